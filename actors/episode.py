"""The episode loop: the one place where an env is played through a memory module, step by step.

    outcome = await play(env, mem, generate, on_step, seed=seed)           # inside an asyncio process
    outcome = asyncio.run(play(env, mem, generate, on_step, seed=seed))    # from synchronous code
    outcomes = await play_match(env, [mem0, mem1], generate, [on_step0, on_step1], seed=seed)   # self-play

Per step: the memory turns the current observation into chat messages (and, when it was made with the
model's tokenizer, into the prompt token ids an engine gets); `generate(turn)` answers them; the env steps
on the answer's text; `on_step(record)` sees the whole step; the memory records it. The actor (sampling,
streaming transitions), the evaluator (its own sampling, nothing sent), the format warm start's
demonstrations and the tiny model's tokenizer corpus (random admissible actions) all play through this
function, so what each of them sees is what an actor sees.

The caller makes and closes the env and the memory (the warm start reuses one env for many episodes).
An env that declares `blocking` (Java- or subprocess-backed games) has its reset and steps run in a
worker thread, so the other episodes on the same event loop keep going meanwhile. With `calls=EnvCalls(...)`
(the actors) those threads are bounded by a timeout, and a reset or step that raises or times out ends the
episode with `EnvFailure` (its cause: "raised" or "timeout"), which the actor retries.

`play_match` is the same loop over a game whose every seat the caller plays (self-play, a `MatchEnv`): a memory
per seat, `generate` asked for the seat to move, each seat's steps reported as a trajectory of its own. Which seats
are trained, and which policy answers each, is the caller's choice (a frozen seat: actors/actor.py).
"""

from __future__ import annotations

import asyncio
import inspect
import threading
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Generic, Protocol, TypeVar

import numpy as np

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
    images: tuple[np.ndarray, ...] = ()
    """The pictures the prompt shows, in the order of its image placeholders (the memory's `prompt_images`;
    none unless the memory shows images)."""


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


class EnvFailure(Exception):
    """An env's reset or step failed: `cause` is "timeout" (no return within the step timeout) or "raised"."""

    def __init__(self, cause: str, detail: str):
        super().__init__(f"env {cause}: {detail}")
        self.cause = cause


class TooManyHungSteps(RuntimeError):
    """More env calls are stuck in their threads than the actor tolerates (actors.max_hung_steps)."""


