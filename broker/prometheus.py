"""/metrics: a broker snapshot in Prometheus text format 0.0.4, written by prometheus_client.

    body = render_prometheus(state)   # state: the snapshot (schema in broker/dashboard.py)

The names (all prefixed `agentstream_`; counters end in `_total`), their kinds, labels and HELP lines are the
catalogue's (broker/catalogue.py); a counter or gauge it does not list still appears, under its sanitized name,
with a generic HELP.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from broker.catalogue import MISMATCH_KEYS, PREFIX, help_text

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"  # what generate_latest writes


def sanitize(name: str) -> str:
    """A metric name made of [a-zA-Z0-9_] only (anything else becomes `_`)."""
    return re.sub(r"[^a-zA-Z0-9_]", "_", name)


def _counter(name: str) -> CounterMetricFamily:
    base = sanitize(name).removesuffix("_total")
    return CounterMetricFamily(PREFIX + base, help_text(base), labels=())


def _gauge(name: str, labels: tuple[str, ...] = ()) -> GaugeMetricFamily:
    return GaugeMetricFamily(PREFIX + name, help_text(name), labels=labels)


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
    for key in ("version", "step_time_s", "loss", "publish_s", *MISMATCH_KEYS):
        if key in state["learner"]:
            gauge("learner_" + key, state["learner"][key])
    gauge("run_wall_s", state["run"]["wall_s"])
    gauge("run_total_steps", state["run"]["total_steps"])
    gauge("actors_alive", sum(bool(a["alive"]) for a in state["actors"]))
    for fam in _labelled(state):
        put(fam)
    return list(out.values())


def _labelled(state: dict[str, Any]) -> Iterator[Metric]:
    per_engine = {
        "engine_version": "version",
        "engine_alive": "alive",
        "engine_requests_in_flight": "requests_in_flight",
        "engine_weight_sync_s": "weight_sync_s",
    }
    yield from _per_row(state["engines"], "engine", per_engine)
    per_actor = {
        "actor_alive": "alive",
        "actor_episodes_in_flight": "episodes_in_flight",
        "actor_requests_in_flight": "requests_in_flight",
        "actor_policy_version": "version",
        "actor_env_steps_hung": "env_steps_hung",
    }
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
    episodes = CounterMetricFamily(PREFIX + "env_episodes", help_text("env_episodes"), labels=("env",))
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
