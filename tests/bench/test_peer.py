"""bench.peer's parts (bench/peer.py, bench/peer_run.py, bench/peer_learn.py) that decide what the two systems
compare: the prompts TRL trains on are the ones agentstream's actors send, and the ratios put agentstream over TRL.
(Its runs themselves take minutes and a venv of their own: they are benchmarks, run by hand; docs/benchmarks.md.)"""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

import bench.peer as bench_peer
from bench import peer_learn, peer_run

ROOT = Path(__file__).resolve().parents[2]


def test_the_peer_gets_the_actors_prompts_one_group_per_seed(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    from agentstream.config import TINY_MODEL_DIR
    from envs.reasoning import INSTRUCTIONS
    from launcher.tiny_model import ensure_tiny_model

    tiny_model_dir = ensure_tiny_model(TINY_MODEL_DIR)  # the benchmark's own model

    w = peer_run.Workload(model=str(tiny_model_dir), batch=16, steps=2)  # 2 steps x 2 groups
    n_tokens = peer_run.write_prompts(w, tmp_path / "prompts.jsonl")
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
    def result(system: str, mode: str, batch: int, steady_s: float) -> peer_run.Result:
        return peer_run.Result(system, mode, batch, steps=5, startup_s=1.0, steady_s=steady_s, detail="")

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
    monkeypatch.setattr(peer_run, "ROLES", (("BURN", "burner"), ("DOZE", "sleeper")))
    busy = "import time\nt = time.time()\nwhile time.time() - t < 3: pass"
    tree = (
        f"import subprocess, sys\nkids = [subprocess.Popen([sys.executable, '-c', {busy!r}, 'burn'.upper()]), "
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(3)', 'doze'.upper()])]\n"
        "[k.wait() for k in kids]"
    )  # (the parent's own command line names neither role)
    proc = subprocess.Popen([sys.executable, "-c", tree])  # a parent ("other") and its two children
    with peer_run.CpuSampler(proc.pid, every_s=0.1) as cpu:
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
    line, per = peer_run.cpu_line({"vLLM engine core": 1.5, "actor": 0.3, "broker": 0.001}, rate=60.0)
    assert per == pytest.approx(1.801 / 60)
    assert "vLLM engine core 1.50, actor 0.30 = 1.80 of" in line and "30.0 CPU ms per completion" in line
    assert "broker" not in line  # under 0.005 cores: left out of the list, kept in the sum
    trl = peer_run.Result("TRL", "sync", 64, 5, 1.0, 2.0, "", cpu_per_completion=0.03)
    ours = peer_run.Result("agentstream", "async", 64, 5, 1.0, 2.0, "", cpu_per_completion=0.02)
    assert bench_peer.cpu_bounds([trl, ours]) == ["async at 64: 1.50x"]  # 0.03 / 0.02


def test_the_learn_workload_reaches_the_env_and_the_peers_prompts(tmp_path: Path) -> None:
    from agentstream.config import TINY_MODEL_DIR
    from launcher.tiny_model import ensure_tiny_model

    w = peer_run.Workload(
        model=str(ensure_tiny_model(TINY_MODEL_DIR)), batch=16, steps=2, dataset_kwargs=peer_learn.LEARN_KWARGS, seed=2
    )
    cfg = peer_run.compose(peer_run.workload_overrides(w))  # the launcher's own composition
    assert cfg.env.kwargs["dataset_kwargs"] == peer_learn.LEARN_KWARGS and cfg.run.seed == 2
    peer_run.write_prompts(w, tmp_path / "prompts.jsonl")
    lines = [json.loads(line) for line in (tmp_path / "prompts.jsonl").read_text().splitlines()]
    assert [line["seed"] for line in lines] == [2 * 1_000_003 + g for g in range(4)]  # run.seed's questions
    for line in lines:
        assert line["kwargs"] == peer_learn.LEARN_KWARGS
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
    lines = peer_learn.learning_lines(curves, batch=64, every=2)
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
    assert "(slower;" in peer_learn.learning_lines(slower, batch=64, every=2)[-2]


def test_the_paired_interval_holds_the_mean_difference_and_narrows_with_seeds() -> None:
    rng = random.Random(0)
    for n in (3, 8, 30):
        a = [rng.gauss(0.1, 0.02) for _ in range(n)]
        b = [x - 0.03 + rng.gauss(0, 0.01) for x in a]  # a leads by 0.03 give or take the pairing noise
        lo, hi = peer_learn.paired_interval(a, b)
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
        json.dumps(peer_learn.LEARN_KWARGS),
        *peer_learn.LEARN_WARM_START,
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


def test_the_trl_side_runs_the_real_models_preset_with_its_figures() -> None:
    from agentstream.config import SMOLLM2_DIR
    from bench import peer_trl
    from learner.model import lora_spec

    # The model's directory picks its preset, and a run of it starts from the preset's own figures.
    assert peer_learn.learn_preset(str(SMOLLM2_DIR), "") == "smollm2"
    assert peer_learn.learn_preset(str(ROOT / ".cache" / "tiny-model"), "") == ""
    w = peer_learn.preset_workload("smollm2", 0, seed=1, overrides=peer_learn.PRESET_SYSTEM)
    args = peer_trl.arguments().parse_args(peer_run.trl_argv(w, Path("python"), Path("/run"))[3:])
    settings = peer_trl.grpo_settings(args)
    # conf/preset/smollm2.yaml: groups_per_step 4 x group_size 8 = 32 completions a step, lr 2e-4, 48 tokens at
    # temperature 1.0 (top_p 1.0: the schema's default), 20 steps, each layer recomputed in backward
    assert Path(args.model) == SMOLLM2_DIR and args.steps == 20 and args.seed == 1
    assert settings["per_device_train_batch_size"] == 32 and settings["num_generations"] == 8
    assert settings["gradient_accumulation_steps"] == 1  # one optimizer step per batch, as the learner takes
    assert settings["learning_rate"] == pytest.approx(2e-4) and settings["lr_scheduler_type"] == "constant"
    assert settings["max_completion_length"] == 48 and settings["temperature"] == 1.0 and settings["top_p"] == 1.0
    assert settings["gradient_checkpointing"] and not settings["use_vllm"] and settings["beta"] == 0.0
    assert args.answer_format == "last_number" and args.invalid_penalty == pytest.approx(-0.1)
    # LoRA r16, alpha 32 on every projection: the adapter the learner builds, field for field
    cfg = peer_run.compose(peer_run.workload_overrides(w))  # what the agentstream runs launch
    ours = lora_spec(cfg.model.lora_rank, cfg.model.lora_alpha, cfg.model.lora_target_modules, cfg.model.lora_dropout)
    assert ours is not None
    theirs = peer_trl.lora_config(args)
    assert theirs.r == 16 and theirs.lora_alpha == 32
    assert set(theirs.target_modules) == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    assert theirs.to_dict() == ours.peft_config().to_dict()
    # the agentstream side runs the preset as it stands: only steps, seed and the learner's threads set here
    assert peer_run.workload_overrides(w) == [
        "preset=smollm2",
        "learner.torch_threads=0",
        "trainer.total_steps=20",
        "run.seed=1",
    ]
    assert cfg.learner.lr == pytest.approx(2e-4) and cfg.trainer.groups_per_step * cfg.env.group_size == 32
    # sums of two 1-digit numbers, the questions TRL's scorer rebuilds from the prompts' `kwargs`
    assert (
        cfg.env.kwargs["dataset_kwargs"]
        == w.dataset_kwargs
        == {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}
    )
    # the tiny model's workload keeps its TRL run: every weight trained, no recompute
    tiny = peer_trl.arguments().parse_args(
        peer_run.trl_argv(peer_run.Workload("tiny", 16, 8), Path("python"), Path("/run"))[3:]
    )
    assert peer_trl.lora_config(tiny) is None and not peer_trl.grpo_settings(tiny)["gradient_checkpointing"]
    assert tiny.answer_format == "tag" and peer_trl.grpo_settings(tiny)["learning_rate"] == pytest.approx(1e-3)


def test_a_preset_the_trl_side_cannot_mirror_is_refused_and_overrides_reach_both_sides() -> None:
    with pytest.raises(SystemExit, match=r"algorithm.advantage=gigpo \(TRL: grpo\)"):
        peer_learn.preset_workload("smollm2", 2, 0, overrides=("algorithm=gigpo",))
    w = peer_learn.preset_workload("smollm2", 2, 0, overrides=("learner.lr=1e-4", "trainer.groups_per_step=2"))
    assert w.lr == pytest.approx(1e-4) and w.batch == 16 and w.steps == 2  # 2 groups of 8
    assert "learner.lr=1e-4" in peer_run.workload_overrides(w)


def test_the_trl_scorer_reads_an_answer_as_the_env_does() -> None:
    from bench import peer_trl
    from envs.base import Action
    from envs.reasoning import parse_answer, parse_last_number

    texts = [
        "The sum is 7.",
        "3 + 4 = 7, so <answer>7</answer>",
        "<answer>5</answer> no, <answer>6</answer> and then 9",
        "<answer> </answer> it is -2.5 or 3",
        "no number here",
        "<answer></answer>",
        "",
    ]
    for text in texts:
        for fmt, env_parse in (("tag", parse_answer), ("last_number", parse_last_number)):
            parsed = env_parse(text)
            assert peer_trl.parse(text, fmt) == (parsed.value if isinstance(parsed, Action) else ""), (text, fmt)
    # by hand: a sentence's last number only when reading last numbers; the last non-empty tag before any number
    assert peer_trl.parse("The sum is 7.", "tag") == "" and peer_trl.parse("The sum is 7.", "last_number") == "7"
    assert peer_trl.parse("<answer> </answer> it is -2.5 or 3", "last_number") == "3"


def test_step_ends_count_back_from_the_last_steps_end() -> None:
    # steps of 5, 2 and 3 s, the last ending 20 s after launch: step 3 ends at 20, step 2 at 20 - 3 = 17, step 1 at
    # 17 - 2 = 15 (step 1's own 5 s, start-up included, does not matter)
    assert peer_run.step_ends([5.0, 2.0, 3.0], 20.0) == (15.0, 17.0, 20.0)
    assert peer_run.step_ends([4.0], 9.0) == (9.0,)


def _result(system: str, mode: str, rewards: tuple[float, ...], ends: tuple[float, ...], seed: int = 0):
    # batch 8 over 4 steps: steady = the last end minus the first's
    return peer_run.Result(
        system, mode, 8, len(rewards), ends[0], ends[-1] - ends[0], "", rewards, step_ends=ends, seed=seed
    )


def test_the_learning_table_gives_each_systems_figures_and_the_ratios() -> None:
    results = {
        "TRL sync": [
            _result("TRL", "sync", (0.0, 0.2, 0.2, 0.4), (10.0, 20.0, 30.0, 40.0)),
            _result("TRL", "sync", (0.2, 0.2, 0.4, 0.4), (10.0, 20.0, 30.0, 40.0), seed=1),
        ],
        "agentstream async": [
            _result("agentstream", "async", (0.2, 0.2, 0.4, 0.6), (20.0, 25.0, 30.0, 35.0)),
            _result("agentstream", "async", (0.2, 0.4, 0.4, 0.6), (20.0, 25.0, 30.0, 35.0), seed=1),
        ],
    }
    lines = peer_learn.learning_table(results, last=2)
    # TRL: mean rewards 0.2 and 0.3 (0.25 +- 0.0707); last 2 steps 0.3 and 0.4 (0.35); wall 40 s; 3 x 8 / 30 = 0.8/s.
    # agentstream: 0.35 and 0.4 (0.375); last 2: 0.5 and 0.5 (0.5); wall 35 s; 3 x 8 / 15 = 1.6/s.
    assert lines[1].split() == ["TRL", "sync", "2", "0.250", "+-", "0.071", "0.350", "+-", "0.071"] + [
        "40.000",
        "+-",
        "0.000",
        "0.800",
        "+-",
        "0.000",
    ]
    assert lines[2].split()[3:5] == ["0.375", "+-"] and lines[2].split()[-3] == "1.600"
    # ratios: 0.375 / 0.25 = 1.50, 0.5 / 0.35 = 1.43, 35 / 40 = 0.88, 1.6 / 0.8 = 2.00
    assert lines[3] == (
        "agentstream async over TRL sync: mean reward 1.50x, last 2 steps 1.43x, wall s 0.88x, "
        "completions/s 2.00x (target >= 1.5x)"
    )
    flat = {"TRL sync": [_result("TRL", "sync", (-0.1, 0.0), (1.0, 2.0))], "agentstream sync": results["TRL sync"][:1]}
    assert "mean reward n/a" in peer_learn.learning_table(flat, last=1)[-1]  # no ratio over a reward of 0 or less


def test_the_learning_report_writes_the_curves_the_plots_and_the_table(tmp_path: Path, capsys) -> None:
    import csv

    w = peer_run.Workload("model", batch=8, steps=2)
    results = {
        "TRL sync": [_result("TRL", "sync", (0.0, 0.5), (10.0, 20.0))],
        "agentstream sync": [_result("agentstream", "sync", (0.25, 0.5), (12.0, 16.0))],
    }
    peer_learn.report_learning(results, w, tmp_path)
    rows = list(csv.DictReader((tmp_path / "learn-8.csv").open()))
    assert [(r["system"], r["step"], r["completions"], r["wall_s"], r["reward_mean"]) for r in rows] == [
        ("TRL sync", "1", "8", "10.0", "0.0"),
        ("TRL sync", "2", "16", "20.0", "0.5"),
        ("agentstream sync", "1", "8", "12.0", "0.25"),
        ("agentstream sync", "2", "16", "16.0", "0.5"),
    ]
    for name in ("reward_vs_completions-8.png", "reward_vs_seconds-8.png"):
        assert (tmp_path / name).read_bytes()[:4] == b"\x89PNG"
    table = (tmp_path / "learn-8-table.txt").read_text().splitlines()
    assert table[-1].startswith("agentstream sync over TRL sync: ") and table[-1] in capsys.readouterr().out
