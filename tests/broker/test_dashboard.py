"""Dashboard HTTP routes (broker/dashboard.py), /metrics (broker/prometheus.py), the broker's
views (Broker.snapshot) and StatsBook's windows, against hand-made inputs; each test runs well under a second
(the page itself runs in Chromium in tests/test_dashboard_browser.py).

    .venv/bin/python -m pytest tests/broker/test_dashboard.py -q
"""

from __future__ import annotations

import asyncio
import copy
import json
import logging
import math
import re
import socket
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client.parser import text_string_to_metric_families

from broker.dashboard import make_app, serve

SNAPSHOT: dict[str, Any] = {
    "time": 1_700_000_000.5,
    "run": {"name": "frozenlake-grpo", "status": "running", "reason": "", "wall_s": 125.0, "total_steps": 200},
    "learner": {"version": 7, "step_time_s": 2.5, "loss": 0.125, "publish_s": 0.5},
    "engines": [
        {
            "name": "engine-0",
            "url": "http://127.0.0.1:8000",
            "version": 6,
            "alive": True,
            "last_seen_s": 0.4,
            "requests_in_flight": 12,
            "weight_sync_s": 0.25,
        },
        {
            "name": "engine-1",
            "url": "http://127.0.0.1:8001",
            "version": 7,
            "alive": False,
            "last_seen_s": 12.0,
            "requests_in_flight": -1,
            "weight_sync_s": 0.5,
        },
    ],
    "actors": [
        {
            "name": "actor-0",
            "incarnation": 0,
            "alive": True,
            "episodes_in_flight": 8,
            "last_seen_s": 0.2,
            "requests_in_flight": 5,
            "version": 6,
        },
        {
            "name": "actor-1",
            "incarnation": 2,
            "alive": False,
            "episodes_in_flight": 0,
            "last_seen_s": 30.0,
            "requests_in_flight": 0,
            "version": 4,
        },
        {
            "name": 'actor "2"',
            "incarnation": 1,
            "alive": True,
            "episodes_in_flight": 3,
            "last_seen_s": 0.9,
            "requests_in_flight": 1,
            "version": 7,
        },
    ],
    "envs": {
        "agentstream/FrozenLake-v0": {
            "episodes": 280.0,
            "successes": 40.0,
            "env_steps": 2000.0,
            "reward_mean": 0.125,
            "success_rate": 0.25,
            "invalid_action_ratio": 0.5,
        },
        "taxi": {
            "episodes": 20.0,
            "successes": 5.0,
            "env_steps": 300.0,
            "reward_mean": -1.5,
            "success_rate": 0.0,
            "invalid_action_ratio": 0.0,
        },
    },
    "rates": {
        "env_steps_per_s": 41.5,
        "tokens_per_s": 1234.0,
        "transitions_per_s": 40.0,
        "learner_samples_per_s": 32.0,
        "learner_steps_per_s": 0.25,
    },
    "counters": {
        "transitions_ingested": 5000,
        "transitions_trained": 4800,
        "transitions_dropped_stale": 12,
        "episodes": 300,
        "successes": 45,
        "weird-name.x": 3,
    },
    "gauges": {
        "buffered_transitions": 188,
        "groups_ready": 2,
        "staleness_mean": 0.75,
        "staleness_max": 2,
        "reward_mean": 0.15,
        "success_rate": 0.15,
        "invalid_action_ratio": 0.05,
    },
    "staleness_hist": {"0": 1200, "1": 2400, "2": 1200},
}


@pytest.fixture
async def client() -> AsyncIterator[TestClient]:
    async with TestClient(TestServer(make_app(lambda: SNAPSHOT, history_s=10))) as c:
        yield c


class CountingState:
    """A state_fn whose learner version and time advance by one per call; remembers what it returned."""

    def __init__(self) -> None:
        self.returned: list[dict[str, Any]] = []

    def __call__(self) -> dict[str, Any]:
        n = len(self.returned)
        snap = copy.deepcopy(SNAPSHOT)
        snap["time"] += n
        snap["learner"]["version"] = n
        snap["counters"]["transitions_ingested"] = 100 * n
        self.returned.append(snap)
        return snap


