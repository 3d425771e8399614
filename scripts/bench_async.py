"""Asynchronous versus synchronous training: the same run at staleness bound 0 (generate, then train) and at
the asynchronous bounds, side by side on one machine, on a latency-bound agent workload.

    .venv/bin/python scripts/bench_async.py [--bounds 0,2,4] [--steps 8] [--latency-ms 50] [--engine-url URL]
    .venv/bin/python scripts/bench_async.py --latency-ms 500 --max-steps 16 --steps 8 --engine-cores 0

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
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from agentstream.wire.addresses import free_port


@dataclass
class RunResult:
    """What one launcher run measured."""

    bound: int
    wall_s: float
    train_s: float
    idle_frac: float
    engine_busy: float
    staleness_mean: float
    transitions: int
    status: str
    wait_s: float = 0.0  # steps 2..N: the learner waiting for its batches (at bound 0: generating them)
    busy_s: float = 0.0  # steps 2..N: the learner training and publishing
    samples: list[tuple[float, float]] = field(default_factory=list)  # (time, requests running)


@contextmanager
def vllm_server(model: str, folder: Path, url: str | None = None, cpu_threads_bind: str = "") -> Iterator[str]:
    """A vLLM server of `model` (the project's own command line), or `url` when one runs already.
    `cpu_threads_bind`: engines.cpu_threads_bind (CPU: the cores of its compute threads, with vLLM's `mp`
    executor, which alone binds them; empty: vLLM's own choice, with the `uni` executor)."""
    if url:
        yield url
        return
    from agentstream.config import Config
    from engines.server import server_command, wait_ready
    from launcher.procs import start, stop

    cfg = Config()
    cfg.model.path = model
    cfg.engines.cpu_threads_bind = cpu_threads_bind
    if cpu_threads_bind:
        cfg.engines.cpu_executor = "mp"
    port = free_port()
    argv, env = server_command(cfg.model, cfg.engines, port)
    proc = start(argv, folder / "engine.log", env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        asyncio.run(wait_ready(url, 300, proc=proc))
        yield url
    finally:
        stop(proc, 20)


def sample_running(url: str, stop: threading.Event, out: list[tuple[float, float]], every_s: float = 0.1) -> None:
    """(time, vllm:num_requests_running) every `every_s` until `stop` (a thread; plain HTTP, no event loop)."""
    import urllib.request

    while not stop.is_set():
        try:
            text = urllib.request.urlopen(f"{url}/metrics", timeout=2).read().decode()
            running = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                          if line.startswith("vllm:num_requests_running"))
            out.append((time.time(), running))
        except (OSError, ValueError, IndexError):
            pass
        stop.wait(every_s)


def launch_overrides(args: argparse.Namespace, model: str, url: str, bound: int, run_dir: Path) -> list[str]:
    """The one config every run shares, but for the staleness bound."""
    slots = (max(int(b) for b in args.bounds.split(",")) + 1) * args.groups_per_step  # groups in flight at most
    return [
        f"run.output_dir={run_dir}", f"model.path={model}", "engines.count=1", f"engines.external_urls=[{url}]",
        "learner.world_size=1", "actors.count=1", f"actors.episodes_per_actor={slots * args.group_size}",
        f"env.name={args.env}", f"env.group_size={args.group_size}", f"env.max_steps={args.max_steps}",
        f"env.step_latency_mean_s={args.latency_ms / 1000}", f"sampling.max_tokens={args.max_tokens}",
        f"trainer.groups_per_step={args.groups_per_step}", f"trainer.total_steps={args.steps}",
        f"trainer.max_staleness={bound}", f"broker.dashboard_port={free_port()}", "run.shutdown_timeout_s=5",
        *args.override,
    ]


def run_once(args: argparse.Namespace, model: str, url: str, bound: int, folder: Path) -> RunResult:
    run_dir = folder / f"bound-{bound}"
    argv = [sys.executable, "scripts/launch.py", *launch_overrides(args, model, url, bound, run_dir)]
    samples: list[tuple[float, float]] = []
    stop = threading.Event()
    sampler = threading.Thread(target=sample_running, args=(url, stop, samples), daemon=True)
    sampler.start()
    t0 = time.time()
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=args.run_timeout_s)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGINT)  # the launcher stops its children cleanly
        out, _ = proc.communicate(timeout=90)
    finally:
        stop.set()
        sampler.join(5)
    wall = time.time() - t0
    if proc.returncode != 0 or not (run_dir / "summary.json").exists():
        raise RuntimeError(f"the launcher run at bound {bound} failed (exit {proc.returncode}); it printed:\n"
                           f"{out[-3000:]}")
    return measure(bound, wall, run_dir, samples)


