"""What the broker shows of itself: the run's summary (summary.json) and the dashboard's state (its page,
`/api/state`, `/metrics` and the metrics sinks), read from a `BrokerView` the server takes of itself."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from agentstream.wire.messages import EngineStatus
from broker.buffer import ReplayBuffer
from broker.catalogue import MISMATCH_KEYS, VALIDATION_GAUGES
from broker.stats import ACTOR_COUNTERS, OUTCOME_WINDOW_S, Peer, StatsBook, env_outcomes


@dataclass(frozen=True)
class BrokerView:
    """What the views read of a broker, taken at one moment of its event loop. The views run synchronously
    inside that loop, so nothing they read changes while they read it; they never write."""

    run_name: str
    status: str
    reason: str
    started: float
    total_steps: int
    buffer: ReplayBuffer
    stats: StatsBook
    engines: Mapping[str, EngineStatus]
    rejected: Mapping[str, int]
    learner_metrics: Mapping[str, float]
    group_waiters: int
    audit: Callable[[], dict[str, Any]]
    """The delivery accounting (computed only for the summary: it walks every buffered key)."""
    dead: frozenset[str] = frozenset()
    """Actors and engines the broker declared gone (silent for broker.heartbeat_timeout_s), until they report again."""
    wal: Mapping[str, float] = field(default_factory=dict)
    """The write-ahead log's health: wal_failing (1 while it cannot be written: a full disk), wal_stalled_s,
    wal_pending_bytes, wal_write_errors (empty without a log)."""


def summary(broker: BrokerView) -> dict[str, Any]:
    """What the launcher writes to summary.json (contract: see README)."""
    b = broker.buffer
    wall = time.time() - broker.started
    actor = broker.stats.role_totals("actor", ACTOR_COUNTERS)
    actors = [p for p in broker.stats.peers.values() if p.role == "actor"]
    return {
        "learner_version": b.learner_version,
        "engine_versions": {name: s.version for name, s in sorted(broker.engines.items())},
        # What reached the broker, from its own (logged) count: every actor transition is keyed, and a key is
        # acknowledged once. The actors' own reports (`transitions_sent_reported`) miss the last sends of an
        # incarnation killed before its next report, so they may fall short of this.
        "transitions_sent": b.counts["transitions_acked"],
        "transitions_sent_reported": int(actor["transitions_sent"]),
        "transitions_ingested": b.counts["transitions_ingested"],
        "transitions_trained": b.counts["transitions_trained"],
        "transitions_buffered": b.buffered(),
        "transitions_dropped": b.dropped(),
        "messages_rejected": {"malformed": b.counts["malformed_messages"], **broker.rejected},
        "groups_admitted": b.counts["groups_admitted"],
        "groups_trained": b.counts["groups_trained"],
        "group_size": b.group_size,
        "trained_group_shapes": dict(b.trained_group_shapes),
        "staleness_hist": {str(k): v for k, v in sorted(b.staleness_hist.items())},
        "episodes": int(actor["episodes"]),
        "success_rate": actor["successes"] / actor["episodes"] if actor["episodes"] else 0.0,
        "env_steps": int(actor["env_steps"]),
        "tokens_generated": int(actor["tokens_generated"]),
        "wall_s": wall,
        "env_steps_per_s": actor["env_steps"] / wall,
        "tokens_per_s": actor["tokens_generated"] / wall,
        "actors_final": sum(1 for p in actors if p.final),
        "transitions_sent_by_actor": broker.stats.by_source("transitions_sent", "actor"),
        "learner_metrics": broker.learner_metrics,
        "judges": _judges(actor),
        "distill": _distill(actor),
        "reliability": broker.audit(),
    }


def _judges(actor: Mapping[str, float]) -> dict[str, Any]:
    """The LLM judges' totals (actors/judge.py): requests = parsed + parse_failures + errors, one per judged
    episode; the mean latency and score of the run."""
    answered, requests = actor["judge_latency_count"], actor["judge_requests"]
    return {
        "requests": int(requests),
        "parsed": int(actor["judge_parsed"]),
        "parse_failures": int(actor["judge_parse_failures"]),
        "errors": int(actor["judge_errors"]),
        "latency_mean_s": actor["judge_latency_s_sum"] / answered if answered else 0.0,
        "score_mean": actor["judge_score_sum"] / requests if requests else 0.0,
    }


def _distill(actor: Mapping[str, float]) -> dict[str, Any]:
    """On-policy distillation's totals (actors/teacher.py): steps and tokens given a teacher's signal, the run's mean
    reverse KL per token, failed requests, retries and groups dropped for want of a signal."""
    steps, tokens = actor["distill_steps"], actor["distill_tokens"]
    return {
        "steps": int(steps),
        "tokens": int(tokens),
        "kl_mean": actor["distill_kl_sum"] / tokens if tokens else 0.0,
        "latency_mean_s": actor["distill_latency_s_sum"] / steps if steps else 0.0,
        "errors": int(actor["distill_errors"]),
        "retries": int(actor["distill_retries"]),
        "groups_dropped": int(actor["distill_dropped"]),
    }


def dashboard_state(broker: BrokerView) -> dict[str, Any]:
    """The dashboard's state now (schema in broker/dashboard.py); each point of its charts and of the metrics
    sinks is this, flattened."""
    now, b, s = time.time(), broker.buffer, broker.stats
    actor = s.role_totals("actor", ACTOR_COUNTERS)
    lags = b.last_staleness
    d_eps = s.window_delta("episodes", OUTCOME_WINDOW_S)
    d_steps = s.window_delta("env_steps", OUTCOME_WINDOW_S)
    d_judged = s.window_delta("judge_latency_count", OUTCOME_WINDOW_S)
    d_taught = s.window_delta("distill_tokens", OUTCOME_WINDOW_S)
    engines, actors = _engine_rows(broker, now), _actor_rows(broker, now)
    gauges = {
        "buffered_transitions": b.buffered(),
        "groups_ready": len(b.ready),
        "groups_open": len(b.open),
        "staleness_mean": sum(lags) / len(lags) if lags else 0.0,
        "staleness_max": max(lags, default=0),
        "reward_mean": s.window_delta("episode_return_sum", OUTCOME_WINDOW_S) / d_eps if d_eps else 0.0,
        "success_rate": s.window_delta("successes", OUTCOME_WINDOW_S) / d_eps if d_eps else 0.0,
        "invalid_action_ratio": s.window_delta("invalid_actions", OUTCOME_WINDOW_S) / d_steps if d_steps else 0.0,
        "actors_alive": sum(1 for a in actors if a["alive"]),
        "engines_alive": sum(1 for e in engines if e["alive"]),
        "weight_sync_s": max((e["weight_sync_s"] for e in engines), default=0.0),
        "group_waiters": broker.group_waiters,
        "judge_latency_s": s.window_delta("judge_latency_s_sum", OUTCOME_WINDOW_S) / d_judged if d_judged else 0.0,
        "distill_kl": s.window_delta("distill_kl_sum", OUTCOME_WINDOW_S) / d_taught if d_taught else 0.0,
        **{k: v for k, v in broker.wal.items() if k != "wal_write_errors"},
    }
    for peer in s.peers.values():  # validation on held-out seeds (actors/evaluate.py), when enabled
        if peer.role == "evaluator":
            gauges.update({k: peer.gauges[k] for k in VALIDATION_GAUGES if k in peer.gauges})
    lm = broker.learner_metrics
    return {
        "time": now,
        "run": {
            "name": broker.run_name,
            "status": broker.status,
            "reason": broker.reason,
            "wall_s": now - broker.started,
            "total_steps": broker.total_steps,
        },
        "learner": {
            "version": b.learner_version,
            "step_time_s": lm.get("step_time_s", 0.0),
            "loss": lm.get("loss", 0.0),
            "publish_s": lm.get("publish_s", 0.0),
            "batch_wait_s": lm.get("batch_wait_s", 0.0),
            **{k: lm[k] for k in MISMATCH_KEYS if k in lm},
        },
        "engines": engines,
        "actors": actors,
        "envs": env_outcomes(s),
        "rates": {
            "env_steps_per_s": s.rate("env_steps"),
            "tokens_per_s": s.rate("tokens_generated"),
            "transitions_per_s": s.rate("transitions_ingested"),
            "learner_samples_per_s": s.rate("transitions_trained"),
            "learner_steps_per_s": s.rate("learner_version"),
        },
        "counters": {
            **{k: float(v) for k, v in b.counts.items()},
            **actor,
            **({"wal_write_errors": broker.wal["wal_write_errors"]} if broker.wal else {}),
        },
        "gauges": {k: float(v) for k, v in gauges.items()},
        "staleness_hist": {str(k): v for k, v in sorted(b.staleness_hist.items())},
    }


def _alive(broker: BrokerView, p: Peer, now: float) -> bool:
    """Reporting (heard from in the last 10 s), not exited, and not declared gone by the broker's heartbeat check."""
    return not p.final and now - p.last_seen < 10 and p.name not in broker.dead


