"""bench/ecosystem.py's pure parts: which paths run, the steady rate and its ratio to the actors, what the rollouts
were, and the CPU per rollout. (Its runs take minutes, five launcher runs: a benchmark, run by hand;
docs/benchmarks.md.)"""

from __future__ import annotations

import math

import pytest

import bench.ecosystem as eco


def test_paths_parse_in_order_with_the_baseline_always_first() -> None:
    assert eco.parse_paths("verifiers, openai") == ["actors", "openai", "verifiers"]  # WAYS' order, actors added
    assert eco.parse_paths("actors,langgraph,actors") == ["actors", "langgraph"]
    assert eco.parse_paths("") == ["actors"]
    assert eco.parse_paths(",".join(eco.BY_NAME)) == [w.name for w in eco.WAYS]
    with pytest.raises(ValueError, match="unknown path.*crewai.*known: actors, openai"):
        eco.parse_paths("openai,crewai")


def test_the_steady_rate_leaves_out_the_start_and_the_steps_made_ahead() -> None:
    # 6 steps; skip 3 (step 1 and the 2 that the bound let be made ahead); steps 4..6 take 1.0 + 2.0 + 1.0 = 4 s,
    # 1.5 s of it waiting: 3 steps x 16 rollouts / 4 s = 12 rollouts/s, waiting 1.5 / 4 = 37.5%
    times = [(30.0, 29.0), (0.1, 0.0), (0.1, 0.0), (1.0, 0.5), (2.0, 1.0), (1.0, 0.0)]
    rows = [{"version": v + 1, "step_time_s": t, "batch_wait_s": w} for v, (t, w) in enumerate(times)]
    s = eco.steady(list(reversed(rows)) + [{"resumed_from": 0}], rollouts_per_step=16, skip=3)  # any order
    assert (s.steps, s.seconds) == (3, 4.0)
    assert s.rollouts_per_s == pytest.approx(12.0) and s.wait_frac == pytest.approx(0.375)
    with pytest.raises(ValueError, match="nothing steady"):
        eco.steady(rows[:3], rollouts_per_step=16, skip=3)


def test_what_was_played_counts_only_the_rollouts_that_ended() -> None:
    # a: 2 calls (100+10, 140+20 tokens), ended; b: 1 call (80+30), ended; c: 1 call, never ended (its group given
    # up). 3 calls of 2 rollouts: 1.5 calls a rollout, prompt (100+140+80)/3 = 106.67, answer (10+20+30)/3 = 20
    calls = [("a", 100, 10, False), ("b", 80, 30, True), ("c", 500, 500, False), ("a", 140, 20, True)]
    p = eco.played(calls)
    assert p.rollouts == 2 and p.calls_per_rollout == 1.5
    assert p.prompt_tokens == pytest.approx(320 / 3) and p.answer_tokens == pytest.approx(20.0)
    assert math.isnan(eco.played([("c", 1, 1, False)]).calls_per_rollout)


def _result(name: str, rate: float, cpu_cores: dict[str, float]) -> eco.Result:
    s = eco.Steady(steps=10, seconds=160 / rate, rollouts_per_s=rate, wait_frac=0.5)
    return eco.Result(
        eco.BY_NAME[name],
        startup_s=30.0,
        steady=s,
        played=eco.Played(160, 1.0, 80.0, 31.0),
        cpu_ms=eco.cpu_ms_per_rollout(cpu_cores, rate),
    )


def test_cpu_per_rollout_and_the_ratios_to_the_actors_end_the_lines() -> None:
    # actors: 20 rollouts/s on 1.6 + 0.2 cores: 80 + 10 = 90 ms a rollout; openai: 5/s on 1.0 + 0.5 cores: 200 +
    # 100 = 300 ms; rollouts/s 5 / 20 = 0.25x; CPU per rollout, actors' over openai's: 90 / 300 = 0.30x
    actors = _result("actors", 20.0, {"vLLM engine core": 1.6, "actor": 0.2})
    openai = _result("openai", 5.0, {"vLLM engine core": 1.0, "agent (openai)": 0.5})
    assert actors.cpu_ms == pytest.approx({"vLLM engine core": 80.0, "actor": 10.0})
    assert eco.ratio(openai, actors) == pytest.approx(0.25)
    line = eco.row_line(openai, actors)
    assert line.split()[0] == "openai" and line.endswith(" 0.25x") and " 300.0 " in line and " 5.00 " in line
    assert eco.row_line(actors, actors).endswith(" 1.00x")
    assert eco.cpu_line(openai) == (
        "# openai: CPU ms per rollout by process: vLLM engine core 200.0, agent (openai) 100.0 = 300.0"
    )
    assert eco.cpu_ratio_line([actors, openai]).endswith(": openai 0.30x")
    assert eco.last_line([actors, openai]) == (
        "steady rollouts/s against the project's own actors (20.00/s): openai 0.25x"
    )
    assert eco.last_line([actors]).endswith("no other path ran")
    assert len(line) == len(eco.HEADER)  # every figure under its column


def test_a_missing_verifiers_venv_is_a_reason_to_skip(monkeypatch, tmp_path) -> None:
    monkeypatch.setattr(eco, "VF_PYTHON", tmp_path / "missing" / "python")
    monkeypatch.setattr(eco, "REPO_ROOT", tmp_path)
    assert "scripts/setup.sh" in eco.skip_reason(eco.BY_NAME["verifiers"])
    assert eco.skip_reason(eco.BY_NAME["actors"]) == ""
    assert "not installed" in eco.skip_reason(eco.Way("x", "", "", ("no_such_module_here",)))
