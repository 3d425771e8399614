"""broker/stats.py's windows and per-env outcomes, and the broker's views (Broker.snapshot / _sample) fed with
real protocol messages, as the dashboard's points (broker/sinks.py) and /metrics (broker/prometheus.py) show them.

    .venv/bin/python -m pytest tests/broker/test_stats.py -q -p no:cacheprovider
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agentstream.config import Config
from agentstream.wire.messages import EngineStatus, Hello, Stats
from broker import prometheus, sinks
from broker.server import Broker
from broker.spec import broker_spec
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
    book.report(
        "a0",
        "actor",
        {
            f"env/{LAKE}/episodes": 6,
            f"env/{LAKE}/episode_return_sum": 2.0,
            f"env/{LAKE}/successes": 1,
            f"env/{LAKE}/env_steps": 40,
            f"env/{LAKE}/invalid_actions": 10,
        },
        {},
        False,
    )
    book.hello("a0", "actor", 1, 2, "")  # restarted: counters from zero under a new incarnation
    book.report(
        "a0",
        "actor",
        {
            f"env/{LAKE}/episodes": 2,
            f"env/{LAKE}/episode_return_sum": 3.0,
            f"env/{LAKE}/successes": 1,
            f"env/{LAKE}/env_steps": 10,
        },
        {},
        False,
    )
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
    assert out["taxi"] == {
        "episodes": 1.0,
        "successes": 0.0,
        "env_steps": 0.0,
        "reward_mean": -4.0,
        "success_rate": 0.0,
        "invalid_action_ratio": 0.0,
    }


# ------------------------------------------------------------------------------------------ the broker's views


async def test_broker_views_from_real_messages(tmp_path: Path) -> None:
    cfg = Config()
    cfg.broker.logger = ["jsonl"]
    broker = Broker(broker_spec(cfg), 0, 0, run_name="r", run_dir=tmp_path)
    broker.sinks = sinks.open_sinks(cfg.broker, tmp_path)
    await broker.handle(b"actor-0", Hello(role="actor", name="actor-0", incarnation=1, pid=42))
    await broker.handle(b"engine-0", Hello(role="engine", name="engine-0", address="http://h:8000", pid=7))
    await broker.handle(b"engine-0", EngineStatus(engine="engine-0", url="http://h:8000", version=0))
    lake = f"env/{LAKE}/"
    await broker.handle(
        b"actor-0",
        Stats(
            source="actor-0",
            role="actor",
            counters={
                "episodes": 1,
                "env_steps": 4,
                lake + "episodes": 1,
                lake + "env_steps": 4,
                lake + "episode_return_sum": 0.0,
            },
            gauges={"episodes_in_flight": 8, "requests_in_flight": 3, "policy_version": 0},
        ),
    )
    await broker.handle(
        b"engine-0",
        Stats(
            source="engine-0",
            role="engine",
            counters={"weight_updates": 0},
            gauges={"version": 0, "weight_sync_s": 0.125, "requests_in_flight": 5},
        ),
    )
    broker._sample()
    await broker.handle(
        b"actor-0",
        Stats(
            source="actor-0",
            role="actor",
            counters={
                "episodes": 3,
                "env_steps": 12,
                lake + "episodes": 3,
                lake + "env_steps": 12,
                lake + "successes": 1,
                lake + "episode_return_sum": 1.0,
                lake + "invalid_actions": 2,
            },
            gauges={"episodes_in_flight": 6, "requests_in_flight": 1, "policy_version": 0},
        ),
    )
    broker._sample()
    snap = broker.snapshot()
    assert snap["actors"] == [
        {
            "name": "actor-0",
            "address": "pid 42",
            "incarnation": 1,
            "alive": True,
            "episodes_in_flight": 6,
            "requests_in_flight": 1,
            "env_steps_hung": 0,
            "version": 0,
            "last_seen_s": snap["actors"][0]["last_seen_s"],
        }
    ]
    engine = snap["engines"][0]
    assert (engine["address"], engine["requests_in_flight"], engine["weight_sync_s"], engine["alive"]) == (
        "http://h:8000",
        5,
        0.125,
        True,
    )
    # Between the two samples: 2 episodes returned 1.0 -> 0.5; 1 success of 2; 2 invalid of 8 steps.
    assert snap["envs"][LAKE]["reward_mean"] == 0.5 and snap["envs"][LAKE]["success_rate"] == 0.5
    assert snap["envs"][LAKE]["invalid_action_ratio"] == 0.25
    assert snap["gauges"]["engines_alive"] == 1 and snap["gauges"]["weight_sync_s"] == 0.125
    assert len(broker.history) == 2 and snap["recent"] == list(broker.history)
    assert snap["recent"][-1][f"reward_mean/{LAKE}"] == 0.5
    broker._close_sinks()  # writes the final point, then closes
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(lines) == 3 and lines[:2] == list(broker.history)[:2]
    text = prometheus.render_prometheus(broker.snapshot()).decode()
    assert f'agentstream_env_success_rate{{env="{LAKE}"}} 0.5' in text
    assert 'agentstream_actor_requests_in_flight{actor="actor-0"} 1.0' in text


async def test_llm_judge_counters_reach_the_dashboard_the_metrics_and_the_summary(tmp_path: Path) -> None:
    """An actor's judge counters (actors/judge.py) as the views show them."""
    broker = Broker(broker_spec(Config()), 0, 0, run_name="r", run_dir=tmp_path)
    await broker.handle(b"actor-0", Hello(role="actor", name="actor-0", incarnation=0, pid=42))

    async def report(requests: int, failures: int, errors: int, latency_sum: float, answered: int) -> None:
        await broker.handle(
            b"actor-0",
            Stats(
                source="actor-0",
                role="actor",
                counters={
                    "episodes": requests,
                    "judge_requests": requests,
                    "judge_parsed": requests - failures - errors,
                    "judge_parse_failures": failures,
                    "judge_errors": errors,
                    "judge_score_sum": 0.5 * requests,
                    "judge_latency_s_sum": latency_sum,
                    "judge_latency_count": answered,
                },
                gauges={},
            ),
        )
        broker._sample()

    await report(2, 1, 0, 1.0, 2)
    await report(6, 2, 1, 4.0, 5)
    snap = broker.snapshot()
    # Between the samples 3 more requests were answered in 3.0 more seconds: a mean of 1.0 s.
    assert snap["gauges"]["judge_latency_s"] == 1.0
    point = snap["recent"][-1]
    assert (
        point["judge_latency_s"],
        point["judge_requests"],
        point["judge_parse_failures"],
        point["judge_errors"],
    ) == (1.0, 6.0, 2.0, 1.0)
    # The run: 6 requests = 3 parsed + 2 parse failures + 1 error; 4.0 s over 5 answered; scores 0.5 x 6 / 6.
    assert broker.summary()["judges"] == {
        "requests": 6,
        "parsed": 3,
        "parse_failures": 2,
        "errors": 1,
        "latency_mean_s": 0.8,
        "score_mean": 0.5,
    }
    text = prometheus.render_prometheus(snap).decode()
    assert "agentstream_judge_parse_failures_total 2.0" in text and "agentstream_judge_latency_s 1.0" in text
    assert "# HELP agentstream_judge_errors_total Judge requests that failed or timed out" in text
