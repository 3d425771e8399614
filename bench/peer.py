"""agentstream against a peer: Hugging Face TRL's `GRPOTrainer` (one process, HF `generate`, synchronous) on the
same workload, in steady completions trained per second; the ratio agentstream/TRL last.

    .venv/bin/python -m bench.peer [--batch 16,64] [--steps 8] [--modes sync,async] [--keep DIR]
    .venv/bin/python -m bench.peer --batch 16 --steps 6 --peer-only
    .venv/bin/python -m bench.peer --agentstream-only --modes sync learner.torch_threads=2
    .venv/bin/python -m bench.peer --learn [--batch 64] [--steps 40] [--seeds 3]
    .venv/bin/python -m bench.peer --learn --model .cache/smollm2-135m-instruct [--steps 20] [--seeds 3] [--keep DIR]

The workload: the 12.6M-parameter local model (`.cache/small-model`, `launcher.tiny_model.SMALL_SHAPE`: the
tiny model 4x wider and 2x deeper; made here once, seconds) in float32, reasoning-gym `basic_arithmetic`
single-turn (`agentstream/Reasoning-v0`, one attempt, one env step), groups of 8, 32 response tokens,
temperature 1.0, lr 1e-3, `--batch` completions per optimizer step (batch/8 groups). `--model .cache/tiny-model`
runs the 0.4M tiny model instead: there each system's fixed costs per step, not the model, set the rate.

TRL runs `bench/peer_trl.py` in a venv of its own (`.cache/peer-venv`: torch, trl, transformers at the
project's pin, reasoning_gym; made here on first use, about a minute) on the prompts agentstream's actors send
for the groups' seeds: this script plays each seed's first turn through the project's own env, memory and
chat template and writes the prompt text, its token ids and the item into a JSONL; the worker checks the ids
and scores answers with reasoning-gym's `score_answer`, as the env does. agentstream runs the real launcher
(`scripts/launch.py`: broker, one vLLM engine, one learner rank, one actor) at `trainer.max_staleness=0`
(sync) and at the config's default bound (async).

Per run: start-up = launch to the end of the first optimizer step; steady = steps 2..N (TRL: the wall clock
between the ends of step 1 and step N; agentstream: the learner's step times, as `bench.overlap` measures),
completions/s = (N-1) x batch / steady. A `#` line after each run says where its step time goes, and one
where its CPU goes: the cores each process used on average over the steady steps (psutil, every 0.5 s), and
the CPU seconds one completion cost. When a run keeps every core busy, cores / (CPU s per completion) bounds
its rate; the ratio of the two systems' CPU s per completion bounds agentstream/TRL on this machine, whatever
the overlap (printed before the ratios).

`--learn` compares learning instead: both systems start from the same format-only warm start
(`python -m launcher.warm_start` on an easy arithmetic: the product of two numbers from 0 to 10, made once into
`.cache/tiny-model-warm-arithmetic`), `--seeds` runs each (run.seed and TRL's seed; each seed its own
questions), and it prints the mean reward of the completions each step trained on against completions
trained, then per system the mean reward over the run (the area under that curve per completion: who learns
faster per sample has more) over the seeds, agentstream's minus TRL's with its standard error, the ratio last.

`--learn --model .cache/smollm2-135m-instruct` (or `--preset NAME`: a model a preset names runs as that preset,
`MODEL_PRESETS`) compares learning on the preset's own workload instead, with no warm start (the model is
pretrained): agentstream runs `scripts/launch.py preset=smollm2` as it stands (only the steps, the seed, the
staleness bound of the mode and the actor's concurrency set here), and TRL gets every figure of it that decides what
is learned (`preset_workload`): the model, the task and its answer reading (`answer_format: last_number`), batch
(groups_per_step x group_size = 4 x 8), lr 2e-4, LoRA r16/alpha 32 on every projection (peft's `LoraConfig` passed to
GRPOTrainer), activation checkpointing (TRL's gradient checkpointing), max_tokens 48, temperature 1.0, top_p 1.0;
what it cannot mirror (another algorithm, optimizer or env) is refused, naming the field. `--steps` defaults to the
preset's trainer.total_steps; launcher overrides after the options reach both sides' workload (`learner.lr=1e-4`
changes both). The sync run's learner takes both cores (`learner.torch_threads=0`: the launcher's choice, 1 thread
when asynchronous), as TRL's 2 torch threads do.

Every --learn comparison also writes, into its folder (`--keep DIR`, else a temporary one), per batch B:
`learn-B.csv` (one row per run and step: system, seed, step, completions trained, seconds since launch at the end of
the step, its mean reward), `reward_vs_completions-B.png` and `reward_vs_seconds-B.png` (bench.compare's plot: each
seed thin, the seeds' mean thick), and prints, and writes as `learn-B-table.txt`, the table: per system the mean
reward over the run, over its last quarter of steps, the wall seconds from launch to the last step's end and the
steady completions/s, each the mean +- sd over the seeds; agentstream over TRL last.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from statistics import mean, stdev
from typing import IO, Any

from agentstream.config import REPO_ROOT, SMALL_MODEL_DIR, SMOLLM2_DIR, Config, TrainerConfig
from agentstream.wire.addresses import free_port
from bench import harness
from launcher.tiny_model import ensure_small_model

PEER_VENV = REPO_ROOT / ".cache" / "peer-venv"
TRL_VERSION = "1.16.0"
DATASET = "basic_arithmetic"
TARGETS = {("sync", 16): 1.0, ("sync", 64): 1.0, ("async", 64): 1.5}  # agentstream/TRL, issue 25
LEARN_TARGETS = {("agentstream async", "completions/s"): 1.5}  # agentstream/TRL in --learn's table, issue 49
LEARN_KWARGS = {
    "min_terms": 2,
    "max_terms": 2,
    "min_digits": 1,
    "max_digits": 1,
    "operators": ["*"],
    "allow_parentheses": False,
    "allow_negation": False,
}
"""--learn's arithmetic: a product of two numbers from 0 to 10; one in six is 0 (a 0 in the question), so there is
something to learn fast: that 0 is often right, then when."""
LEARN_MODEL = REPO_ROOT / ".cache" / "tiny-model-warm-arithmetic"
ROLES = (*harness.ROLES, ("peer_trl", "TRL"))
"""(a word of a process's command line, the name its CPU is reported under); "other" for the rest."""
LEARN_WARM_START = ["--answer-range=0,20"]
"""The warm start's answers: any integer the task's answers lie in, uniformly (not their distribution)."""
MODEL_PRESETS = {SMOLLM2_DIR.resolve(): "smollm2"}
"""--learn --model DIR of a pretrained model: the preset whose workload both systems run (no warm start)."""
PRESET_SYSTEM = ("learner.torch_threads=0",)
"""A preset's agentstream runs, before the user's overrides: the sync run's learner takes every core (the engines
idle while it trains; TRL computes on 2 threads), an async one 1 (agentstream.config.learner_threads)."""
TRL_FIXED: dict[str, Any] = {
    "env.name": "agentstream/Reasoning-v0",
    "env.kwargs.dataset": DATASET,
    "env.kwargs.max_attempts": 1,
    "env.max_steps": 1,
    "model.dtype": "float32",
    "algorithm.advantage": "grpo",
    "algorithm.norm_by_std": True,
    "algorithm.policy_loss": "ppo_clip",
    "algorithm.clip_low": 0.2,
    "algorithm.clip_high": 0.28,
    "algorithm.dual_clip": 0.0,
    "algorithm.loss_agg": "token-mean",
    "algorithm.kl_coef": 0.0,
    "algorithm.entropy_coef": 0.0,
    "learner.weight_decay": 0.0,
    "learner.betas": [0.9, 0.999],
    "learner.eps": 1e-8,
    "learner.max_grad_norm": 1.0,
    "learner.ppo_epochs": 1,
    "learner.mini_batches": 1,
    "trainer.invalid_action_penalty": TrainerConfig().invalid_action_penalty,
}
"""What bench/peer_trl.py runs as it stands (`grpo_settings`, its scorer), as agentstream's config names it: a
preset that sets one of these otherwise cannot be mirrored (`unmirrored`)."""


@dataclass(frozen=True)
class Workload:
    """What both systems train on; `batch` completions per optimizer step."""

    model: str
    batch: int
    steps: int
    group_size: int = 8
    max_tokens: int = 32
    temperature: float = 1.0
    lr: float = 1e-3
    dataset_kwargs: dict[str, Any] = field(default_factory=dict)
    """The reasoning-gym generator's arguments (empty: its defaults)."""
    seed: int = 0
    """run.seed (which questions, group g asks seed_base + g's) and TRL's seed."""
    peer_seed_offset: int = 0
    """Added to `seed` for TRL's own seed: its sampling draws apart from the questions (vLLM samples unseeded)."""
    top_p: float = 1.0
    answer_format: str = "tag"
    """How the env reads an answer (env.kwargs.answer_format); TRL's scorer reads it the same way."""
    lora_rank: int = 0
    """> 0: both sides train a LoRA adapter of this rank (model.lora_*), else every weight."""
    lora_alpha: float = 16.0
    lora_targets: tuple[str, ...] = ()
    lora_dropout: float = 0.0
    activation_checkpointing: bool = False
    """learner.activation_checkpointing; TRL's gradient_checkpointing."""
    preset: str = ""
    """The launcher preset agentstream runs as it stands, `overrides` after it (empty: `workload_overrides` sets
    every figure above for the tiny model)."""
    overrides: tuple[str, ...] = ()

    @property
    def groups(self) -> int:
        return self.batch // self.group_size


class CpuSampler(harness.CpuSampler):
    """`harness.CpuSampler` with TRL's process named (`ROLES`)."""

    def __init__(self, pid: int, every_s: float = 0.5):
        super().__init__(pid, every_s, ROLES)


def cpu_line(cores: dict[str, float], rate: float) -> tuple[str, float]:
    """The `#` line of where a run's CPU went, and its CPU s per completion (nan without readings)."""
    if not cores:
        return "CPU: too few readings in the steady steps", float("nan")
    used = sum(cores.values())
    per = used / rate
    parts = ", ".join(f"{name} {c:.2f}" for name, c in cores.items() if c >= 0.005)
    return (
        f"CPU cores used in the steady steps: {parts} = {used:.2f} of {os.cpu_count()}; "
        f"{1000 * per:.1f} CPU ms per completion (at every core: {(os.cpu_count() or 1) / per:.0f} completions/s)"
    ), per


@dataclass(frozen=True)
class Result:
    """One run: start-up = launch to the end of step 1; steady = steps 2..N."""

    system: str
    mode: str
    batch: int
    steps: int
    startup_s: float
    steady_s: float
    detail: str
    rewards: tuple[float, ...] = ()
    """Each step's mean reward of the completions it trained on."""
    cpu: str = ""
    """Where its CPU went in the steady steps (`cpu_line`)."""
    cpu_per_completion: float = float("nan")
    step_ends: tuple[float, ...] = ()
    """Seconds from launch to the end of each step."""
    seed: int = 0

    @property
    def label(self) -> str:
        return f"{self.system} {self.mode}"

    @property
    def rate(self) -> float:
        """Steady completions trained per second."""
        return (self.steps - 1) * self.batch / self.steady_s


def workload_overrides(w: Workload) -> list[str]:
    """The launcher overrides that set the workload (the same for the prompts written for TRL)."""
    if w.preset:
        return [f"preset={w.preset}", *w.overrides, f"trainer.total_steps={w.steps}", f"run.seed={w.seed}"]
    return [
        f"model.path={w.model}",
        "model.dtype=float32",
        "env.name=agentstream/Reasoning-v0",
        f"+env.kwargs.dataset={DATASET}",
        "+env.kwargs.max_attempts=1",
        "env.max_steps=1",
        f"env.group_size={w.group_size}",
        f"sampling.max_tokens={w.max_tokens}",
        f"sampling.temperature={w.temperature}",
        f"learner.lr={w.lr}",
        f"trainer.groups_per_step={w.groups}",
        f"trainer.total_steps={w.steps}",
        f"run.seed={w.seed}",
        *([f"+env.kwargs.dataset_kwargs={hydra_value(w.dataset_kwargs)}"] if w.dataset_kwargs else []),
    ]


def preset_workload(
    preset: str, steps: int, seed: int, peer_seed_offset: int = 0, overrides: tuple[str, ...] = ()
) -> Workload:
    """The workload of `scripts/launch.py preset=PRESET OVERRIDES` as both sides run it (`steps` 0: the preset's
    trainer.total_steps); SystemExit, naming the fields, when TRL's side cannot run it as agentstream does."""
    cfg = compose([f"preset={preset}", *overrides])
    problems = unmirrored(cfg)
    if problems:
        raise SystemExit(f"preset={preset} {' '.join(overrides)}: TRL's side cannot mirror " + "; ".join(problems))
    model = Path(cfg.model.path)
    return Workload(
        model=str(model if model.is_absolute() else REPO_ROOT / model),  # the launcher runs from the repository
        batch=cfg.trainer.groups_per_step * cfg.env.group_size,
        steps=steps or cfg.trainer.total_steps,
        group_size=cfg.env.group_size,
        max_tokens=cfg.sampling.max_tokens,
        temperature=cfg.sampling.temperature,
        top_p=cfg.sampling.top_p,
        lr=cfg.learner.lr,
        dataset_kwargs=dict(cfg.env.kwargs.get("dataset_kwargs") or {}),
        answer_format=cfg.env.kwargs.get("answer_format", "tag"),
        lora_rank=cfg.model.lora_rank,
        lora_alpha=cfg.model.lora_alpha,
        lora_targets=tuple(cfg.model.lora_target_modules),
        lora_dropout=cfg.model.lora_dropout,
        activation_checkpointing=cfg.learner.activation_checkpointing,
        seed=seed,
        peer_seed_offset=peer_seed_offset,
        preset=preset,
        overrides=overrides,
    )


def unmirrored(cfg: Config) -> list[str]:
    """The fields of `cfg` whose value differs from what TRL's side runs (`TRL_FIXED`), as `field=value (TRL:
    value)`."""
    out = []
    for key, want in TRL_FIXED.items():
        node: Any = cfg
        for part in key.split("."):  # env.kwargs is a dict; max_attempts 1 is the env's own default
            node = (
                node.get(part, 1 if part == "max_attempts" else None) if isinstance(node, dict) else getattr(node, part)
            )
        if node != want:
            out.append(f"{key}={node} (TRL: {want})")
    return out


def hydra_value(value: Any) -> str:
    """`value` (dicts, lists, strings, numbers, booleans) in Hydra's override grammar."""
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{hydra_value(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ",".join(hydra_value(v) for v in value) + "]"
    if isinstance(value, bool):
        return str(value).lower()
    return json.dumps(value) if isinstance(value, str) else str(value)


def compose(overrides: list[str]) -> Config:
    """The run's config as the launcher composes it (conf/config.yaml, presets, then `overrides`)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from agentstream import config as config_mod

    config_mod.register_schemas()
    with initialize_config_dir(config_dir=str(REPO_ROOT / "conf"), version_base=None):
        cfg = hydra_compose(config_name="config", overrides=[*overrides, "run.output_dir=unused"])
    return config_mod.to_object(cfg)


def write_prompts(w: Workload, path: Path) -> int:
    """One line per group of the TRL run: the first turn's prompt as agentstream's actor builds it for the
    group's seed (the env's reset, the memory, the chat template), its token ids and the item. Returns the
    number of prompt tokens of the first group."""
    import asyncio

    from transformers import AutoTokenizer

    from actors.episode import Answer, Turn, play
    from actors.spec import EpisodeSpec
    from broker.spec import broker_spec

    cfg = compose(workload_overrides(w))
    spec = EpisodeSpec.from_config(cfg)
    tokenizer = AutoTokenizer.from_pretrained(w.model)
    seed_base = broker_spec(cfg).seed_base  # group g starts from seed_base + g
    turns: list[Turn] = []

    def first_turn(turn: Turn) -> Answer:
        turns.append(turn)
        return Answer("")

    with path.open("w") as f:
        for g in range(w.steps * w.groups):
            env, mem = spec.make_env(), spec.make_memory(tokenizer)
            try:
                asyncio.run(play(env, mem, first_turn, seed=seed_base + g, step_limit=1))
            finally:
                env.close()
            turn = turns[-1]
            text = tokenizer.apply_chat_template(turn.messages, add_generation_prompt=True, tokenize=False)
            f.write(
                json.dumps(
                    {
                        "seed": seed_base + g,
                        "dataset": DATASET,
                        "kwargs": w.dataset_kwargs,
                        "prompt": text,
                        "prompt_ids": turn.prompt_ids,
                    }
                )
                + "\n"
            )
    return len(turns[0].prompt_ids or [])


def peer_python(log: IO[str]) -> tuple[Path, float]:
    """The peer venv's python, made (or remade) when it does not import TRL; (python, seconds spent making it)."""
    python = PEER_VENV / "bin" / "python"
    pins = {p: installed_version(p) for p in ("torch", "transformers", "reasoning_gym", "peft")}
    check = [
        str(python),
        "-c",
        f"import peft, reasoning_gym, torch, transformers, trl; assert trl.__version__ == {TRL_VERSION!r} and "
        f"transformers.__version__ == {pins['transformers']!r} and peft.__version__ == {pins['peft']!r}",
    ]
    if python.exists() and subprocess.run(check, capture_output=True).returncode == 0:
        return python, 0.0
    t0 = time.time()
    print(f"# making the peer venv {PEER_VENV} (about a minute)", flush=True)
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(PEER_VENV)], check=True)
    packages = [f"trl=={TRL_VERSION}", *(f"{p}=={v.split('+')[0]}" for p, v in pins.items())]  # torch: the CPU wheel
    subprocess.run([str(python), "-m", "pip", "install", "-q", *packages], stdout=log, stderr=log, check=True)
    subprocess.run(check, check=True)
    return python, time.time() - t0


