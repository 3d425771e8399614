"""Taxi as a text game: gymnasium's Taxi-v3 (5x5 grid, four stands R, G, Y, B) with a text map.

The taxi (T) picks the passenger up at one stand and drops them off at another. Rewards are Taxi-v3's: -1
per step, +20 for the drop-off at the destination (ends the episode with `success`), -10 for a pickup or
drop-off where none is allowed. An unparseable answer does not move the taxi and costs the step's -1. The
start (taxi cell, passenger stand, destination) comes from the env's own RNG, seeded by `reset(seed=...)`.
The model answers with `<action>NAME</action>`, NAME one of south, north, east, west, pickup, dropoff
(down, up, right, left also work).

    env = envs.make("agentstream/Taxi-v0", max_steps=50)
    obs, info = env.reset(seed=3)
    obs, reward, terminated, truncated, info = env.step("<action>north</action>")
"""

from __future__ import annotations

from typing import Any

from gymnasium.envs.toy_text.taxi import TaxiEnv

from envs.base import ParseResult, StepResult, TextGame, parse_tagged, text_space

ACTIONS = ("south", "north", "east", "west", "pickup", "dropoff")  # gymnasium's action indices 0..5
_ALIASES = {"down": 0, "up": 1, "right": 2, "left": 3, "drop off": 5, "pick up": 4}
_CHOICES = {**{name: i for i, name in enumerate(ACTIONS)}, **_ALIASES}
STANDS = "RGYB"  # gymnasium's location indices 0..3; 4 means "in the taxi"

INSTRUCTIONS = (
    "You drive a taxi (T) on a 5x5 grid drawn with walls '|' you cannot cross (':' is open road). "
    "Row 0 is the top, column 0 the left. Pick the passenger up at their stand (R, G, Y or B) and drop "
    "them off at the destination stand. Each move costs 1 point, a correct drop-off earns 20, and a "
    "pickup or drop-off in the wrong place costs 10. Answer with one action: <action>south</action>, "
    "<action>north</action>, <action>east</action>, <action>west</action>, <action>pickup</action> or "
    "<action>dropoff</action>."
)


def parse_action(text: str) -> ParseResult:
    """The first `<action>NAME</action>` in `text` -> Action(gymnasium index). Never raises."""
    return parse_tagged(text, _CHOICES, what="action")


def render(desc: list[str], locs: list[tuple[int, int]], taxi: tuple[int, int], passenger: int, dest: int) -> str:
    """The map with T at the taxi's cell, then the passenger and the destination in words."""
    lines = [list(line) for line in desc]
    row, col = taxi
    lines[row + 1][2 * col + 1] = "T"
    if passenger == 4:
        where = "in the taxi"
    else:
        pr, pc = locs[passenger]
        where = f"waiting at {STANDS[passenger]} (row {pr}, column {pc})"
    dr, dc = locs[dest]
    return "\n".join(
        [
            *("".join(line) for line in lines),
            f"Taxi at row {row}, column {col}. Passenger: {where}. "
            f"Destination: {STANDS[dest]} (row {dr}, column {dc}).",
        ]
    )


class TaxiText(TextGame):
    """Taxi with text observations and text actions (see the module docstring)."""

    metadata = {"render_modes": []}
    invalid_reward = -1.0  # Taxi-v3's step penalty: the turn passed (free, an invalid answer would beat a move)
    instructions = INSTRUCTIONS

    def __init__(self, max_steps: int = 200, is_rainy: bool = False, fickle_passenger: bool = False):
        self.max_steps = max_steps
        self.observation_space = text_space()
        self.action_space = text_space()
        # One game per env: building Taxi's transition table takes a few ms; its RNG is re-seeded per reset.
        self._game = TaxiEnv(is_rainy=is_rainy, fickle_passenger=fickle_passenger)
        self._desc = [b"".join(row).decode() for row in self._game.desc.tolist()]
        self._state: int | None = None
        self._steps = 0

    @property
    def state(self) -> tuple[int, int, int, int]:
        """(taxi row, taxi column, passenger location 0-4, destination 0-3), gymnasium's encoding."""
        if self._state is None:
            raise RuntimeError("call reset() before step()")
        return tuple(int(x) for x in self._game.decode(self._state))  # type: ignore[return-value]

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[str, dict[str, Any]]:
        super().reset(seed=seed)
        self._state, _ = self._game.reset(seed=int(self.np_random.integers(2**31)))
        self._steps = 0
        obs = self._observation()
        return obs, self._info(valid=True, success=False, anchor=obs)

    def _started(self) -> bool:
        return self._state is not None

    def _parse(self, action: str) -> ParseResult:
        return parse_action(action)

    def _invalid(self) -> tuple[str, dict[str, Any]]:
        obs = self._observation()
        return obs, self._info(valid=False, success=False, anchor=obs)

    def _step(self, value: int) -> StepResult:
        self._state, reward, terminated, _, _ = self._game.step(value)
        obs = self._observation()
        done = bool(terminated)  # Taxi ends only at a correct drop-off
        return obs, float(reward), done, False, self._info(True, done, obs)

    def _observation(self) -> str:
        row, col, passenger, dest = self.state
        return render(self._desc, self._game.locs, (row, col), passenger, dest)

    def _info(self, valid: bool, success: bool, anchor: str) -> dict[str, Any]:
        return {"valid": valid, "success": success, "anchor": anchor, "admissible_actions": list(ACTIONS)}

    def close(self) -> None:
        self._state = None
