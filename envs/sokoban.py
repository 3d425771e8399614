"""Sokoban as a text game: procedurally generated rooms that are solvable by construction.

A room is made the way gym-sokoban makes it, with this env's own RNG (`self.np_random`) instead of the
global one: a random walk digs the floor out of solid wall, the targets and the player land on random
floor cells, and the boxes start on their targets; then the player walks backwards, *pulling* boxes.
Every pull undoes a legal push, so playing the walk in reverse solves the room: every room is solvable.
gym-sokoban searches the reverse moves depth-first (exponential in the depth); this env runs a few random
reverse walks of `search_depth` moves instead and keeps the one gym-sokoban's score prefers (box swaps x
total box displacement), rejecting walks that leave every box on a target.

Observation: the grid in verl-agent's symbols (`#` wall, `_` floor, `O` target, `X` box, `√` box on target,
`P` player, `S` player on target), one row per line. Answer: `<action>up|down|left|right</action>`.
Rewards are gym-sokoban's: -0.1 per step, +1 when a box lands on a target, -1 when one leaves it, +10 when
all boxes are on targets (which ends the episode with `success`). An unparseable answer does not move
the game and costs the step's -0.1 (as gym-sokoban's no-op; the actor adds its invalid-action penalty): were it
free, an invalid answer would cost the same as a move, and nothing would hold the answer format.

`observation="image"` also puts an RGB rendering (uint8 [H*tile, W*tile, 3]) in `info["image"]`, for
vision-language models; the observation itself stays text. `render_mode="rgb_array"` makes `render()`
return the same picture.

    env = envs.make("agentstream/Sokoban-v0", dim_room=(6, 6), num_boxes=1, max_steps=100)
    obs, info = env.reset(seed=3)
    obs, reward, terminated, truncated, info = env.step("<action>up</action>")
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import numpy as np

from envs.base import ParseResult, StepResult, TextGame, check_observation, parse_tagged, text_space

# gym-sokoban's cell codes, and verl-agent's symbol for each
WALL, FLOOR, TARGET, BOX_ON_TARGET, BOX, PLAYER, PLAYER_ON_TARGET = range(7)
SYMBOLS = ("#", "_", "O", "√", "X", "P", "S")
ACTIONS = ("up", "down", "left", "right")
MOVES = ((-1, 0), (1, 0), (0, -1), (0, 1))  # (d_row, d_col) per action index
_CHOICES = {name: i for i, name in enumerate(ACTIONS)}

PENALTY_FOR_STEP = -0.1
REWARD_BOX_ON_TARGET = 1.0
PENALTY_BOX_OFF_TARGET = -1.0
REWARD_FINISHED = 10.0

INSTRUCTIONS = (
    "You are solving a Sokoban puzzle. Symbols: # wall, _ floor, O target, X box, √ box on a target, "
    "P you, S you standing on a target. Push every box onto a target. You push a box by walking into it; "
    "a box moves only if the cell behind it is free. You cannot pull boxes, so do not push them into "
    "corners or against walls where they get stuck. "
    "Answer with one move: <action>up</action>, <action>down</action>, <action>left</action> or "
    "<action>right</action>."
)

Pos = tuple[int, int]


def parse_action(text: str) -> ParseResult:
    """The first `<action>up|down|left|right</action>` in `text` -> Action(index). Never raises."""
    return parse_tagged(text, _CHOICES)


@dataclass(frozen=True)
class Room:
    """A Sokoban state: the fixed layout (WALL/FLOOR/TARGET codes), the boxes and the player."""

    fixed: np.ndarray  # [H, W] int8
    boxes: frozenset[Pos]
    player: Pos

    @property
    def targets(self) -> frozenset[Pos]:
        return frozenset((int(r), int(c)) for r, c in np.argwhere(self.fixed == TARGET))

    def codes(self) -> np.ndarray:
        """The room as gym-sokoban's cell codes, [H, W]."""
        grid = self.fixed.copy()
        for r, c in self.boxes:
            grid[r, c] = BOX_ON_TARGET if self.fixed[r, c] == TARGET else BOX
        r, c = self.player
        grid[r, c] = PLAYER_ON_TARGET if self.fixed[r, c] == TARGET else PLAYER
        return grid

    def boxes_on_target(self) -> int:
        return sum(int(self.fixed[p] == TARGET) for p in self.boxes)

    def solved(self) -> bool:
        return self.boxes_on_target() == len(self.boxes)


