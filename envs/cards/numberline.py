"""NumberLine (gym-cards, as verl-agent uses it) as a text game: move a pointer to a target.

Positions are 0..max_position; the start and the target differ and come from the env's own RNG. Each
step `<action>+</action>` moves the pointer up one, `<action>-</action>` down one (it stays at the ends).
Rewards are gym-cards': +1 on reaching the target (ends the episode with `success`), -1 for a step that
does not bring the pointer closer, 0 otherwise.

    env = envs.make("agentstream/NumberLine-v0", max_position=5, max_steps=10)
"""

from __future__ import annotations

from typing import Any

from envs.base import ParseResult, StepResult, TextGame, parse_tagged, text_space

ACTIONS = ("-", "+")  # gym-cards' indices 0 (left) and 1 (right)
_CHOICES = {"-": 0, "+": 1}

INSTRUCTIONS = (
    "You play the number line game. You see a target number and the current number. Move the current "
    "number to the target by adding or subtracting one each step. Reaching the target earns 1 point; a "
    "step that does not bring you closer costs 1. Answer with <action>+</action> or <action>-</action>."
)


def parse_action(text: str) -> ParseResult:
    """The first `<action>+|-</action>` in `text` -> Action(0 for -, 1 for +). Never raises."""
    return parse_tagged(text, _CHOICES)


class NumberLineText(TextGame):
    """NumberLine with text observations and text actions (see the module docstring)."""

    metadata = {"render_modes": []}
    instructions = INSTRUCTIONS

    def __init__(self, max_position: int = 5, max_steps: int = 10):
        if max_position < 1:
            raise ValueError(f"max_position={max_position}: must be at least 1")
        self.max_position, self.max_steps = max_position, max_steps
        self.observation_space = text_space()
        self.action_space = text_space()
        self.position = self.goal = -1
        self._steps = 0

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[str, dict[str, Any]]:
        super().reset(seed=seed)
        self.position = int(self.np_random.integers(self.max_position + 1))
        # the target: any other position, uniformly
        self.goal = int(self.np_random.integers(self.max_position))
        self.goal += self.goal >= self.position
        self._steps = 0
        obs = self._observation()
        return obs, self._info(True, False, obs)

    def _started(self) -> bool:
        return self.goal >= 0

    def _parse(self, action: str) -> ParseResult:
        return parse_action(action)

    def _invalid(self) -> tuple[str, dict[str, Any]]:
        obs = self._observation()
        return obs, self._info(False, False, obs)

    def _step(self, value: int) -> StepResult:
        before = abs(self.position - self.goal)
        self.position = min(max(self.position + (1 if value else -1), 0), self.max_position)
        after = abs(self.position - self.goal)
        reached = after == 0
        reward = 1.0 if reached else (-1.0 if after >= before else 0.0)
        obs = self._observation()
        return obs, reward, reached, False, self._info(True, reached, obs)

    def _observation(self) -> str:
        return f"Target: {self.goal}\nCurrent: {self.position}"

    def _info(self, valid: bool, success: bool, anchor: str) -> dict[str, Any]:
        return {"valid": valid, "success": success, "anchor": anchor, "admissible_actions": list(ACTIONS)}

    def close(self) -> None:
        pass
