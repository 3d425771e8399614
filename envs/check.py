"""The launch-time check of a user's env: gymnasium's env checker plus the text protocol (docs/your_env.md).

    errors = env_errors("examples.my_env.guess:GuessEnv", kwargs={}, max_steps=8)   # [] when it keeps the protocol

The launcher (`launcher.checks`) calls it for every `env.name` that is not built in, before any process starts:
the env is built, reset and stepped a few times here, so a broken one is refused with a message that names the
method and the fix instead of failing later in every actor. It stops at the first break, since later checks need
the earlier ones to hold (a `step` cannot be checked after a `reset` that fails). Built-in envs are held to the same
contract by tests/envs/test_env_contract.py.

In order: `env.name` resolves (`envs.user.resolve`) and the constructor takes `env.kwargs`; the env builds; both
spaces are `gymnasium.spaces.Text`; `reset(seed=...)` returns (str, dict) and sets `instructions` (a non-empty str);
the same seed gives the same first observation on another copy, whatever the global RNGs hold (a group's G episodes
reset G copies to one seed); `step(text)` never raises on text its parser refuses and returns (str, real reward,
bool, bool, dict) with `valid`/`success` bools and `anchor` a str where given; `blocking` is a bool where given; then
gymnasium's own `check_env`, its warnings counted as errors (as the built-in envs pass it).
"""

from __future__ import annotations

import contextlib
import math
import random
import warnings
from collections.abc import Mapping
from numbers import Real
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium.utils.env_checker import check_env

from envs.base import VALIDATION_SEEDS
from envs.user import DOCS, EnvSourceError, make, resolve

SEEDS = (0, 7, VALIDATION_SEEDS[-1])
"""Seeds reset with: the train range's start, another, and the largest seed the actors ever give."""
PROBES = ("", "hello", "<action>zzz</action>", "<action>1</action>", "left")
"""Answers stepped with: mostly text no parser accepts, as a model's first answers are."""


class ProtocolError(Exception):
    """One break of the text protocol, said with the method and the fix."""


def env_errors(name: str, kwargs: Mapping[str, Any], max_steps: int) -> list[str]:
    """Why the user's env `name` cannot be trained with `kwargs` (empty: it keeps the protocol); each message starts
    with `env.name=<name>:`, names the method that broke and says how to fix it."""
    state, np_state = random.getstate(), np.random.get_state()  # the checks disturb them on purpose
    try:
        _check(name, dict(kwargs), max_steps)
    except EnvSourceError as exc:  # (its message starts with the name)
        return [f"env.name={exc}"]
    except ProtocolError as exc:
        return [f"env.name={name!r}: {exc}"]
    finally:
        random.setstate(state)
        np.random.set_state(np_state)
    return []


def _check(name: str, kwargs: dict[str, Any], max_steps: int) -> None:
    source = resolve(name)
    if source.params is not None:
        unknown = sorted(set(kwargs) - set(source.params))
        if unknown:
            known = sorted(p for p in source.params if p not in ("self", "render_mode"))
            raise ProtocolError(f"env.kwargs has {unknown}, which its constructor does not take; it takes {known}.")
    env, twin = _build(name, kwargs, max_steps), _build(name, kwargs, max_steps)
    try:
        raw = env.unwrapped  # the user's own env: the checks below see what it returns, not the wrapper's repairs
        _check_spaces(raw)
        first = _check_reset(raw)
        _check_seeds(raw, twin.unwrapped, first)
        _check_steps(raw)
        blocking = getattr(raw, "blocking", False)  # optional: most envs do not block
        if not isinstance(blocking, bool):
            raise ProtocolError(
                f"blocking is {blocking!r}: declare `blocking = True` only if reset/step block for long (a "
                f"subprocess, a JVM, a network call; the actor then runs them in a thread), else leave it out."
            )
        _gymnasium_check(raw)
    finally:
        for e in (env, twin):
            _close(e)


def _build(name: str, kwargs: dict[str, Any], max_steps: int) -> gym.Env:
    try:
        return make(name, max_steps=max_steps, **kwargs)
    except EnvSourceError:
        raise
    except Exception as exc:
        raise ProtocolError(
            f"__init__ raised {_said(exc)} when built with env.kwargs={kwargs}; fix the constructor or env.kwargs."
        ) from None


def _check_spaces(env: gym.Env) -> None:
    for which in ("observation_space", "action_space"):
        space = getattr(env, which, None)
        if not isinstance(space, gym.spaces.Text):
            raise ProtocolError(
                f"{which} is {_short(space)}, not text: set `self.{which} = gymnasium.spaces.Text(max_length=8192, "
                f"charset=...)` in __init__ (envs.base.text_space() is one with printable characters): "
                f"{'observations' if which == 'observation_space' else 'actions'} are text in this protocol."
            )