def _engine_rows(broker: BrokerView, now: float) -> list[dict[str, Any]]:
    rows = []
    for name, e in sorted(broker.engines.items()):
        p = broker.stats.peers.get(name)
        rows.append(
            {
                "name": name,
                "url": e.url,
                "address": e.url,
                "incarnation": p.incarnation if p else 0,
                "version": e.version,
                "alive": p is not None and _alive(broker, p, now),
                "requests_in_flight": int(p.gauges.get("requests_in_flight", -1)) if p else -1,
                "weight_sync_s": p.gauges.get("weight_sync_s", 0.0) if p else 0.0,
                "last_seen_s": now - p.last_seen if p else -1.0,
            }
        )
    return rows


def _actor_rows(broker: BrokerView, now: float) -> list[dict[str, Any]]:
    return [
        {
            "name": p.name,
            "address": p.address or (f"pid {p.pid}" if p.pid else ""),
            "incarnation": p.incarnation,
            "alive": _alive(broker, p, now),
            "episodes_in_flight": int(p.gauges.get("episodes_in_flight", 0)),
            "requests_in_flight": int(p.gauges.get("requests_in_flight", 0)),
            "env_steps_hung": int(p.gauges.get("env_steps_hung", 0)),
            "version": int(p.gauges.get("policy_version", -1)),
            "last_seen_s": now - p.last_seen,
        }
        for p in sorted(broker.stats.peers.values(), key=lambda p: p.name)
        if p.role == "actor"
    ]
