"""What both of bench.peer's comparisons run (the speed one in bench/peer.py, `--learn`'s in bench/peer_learn.py):
the `Workload` both systems train on and its launcher overrides (`workload_overrides`, `compose`), the prompts
written for TRL (`write_prompts`: the actors' own), the peer venv (`peer_python`: `.cache/peer-venv`), one TRL run
(`run_trl`: bench/peer_trl.py in that venv) and one agentstream run (`run_agentstream`: the real launcher), each a
`Result` with its steps' ends, its rewards and where its CPU went (`CpuSampler`, `cpu_line`). Not a command of its
own: `python -m bench.peer` runs it (docs/benchmarks.md).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from statistics import mean
from typing import IO, Any

from agentstream.config import REPO_ROOT, Config, TrainerConfig
from agentstream.wire.addresses import free_port
from bench import harness

PEER_VENV = REPO_ROOT / ".cache" / "peer-venv"
TRL_VERSION = "1.16.0"
DATASET = "basic_arithmetic"
ROLES = (*harness.ROLES, ("peer_trl", "TRL"))
"""(a word of a process's command line, the name its CPU is reported under); "other" for the rest."""


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
