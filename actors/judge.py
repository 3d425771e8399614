"""LLM judges as rewards: a finished episode, written into `judges.template`, is asked of a judge server; the
score parsed from the answer joins the env reward of the episode's last step by the `judges.combine` rule.

    judge = Judge(spec.judge, [EngineClient(url, session, spec.judge.timeout_s, versioned=False)], tokenizer)
    verdict = await judge.judge(EpisodeRecord(env.instructions, steps, final_observation, success))
    reward = combine(spec.judge.combine, last_env_reward, verdict.score, spec.judge.weight)

The actor (actors/actor.py) holds back an episode's last transition until its verdict is in; its other episodes
keep playing meanwhile. Judges are vLLM servers of their own (the launcher starts them as judge-<i> with the
engines' server command): actors never generate on them, and the learner never publishes weights to them.

The pure parts are `render` (the template), `parse_score` (the answer; a typed failure, never an exception) and
`combine` (the rule); `Judge` only picks a server, fits the prompt into its context, and turns every failure
(no score in the answer, an error, a timeout) into `default_score` with the reason counted apart.
See docs/judges.md.
"""

from __future__ import annotations

import asyncio
import math
import re
import string
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from actors.servers import FixedServers
from actors.spec import JudgeSpec
from engines.client import EngineClient, EngineError

PLACEHOLDERS: Mapping[str, str] = {
    "task": "the env's instructions (the text at the top of every policy prompt)",
    "transcript": "every step: its observation, the policy's answer and the env's reward (oldest steps left out "
    "when the prompt would not fit the judge's context)",
    "final_observation": "the observation the last action led to",
    "env_return": "the sum of the env's rewards over the episode (without invalid-action penalties)",
    "steps": "the number of steps",
    "success": "yes or no: whether the env counts the episode a success",
}
"""What a template may name, each with what it becomes."""


@dataclass(frozen=True)
class JudgedStep:
    """One step as the judge sees it."""

    observation: str
    """The observation the policy acted on."""
    action: str
    """The policy's answer (its text, as the env's parser got it)."""
    reward: float
    """The env's reward of the step (no penalty)."""


@dataclass(frozen=True)
class EpisodeRecord:
    """A finished episode: what the template's placeholders are made of."""

    task: str
    steps: tuple[JudgedStep, ...]
    final_observation: str
    success: bool

    @property
    def env_return(self) -> float:
        return sum(s.reward for s in self.steps)


def transcript(steps: Sequence[JudgedStep], left_out: int = 0) -> str:
    """The steps as text, numbered from `left_out + 1`; a first line says how many earlier ones were left out."""
    parts = [f"({left_out} earlier steps left out)"] if left_out else []
    for i, s in enumerate(steps, start=left_out + 1):
        parts.append(f"Step {i}\nObservation:\n{s.observation}\nAction: {s.action}\nReward: {s.reward:g}")
    return "\n\n".join(parts)


def render(template: str, episode: EpisodeRecord, keep_last: int | None = None) -> str:
    """`template` with its placeholders (`PLACEHOLDERS`) filled from `episode`; the transcript holds only the
    last `keep_last` steps when given. Raises KeyError/ValueError for a template `template_errors` refuses."""
    steps = episode.steps if keep_last is None else episode.steps[len(episode.steps) - keep_last :]
    values: dict[str, Any] = {
        "task": episode.task,
        "transcript": transcript(steps, len(episode.steps) - len(steps)),
        "final_observation": episode.final_observation,
        "env_return": episode.env_return,
        "steps": len(episode.steps),
        "success": "yes" if episode.success else "no",
    }
    return template.format_map(values)


_SAMPLE = EpisodeRecord("task", (JudgedStep("observation", "action", 1.0),), "final observation", True)


