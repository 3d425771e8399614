"""What every agentstream environment provides, beyond gymnasium's `Env`.

An environment splits into three parts kept apart: the game (a gymnasium `Env` whose observations and
actions are text), a pure action parser (`parse(text) -> Action | ParseFailure`, never raises), and the
prompt (`instructions`, the task text the memory module puts at the top of every prompt).

`step(text)` takes the model's raw text. When it does not parse, the game does not move: the observation
repeats, the reward is 0, `info["valid"] is False` and `info["parse_error"]` says why; the actor adds the
configured penalty. `info` always carries `anchor` (the state as text, for GiGPO's step groups),
`valid`, `success`, and `admissible_actions` where the game knows them. Each admissible action is the
text that goes between the tags: `f"<action>{a}</action>"` parses for every `a` in the list.
Envs that draw their state (Sokoban, EZPoints, Points24) take `observation="text"|"image"` (`check_observation`);
with "image", `info["image"]` carries the picture of the observation it comes with, after reset and every
step (invalid ones too): RGB, numpy uint8 [H, W, 3], one fixed size per env instance, byte-identical for
the same state. The observation itself stays text, for vision-language models to read beside the picture.
`TextGame` writes that turn once (reset check, step count, truncation, parse, invalid answer); each env
supplies the parser and what a valid action does.

`blocking` is True for envs whose reset/step block for long (a JVM, a C planner, SQLite, subprocesses):
callers run those calls in a thread so that the other episodes in the process keep going.

Every env takes `max_steps` (the actor passes it) and draws all its randomness from its own
`self.np_random` (seeded by `reset(seed=...)`), never from `random` or `np.random`'s global state:
many episodes run concurrently in one process, and the G episodes of a group must start identical.

Seeds: `TRAIN_SEEDS` and `VALIDATION_SEEDS` are disjoint ranges; a validation run draws its seeds from
`VALIDATION_SEEDS` so that no validation task was ever trained on.
"""

from __future__ import annotations

import copy
import functools
import importlib
import re
import string
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import gymnasium as gym

TRAIN_SEEDS = range(0, 10**9)
"""Env seeds for training (the broker's seeds, `run.seed * 1_000_003 + group_id`, stay in here)."""
VALIDATION_SEEDS = range(10**9, 2 * 10**9)
"""Env seeds for validation/evaluation only; disjoint from `TRAIN_SEEDS`, and below 2**32 (numpy's limit)."""

OBSERVATIONS = ("text", "image")
"""What an env that draws its state can be asked for: text only, or text plus `info["image"]`."""

TEXT_CHARSET = string.printable + "√♠♥♦♣·…–—‘’“”"
"""Characters an observation may contain: `gymnasium.spaces.Text` rejects anything outside its charset."""


def seed_split(seed: int) -> str:
    """'train' or 'validation': which convention range `seed` belongs to (ValueError outside both)."""
    if seed in TRAIN_SEEDS:
        return "train"
    if seed in VALIDATION_SEEDS:
        return "validation"
    raise ValueError(f"seed {seed} is outside TRAIN_SEEDS {TRAIN_SEEDS} and VALIDATION_SEEDS {VALIDATION_SEEDS}")


def check_observation(observation: str) -> str:
    """`observation` when it is one of `OBSERVATIONS`; a ValueError naming them otherwise."""
    if observation not in OBSERVATIONS:
        raise ValueError(f"observation={observation!r}: use 'text' or 'image' (image adds info['image'])")
    return observation


def text_space(max_length: int = 8192, extra_chars: str = "") -> gym.spaces.Text:
    """The observation/action space of a text env: printable text (plus `extra_chars`) up to `max_length`. A
    copy of one made once: gymnasium indexes the charset in every `Text`, ~100 us, twice in each env an actor
    makes per episode (the copy shares that read-only index; its random generator is its own)."""
    return copy.copy(_text_space(max_length, extra_chars))


@functools.lru_cache(maxsize=None)
def _text_space(max_length: int, extra_chars: str) -> gym.spaces.Text:
    return gym.spaces.Text(max_length=max_length, min_length=0, charset=TEXT_CHARSET + extra_chars)


@dataclass(frozen=True)
class Action:
    """A parsed action."""

    value: Any


@dataclass(frozen=True)
class ParseFailure:
    """Why a text is not an action; shown to the model as feedback."""

    reason: str


ParseResult = Action | ParseFailure


@functools.lru_cache(maxsize=None)
def _tag_re(tag: str) -> re.Pattern[str]:
    return re.compile(rf"<{re.escape(tag)}>(.*?)</{re.escape(tag)}>", re.DOTALL | re.IGNORECASE)


def parse_tagged(text: object, choices: Mapping[str, Any], tag: str = "action", what: str = "move") -> ParseResult:
    """The first `<tag>NAME</tag>` in `text` -> `Action(choices[NAME])`; NAME is stripped and lower-cased.

    `choices` maps lower-case names to action values. Never raises: anything else is a `ParseFailure`
    whose reason tells the model what to write instead.
    """
    if not isinstance(text, str):
        return ParseFailure(f"expected text, got {type(text).__name__}")
    match = _tag_re(tag).search(text)
    if match is None:
        return ParseFailure(f"no <{tag}>...</{tag}> tag found")
    name = match.group(1).strip().lower()
    if name not in choices:
        shown = name if len(name) <= 40 else name[:40] + "..."
        return ParseFailure(f"unknown {what} {shown!r}; use one of {', '.join(choices)}")
    return Action(choices[name])


