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

TRL runs `bench/peer_trl.py` in a venv of its own (`.cache/peer-venv`: torch, trl, transformers at the project's
pin, reasoning_gym; made here on first use, about a minute) on the prompts agentstream's actors send for the groups'
seeds: `write_prompts` (bench/peer_run.py) plays each seed's first turn through the project's own env, memory and
chat template and writes the prompt text, its token ids and the item into a JSONL; the worker checks the ids and
scores answers with reasoning-gym's `score_answer`, as the env does. agentstream runs the real launcher
(`scripts/launch.py`: broker, one vLLM engine, one learner rank, one actor) at `trainer.max_staleness=0` (sync) and
at the config's default bound (async).

Per run: start-up = launch to the end of the first optimizer step; steady = steps 2..N (TRL: the wall clock
between the ends of step 1 and step N; agentstream: the learner's step times, as `bench.overlap` measures),
completions/s = (N-1) x batch / steady. A `#` line after each run says where its step time goes, and one
where its CPU goes: the cores each process used on average over the steady steps (psutil, every 0.5 s), and
the CPU seconds one completion cost. When a run keeps every core busy, cores / (CPU s per completion) bounds
its rate; the ratio of the two systems' CPU s per completion bounds agentstream/TRL on this machine, whatever
the overlap (printed before the ratios).

This module holds the speed comparison and the command line of both; `--learn` (learning per sample instead of
speed) is bench/peer_learn.py (its docstring: `--help` prints it after this one), and what both run (the workload,
the prompts written for TRL, the peer venv, one TRL run, one agentstream run) is bench/peer_run.py.
"""

from __future__ import annotations

from agentstream.config import REPO_ROOT, SMALL_MODEL_DIR
from bench import harness, peer_learn
from bench.peer_run import DATASET, TRL_VERSION, Result, Workload, compose, peer_python, run_agentstream, run_trl
from launcher.tiny_model import ensure_small_model

TARGETS = {("sync", 16): 1.0, ("sync", 64): 1.0, ("async", 64): 1.5}  # agentstream/TRL, issue 25


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


def main() -> None:
    parser = harness.arguments(
        f"{__doc__}\n{peer_learn.__doc__}",
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
        f"{', '.join(f'{m.name} -> {p}' for m, p in peer_learn.MODEL_PRESETS.items())})",
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
    preset = peer_learn.learn_preset(args.model, args.preset) if args.learn else ""
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
        peer_learn.learn(args, modes, bounds, folder)
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