def template_errors(template: str) -> list[str]:
    """What is wrong with `template` (empty: nothing): unknown or positional placeholders, unbalanced braces,
    a format spec its value cannot take."""
    known = ", ".join("{" + name + "}" for name in PLACEHOLDERS)
    try:
        names = [name for _, name, _, _ in string.Formatter().parse(template) if name is not None]
    except ValueError as exc:
        return [
            f"judges.template does not parse ({exc}): write {{{{ and }}}} for a literal brace; the "
            f"placeholders are {known}."
        ]
    unknown = sorted({n for n in names if n not in PLACEHOLDERS})
    if unknown:
        shown = ", ".join("{" + n + "}" for n in unknown)
        return [
            f"judges.template names {shown}, which is not a placeholder; the placeholders are {known} "
            f"(write {{{{ and }}}} for a literal brace)."
        ]
    try:
        render(template, _SAMPLE)
    except (ValueError, KeyError, IndexError) as exc:
        return [
            f"judges.template does not render: {exc} (the placeholders are {known}; {{env_return}} is a "
            f"number, {{steps}} an integer, the others text)."
        ]
    return []


# ----------------------------------------------------------------------------------------------- the answer


@dataclass(frozen=True)
class ScoreParseFailure:
    """Why an answer holds no score."""

    reason: str


def parse_score(text: str, pattern: re.Pattern[str]) -> float | ScoreParseFailure:
    """Group 1 of the LAST match of `pattern` in `text`, as a finite float; a judge that reasons first ends with
    its verdict. Every other case is a ScoreParseFailure saying why (never an exception)."""
    last = None
    for match in pattern.finditer(text):
        last = match
    if last is None:
        return ScoreParseFailure(f"no match of {pattern.pattern!r} in the answer")
    raw = last.group(1)
    if raw is None:
        return ScoreParseFailure(f"group 1 of {pattern.pattern!r} took no part in its last match")
    try:
        value = float(raw.strip())
    except ValueError:
        return ScoreParseFailure(f"{raw!r} is not a number")
    if not math.isfinite(value):
        return ScoreParseFailure(f"{raw!r} is not a finite number")
    return value


def pattern_errors(pattern: str) -> list[str]:
    """What is wrong with `judges.score_pattern` (empty: nothing)."""
    try:
        compiled = re.compile(pattern)
    except re.error as exc:
        return [f"judges.score_pattern={pattern!r} is not a regular expression ({exc})."]
    if compiled.groups < 1:
        return [
            f"judges.score_pattern={pattern!r} has no group: put the score in parentheses, e.g. "
            f"'Score: (-?\\d+(?:\\.\\d+)?)'."
        ]
    return []


# ----------------------------------------------------------------------------------------------- the reward

COMBINE_RULES: Mapping[str, Callable[[float, float], float]] = {
    "add": lambda r, ws: r + ws,
    "replace": lambda r, ws: ws,
    "multiply": lambda r, ws: r * ws,
}
"""rule -> f(r, w*s): r is the env reward of the episode's last step, w*s the weighted judge score."""


def combine(rule: str, env_reward: float, score: float, weight: float) -> float:
    """The last step's reward: `env_reward` and the judge's `score` joined by `rule` (COMBINE_RULES)."""
    try:  # not `lookup`: the error lists the rules in the table's order, the default (add) first
        fn = COMBINE_RULES[rule]
    except KeyError:
        raise ValueError(f"judges.combine={rule!r} is unknown; known: {', '.join(COMBINE_RULES)}") from None
    return fn(env_reward, weight * score)


# ----------------------------------------------------------------------------------------------- asking

Outcome = Literal["parsed", "parse_failure", "error"]
COUNTERS: Mapping[str, str] = {
    "parsed": "judge_parsed",
    "parse_failure": "judge_parse_failures",
    "error": "judge_errors",
}
"""The actor's counter of each outcome (with judge_requests = their sum)."""


@dataclass(frozen=True)
class Verdict:
    """What one episode's judging gave."""

    score: float
    """The parsed score, or default_score (parse failure, error, timeout)."""
    outcome: Outcome
    latency_s: float
    """From sending the request to its answer (or failure)."""
    detail: str = ""
    """Why the outcome is not `parsed`."""