def installed_version(package: str) -> str:
    """The version the project's venv runs, so that both sides run the same one."""
    from importlib.metadata import version

    return version(package)


def trl_argv(w: Workload, python: Path, folder: Path) -> list[str]:
    """bench/peer_trl.py's command for `w`, its prompts in `folder`/prompts.jsonl."""
    lora = [
        *("--lora-rank", str(w.lora_rank), "--lora-alpha", str(w.lora_alpha)),
        *("--lora-targets", ",".join(w.lora_targets), "--lora-dropout", str(w.lora_dropout)),
    ]
    return [
        str(python),
        "-m",
        "bench.peer_trl",
        "--prompts",
        str(folder / "prompts.jsonl"),
        "--model",
        w.model,
        "--out",
        str(folder / "trl-out"),
        "--batch",
        str(w.batch),
        "--steps",
        str(w.steps),
        "--group-size",
        str(w.group_size),
        "--max-tokens",
        str(w.max_tokens),
        "--temperature",
        str(w.temperature),
        "--lr",
        str(w.lr),
        "--invalid-penalty",
        str(invalid_penalty()),
        "--seed",
        str(w.seed + w.peer_seed_offset),
        "--top-p",
        str(w.top_p),
        "--answer-format",
        w.answer_format,
        *(lora if w.lora_rank > 0 else []),
        *(["--gradient-checkpointing"] if w.activation_checkpointing else []),
    ]