def move(room: Room, action: int) -> Room:
    """One forward move: walk, or push the box in front if the cell behind it is free."""
    dr, dc = MOVES[action]
    r, c = room.player
    ahead = (r + dr, c + dc)
    if room.fixed[ahead] == WALL:
        return room
    boxes = room.boxes
    if ahead in boxes:
        beyond = (r + 2 * dr, c + 2 * dc)
        if room.fixed[beyond] == WALL or beyond in boxes:
            return room
        boxes = (boxes - {ahead}) | {beyond}
    return Room(room.fixed, boxes, ahead)


def render_text(room: Room) -> str:
    """The grid in verl-agent's symbols, cells separated by spaces."""
    return "\n".join(" ".join(SYMBOLS[v] for v in row) for row in room.codes().tolist())


# ---- generation (reverse play from the solved room) ----

_MASKS = np.array(
    [  # the shapes the digger carves at each step (gym-sokoban's set)
        [[0, 0, 0], [1, 1, 1], [0, 0, 0]],
        [[0, 1, 0], [0, 1, 0], [0, 1, 0]],
        [[0, 0, 0], [1, 1, 0], [0, 1, 0]],
        [[0, 0, 0], [1, 1, 0], [1, 1, 0]],
        [[0, 0, 0], [0, 1, 1], [0, 1, 0]],
    ],
    dtype=np.int8,
)


def _topology(rng: np.random.Generator, dim: tuple[int, int], num_steps: int, p_change: float = 0.35) -> np.ndarray:
    """Floor (1) dug out of wall (0) by a random walk; the border always stays wall."""
    h, w = dim
    level = np.zeros(dim, dtype=np.int8)
    pos = np.array([rng.integers(1, h - 1), rng.integers(1, w - 1)])
    direction = np.array(MOVES[rng.integers(4)])
    for _ in range(num_steps):
        if rng.random() < p_change:
            direction = np.array(MOVES[rng.integers(4)])
        pos = np.clip(pos + direction, 1, [h - 2, w - 2])
        r, c = pos - 1
        level[r : r + 3, c : c + 3] |= _MASKS[rng.integers(len(_MASKS))][: h - r, : w - c]
    level[[0, -1], :] = WALL
    level[:, [0, -1]] = WALL
    return level


def _reverse_walk(
    rng: np.random.Generator, fixed: np.ndarray, targets: list[Pos], player: Pos, steps: int
) -> tuple[float, Room]:
    """Walk backwards from the solved room, pulling boxes; returns (gym-sokoban's score, the room reached)."""
    origin_of = {t: t for t in targets}  # current box position -> the target it started on
    swaps, last_box = 0, None
    r, c = player
    for _ in range(steps):
        dr, dc = MOVES[rng.integers(4)]
        ahead = (r + dr, c + dc)
        if fixed[ahead] == WALL or ahead in origin_of:
            continue
        behind = (r - dr, c - dc)
        if behind in origin_of and rng.random() < 0.75:  # pull the box behind along (undoes a push)
            origin = origin_of.pop(behind)
            origin_of[(r, c)] = origin
            if origin != last_box:
                swaps, last_box = swaps + 1, origin
        r, c = ahead
    displacement = sum(abs(p[0] - o[0]) + abs(p[1] - o[1]) for p, o in origin_of.items())
    return float(swaps * displacement), Room(fixed, frozenset(origin_of), (r, c))


def generate_room(
    rng: np.random.Generator,
    dim: tuple[int, int],
    num_boxes: int,
    search_depth: int,
    walks: int = 8,
    max_attempts: int = 100,
) -> Room:
    """A solvable room with `num_boxes` boxes, none of it drawn from outside `rng`."""
    h, w = dim
    for _ in range(max_attempts):
        fixed = _topology(rng, dim, num_steps=int(1.7 * (h + w)))
        floor = np.argwhere(fixed == FLOOR)
        if len(floor) < num_boxes + 1:
            continue
        picks = rng.choice(len(floor), size=num_boxes + 1, replace=False)
        targets = [tuple(int(x) for x in floor[i]) for i in picks[:-1]]
        for t in targets:
            fixed[t] = TARGET
        player = tuple(int(x) for x in floor[picks[-1]])
        best_score, best = 0.0, None
        for _ in range(walks):
            score, room = _reverse_walk(rng, fixed, targets, player, search_depth)
            if score > best_score and not room.solved():
                best_score, best = score, room
        if best is not None:
            return best
    raise RuntimeError(
        f"no solvable {dim} room with {num_boxes} boxes in {max_attempts} attempts; "
        "use a larger dim_room or fewer boxes"
    )


# ---- picture for vision-language models ----

