"""What every benchmark shares: its command line and first line, the processes it starts (a vLLM server, a broker,
a whole launcher run), waiting for them, reading their metrics, stopping them, and its ratio line.

    parser = harness.arguments(__doc__, model=True, engine_url=True)   # --model, --engine-url
    args = parser.parse_args()
    model, folder = harness.begin(args.model, "bench-actor-", about="what it measures")  # the load line first
    with harness.vllm_server(model, folder, args.engine_url) as url:    # started here unless --engine-url
        n0 = harness.generated_tokens(url)
        ...
    print(harness.ratio_line("actor/ceiling", actor, ceiling, "tokens/s", target=0.90))  # the last line

Every process starts in a session of its own and is stopped with its whole group (`launcher.procs`), also when
the benchmark itself is stopped by SIGTERM (e.g. `timeout`) or Ctrl-C: a vLLM server is three processes and a
launcher run a dozen, and an orphan keeps its port and its memory.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import psutil

from agentstream.config import REPO_ROOT, TINY_MODEL_DIR, Config
from agentstream.wire.addresses import free_port

LAUNCH = REPO_ROOT / "scripts" / "launch.py"
"""The launcher's command: every launcher run of a benchmark is a real run of it."""
ROLES = (
    ("EngineCore", "vLLM engine core"),
    ("VLLM::Worker", "vLLM worker"),
    ("api_server", "vLLM API server"),
    ("torch.distributed.run", "torchrun"),
    ("learner.train", "learner"),
    ("actors.actor", "actor"),
    ("actors.evaluate", "evaluator"),
    ("-m gateway", "gateway"),
    ("broker.server", "broker"),
    ("engines.sidecar", "sidecar"),
    ("scripts/launch.py", "launcher"),
)
"""(a word of a process's command line, the role it is reported under), first match wins: torchrun's command line
names learner.train too. Most command lines hold the run folder's path, so a word must be one a folder's name is
unlikely to hold ("-m gateway", not "gateway")."""