class EnvCalls:
    """Runs an actor's env calls. A blocking env's reset/step runs in a daemon thread of its own, awaited for at
    most `timeout_s` (0: no limit); one that raises or times out becomes `EnvFailure`.

    A Python thread cannot be killed: a timed-out call's thread is left to finish on its own (its result is thrown
    away) and counted in `hung` until it does. At most `max_hung` may be stuck at once; one more raises
    `TooManyHungSteps`, which ends the actor (its restart ends the threads; they are daemons, so they never keep
    a process from exiting). A non-blocking env runs on the event loop: it can raise, but a hang there cannot be
    cut short (the actor stops reporting and the broker declares it dead)."""

    def __init__(self, timeout_s: float = 0.0, max_hung: int = 8):
        self.timeout_s, self.max_hung = timeout_s, max_hung
        self.hung = 0  # calls past their timeout whose thread still runs
        self._ids = 0

    async def call(self, blocking: bool, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        name = getattr(fn, "__name__", "call")
        if not blocking:
            try:
                return fn(*args, **kwargs)
            except Exception as exc:
                raise EnvFailure("raised", f"{name}: {exc!r}") from exc
        loop = asyncio.get_running_loop()
        done: asyncio.Future[Any] = loop.create_future()

        def settle(value: Any, exc: BaseException | None) -> None:
            if done.done():
                return
            if exc is not None:
                done.set_exception(exc)
            else:
                done.set_result(value)

        def run() -> None:
            try:
                value, exc = fn(*args, **kwargs), None
            except BaseException as e:  # handed to the awaiting coroutine, which decides
                value, exc = None, e
            try:
                loop.call_soon_threadsafe(settle, value, exc)
            except RuntimeError:  # the loop is gone (the actor stopped): nobody waits for this answer
                pass

        self._ids += 1
        threading.Thread(target=run, name=f"env-{name}-{self._ids}", daemon=True).start()
        try:
            if self.timeout_s > 0:
                # asyncio.timeout, not wait_for: on Python 3.11 wait_for swallows a cancellation that comes as the
                # call ends, and the lane then plays on while its actor waits for it to stop.
                async with asyncio.timeout(self.timeout_s):
                    return await asyncio.shield(done)
            return await done
        except TimeoutError:
            self.hung += 1
            done.add_done_callback(self._unhang)
            if self.hung > self.max_hung:
                raise TooManyHungSteps(
                    f"{self.hung} env calls still running after env.step_timeout_s="
                    f"{self.timeout_s}; more than actors.max_hung_steps={self.max_hung}"
                ) from None
            raise EnvFailure("timeout", f"{name} gave no answer within env.step_timeout_s={self.timeout_s}") from None
        except Exception as exc:
            raise EnvFailure("raised", f"{name}: {exc!r}") from exc

    def _unhang(self, fut: asyncio.Future[Any]) -> None:
        self.hung -= 1
        if not fut.cancelled():
            fut.exception()  # (retrieved: a late failure of an abandoned call is nobody's error)

    def close(self, env: TextEnv, abandoned: bool) -> None:
        """Close `env`; after a timed-out call (`abandoned`), in a thread, not waited for: the env may still be in
        use by the stuck call, and closing it may well be what unblocks that call (a sandbox, a subprocess)."""
        if not abandoned:
            env.close()
            return
        threading.Thread(target=_close_quietly, args=(env,), name="env-close", daemon=True).start()


def _close_quietly(env: TextEnv) -> None:
    try:
        env.close()
    except Exception:  # noqa: BLE001 (an env whose step hung may fail to close too; nothing to do about it)
        pass


async def play(
    env: TextEnv,
    mem: Memory,
    generate: Callable[[Turn], R | Awaitable[R]],
    on_step: Callable[[StepRecord[R]], None | Awaitable[None]] | None = None,
    *,
    seed: int,
    step_limit: int | None = None,
    calls: EnvCalls | None = None,
) -> EpisodeOutcome:
    """Play one episode of `env` from `seed` until it terminates or truncates (or after `step_limit` steps).

    `generate` and `on_step` may be plain functions or coroutine functions. `on_step` runs after the env
    step and before the memory records it; an exception in either ends the episode and propagates.
    `calls`: runs the env's reset and steps (timeouts; failures as `EnvFailure`); None: in a thread (blocking
    envs) or inline, their exceptions propagating as they are."""
    blocking = bool(env.blocking)
    call = _call_env if calls is None else calls.call
    obs, info = await call(blocking, env.reset, seed=seed)
    mem.reset(env.instructions)
    has_ids = mem.fitter.tokenizer is not None
    total, invalid, step = 0.0, 0, 0
    while True:
        messages = mem.messages(obs, image=info.get("image"))
        turn = Turn(
            step,
            obs,
            str(info.get("anchor", "")),
            messages,
            mem.fitter.token_ids(messages) if has_ids else None,
            info,
            tuple(mem.prompt_images),
        )
        response = generate(turn)
        if inspect.isawaitable(response):
            response = await response
        next_obs, reward, terminated, truncated, info = await call(blocking, env.step, response.text)
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


class MatchEnv(TextEnv, Protocol):
    """A game whose every seat the caller plays (envs/arena.py with `opponent="self"` or `"frozen"`): reset's and
    every step's `info["seat"]` is the seat to move, whose turn the observation is; a step's reward is the mover's; a
    game that ends puts each seat's outcome and last observation in `info["seat_rewards"]` and
    `info["seat_observations"]`."""

    seat_instructions: tuple[str, ...]
    """Each seat's instructions (set by reset)."""
    trained_seat: int | None
    """The one seat whose turns are trained, the others played by a frozen policy (set by reset); None: every seat's."""


async def play_match(
    env: MatchEnv,
    mems: Sequence[Memory],
    generate: Callable[[Turn], R | Awaitable[R]],
    on_step: Sequence[Callable[[StepRecord[R]], None | Awaitable[None]]],
    *,
    seed: int,
    calls: EnvCalls | None = None,
) -> list[EpisodeOutcome]:
    """Play one game of `env` from `seed`, every seat through `generate` (self-play); seat s's turns are built by
    `mems[s]` and reported to `on_step[s]`, numbered 0, 1, ... as a trajectory of their own. Returns each seat's
    outcome.

    A seat's step is its move and what followed until its next turn, as an episode's step against a fixed opponent
    is: its record waits for the seat's next turn (reward: the env's for the move, done False) or the end of the game
    (every seat's last record is done, and a seat whose move did not end the game gets its outcome from
    `info["seat_rewards"]` on its last step; a truncated game gives no outcome). An invalid answer is a step of its
    own. A record's `info` is what its env step returned (the move's validity; the rest is about the next mover's
    turn), its `next_observation` the seat's own next one. Exceptions propagate as in `play`. A seat that never
    moved has no steps: an env must let every seat move before its game can end."""
    blocking = bool(env.blocking)
    call = _call_env if calls is None else calls.call
    obs, info = await call(blocking, env.reset, seed=seed)
    for mem, instructions in zip(mems, env.seat_instructions, strict=True):
        mem.reset(instructions)
    has_ids = mems[0].fitter.tokenizer is not None
    held: list[StepRecord[R] | None] = [None] * len(mems)  # each seat's last step, until what followed is known
    steps, totals, invalid = [0] * len(mems), [0.0] * len(mems), [0] * len(mems)

    async def report(seat: int, record: StepRecord[R]) -> None:
        handled = on_step[seat](record)
        if inspect.isawaitable(handled):
            await handled
        totals[seat] += record.reward
        invalid[seat] += not record.valid

    while True:
        seat = int(info["seat"])
        mem, before = mems[seat], held[seat]
        if before is not None:  # its step led to this turn
            await report(seat, replace(before, next_observation=obs))
        messages = mem.messages(obs, image=info.get("image"))
        turn = Turn(
            steps[seat],
            obs,
            str(info.get("anchor", "")),
            messages,
            mem.fitter.token_ids(messages) if has_ids else None,
            info,
            tuple(mem.prompt_images),
        )
        response = generate(turn)
        if inspect.isawaitable(response):
            response = await response
        next_obs, reward, terminated, truncated, info = await call(blocking, env.step, response.text)
        held[seat] = StepRecord(turn, response, float(reward), False, False, info)  # (next_obs: the next mover's)
        mem.record(obs, response.text, reward=float(reward), info=info)
        obs, steps[seat] = next_obs, steps[seat] + 1
        if terminated or truncated:
            break
    outcomes = info["seat_rewards"] if terminated else None
    for s, record in enumerate(held):
        if record is None:
            continue
        if outcomes is not None:
            own = record.reward + (outcomes[s] if s != seat else 0.0)  # (the mover's reward holds its outcome already)
            record = replace(
                record,
                reward=own,
                info={**record.info, "success": outcomes[s] > 0},
                next_observation=info["seat_observations"][s],
            )
        await report(s, replace(record, terminated=bool(terminated), truncated=not terminated))
    return [
        EpisodeOutcome(steps[s], totals[s], invalid[s], outcomes is not None and outcomes[s] > 0, True)
        for s in range(len(mems))
    ]


__all__ = [
    "Answer",
    "EnvCalls",
    "EnvFailure",
    "EpisodeOutcome",
    "MatchEnv",
    "Response",
    "StepRecord",
    "TooManyHungSteps",
    "Turn",
    "play",
    "play_match",
]
