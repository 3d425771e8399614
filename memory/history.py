"""The episode so far, as every memory module records it: one `Step` per (observation, action, outcome).

A step is *key* when the env says so (`info["key_event"]`), when it succeeded, when the answer did not parse
into an action, or when its reward differs from the previous step's (the first step compares with 0): a
sparse reward shows up as a change, and a constant step penalty (Sokoban's -0.1) does not flood the list.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np

_ACTION_TAG = re.compile(r"<action>\s*(.*?)\s*</action>", re.S)
MAX_ACTION_NAME_CHARS = 24


@dataclass(frozen=True)
class Step:
    """One recorded step: what the model saw, what it answered, and what came of it."""

    index: int
    """1-based step number in the episode."""
    observation: str
    """The observation the action answered (before the step)."""
    action: str
    """The model's raw answer."""
    reward: float
    """The env's reward for the step (without the actor's invalid-action penalty)."""
    valid: bool
    """Whether the answer parsed into an action."""
    parse_error: str
    """Why it did not parse ("" when valid)."""
    event: str
    """Why the step is key ("" when it is not): see the module docstring."""
    image: np.ndarray | None = field(default=None, compare=False)
    """The observation's picture, when the memory keeps history pictures (images="last_k")."""


def key_event_reason(reward: float, previous_reward: float, info: Mapping[str, Any]) -> str:
    """Why a step is key, or "" (the env's own reason first, then success, invalid answer, reward change)."""
    marked = info.get("key_event")
    if marked:
        return marked if isinstance(marked, str) else "key event"
    if info.get("success"):
        return "success"
    if info.get("valid", True) is False:
        return "invalid answer"
    if reward != previous_reward:
        return f"reward {previous_reward:g} -> {reward:g}"
    return ""


def action_name(action: str) -> str:
    """A short name for an answer: the text of its `<action>` tag, else the answer itself, whitespace collapsed."""
    match = _ACTION_TAG.search(action)
    name = " ".join((match.group(1) if match else action).split())
    return name if len(name) <= MAX_ACTION_NAME_CHARS else name[: MAX_ACTION_NAME_CHARS - 3] + "..."


def last_line(text: str) -> str:
    """The last non-empty line of an observation: the envs end theirs with a one-line status."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else ""


class History:
    """Every step of the current episode, oldest first."""

    def __init__(self) -> None:
        self.steps: list[Step] = []

    def clear(self) -> None:
        self.steps.clear()

    def record(
        self,
        observation: str,
        action: str,
        reward: float = 0.0,
        info: Mapping[str, Any] | None = None,
        image: np.ndarray | None = None,
    ) -> Step:
        info = info or {}
        previous = self.steps[-1].reward if self.steps else 0.0
        valid = info.get("valid", True) is not False
        step = Step(
            index=len(self.steps) + 1,
            observation=observation,
            action=action,
            reward=float(reward),
            valid=valid,
            parse_error="" if valid else str(info.get("parse_error", "")),
            event=key_event_reason(float(reward), previous, info),
            image=image,
        )
        self.steps.append(step)
        return step

    @property
    def next_index(self) -> int:
        """The number of the step the next prompt asks for."""
        return len(self.steps) + 1
