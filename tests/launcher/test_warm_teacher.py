"""The FrozenLake warm start's teacher (launcher/warm_start.py): it reads the lake as the model sees it, and it is
imperfect by the chosen amount, measured on fixed held-out lakes. No model: a few seconds."""

from __future__ import annotations

import random

import pytest

from actors.demos import FormatSpec
from envs.base import VALIDATION_SEEDS
from launcher.warm_start import TEACHER_P, frozenlake_teacher, lake_cells, safe_forward_move, teacher_success

LAKES = [VALIDATION_SEEDS[i] for i in range(256)]
"""The first 256 held-out lakes (the run validates on the first 64 of them)."""


def spec(p: float, **kwargs: object) -> FormatSpec:
    """The main job's lake (cpu_learn: 5x5, frozen_prob 0.9, 16 steps) with the teacher at `p`."""
    lake = {"map_size": 5, "frozen_prob": 0.9, **kwargs}
    return FormatSpec("agentstream/FrozenLake-v0", lake, 16, "last_k", 0, teacher=frozenlake_teacher(p))


def test_the_teacher_reads_both_views_as_the_model_sees_them() -> None:
    # The grid view: P at row 1, column 1; left F, down H, right G, up F (worked out from the picture).
    grid = "F F F\nF P G\nF H F\nYou are at row 1, column 1."
    assert lake_cells(grid) == {"left": "ice", "down": "hole", "right": "goal", "up": "ice"}
    # P in the top-left corner: left and up are off the lake.
    assert lake_cells("P H\nF G\nYou are at row 0, column 0.") == {
        "left": "off",
        "down": "ice",
        "right": "hole",
        "up": "off",
    }
    local = "left ice, down hole, right off, up ice."
    assert lake_cells(local) == {"left": "ice", "down": "hole", "right": "off", "up": "ice"}
    rng = random.Random(0)
    # Of right and down only down is safe in the corner; in the local example neither is, so left or up.
    assert {safe_forward_move(lake_cells("P H\nF G\nYou are at row 0, column 0."), rng) for _ in range(20)} == {"down"}
    assert {safe_forward_move(lake_cells(local), rng) for _ in range(40)} == {"left", "up"}


@pytest.mark.parametrize("view", ["grid", "local"])
def test_the_teacher_is_imperfect_by_the_chosen_amount(view: str) -> None:
    # The chosen p makes the teacher win about 0.55 of the held-out lakes (issue 50: 0.5-0.6). Over 256 lakes the
    # standard error of a rate near 0.55 is sqrt(0.55 * 0.45 / 256) = 0.031; the band 0.55 +- 0.08 is ~2.5 of them,
    # so a teacher whose rate on all lakes is 0.55 lands outside it on 256 of them about 1% of the time, and one
    # whose rate is 0.45 or 0.65 (off the target) lands inside only ~0.6% of the time. Seeded: the same figure each
    # run; both views make the same moves on the same lakes, so they agree.
    rate = teacher_success(spec(TEACHER_P, view=view), LAKES, seed=0)
    assert 0.47 <= rate <= 0.63, f"teacher at p={TEACHER_P} won {rate:.3f} of {len(LAKES)} held-out lakes"
    # The imperfection is p's: the scripted policy alone wins ~0.96 (docs/experiments.md), uniform moves ~0.02.
    assert teacher_success(spec(1.0, view=view), LAKES, seed=0) >= 0.9
    assert teacher_success(spec(1e-9, view=view), LAKES, seed=0) <= 0.1
