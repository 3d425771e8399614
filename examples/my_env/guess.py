"""Guess the number: a text environment written as a user would, a plain `gymnasium.Env` outside the project.

    .venv/bin/python scripts/launch.py env.name=examples.my_env.guess:GuessEnv     # trains it: tiny model, CPU

The env draws a secret number from 1 to `high` from its reset seed; the model answers `<action>N</action>` and
reads whether N was too low or too high. The right number ends the episode with reward 1; every other answer earns
0. An answer that is not `<action>N</action>` with N in range is an invalid action: the game does not move, and the
actor adds its penalty. The episode's step limit is the run's `env.max_steps` (the project cuts the episode there).

What makes it trainable is the text protocol (docs/your_env.md), nothing else: text observations from `reset` and
`step`, text actions into `step`, `instructions` for the prompt, randomness drawn from `self.np_random` after
`super().reset(seed=seed)` (a group's episodes share a seed), and `info` saying whether the answer parsed (`valid`)
and whether the task was solved (`success`). It takes the project's action-tag parser (`envs.base.parse_tagged`);
any function of the text would do as well.
"""

from __future__ import annotations

import string
from typing import Any

import gymnasium as gym

from envs.base import ParseFailure, parse_tagged


class GuessEnv(gym.Env):
    """Guess a number from 1 to `high`, told "too low" or "too high" after each wrong guess."""

    metadata = {"render_modes": []}

    def __init__(self, high: int = 8):
        if high < 2:
            raise ValueError(f"high={high}: must be at least 2 (a number from 1 to high)")
        self.high = high
        self.instructions = (
            f"I am thinking of a number from 1 to {high}. Find it in as few guesses as you can; after each wrong "
            f"guess I say whether it was too low or too high. Answer with one number: <action>N</action>."
        )
        self.observation_space = gym.spaces.Text(max_length=512, charset=string.printable)
        self.action_space = gym.spaces.Text(max_length=512, charset=string.printable)
        self._choices = {str(n): n for n in range(1, high + 1)}  # what parse_tagged accepts between the tags
        self._secret = 0
        self._observation = ""

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[str, dict[str, Any]]:
        super().reset(seed=seed)  # seeds self.np_random: the same seed, the same secret
        self._secret = int(self.np_random.integers(1, self.high + 1))
        self._observation = f"Guess a number from 1 to {self.high}."
        return self._observation, {"valid": True, "success": False}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        if not self._secret:
            raise RuntimeError("call reset() before step()")
        parsed = parse_tagged(action, self._choices, what="number")
        if isinstance(parsed, ParseFailure):  # the game does not move; the reason goes to the model's history
            return (
                self._observation,
                0.0,
                False,
                False,
                {"valid": False, "success": False, "parse_error": parsed.reason},
            )
        guess = parsed.value
        if guess == self._secret:
            return f"{guess} is right.", 1.0, True, False, {"valid": True, "success": True}
        hint = "too low" if guess < self._secret else "too high"
        self._observation = f"{guess} is {hint}. Guess a number from 1 to {self.high}."
        return self._observation, 0.0, False, False, {"valid": True, "success": False}
