"""The main job's pieces that need no run: the held-out success it prints and records, and the warm start the
launcher makes for it (its arguments follow the run's env and memory). The run itself: tests/test_learns.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from agentstream.config import EnvConfig, MemoryConfig
from launcher.progress import format_progress, held_out_line, held_out_summary
from launcher.warm_start import argv_for

ROWS = [
    {"version": 0.0, "val_success_rate": 0.03125, "val_return": 0.0},
    {"version": 12.0, "val_success_rate": 0.25, "val_return": 0.2},
    {"version": 24.0, "val_success_rate": 0.421875, "val_return": 0.4},
]


def test_held_out_success_from_the_first_to_the_latest_validation() -> None:
    assert held_out_line(ROWS) == "held-out success 0.03 at v0 -> 0.42 at v24"
    assert held_out_line(ROWS[:1]) == "held-out success 0.03 at v0"
    assert held_out_line([]) == ""
    assert held_out_summary(ROWS) == {
        "start": {"version": 0.0, "success_rate": 0.03125},
        "end": {"version": 24.0, "success_rate": 0.421875},
    }
    assert held_out_summary([]) == {}
    state = {
        "learner": {"version": 24},
        "engines": [{"version": 24}],
        "rates": {"env_steps_per_s": 1.0, "tokens_per_s": 2.0, "transitions_per_s": 3.0},
        "gauges": {"buffered_transitions": 4, "success_rate": 0.5, "actors_alive": 2},
    }
    assert format_progress(state, 30, 10.0, ROWS).endswith("ETA 10s | held-out success 0.03 at v0 -> 0.42 at v24")
    assert format_progress(state, 30, 10.0).endswith("ETA 10s")  # no validation: the line as before


def test_the_warm_starts_teacher_and_warm_model_go_beside_the_run(tmp_path: Path) -> None:
    from actors.demos import WARM_STAMP, warm_start_success
    from actors.evaluate import stats

    assert warm_start_success(tmp_path) == {}  # not a warm start's folder: nothing to show
    (tmp_path / WARM_STAMP).write_text('{"key": "k", "check": {}}')
    assert warm_start_success(tmp_path) == {}  # a format-only warm start (no teacher): nothing either
    (tmp_path / WARM_STAMP).write_text('{"teacher_success": 0.546875, "warm_success": 0.5, "held_out_episodes": 64}')
    ref = warm_start_success(tmp_path)
    assert ref == {"teacher": 0.546875, "warm_model": 0.5}
    assert held_out_line(ROWS, ref) == "held-out success 0.03 at v0 -> 0.42 at v24 (teacher 0.55)"
    assert held_out_summary(ROWS, ref) == {
        "start": {"version": 0.0, "success_rate": 0.03125},
        "end": {"version": 24.0, "success_rate": 0.421875},
        "warm_start": ref,
    }
    # the dashboard's validation chart draws them beside the run's validation (broker/catalogue.py VALIDATION_GAUGES)
    gauges = stats("evaluator", None, 0, reference=ref).gauges
    assert gauges == {"val_teacher_success": 0.546875, "val_warm_model_success": 0.5}


def test_the_warm_start_fits_the_runs_lake_and_memory() -> None:
    env = EnvConfig(name="agentstream/FrozenLake-v0", max_steps=12, kwargs={"map_size": 5, "frozen_prob": 0.9})
    argv = argv_for(env, MemoryConfig(kind="last_k", k=0), Path("/tmp/warm"))
    pairs = dict(zip(argv[::2], argv[1::2]))
    assert pairs == {
        "--out": "/tmp/warm",
        "--env": "agentstream/FrozenLake-v0",
        "--map-size": "5",
        "--frozen-prob": "0.9",
        "--max-steps": "12",
        "--view": "grid",
        "--memory": "last_k",
        "--k": "0",
    }
    # the env's own defaults (FrozenLake: 4x4, frozen_prob 0.8) when the run does not set them; its safe-moves line
    plain = argv_for(EnvConfig(kwargs={"show_safe_moves": True}), MemoryConfig(), Path("w"))
    assert plain[plain.index("--map-size") + 1] == "4" and plain[plain.index("--frozen-prob") + 1] == "0.8"
    assert plain[-1] == "--show-safe-moves"
    # the run's own task text shapes the prompts, so the warm start gets it too (as JSON, merged into the lake's kwargs)
    brief = argv_for(EnvConfig(kwargs={"instructions": "Reach the goal."}), MemoryConfig(), Path("w"))
    assert brief[-2:] == ["--env-kwargs", '{"instructions": "Reach the goal."}']
    with pytest.raises(ValueError, match="launcher.warm_start --env agentstream/Sokoban-v0"):
        argv_for(EnvConfig(name="agentstream/Sokoban-v0"), MemoryConfig(), Path("w"))


def test_the_warm_start_checks_answers_with_the_envs_own_parser() -> None:
    from envs.base import Action
    from launcher.warm_start import parser

    arena = parser("agentstream/TextArena-v0")
    assert isinstance(arena("<action>bet</action>"), Action) and isinstance(arena("<action>[4]</action>"), Action)
    assert not isinstance(arena("<action>raise</action>"), Action) and not isinstance(arena("bet"), Action)
    lake = parser("agentstream/FrozenLake-v0")
    assert isinstance(lake("<action>down</action>"), Action) and not isinstance(lake("<action>bet</action>"), Action)
