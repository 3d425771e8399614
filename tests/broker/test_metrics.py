"""broker/metrics.py (points, sinks), broker/stats.py's windows and per-env outcomes, and the broker's views
(Broker.snapshot / _sample) fed with real protocol messages; about a second in all.

    .venv/bin/python -m pytest tests/broker/test_metrics.py -q -p no:cacheprovider
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
from e2e_testing import read_tensorboard

from agentstream.config import BrokerConfig, Config
from broker import metrics
from broker.protocol import EngineStatus, Hello, Stats
from broker.server import Broker
from broker.stats import StatsBook, env_outcomes

LAKE = "agentstream/FrozenLake-v0"


# ------------------------------------------------------------------------------------------ StatsBook


def test_windows_use_the_oldest_sample_inside_them() -> None:
    book = StatsBook()
    for t in range(71):  # a counter growing by 2 per second, sampled once a second
        book.sample({"x": 2.0 * t}, now=1000.0 + t)
    # 10 s window: samples at t=60 and t=70 -> (140 - 120) / 10 = 2 per second.
    assert book.rate("x") == pytest.approx(2.0)
    # 60 s window: from t=10 (x=20) to t=70 (x=140): 120.
    assert book.window_delta("x", 60.0) == pytest.approx(120.0)
    # Samples older than the longest window are dropped (but one just outside stays as an anchor).
    assert len(book._samples) <= 62


def test_env_outcomes_sum_actors_and_incarnations_per_env() -> None:
    book = StatsBook()
    book.hello("a0", "actor", 0, 1, "")
    book.report("a0", "actor", {f"env/{LAKE}/episodes": 2, f"env/{LAKE}/episode_return_sum": 1.0}, {}, False)
    book.sample(book.env_totals(), now=0.0)
    book.report("a0", "actor", {f"env/{LAKE}/episodes": 6, f"env/{LAKE}/episode_return_sum": 2.0,
                                f"env/{LAKE}/successes": 1, f"env/{LAKE}/env_steps": 40,
                                f"env/{LAKE}/invalid_actions": 10}, {}, False)
    book.hello("a0", "actor", 1, 2, "")  # restarted: counters from zero under a new incarnation
    book.report("a0", "actor", {f"env/{LAKE}/episodes": 2, f"env/{LAKE}/episode_return_sum": 3.0,
                                f"env/{LAKE}/successes": 1, f"env/{LAKE}/env_steps": 10}, {}, False)
    book.hello("a1", "actor", 0, 3, "")
    book.report("a1", "actor", {"env/taxi/episodes": 1, "env/taxi/episode_return_sum": -4.0}, {}, False)
    book.sample(book.env_totals(), now=10.0)
    out = env_outcomes(book)
    # lake: episodes 6 + 2 = 8 in all; in the window 8 - 2 = 6 episodes returned (2 + 3) - 1 = 4 -> 4/6;
    # successes 2/6; invalid 10 of 50 steps = 0.2.
    assert out[LAKE]["episodes"] == 8 and out[LAKE]["env_steps"] == 50
    assert out[LAKE]["reward_mean"] == pytest.approx(4 / 6)
    assert out[LAKE]["success_rate"] == pytest.approx(2 / 6)
    assert out[LAKE]["invalid_action_ratio"] == pytest.approx(0.2)
    # taxi: one episode of -4, no steps reported: ratio 0.0 (no step in the window), not a division by zero.
    assert out["taxi"] == {"episodes": 1.0, "successes": 0.0, "env_steps": 0.0, "reward_mean": -4.0,
                           "success_rate": 0.0, "invalid_action_ratio": 0.0}


# ------------------------------------------------------------------------------------------ points


def test_flatten_names_one_key_per_series_and_nulls_non_finite_values() -> None:
    state = {
        "time": 50.0, "rates": {"env_steps_per_s": 3.0, "tokens_per_s": math.inf},
        "gauges": {"buffered_transitions": 7.0, "staleness_mean": math.nan}, "learner": {"version": 2, "loss": 0.5},
        "engines": [{"name": "engine-0", "version": 2, "weight_sync_s": 0.25}],
        "envs": {LAKE: {"reward_mean": 0.5, "success_rate": 0.25, "invalid_action_ratio": 0.0}},
    }
    p = metrics.flatten(state)
    assert p["t"] == 50.0 and p["env_steps_per_s"] == 3.0 and p["learner_version"] == 2.0
    assert p["tokens_per_s"] is None and p["staleness_mean"] is None and p["learner_step_time_s"] is None
    assert p["engine_version/engine-0"] == 2.0 and p["weight_sync_s/engine-0"] == 0.25
    assert p[f"reward_mean/{LAKE}"] == 0.5 and p[f"success_rate/{LAKE}"] == 0.25
    json.dumps(p, allow_nan=False)  # valid JSON as it stands


# ------------------------------------------------------------------------------------------ sinks


def test_jsonl_and_tensorboard_sinks_hold_the_same_points(tmp_path: Path) -> None:
    sinks = metrics.open_sinks(BrokerConfig(), tmp_path)
    assert [type(s).__name__ for s in sinks] == ["JsonlSink", "TensorBoardSink"]
    points = [{"t": 100.0, "env_steps_per_s": 1.5, "learner_version": 0.0, "learner_loss": None},
              {"t": 101.0, "env_steps_per_s": 2.5, "learner_version": 1.0, "learner_loss": 0.25},
              {"t": 103.0, "env_steps_per_s": 4.0, "learner_version": 1.0, "learner_loss": 0.125}]
    for p in points:
        for sink in sinks:
            sink.write(p)
    for sink in sinks:
        sink.close()
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == points
    tb = read_tensorboard(tmp_path / "tensorboard")
    # Steps are whole seconds since the first point: 0, 1, 3. A None (no value yet) is left out.
    assert tb["env_steps_per_s"] == [(0, 1.5), (1, 2.5), (3, 4.0)]
    assert tb["learner_loss"] == [(1, 0.25), (3, 0.125)]
    assert "t" not in tb


def test_no_run_folder_no_files_and_wandb_needs_its_package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert metrics.open_sinks(BrokerConfig(), None) == []
    off = BrokerConfig(metrics_jsonl=False, tensorboard=False)
    assert metrics.open_sinks(off, tmp_path) == [] and list(tmp_path.iterdir()) == []
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed: `import wandb` raises ImportError
    with pytest.raises(RuntimeError, match=r"broker.wandb_project='p' is set but wandb is not installed: `pip install wandb`"):
        metrics.open_sinks(BrokerConfig(wandb_project="p", metrics_jsonl=False, tensorboard=False), tmp_path)


# ------------------------------------------------------------------------------------------ the broker's views


async def test_broker_views_from_real_messages(tmp_path: Path) -> None:
    cfg = Config()
    cfg.broker.tensorboard = False
    broker = Broker(cfg, 0, 0, run_name="r", run_dir=tmp_path)
    broker.sinks = metrics.open_sinks(cfg.broker, tmp_path)
    await broker.handle(b"actor-0", Hello(role="actor", name="actor-0", incarnation=1, pid=42))
    await broker.handle(b"engine-0", Hello(role="engine", name="engine-0", address="http://h:8000", pid=7))
    await broker.handle(b"engine-0", EngineStatus(engine="engine-0", url="http://h:8000", version=0))
    lake = f"env/{LAKE}/"
    await broker.handle(b"actor-0", Stats(source="actor-0", role="actor", counters={
        "episodes": 1, "env_steps": 4, lake + "episodes": 1, lake + "env_steps": 4, lake + "episode_return_sum": 0.0},
        gauges={"episodes_in_flight": 8, "requests_in_flight": 3, "policy_version": 0}))
    await broker.handle(b"engine-0", Stats(source="engine-0", role="engine", counters={"weight_updates": 0},
                                           gauges={"version": 0, "weight_sync_s": 0.125, "requests_in_flight": 5}))
    broker._sample()
    await broker.handle(b"actor-0", Stats(source="actor-0", role="actor", counters={
        "episodes": 3, "env_steps": 12, lake + "episodes": 3, lake + "env_steps": 12, lake + "successes": 1,
        lake + "episode_return_sum": 1.0, lake + "invalid_actions": 2},
        gauges={"episodes_in_flight": 6, "requests_in_flight": 1, "policy_version": 0}))
    broker._sample()
    snap = broker.snapshot()
    assert snap["actors"] == [{"name": "actor-0", "address": "pid 42", "incarnation": 1, "alive": True,
                               "episodes_in_flight": 6, "requests_in_flight": 1, "version": 0,
                               "last_seen_s": snap["actors"][0]["last_seen_s"]}]
    engine = snap["engines"][0]
    assert (engine["address"], engine["requests_in_flight"], engine["weight_sync_s"], engine["alive"]) == (
        "http://h:8000", 5, 0.125, True)
    # Between the two samples: 2 episodes returned 1.0 -> 0.5; 1 success of 2; 2 invalid of 8 steps.
    assert snap["envs"][LAKE]["reward_mean"] == 0.5 and snap["envs"][LAKE]["success_rate"] == 0.5
    assert snap["envs"][LAKE]["invalid_action_ratio"] == 0.25
    assert snap["gauges"]["engines_alive"] == 1 and snap["gauges"]["weight_sync_s"] == 0.125
    assert len(broker.history) == 2 and snap["recent"] == list(broker.history)
    assert snap["recent"][-1][f"reward_mean/{LAKE}"] == 0.5
    broker._close_sinks()  # writes the final point, then closes
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(lines) == 3 and lines[:2] == list(broker.history)[:2]
    text = metrics.render_prometheus(broker.snapshot()).decode()
    assert f'agentstream_env_success_rate{{env="{LAKE}"}} 0.5' in text
    assert 'agentstream_actor_requests_in_flight{actor="actor-0"} 1.0' in text
