"""Metric names, the Prometheus rendering of a broker snapshot, and the sinks that log metrics over time.

Every process reports counters and gauges to the broker (`Stats` messages, agentstream/wire/messages.py); the
broker turns them into one snapshot (schema in broker/dashboard.py) and, once a second, into one flat *point*
(`flatten`). The same numbers go to:

    /metrics                Prometheus text format 0.0.4 (`render_prometheus`, written by prometheus_client)
    /api/state, /api/history JSON (the snapshot; the last points)

and to the sinks named in `broker.logger` (`logger=[jsonl,tensorboard,wandb,mlflow]` on the command line;
default jsonl and tensorboard):

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
nowhere.

Prometheus metric names (all prefixed `agentstream_`; counters end in `_total`):

| name                                   | type    | labels | meaning                                                   |
|----------------------------------------|---------|--------|-----------------------------------------------------------|
| transitions_ingested_total             | counter |        | per-step transitions accepted by the broker               |
| transitions_trained_total              | counter |        | transitions served to the learner                         |
| transitions_dropped_<reason>_total     | counter |        | transitions dropped, by reason (stale, actor_died, ...)   |
| groups_admitted/completed/trained_total| counter |        | groups granted to actors / completed / served             |
| malformed_messages_total               | counter |        | messages the broker rejected                              |
| env_steps_total, episodes_total, successes_total, invalid_actions_total, tokens_generated_total, transitions_sent_total, episode_return_sum_total, engine_errors_total | counter | | actor totals over all actors and incarnations |
| env_steps_per_s, tokens_per_s, transitions_per_s | gauge | | rates over the last 10 s                             |
| learner_samples_per_s, learner_steps_per_s | gauge |      | transitions trained / optimizer steps per second (10 s)   |
| learner_version, learner_step_time_s, learner_loss, learner_publish_s | gauge | | from the learner's last VersionUpdate |
| buffered_transitions, groups_ready, groups_open, group_waiters | gauge | | broker buffer depth and queues              |
| staleness_mean, staleness_max          | gauge   |        | policy lag of the last trained batch                      |
| staleness_count                        | gauge   | lag    | trained transitions per policy lag (histogram)            |
| reward_mean, success_rate, invalid_action_ratio | gauge | | over episodes/steps of the last 60 s, all envs           |
| env_reward_mean, env_success_rate, env_invalid_action_ratio | gauge | env | the same per environment              |
| env_episodes_total                     | counter | env    | episodes finished per environment                         |
| actors_alive, engines_alive            | gauge   |        | processes that reported within 10 s                       |
| weight_sync_s                          | gauge   |        | slowest engine's last weight update (write to resume)     |
| judge_requests_total, judge_parsed_total, judge_parse_failures_total, judge_errors_total | counter | | LLM judges (actors/judge.py): episodes judged = parsed + parse failures + errors (timeouts included) |
| judge_latency_s_sum_total, judge_latency_count_total, judge_score_sum_total | counter | | answered judge requests' seconds and count; the scores given (defaults included) |
| judge_latency_s                        | gauge   |        | mean seconds of the judge requests answered in the last 60 s |
| token_reward_steps_total, token_reward_sum_total, token_reward_failures_total, token_reward_failures_CAUSE_total | counter | | rewards on tokens (actors/token_rewards.py): steps given them, their sum; steps without them because the function failed, in all and by cause (raised, not_numbers, wrong_length, non_finite) |
| gateway_requests_total, gateway_calls_total, gateway_episodes_opened_total, gateway_episodes_finished_total, gateway_prompt_tokens_total, gateway_tool_calls_total | counter | | the OpenAI-compatible gateway (gateway/server.py; an actor to the broker, whose episodes and calls also count in episodes_total and env_steps_total): HTTP requests, model calls, episodes, prompt tokens, tool calls returned |
| gateway_rejected_total, gateway_rejected_CODE_total, gateway_tool_parse_failures_total, gateway_tool_parse_REASON_total, gateway_prompts_rendered_anew_total, gateway_prompts_extended_total, gateway_internal_errors_total | counter | | its refusals (4xx) in all and by code (docs/gateway.md), tool calls that did not parse in all and by reason, prompts rendered whole again vs extended token-exactly, 500s |
| engine_failovers_total, engine_stalls_total, episode_retries_total, infra_failures_total, infra_failures_CAUSE_total, episodes_cut_total | counter | | faults outside the model (actors/actor.py, docs/reliability.md): requests moved off a failed or stalled engine; episodes played again on their seed; episode attempts failed by their env or engines, in all and by cause (timeout, raised, engine); episodes stopped because their group was given up |
| actor_alive, actor_episodes_in_flight, actor_requests_in_flight, actor_policy_version, actor_env_steps_hung | gauge | actor | per actor (env_steps_hung: env calls left running after env.step_timeout_s) |
| engine_alive, engine_version, engine_requests_in_flight, engine_weight_sync_s | gauge | engine | per engine (requests: vLLM running+waiting, -1 unknown) |
| run_wall_s, run_total_steps            | gauge   |        | seconds since the broker started; configured steps        |
| wal_failing                            | gauge   |        | 1 while the write-ahead log cannot be written (full disk) |
| wal_stalled_s, wal_pending_bytes       | gauge   |        | seconds stalled on it in all; bytes waiting to be written |
| wal_write_errors_total                 | counter |        | failed writes of the write-ahead log (and compactions)    |

Any other counter or gauge a process reports still appears, under its sanitized name, with a generic HELP.
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
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from agentstream.config import BrokerConfig
from broker.stats import GATEWAY_REJECT_CODES

PREFIX = "agentstream_"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"  # what generate_latest writes

# The gateway's counters (broker.stats.GATEWAY_COUNTERS), one HELP line each.
GATEWAY_HELP: dict[str, str] = {
    "gateway_requests": "HTTP requests the OpenAI-compatible gateway handled (answered or refused).",
    "gateway_calls": "Model calls the gateway answered (each one transition; also counted in env_steps).",
    "gateway_episodes_opened": "Episodes opened at the gateway.",
    "gateway_episodes_finished": "Episodes finished at the gateway (also counted in episodes).",
    "gateway_episodes_abandoned": "Gateway episodes given up (no request for gateway.episode_idle_timeout_s; group dropped).",
    "gateway_prompt_tokens": "Prompt tokens of the gateway's model calls.",
    "gateway_tool_calls": "Tool calls the gateway parsed from answers and returned as OpenAI tool_calls.",
    "gateway_tool_parse_failures": "Answers whose tool calls did not parse (returned as text; the step is invalid).",
    "gateway_prompts_extended": "Gateway calls whose prompt extended the previous prompt and answer token-exactly.",
    "gateway_prompts_rendered_anew": "Gateway calls rendered whole again (history edited, tools changed).",
    "gateway_internal_errors": "Gateway requests that failed inside it (500, logged with the trace).",
    "gateway_rejected": "Gateway requests refused with a 4xx (all codes).",
    **{f"gateway_tool_parse_{r}": f"Gateway answers whose tool calls did not parse: {r}." for r in
       ("truncated", "bad_json", "bad_call", "unknown_tool")},
    **{f"gateway_rejected_{c}": f"Gateway requests refused with code {c} (docs/gateway.md, Bad input)."
       for c in GATEWAY_REJECT_CODES},
}

# HELP text per name (without prefix and without `_total`); an unknown name gets a generic line.
HELP: dict[str, str] = {
    "transitions_ingested": "Per-step transitions accepted by the broker.",
    "transitions_trained": "Transitions served to the learner in batches.",
    "transitions_dropped_stale": "Transitions dropped because their policy lag exceeded the bound.",
    "groups_admitted": "Groups granted to actors.",
    "groups_completed": "Groups whose G trajectories all finished.",
    "groups_trained": "Complete groups served to the learner.",
    "env_steps": "Environment steps taken by all actors.",
    "tokens_generated": "Response tokens generated by the engines.",
    "transitions_sent": "Transitions sent by actors.",
    "episodes": "Episodes finished.",
    "successes": "Episodes that ended in success.",
    "episode_return_sum": "Sum of episode returns (divide by episodes for the mean).",
    "invalid_actions": "Steps whose response did not parse as an action.",
    "engine_errors": "Engine requests that failed.",
    "judge_requests": "Episodes an LLM judge scored (parsed + parse failures + errors).",
    "judge_parsed": "Judge answers whose score parsed.",
    "judge_parse_failures": "Judge answers without a score (judges.default_score was used).",
    "judge_errors": "Judge requests that failed or timed out (judges.default_score was used).",
    "judge_score_sum": "Sum of the judge scores given (defaults included; divide by judge_requests).",
    "judge_latency_s_sum": "Seconds of the answered judge requests (divide by judge_latency_count).",
    "judge_latency_count": "Answered judge requests.",
    "token_reward_steps": "Steps given rewards on their response tokens (trainer.token_reward).",
    "token_reward_sum": "Sum of the rewards placed on response tokens.",
    "token_reward_failures": "Steps without token rewards because the token reward function failed.",
    "token_reward_failures_raised": "Token reward function calls that raised.",
    "token_reward_failures_not_numbers": "Token reward function calls that returned no sequence of numbers.",
    "token_reward_failures_wrong_length": "Token reward function calls that returned more or fewer values than tokens.",
    "token_reward_failures_non_finite": "Token reward function calls that returned nan, inf or values beyond float32.",
    **GATEWAY_HELP,
    "judge_latency_s": "Mean seconds of the judge requests answered in the last 60 s.",
    "engine_failovers": "Engine requests moved to another engine after a failure or a stall.",
    "engine_stalls": "Engine requests unanswered for engines.stall_timeout_s whose engine then missed a probe too.",
    "episode_retries": "Episodes played again on their seed after an infrastructure failure.",
    "infra_failures": "Episode attempts failed by the env or the engines (not the model), in all.",
    "infra_failures_timeout": "Episode attempts failed because an env step outlasted env.step_timeout_s.",
    "infra_failures_raised": "Episode attempts failed because an env step raised.",
    "infra_failures_engine": "Episode attempts failed because no engine answered within engines.request_timeout_s.",
    "episodes_cut": "Episodes stopped early because another episode of their group gave up (the group is dropped).",
    "malformed_messages": "Messages the broker could not decode.",
    "buffered_transitions": "Transitions held by the broker, not yet trained on.",
    "groups_ready": "Complete groups waiting to be served.",
    "groups_open": "Groups still being played.",
    "group_waiters": "Actor group requests waiting for admission.",
    "staleness_mean": "Mean policy lag (learner version - producing version) of the last trained batch.",
    "staleness_max": "Largest policy lag of the last trained batch.",
    "reward_mean": "Mean episode return over the last 60 s.",
    "success_rate": "Fraction of the last 60 s's episodes that succeeded.",
    "invalid_action_ratio": "Fraction of the last 60 s's steps with an invalid action.",
    "actors_alive": "Actor processes that reported within 10 s.",
    "engines_alive": "Engines that reported within 10 s.",
    "weight_sync_s": "Seconds the slowest engine's last weight update took (write to resume).",
    "env_steps_per_s": "Environment steps per second (10 s window).",
    "tokens_per_s": "Generated tokens per second (10 s window).",
    "transitions_per_s": "Transitions ingested per second (10 s window).",
    "learner_samples_per_s": "Transitions trained per second (10 s window).",
    "learner_steps_per_s": "Learner optimizer steps per second (10 s window).",
    "learner_version": "Learner policy version (one per optimizer step).",
    "learner_step_time_s": "Seconds taken by the last learner step.",
    "learner_loss": "Loss of the last learner step.",
    "learner_publish_s": "Seconds the learner took to publish the last weights.",
    "run_wall_s": "Seconds since the broker started.",
    "run_total_steps": "Learner steps the run is configured to take.",
    "wal_failing": "1 while the broker's write-ahead log cannot be written (a full disk): nothing is acknowledged.",
    "wal_stalled_s": "Seconds the broker has stalled on an unwritable write-ahead log, in all.",
    "wal_pending_bytes": "Bytes of write-ahead log records waiting to be written.",
    "wal_write_errors": "Failed writes of the write-ahead log (and failed compactions).",
    "engine_version": "Policy version an engine is serving.",
    "engine_alive": "1 if the engine reported within 10 s.",
    "engine_requests_in_flight": "Requests the engine's vLLM server is running or queueing (-1: unknown).",
    "engine_weight_sync_s": "Seconds the engine's last weight update took.",
    "actor_alive": "1 if the actor reported within 10 s and has not said goodbye.",
    "actor_episodes_in_flight": "Episodes an actor is running now.",
    "actor_requests_in_flight": "Engine requests an actor is waiting on now.",
    "actor_env_steps_hung": "Env calls of an actor still running after env.step_timeout_s.",
    "actor_policy_version": "Newest policy version an actor's responses came from.",
    "staleness_count": "Trained transitions per policy lag (label lag).",
    "env_reward_mean": "Mean episode return over the last 60 s, per environment.",
    "env_success_rate": "Success rate over the last 60 s, per environment.",
    "env_invalid_action_ratio": "Invalid-action ratio over the last 60 s, per environment.",
    "env_episodes": "Episodes finished, per environment.",
}


# ---------------------------------------------------------------------------------------------- /metrics


def sanitize(name: str) -> str:
    """A metric name made of [a-zA-Z0-9_] only (anything else becomes `_`)."""
    return re.sub(r"[^a-zA-Z0-9_]", "_", name)


def _help(name: str) -> str:
    return HELP.get(name, f"{name.replace('_', ' ')} (as reported to the broker).")


def _counter(name: str) -> CounterMetricFamily:
    base = sanitize(name).removesuffix("_total")
    return CounterMetricFamily(PREFIX + base, _help(base), labels=())


def _gauge(name: str, labels: tuple[str, ...] = ()) -> GaugeMetricFamily:
    return GaugeMetricFamily(PREFIX + name, _help(name), labels=labels)


def metric_families(state: dict[str, Any]) -> list[Metric]:
    """Every family the snapshot yields, each name once (the first source of a name wins)."""
    out: dict[str, Metric] = {}

    def put(fam: Metric) -> None:
        if fam.samples:  # a family without samples would be a TYPE line with nothing under it
            out.setdefault(fam.name, fam)

    def gauge(name: str, value: float) -> None:
        fam = _gauge(sanitize(name))
        fam.add_metric([], _num(value))
        put(fam)

    for key, value in state["counters"].items():
        fam = _counter(key)
        fam.add_metric([], _num(value))
        put(fam)
    for key, value in [*state["gauges"].items(), *state["rates"].items()]:
        gauge(key, value)
    for key in ("version", "step_time_s", "loss", "publish_s"):
        if key in state["learner"]:
            gauge("learner_" + key, state["learner"][key])
    gauge("run_wall_s", state["run"]["wall_s"])
    gauge("run_total_steps", state["run"]["total_steps"])
    gauge("actors_alive", sum(bool(a["alive"]) for a in state["actors"]))
    for fam in _labelled(state):
        put(fam)
    return list(out.values())


def _labelled(state: dict[str, Any]) -> Iterator[Metric]:
    per_engine = {"engine_version": "version", "engine_alive": "alive", "engine_requests_in_flight":
                  "requests_in_flight", "engine_weight_sync_s": "weight_sync_s"}
    yield from _per_row(state["engines"], "engine", per_engine)
    per_actor = {"actor_alive": "alive", "actor_episodes_in_flight": "episodes_in_flight",
                 "actor_requests_in_flight": "requests_in_flight", "actor_policy_version": "version",
                 "actor_env_steps_hung": "env_steps_hung"}
    yield from _per_row(state["actors"], "actor", per_actor)
    staleness = _gauge("staleness_count", ("lag",))
    for lag, count in sorted(state["staleness_hist"].items(), key=lambda kv: int(kv[0])):
        staleness.add_metric([str(lag)], _num(count))
    yield staleness
    envs = state.get("envs", {})
    for name in ("reward_mean", "success_rate", "invalid_action_ratio"):
        fam = _gauge("env_" + name, ("env",))
        for env, row in sorted(envs.items()):
            fam.add_metric([env], _num(row[name]))
        yield fam
    episodes = CounterMetricFamily(PREFIX + "env_episodes", _help("env_episodes"), labels=("env",))
    for env, row in sorted(envs.items()):
        episodes.add_metric([env], _num(row["episodes"]))
    yield episodes


def _per_row(rows: Iterable[dict[str, Any]], label: str, fields: dict[str, str]) -> Iterator[Metric]:
    rows = list(rows)
    for metric, key in fields.items():
        fam = _gauge(metric, (label,))
        for row in rows:
            if key in row:
                fam.add_metric([str(row["name"])], _num(row[key]))
        yield fam


def _num(value: Any) -> float:
    return math.nan if value is None else float(value)  # None: NaN sent over JSON as null


class _Snapshot:
    """A prometheus_client collector over one snapshot."""

    def __init__(self, state: dict[str, Any]):
        self.state = state

    def collect(self) -> list[Metric]:
        return metric_families(self.state)


def render_prometheus(state: dict[str, Any]) -> bytes:
    """The snapshot in Prometheus text format 0.0.4 (HELP, TYPE, then samples for each family)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Snapshot(state))
    return generate_latest(registry)