def run_trl(w: Workload, python: Path, folder: Path, timeout_s: float) -> Result:
    """TRL's GRPOTrainer on the prompts agentstream's actors would send."""
    folder.mkdir(parents=True, exist_ok=True)
    prompt_tokens = write_prompts(w, folder / "prompts.jsonl")
    argv = trl_argv(w, python, folder)
    t0 = time.time()
    with harness.child(argv, folder / "trl.log") as proc, CpuSampler(proc.pid) as cpu:
        proc.wait(timeout_s)
    lines = (folder / "trl.log").read_text().splitlines()
    events = [json.loads(line) for line in lines if line.startswith('{"event"')]  # TRL prints its logs as dicts
    steps = [e for e in events if e["event"] == "step"]
    if proc.returncode != 0 or len(steps) != w.steps:
        raise RuntimeError(
            f"the TRL run failed (exit {proc.returncode}, {len(steps)} of {w.steps} steps); "
            f"{folder / 'trl.log'} ends:\n{(folder / 'trl.log').read_text()[-3000:]}"
        )
    steady = steps[1:]
    step_s = sum(e["t"] - e["t_begin"] for e in steady) / len(steady)
    gen_s = sum(e["t_generated"] - e["t_begin"] for e in steady) / len(steady)
    ready = next(e["t"] for e in events if e["event"] == "ready")
    rewards = [e["reward_mean"] for e in sorted((e for e in events if e["event"] == "log"), key=lambda e: e["step"])]
    detail = (
        f"TRL step {step_s:.3f} s = generate {gen_s:.3f} + reward/loss/backward/optimizer "
        f"{step_s - gen_s:.3f}; start-up: trainer built {ready - t0:.1f} s after launch; {prompt_tokens} "
        f"prompt tokens; mean reward {mean(rewards) if rewards else 0.0:.3f}"
    )
    steady_s = steps[-1]["t"] - steps[0]["t"]
    return Result(
        "TRL",
        "sync",
        w.batch,
        w.steps,
        steps[0]["t"] - t0,
        steady_s,
        detail,
        tuple(rewards),
        *cpu_line(cpu.cores(steps[0]["t"], steps[-1]["t"]), (w.steps - 1) * w.batch / steady_s),
        step_ends=tuple(e["t"] - t0 for e in steps),
        seed=w.seed,
    )


