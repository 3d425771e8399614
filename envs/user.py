"""Environments from outside the project: a gymnasium id or an import path, played through the same text protocol.

    env = envs.make("examples.my_env.guess:GuessEnv", max_steps=6)   # a class: package.module:Class
    env = envs.make("my_pkg:MyGame-v0", max_steps=6)                 # gymnasium's module:id (imports my_pkg first)
    env = envs.make("MyGame-v0", max_steps=6)                        # an id already in gymnasium's registry

`env.name` takes any of these besides the built-in `agentstream/...` names. The env keeps the text protocol
(docs/your_env.md): `reset(seed=...)` -> (str, dict), `step(str)` -> (str, float, bool, bool, dict), an
`instructions` str; `envs.check` checks it at launch, before any process starts. `UserEnv` wraps it with what the
actor reads of every env and a user's env may leave out: `blocking` (False unless the env declares it), the
episode's step limit (`max_steps`: given to the constructor when it takes it, enforced here either way) and
`info["anchor"]` (the observation, unless the env gives its own).

Modules are imported with the working directory on `sys.path`, as `python -m` has it: a package beside the
command line is found by the launcher (`python scripts/launch.py` puts only `scripts/` there) and by every
process it starts, which inherit the working directory. A package elsewhere: put its folder on PYTHONPATH.
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import gymnasium as gym
from gymnasium.envs.registration import load_env_creator

from envs.base import StepResult

DOCS = "docs/your_env.md"


class EnvSourceError(ValueError):
    """`env.name` names nothing that can be built: the message says what was looked for and how to fix it."""


@dataclass(frozen=True)
class EnvSource:
    """Where a user's env comes from: how to build it and what its constructor takes."""

    name: str
    """As given in `env.name`."""
    build: Callable[..., gym.Env]
    """Builds the env (unwrapped) from keyword arguments."""
    params: Mapping[str, inspect.Parameter] | None
    """The constructor's parameters (None: it takes **kwargs, or its signature cannot be read)."""

    def takes(self, kwarg: str) -> bool:
        """Whether the constructor names `kwarg` (a **kwargs catch-all does not count: it may ignore it)."""
        return self.params is not None and kwarg in self.params


def _import(module: str) -> Any:
    cwd = os.getcwd()
    if not any(os.path.abspath(p or ".") == cwd for p in sys.path):
        sys.path.append(cwd)  # appended: a user's folder never shadows an installed package
    return importlib.import_module(module)


def _parameters(creator: Callable[..., Any]) -> Mapping[str, inspect.Parameter] | None:
    try:
        params = inspect.signature(creator).parameters
    except (TypeError, ValueError):  # a builtin or C-implemented callable
        return None
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return None
    return params


def _from_gym_id(name: str, env_id: str) -> EnvSource:
    entry_point = gym.registry[env_id].entry_point
    try:
        creator = load_env_creator(entry_point) if isinstance(entry_point, str) else entry_point
    except Exception as exc:  # its package is not installed, or is broken
        raise EnvSourceError(
            f"{name!r} is gymnasium's id {env_id!r}, whose entry point {entry_point!r} does not load "
            f"({type(exc).__name__}: {exc}); install the package that provides it"
        ) from None
    params = _parameters(creator) if creator is not None else None

    def build(**kwargs: Any) -> gym.Env:
        # The step limit is env.max_steps (UserEnv), so gymnasium's TimeLimit and passive checker stay out.
        return gym.make(env_id, disable_env_checker=True, **kwargs).unwrapped

    return EnvSource(name, build, params)


