"""Rewards on response tokens: a function of the run's (`trainer.token_reward=module:function`) that the actor
calls on every step, whose values sit on the step's response tokens (verl's `token_level_rewards`).

    def my_reward(step: TokenRewardStep, **kwargs) -> Sequence[float]:   # one value per response token
        ...

    rewards = TokenRewards.load("my_module:my_reward", {"scale": 0.1})
    token_rewards, problem = rewards(step)   # float32 [T], "" or why none were given

Their sum joins the step's reward (`Transition.reward` is always the step's whole reward); the learner gives
each token its reward to go where the estimator uses returns (REINFORCE++, GAE: `learner/token_rewards.py`) and
the sum elsewhere. A function that raises, or returns the wrong number of values or a nan, gives the step no
token rewards: the step goes on with its env reward, the failure is counted by cause and logged once per cause;
the function never stops an episode. `after_action` and `per_token_cost` are ready ones. See docs/algorithms.md,
"Rewards on tokens".
"""

from __future__ import annotations

import importlib
import inspect
import logging
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

log = logging.getLogger("actor")

FAILURES = ("raised", "not_numbers", "wrong_length", "non_finite")
"""Why a step got no token rewards, each counted as `token_reward_failures_<cause>`."""


@dataclass(frozen=True)
class TokenRewardStep:
    """One step as a token reward function sees it."""

    observation: str
    """The observation the policy acted on."""
    response_text: str
    """The policy's answer, as the env's parser got it."""
    response_ids: np.ndarray
    """[T] int32: the answer's token ids (the function returns one value per id)."""
    tokenizer: Any
    """The policy's tokenizer (to find which tokens hold which text)."""
    reward: float
    """The env's reward of the step."""
    valid: bool
    """Whether the answer parsed into an action."""
    info: Mapping[str, Any] = field(default_factory=dict)
    """The env's info of the step."""


TokenRewardFn = Callable[..., Sequence[float]]


def load_function(spec: str) -> TokenRewardFn:
    """`module:function` -> the function; ValueError saying what is wrong otherwise."""
    module_name, sep, name = spec.partition(":")
    if not sep or not module_name or not name:
        raise ValueError(
            f"trainer.token_reward={spec!r}: write it as module:function, e.g. actors.token_rewards:after_action"
        )
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # any import-time error of the user's module
        raise ValueError(
            f"trainer.token_reward={spec!r}: cannot import {module_name!r} ({exc!r}); it must be "
            f"importable by the actors (on PYTHONPATH)"
        ) from None
    fn = getattr(module, name, None)
    if not callable(fn):
        raise ValueError(f"trainer.token_reward={spec!r}: {module_name} has no function {name!r}")
    return fn


def token_reward_errors(spec: str, kwargs: Mapping[str, Any]) -> list[str]:
    """What is wrong with `trainer.token_reward` and its kwargs, each said with the fix (empty: fine or unset)."""
    if not spec:
        return [f"trainer.token_reward_kwargs={dict(kwargs)} is set but trainer.token_reward is not."] if kwargs else []
    try:
        fn = load_function(spec)
    except ValueError as exc:
        return [str(exc)]
    try:
        inspect.signature(fn).bind(None, **kwargs)
    except TypeError as exc:
        return [
            f"trainer.token_reward={spec!r} cannot be called as {spec.partition(':')[2]}(step, **"
            f"trainer.token_reward_kwargs={dict(kwargs)}): {exc}."
        ]
    except ValueError:  # no signature to read (a builtin): called as it is
        pass
    return []


class TokenRewards:
    """The run's token reward function with its keyword arguments; what it gets wrong is counted, never raised."""

    def __init__(self, fn: TokenRewardFn, kwargs: Mapping[str, Any] | None = None):
        self.fn, self.kwargs = fn, dict(kwargs or {})
        self.counters: Counter[str] = Counter()

    @classmethod
    def load(cls, spec: str, kwargs: Mapping[str, Any] | None = None) -> TokenRewards:
        return cls(load_function(spec), kwargs)

    def __call__(self, step: TokenRewardStep) -> tuple[np.ndarray, str]:
        """(float32 [T] token rewards, "") or (empty, the cause of a failure: one of FAILURES)."""
        tokens = int(step.response_ids.size)
        try:
            values = self.fn(step, **self.kwargs)
        except Exception as exc:  # the user's code: any error is its failure, never the episode's
            return self._failed("raised", f"{exc!r}")
        try:
            out = np.asarray(values, dtype=np.float64).reshape(-1)
        except (TypeError, ValueError):
            return self._failed("not_numbers", f"returned {type(values).__name__}, not a sequence of numbers")
        if out.size != tokens:
            return self._failed("wrong_length", f"returned {out.size} values for {tokens} response tokens")
        with np.errstate(over="ignore"):
            as32 = out.astype(np.float32)
        if not np.isfinite(as32).all():
            return self._failed("non_finite", "returned nan, inf or values beyond float32")
        self.counters.update(token_reward_steps=1)
        self.counters["token_reward_sum"] += float(as32.sum(dtype=np.float64))
        return as32, ""

    def _failed(self, cause: str, detail: str) -> tuple[np.ndarray, str]:
        if not self.counters[f"token_reward_failures_{cause}"]:  # once per cause: a bad function fails every step
            log.warning(
                "token reward function %s %s: those steps get no token rewards (counted as token_reward_failures_%s)",
                getattr(self.fn, "__name__", self.fn),
                detail,
                cause,
            )
        self.counters.update({"token_reward_failures": 1, f"token_reward_failures_{cause}": 1})
        return np.zeros(0, np.float32), cause


def after_action(step: TokenRewardStep, *, penalty: float = -0.01, tag: str = "</action>") -> list[float]:
    """`penalty` on every response token after the first `tag` (text the env's parser never reads); nothing
    for an answer without the tag. The first token whose prefix holds the whole tag closes it: found by bisection
    on decoded prefixes (a prefix holds the tag, so every longer one does)."""
    ids = [int(i) for i in step.response_ids]
    if not ids or tag not in step.response_text:
        return [0.0] * len(ids)
    lo, hi = 1, len(ids)  # the shortest prefix ids[:k] whose text holds the tag; ids[:len] does
    while lo < hi:
        mid = (lo + hi) // 2
        if tag in step.tokenizer.decode(ids[:mid], skip_special_tokens=False):
            hi = mid
        else:
            lo = mid + 1
    return [0.0] * lo + [penalty] * (len(ids) - lo)


def per_token_cost(step: TokenRewardStep, *, cost: float = -0.001) -> list[float]:
    """`cost` on every response token: a length cost that each token pays where it is spent (under REINFORCE++ a
    token's advantage holds the cost of itself and of the tokens after it)."""
    return [cost] * int(step.response_ids.size)