def invalid_penalty() -> float:
    """agentstream's reward for an answer that does not parse (trainer.invalid_action_penalty's default)."""
    return TrainerConfig().invalid_action_penalty


def run_agentstream(w: Workload, mode: str, bound: int, folder: Path, timeout_s: float, extra: list[str]) -> Result:
    """The real launcher: broker, one vLLM engine it starts, one learner rank, one actor, at staleness `bound`;
    `extra`: more launcher overrides."""
    run_dir = folder / f"agentstream-{mode}-{w.batch}"
    episodes = (bound + 1) * w.groups * w.group_size  # every group the bound lets be in flight
    overrides = [
        *workload_overrides(w),
        "engines.count=1",
        "learner.world_size=1",
        "actors.count=1",
        f"actors.episodes_per_actor={episodes}",
        f"trainer.max_staleness={bound}",
        f"broker.dashboard_port={free_port()}",
        "run.shutdown_timeout_s=5",
        *(o for o in extra if not o.startswith("trainer.max_staleness=")),
    ]  # the mode sets the bound
    t0, wall, cpu = harness.run_launcher(run_dir, overrides, f"({mode}, batch {w.batch})", timeout_s, watch=CpuSampler)
    m = harness.measure(bound, wall, run_dir, [])
    metrics = run_dir / "learner_metrics.jsonl"
    every = sorted((r for r in harness.learner_rows(run_dir) if "version" in r), key=lambda r: r["version"])
    rows = every[1:]
    first_step_end = metrics.stat().st_mtime - m.train_s  # the learner wrote step N's row train_s after step 1's
    avg = {
        k: sum(r.get(k, 0.0) for r in rows) / len(rows)
        for k in ("step_time_s", "batch_wait_s", "compute_s", "publish_s")
    }
    train = avg["step_time_s"] - avg["batch_wait_s"] - avg["publish_s"]
    detail = (
        f"learner step {avg['step_time_s']:.3f} s = batch wait {avg['batch_wait_s']:.3f} + train "
        f"{train:.3f} (compute {avg['compute_s']:.3f}) + publish {avg['publish_s']:.3f}; staleness "
        f"{m.staleness_mean:.2f}; trained {m.transitions} transitions; {m.status}; wall {wall:.1f} s"
    )
    rate = (w.steps - 1) * w.batch / m.train_s
    return Result(
        "agentstream",
        mode,
        w.batch,
        w.steps,
        first_step_end - t0,
        m.train_s,
        detail,
        tuple(r["reward_mean"] for r in every),
        *cpu_line(cpu.cores(first_step_end, metrics.stat().st_mtime), rate),
        step_ends=step_ends([r["step_time_s"] for r in every], metrics.stat().st_mtime - t0),
        seed=w.seed,
    )