def resolve(name: str) -> EnvSource:
    """The env `name` gives: a gymnasium id in `gymnasium.registry`, gymnasium's `module:Id-v0` (the module
    registers the id when imported), or `package.module:Class` with Class a `gymnasium.Env` subclass.
    Imports what it names; EnvSourceError says what did not resolve and how to fix it."""
    if ":" not in name:
        if name in gym.registry:
            return _from_gym_id(name, name)
        builtin = sorted(k for k in gym.registry if k.startswith("agentstream/"))
        raise EnvSourceError(
            f"{name!r} is not registered; known: {', '.join(builtin)}; or any id in gymnasium's registry, "
            f"gymnasium's module:Id-v0 (the module registers the id when imported), or an import path "
            f"package.module:Class (e.g. examples.my_env.guess:GuessEnv; {DOCS})"
        )
    module_name, _, attr = name.partition(":")
    try:
        module = _import(module_name)
    except ImportError as exc:
        raise EnvSourceError(
            f"{name!r} does not resolve: importing {module_name!r} failed ({exc}). Check the "
            f"spelling (package.module:Class), and run from the folder that holds the package or put that "
            f"folder on PYTHONPATH ({DOCS})"
        ) from None
    except Exception as exc:  # the module itself is broken (a SyntaxError, an error at import time)
        raise EnvSourceError(
            f"{name!r} does not resolve: importing {module_name!r} raised {type(exc).__name__}: {exc}; fix the "
            f"module (python -c 'import {module_name}' shows the traceback)"
        ) from None
    if not hasattr(module, attr):
        if attr in gym.registry:
            return _from_gym_id(name, attr)
        envs_there = sorted(k for k, v in vars(module).items() if isinstance(v, type) and issubclass(v, gym.Env))
        raise EnvSourceError(
            f"{name!r} does not resolve: module {module_name!r} has no attribute {attr!r} and "
            f"gymnasium has no id {attr!r}; the gymnasium.Env classes it defines: "
            f"{', '.join(envs_there) or 'none'} ({DOCS})"
        )
    cls = getattr(module, attr)
    if not (isinstance(cls, type) and issubclass(cls, gym.Env)):
        bases = [b.__name__ for b in cls.__mro__[1:]] if isinstance(cls, type) else []
        what = f"a class of bases {bases}" if isinstance(cls, type) else f"a {type(cls).__name__}"
        raise EnvSourceError(
            f"{name!r} is {what}, not a gymnasium.Env subclass: declare it `class {attr}(gymnasium.Env)` "
            f"(its reset/step/spaces are gymnasium's; {DOCS})"
        )
    return EnvSource(name, cls, _parameters(cls))


class UserEnv(gym.Wrapper):
    """A user's env as the actor plays it: `blocking` and `instructions` read from the env, the episode cut at
    `max_steps` steps (truncated), and `info["anchor"]` (GiGPO's step-group key) the observation unless the env
    gives its own."""

    def __init__(self, env: gym.Env, max_steps: int | None):
        super().__init__(env)
        self.max_steps = max_steps
        self.blocking = bool(getattr(env, "blocking", False))  # optional in the protocol: most envs do not block
        self._steps = 0

    @property
    def instructions(self) -> str:
        """The env's own prompt text (read at each episode: an env may set it in reset)."""
        return str(self.env.get_wrapper_attr("instructions"))

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[str, dict[str, Any]]:
        self._steps = 0
        obs, info = self.env.reset(seed=seed, options=options)
        return obs, {"anchor": obs, **info}

    def step(self, action: str) -> StepResult:
        obs, reward, terminated, truncated, info = self.env.step(action)
        self._steps += 1
        cut = self.max_steps is not None and self._steps >= self.max_steps
        return obs, float(reward), bool(terminated), bool(truncated or cut) and not terminated, {"anchor": obs, **info}


def make(name: str, max_steps: int | None = None, **kwargs: Any) -> UserEnv:
    """Build the user's env `name` with `kwargs` (plus `max_steps` when its constructor takes it), wrapped as the
    actor plays it (`UserEnv`). EnvSourceError when `name` does not resolve."""
    source = resolve(name)
    if max_steps is not None and source.takes("max_steps"):
        kwargs = {**kwargs, "max_steps": max_steps}
    return UserEnv(source.build(**kwargs), max_steps)
