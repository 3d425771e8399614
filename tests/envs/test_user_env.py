"""A user's env by import path or gymnasium id (envs/user.py), and the launch-time check that refuses one that breaks
the text protocol (envs/check.py) with a message naming the method and the fix.

The broken envs below each break one rule and keep every other, so each message is the one that rule gives. They
are served as the module `broken_envs` (put in `sys.modules` for the test), so `broken_envs:Class` resolves as a
user's import path does.
"""

from __future__ import annotations

import random
import re
import string
import sys
import types
from typing import Any

import gymnasium as gym
import pytest

import envs
from envs.base import EnvTraits
from envs.check import env_errors
from envs.user import EnvSourceError, UserEnv, resolve

EXAMPLE = "examples.my_env.guess:GuessEnv"


class Good(gym.Env):
    """The smallest env that keeps the protocol: count up, `<action>up</action>` moves, 3 ends it."""

    metadata = {"render_modes": []}
    instructions = "Count to 3. Answer <action>up</action>."

    def __init__(self, start: int = 0):
        self.start, self.n = start, start
        self.observation_space = gym.spaces.Text(max_length=64, charset=string.printable)
        self.action_space = gym.spaces.Text(max_length=64, charset=string.printable)

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[Any, dict]:
        super().reset(seed=seed)
        self.n = self.start + int(self.np_random.integers(2))
        return f"at {self.n}", {}

    def step(self, action: Any) -> tuple:
        valid = action == "<action>up</action>"
        self.n += valid
        return f"at {self.n}", float(self.n >= 3), self.n >= 3, False, {"valid": valid, "success": self.n >= 3}


class NotAnEnv:
    def reset(self, *, seed=None):
        return "x", {}


class IntObservation(Good):
    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return 3, {}  # the state as a number, not as text


class OldGymStep(Good):
    def step(self, action):
        obs, reward, terminated, _, info = super().step(action)
        return obs, reward, terminated, info


class NoInstructions(Good):
    instructions = ""


class GlobalRandom(Good):
    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.n = random.randint(0, 10**6)  # the global RNG: copies of one seed start apart
        return f"at {self.n}", {}


class RaisingParser(Good):
    def step(self, action):
        if "<action>" not in action:
            raise ValueError("no action tag")
        return super().step(action)


class DiscreteActions(Good):
    def __init__(self):
        super().__init__()
        self.action_space = gym.spaces.Discrete(2)


class OutsideItsCharset(Good):
    def __init__(self):
        super().__init__()
        self.observation_space = gym.spaces.Text(max_length=64, charset="0123456789")  # "at 1" is outside


class TakesMaxSteps(Good):
    def __init__(self, max_steps: int = 100):
        super().__init__()
        self.max_steps = max_steps


@pytest.fixture(autouse=True)
def broken_envs(monkeypatch: pytest.MonkeyPatch) -> None:
    module = types.ModuleType("broken_envs")
    classes: tuple[type, ...] = (Good, NotAnEnv, IntObservation, OldGymStep, NoInstructions, GlobalRandom)
    classes += (RaisingParser, DiscreteActions, OutsideItsCharset, TakesMaxSteps)
    for cls in classes:
        setattr(module, cls.__name__, cls)
    monkeypatch.setitem(sys.modules, "broken_envs", module)


@pytest.mark.parametrize(
    "name, expected",
    [
        (  # the import path does not resolve
            "no_such_package.games:Guess",
            "env.name='no_such_package.games:Guess' does not resolve: importing 'no_such_package.games' failed "
            "(No module named 'no_such_package'). Check the spelling (package.module:Class), and run from the folder "
            "that holds the package or put that folder on PYTHONPATH (docs/your_env.md)",
        ),
        (  # the module is there, the class is not
            "broken_envs:Gud",
            "env.name='broken_envs:Gud' does not resolve: module 'broken_envs' has no attribute 'Gud' and gymnasium "
            "has no id 'Gud'; the gymnasium.Env classes it defines: DiscreteActions, GlobalRandom, Good, "
            "IntObservation, NoInstructions, OldGymStep, OutsideItsCharset, RaisingParser, TakesMaxSteps "
            "(docs/your_env.md)",
        ),
        (  # the class is not a gymnasium.Env
            "broken_envs:NotAnEnv",
            "env.name='broken_envs:NotAnEnv' is a class of bases ['object'], not a gymnasium.Env subclass: declare "
            "it `class NotAnEnv(gymnasium.Env)` (its reset/step/spaces are gymnasium's; docs/your_env.md)",
        ),
        (  # reset returns a non-str observation
            "broken_envs:IntObservation",
            "env.name='broken_envs:IntObservation': reset(seed=0) returned an observation of type int (3); return it "
            "as text (str), what the model reads: render the state in words, e.g. "
            "`return f'Guess a number from 1 to {self.high}.', {}`.",
        ),
        (  # step returns old gym's 4-tuple
            "broken_envs:OldGymStep",
            "env.name='broken_envs:OldGymStep': step('') returned a 4-tuple (str, float, bool, dict); return five "
            "values (observation: str, reward: float, terminated: bool, truncated: bool, info: dict), as "
            "gymnasium's Env.step (an old gym env's `done` splits into terminated, the game ended, and truncated, "
            "the game was cut short).",
        ),
    ],
    ids=["unresolved", "no-class", "not-an-env", "non-str-reset", "four-tuple-step"],
)
def test_the_checker_refuses_a_broken_env_naming_the_method_and_the_fix(name: str, expected: str) -> None:
    assert env_errors(name, {}, max_steps=8) == [expected]