async def read_events(resp: aiohttp.ClientResponse, n: int) -> list[dict[str, Any]]:
    events = []
    while len(events) < n:
        line = await asyncio.wait_for(resp.content.readline(), timeout=5)
        assert line, "stream ended early"
        if line.startswith(b"data: "):
            events.append(json.loads(line[len(b"data: ") :]))
    return events


# ------------------------------------------------------------------------------------------ /api/state


async def test_state_returns_the_snapshot(client: TestClient) -> None:
    resp = await client.get("/api/state")
    assert resp.status == 200 and resp.content_type == "application/json"
    assert await resp.json() == SNAPSHOT


async def test_state_turns_non_finite_floats_into_null() -> None:
    snap = copy.deepcopy(SNAPSHOT)
    snap["learner"]["loss"] = math.nan
    snap["gauges"]["staleness_max"] = math.inf
    async with TestClient(TestServer(make_app(lambda: snap))) as c:
        body = await (await c.get("/api/state")).text()
    parsed = json.loads(body)  # strict enough: Python's parser would accept NaN, so check the text too
    assert "NaN" not in body and "Infinity" not in body
    assert parsed["learner"]["loss"] is None and parsed["gauges"]["staleness_max"] is None


# ------------------------------------------------------------------------------------------ /metrics

