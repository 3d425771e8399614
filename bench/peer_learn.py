"""`bench.peer --learn`: TRL's `GRPOTrainer` against agentstream in learning per sample instead of speed (reward
per step against completions trained and against seconds: a CSV, two plots and a table), on bench.peer's command
line (bench/peer.py parses it and calls `learn`; bench/peer_run.py runs each system):

    .venv/bin/python -m bench.peer --learn [--batch 64] [--steps 40] [--seeds 3]
    .venv/bin/python -m bench.peer --learn --model .cache/smollm2-135m-instruct [--steps 20] [--seeds 3] [--keep DIR]

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
import subprocess
import sys
from pathlib import Path
from statistics import mean, stdev
from typing import Any

from agentstream.config import REPO_ROOT, SMOLLM2_DIR, Config, TrainerConfig
from bench.peer_run import DATASET, Result, Workload, compose, peer_python, run_agentstream, run_trl, workload_overrides

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
