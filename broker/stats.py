"""Stats from every process, under stable names: totals, rates and the registry of peers.

Each process sends `Stats` with its counters (totals since it started) and gauges. A restarted process
comes back under a new incarnation with counters from zero, so totals are kept per (source, incarnation)
and summed. Rates are differences of totals over a sliding window, sampled once a second.

Actors also report per-environment counters as `env/<env name>/<counter>` (an env name may itself hold
`/`: the counter is what follows the last one); `env_totals` sums them per environment.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

# LLM judges (actors/judge.py): episodes judged = parsed + parse failures + errors; the latency of answered ones.
JUDGE_COUNTERS = (
    "judge_requests",
    "judge_parsed",
    "judge_parse_failures",
    "judge_errors",
    "judge_score_sum",
    "judge_latency_s_sum",
    "judge_latency_count",
)
# Rewards on tokens (actors/token_rewards.py): steps given them, their sum, and the steps whose function failed.
TOKEN_REWARD_COUNTERS = (
    "token_reward_steps",
    "token_reward_sum",
    "token_reward_failures",
    "token_reward_failures_raised",
    "token_reward_failures_not_numbers",
    "token_reward_failures_wrong_length",
    "token_reward_failures_non_finite",
)
# On-policy distillation (actors/teacher.py): steps given a teacher's signal, their tokens, the sum over them of
# log pi_student - log pi_teacher (/ distill_tokens: mean reverse KL per token), answered requests' seconds, failed
# requests, requests asked again, groups dropped for want of a signal.
DISTILL_COUNTERS = (
    "distill_steps",
    "distill_tokens",
    "distill_kl_sum",
    "distill_latency_s_sum",
    "distill_errors",
    "distill_retries",
    "distill_dropped",
)
# The OpenAI-compatible gateway (gateway/server.py), which reports as an actor: its episodes and calls count as
# actors' episodes and env steps; these are its own. rejected = the sum of rejected_<code> (one per 4xx code),
# tool_parse_failures = the sum of tool_parse_<reason> (= its invalid actions); prompts_rendered_anew: calls whose
# prompt could not extend the previous one token-exactly (re-renders).
GATEWAY_REJECT_CODES = (
    "unknown_episode",
    "no_episode",
    "invalid_json",
    "invalid_request",
    "context_length_exceeded",
    "body_too_large",
    "episode_finished",
    "episode_abandoned",
    "no_step",
    "busy",
    "unknown_route",
    "method_not_allowed",
    "bad_key",
)
GATEWAY_COUNTERS = (
    "gateway_requests",
    "gateway_calls",
    "gateway_episodes_opened",
    "gateway_episodes_finished",
    "gateway_episodes_abandoned",
    "gateway_prompt_tokens",
    "gateway_tool_calls",
    "gateway_tool_parse_failures",
    *(f"gateway_tool_parse_{r}" for r in ("truncated", "bad_json", "bad_call", "unknown_tool")),
    "gateway_prompts_extended",
    "gateway_prompts_rendered_anew",
    "gateway_internal_errors",
    "gateway_rejected",
    *(f"gateway_rejected_{c}" for c in GATEWAY_REJECT_CODES),
)
# Faults outside the model (actors/actor.py): engine failovers and stalls, episodes retried on their seed, episodes
# failed by their env or engines (in all and by cause), episodes cut short because their group was dropped.
INFRA_COUNTERS = (
    "engine_failovers",
    "engine_stalls",
    "episode_retries",
    "infra_failures",
    "infra_failures_timeout",
    "infra_failures_raised",
    "infra_failures_engine",
    "infra_failures_teacher",
    "episodes_cut",
)
# Counter names summed over every process of a role, as they appear on the dashboard and in /metrics.
ACTOR_COUNTERS = (
    "env_steps",
    "tokens_generated",
    "transitions_sent",
    "episodes",
    "successes",
    "episode_return_sum",
    "invalid_actions",
    "engine_errors",
    *JUDGE_COUNTERS,
    *TOKEN_REWARD_COUNTERS,
    *DISTILL_COUNTERS,
    *GATEWAY_COUNTERS,
    *INFRA_COUNTERS,
)
ENV_PREFIX = "env/"
RATE_WINDOW_S = 10.0  # throughputs: short, so the charts react
OUTCOME_WINDOW_S = 60.0  # rewards and success rates: long enough to hold a few episodes
_KEEP_S = max(RATE_WINDOW_S, OUTCOME_WINDOW_S)


@dataclass
class Peer:
    """One process the broker has heard from."""

    name: str
    role: str
    incarnation: int = 0
    address: str = ""
    pid: int = 0
    last_seen: float = field(default_factory=time.time)
    final: bool = False
    gauges: dict = field(default_factory=dict)


class StatsBook:
    """Latest stats of every peer, run totals, and windowed rates."""

    def __init__(self) -> None:
        self.peers: dict[str, Peer] = {}
        self._totals: dict[tuple[str, int], dict[str, float]] = {}
        self._samples: deque[tuple[float, dict[str, float]]] = deque()

    def hello(self, name: str, role: str, incarnation: int, pid: int, address: str) -> None:
        self.peers[name] = Peer(name, role, incarnation, address, pid)

    def report(self, name: str, role: str, counters: dict, gauges: dict, final: bool) -> None:
        peer = self.peers.get(name) or self.peers.setdefault(name, Peer(name, role))
        peer.last_seen, peer.final = time.time(), final
        peer.gauges = {k: float(v) for k, v in gauges.items() if isinstance(v, (int, float))}
        self._totals[(name, peer.incarnation)] = {
            k: float(v) for k, v in counters.items() if isinstance(v, (int, float))
        }

    def by_source(self, counter: str, role: str) -> dict[str, float]:
        """A counter per process of `role`, summed over its incarnations (which actor did how much)."""
        out: dict[str, float] = {}
        for (name, _), c in self._totals.items():
            if name in self.peers and self.peers[name].role == role:
                out[name] = out.get(name, 0.0) + c.get(counter, 0.0)
        return out

    def total(self, counter: str, role: str | None = None) -> float:
        """Sum of a counter over every process (of `role`) and all their incarnations."""
        return sum(
            c.get(counter, 0.0)
            for (name, _), c in self._totals.items()
            if role is None or (name in self.peers and self.peers[name].role == role)
        )

    def role_totals(self, role: str, names: tuple[str, ...]) -> dict[str, float]:
        return {n: self.total(n, role) for n in names}

    def env_totals(self) -> dict[str, float]:
        """Every `env/<env>/<counter>` total, summed over all processes and incarnations."""
        out: dict[str, float] = {}
        for counters in self._totals.values():
            for key, value in counters.items():
                if key.startswith(ENV_PREFIX):
                    out[key] = out.get(key, 0.0) + value
        return out

    def sample(self, totals: dict[str, float], now: float | None = None) -> None:
        """Record run totals now (call about once a second) for the windowed rates."""
        now = time.time() if now is None else now
        self._samples.append((now, dict(totals)))
        while len(self._samples) > 2 and now - self._samples[1][0] >= _KEEP_S:
            self._samples.popleft()

    def _window(self, window_s: float) -> tuple[tuple[float, dict[str, float]], tuple[float, dict[str, float]]] | None:
        """(oldest sample at most `window_s` before the newest, newest), or None with fewer than two."""
        if len(self._samples) < 2:
            return None
        last = self._samples[-1]
        first = next(s for s in self._samples if last[0] - s[0] <= window_s + 1e-9)
        return (self._samples[-2], last) if first is last else (first, last)

    def rate(self, key: str, window_s: float = RATE_WINDOW_S) -> float:
        """Per-second increase of a total over the window."""
        w = self._window(window_s)
        if w is None:
            return 0.0
        (t0, a), (t1, b) = w
        return (b.get(key, 0.0) - a.get(key, 0.0)) / max(t1 - t0, 1e-9)

    def window_delta(self, key: str, window_s: float = RATE_WINDOW_S) -> float:
        """Increase of a total over the window."""
        w = self._window(window_s)
        if w is None:
            return 0.0
        return w[1][1].get(key, 0.0) - w[0][1].get(key, 0.0)


def env_outcomes(book: StatsBook, window_s: float = OUTCOME_WINDOW_S) -> dict[str, dict[str, float]]:
    """Per environment: run totals (episodes, successes, env_steps) and, over the window, reward_mean,
    success_rate and invalid_action_ratio (0.0 when the window holds no episode / step)."""
    totals = book.env_totals()
    envs = sorted({key[len(ENV_PREFIX) :].rsplit("/", 1)[0] for key in totals})
    out = {}
    for env in envs:
        k = f"{ENV_PREFIX}{env}/"
        d_eps, d_steps = book.window_delta(k + "episodes", window_s), book.window_delta(k + "env_steps", window_s)
        out[env] = {
            "episodes": totals.get(k + "episodes", 0.0),
            "successes": totals.get(k + "successes", 0.0),
            "env_steps": totals.get(k + "env_steps", 0.0),
            "reward_mean": book.window_delta(k + "episode_return_sum", window_s) / d_eps if d_eps else 0.0,
            "success_rate": book.window_delta(k + "successes", window_s) / d_eps if d_eps else 0.0,
            "invalid_action_ratio": book.window_delta(k + "invalid_actions", window_s) / d_steps if d_steps else 0.0,
        }
    return out
