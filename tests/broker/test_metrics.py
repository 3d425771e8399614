"""broker/metrics.py (points, sinks), broker/stats.py's windows and per-env outcomes, and the broker's views
(Broker.snapshot / _sample) fed with real protocol messages. Each sink writes three points to a run folder and
they are read back with the tracker's own reader; the W&B and MLflow ones take a few seconds (imports, wandb's
service process).

    .venv/bin/python -m pytest tests/broker/test_metrics.py -q -p no:cacheprovider
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
from e2e_testing import read_mlflow, read_tensorboard, read_wandb

from agentstream.config import BrokerConfig, Config
from agentstream.wire.messages import EngineStatus, Hello, Stats
from broker import metrics
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


POINTS = [{"t": 100.0, "env_steps_per_s": 1.5, "learner_version": 0.0, "learner_loss": None},
          {"t": 101.0, "env_steps_per_s": 2.5, "learner_version": 1.0, "learner_loss": 0.25},
          {"t": 103.0, "env_steps_per_s": 4.0, "learner_version": 1.0, "learner_loss": 0.125,
           "reward_mean": 0.75, f"reward_mean/{LAKE}": 0.5}]


def write_points(cfg: BrokerConfig, run_dir: Path, run_name: str = "") -> list[str]:
    """Open the sinks `cfg` names on `run_dir`, write POINTS to each, close them; their class names."""
    sinks = metrics.open_sinks(cfg, run_dir, run_name)
    for p in POINTS:
        for sink in sinks:
            sink.write(p)
    for sink in sinks:
        sink.close()
    return [type(s).__name__ for s in sinks]


@pytest.fixture
def tracker_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No tracker setting of the user's reaches the test: wandb offline, MLflow in the run folder. What the
    sinks set themselves (MLFLOW_ALLOW_FILE_STORE) is undone afterwards."""
    for name in ("WANDB_MODE", "WANDB_API_KEY", "MLFLOW_TRACKING_URI", "MLFLOW_ALLOW_FILE_STORE"):
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)


def test_jsonl_and_tensorboard_sinks_hold_the_same_points(tmp_path: Path) -> None:
    assert write_points(BrokerConfig(), tmp_path) == ["JsonlSink", "TensorBoardSink"]  # the default
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == POINTS
    tb = read_tensorboard(tmp_path / "tensorboard")
    # Steps are whole seconds since the first point: 0, 1, 3. A None (no value yet) is left out.
    assert tb["env_steps_per_s"] == [(0, 1.5), (1, 2.5), (3, 4.0)]
    assert tb["learner_loss"] == [(1, 0.25), (3, 0.125)]
    assert tb["reward_mean"] == [(3, 0.75)] and tb[f"reward_mean/{LAKE}"] == [(3, 0.5)]
    assert "t" not in tb


def test_wandb_sink_logs_an_offline_run_in_the_run_folder(tmp_path: Path, tracker_env: None) -> None:
    assert write_points(BrokerConfig(logger=["wandb"], project="proj"), tmp_path, "run-a") == ["WandbSink"]
    run, history = read_wandb(tmp_path / "wandb")
    assert (run["display_name"], run["project"]) == ("run-a", "proj")
    # One history row per point, step = the point's index; a None is left out, and so is `t`.
    assert history["env_steps_per_s"] == [(0, 1.5), (1, 2.5), (2, 4.0)]
    assert history["learner_version"] == [(0, 0.0), (1, 1.0), (2, 1.0)]
    assert history["learner_loss"] == [(1, 0.25), (2, 0.125)]
    assert history["reward_mean"] == [(2, 0.75)] and history[f"reward_mean/{LAKE}"] == [(2, 0.5)]
    assert "t" not in history
    assert list(tmp_path.iterdir()) == [tmp_path / "wandb"]


def test_mlflow_sink_logs_a_run_in_the_run_folders_file_store(tmp_path: Path, tracker_env: None) -> None:
    assert write_points(BrokerConfig(logger=["mlflow"], project="proj"), tmp_path, "run-a") == ["MlflowSink"]
    run, history = read_mlflow((tmp_path / "mlruns").as_uri(), "proj")
    assert run.info.run_name == "run-a" and run.info.status == "FINISHED"
    assert history["env_steps_per_s"] == [(0, 1.5), (1, 2.5), (2, 4.0)]
    assert history["learner_version"] == [(0, 0.0), (1, 1.0), (2, 1.0)]
    assert history["learner_loss"] == [(1, 0.25), (2, 0.125)]
    # `/` becomes `.`: the file store could not keep both reward_mean and reward_mean/<env> (a file and a folder)
    assert history["reward_mean"] == [(2, 0.75)] and history["reward_mean.agentstream.FrozenLake-v0"] == [(2, 0.5)]
    assert "t" not in history


