"""FrozenLake as a text game: gymnasium's FrozenLake (non-slippery by default) with a text grid.

The map is generated from the reset seed (`generate_random_map(map_size, seed)`), so the G episodes of a
group (same seed) face the same lake, and seeds index distinct tasks. The model answers with
`<action>left|down|right|up</action>`; anything else is an invalid action (the game does not move).

    env = envs.make("agentstream/FrozenLake-v0", map_size=4, max_steps=8)
    obs, info = env.reset(seed=3)
    obs, reward, terminated, truncated, info = env.step("<action>right</action>")
"""

from __future__ import annotations

from typing import Any

from gymnasium.envs.toy_text.frozen_lake import FrozenLakeEnv, generate_random_map

from envs.base import ParseResult, StepResult, TextGame, parse_tagged, text_space

ACTIONS = ("left", "down", "right", "up")  # gymnasium's action indices 0..3
_CHOICES = {name: i for i, name in enumerate(ACTIONS)}

INSTRUCTIONS = (
    "You are on a frozen lake grid. P is you, G is the goal, H is a hole, F is frozen ice. "
    "Reach G without stepping into H. Moving off the grid leaves you in place. "
    "Answer with one move: <action>left</action>, <action>down</action>, <action>right</action> "
    "or <action>up</action>."
)
LOCAL_INSTRUCTIONS = (
    "You see what is one move away. The goal is at the bottom right. Reach the goal without stepping into a hole. "
    "Answer with one move: <action>left</action>, <action>down</action>, <action>right</action> or <action>up</action>."
)
VIEWS = ("grid", "local")
OFFSETS = dict(zip(ACTIONS, ((0, -1), (1, 0), (0, 1), (-1, 0))))  # (row, column) change of each move


def parse_action(text: str) -> ParseResult:
    """The first `<action>NAME</action>` in `text` -> Action(index). Never raises."""
    return parse_tagged(text, _CHOICES)


def safe_moves(desc: list[str], row: int, col: int) -> list[str]:
    """The moves that stay on the grid and do not land in a hole, in ACTIONS order."""
    size = len(desc)
    out = []
    for name, (dr, dc) in OFFSETS.items():
        r, c = row + dr, col + dc
        if 0 <= r < size and 0 <= c < size and desc[r][c] != "H":
            out.append(name)
    return out


def neighbours(desc: list[str], row: int, col: int) -> str:
    """The local view: what lies one move away in each direction, in ACTIONS order."""
    size, names = len(desc), {"F": "ice", "S": "ice", "H": "hole", "G": "goal"}
    parts = []
    for name, (dr, dc) in OFFSETS.items():
        r, c = row + dr, col + dc
        parts.append(f"{name} {names[desc[r][c]] if 0 <= r < size and 0 <= c < size else 'off'}")
    return ", ".join(parts) + "."


def render(desc: list[str], row: int, col: int) -> str:
    """The lake as text rows, with P at the player's cell."""
    lines = []
    for r, line in enumerate(desc):
        cells = ["P" if (r, c) == (row, col) else ch.replace("S", "F") for c, ch in enumerate(line)]
        lines.append(" ".join(cells))
    return "\n".join(lines)