# ---------------------------------------------------------------------------------------------- points


def flatten(state: dict[str, Any]) -> dict[str, float | None]:
    """The snapshot's charted numbers as one flat point: `t` plus one key per series. Per-engine and
    per-environment series are `<name>/<engine or env>` (TensorBoard groups them by the part before `/`).
    None stands for "no value" (NaN), so that JSON stays valid."""
    r, g, learner = state["rates"], state["gauges"], state["learner"]
    point: dict[str, Any] = {
        "t": state["time"],
        **{k: r.get(k) for k in ("env_steps_per_s", "tokens_per_s", "transitions_per_s",
                                 "learner_samples_per_s", "learner_steps_per_s")},
        "learner_version": learner["version"], "learner_step_time_s": learner.get("step_time_s"),
        "learner_loss": learner.get("loss"), "learner_publish_s": learner.get("publish_s"),
        **{k: g.get(k) for k in ("buffered_transitions", "groups_ready", "staleness_mean", "staleness_max",
                                 "reward_mean", "success_rate", "invalid_action_ratio", "actors_alive",
                                 "engines_alive", "val_success_rate", "val_return", "val_version",
                                 "judge_latency_s", "wal_failing")},
        **{k: state.get("counters", {}).get(k) for k in (
            "judge_requests", "judge_parse_failures", "judge_errors", "gateway_requests", "gateway_rejected",
            "gateway_tool_parse_failures", "gateway_prompts_rendered_anew", "engine_stalls", "episode_retries",
            "infra_failures_timeout", "infra_failures_raised", "infra_failures_engine")},
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
        self._run = wandb.init(mode=None if user_chose else "offline", dir=str(self._dir), project=self._project,
                               name=self._run_name or None, reinit="create_new",
                               settings=wandb.Settings(console="off"))

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
            self._client.log_batch(self.run_id, metrics=metrics[i:i + self.batch])
        self._step += 1

    def _finish(self) -> None:
        self._client.set_terminated(self.run_id)


LOGGERS = {"jsonl": None, "tensorboard": "tensorboardX", "wandb": "wandb", "mlflow": "mlflow"}
"""The names `broker.logger` takes, each with the package its sink imports (None: the standard library)."""


def logger_errors(names: Iterable[str]) -> list[str]:
    """What is wrong with `broker.logger=names`, each said with what to change (empty: every name is fine)."""
    names = list(names)
    known = ", ".join(LOGGERS)
    errors = [f"broker.logger: {n!r} is not a logger; the loggers are {known} (e.g. logger=[jsonl,wandb])."
              for n in names if n not in LOGGERS]
    errors += [f"broker.logger lists {n!r} {names.count(n)} times; list each logger once."
               for n in sorted(set(names)) if names.count(n) > 1]
    for n in dict.fromkeys(names):
        package = LOGGERS.get(n)
        if package and importlib.util.find_spec(package) is None:
            errors.append(f"broker.logger has {n}, but the {package} package is not installed: run bash "
                          f"scripts/setup.sh, or leave {n} out of broker.logger.")
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