def measure(bound: int, wall: float, run_dir: Path, samples: list[tuple[float, float]]) -> RunResult:
    """The figures of one finished run, from its run folder and the engine samples."""
    summary = json.loads((run_dir / "summary.json").read_text())
    rows = [json.loads(line) for line in (run_dir / "learner_metrics.jsonl").read_text().splitlines() if line]
    steady = rows[1:] or rows  # step 1's wait includes start-up
    train_s = sum(r["step_time_s"] for r in steady)
    wait_s = sum(r["batch_wait_s"] for r in steady)
    idle = wait_s / max(train_s, 1e-9)
    # The training window of steps 2..N ends when the learner finished; it lasted train_s.
    end = (run_dir / "learner_metrics.jsonl").stat().st_mtime
    window = [running for t, running in samples if end - train_s <= t <= end]
    busy = sum(1 for r in window if r > 0) / len(window) if window else float("nan")
    hist = {int(k): v for k, v in summary.get("staleness_hist", {}).items()}
    n = sum(hist.values())
    return RunResult(bound=bound, wall_s=wall, train_s=train_s, idle_frac=idle, engine_busy=busy,
                     staleness_mean=sum(k * v for k, v in hist.items()) / n if n else float("nan"),
                     transitions=int(summary.get("transitions_trained", 0)), status=str(summary.get("status")),
                     samples=samples, wait_s=wait_s, busy_s=train_s - wait_s)


def load_line() -> str:
    """The machine's load as a benchmark's first line says it."""
    return (f"# load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores (other work on the machine slows "
            f"every path; compare ratios within one run)")


def ideal_speedup(sync: RunResult) -> float:
    """The most overlap can give over the synchronous run `sync` (bound 0, where the learner waits while the batch
    is generated, and the engines wait while it trains): its time / max(generating, training), the same work with
    each side running all the time."""
    return sync.train_s / max(sync.wait_s, sync.busy_s, 1e-9)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bounds", default="0,2,4", help="staleness bounds to compare; the first is the baseline")
    parser.add_argument("--steps", type=int, default=6, help="learner steps per run")
    parser.add_argument("--groups-per-step", type=int, default=2)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--max-steps", type=int, default=8, help="env steps per episode (env.max_steps)")
    parser.add_argument("--max-tokens", type=int, default=16, help="sampling.max_tokens")
    parser.add_argument("--latency-ms", type=float, default=50.0, help="mean env step latency (log-normal)")
    parser.add_argument("--env", default="agentstream/FrozenLake-v0")
    parser.add_argument("--model", default="", help="model directory (default: the tiny local model)")
    parser.add_argument("--engine-url", default="", help="use this running vLLM server instead of starting one")
    parser.add_argument("--engine-cores", default="", help="engines.cpu_threads_bind of the server started here, "
                        "e.g. 0: its compute threads on core 0, the other cores left to the learner")
    parser.add_argument("--run-timeout-s", type=float, default=300.0)
    parser.add_argument("--keep", default="", help="keep the run folders here (default: a temporary folder)")
    parser.add_argument("override", nargs="*", help="more launcher overrides, applied to every run")
    args = parser.parse_args()
    # SIGTERM (e.g. `timeout`) unwinds like Ctrl-C, so the servers this script started are stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    bounds = [int(b) for b in args.bounds.split(",")]
    from agentstream.config import TINY_MODEL_DIR
    from launcher.tiny_model import ensure_tiny_model

    model = args.model or str(ensure_tiny_model(TINY_MODEL_DIR))
    folder = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="bench-async-"))
    folder.mkdir(parents=True, exist_ok=True)
    print(load_line(), flush=True)
    print(f"# {args.steps} steps x {args.groups_per_step} groups x {args.group_size} episodes, <= {args.max_steps} "
          f"env steps, {args.latency_ms:.0f} ms mean env latency, {args.max_tokens} tokens/response, engine cores "
          f"{args.engine_cores or 'all'}", flush=True)
    print(f"{'bound':>5} {'wall s':>7} {'train s':>8} {'speed-up':>8} {'learner idle':>12} {'engine busy':>11} "
          f"{'staleness':>9} {'trained':>7} {'status':>8}", flush=True)
    results: list[RunResult] = []
    with vllm_server(model, folder, args.engine_url or None, args.engine_cores) as url:
        for bound in bounds:
            r = run_once(args, model, url, bound, folder)
            results.append(r)
            speed = results[0].train_s / r.train_s
            print(f"{r.bound:>5} {r.wall_s:>7.1f} {r.train_s:>8.1f} {speed:>7.2f}x {r.idle_frac:>12.1%} "
                  f"{r.engine_busy:>11.1%} {r.staleness_mean:>9.2f} {r.transitions:>7} {r.status:>8}", flush=True)
    base = results[0]
    ideal = ideal_speedup(base)
    print(f"ideal overlap: bound {base.bound}'s {base.train_s:.1f} s / max(generating {base.wait_s:.1f} s, training "
          f"{base.busy_s:.1f} s) = {ideal:.2f}x; reached: " + ", ".join(
              f"bound {r.bound} {base.train_s / r.train_s / ideal:.0%}" for r in results[1:]) + " (target >= 90%)")
    print(f"speed-up over bound {base.bound}: " + ", ".join(
        f"bound {r.bound} {base.train_s / r.train_s:.2f}x (learner idle {r.idle_frac:.0%})" for r in results[1:])
        + " (target >= 2.5x at bound 4, learner idle < 10%)")


if __name__ == "__main__":
    main()