class Judge:
    """Asks the judge servers (`FixedServers`: least loaded first; one that just failed only when all did)."""

    def __init__(self, spec: JudgeSpec, clients: Sequence[EngineClient], tokenizer: Any):
        self.servers = FixedServers(clients, "judge (judges.count >= 1)")
        self.spec, self.clients, self.tokenizer = spec, self.servers.clients, tokenizer
        self.pattern = re.compile(spec.score_pattern)

    @property
    def load(self) -> dict[str, int]:
        """Requests in flight per judge URL."""
        return self.servers.load

    def pick(self) -> EngineClient:
        """The judge with the fewest requests in flight (ties: in turn), among those that have not just failed."""
        return self.servers.pick()

    def prompt_ids(self, episode: EpisodeRecord) -> list[int] | None:
        """The judge's prompt as token ids, with as many of the latest steps as fit `max_prompt_tokens`
        (None: not even without any step)."""

        def ids(keep: int) -> list[int]:
            return self._encode(render(self.spec.template, episode, keep_last=keep))

        n = len(episode.steps)
        whole = ids(n)
        if len(whole) <= self.spec.max_prompt_tokens:
            return whole
        lo, hi, best = 0, n - 1, None  # the most steps that fit: fewer steps, shorter prompt
        while lo <= hi:
            mid = (lo + hi) // 2
            got = ids(mid)
            if len(got) <= self.spec.max_prompt_tokens:
                best, lo = got, mid + 1
            else:
                hi = mid - 1
        return best

    def _encode(self, text: str) -> list[int]:
        if getattr(self.tokenizer, "chat_template", None):
            return list(
                self.tokenizer.apply_chat_template(
                    [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True, return_dict=False
                )
            )
        return list(self.tokenizer.encode(text))  # a base model without a chat template: the text alone

    async def judge(self, episode: EpisodeRecord) -> Verdict:
        """The verdict on `episode`; never raises for a judge's failure (default_score, outcome `error`)."""
        default = self.spec.default_score
        ids = self.prompt_ids(episode)
        if ids is None:
            return Verdict(
                default,
                "error",
                0.0,
                f"the prompt does not fit {self.spec.max_prompt_tokens} tokens even without the transcript",
            )
        client = self.pick()
        started = time.monotonic()
        try:
            with self.servers.using(client):
                async with asyncio.timeout(self.spec.timeout_s):
                    gen = await client.generate(ids, self.spec.sampling)
        except (EngineError, TimeoutError) as exc:
            self.servers.failed(client)
            reason = str(exc) or f"no answer within judges.timeout_s={self.spec.timeout_s}"
            return Verdict(default, "error", time.monotonic() - started, reason)
        latency = time.monotonic() - started
        score = parse_score(gen.text, self.pattern)
        if isinstance(score, ScoreParseFailure):
            return Verdict(default, "parse_failure", latency, score.reason)
        if not math.isfinite(score * self.spec.weight):
            return Verdict(default, "parse_failure", latency, f"{score} x judges.weight is not finite")
        return Verdict(score, "parsed", latency)


def verdict_counters(verdict: Verdict) -> dict[str, float]:
    """The actor's counters for one verdict: judge_requests, the outcome's counter, the score's sum, and the
    latency of an answered request (judge_latency_s_sum / judge_latency_count is the mean)."""
    out = {"judge_requests": 1.0, COUNTERS[verdict.outcome]: 1.0, "judge_score_sum": verdict.score}
    if verdict.outcome != "error":
        out.update(judge_latency_s_sum=verdict.latency_s, judge_latency_count=1.0)
    return out


__all__ = [
    "COMBINE_RULES",
    "COUNTERS",
    "PLACEHOLDERS",
    "EpisodeRecord",
    "Judge",
    "JudgedStep",
    "ScoreParseFailure",
    "Verdict",
    "combine",
    "parse_score",
    "pattern_errors",
    "render",
    "template_errors",
    "transcript",
    "verdict_counters",
]
