"""Higher or lower, as an OpenEnv server: the shape of an `openenv init` environment (an Action, an Observation, an
`Environment` and `create_app`), in one file.

    .venv/bin/python -m uvicorn examples.openenv_game.server:app --host 127.0.0.1 --port 8001   # serve it yourself
    .venv/bin/python scripts/launch.py env.name=agentstream/OpenEnv-v0 +env.kwargs.base_url=http://127.0.0.1:8001
    .venv/bin/python scripts/launch.py env.name=agentstream/OpenEnv-v0 +env.kwargs.app=examples.openenv_game.server:app

The secret is drawn from the reset's seed (a group's G sessions reset to one seed get one secret); each guess is
answered "too low" or "too high" until it is right (reward 1, done) or the guesses run out (reward 0, done). The
server reads the model's whole answer (`message`) and parses it itself, as TextArena's OpenEnv server does: an answer
without a number in range is an invalid guess (`valid` False), which costs a guess.
"""

from __future__ import annotations

import random
import re
from typing import Any

from openenv.core.env_server import Action, Environment, Observation, State, create_app
from openenv.core.env_server.types import EnvironmentMetadata

HIGH = 8
"""The secret is from 1 to HIGH."""
GUESSES = 6
"""Guesses per episode."""
_GUESS = re.compile(r"<action>\s*(\d+)\s*</action>")


class GuessAction(Action):
    message: str
    """The model's whole answer."""


class GuessObservation(Observation):
    prompt: str
    """What the player reads."""
    guesses_left: int = GUESSES
    valid: bool = True
    """Whether the last answer held a guess in range."""
    success: bool = False


class GuessEnvironment(Environment):
    """One game per WebSocket session; sessions share nothing, so a server may hold many at once."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        super().__init__()
        self._secret, self._left = 1, GUESSES
        self._state = State(step_count=0)

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any) -> GuessObservation:
        self._secret = random.Random(seed).randint(1, HIGH)  # an RNG of its own: sessions share the process
        self._left = GUESSES
        self._state = State(episode_id=episode_id, step_count=0)
        return GuessObservation(prompt=f"Guess a number from 1 to {HIGH}. You have {GUESSES} guesses.", reward=0.0)

    def step(self, action: GuessAction, timeout_s: float | None = None, **kwargs: Any) -> GuessObservation:  # type: ignore[override]
        self._state.step_count += 1
        self._left -= 1
        match = _GUESS.search(action.message)
        guess = int(match.group(1)) if match else 0
        if not 1 <= guess <= HIGH:
            said = f"Answer with one number from 1 to {HIGH} as <action>N</action>."
            return self._observe(said, valid=False)
        if guess == self._secret:
            return GuessObservation(
                prompt=f"{guess} is right!", guesses_left=self._left, success=True, reward=1.0, done=True
            )
        return self._observe(f"{guess} is too {'low' if guess < self._secret else 'high'}.")

    def _observe(self, said: str, valid: bool = True) -> GuessObservation:
        left = f"{self._left} guesses left." if self._left else "No guesses left."
        return GuessObservation(
            prompt=f"{said} {left}", guesses_left=self._left, valid=valid, reward=0.0, done=self._left == 0
        )

    @property
    def state(self) -> State:
        return self._state

    def get_metadata(self) -> EnvironmentMetadata:
        # The adapter's default instructions (envs/openenv.py): the server says what its game is and how to answer.
        return EnvironmentMetadata(
            name="higher-or-lower",
            description=(
                f"I am thinking of a number from 1 to {HIGH}. Guess it in {GUESSES} tries; after each guess I say "
                f"whether it is too low or too high. Answer with one number: <action>N</action>."
            ),
            version="1.0.0",
        )


app = create_app(GuessEnvironment, GuessAction, GuessObservation, env_name="higher-or-lower", max_concurrent_envs=64)
"""What uvicorn serves (`examples.openenv_game.server:app`): 64 sessions at once, one game each."""