class FrozenLakeText(TextGame):
    """FrozenLake with text observations and text actions (see the module docstring)."""

    metadata = {"render_modes": []}
    instructions = INSTRUCTIONS

    def __init__(
        self,
        map_size: int = 4,
        max_steps: int = 8,
        is_slippery: bool = False,
        frozen_prob: float = 0.8,
        show_safe_moves: bool = False,
        hole_reward: float = 0.0,
        view: str = "grid",
        instructions: str = "",
    ):
        if map_size < 2:
            raise ValueError(f"map_size={map_size}: must be at least 2")
        if view not in VIEWS:
            raise ValueError(f"view={view!r}: must be one of {VIEWS}")
        if view == "local" and show_safe_moves:
            raise ValueError(
                "show_safe_moves=True adds a line to the grid view; the local view (view='local') "
                "already names what each move reaches: drop one of them"
            )
        self.map_size = map_size
        self.max_steps = max_steps
        self.is_slippery = is_slippery
        self.frozen_prob = frozen_prob  # gymnasium's `p`: probability that a tile is frozen
        # Also say of each move whether it is safe: stays on the grid and misses the holes (`Safe moves: left no,
        # down yes, right yes, up no.`): the same facts as the grid, said where a small model need not find them
        # by counting columns. Which safe move leads to G is still the task. Each move has a fixed place in the
        # line: the tiny model learnt to read that (supervised, 200 steps) but not a list of just the safe ones.
        self.show_safe_moves = show_safe_moves
        # Reward of the step that falls into a hole (gymnasium gives 0, the same as any other step). Negative, it
        # tells a policy at once that the move was bad, instead of only when other episodes from the same
        # state reach G: reward shaping; success is still reaching G.
        self.hole_reward = hole_reward
        # "grid": the whole lake with P at the player, and the player's row and column. "local": only the four
        # cells one move away (`left ice, down hole, right off, up ice.`: one token each), egocentric and
        # partial, as in MiniGrid: a prompt two thirds as long, where the cells that decide the move are all it shows.
        self.view = view
        # The task text every prompt starts with; `instructions` replaces the view's own (e.g. a shorter one: the
        # tiny model's state at the move is mostly the prompt's constant part, see docs/experiments.md).
        self.instructions = instructions or (INSTRUCTIONS if view == "grid" else LOCAL_INSTRUCTIONS)
        self.observation_space = text_space()
        self.action_space = text_space()
        self._game: FrozenLakeEnv | None = None
        self._desc: list[str] = []
        self._state = 0
        self._steps = 0

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[str, dict[str, Any]]:
        super().reset(seed=seed)
        map_seed = int(self.np_random.integers(2**31)) if seed is None else seed
        self._desc = generate_random_map(self.map_size, p=self.frozen_prob, seed=map_seed)
        # A per-episode game with its own RNG: nothing global is seeded, so concurrent episodes in one
        # process never share random state.
        self._game = FrozenLakeEnv(desc=self._desc, is_slippery=self.is_slippery)
        self._state, _ = self._game.reset(seed=map_seed)
        self._steps = 0
        obs = self._observation()
        return obs, self._info(valid=True, success=False, obs=obs)

    def _started(self) -> bool:
        return self._game is not None

    def _parse(self, action: str) -> ParseResult:
        return parse_action(action)

    def _invalid(self) -> tuple[str, dict[str, Any]]:
        obs = self._observation()
        return obs, self._info(valid=False, success=False, obs=obs)

    def _step(self, value: int) -> StepResult:
        assert self._game is not None
        self._state, reward, terminated, _, _ = self._game.step(value)
        obs = self._observation()
        success = bool(terminated and reward > 0)
        if terminated and not success:
            reward = self.hole_reward
        return obs, float(reward), bool(terminated), False, self._info(True, success, obs)

    def _observation(self) -> str:
        row, col = divmod(int(self._state), self.map_size)
        if self.view == "local":
            return neighbours(self._desc, row, col)
        text = f"{render(self._desc, row, col)}\nYou are at row {row}, column {col}."
        if self.show_safe_moves:
            safe = safe_moves(self._desc, row, col)
            text += "\nSafe moves: " + ", ".join(f"{m} {'yes' if m in safe else 'no'}" for m in ACTIONS) + "."
        return text

    def _info(self, valid: bool, success: bool, obs: str) -> dict[str, Any]:
        return {"valid": valid, "success": success, "anchor": self._anchor(obs), "admissible_actions": list(ACTIONS)}

    def _anchor(self, obs: str) -> str:
        """GiGPO's step-group key: the state (the lake is the group's; the player's cell is the rest). The grid
        view shows both; the local view's text alone is shared by different cells, so the cell is added."""
        if self.view == "grid":
            return obs
        row, col = divmod(int(self._state), self.map_size)
        return f"{obs} (row {row}, column {col})"

    def close(self) -> None:
        self._game = None
