"""Full-history memory: every step so far. The baseline that outgrows the context on long episodes.

Without a budget the prompt grows by one step per step; with one, it keeps the newest steps that fit
(and counts the rest in `dropped_steps`), which makes it a last-k whose k the budget decides.
"""

from __future__ import annotations

import numpy as np

from memory.episode import EpisodeMemory
from memory.prompt import Messages, PromptFitter, Section, step_block


class Full(EpisodeMemory):
    """Keeps every step of the episode."""

    def __init__(self, fitter: PromptFitter | None = None):
        super().__init__(fitter)

    def _prompt(self, observation: str, image: np.ndarray | None) -> Messages:
        blocks = tuple(step_block(s) for s in self._history.steps)
        return self.fitter.fit(
            self._instructions, [Section("Steps so far:", blocks)], self._history.next_index, observation, image
        )