def step_ends(step_times: list[float], end: float) -> tuple[float, ...]:
    """When each learner step ended, from the steps' durations and the last one's end (the metrics file's last
    write): the learner runs its steps back to back, each from asking for its batch to publishing its weights."""
    ends = [end]
    for s in reversed(step_times[1:]):
        ends.append(ends[-1] - s)
    return tuple(reversed(ends))


def print_result(r: Result) -> None:
    print(
        f"{r.system:>11} {r.mode:>5} {r.batch:>5} {r.steps:>5} {r.startup_s:>10.1f} {r.steady_s:>8.2f} {r.rate:>13.1f}",
        flush=True,
    )
    print(f"# {r.detail}", flush=True)
    if r.cpu:
        print(f"# {r.cpu}", flush=True)


def cpu_bounds(results: list[Result]) -> list[str]:
    """Per (mode, batch): TRL's CPU s per completion over agentstream's, the most agentstream/TRL can reach on
    this machine when both keep every core busy."""
    peer = {r.batch: r for r in results if r.system == "TRL"}
    return [
        f"{r.mode} at {r.batch}: {peer[r.batch].cpu_per_completion / r.cpu_per_completion:.2f}x"
        for r in results
        if r.system == "agentstream" and r.batch in peer
    ]


def ratios(results: list[Result]) -> list[str]:
    """agentstream/TRL per (mode, batch), the issue's target in parentheses."""
    peer = {r.batch: r for r in results if r.system == "TRL"}
    out = []
    for r in results:
        if r.system == "agentstream" and r.batch in peer:
            target = TARGETS.get((r.mode, r.batch))
            out.append(
                f"{r.mode} at {r.batch}: {r.rate / peer[r.batch].rate:.2f}x"
                + (f" (target >= {target:.1f}x)" if target else " (no target)")
            )
    return out


def warm_model(log: Path) -> Path:
    """--learn's starting weights (made once; launcher.warm_start redoes them only when an input changed)."""
    argv = [
        sys.executable,
        "-m",
        "launcher.warm_start",
        "--env",
        "agentstream/Reasoning-v0",
        "--dataset",
        DATASET,
        "--dataset-kwargs",
        json.dumps(LEARN_KWARGS),
        *LEARN_WARM_START,
        "--out",
        str(LEARN_MODEL),
    ]
    with log.open("w") as out:
        if subprocess.run(argv, cwd=REPO_ROOT, stdout=out, stderr=subprocess.STDOUT).returncode != 0:
            raise RuntimeError(f"the warm start failed; {log} ends:\n{log.read_text()[-3000:]}")
    return LEARN_MODEL


