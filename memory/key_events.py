"""Key-events memory: the steps that mattered (see `memory.history`), then the last k steps verbatim.

A step is key when the env marks it (`info["key_event"]`), succeeds, has an unparseable answer, or changes
the reward. The newest `max_events` key steps older than the last k are shown with their reason; the
last k are shown whatever they were (with the reason when they are key too). Under a token budget the
oldest key steps go first, then the oldest recent ones.
"""

from __future__ import annotations

import numpy as np

from memory.episode import EpisodeMemory
from memory.history import Step
from memory.prompt import Block, Messages, PromptFitter, Section, step_block


def _block(step: Step) -> Block:
    return step_block(step, step.event)


class KeyEvents(EpisodeMemory):
    """Keeps the newest `max_events` key steps before the last `k`, and the last `k`."""

    def __init__(self, k: int = 2, max_events: int = 8, fitter: PromptFitter | None = None):
        if k < 0 or max_events < 0:
            raise ValueError(f"memory k={k}, max_events={max_events}: both must be >= 0")
        self.k, self.max_events = k, max_events
        super().__init__(fitter)

    def _prompt(self, observation: str, image: np.ndarray | None) -> Messages:
        steps = self._history.steps
        split = max(0, len(steps) - self.k)
        events = [s for s in steps[:split] if s.event]
        events = events[max(0, len(events) - self.max_events) :]
        sections = [
            Section("Key events:", tuple(_block(s) for s in events)),
            Section("Recent steps:", tuple(_block(s) for s in steps[split:])),
        ]
        return self.fitter.fit(self._instructions, sections, self._history.next_index, observation, image)
