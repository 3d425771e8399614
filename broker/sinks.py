"""The once-a-second points of the broker's numbers, and the sinks that log them over time.

Once a second the broker turns its snapshot (schema in broker/dashboard.py) into one flat *point* (`flatten`):
the dashboard's history (/api/history) keeps the last ones, and the sinks named in `broker.logger`
(`logger=[jsonl,tensorboard,wandb,mlflow]` on the command line; default jsonl and tensorboard) log every one:

    jsonl        RUN/metrics.jsonl: one point per line
    tensorboard  RUN/tensorboard/: TensorBoard scalars, one per point key (tensorboardX); step = whole seconds
                 since the first point
    wandb        a Weights & Biases run named after the run folder in project `broker.project`, offline in
                 RUN/wandb/ (no account, nothing leaves the machine) unless WANDB_MODE or WANDB_API_KEY is set;
                 step = the point's index (0, 1, 2, ...; wandb needs steps that only grow)
    mlflow       an MLflow run named after the run folder in experiment `broker.project`, in the file store
                 RUN/mlruns/ unless MLFLOW_TRACKING_URI is set; step = the point's index; keys have `/` as `.`
                 (`reward_mean.<env>`) and characters MLflow refuses as `_` (`mlflow_key`)

Read them with `pandas.read_json("RUN/metrics.jsonl", lines=True)`, `tensorboard --logdir RUN/tensorboard`,
`wandb leet RUN/wandb/latest-run` (or upload: `wandb sync RUN/wandb/offline-run-*`), and MLflow's
`MlflowClient("file://RUN/mlruns")` or `mlflow ui --backend-store-uri RUN/mlruns` (the full mlflow package),
both with MLFLOW_ALLOW_FILE_STORE=true: MLflow 3 opens a file store only when told to. W&B and MLflow are
driven from a thread of their own (`TrackerSink`). A broker started without a run folder (as in tests) logs
nowhere. What each name means: broker/catalogue.py.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import queue
import re
import sys
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Protocol

from agentstream.config import BrokerConfig
from broker.catalogue import MISMATCH_KEYS, VALIDATION_GAUGES

# ---------------------------------------------------------------------------------------------- points


def flatten(state: dict[str, Any]) -> dict[str, float | None]:
    """The snapshot's charted numbers as one flat point: `t` plus one key per series. Per-engine and
    per-environment series are `<name>/<engine or env>` (TensorBoard groups them by the part before `/`).
    None stands for "no value" (NaN), so that JSON stays valid."""
    r, g, learner = state["rates"], state["gauges"], state["learner"]
    point: dict[str, Any] = {
        "t": state["time"],
        **{
            k: r.get(k)
            for k in (
                "env_steps_per_s",
                "tokens_per_s",
                "transitions_per_s",
                "learner_samples_per_s",
                "learner_steps_per_s",
            )
        },
        "learner_version": learner["version"],
        "learner_step_time_s": learner.get("step_time_s"),
        "learner_loss": learner.get("loss"),
        "learner_publish_s": learner.get("publish_s"),
        **{f"learner_{k}": learner.get(k) for k in MISMATCH_KEYS},
        **{
            k: g.get(k)
            for k in (
                "buffered_transitions",
                "groups_ready",
                "staleness_mean",
                "staleness_max",
                "reward_mean",
                "success_rate",
                "invalid_action_ratio",
                "actors_alive",
                "engines_alive",
                *VALIDATION_GAUGES,
                "judge_latency_s",
                "distill_kl",
                "wal_failing",
            )
        },
        **{
            k: state.get("counters", {}).get(k)
            for k in (
                "judge_requests",
                "judge_parse_failures",
                "judge_errors",
                "gateway_requests",
                "gateway_rejected",
                "gateway_tool_parse_failures",
                "gateway_prompts_rendered_anew",
                "engine_stalls",
                "episode_retries",
                "infra_failures_timeout",
                "infra_failures_raised",
                "infra_failures_engine",
                "distill_dropped",
            )
        },
    }
    for e in state["engines"]:
        point[f"engine_version/{e['name']}"] = e["version"]
        point[f"weight_sync_s/{e['name']}"] = e.get("weight_sync_s")
    for env, row in sorted(state.get("envs", {}).items()):
        for key in ("reward_mean", "success_rate", "invalid_action_ratio"):
            point[f"{key}/{env}"] = row[key]
    return {k: (None if v is None or not math.isfinite(float(v)) else float(v)) for k, v in point.items()}


# ---------------------------------------------------------------------------------------------- sinks


class MetricsSink(Protocol):
    """Somewhere points go, once a second while the broker runs."""

    def write(self, point: dict[str, float | None]) -> None: ...

    def close(self) -> None: ...


class JsonlSink:
    """RUN/metrics.jsonl: one JSON object per point, flushed per line (a killed broker loses at most one)."""

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._file = path.open("a", encoding="utf-8", buffering=1)

    def write(self, point: dict[str, float | None]) -> None:
        self._file.write(json.dumps(point, separators=(",", ":")) + "\n")

    def close(self) -> None:
        self._file.close()


class TensorBoardSink:
    """TensorBoard scalars under RUN/tensorboard; the step is whole seconds since the first point."""

    def __init__(self, logdir: Path):
        self._writer = _summary_writer()(logdir=str(logdir), flush_secs=5)
        self._t0: float | None = None

    def write(self, point: dict[str, float | None]) -> None:
        t = point["t"] or 0.0
        self._t0 = t if self._t0 is None else self._t0
        for key, value in point.items():
            if key != "t" and value is not None:
                self._writer.add_scalar(key, value, global_step=int(t - self._t0), walltime=t)

    def close(self) -> None:
        self._writer.close()


def _summary_writer() -> type:
    """tensorboardX's SummaryWriter, imported without torch: tensorboardX tries `import torch` only to accept
    tensors, and the broker logs floats; in a broker process that has not loaded torch that import would cost
    seconds of start-up and hundreds of MB."""
    if "torch" in sys.modules:
        from tensorboardX import SummaryWriter

        return SummaryWriter
    sys.modules["torch"] = None  # type: ignore[assignment]  # `import torch` raises ImportError meanwhile
    try:
        from tensorboardX import SummaryWriter
    finally:
        del sys.modules["torch"]
    return SummaryWriter


class TrackerSink:
    """A sink whose tracker library runs on a thread of its own, so that the broker's event loop only queues
    points: opening a tracker takes seconds (imports, wandb's service process) and MLflow's file store takes
    tens of milliseconds per point. Subclasses say how to open, log a point and finish. A failure on that thread
    (or a tracker too far behind) surfaces as OSError from the next `write` or from `close`, so the broker
    drops the sink as it does a full disk."""

    name = "tracker"
    max_behind = 300
    """Points queued and not yet logged before `write` gives up on the tracker (5 minutes of points)."""
    close_timeout_s = 60.0
    """How long `close` waits for the tracker to log what is queued and finish."""

    def __init__(self) -> None:
        self._queue: queue.Queue[dict[str, float | None] | None] = queue.Queue()
        self._failure: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=f"metrics-{self.name}", daemon=True)
        self._thread.start()  # daemon: a tracker that hangs never keeps the broker process alive

    def write(self, point: dict[str, float | None]) -> None:
        self._raise_failure()
        if self._queue.qsize() >= self.max_behind:
            raise OSError(f"{self.name} has {self._queue.qsize()} points not yet logged (is it hanging?)")
        self._queue.put(point)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(self.close_timeout_s)
        if self._thread.is_alive():
            raise OSError(f"{self.name} did not finish within {self.close_timeout_s:.0f}s")
        self._raise_failure()

    def _raise_failure(self) -> None:
        if self._failure is not None:
            raise OSError(f"{self.name}: {self._failure!r}") from self._failure

    def _run(self) -> None:
        opened = False
        try:
            self._open()
            opened = True
            while (point := self._queue.get()) is not None:
                self._log(point)
        except Exception as exc:  # any tracker error: the sink stops (write/close re-raise it as OSError)
            self._failure = exc
        finally:
            if opened:
                try:
                    self._finish()
                except Exception as exc:
                    self._failure = self._failure or exc

    def _open(self) -> None:
        raise NotImplementedError

    def _log(self, point: dict[str, float | None]) -> None:
        raise NotImplementedError

    def _finish(self) -> None:
        raise NotImplementedError


class WandbSink(TrackerSink):
    """A Weights & Biases run `run_name` in `project`, offline under `run_dir`/wandb unless the user set WANDB_MODE
    or WANDB_API_KEY (then wandb's own settings decide). Each point is one history row; its step is the
    point's index, because wandb keeps only steps that grow and several points share a learner version."""

    name = "wandb"

    def __init__(self, run_dir: Path, project: str, run_name: str):
        self._dir, self._project, self._run_name = run_dir, project, run_name
        self._step = 0
        super().__init__()

    def _open(self) -> None:
        import wandb

        user_chose = bool(os.environ.get("WANDB_MODE") or os.environ.get("WANDB_API_KEY"))
        self._dir.mkdir(parents=True, exist_ok=True)
        # console="off": wandb would otherwise wrap the broker's stdout/stderr to copy its log into the run.
        self._run = wandb.init(
            mode=None if user_chose else "offline",
            dir=str(self._dir),
            project=self._project,
            name=self._run_name or None,
            reinit="create_new",
            settings=wandb.Settings(console="off"),
        )

    def _log(self, point: dict[str, float | None]) -> None:
        self._run.log({k: v for k, v in point.items() if k != "t" and v is not None}, step=self._step)
        self._step += 1

    def _finish(self) -> None:
        self._run.finish()


def mlflow_key(key: str) -> str:
    """`key` as an MLflow metric name: `/` becomes `.`, any other character outside [A-Za-z0-9_-. ] becomes `_`,
    and leading dots go. MLflow's file store keeps each metric in a file named by its key, so with `/` kept
    `reward_mean` (a file) and `reward_mean/<env>` (a file in a folder of that name) could not both be logged."""
    return re.sub(r"[^A-Za-z0-9_\-. ]", "_", key.replace("/", ".")).lstrip(".") or "_"


class MlflowSink(TrackerSink):
    """An MLflow run `run_name` in experiment `experiment`, in the file store `run_dir`/mlruns unless the user set
    MLFLOW_TRACKING_URI. Each point is one batch of metrics at step = the point's index and the point's time;
    None values are left out."""

    name = "mlflow"
    batch = 1000
    """MLflow takes at most this many metrics in one log_batch call."""

    def __init__(self, run_dir: Path, experiment: str, run_name: str):
        self.tracking_uri = os.environ.get("MLFLOW_TRACKING_URI") or (run_dir / "mlruns").resolve().as_uri()
        if self.tracking_uri.startswith("file:"):
            # MLflow 3 refuses a file store unless told to; mlflow-skinny has no database store to use instead.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self._experiment, self._run_name = experiment, run_name
        self._step = 0
        super().__init__()

    def _open(self) -> None:
        from mlflow.tracking import MlflowClient

        self._client = MlflowClient(self.tracking_uri)
        found = self._client.get_experiment_by_name(self._experiment)
        experiment_id = found.experiment_id if found else self._client.create_experiment(self._experiment)
        self.run_id = self._client.create_run(experiment_id, run_name=self._run_name or None).info.run_id

    def _log(self, point: dict[str, float | None]) -> None:
        from mlflow.entities import Metric as MlflowMetric

        ms = int((point.get("t") or time.time()) * 1000)
        values = {mlflow_key(k): v for k, v in point.items() if k != "t" and v is not None}
        metrics = [MlflowMetric(k, v, ms, self._step) for k, v in values.items()]
        for i in range(0, len(metrics), self.batch):
            self._client.log_batch(self.run_id, metrics=metrics[i : i + self.batch])
        self._step += 1

    def _finish(self) -> None:
        self._client.set_terminated(self.run_id)


LOGGERS = {"jsonl": None, "tensorboard": "tensorboardX", "wandb": "wandb", "mlflow": "mlflow"}
"""The names `broker.logger` takes, each with the package its sink imports (None: the standard library)."""


def logger_errors(names: Iterable[str]) -> list[str]:
    """What is wrong with `broker.logger=names`, each said with what to change (empty: every name is fine)."""
    names = list(names)
    known = ", ".join(LOGGERS)
    errors = [
        f"broker.logger: {n!r} is not a logger; the loggers are {known} (e.g. logger=[jsonl,wandb])."
        for n in names
        if n not in LOGGERS
    ]
    errors += [
        f"broker.logger lists {n!r} {names.count(n)} times; list each logger once."
        for n in sorted(set(names))
        if names.count(n) > 1
    ]
    for n in dict.fromkeys(names):
        package = LOGGERS.get(n)
        if package and importlib.util.find_spec(package) is None:
            errors.append(
                f"broker.logger has {n}, but the {package} package is not installed: run bash "
                f"scripts/setup.sh, or leave {n} out of broker.logger."
            )
    return errors


def open_sinks(cfg: BrokerConfig, run_dir: Path | None, run_name: str = "") -> list[MetricsSink]:
    """The sinks `cfg.logger` names, in its order. Each writes under `run_dir` (wandb and MLflow unless the
    user pointed them elsewhere); without a run folder there are none. Raises ValueError for a name that is
    not a logger (`logger_errors`)."""
    errors = logger_errors(cfg.logger)
    if errors:
        raise ValueError("\n".join(errors))
    if run_dir is None:
        return []
    sinks: list[MetricsSink] = []
    for name in cfg.logger:
        if name == "jsonl":
            sinks.append(JsonlSink(run_dir / "metrics.jsonl"))
        elif name == "tensorboard":
            sinks.append(TensorBoardSink(run_dir / "tensorboard"))
        elif name == "wandb":
            sinks.append(WandbSink(run_dir, cfg.project, run_name))
        elif name == "mlflow":
            sinks.append(MlflowSink(run_dir, cfg.project, run_name))
    return sinks