# ------------------------------------------------------------------------------------ command line
def arguments(
    doc: str, *, model: bool = False, engine_url: bool = False, default_model: str = "the tiny local model"
) -> argparse.ArgumentParser:
    """A benchmark's parser: `doc` (its module docstring) as `--help`'s text; `model`: `--model DIR` (default:
    `default_model`, the benchmark's own choice, else the tiny local model, `model_dir`); `engine_url`:
    `--engine-url URL`, a vLLM server of that model already up."""
    spec = getattr(sys.modules["__main__"], "__spec__", None)  # run as `python -m bench.NAME`: say so in its usage
    parser = argparse.ArgumentParser(
        prog=f"python -m {spec.name}" if spec else None,
        description=doc,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    if model:
        parser.add_argument("--model", default="", help=f"model directory (default: {default_model})")
    if engine_url:
        parser.add_argument("--engine-url", default="", help="use this running vLLM server instead of starting one")
    return parser


def begin(model: str, prefix: str, keep: str = "", about: str = "") -> tuple[str, Path]:
    """A benchmark's start, once its arguments are checked: SIGTERM unwinds like Ctrl-C from now on, the model
    directory (`model_dir`), its folder (`run_folder`), and its first lines: the load (`load_line`) and `about`,
    what it measures. Returns (model directory, folder)."""
    stop_on_sigterm()
    model, folder = model_dir(model), run_folder(keep, prefix)
    print(load_line(), flush=True)
    if about:
        print(f"# {about}", flush=True)
    return model, folder


def stop_on_sigterm() -> None:
    """SIGTERM (e.g. `timeout`) unwinds like Ctrl-C, so that the processes the benchmark started are stopped."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))


def model_dir(path: str) -> str:
    """`path`, or the tiny local model's directory (made when missing)."""
    if path:
        return path
    from launcher.tiny_model import ensure_tiny_model

    return str(ensure_tiny_model(TINY_MODEL_DIR))


def run_folder(keep: str, prefix: str) -> Path:
    """Where a benchmark's runs go: `keep` when given (made if missing), else a new temporary folder."""
    folder = Path(keep) if keep else Path(tempfile.mkdtemp(prefix=prefix))
    folder.mkdir(parents=True, exist_ok=True)
    return folder


# ------------------------------------------------------------------------------------ what it prints
def load_line() -> str:
    """A benchmark's first line: the machine's load, which slows every path alike."""
    return (
        f"# load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores (other work on the machine slows "
        f"every path; compare ratios within one run)"
    )


def ratio_line(label: str, measured: float, baseline: float, unit: str, target: float, note: str = "") -> str:
    """A benchmark's last line: `label: measured/baseline (measured / baseline unit[, note]; target >= target)`."""
    return (
        f"{label}: {measured / baseline:.2f} ({measured:.0f} / {baseline:.0f} {unit}{f', {note}' if note else ''}; "
        f"target >= {target:.2f})"
    )


# ------------------------------------------------------------------------------------ processes
@contextmanager
def started(
    argv: list[str], log: Path, grace_s: float = 10.0, env: dict[str, str] | None = None
) -> Iterator[subprocess.Popen]:
    """`argv` in a session of its own (from the repository), output to `log`; its whole group stopped when the block
    ends (SIGTERM, SIGKILL after `grace_s`)."""
    from launcher.procs import start, stop

    proc = start(argv, log, env=env, cwd=REPO_ROOT)
    try:
        yield proc
    finally:
        stop(proc, grace_s)


@contextmanager
def child(
    argv: list[str], log: Path, stop_signal: int = signal.SIGTERM, grace_s: float = 30
) -> Iterator[subprocess.Popen]:
    """A child process in its own session, output to `log`; stopped with `stop_signal` (then its group killed after
    `grace_s`) if it is still running when the block ends, also on SIGTERM or Ctrl-C here. For a process that
    stops its own children on `stop_signal` (the launcher on SIGINT), unlike `started`, which signals the group."""
    with log.open("w") as out:
        proc = subprocess.Popen(
            argv, cwd=REPO_ROOT, stdout=out, stderr=subprocess.STDOUT, text=True, start_new_session=True
        )
        try:
            yield proc
        finally:
            if proc.poll() is None:
                proc.send_signal(stop_signal)
                try:
                    proc.wait(grace_s)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()


def broker_argv(config: Path, port: int, python_args: Sequence[str] = ()) -> list[str]:
    """The broker's command (`python -m broker.server`) for the config file `config`, listening on `port`, its
    dashboard on a port the OS picks as it binds (0: a port chosen here beforehand could be taken by then, and the
    broker would die); `python_args` go before `-m` (e.g. `-m cProfile -o FILE`)."""
    return [
        sys.executable,
        *python_args,
        "-m",
        "broker.server",
        "--config",
        str(config),
        "--port",
        str(port),
        "--dashboard-port",
        "0",
    ]


def start_vllm(cfg: Config, log: Path) -> tuple[subprocess.Popen, str]:
    """A vLLM server of `cfg` (a `Config`: its model and engines sections) started as every engine is (the
    project's own command line), not yet ready; (its process, its URL)."""
    from engines.server import server_command
    from launcher.procs import start

    port = free_port()
    argv, env = server_command(cfg.model, cfg.engines, port)
    return start(argv, log, env=env), f"http://127.0.0.1:{port}"


@contextmanager
def vllm_server(model: str, folder: Path, url: str | None = None, cpu_threads_bind: str = "") -> Iterator[str]:
    """A vLLM server of `model` (the project's own command line), ready, or `url` when one runs already.
    `cpu_threads_bind`: engines.cpu_threads_bind (CPU: the cores of its compute threads, with vLLM's `mp`
    executor, which alone binds them; empty: vLLM's own choice, with the `uni` executor)."""
    if url:
        yield url
        return
    import asyncio

    from engines.server import wait_ready
    from launcher.procs import stop

    cfg = Config()
    cfg.model.path = model
    cfg.engines.cpu_threads_bind = cpu_threads_bind
    if cpu_threads_bind:
        cfg.engines.cpu_executor = "mp"
    proc, url = start_vllm(cfg, folder / "engine.log")
    try:
        asyncio.run(wait_ready(url, 300, proc=proc))
        yield url
    finally:
        stop(proc, 20)


def wait_healthy(url: str, proc: subprocess.Popen, log: Path, what: str, timeout_s: float = 120) -> None:
    """Until GET `url` answers; fails at once, with the tail of its `log`, when `proc` (`what`) exits."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited ({proc.returncode}); see {log}:\n{log.read_text()[-2000:]}")
        try:
            urllib.request.urlopen(url, timeout=2).read()
            return
        except OSError:
            time.sleep(0.3)
    raise RuntimeError(f"{what} did not answer within {timeout_s:.0f}s; see {log}")


def wait_listening(
    port: int, what: str, timeout_s: float = 60, proc: subprocess.Popen | None = None, log: Path | None = None
) -> None:
    """Until something accepts connections on `port` of this host; fails at once, with the tail of its `log`, when
    `proc` (`what`) exits."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            tail = log.read_text()[-2000:] if log is not None and log.exists() else ""
            raise RuntimeError(f"{what} exited ({proc.returncode}); see {log}:\n{tail}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise RuntimeError(f"{what} did not listen on port {port} within {timeout_s}s; see its log")


class Periodic:
    """A context that calls `tick()` every `every_s` seconds in a thread of this process while the block runs (a
    sampler of the processes a benchmark started) until `tick` returns False."""

    def __init__(self, every_s: float):
        self.every_s = every_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            if not self.tick():
                return

    def tick(self) -> bool:
        raise NotImplementedError


def role(cmdline: Sequence[str], roles: Sequence[tuple[str, str]] = ROLES) -> str:
    """The role of a process by its command line (`roles`: (word, role), first match); "other" for the rest (e.g.
    the multiprocessing resource tracker vLLM starts)."""
    text = " ".join(cmdline)
    return next((name for word, name in roles if word in text), "other")


class CpuSampler(Periodic):
    """CPU seconds of a process tree (`pid` and its descendants) by role (`roles`, as `role` names them), read every
    `every_s` seconds in a thread of this process while the block runs; a process that exits keeps its last
    reading. `cores(t0, t1)`: the cores each role used on average between two times."""

    def __init__(self, pid: int, every_s: float = 0.5, roles: Sequence[tuple[str, str]] = ROLES):
        super().__init__(every_s)
        self.root, self.roles = psutil.Process(pid), roles
        self.samples: list[tuple[float, dict[str, float]]] = []  # (time, CPU s of each role so far)
        self._seen: dict[int, tuple[str, float]] = {}  # pid -> (role, CPU s)

    def tick(self) -> bool:
        try:
            procs = [self.root, *self.root.children(recursive=True)]
        except psutil.Error:  # the root exited: its tree's last readings stay
            return True
        for p in procs:
            try:
                t = p.cpu_times()
                self._seen[p.pid] = (role(p.cmdline(), self.roles), t.user + t.system)
            except psutil.Error:
                pass
        totals: dict[str, float] = {}
        for name, used in self._seen.values():
            totals[name] = totals.get(name, 0.0) + used
        self.samples.append((time.time(), totals))
        return True

    def cores(self, t0: float, t1: float) -> dict[str, float]:
        """Cores each role used on average between the first reading at or after `t0` and the last at or before
        `t1`, most first; empty when fewer than two readings fall between."""
        inside = [s for s in self.samples if t0 <= s[0] <= t1]
        if len(inside) < 2:
            return {}
        (ta, a), (tb, b) = inside[0], inside[-1]
        return dict(sorted(((r, (b[r] - a.get(r, 0.0)) / (tb - ta)) for r in b), key=lambda x: -x[1]))


def cpu_s(pid: int) -> float:
    """CPU seconds (user + system) a process has used so far (from /proc; Linux)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# ------------------------------------------------------------------------------------ a vLLM server's metrics
def vllm_metric(url: str, name: str, timeout_s: float = 60) -> float:
    """The sum of the samples of Prometheus metric `name` on the server's /metrics (plain HTTP, no event loop)."""
    text = urllib.request.urlopen(f"{url}/metrics", timeout=timeout_s).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


def generated_tokens(url: str) -> float:
    """The engine's own count of generated tokens so far (a counter)."""
    return vllm_metric(url, "vllm:generation_tokens_total")


def reset_prefix_cache(url: str) -> None:
    """Empty vLLM's prefix cache (a dev-mode endpoint, which `engines.server` turns on)."""
    urllib.request.urlopen(urllib.request.Request(f"{url}/reset_prefix_cache", method="POST"), timeout=60).read()


# ------------------------------------------------------------------------------------ a launcher run
class Launched(NamedTuple):
    """A finished launcher run."""

    started: float  # time.time() at its launch
    wall_s: float
    watched: Any  # what `watch` gave while it ran (None without one)


def run_launcher(
    run_dir: Path,
    overrides: Sequence[str],
    what: str,
    timeout_s: float | None = None,
    watch: Callable[[int], AbstractContextManager] | None = None,
    stop_ok: bool = False,
) -> Launched:
    """One whole run of the launcher, `scripts/launch.py run.output_dir=RUN_DIR OVERRIDES`, to its end, its output
    to `launch-<run folder's name>.log` beside the run folder. Past `timeout_s`, and when the benchmark stops, it
    is stopped as Ctrl-C stops it (SIGINT: the launcher stops its children; its group is killed 90 s later);
    `stop_ok`: a run meant to go on until stopped there (a soak), whose exit as interrupted (130) is its end.
    `watch(pid)`: a context (a sampler of its processes) held while it runs. Raises, with the output's tail, when
    the run (`what`) failed or wrote no summary.json."""
    log = run_dir.parent / f"launch-{run_dir.name}.log"
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, str(LAUNCH), f"run.output_dir={run_dir}", *overrides]
    t0 = time.time()
    stopped = False
    with child(argv, log, signal.SIGINT, 90) as proc, watch(proc.pid) if watch else nullcontext() as watched:
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            stopped = True  # leaving the block stops it
    wall = time.time() - t0
    ended = proc.returncode == 0 or (stop_ok and stopped and proc.returncode == 130)
    if not ended or not (run_dir / "summary.json").exists():
        raise RuntimeError(
            f"the launcher run {what} failed (exit {proc.returncode}); it printed:\n{log.read_text()[-3000:]}"
        )
    return Launched(t0, wall, watched)


def learner_rows(run_dir: Path) -> list[dict]:
    """The learner's rows of a run (learner_metrics.jsonl), one a step."""
    return [json.loads(line) for line in (run_dir / "learner_metrics.jsonl").read_text().splitlines() if line]


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


def measure(bound: int, wall: float, run_dir: Path, samples: list[tuple[float, float]]) -> RunResult:
    """The figures of one finished run at staleness `bound`, from its run folder and the engine's samples of
    (time, requests running): training time = the learner's steps 2..N (step 1 also waits for start-up), the
    learner's idle fraction over them, the engine's busy fraction over the same window, the mean staleness."""
    summary = json.loads((run_dir / "summary.json").read_text())
    rows = learner_rows(run_dir)
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
    return RunResult(
        bound=bound,
        wall_s=wall,
        train_s=train_s,
        idle_frac=idle,
        engine_busy=busy,
        staleness_mean=sum(k * v for k, v in hist.items()) / n if n else float("nan"),
        transitions=int(summary.get("transitions_trained", 0)),
        status=str(summary.get("status")),
        samples=samples,
        wait_s=wait_s,
        busy_s=train_s - wait_s,
    )