def test_mlflow_keys_are_names_mlflow_takes() -> None:
    assert metrics.mlflow_key(f"reward_mean/{LAKE}") == "reward_mean.agentstream.FrozenLake-v0"
    assert metrics.mlflow_key("success_rate/env=1 (hard)") == "success_rate.env_1 _hard_"
    assert metrics.mlflow_key("../a") == "a" and metrics.mlflow_key("/") == "_"


def test_a_tracker_that_fails_is_reported_by_write_and_close(tmp_path: Path, tracker_env: None,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "nosuchscheme://host/x")  # MLflow has no store for it
    [sink] = metrics.open_sinks(BrokerConfig(logger=["mlflow"]), tmp_path, "r")
    sink._thread.join(60)  # opening failed on the sink's thread
    with pytest.raises(OSError, match=r"^mlflow: .*nosuchscheme"):
        sink.write(POINTS[0])  # the broker drops a sink whose write raises OSError
    with pytest.raises(OSError, match=r"^mlflow: "):
        sink.close()


def test_an_unknown_logger_is_refused_with_the_known_ones(tmp_path: Path) -> None:
    text = ("broker.logger: 'neptune' is not a logger; the loggers are jsonl, tensorboard, wandb, mlflow "
            "(e.g. logger=[jsonl,wandb]).")
    assert metrics.logger_errors(["jsonl", "neptune"]) == [text]
    with pytest.raises(ValueError) as err:
        metrics.open_sinks(BrokerConfig(logger=["jsonl", "neptune"]), tmp_path)
    assert str(err.value) == text
    assert list(tmp_path.iterdir()) == []  # nothing opened
    assert metrics.logger_errors(["wandb", "jsonl", "wandb"]) == [
        "broker.logger lists 'wandb' 2 times; list each logger once."]
    assert metrics.logger_errors(["jsonl", "tensorboard", "wandb", "mlflow"]) == metrics.logger_errors([]) == []


def test_no_run_folder_no_files_and_a_missing_package_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert metrics.open_sinks(BrokerConfig(), None) == []
    assert metrics.open_sinks(BrokerConfig(logger=[]), tmp_path) == [] and list(tmp_path.iterdir()) == []
    monkeypatch.setitem(metrics.LOGGERS, "wandb", "agentstream_not_installed")  # as if wandb were not installed
    text = ("broker.logger has wandb, but the agentstream_not_installed package is not installed: run bash "
            "scripts/setup.sh, or leave wandb out of broker.logger.")
    assert metrics.logger_errors(["jsonl", "wandb"]) == [text]
    with pytest.raises(ValueError, match=re.escape(text)):
        metrics.open_sinks(BrokerConfig(logger=["wandb"]), tmp_path)


# ------------------------------------------------------------------------------------------ the broker's views


async def test_broker_views_from_real_messages(tmp_path: Path) -> None:
    cfg = Config()
    cfg.broker.logger = ["jsonl"]
    broker = Broker(broker_spec(cfg), 0, 0, run_name="r", run_dir=tmp_path)
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
                               "episodes_in_flight": 6, "requests_in_flight": 1, "env_steps_hung": 0, "version": 0,
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


async def test_llm_judge_counters_reach_the_dashboard_the_metrics_and_the_summary(tmp_path: Path) -> None:
    """An actor's judge counters (actors/judge.py) as the views show them."""
    broker = Broker(broker_spec(Config()), 0, 0, run_name="r", run_dir=tmp_path)
    await broker.handle(b"actor-0", Hello(role="actor", name="actor-0", incarnation=0, pid=42))

    async def report(requests: int, failures: int, errors: int, latency_sum: float, answered: int) -> None:
        await broker.handle(b"actor-0", Stats(source="actor-0", role="actor", counters={
            "episodes": requests, "judge_requests": requests, "judge_parsed": requests - failures - errors,
            "judge_parse_failures": failures, "judge_errors": errors, "judge_score_sum": 0.5 * requests,
            "judge_latency_s_sum": latency_sum, "judge_latency_count": answered}, gauges={}))
        broker._sample()

    await report(2, 1, 0, 1.0, 2)
    await report(6, 2, 1, 4.0, 5)
    snap = broker.snapshot()
    # Between the samples 3 more requests were answered in 3.0 more seconds: a mean of 1.0 s.
    assert snap["gauges"]["judge_latency_s"] == 1.0
    point = snap["recent"][-1]
    assert (point["judge_latency_s"], point["judge_requests"], point["judge_parse_failures"], point["judge_errors"]) == (
        1.0, 6.0, 2.0, 1.0)
    # The run: 6 requests = 3 parsed + 2 parse failures + 1 error; 4.0 s over 5 answered; scores 0.5 x 6 / 6.
    assert broker.summary()["judges"] == {"requests": 6, "parsed": 3, "parse_failures": 2, "errors": 1,
                                          "latency_mean_s": 0.8, "score_mean": 0.5}
    text = metrics.render_prometheus(snap).decode()
    assert "agentstream_judge_parse_failures_total 2.0" in text and "agentstream_judge_latency_s 1.0" in text
    assert "# HELP agentstream_judge_errors_total Judge requests that failed or timed out" in text