def _check_reset(env: gym.Env) -> str:
    """The first observation of seed SEEDS[0]; reset returns (str, dict) for every seed, and `instructions` is set."""
    first = ""
    for seed in SEEDS:
        out = _call(env.reset, f"reset(seed={seed})", seed=seed)
        if not (isinstance(out, tuple) and len(out) == 2):
            raise ProtocolError(
                f"reset(seed={seed}) returned {_shape(out)}; return the pair (observation, info): the observation "
                f"as text (str) and info a dict, as gymnasium's Env.reset."
            )
        obs, info = out
        if not isinstance(obs, str):
            raise ProtocolError(
                f"reset(seed={seed}) returned an observation of type {type(obs).__name__} ({_short(obs)}); return it "
                f"as text (str), what the model reads: render the state in words, e.g. "
                f"`return f'Guess a number from 1 to {{self.high}}.', {{}}`."
            )
        if not isinstance(info, dict):
            raise ProtocolError(f"reset(seed={seed}) returned info of type {type(info).__name__}; return a dict.")
        first = first or obs
    instructions = getattr(env, "instructions", None)
    if not (isinstance(instructions, str) and instructions.strip()):
        raise ProtocolError(
            f"instructions is {_short(instructions)}; set `instructions` (a non-empty str) on the class or in "
            f"__init__: the task text at the top of every prompt, what the game is and how to answer "
            f"(e.g. 'Answer with <action>NUMBER</action>.')."
        )
    return first


def _check_seeds(env: gym.Env, twin: gym.Env, first: str) -> None:
    random.seed(1)
    np.random.seed(1)
    again = _call(env.reset, f"reset(seed={SEEDS[0]})", seed=SEEDS[0])[0]
    random.seed(2)
    np.random.seed(2)
    other = _call(twin.reset, f"reset(seed={SEEDS[0]})", seed=SEEDS[0])[0]
    if not first == again == other:
        raise ProtocolError(
            f"reset(seed={SEEDS[0]}) gave different first observations ({_short(first)} then {_short(other)}): a "
            f"group's G episodes reset G copies to one seed and must start identical. Call "
            f"`super().reset(seed=seed)` first and draw every random choice from `self.np_random`, never from "
            f"`random` or `np.random` (many episodes share one process)."
        )


def _check_steps(env: gym.Env) -> None:
    env.reset(seed=SEEDS[0])
    for text in PROBES:
        out = _call(
            env.step,
            f"step({text!r})",
            text,
            fix="an answer the parser refuses is an invalid action, never an exception: return the same observation, "
            "reward 0, terminated False and info['valid'] = False (info['parse_error'] says why)",
        )
        _check_step_result(text, out)
        if out[2] or out[3]:
            env.reset(seed=SEEDS[0])


def _check_step_result(text: str, out: object) -> None:
    call = f"step({text!r})"
    if not (isinstance(out, tuple) and len(out) == 5):
        raise ProtocolError(
            f"{call} returned {_shape(out)}; return five values (observation: str, reward: float, terminated: bool, "
            f"truncated: bool, info: dict), as gymnasium's Env.step (an old gym env's `done` splits into "
            f"terminated, the game ended, and truncated, the game was cut short)."
        )
    obs, reward, terminated, truncated, info = out
    if not isinstance(obs, str):
        raise ProtocolError(
            f"{call} returned an observation of type {type(obs).__name__} ({_short(obs)}); return it as text (str)."
        )
    if isinstance(reward, bool) or not isinstance(reward, Real) or not math.isfinite(float(reward)):
        raise ProtocolError(f"{call} returned reward {_short(reward)}; return a finite float.")
    for what, flag in (("terminated", terminated), ("truncated", truncated)):
        if not isinstance(flag, bool | np.bool_):
            raise ProtocolError(f"{call} returned {what}={_short(flag)}; return a bool.")
    if not isinstance(info, dict):
        raise ProtocolError(f"{call} returned info of type {type(info).__name__}; return a dict.")
    for key, kind in (("valid", bool), ("success", bool), ("anchor", str)):
        if key in info and not isinstance(info[key], kind):
            raise ProtocolError(
                f"{call} returned info[{key!r}] = {_short(info[key])}; it must be a {kind.__name__} ({DOCS}, info)."
            )


def _gymnasium_check(env: gym.Env) -> None:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # gymnasium says most problems as warnings: none allowed, as for ours
            # Render and close checks need a spec (an env built by gymnasium.make); the project never renders.
            check_env(env, skip_render_check=True, skip_close_check=True)
    except Exception as exc:
        raise ProtocolError(
            f"gymnasium's env checker (gymnasium.utils.env_checker.check_env) refused it: {_said(exc)} ({DOCS})"
        ) from None


def _call(fn: Any, what: str, *args: Any, fix: str = "", **kwargs: Any) -> Any:
    try:
        return fn(*args, **kwargs)
    except Exception as exc:
        raise ProtocolError(f"{what} raised {_said(exc)}" + (f"; {fix}." if fix else ".")) from None


def _close(env: gym.Env) -> None:
    with contextlib.suppress(Exception):  # a close that raises breaks nothing the checks are about
        env.close()


def _said(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _shape(out: object) -> str:
    if isinstance(out, tuple):
        return f"a {len(out)}-tuple ({', '.join(type(v).__name__ for v in out)})"
    return f"{type(out).__name__} {_short(out)}"
