"""FrozenLake text env: the parser never raises, groups share a lake, moves do what the grid says."""

import random
import re
import string

import pytest

import envs
from envs.base import Action, ParseFailure
from envs.frozenlake import ACTIONS, parse_action


def test_parser_accepts_each_move_and_ignores_surrounding_text() -> None:
    for i, name in enumerate(ACTIONS):
        assert parse_action(f"I think <action>{name}</action> is best") == Action(i)
        assert parse_action(f"<action> {name.upper()} </action>") == Action(i)
    assert parse_action("<action>up</action><action>left</action>") == Action(3)  # the first tag wins


def test_parser_returns_typed_failures() -> None:
    assert isinstance(parse_action(""), ParseFailure)
    assert "no <action>" in parse_action("go left").reason
    assert "unknown move" in parse_action("<action>jump</action>").reason
    assert isinstance(parse_action(None), ParseFailure)  # type: ignore[arg-type]


def test_parser_never_raises_on_random_strings() -> None:
    rng = random.Random(0)
    alphabet = string.printable + "<>/ü\x00"
    pieces = ["<action>", "</action>", "left", "up", "<", ">", "action"]
    for _ in range(5000):
        text = "".join(
            rng.choice(pieces) if rng.random() < 0.3 else rng.choice(alphabet) for _ in range(rng.randint(0, 40))
        )
        assert isinstance(parse_action(text), (Action, ParseFailure))


def test_same_seed_same_lake_and_invalid_action_does_not_move() -> None:
    a = envs.make("agentstream/FrozenLake-v0", map_size=5, max_steps=4)
    b = envs.make("agentstream/FrozenLake-v0", map_size=5, max_steps=4)
    obs_a, _ = a.reset(seed=11)
    obs_b, _ = b.reset(seed=11)
    assert obs_a == obs_b and obs_a.startswith("P")  # start is the top-left corner
    assert len(obs_a.splitlines()[0].split()) == 5
    obs, reward, term, trunc, info = a.step("nonsense")
    assert (obs, reward, term, trunc, info["valid"]) == (obs_a, 0.0, False, False, False)
    assert "parse_error" in info


def test_a_move_down_then_right_follows_the_grid() -> None:
    env = envs.make("agentstream/FrozenLake-v0", map_size=4, max_steps=10)
    for seed in range(50):
        obs, _ = env.reset(seed=seed)
        grid = [line.split() for line in obs.splitlines()[:4]]
        if grid[1][0] == "F":  # the cell below the start is frozen ice: moving down lands there
            obs, reward, term, _, info = env.step("<action>down</action>")
            assert info["valid"] and not term and reward == 0.0
            assert obs.splitlines()[1].split()[0] == "P" and "row 1, column 0" in obs
            return
    raise AssertionError("no seed with ice below the start in 50 maps")


def test_truncation_after_max_steps_and_success_on_goal() -> None:
    env = envs.make("agentstream/FrozenLake-v0", map_size=2, max_steps=3, frozen_prob=1.0)
    env.reset(seed=0)  # 2x2 all ice: S F / F G
    _, _, term, trunc, _ = env.step("<action>up</action>")  # off-grid: stays
    assert not term and not trunc
    _, r, term, trunc, info = env.step("<action>right</action>")
    assert not term
    _, r, term, trunc, info = env.step("<action>down</action>")  # reaches G on the last allowed step
    assert term and not trunc and r == 1.0 and info["success"]
    env.reset(seed=0)
    for _ in range(2):
        env.step("x")
    assert env.step("x")[3] is True  # the 3rd step truncates


def _bfs(obs: str) -> list[str] | None:
    """Shortest moves from P to G avoiding H, read from the text grid alone."""
    from collections import deque

    grid = [line.split() for line in obs.splitlines() if line and line[0] in "PFHG"]
    n = len(grid)
    start = next((r, c) for r in range(n) for c in range(n) if grid[r][c] == "P")
    deltas = {"left": (0, -1), "down": (1, 0), "right": (0, 1), "up": (-1, 0)}
    parent = {start: None}
    queue = deque([start])
    while queue:
        cell = queue.popleft()
        if grid[cell[0]][cell[1]] == "G":
            plan = []
            while parent[cell] is not None:
                cell, name = parent[cell]
                plan.append(name)
            return plan[::-1]
        for name, (dr, dc) in deltas.items():
            r, c = cell[0] + dr, cell[1] + dc
            if 0 <= r < n and 0 <= c < n and grid[r][c] != "H" and (r, c) not in parent:
                parent[(r, c)] = (cell, name)
                queue.append((r, c))
    return None


def test_bfs_reaches_the_goal_on_several_seeds() -> None:
    env = envs.make("agentstream/FrozenLake-v0", map_size=6, max_steps=40)
    for seed in range(8):
        obs, _ = env.reset(seed=seed)
        plan = _bfs(obs)
        assert plan is not None  # generate_random_map only returns lakes with a path
        for name in plan:
            obs, reward, term, trunc, info = env.step(f"<action>{name}</action>")
        assert term and info["success"] and reward == 1.0