_COLORS = {  # cell code -> (background, foreground) RGB
    WALL: ((90, 90, 90), (120, 120, 120)),
    FLOOR: ((20, 20, 20), (20, 20, 20)),
    TARGET: ((20, 20, 20), (200, 40, 40)),
    BOX_ON_TARGET: ((200, 40, 40), (60, 200, 60)),
    BOX: ((20, 20, 20), (220, 170, 40)),
    PLAYER: ((20, 20, 20), (60, 120, 240)),
    PLAYER_ON_TARGET: ((200, 40, 40), (60, 120, 240)),
}


@functools.lru_cache(maxsize=8)
def _sprites(tile: int) -> np.ndarray:
    """[7, tile, tile, 3] uint8: one small picture per cell code (a square inside its background)."""
    out = np.zeros((len(SYMBOLS), tile, tile, 3), dtype=np.uint8)
    inset = max(1, tile // 5)
    for code, (bg, fg) in _COLORS.items():
        out[code] = bg
        out[code, inset : tile - inset, inset : tile - inset] = fg
    return out


def render_rgb(room: Room, tile: int = 16) -> np.ndarray:
    """The room as an RGB picture, [H * tile, W * tile, 3] uint8."""
    codes = room.codes()  # [H, W]
    h, w = codes.shape
    tiles = _sprites(tile)[codes]  # [H, W, tile, tile, 3]
    return np.ascontiguousarray(tiles.transpose(0, 2, 1, 3, 4).reshape(h * tile, w * tile, 3))


class SokobanText(TextGame):
    """Sokoban with text observations and text actions (see the module docstring)."""

    metadata = {"render_modes": ["rgb_array"], "render_fps": 4}
    invalid_reward = PENALTY_FOR_STEP  # the turn passed, as gym-sokoban's no-op costs (verl-agent's invalid answer)
    instructions = INSTRUCTIONS

    def __init__(
        self,
        dim_room: tuple[int, int] | list[int] = (6, 6),
        num_boxes: int = 1,
        max_steps: int = 100,
        search_depth: int = 100,
        observation: str = "text",
        tile_size: int = 16,
        render_mode: str | None = None,
    ):
        dim = (int(dim_room[0]), int(dim_room[1]))
        if min(dim) < 4:
            raise ValueError(f"dim_room={dim_room}: both sides must be at least 4 (the border is wall)")
        if num_boxes < 1:
            raise ValueError(f"num_boxes={num_boxes}: must be at least 1")
        if render_mode not in (None, "rgb_array"):
            raise ValueError(f"render_mode={render_mode!r}: use None or 'rgb_array'")
        self.dim_room, self.num_boxes, self.max_steps = dim, num_boxes, max_steps
        self.search_depth, self.tile_size = search_depth, tile_size
        self.observation = check_observation(observation)
        self.render_mode = render_mode
        self.observation_space = text_space()
        self.action_space = text_space()
        self._room: Room | None = None
        self._steps = 0

    @property
    def room(self) -> Room:
        """The current state (for solvers and tests)."""
        if self._room is None:
            raise RuntimeError("call reset() before using the room")
        return self._room

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[str, dict[str, Any]]:
        super().reset(seed=seed)
        self._room = generate_room(self.np_random, self.dim_room, self.num_boxes, self.search_depth)
        self._steps = 0
        obs = render_text(self._room)
        return obs, self._info(valid=True, anchor=obs)

    def _started(self) -> bool:
        _ = self.room  # before reset this raises the room's own "call reset() before using the room"
        return True

    def _parse(self, action: str) -> ParseResult:
        return parse_action(action)

    def _invalid(self) -> tuple[str, dict[str, Any]]:
        obs = render_text(self.room)
        return obs, self._info(valid=False, anchor=obs)

    def _step(self, value: int) -> StepResult:
        room = self.room
        before = room.boxes_on_target()
        self._room = new = move(room, value)
        after = new.boxes_on_target()
        reward = PENALTY_FOR_STEP
        if after > before:
            reward += REWARD_BOX_ON_TARGET
        elif after < before:
            reward += PENALTY_BOX_OFF_TARGET
        solved = new.solved()
        if solved:
            reward += REWARD_FINISHED
        obs = render_text(new)
        info = self._info(valid=True, anchor=obs)
        info["moved"] = new is not room
        return obs, float(reward), solved, False, info

    def _info(self, valid: bool, anchor: str) -> dict[str, Any]:
        room = self.room
        info: dict[str, Any] = {
            "valid": valid,
            "success": room.solved(),
            "anchor": anchor,
            "admissible_actions": list(ACTIONS),
            "boxes_on_target": int(room.boxes_on_target()),
        }
        if self.observation == "image":
            info["image"] = render_rgb(room, self.tile_size)
        return info

    def render(self) -> np.ndarray | None:
        if self.render_mode == "rgb_array":
            return render_rgb(self.room, self.tile_size)
        return None

    def close(self) -> None:
        self._room = None