def paired_interval(a: list[float], b: list[float], draws: int = 10_000, seed: int = 0) -> tuple[float, float]:
    """The 95% bootstrap interval of mean(a - b) over seeds, paired: seed s of each system played the same questions
    (seeds drawn with replacement, `draws` times; the 2.5th and 97.5th percentiles of the resampled means)."""
    import numpy as np

    d = np.asarray(a[: len(b)]) - np.asarray(b[: len(a)])
    means = d[np.random.default_rng(seed).integers(0, len(d), (draws, len(d)))].mean(axis=1)
    return float(np.quantile(means, 0.025)), float(np.quantile(means, 0.975))


def learning_lines(curves: dict[str, list[tuple[float, ...]]], batch: int, every: int) -> list[str]:
    """`curves`: per system label (TRL first), each seed's per-step rewards. The table of the mean reward over
    the seeds every `every` steps against completions trained; each system's mean reward over the run (the area
    under its reward-against-completions curve, per completion: who learns faster per sample has more), its mean
    +- standard deviation over the seeds; agentstream's minus TRL's (+- its standard error, and a paired bootstrap
    interval); the ratio last."""
    labels = list(curves)
    steps = min(len(c) for runs in curves.values() for c in runs)
    lines = [f"{'step':>5} {'completions':>11} " + " ".join(f"{label:>16}" for label in labels)]
    for i in [*range(0, steps - 1, every), steps - 1]:
        lines.append(
            f"{i + 1:>5} {(i + 1) * batch:>11} "
            + " ".join(f"{mean(c[i] for c in curves[label]):>16.3f}" for label in labels)
        )
    areas = {label: [mean(c[:steps]) for c in runs] for label, runs in curves.items()}

    def spread(xs: list[float]) -> float:
        return stdev(xs) if len(xs) > 1 else 0.0

    for label, xs in areas.items():
        lines.append(
            f"# {label}: mean reward over the run {mean(xs):+.4f} +- {spread(xs):.4f} over {len(xs)} seeds "
            f"({', '.join(f'{x:+.4f}' for x in xs)}); at step 1 {mean(c[0] for c in curves[label]):+.4f}"
        )
    peer, rest = labels[0], labels[1:]
    diffs, ratios_ = [], []
    for label in rest:
        se = (spread(areas[label]) ** 2 / len(areas[label]) + spread(areas[peer]) ** 2 / len(areas[peer])) ** 0.5
        d = mean(areas[label]) - mean(areas[peer])
        verdict = "as fast or faster" if d >= -2 * se else "slower"
        lo, hi = paired_interval(areas[label], areas[peer])
        diffs.append(f"{label} {d:+.4f} +- {se:.4f} ({verdict}; 95% paired bootstrap [{lo:+.4f}, {hi:+.4f}])")
        ratio = mean(areas[label]) / mean(areas[peer]) if mean(areas[peer]) > 0 else float("nan")
        ratios_.append(f"{label} {ratio:.2f}x")
    lines.append(f"# mean reward minus {peer}'s (within 2 standard errors: as fast): " + ", ".join(diffs))
    lines.append(f"mean reward over the run, over {peer}'s: " + ", ".join(ratios_))
    return lines


def learn(args: argparse.Namespace, modes: list[str], bounds: dict[str, int], folder: Path) -> None:
    """--learn: reward against completions trained and against seconds, TRL and agentstream on the same workload,
    `--seeds` each: the tiny model from its arithmetic warm start, or a preset's (`learn_preset`) as it stands."""
    preset = learn_preset(args.model, args.preset)
    plans, about = preset_plan(preset, args) if preset else warm_start_plan(args, folder)
    if preset:
        bounds = {"sync": 0, "async": compose(workload_overrides(plans[0][0])).trainer.max_staleness}
    with (folder / "peer-venv.log").open("w") as log:
        python, _ = peer_python(log)
    w = plans[0][0]
    print(f"# learning: {about}; {w.steps} steps, {args.seeds} seeds, lr {w.lr:g}; runs in {folder}", flush=True)
    for workloads in plans:
        results: dict[str, list[Result]] = {}
        for w in workloads:
            # a real model's step takes ~45 s (TRL) here on a quiet machine, many times that beside other work
            timeout_s = args.run_timeout_s or (300 + 180 * w.steps if w.preset else 600.0)
            runs = (
                []
                if args.agentstream_only
                else [run_trl(w, python, folder / f"seed-{w.seed}" / f"trl-{w.batch}", timeout_s)]
            )
            extra = [] if w.preset else args.override  # a preset's workload carries them
            runs += [
                run_agentstream(w, mode, bounds[mode], folder / f"seed-{w.seed}", timeout_s, extra) for mode in modes
            ]
            for r in runs:
                results.setdefault(r.label, []).append(r)
                print(
                    f"# seed {w.seed}: {r.system} {r.mode} {w.batch}: mean reward {mean(r.rewards):+.4f}, "
                    f"{r.rate:.1f} completions/s",
                    flush=True,
                )
        report_learning(results, w, folder)


def preset_plan(preset: str, args: argparse.Namespace) -> tuple[list[list[Workload]], str]:
    """--learn on a preset: one batch (the preset's), a workload per seed; and the line that says what it runs."""
    overrides = (*PRESET_SYSTEM, *preset_overrides(args))
    seeds = [preset_workload(preset, args.steps, seed, args.peer_seed_offset, overrides) for seed in range(args.seeds)]
    w = seeds[0]
    if Path(w.model).resolve() == SMOLLM2_DIR.resolve():  # the prompts for TRL need its tokenizer first
        from launcher.real_model import ensure_smollm2

        ensure_smollm2(w.model)
    about = (
        f"preset={preset} {' '.join(overrides)}: {DATASET} {json.dumps(w.dataset_kwargs)} read as "
        f"{w.answer_format}, from {w.model} (pretrained, no warm start); batch {w.batch} (groups of "
        f"{w.group_size}), {w.max_tokens} tokens, temperature {w.temperature:g}, "
        f"LoRA r{w.lora_rank}/alpha {w.lora_alpha:g} on {','.join(w.lora_targets)}, activation checkpointing "
        f"{w.activation_checkpointing}"
    )
    return [seeds], about