@dataclass(frozen=True)
class EnvTraits:
    """What an env declares about itself, known from its registered name and kwargs without building it
    (`envs.registry.traits`): the actor and the launcher read these, never a game's name or its kwargs."""

    seats: int = 1
    """Seats of one game whose turns the actor answers: 2 in a match (the env is an `actors.episode.MatchEnv`, played
    by `actors.episode.play_match` with a memory per seat), else 1."""
    frozen_seat: bool = False
    """A match whose other seat is a frozen copy of the policy: only the env's `trained_seat` trains, the other seat's
    turns are sampled from the engines' frozen copy (LoRA runs; the engines refresh it every engines.frozen_every)."""
    one_seat_kwargs: tuple[tuple[str, Any], ...] = ()
    """The env kwargs that make a match one seat against a fixed opponent (validation plays that: a win rate against
    a fixed opponent measures progress, one against itself does not); empty where the game has one seat."""
    parser: str = ""
    """`module:function`, the env's own answer parser (`answer_parser`): the warm start checks its sampled answers with
    it. "": the env has none that reads an answer without the game's state."""
    moves: tuple[str, ...] = ()
    """Every move the env's games take, given to `parser` as the legal ones (a parser of (text, legal moves), as
    TextArena's: the warm start's check does not know each prompt's state); empty: the parser takes the text alone."""
    remote: bool = False
    """Its episodes are played on a server that env.kwargs names (OpenEnv's, envs/openenv.py): it is built only with
    one, so what builds every env with no kwargs (the contract tests, bench.envs) leaves it out."""
    serve: str = ""
    """An app (`module:attr`, as uvicorn takes it) the launcher serves on 127.0.0.1 for the run, its URL given to the
    actors as env.kwargs.base_url (OpenEnv's env.kwargs.app); empty: nothing to serve."""

    @property
    def trained_seats(self) -> int:
        """Seats whose turns are trained, each seat's trajectories in a group of its own: 2 in self-play, else 1."""
        return self.seats - self.frozen_seat

    def answer_parser(self) -> Callable[[str], ParseResult] | None:
        """The env's parser as a function of the text alone, imported now (None: the env declares none)."""
        if not self.parser:
            return None
        module, _, name = self.parser.partition(":")
        parse = getattr(importlib.import_module(module), name)
        return functools.partial(parse, legal=self.moves) if self.moves else parse


StepResult = tuple[str, float, bool, bool, dict[str, Any]]
"""What `step` returns: (observation, reward, terminated, truncated, info), as gymnasium's."""


@runtime_checkable
class TextEnv(Protocol):
    """The part of an environment the actor relies on (the rest is gymnasium's `Env`)."""

    instructions: str
    blocking: bool
    """True when reset/step block for long (JVM, C library, SQLite, subprocess): callers run them in a thread."""

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[str, dict[str, Any]]: ...

    def step(self, action: str) -> StepResult: ...

    def close(self) -> None: ...


class TextGame(gym.Env):
    """The base of agentstream's envs: `blocking` (False unless an env says otherwise) and the turn every
    env plays the same way, so that invalid answers are counted and reported alike across envs.

    `step` checks that reset was called, counts the step (invalid ones too: the episode limit bounds the
    model's turns, not the game's moves), parses the text, and on a parse failure returns the env's
    current observation with reward `invalid_reward`, `info["valid"] = False` and `info["parse_error"]`. An env
    sets `max_steps`, zeroes `_steps` in `reset`, and implements the four hooks below.
    """

    invalid_reward: float = 0.0
    """What an answer that does not parse earns (the actor's invalid-action penalty comes on top). An env whose
    every move costs a step penalty charges it here too: the turn passed, and an invalid answer must not be
    cheaper than a move."""
    blocking: bool = False
    instructions: str
    max_steps: int
    _steps: int = 0

    def step(self, action: str) -> StepResult:
        if not self._started():
            raise RuntimeError("call reset() before step()")
        self._steps += 1
        out_of_steps = self._steps >= self.max_steps
        parsed = self._parse(action)
        if isinstance(parsed, ParseFailure):
            obs, info = self._invalid()
            info["parse_error"] = parsed.reason
            return obs, self.invalid_reward, False, out_of_steps, info
        obs, reward, terminated, truncated, info = self._step(parsed.value)
        return obs, reward, terminated, (truncated or out_of_steps) and not terminated, info

    def _started(self) -> bool:
        """Whether an episode is under way (reset was called, and close was not since)."""
        raise NotImplementedError

    def _parse(self, action: str) -> ParseResult:
        """The model's text as an action of this env, or why it is not one. Never raises."""
        raise NotImplementedError

    def _invalid(self) -> tuple[str, dict[str, Any]]:
        """(observation, info with `valid` False) for an answer that does not move the game."""
        raise NotImplementedError

    def _step(self, value: Any) -> StepResult:
        """Play a parsed action. `truncated` is the game's own cut-off (most have none: False); `step` adds
        the `max_steps` limit and clears it when the episode terminates."""
        raise NotImplementedError
