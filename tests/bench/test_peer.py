"""bench/peer.py's parts that decide what the two systems compare: the prompts TRL trains on are the
ones agentstream's actors send, and the ratios put agentstream over TRL. (Its runs themselves take minutes and a
venv of their own: they are benchmarks, run by hand; docs/benchmarks.md.)"""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

import bench.peer as bench_peer

ROOT = Path(__file__).resolve().parents[2]


def test_the_peer_gets_the_actors_prompts_one_group_per_seed(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    from agentstream.config import TINY_MODEL_DIR
    from envs.reasoning import INSTRUCTIONS
    from launcher.tiny_model import ensure_tiny_model

    tiny_model_dir = ensure_tiny_model(TINY_MODEL_DIR)  # the benchmark's own model

    w = bench_peer.Workload(model=str(tiny_model_dir), batch=16, steps=2)  # 2 steps x 2 groups
    n_tokens = bench_peer.write_prompts(w, tmp_path / "prompts.jsonl")
    lines = [json.loads(line) for line in (tmp_path / "prompts.jsonl").read_text().splitlines()]
    assert len(lines) == 4 and len({line["seed"] for line in lines}) == 4
    assert [line["seed"] - lines[0]["seed"] for line in lines] == [0, 1, 2, 3]  # group g: seed_base + g
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    for line in lines:
        assert INSTRUCTIONS[:40] in line["prompt"] and line["dataset"] == "basic_arithmetic"
        # the text TRL tokenizes is the prompt the engine gets, token for token
        assert tokenizer(line["prompt"], add_special_tokens=False)["input_ids"] == line["prompt_ids"]
    assert n_tokens == len(lines[0]["prompt_ids"]) > 20
    assert len({tuple(line["prompt_ids"]) for line in lines}) == 4  # each seed its own question


def test_ratios_put_agentstream_over_trl_with_the_targets() -> None:
    def result(system: str, mode: str, batch: int, steady_s: float) -> bench_peer.Result:
        return bench_peer.Result(system, mode, batch, steps=5, startup_s=1.0, steady_s=steady_s, detail="")

    # completions/s = (steps - 1) x batch / steady: TRL 4 x 16 / 2 = 32; agentstream 64 / 1 = 64 (2.00x),
    # 64 / 4 = 16 (0.50x); at 64: TRL 256 / 4 = 64, agentstream 256 / 2 = 128 (2.00x, target 1.5)
    results = [
        result("TRL", "sync", 16, 2.0),
        result("agentstream", "sync", 16, 1.0),
        result("agentstream", "async", 16, 4.0),
        result("TRL", "sync", 64, 4.0),
        result("agentstream", "async", 64, 2.0),
    ]
    assert results[1].rate == pytest.approx(64.0)
    assert bench_peer.ratios(results) == [
        "sync at 16: 2.00x (target >= 1.0x)",
        "async at 16: 0.50x (no target)",
        "async at 64: 2.00x (target >= 1.5x)",
    ]


def test_the_cpu_sampler_reports_the_cores_each_process_of_a_tree_used(monkeypatch) -> None:
    monkeypatch.setattr(bench_peer, "ROLES", (("BURN", "burner"), ("DOZE", "sleeper")))
    busy = "import time\nt = time.time()\nwhile time.time() - t < 3: pass"
    tree = (
        f"import subprocess, sys\nkids = [subprocess.Popen([sys.executable, '-c', {busy!r}, 'burn'.upper()]), "
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(3)', 'doze'.upper()])]\n"
        "[k.wait() for k in kids]"
    )  # (the parent's own command line names neither role)
    proc = subprocess.Popen([sys.executable, "-c", tree])  # a parent ("other") and its two children
    with bench_peer.CpuSampler(proc.pid, every_s=0.1) as cpu:
        proc.wait()
    t0 = cpu.samples[0][0] + 0.8  # both children started (a Python start-up is ~0.1 s)
    cores = cpu.cores(t0, t0 + 1.5)
    # a busy loop holds one core (at most 1; more than 0.3 leaves room for a loaded machine), a sleep none, and
    # the parent only waits
    assert 0.3 < cores["burner"] <= 1.05, cores
    assert cores["sleeper"] < 0.1 and cores["other"] < 0.1, cores
    assert list(cores)[0] == "burner"  # most first
    assert cpu.cores(t0, t0) == {}  # fewer than two readings


def test_cpu_lines_and_the_cpu_bound_on_the_ratio() -> None:
    # 1.5 + 0.3 + 0.001 = 1.801 cores at 60 completions/s: 1.801 / 60 = 0.0300 CPU s = 30.0 ms per completion
    line, per = bench_peer.cpu_line({"vLLM engine core": 1.5, "actor": 0.3, "broker": 0.001}, rate=60.0)
    assert per == pytest.approx(1.801 / 60)
    assert "vLLM engine core 1.50, actor 0.30 = 1.80 of" in line and "30.0 CPU ms per completion" in line
    assert "broker" not in line  # under 0.005 cores: left out of the list, kept in the sum
    trl = bench_peer.Result("TRL", "sync", 64, 5, 1.0, 2.0, "", cpu_per_completion=0.03)
    ours = bench_peer.Result("agentstream", "async", 64, 5, 1.0, 2.0, "", cpu_per_completion=0.02)
    assert bench_peer.cpu_bounds([trl, ours]) == ["async at 64: 1.50x"]  # 0.03 / 0.02


def test_the_learn_workload_reaches_the_env_and_the_peers_prompts(tmp_path: Path) -> None:
    from agentstream.config import TINY_MODEL_DIR
    from launcher.tiny_model import ensure_tiny_model

    w = bench_peer.Workload(
        model=str(ensure_tiny_model(TINY_MODEL_DIR)), batch=16, steps=2, dataset_kwargs=bench_peer.LEARN_KWARGS, seed=2
    )
    cfg = bench_peer.compose(bench_peer.workload_overrides(w))  # the launcher's own composition
    assert cfg.env.kwargs["dataset_kwargs"] == bench_peer.LEARN_KWARGS and cfg.run.seed == 2
    bench_peer.write_prompts(w, tmp_path / "prompts.jsonl")
    lines = [json.loads(line) for line in (tmp_path / "prompts.jsonl").read_text().splitlines()]
    assert [line["seed"] for line in lines] == [2 * 1_000_003 + g for g in range(4)]  # run.seed's questions
    for line in lines:
        assert line["kwargs"] == bench_peer.LEARN_KWARGS
        # two numbers from 0 to 10 multiplied: what the TRL side's verifier is built with too
        question = line["prompt"].split("Calculate ")[1].split(".")[0].split()
        assert len(question) == 3 and question[1] == "*" and all(0 <= int(t) <= 10 for t in question[::2])


def test_learning_lines_compare_the_mean_reward_per_completion() -> None:
    # TRL's 2 seeds: means 0.2 and 0.4 (0.3 +- 0.1414); agentstream's: 0.3 and 0.5 (0.4 +- 0.1414);
    # difference 0.1, standard error sqrt(0.02/2 + 0.02/2) = 0.1414: within 2 of them; ratio 0.4/0.3 = 1.33x
    curves = {
        "TRL sync": [(0.0, 0.2, 0.4, 0.2), (0.0, 0.4, 0.6, 0.6)],
        "agentstream sync": [(0.0, 0.4, 0.4, 0.4), (0.0, 0.6, 0.6, 0.8)],
    }
    lines = bench_peer.learning_lines(curves, batch=64, every=2)
    assert lines[1].split() == ["1", "64", "0.000", "0.000"]
    assert lines[2].split() == ["3", "192", "0.500", "0.500"]  # step 3: (0.4+0.6)/2 both
    assert lines[3].split() == ["4", "256", "0.400", "0.600"]  # the last step is always shown
    assert "mean reward over the run +0.3000 +- 0.1414 over 2 seeds" in lines[4]
    # Paired by seed, agentstream is ahead by exactly 0.1 in both seeds: every resample's mean is 0.1.
    assert (
        "agentstream sync +0.1000 +- 0.1414 (as fast or faster; 95% paired bootstrap [+0.1000, +0.1000])" in lines[-2]
    )
    assert lines[-1] == "mean reward over the run, over TRL sync's: agentstream sync 1.33x"
    slower = {"TRL sync": curves["TRL sync"], "agentstream sync": [(0.0, 0.0, 0.0, 0.0)] * 2}
    assert "(slower;" in bench_peer.learning_lines(slower, batch=64, every=2)[-2]


def test_the_paired_interval_holds_the_mean_difference_and_narrows_with_seeds() -> None:
    rng = random.Random(0)
    for n in (3, 8, 30):
        a = [rng.gauss(0.1, 0.02) for _ in range(n)]
        b = [x - 0.03 + rng.gauss(0, 0.01) for x in a]  # a leads by 0.03 give or take the pairing noise
        lo, hi = bench_peer.paired_interval(a, b)
        d = sum(x - y for x, y in zip(a, b)) / n
        assert lo <= d <= hi and hi - lo < 0.05
        if n == 30:
            assert 0.02 < lo and hi < 0.04  # 30 seeds: within a third of the noise's spread of the true 0.03


def test_the_learn_warm_start_writes_a_model_of_format_demonstrations(tmp_path: Path) -> None:
    import subprocess

    # A few steps only (the whole warm start is the benchmark's, ~30 s): the command, its arguments and its record.
    out = tmp_path / "warm"
    argv = [
        sys.executable,
        "-m",
        "launcher.warm_start",
        "--env",
        "agentstream/Reasoning-v0",
        "--dataset-kwargs",
        json.dumps(bench_peer.LEARN_KWARGS),
        *bench_peer.LEARN_WARM_START,
        "--episodes",
        "12",
        "--steps",
        "2",
        "--batch-size",
        "4",
        "--out",
        str(out),
    ]
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    stamp = json.loads((out / "agentstream_warm_start.json").read_text())
    assert stamp["demos"] == 12  # one answer per one-attempt episode
    assert 0.0 <= stamp["check"]["valid_fraction"] <= 1.0 and (out / "config.json").is_file()
    assert stamp["args"]["answer_range"] == "0,20" and stamp["args"]["env"] == "agentstream/Reasoning-v0"