@pytest.mark.parametrize(
    "name, needle",
    [
        ("broken_envs:NoInstructions", "instructions is ''; set `instructions` (a non-empty str)"),
        ("broken_envs:GlobalRandom", "reset(seed=0) gave different first observations"),
        ("broken_envs:RaisingParser", "step('') raised ValueError: no action tag; an answer the parser refuses is"),
        ("broken_envs:DiscreteActions", "action_space is Discrete(2), not text: set `self.action_space = gymnasium"),
        ("broken_envs:OutsideItsCharset", "gymnasium's env checker (gymnasium.utils.env_checker.check_env) refused"),
        ("FrozenLake-v1", "observation_space is Discrete(16), not text"),  # gymnasium's own, not a text env
        ("Nope-v0", "env.name='Nope-v0' is not registered; known: agentstream/ALFWorld-v0"),
    ],
)
def test_the_checker_refuses_each_other_break(name: str, needle: str) -> None:
    (error,) = env_errors(name, {}, max_steps=8)
    assert needle in error


def test_the_checker_refuses_kwargs_the_constructor_does_not_take() -> None:
    assert env_errors("broken_envs:Good", {"begin": 1}, max_steps=8) == [
        "env.name='broken_envs:Good': env.kwargs has ['begin'], which its constructor does not take; it takes "
        "['start']."
    ]


@pytest.mark.parametrize("name", ["broken_envs:Good", EXAMPLE, "examples.my_env:my_env/Guess-v0"])
def test_an_env_that_keeps_the_protocol_passes(name: str) -> None:
    state = random.getstate()
    assert env_errors(name, {}, max_steps=8) == []
    assert random.getstate() == state  # the checks put the global RNGs back


def test_the_example_by_import_path_and_by_gymnasium_id_is_one_game() -> None:
    by_path, by_id = envs.make(EXAMPLE, max_steps=8), envs.make("examples.my_env:my_env/Guess-v0", max_steps=8)
    assert isinstance(by_path, UserEnv) and type(by_path.unwrapped) is type(by_id.unwrapped)
    assert by_path.reset(seed=5) == by_id.reset(seed=5)
    assert envs.traits(EXAMPLE, {}) == EnvTraits()  # one seat, no answer parser declared


def test_an_import_path_resolves_from_the_working_directory(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`python scripts/launch.py` has scripts/ on sys.path, not the folder it runs in; a package there still
    resolves (and the processes the launcher starts there inherit that folder)."""
    (tmp_path / "cwd_pkg_for_test").mkdir()
    (tmp_path / "cwd_pkg_for_test" / "__init__.py").write_text("from broken_envs import Good as Mine\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".", str(tmp_path))])
    assert resolve("cwd_pkg_for_test:Mine").build() is not None
    assert str(tmp_path) in sys.path


def test_the_wrapper_limits_steps_and_fills_what_the_actor_reads() -> None:
    env = envs.make("broken_envs:Good", max_steps=2, start=-10)  # never reaches 3: the limit ends it
    assert isinstance(env, UserEnv)
    obs, info = env.reset(seed=0)
    assert env.blocking is False and env.instructions == Good.instructions
    assert info["anchor"] == obs  # no anchor of its own: the observation is the state
    assert env.step("<action>up</action>")[2:4] == (False, False)
    assert env.step("nope")[2:4] == (False, True)  # the 2nd step: truncated by max_steps
    env.reset(seed=0)
    assert env.step("<action>up</action>")[3] is False  # reset zeroes the count


def test_max_steps_reaches_a_constructor_that_takes_it() -> None:
    env = envs.make("broken_envs:TakesMaxSteps", max_steps=5).unwrapped
    assert isinstance(env, TakesMaxSteps) and env.max_steps == 5
    assert not hasattr(envs.make("broken_envs:Good", max_steps=5).unwrapped, "max_steps")


def test_an_unknown_name_raises_at_make() -> None:
    with pytest.raises(EnvSourceError, match=re.escape("'Nope-v0' is not registered; known: agentstream/")):
        envs.make("Nope-v0")
