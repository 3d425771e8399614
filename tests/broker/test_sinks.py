"""broker/sinks.py: the once-a-second points, and the sinks that log them. Each sink writes three points to a run
folder and they are read back with the tracker's own reader; the W&B and MLflow ones take a few seconds (imports,
wandb's service process).

    .venv/bin/python -m pytest tests/broker/test_sinks.py -q -p no:cacheprovider
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
from e2e_testing import read_mlflow, read_tensorboard, read_wandb

from agentstream.config import BrokerConfig
from broker import sinks

LAKE = "agentstream/FrozenLake-v0"


# ------------------------------------------------------------------------------------------ points


def test_flatten_names_one_key_per_series_and_nulls_non_finite_values() -> None:
    state = {
        "time": 50.0,
        "rates": {"env_steps_per_s": 3.0, "tokens_per_s": math.inf},
        "gauges": {"buffered_transitions": 7.0, "staleness_mean": math.nan},
        "learner": {"version": 2, "loss": 0.5},
        "engines": [{"name": "engine-0", "version": 2, "weight_sync_s": 0.25}],
        "envs": {LAKE: {"reward_mean": 0.5, "success_rate": 0.25, "invalid_action_ratio": 0.0}},
    }
    p = sinks.flatten(state)
    assert p["t"] == 50.0 and p["env_steps_per_s"] == 3.0 and p["learner_version"] == 2.0
    assert p["tokens_per_s"] is None and p["staleness_mean"] is None and p["learner_step_time_s"] is None
    assert p["engine_version/engine-0"] == 2.0 and p["weight_sync_s/engine-0"] == 0.25
    assert p[f"reward_mean/{LAKE}"] == 0.5 and p[f"success_rate/{LAKE}"] == 0.25
    json.dumps(p, allow_nan=False)  # valid JSON as it stands


# ------------------------------------------------------------------------------------------ sinks


POINTS = [
    {"t": 100.0, "env_steps_per_s": 1.5, "learner_version": 0.0, "learner_loss": None},
    {"t": 101.0, "env_steps_per_s": 2.5, "learner_version": 1.0, "learner_loss": 0.25},
    {
        "t": 103.0,
        "env_steps_per_s": 4.0,
        "learner_version": 1.0,
        "learner_loss": 0.125,
        "reward_mean": 0.75,
        f"reward_mean/{LAKE}": 0.5,
    },
]


def write_points(cfg: BrokerConfig, run_dir: Path, run_name: str = "") -> list[str]:
    """Open the sinks `cfg` names on `run_dir`, write POINTS to each, close them; their class names."""
    opened = sinks.open_sinks(cfg, run_dir, run_name)
    for p in POINTS:
        for sink in opened:
            sink.write(p)
    for sink in opened:
        sink.close()
    return [type(s).__name__ for s in opened]


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
    assert sinks.mlflow_key(f"reward_mean/{LAKE}") == "reward_mean.agentstream.FrozenLake-v0"
    assert sinks.mlflow_key("success_rate/env=1 (hard)") == "success_rate.env_1 _hard_"
    assert sinks.mlflow_key("../a") == "a" and sinks.mlflow_key("/") == "_"


def test_a_tracker_that_fails_is_reported_by_write_and_close(
    tmp_path: Path, tracker_env: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "nosuchscheme://host/x")  # MLflow has no store for it
    [sink] = sinks.open_sinks(BrokerConfig(logger=["mlflow"]), tmp_path, "r")
    sink._thread.join(60)  # opening failed on the sink's thread
    with pytest.raises(OSError, match=r"^mlflow: .*nosuchscheme"):
        sink.write(POINTS[0])  # the broker drops a sink whose write raises OSError
    with pytest.raises(OSError, match=r"^mlflow: "):
        sink.close()


def test_an_unknown_logger_is_refused_with_the_known_ones(tmp_path: Path) -> None:
    text = (
        "broker.logger: 'neptune' is not a logger; the loggers are jsonl, tensorboard, wandb, mlflow "
        "(e.g. logger=[jsonl,wandb])."
    )
    assert sinks.logger_errors(["jsonl", "neptune"]) == [text]
    with pytest.raises(ValueError) as err:
        sinks.open_sinks(BrokerConfig(logger=["jsonl", "neptune"]), tmp_path)
    assert str(err.value) == text
    assert list(tmp_path.iterdir()) == []  # nothing opened
    assert sinks.logger_errors(["wandb", "jsonl", "wandb"]) == [
        "broker.logger lists 'wandb' 2 times; list each logger once."
    ]
    assert sinks.logger_errors(["jsonl", "tensorboard", "wandb", "mlflow"]) == sinks.logger_errors([]) == []


def test_no_run_folder_no_files_and_a_missing_package_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert sinks.open_sinks(BrokerConfig(), None) == []
    assert sinks.open_sinks(BrokerConfig(logger=[]), tmp_path) == [] and list(tmp_path.iterdir()) == []
    monkeypatch.setitem(sinks.LOGGERS, "wandb", "agentstream_not_installed")  # as if wandb were not installed
    text = (
        "broker.logger has wandb, but the agentstream_not_installed package is not installed: run bash "
        "scripts/setup.sh, or leave wandb out of broker.logger."
    )
    assert sinks.logger_errors(["jsonl", "wandb"]) == [text]
    with pytest.raises(ValueError, match=re.escape(text)):
        sinks.open_sinks(BrokerConfig(logger=["wandb"]), tmp_path)
