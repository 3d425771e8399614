"""Taxi as text: a BFS that reads only the text map delivers the passenger on several seeds, with Taxi-v3's
rewards; the parser never raises and accepts the direction aliases."""

from collections import deque

import pytest

import envs
from envs.base import Action, ParseFailure
from envs.taxi import parse_action

MOVES = {"south": (1, 0), "north": (-1, 0), "east": (0, 1), "west": (0, -1)}


def read(obs: str) -> tuple[list[str], dict[str, tuple[int, int]], tuple[int, int], str | None, str]:
    """(map rows, stand -> cell, taxi cell, passenger's stand or None if in the taxi, destination stand)."""
    lines = obs.splitlines()
    grid = lines[1:6]
    stands = {ch: (r, (c - 1) // 2) for r, line in enumerate(grid) for c, ch in enumerate(line) if ch in "RGYB"}
    taxi = next((r, (c - 1) // 2) for r, line in enumerate(grid) for c, ch in enumerate(line) if ch == "T")
    words = lines[7]
    passenger = None if "in the taxi" in words else words.split("waiting at ")[1][0]
    dest = words.split("Destination: ")[1][0]
    for stand, cell in zip("RGYB", [(0, 0), (0, 4), (4, 0), (4, 3)]):  # a stand under the taxi is hidden
        stands.setdefault(stand, cell)
    return grid, stands, taxi, passenger, dest


def path(grid: list[str], start: tuple[int, int], goal: tuple[int, int]) -> list[str]:
    """Shortest moves on the 5x5 grid; a '|' between two cells blocks east/west."""
    parent = {start: None}
    queue = deque([start])
    while queue:
        cell = queue.popleft()
        if cell == goal:
            break
        r, c = cell
        for name, (dr, dc) in MOVES.items():
            nr, nc = r + dr, c + dc
            if not (0 <= nr < 5 and 0 <= nc < 5):
                continue
            if dc and grid[r][2 * c + 1 + dc] == "|":  # the character between the two cells
                continue
            if (nr, nc) not in parent:
                parent[(nr, nc)] = (cell, name)
                queue.append((nr, nc))
    plan, cell = [], goal
    while parent[cell] is not None:
        cell, name = parent[cell]
        plan.append(name)
    return plan[::-1]


def test_bfs_from_the_text_delivers_the_passenger() -> None:
    env = envs.make("agentstream/Taxi-v0", max_steps=60)
    for seed in range(8):
        obs, _ = env.reset(seed=seed)
        grid, stands, taxi, passenger, dest = read(obs)
        assert passenger is not None
        plan = (
            path(grid, taxi, stands[passenger]) + ["pickup"] + path(grid, stands[passenger], stands[dest]) + ["dropoff"]
        )
        total = 0.0
        for name in plan:
            obs, reward, term, trunc, info = env.step(f"<action>{name}</action>")
            total += reward
        assert term and info["success"] and not trunc
        # -1 for every action but the last, +20 for the drop-off at the destination
        assert total == pytest.approx(-(len(plan) - 1) + 20)


def test_illegal_pickup_costs_10_and_text_moves() -> None:
    env = envs.make("agentstream/Taxi-v0")
    for seed in range(20):
        obs, _ = env.reset(seed=seed)
        _, stands, taxi, passenger, _ = read(obs)
        if stands[passenger] != taxi:  # not at the passenger's stand: a pickup is illegal
            _, r, term, _, info = env.step("<action>pickup</action>")
            assert (r, term, info["valid"]) == (-10.0, False, True)
            _, r, _, _, info = env.step("<action>north</action>")
            assert r == -1.0 and info["valid"]
            break
    else:
        raise AssertionError("the taxi started at the passenger's stand 20 times")
    _, r, _, _, info = env.step("<action>go</action>")
    assert (r, info["valid"]) == (-1.0, False) and "unknown action" in info["parse_error"]  # the step's -1


def test_parser_aliases() -> None:
    assert parse_action("<action>down</action>") == parse_action("<action>South</action>") == Action(0)
    assert parse_action("<action>dropoff</action>") == Action(5)
    assert isinstance(parse_action("south"), ParseFailure)
