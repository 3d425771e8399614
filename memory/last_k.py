"""Last-k memory (verl-agent's default): the task, the last k (observation, action) steps, the current observation.

The prompt length is bounded by k whatever the episode length, which is what keeps 30-50 step episodes
inside a short context window.
"""

from __future__ import annotations

import numpy as np

from memory.episode import EpisodeMemory
from memory.prompt import Messages, PromptFitter, Section, step_block


class LastK(EpisodeMemory):
    """Keeps the last `k` steps of the episode."""

    def __init__(self, k: int = 2, fitter: PromptFitter | None = None):
        if k < 0:
            raise ValueError(f"memory k={k}: must be >= 0")
        self.k = k
        super().__init__(fitter)

    def _prompt(self, observation: str, image: np.ndarray | None) -> Messages:
        recent = self._history.steps[max(0, len(self._history.steps) - self.k) :]
        blocks = tuple(step_block(s) for s in recent)
        return self.fitter.fit(
            self._instructions, [Section("Recent steps:", blocks)], self._history.next_index, observation, image
        )