def warm_start_plan(args: argparse.Namespace, folder: Path) -> tuple[list[list[Workload]], str]:
    """--learn on the tiny model: per `--batch`, a workload per seed from its arithmetic warm start (made here)."""
    model = warm_model(folder / "warm-start.log")
    lr = Workload.lr if args.lr is None else args.lr
    plans = [
        [
            Workload(
                str(model),
                batch,
                args.steps or 40,
                dataset_kwargs=LEARN_KWARGS,
                seed=seed,
                lr=lr,
                peer_seed_offset=args.peer_seed_offset,
            )
            for seed in range(args.seeds)
        ]
        for batch in (int(b) for b in (args.batch or "16,64").split(","))
    ]
    return plans, f"{DATASET} {json.dumps(LEARN_KWARGS)}, from {model} (format-only warm start)"


def learn_preset(model: str, preset: str) -> str:
    """--learn's preset: `preset`, else the one `model` belongs to (`MODEL_PRESETS`), else "" (the tiny model)."""
    return preset or (MODEL_PRESETS.get(Path(model).resolve(), "") if model else "")


def preset_overrides(args: argparse.Namespace) -> list[str]:
    """The command line's changes to a preset's workload, as launcher overrides: --model, --lr, then the rest."""
    return [
        *([f"model.path={Path(args.model).resolve()}"] if args.model else []),
        *([f"learner.lr={args.lr}"] if args.lr is not None else []),
        *args.override,
    ]


