"""Asynchronous versus synchronous training: the same run at staleness bound 0 (generate, then train) and at
the asynchronous bounds, side by side on one machine, on a latency-bound agent workload.

    .venv/bin/python -m bench.overlap [--bounds 0,2,4] [--steps 8] [--latency-ms 50] [--engine-url URL]
    .venv/bin/python -m bench.overlap --latency-ms 500 --max-steps 16 --steps 8 --engine-cores 0

Every run is the real launcher (`scripts/launch.py`: broker, weight sidecar, torchrun learner, actors) with the
same config except `trainer.max_staleness`; one vLLM server, started here once (or `--engine-url`), serves
them all (`engines.external_urls`), so start-up cost is equal. Each env step waits a log-normal latency
(`env.step_latency_mean_s`, sigma 0.5), as tool calls and web pages do.

Per run: launcher wall time; training wall time = the learner's steps 2..N (step 1 also waits for start-up);
the learner's idle fraction over those steps (time waiting for the broker's batch / step time, from
learner_metrics.jsonl); the engine's busy fraction over the same window (vLLM /metrics
`vllm:num_requests_running` > 0, sampled every 0.1 s); the mean staleness of the trained transitions
(summary.json). Then the ideal overlap: bound 0's training time / max(its time generating, its time training),
the speed-up a perfect overlap of the two would give on the same work, and the fraction of it each bound reached
(target >= 90%). The last line is the speed-up of each bound over bound 0 (target: >= 2.5 at bound 4, with
the learner idle < 10%).
"""

from __future__ import annotations

import argparse
import threading
import time
from pathlib import Path

from agentstream.wire.addresses import free_port
from bench import harness
from bench.harness import RunResult


def sample_running(url: str, stop: threading.Event, out: list[tuple[float, float]], every_s: float = 0.1) -> None:
    """(time, vllm:num_requests_running) every `every_s` until `stop` (a thread; plain HTTP, no event loop)."""
    while not stop.is_set():
        try:
            out.append((time.time(), harness.vllm_metric(url, "vllm:num_requests_running", timeout_s=2)))
        except (OSError, ValueError, IndexError):
            pass
        stop.wait(every_s)


def launch_overrides(args: argparse.Namespace, model: str, url: str, bound: int) -> list[str]:
    """The one config every run shares, but for the staleness bound."""
    slots = (max(int(b) for b in args.bounds.split(",")) + 1) * args.groups_per_step  # groups in flight at most
    return [
        f"model.path={model}",
        "engines.count=1",
        f"engines.external_urls=[{url}]",
        "learner.world_size=1",
        "actors.count=1",
        f"actors.episodes_per_actor={slots * args.group_size}",
        f"env.name={args.env}",
        f"env.group_size={args.group_size}",
        f"env.max_steps={args.max_steps}",
        f"env.step_latency_mean_s={args.latency_ms / 1000}",
        f"sampling.max_tokens={args.max_tokens}",
        f"trainer.groups_per_step={args.groups_per_step}",
        f"trainer.total_steps={args.steps}",
        f"trainer.max_staleness={bound}",
        f"broker.dashboard_port={free_port()}",
        "run.shutdown_timeout_s=5",
        *args.override,
    ]


def run_once(args: argparse.Namespace, model: str, url: str, bound: int, folder: Path) -> RunResult:
    """One launcher run at staleness `bound`, the engine's running requests sampled meanwhile."""
    run_dir = folder / f"bound-{bound}"
    samples: list[tuple[float, float]] = []
    stop = threading.Event()
    sampler = threading.Thread(target=sample_running, args=(url, stop, samples), daemon=True)
    sampler.start()
    try:
        wall = harness.run_launcher(
            run_dir, launch_overrides(args, model, url, bound), f"at bound {bound}", args.run_timeout_s
        ).wall_s
    finally:
        stop.set()
        sampler.join(5)
    return harness.measure(bound, wall, run_dir, samples)


def ideal_speedup(sync: RunResult) -> float:
    """The most overlap can give over the synchronous run `sync` (bound 0, where the learner waits while the batch
    is generated, and the engines wait while it trains): its time / max(generating, training), the same work with
    each side running all the time."""
    return sync.train_s / max(sync.wait_s, sync.busy_s, 1e-9)


def main() -> None:
    parser = harness.arguments(__doc__, model=True, engine_url=True)
    parser.add_argument("--bounds", default="0,2,4", help="staleness bounds to compare; the first is the baseline")
    parser.add_argument("--steps", type=int, default=6, help="learner steps per run")
    parser.add_argument("--groups-per-step", type=int, default=2)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--max-steps", type=int, default=8, help="env steps per episode (env.max_steps)")
    parser.add_argument("--max-tokens", type=int, default=16, help="sampling.max_tokens")
    parser.add_argument("--latency-ms", type=float, default=50.0, help="mean env step latency (log-normal)")
    parser.add_argument("--env", default="agentstream/FrozenLake-v0")
    parser.add_argument(
        "--engine-cores",
        default="",
        help="engines.cpu_threads_bind of the server started here, "
        "e.g. 0: its compute threads on core 0, the other cores left to the learner",
    )
    parser.add_argument("--run-timeout-s", type=float, default=300.0)
    parser.add_argument("--keep", default="", help="keep the run folders here (default: a temporary folder)")
    parser.add_argument("override", nargs="*", help="more launcher overrides, applied to every run")
    args = parser.parse_args()
    bounds = [int(b) for b in args.bounds.split(",")]
    model, folder = harness.begin(
        args.model,
        "bench-async-",
        args.keep,
        about=(
            f"{args.steps} steps x {args.groups_per_step} groups x {args.group_size} episodes, <= {args.max_steps} env "
            f"steps, {args.latency_ms:.0f} ms mean env latency, {args.max_tokens} tokens/response, engine cores "
            f"{args.engine_cores or 'all'}"
        ),
    )
    print(
        f"{'bound':>5} {'wall s':>7} {'train s':>8} {'speed-up':>8} {'learner idle':>12} {'engine busy':>11} "
        f"{'staleness':>9} {'trained':>7} {'status':>8}",
        flush=True,
    )
    results: list[RunResult] = []
    with harness.vllm_server(model, folder, args.engine_url, args.engine_cores) as url:
        for bound in bounds:
            r = run_once(args, model, url, bound, folder)
            results.append(r)
            speed = results[0].train_s / r.train_s
            print(
                f"{r.bound:>5} {r.wall_s:>7.1f} {r.train_s:>8.2f} {speed:>7.2f}x {r.idle_frac:>12.1%} "
                f"{r.engine_busy:>11.1%} {r.staleness_mean:>9.2f} {r.transitions:>7} {r.status:>8}",
                flush=True,
            )
    base = results[0]
    ideal = ideal_speedup(base)
    print(
        f"ideal overlap: bound {base.bound}'s {base.train_s:.1f} s / max(generating {base.wait_s:.1f} s, training "
        f"{base.busy_s:.1f} s) = {ideal:.2f}x; reached: "
        + ", ".join(f"bound {r.bound} {base.train_s / r.train_s / ideal:.0%}" for r in results[1:])
        + " (target >= 90%)"
    )
    print(
        f"speed-up over bound {base.bound}: "
        + ", ".join(
            f"bound {r.bound} {base.train_s / r.train_s:.2f}x (learner idle {r.idle_frac:.0%})" for r in results[1:]
        )
        + " (target >= 2.5x at bound 4, learner idle < 10%)"
    )


if __name__ == "__main__":
    main()