SAMPLE_RE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)$")
LABEL_RE = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\\n]|\\[\\"n])*)"')


def parse_prometheus(text: str) -> dict[str, dict[str, Any]]:
    """Strict reader of text format 0.0.4 as /metrics writes it: {family: {type, help, samples}}."""
    assert text.endswith("\n")
    families: dict[str, dict[str, Any]] = {}
    current = None
    for line in text.splitlines():
        if line.startswith(("# HELP ", "# TYPE ")):
            _, word, name, rest = line.split(" ", 3)
            assert re.fullmatch(r"[a-zA-Z_:][a-zA-Z0-9_:]*", name), line
            fam = families.setdefault(name, {"samples": {}})
            assert word.lower() not in fam, f"second {word} for {name}"
            assert not fam["samples"], f"{word} after samples of {name}"
            fam[word.lower()], current = rest, name
            continue
        match = SAMPLE_RE.match(line)
        assert match, f"not a sample line: {line!r}"
        name, label_text, value = match.groups()
        assert name == current, f"sample {name} outside its family block"
        labels = tuple(LABEL_RE.findall(label_text or ""))
        assert ",".join(f'{k}="{v}"' for k, v in labels) == (label_text or ""), line
        unescaped = tuple((k, v.replace('\\"', '"').replace("\\n", "\n").replace("\\\\", "\\")) for k, v in labels)
        assert unescaped not in families[name]["samples"], f"duplicate series {line!r}"
        families[name]["samples"][unescaped] = float(value)  # float() reads NaN, +Inf, -Inf too
    for name, fam in families.items():
        assert fam.get("type") in {"counter", "gauge"}, f"{name} has no TYPE line"
        assert fam.get("help"), f"{name} has no HELP line"
        assert fam["type"] != "counter" or name.endswith("_total"), name
        assert name.startswith("agentstream_") and fam["samples"], name
    return families


async def test_metrics_is_valid_prometheus_text_with_the_snapshot_values(client: TestClient) -> None:
    resp = await client.get("/metrics")
    assert resp.status == 200
    assert resp.headers["Content-Type"] == "text/plain; version=0.0.4; charset=utf-8"
    fams = parse_prometheus(await resp.text())

    def value(name: str, **labels: str) -> float:
        return fams[name]["samples"][tuple(sorted(labels.items()))]

    # Counters get `_total`; "weird-name.x" has its '-' and '.' replaced by '_'.
    assert fams["agentstream_transitions_ingested_total"]["type"] == "counter"
    assert value("agentstream_transitions_ingested_total") == 5000
    assert value("agentstream_transitions_dropped_stale_total") == 12
    assert value("agentstream_weird_name_x_total") == 3
    # Gauges and rates keep their names.
    assert fams["agentstream_staleness_mean"]["type"] == "gauge"
    assert value("agentstream_staleness_mean") == 0.75
    assert value("agentstream_buffered_transitions") == 188
    assert value("agentstream_env_steps_per_s") == 41.5
    assert value("agentstream_learner_steps_per_s") == 0.25
    assert value("agentstream_learner_version") == 7
    assert value("agentstream_engine_version", engine="engine-0") == 6
    assert value("agentstream_engine_version", engine="engine-1") == 7
    # actor-0 and 'actor "2"' are alive, actor-1 is not: 2 alive (no actors_alive gauge in this snapshot).
    assert value("agentstream_actor_alive", actor="actor-0") == 1
    assert value("agentstream_actor_alive", actor="actor-1") == 0
    assert value("agentstream_actor_alive", actor='actor "2"') == 1
    assert value("agentstream_actors_alive") == 2
    assert value("agentstream_staleness_count", lag="1") == 2400
    assert "policy lag" in fams["agentstream_staleness_mean"]["help"]  # a real description, not the fallback
    # Labelled families from the new snapshot fields.
    assert value("agentstream_engine_requests_in_flight", engine="engine-0") == 12
    assert value("agentstream_engine_requests_in_flight", engine="engine-1") == -1
    assert value("agentstream_engine_weight_sync_s", engine="engine-1") == 0.5
    assert value("agentstream_actor_requests_in_flight", actor="actor-0") == 5
    assert value("agentstream_actor_policy_version", actor='actor "2"') == 7
    assert value("agentstream_env_reward_mean", env="taxi") == -1.5
    assert value("agentstream_env_success_rate", env="agentstream/FrozenLake-v0") == 0.25
    assert value("agentstream_env_episodes_total", env="agentstream/FrozenLake-v0") == 280
    assert fams["agentstream_env_episodes_total"]["type"] == "counter"
    assert value("agentstream_learner_samples_per_s") == 32
    assert value("agentstream_learner_publish_s") == 0.5


async def test_metrics_prefers_the_reported_actors_alive_gauge_and_writes_nan() -> None:
    snap = copy.deepcopy(SNAPSHOT)
    snap["gauges"]["actors_alive"] = 5  # the broker's own count wins over counting the list (2)
    snap["learner"]["loss"] = math.nan
    snap["actors"], snap["engines"], snap["staleness_hist"], snap["envs"] = [], [], {}, {}
    async with TestClient(TestServer(make_app(lambda: snap))) as c:
        fams = parse_prometheus(await (await c.get("/metrics")).text())
    assert fams["agentstream_actors_alive"]["samples"] == {(): 5.0}
    assert math.isnan(fams["agentstream_learner_loss"]["samples"][()])
    assert "agentstream_actor_alive" not in fams and "agentstream_engine_version" not in fams  # no empty families
    assert "agentstream_env_reward_mean" not in fams and "agentstream_staleness_count" not in fams


async def test_metrics_parse_with_prometheus_client(client: TestClient) -> None:
    text = await (await client.get("/metrics")).text()
    fams = {f.name: f for f in text_string_to_metric_families(text)}  # the library's own reader
    assert fams["agentstream_transitions_ingested"].type == "counter"  # the parser strips `_total`
    assert fams["agentstream_transitions_ingested"].samples[0].value == 5000
    assert {s.labels["engine"]: s.value for s in fams["agentstream_engine_version"].samples} == {
        "engine-0": 6,
        "engine-1": 7,
    }
    assert {s.labels["env"]: s.value for s in fams["agentstream_env_reward_mean"].samples} == {
        "agentstream/FrozenLake-v0": 0.125,
        "taxi": -1.5,
    }
    assert all(f.documentation and f.type in ("counter", "gauge") for f in fams.values())


# ------------------------------------------------------------------------------------------ /api/stream


async def test_stream_pushes_successive_snapshots() -> None:
    state = CountingState()
    async with TestClient(TestServer(make_app(state, stream_interval_s=0.02))) as c:
        resp = await c.get("/api/stream")
        assert resp.headers["Content-Type"] == "text/event-stream"
        events = await read_events(resp, 2)
        resp.close()
    assert events == state.returned[:2]
    assert [e["learner"]["version"] for e in events] == [0, 1]


async def test_stream_stops_when_the_client_leaves(caplog: pytest.LogCaptureFixture) -> None:
    state = CountingState()
    async with TestClient(TestServer(make_app(state, stream_interval_s=0.01))) as c:
        resp = await c.get("/api/stream")
        await read_events(resp, 1)
        resp.close()
        await asyncio.sleep(0.15)  # the server notices at its next write, one interval later
        calls = len(state.returned)
        await asyncio.sleep(0.15)
        assert len(state.returned) == calls, "the stream kept polling state_fn after the client left"
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], "disconnect logged as an error"


