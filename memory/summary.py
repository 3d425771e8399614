"""Summary memory: a running, rule-based summary of the older steps, then the last k steps verbatim.

No model calls: the summary is counts and a few key observations, worked out from the recorded steps, so
it is deterministic and its length is bounded whatever the episode length. For steps 1..m (all but the last
k) it reads, leaving out lines that would be empty:

    Summary of steps 1-6:
    Moves: right x3, down x1.                      # valid answers by action name, most used first
    Invalid answers: 2 (last: no <action>...</action> tag found).
    Reward so far: 0.
    Last states: You are at row 0, column 1. -> You are at row 1, column 1.
    Notable: step 4 (reward 0 -> 1).               # key steps other than invalid answers

"Last states" is the last line of each summarised observation (the envs end observations with a one-line
status), repeats in a row merged, the newest few kept. Under a token budget the oldest recent steps fold
into the summary first (k shrinks, down to 0); only if the summary alone is still too long is it dropped
(it is the oldest history), counting as the m steps it stands for. With history pictures (images="last_k")
the recent steps show theirs, which the budget drops before folding any step; a folded step is summarised
without its picture (not counted in `dropped_images`, as it is not in `dropped_steps`).
"""

from __future__ import annotations

from collections import Counter
from typing import Sequence

import numpy as np

from memory.episode import EpisodeMemory
from memory.history import Step, action_name, last_line
from memory.prompt import Block, Messages, PromptFitter, Section, step_block

MAX_MOVES = 8  # action names listed; the rest are counted as "other"
MAX_STATES = 4
MAX_NOTABLE = 3
MAX_LINE_CHARS = 60


def _short(text: str) -> str:
    return text if len(text) <= MAX_LINE_CHARS else text[: MAX_LINE_CHARS - 3] + "..."


def summarize(steps: Sequence[Step]) -> str:
    """The summary text of `steps` (oldest first, at least one); see the module docstring."""
    lines = [f"Summary of steps {steps[0].index}-{steps[-1].index}:"]
    names = [action_name(s.action) for s in steps if s.valid]
    if names:
        first_use = {name: i for i, name in reversed(list(enumerate(names)))}
        ranked = sorted(Counter(names).items(), key=lambda kv: (-kv[1], first_use[kv[0]]))
        moves = [f"{name} x{n}" for name, n in ranked[:MAX_MOVES]]
        if len(ranked) > MAX_MOVES:
            moves.append(f"{sum(n for _, n in ranked[MAX_MOVES:])} other")
        lines.append(f"Moves: {', '.join(moves)}.")
    invalid = [s for s in steps if not s.valid]
    if invalid:
        lines.append(f"Invalid answers: {len(invalid)} (last: {_short(invalid[-1].parse_error or 'unparseable')}).")
    lines.append(f"Reward so far: {sum(s.reward for s in steps):g}.")
    states: list[str] = []
    for s in steps:
        state = _short(last_line(s.observation))
        if state and (not states or states[-1] != state):
            states.append(state)
    if states:
        lines.append(f"Last states: {' -> '.join(states[-MAX_STATES:])}")
    notable = [f"step {s.index} ({s.event})" for s in steps if s.event and s.valid]
    if notable:
        lines.append(f"Notable: {'; '.join(notable[-MAX_NOTABLE:])}.")
    return "\n".join(lines)


class Summary(EpisodeMemory):
    """A summary of all but the last `k` steps, and those k verbatim."""

    def __init__(self, k: int = 2, fitter: PromptFitter | None = None):
        if k < 0:
            raise ValueError(f"memory k={k}: must be >= 0")
        self.k = k
        super().__init__(fitter)

    def _prompt(self, observation: str, image: np.ndarray | None) -> Messages:
        step = self._history.next_index
        # Over the budget, the oldest recent steps fold into the summary (k shrinks) before any history is
        # dropped: a summarised step costs a few tokens, a verbatim one a whole observation. History pictures
        # go before either (`fit` drops them), so the test is on the text.
        for k in range(min(self.k, len(self._history.steps)), -1, -1):
            sections = self._sections(k)
            if k == 0 or self.fitter.fits_text(self._instructions, sections, step, observation, image):
                break
        return self.fitter.fit(self._instructions, sections, step, observation, image)

    def _sections(self, k: int) -> list[Section]:
        steps = self._history.steps
        split = len(steps) - k
        older = (Block(summarize(steps[:split]), split),) if split else ()
        recent = tuple(step_block(s) for s in steps[split:])
        return [Section("", older), Section("Recent steps:", recent)]