def test_safe_moves_line_lists_the_moves_the_grid_shows_are_on_the_lake_and_not_holes() -> None:
    """Property over random lakes and walks: `Safe moves:` agrees with the rendered grid cell by cell (on the
    grid and not H), and the observation without the option is the same text minus that line."""
    rng = random.Random(3)
    offsets = {"left": (0, -1), "down": (1, 0), "right": (0, 1), "up": (-1, 0)}
    for seed in range(30):
        size = rng.randint(2, 7)
        env = envs.make("agentstream/FrozenLake-v0", map_size=size, max_steps=20, show_safe_moves=True)
        plain = envs.make("agentstream/FrozenLake-v0", map_size=size, max_steps=20)
        obs, _ = env.reset(seed=seed)
        plain_obs, _ = plain.reset(seed=seed)
        for _ in range(10):
            lines = obs.splitlines()
            assert "\n".join(lines[:-1]) == plain_obs
            grid = [row.split() for row in lines[:size]]
            ((row, col),) = [(r, c) for r in range(size) for c in range(size) if grid[r][c] == "P"]
            assert lines[-1].startswith("Safe moves: ") and lines[-1].endswith(".")
            said = lines[-1][len("Safe moves: ") : -1]
            expected = [
                m
                for m, (dr, dc) in offsets.items()
                if 0 <= row + dr < size and 0 <= col + dc < size and grid[row + dr][col + dc] != "H"
            ]
            assert said == ", ".join(f"{m} {'yes' if m in expected else 'no'}" for m in offsets), obs
            move = rng.choice(ACTIONS)
            obs, _, term, trunc, _ = env.step(f"<action>{move}</action>")
            plain_obs, *_ = plain.step(f"<action>{move}</action>")
            if term or trunc:
                break


def test_hole_reward_is_paid_only_on_the_step_into_a_hole() -> None:
    """Random walks on random lakes: a step that lands on an H of the grid shown before it pays hole_reward
    and ends the episode, a step onto G pays 1, every other step 0; without the option a hole pays 0."""
    rng = random.Random(7)
    holes = 0
    for seed in range(40):
        shaped = envs.make("agentstream/FrozenLake-v0", map_size=5, max_steps=30, frozen_prob=0.7, hole_reward=-0.5)
        plain = envs.make("agentstream/FrozenLake-v0", map_size=5, max_steps=30, frozen_prob=0.7)
        obs, _ = shaped.reset(seed=seed)
        plain.reset(seed=seed)
        for _ in range(30):
            before = [line.split() for line in obs.splitlines()[:5]]
            move = f"<action>{rng.choice(ACTIONS)}</action>"
            obs, reward, term, trunc, info = shaped.step(move)
            _, plain_reward, *_ = plain.step(move)
            row, col = (int(x) for x in re.findall(r"row (\d+), column (\d+)", obs)[0])
            in_hole = before[row][col] == "H"
            assert term == (in_hole or info["success"])
            assert reward == (-0.5 if in_hole else 1.0 if info["success"] else 0.0)
            assert plain_reward == (1.0 if info["success"] else 0.0)
            holes += in_hole
            if term or trunc:
                break
    assert holes >= 10  # the property was exercised: 70% ice, random moves


def test_local_view_names_the_cell_each_move_reaches_as_the_grid_shows_it() -> None:
    """Property over random lakes and walks: the local view (`left ice, down hole, right off, up goal.`) says,
    for each move in order, what the grid view of the same lake shows one cell away (F/S ice, H hole, G goal,
    off the grid: off); its GiGPO anchor adds the cell (the text alone is shared by cells); both views move
    alike, and a wrong view is refused with the choices."""
    rng = random.Random(5)
    offsets = {"left": (0, -1), "down": (1, 0), "right": (0, 1), "up": (-1, 0)}
    names = {"F": "ice", "H": "hole", "G": "goal"}
    seen: set[str] = set()
    for seed in range(30):
        size = rng.randint(2, 7)
        local = envs.make("agentstream/FrozenLake-v0", map_size=size, max_steps=20, frozen_prob=0.7, view="local")
        grid = envs.make("agentstream/FrozenLake-v0", map_size=size, max_steps=20, frozen_prob=0.7)
        assert local.unwrapped.instructions != grid.unwrapped.instructions
        obs, info = local.reset(seed=seed)
        grid_obs, _ = grid.reset(seed=seed)
        for _ in range(10):
            cells = [row.split() for row in grid_obs.splitlines()[:size]]
            ((row, col),) = [(r, c) for r in range(size) for c in range(size) if cells[r][c] == "P"]
            expected = []
            for move, (dr, dc) in offsets.items():
                r, c = row + dr, col + dc
                expected.append(f"{move} {names[cells[r][c]] if 0 <= r < size and 0 <= c < size else 'off'}")
            assert obs == ", ".join(expected) + ".", (obs, grid_obs)
            assert info["anchor"] == f"{obs} (row {row}, column {col})"
            seen.update(e.split()[1] for e in expected)
            move = f"<action>{rng.choice(ACTIONS)}</action>"
            obs, reward, term, trunc, info = local.step(move)
            grid_obs, grid_reward, grid_term, grid_trunc, _ = grid.step(move)
            assert (reward, term, trunc) == (grid_reward, grid_term, grid_trunc)
            if term or trunc:
                break
    assert seen == {"ice", "hole", "goal", "off"}  # every kind of cell was checked
    with pytest.raises(ValueError, match=r"view='map': must be one of \('grid', 'local'\)"):
        envs.make("agentstream/FrozenLake-v0", view="map")
    with pytest.raises(ValueError, match="drop one of them"):
        envs.make("agentstream/FrozenLake-v0", view="local", show_safe_moves=True)


def test_instructions_replace_the_views_task_text_and_nothing_else() -> None:
    for view in ("grid", "local"):
        own = envs.make("agentstream/FrozenLake-v0", view=view)
        brief = envs.make("agentstream/FrozenLake-v0", view=view, instructions="Reach the goal, avoid holes.")
        assert brief.unwrapped.instructions == "Reach the goal, avoid holes." != own.unwrapped.instructions
        assert brief.reset(seed=4) == own.reset(seed=4)
        assert brief.step("<action>down</action>") == own.step("<action>down</action>")
