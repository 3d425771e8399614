"""The episode loop: the one place where an env is played through a memory module, step by step.

    outcome = await play(env, mem, generate, on_step, seed=seed)           # inside an asyncio process
    outcome = asyncio.run(play(env, mem, generate, on_step, seed=seed))    # from synchronous code

Per step: the memory turns the current observation into chat messages (and, when it was made with the
model's tokenizer, into the prompt token ids an engine gets); `generate(turn)` answers them; the env steps
on the answer's text; `on_step(record)` sees the whole step; the memory records it. The actor (sampling,
streaming transitions), the evaluator (its own sampling, nothing sent), the format warm start's
demonstrations and the tiny model's tokenizer corpus (random admissible actions) all play through this
function, so what each of them sees is what an actor sees.

The caller makes and closes the env and the memory (the warm start reuses one env for many episodes).
An env that declares `blocking` (Java- or subprocess-backed games) has its reset and steps run in a
worker thread, so the other episodes on the same event loop keep going meanwhile.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

from envs.base import TextEnv
from memory import Memory
from memory.prompt import Messages


class Response(Protocol):
    """What `generate` returns: at least the text the env's parser gets."""

    @property
    def text(self) -> str: ...


R = TypeVar("R", bound=Response)


@dataclass(frozen=True)
class Answer:
    """A response written without an engine (random play): its text and, if needed, its token ids."""

    text: str
    response_ids: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class Turn:
    """The state to act in, as `generate` gets it."""

    step: int
    """0-based step index in the episode."""
    observation: str
    anchor: str
    """`info["anchor"]` of this state: GiGPO's step groups gather the steps taken from the same state."""
    messages: Messages
    """The memory's chat messages for this step."""
    prompt_ids: list[int] | None
    """`messages` through the chat template with the generation prompt; None if the memory has no tokenizer."""
    info: Mapping[str, Any]
    """The env's info about this state (from reset or the previous step), e.g. `admissible_actions`."""


@dataclass(frozen=True)
class StepRecord(Generic[R]):
    """One step as `on_step` gets it: the turn, the answer, and what the env made of it."""

    turn: Turn
    response: R
    reward: float
    """The env's reward (without the actor's invalid-action penalty)."""
    terminated: bool
    truncated: bool
    info: dict[str, Any]
    """The info the step returned (about the next state)."""
    next_observation: str = ""
    """The observation the step led to (what an LLM judge sees as the episode's end, actors/judge.py)."""

    @property
    def valid(self) -> bool:
        """Whether the answer parsed into an action."""
        return bool(self.info.get("valid", True))

    @property
    def done(self) -> bool:
        return bool(self.terminated or self.truncated)


@dataclass(frozen=True)
class EpisodeOutcome:
    """How an episode ended."""

    steps: int
    env_return: float
    """Sum of the env's rewards, in step order (without the invalid-action penalty)."""
    invalid: int
    """Steps whose answer did not parse."""
    success: bool
    """`info["success"]` of the last step."""
    ended: bool
    """False when `step_limit` stopped the episode before the env ended it."""


async def _call_env(blocking: bool, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    return await asyncio.to_thread(fn, *args, **kwargs) if blocking else fn(*args, **kwargs)


async def play(env: TextEnv, mem: Memory, generate: Callable[[Turn], R | Awaitable[R]],
               on_step: Callable[[StepRecord[R]], None | Awaitable[None]] | None = None, *, seed: int,
               step_limit: int | None = None) -> EpisodeOutcome:
    """Play one episode of `env` from `seed` until it terminates or truncates (or after `step_limit` steps).

    `generate` and `on_step` may be plain functions or coroutine functions. `on_step` runs after the env
    step and before the memory records it; an exception in either ends the episode and propagates."""
    blocking = bool(env.blocking)
    obs, info = await _call_env(blocking, env.reset, seed=seed)
    mem.reset(env.instructions)
    has_ids = mem.fitter.tokenizer is not None
    total, invalid, step = 0.0, 0, 0
    while True:
        messages = mem.messages(obs)
        turn = Turn(step, obs, str(info.get("anchor", "")), messages,
                    mem.fitter.token_ids(messages) if has_ids else None, info)
        response = generate(turn)
        if inspect.isawaitable(response):
            response = await response
        next_obs, reward, terminated, truncated, info = await _call_env(blocking, env.step, response.text)
        record = StepRecord(turn, response, float(reward), bool(terminated), bool(truncated), info, str(next_obs))
        if on_step is not None:
            handled = on_step(record)
            if inspect.isawaitable(handled):
                await handled
        total, invalid = total + record.reward, invalid + (not record.valid)
        mem.record(obs, response.text, reward=record.reward, info=info)
        obs, step = next_obs, step + 1
        if record.done or step == step_limit:
            return EpisodeOutcome(step, total, invalid, bool(info.get("success", False)), record.done)


__all__ = ["Answer", "EpisodeOutcome", "Response", "StepRecord", "Turn", "play"]
