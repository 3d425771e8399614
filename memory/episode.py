"""What every memory kind shares: the instructions, the episode's steps (with their pictures, when the memory
shows history pictures), and the prompt fitter's counts. A kind adds only `_prompt(observation, image)`,
which decides what history goes into the prompt."""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from memory.history import History
from memory.prompt import Messages, PromptFitter


class EpisodeMemory:
    """The episode so far; subclasses decide what of it each prompt shows.

    A step's picture is its observation's: the one `messages` got for it or, when that got none, the
    `info["image"]` of the step before (envs put the picture of the observation they return there)."""

    def __init__(self, fitter: PromptFitter | None = None):
        self.fitter = fitter or PromptFitter()
        self._instructions = ""
        self._history = History()
        self._picture: np.ndarray | None = None  # the picture of the observation the next step answers

    @property
    def dropped_steps(self) -> int:
        return self.fitter.dropped_steps

    @property
    def truncated_steps(self) -> int:
        return self.fitter.truncated_steps

    @property
    def dropped_images(self) -> int:
        return self.fitter.dropped_images

    @property
    def prompt_images(self) -> list[np.ndarray]:
        return self.fitter.prompt_images

    def reset(self, instructions: str) -> None:
        self.fitter.check(instructions)
        self._instructions = instructions
        self._history.clear()
        self._picture = None

    def record(self, observation: str, action: str, reward: float = 0.0, info: Mapping[str, Any] | None = None) -> None:
        self._history.record(observation, action, reward, info, self._picture)
        self._picture = (info or {}).get("image") if self._keeps_pictures else None

    def messages(self, observation: str, image: np.ndarray | None = None) -> Messages:
        """The prompt for `observation`; `image`: its picture (shown unless the memory shows none)."""
        if image is not None and self._keeps_pictures:
            self._picture = image
        return self._prompt(observation, image)

    @property
    def _keeps_pictures(self) -> bool:
        """Whether steps keep their pictures: only "last_k" shows history pictures, the other modes hold none."""
        return self.fitter.images == "last_k"

    def _prompt(self, observation: str, image: np.ndarray | None) -> Messages:
        """The chat prompt of the current step (`image`: its picture, None for none)."""
        raise NotImplementedError