async def test_shutdown_ends_an_open_stream_at_once() -> None:
    server = TestServer(make_app(CountingState(), stream_interval_s=30))  # a plain sleep would hold for 30 s
    async with TestClient(server) as c:
        resp = await c.get("/api/stream")
        await read_events(resp, 1)
        start = time.monotonic()
        await asyncio.wait_for(server.close(), timeout=5)
        assert time.monotonic() - start < 2
        rest = await asyncio.wait_for(resp.content.read(), timeout=2)
        assert rest.strip() == b""  # the blank line closing the first event, then the end: no more events


# ------------------------------------------------------------------------------------------ page, serve()

VENDOR = Path(__file__).resolve().parents[2] / "broker" / "static" / "vendor"


async def test_page_loads_only_the_vendored_chart_library_from_the_broker(client: TestClient) -> None:
    resp = await client.get("/")
    assert resp.status == 200 and resp.content_type == "text/html"
    html = await resp.text()
    for element_id in ["charts", "actors-table", "engines-table", "badge-conn", "tile-version", "gallery"]:
        assert f'id="{element_id}"' in html
    assert "window.agentstreamDashboard" in html and "EventSource" in html and "api/history" in html
    assert '<meta name="history-s" content="10.0">' in html  # make_app's history_s reached the page
    assert not re.search(r"https?://", html), "the page must not name any URL"
    loads = re.findall(r"""(?:src|href)\s*=\s*["']([^"']*)["']""", html)
    assert sorted(loads) == ["static/vendor/uPlot.iife.min.js", "static/vendor/uPlot.min.css"]
    for path in loads:  # served by the broker itself, byte for byte the vendored files
        got = await client.get("/" + path)
        assert got.status == 200 and await got.read() == (VENDOR / Path(path).name).read_bytes()
    js = (VENDOR / "uPlot.iife.min.js").read_text()
    assert js.startswith("/*! https://github.com/leeoniya/uPlot (v1.6.32) */")  # the version README names
    assert "MIT License" in (VENDOR / "uPlot.LICENSE").read_text()
    assert (await client.get("/static/vendor/../dashboard.html")).status in (403, 404)  # nothing else served


async def test_history_returns_the_kept_points_as_json() -> None:
    points = [{"t": 1.0, "env_steps_per_s": 2.5}, {"t": 2.0, "env_steps_per_s": math.nan}]
    async with TestClient(TestServer(make_app(lambda: SNAPSHOT, history_fn=lambda: points))) as c:
        got = await (await c.get("/api/history")).json()
        assert got == {"points": [{"t": 1.0, "env_steps_per_s": 2.5}, {"t": 2.0, "env_steps_per_s": None}]}
    async with TestClient(TestServer(make_app(lambda: SNAPSHOT))) as c:  # no history kept: an empty list
        assert await (await c.get("/api/history")).json() == {"points": []}


async def test_serve_binds_and_reports_a_taken_port_by_its_config_key() -> None:
    runner = await serve(make_app(lambda: SNAPSHOT), "127.0.0.1", 0)
    try:
        host, port = runner.addresses[0][:2]
        async with aiohttp.ClientSession() as session, session.get(f"http://{host}:{port}/api/state") as resp:
            assert (await resp.json())["learner"]["version"] == 7
        with pytest.raises(OSError, match=rf"port {port} .*broker\.dashboard_port"):
            await serve(make_app(lambda: SNAPSHOT), "127.0.0.1", port)
    finally:
        await runner.cleanup()
    with socket.socket() as s:  # and the port is free again after cleanup
        s.bind(("127.0.0.1", port))