def report_learning(results: dict[str, list[Result]], w: Workload, folder: Path) -> None:
    """The learning comparison's lines (`learning_lines`), then into `folder`: learn-B.csv (each run's steps),
    the two plots and the table (`learning_table`, also printed)."""
    from bench.compare import plot, write_csv

    for line in learning_lines(
        {k: [r.rewards for r in rs] for k, rs in results.items()}, w.batch, max(1, w.steps // 8)
    ):
        print(line, flush=True)
    curves = {label: [curve_rows(r) for r in rs] for label, rs in results.items()}
    rows = [
        {"system": label, "seed": r.seed, **row} for label, rs in results.items() for r in rs for row in curve_rows(r)
    ]
    stem = folder / f"learn-{w.batch}"
    write_csv(stem.with_suffix(".csv"), rows, ["system", "seed", "step", "completions", "wall_s", "reward_mean"])
    lora = f", LoRA r{w.lora_rank}" if w.lora_rank else ""
    title = f"{Path(w.model).name}: batch {w.batch}, G {w.group_size}, lr {w.lr:g}{lora}, CPU"
    for x, xlabel, name in (
        ("completions", "completions trained", "reward_vs_completions"),
        ("wall_s", "wall-clock seconds since launch", "reward_vs_seconds"),
    ):
        path = folder / f"{name}-{w.batch}.png"
        plot(curves, x, xlabel, title, path, y="reward_mean", ylabel="mean reward of the step's completions", ylim=None)
    table = learning_table(results, last=max(1, w.steps // 4))
    (folder / f"learn-{w.batch}-table.txt").write_text("\n".join(table) + "\n")
    for line in table:
        print(line, flush=True)
    print(f"# wrote {stem}.csv, {stem}-table.txt, reward_vs_completions-{w.batch}.png, reward_vs_seconds-{w.batch}.png")


def curve_rows(r: Result) -> list[dict[str, float]]:
    """A run's steps: step, completions trained by its end, seconds since launch at its end, its mean reward."""
    return [
        {"step": k + 1, "completions": (k + 1) * r.batch, "wall_s": round(t, 2), "reward_mean": reward}
        for k, (t, reward) in enumerate(zip(r.step_ends, r.rewards, strict=True))
    ]


def learning_table(results: dict[str, list[Result]], last: int) -> list[str]:
    """Per system (TRL first): the mean reward over the run and over its `last` steps, the wall seconds from launch
    to the last step's end, the steady completions/s (steps 2..N), each the mean +- sd over the seeds; then each
    other system over the first, the ratio of the means (a reward ratio only where the first's is positive), with
    issue 49's target for completions/s."""
    columns = {
        "mean reward": lambda r: mean(r.rewards),
        f"last {last} steps": lambda r: mean(r.rewards[-last:]),
        "wall s": lambda r: r.step_ends[-1],
        "completions/s": lambda r: r.rate,
    }
    figures = {label: {name: [f(r) for r in rs] for name, f in columns.items()} for label, rs in results.items()}
    lines = [f"{'system':<18} {'seeds':>5} " + " ".join(f"{name:>18}" for name in columns)]
    for label, cells in figures.items():
        text = " ".join(f"{mean(xs):>9.3f} +- {stdev(xs) if len(xs) > 1 else 0.0:<5.3f}" for xs in cells.values())
        lines.append(f"{label:<18} {len(results[label]):>5} {text}")
    peer, *rest = figures
    for label in rest:
        parts = []
        for name in columns:
            ours, theirs = mean(figures[label][name]), mean(figures[peer][name])
            ok = theirs > 0 or name not in ("mean reward", f"last {last} steps")
            target = LEARN_TARGETS.get((label, name))
            parts.append(
                f"{name} {f'{ours / theirs:.2f}x' if ok else 'n/a'}" + (f" (target >= {target:.1f}x)" if target else "")
            )
        lines.append(f"{label} over {peer}: " + ", ".join(parts))
    return lines


def main() -> None:
    parser = harness.arguments(
        __doc__,
        model=True,
        default_model=f"{SMALL_MODEL_DIR}, made if missing; --learn: the tiny model's arithmetic warm start",
    )
    parser.add_argument(
        "--batch", default="", help="completions per optimizer step, a comma list (default 16,64; a preset's: its own)"
    )
    parser.add_argument(
        "--steps",
        type=int,
        default=0,
        help="optimizer steps per run (steady state: 2..N); default 8, with --learn 40 (a preset: its total_steps)",
    )
    parser.add_argument(
        "--learn",
        action="store_true",
        help="compare learning (reward against completions) from the same warm start instead of speed",
    )
    parser.add_argument("--seeds", type=int, default=3, help="--learn: runs per system")
    parser.add_argument(
        "--lr",
        type=float,
        default=None,
        help=f"--learn: both systems' learning rate (default {Workload.lr:g}; a preset's)",
    )
    parser.add_argument(
        "--preset",
        default="",
        help="--learn: compare on this launcher preset's workload as it stands (default: the preset of --model, "
        f"{', '.join(f'{m.name} -> {p}' for m, p in MODEL_PRESETS.items())})",
    )
    parser.add_argument(
        "--peer-seed-offset",
        type=int,
        default=0,
        help="--learn: TRL's seed is the questions' seed plus this (other sampling, same questions)",
    )
    parser.add_argument(
        "--modes",
        default="sync,async",
        help="agentstream's modes: sync (max_staleness=0), async (the config's default bound)",
    )
    parser.add_argument("--peer-only", action="store_true", help="run TRL only")
    parser.add_argument("--agentstream-only", action="store_true", help="run agentstream only")
    parser.add_argument(
        "--run-timeout-s", type=float, default=0.0, help="each run's limit (0: 600 s; a preset's: 300 + 180 s a step)"
    )
    parser.add_argument("--keep", default="", help="keep the run folders here (default: a temporary folder)")
    parser.add_argument(
        "override",
        nargs="*",
        help="more launcher overrides for every agentstream run, e.g. "
        "learner.torch_threads=2 (trainer.max_staleness=K: the async bound)",
    )
    args = parser.parse_args()
    if args.steps and args.steps < 2:
        parser.error("--steps must be at least 2: step 1 holds the start-up")
    bounds = {"sync": 0, "async": compose(args.override).trainer.max_staleness}
    modes = [m for m in args.modes.split(",") if m]
    unknown = [m for m in modes if m not in bounds]
    if unknown:
        parser.error(f"unknown mode(s) {unknown}; known: {', '.join(bounds)}")
    modes = [] if args.peer_only else modes
    preset = learn_preset(args.model, args.preset) if args.learn else ""
    if args.preset and not args.learn:
        parser.error("--preset: with --learn only")
    if preset and args.batch:
        parser.error(
            f"--batch: preset={preset} sets the batch (trainer.groups_per_step=N after the options changes it)"
        )
    if preset and not args.model:
        args.model = str(REPO_ROOT / compose([f"preset={preset}"]).model.path)
    if not (args.model or args.learn):  # the speed workload's model (issue 38, option a); --learn makes its own
        args.model = str(ensure_small_model(SMALL_MODEL_DIR))
    model, folder = harness.begin(args.model, "bench-peer-", args.keep)
    if args.learn:
        learn(args, modes, bounds, folder)
        return
    args.steps = args.steps or 8
    if not args.agentstream_only:
        with (folder / "peer-venv.log").open("w") as log:
            python, made_s = peer_python(log)
        if made_s:
            print(f"# peer venv made in {made_s:.0f} s", flush=True)
    print(
        f"# {DATASET} single-turn on {model}, groups of 8, 32 tokens, temperature 1.0, lr 1e-3, fp32; "
        f"TRL {TRL_VERSION} (HF generate, 2 torch threads); agentstream: 1 vLLM engine, 1 learner rank, 1 actor; "
        f"async = max_staleness {bounds['async']}; runs in {folder}",
        flush=True,
    )
    print(
        f"{'system':>11} {'mode':>5} {'batch':>5} {'steps':>5} {'start-up s':>10} {'steady s':>8} "
        f"{'completions/s':>13}",
        flush=True,
    )
    results: list[Result] = []
    for batch in (int(b) for b in (args.batch or "16,64").split(",")):
        w = Workload(model, batch, args.steps)
        if batch % w.group_size:
            raise SystemExit(f"--batch {batch}: must be a multiple of the group size {w.group_size}")
        if not args.agentstream_only:
            results.append(run_trl(w, python, folder / f"trl-{batch}", args.run_timeout_s or 600.0))
            print_result(results[-1])
        for mode in modes:
            results.append(run_agentstream(w, mode, bounds[mode], folder, args.run_timeout_s or 600.0, args.override))
            print_result(results[-1])
    cpu_ratios = cpu_bounds(results)
    if cpu_ratios:
        print(
            "# TRL's CPU s per completion over agentstream's (agentstream/TRL at every core busy): "
            + ", ".join(cpu_ratios)
        )
    lines = ratios(results)
    if lines:
        print("agentstream/TRL completions/s: " + ", ".join(lines))


if __name__ == "__main__":
    main()
