"""A soak: the default job for `--minutes`, every process of it sampled meanwhile; what grows per 1,000 learner steps.

    .venv/bin/python -m bench.soak [--minutes 60] [--sample-s 10] [--warmup-frac 0.2] [--keep DIR] [-- OVERRIDES...]

It runs the real launcher (`scripts/launch.py`) with `trainer.total_steps` out of reach and OVERRIDES, and stops it
after `--minutes` as Ctrl-C does (SIGINT). Every `--sample-s` seconds it reads each process of the launcher's tree
(psutil), summed by role (`harness.ROLES`: broker, vLLM API server and engine core, torchrun and the learner rank,
actor, sidecar, the launcher itself, ...): resident memory (RSS), open file descriptors, threads; the size on disk
of the broker's write-ahead log (RUN/broker-wal, every segment); and from the dashboard's /api/state the learner's
version (its step) and the broker's buffered transitions.

Samples in the first `--warmup-frac` of the run (start-up, caches and pools filling), and any before the learner's
first step, are left out. Over the rest, a value's growth is the least-squares slope of it against the learner's
step, x 1000 (RSS also in % of its value at the end of the warm-up, the first sample after it). It prints a table of
the roles (and all of them together), the WAL's size (first after the warm-up, max, last, and how often it shrank:
compactions) and the buffered transitions (mean, max), then last the worst role's RSS growth against the targets
(issue 40): RSS under 5% per 1,000 steps, no growth in open files or threads, the WAL bounded by its compaction
(`broker.wal_compact_events`).
"""

from __future__ import annotations

import json
import math
import statistics
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import psutil
import yaml
from omegaconf.errors import OmegaConfBaseException

from agentstream import config as config_mod
from agentstream.wire.addresses import advertised_host
from bench import harness
from broker.wal import FOLDER as WAL_FOLDER

RSS_TARGET_PCT = 5.0
"""The most RSS may grow per 1,000 learner steps, in % of its value at the end of the warm-up (issue 40)."""
FOREVER_STEPS = 1_000_000_000
"""trainer.total_steps: a run that goes on until it is stopped."""
MIB = 1 << 20
ALL = "all"
"""The row of every process of the run together."""


class Usage(NamedTuple):
    """One role's processes at one sample, summed."""

    procs: int
    rss: int  # bytes
    fds: int
    threads: int


@dataclass(frozen=True)
class Sample:
    """One reading of the whole run."""

    t: float  # seconds since the launch
    step: int | None  # the learner's version (None: the dashboard did not answer)
    buffered: int | None  # the broker's buffered transitions (None: as step)
    wal_bytes: int  # every segment of the write-ahead log on disk
    roles: dict[str, Usage]


class RoleGrowth(NamedTuple):
    """One role over the samples after the warm-up: values at its end and at the last sample, growth per 1,000
    learner steps (nan: fewer than two learner steps among the samples)."""

    role: str
    procs: int
    rss: tuple[float, float]  # MiB
    rss_per_k: float  # MiB
    rss_pct_per_k: float  # % of rss[0]
    fds: tuple[int, int]
    fds_per_k: float
    threads: tuple[int, int]
    threads_per_k: float


# ------------------------------------------------------------------------------------ the figures (pure)
def slope(xs: Sequence[float], ys: Sequence[float]) -> float:
    """The least-squares slope of `ys` against `xs`: sum((x - mx)(y - my)) / sum((x - mx)^2); nan when the xs do not
    vary (fewer than two distinct values)."""
    if len(xs) != len(ys):
        raise ValueError(f"{len(xs)} xs against {len(ys)} ys")
    try:
        return statistics.linear_regression(xs, ys).slope
    except statistics.StatisticsError:  # fewer than two points, or the xs constant
        return math.nan


def after_warmup(samples: Sequence[Sample], warmup_frac: float) -> list[Sample]:
    """The samples taken after the first `warmup_frac` of the run (from the launch to the last sample) and after the
    learner's first step (before it, the run is still starting: a short run's warm-up can end sooner), that know the
    learner's step."""
    if not samples:
        return []
    start = warmup_frac * samples[-1].t
    return [s for s in samples if s.t >= start and s.step is not None and s.step >= 1]


def with_total(samples: Sequence[Sample]) -> list[Sample]:
    """`samples` with one more role, `ALL`: every process of the run together."""
    return [
        Sample(s.t, s.step, s.buffered, s.wal_bytes, {**s.roles, ALL: Usage(*map(sum, zip(*s.roles.values())))})
        for s in samples
        if s.roles
    ]


def role_growth(samples: Sequence[Sample], role: str) -> RoleGrowth:
    """How `role` grew over `samples` (after the warm-up, in order; those without the role are skipped: a process
    between two lives)."""
    seen = [(s.step, s.roles[role]) for s in samples if role in s.roles]
    if not seen:
        raise ValueError(f"no sample holds role {role!r}")
    steps = [float(step) for step, _ in seen]
    first, last = seen[0][1], seen[-1][1]

    def per_k(values: list[float]) -> float:
        return 1000 * slope(steps, values)

    rss_per_k = per_k([u.rss / MIB for _, u in seen])
    return RoleGrowth(
        role,
        last.procs,
        (first.rss / MIB, last.rss / MIB),
        rss_per_k,
        100 * rss_per_k / (first.rss / MIB) if first.rss else math.nan,
        (first.fds, last.fds),
        per_k([float(u.fds) for _, u in seen]),
        (first.threads, last.threads),
        per_k([float(u.threads) for _, u in seen]),
    )


def growth_table(samples: Sequence[Sample]) -> list[RoleGrowth]:
    """Every role seen in `samples` (after the warm-up), largest RSS first, the whole run last."""
    roles = sorted(
        {r for s in samples for r in s.roles} - {ALL},
        key=lambda r: -max(s.roles[r].rss for s in samples if r in s.roles),
    )
    return [role_growth(samples, r) for r in [*roles, ALL] if any(r in s.roles for s in samples)]


def _signed(x: float, fmt: str) -> str:
    return "n/a" if math.isnan(x) else format(x, "+" + fmt)


def table_lines(rows: Sequence[RoleGrowth]) -> list[str]:
    """The table: per role, its value at the end of the warm-up -> at the last sample, and growth per 1,000 steps."""
    out = [
        f"{'role':<17} {'procs':>5} {'RSS MiB':>17} {'MiB/1k':>8} {'%/1k':>7} {'open files':>11} {'/1k':>7} "
        f"{'threads':>11} {'/1k':>7}"
    ]
    for r in rows:
        out.append(
            f"{r.role:<17} {r.procs:>5} {r.rss[0]:>7.1f} -> {r.rss[1]:>7.1f} {_signed(r.rss_per_k, '.2f'):>8} "
            f"{_signed(r.rss_pct_per_k, '.2f'):>7} {r.fds[0]:>4} -> {r.fds[1]:>4} "
            f"{_signed(r.fds_per_k, '.1f'):>7} {r.threads[0]:>4} -> {r.threads[1]:>4} "
            f"{_signed(r.threads_per_k, '.1f'):>7}"
        )
    return out


def wal_line(samples: Sequence[Sample]) -> str:
    """The write-ahead log's size after the warm-up: first, max, last, and how often it shrank (a compaction)."""
    sizes = [s.wal_bytes for s in samples]
    shrank = sum(1 for a, b in zip(sizes, sizes[1:]) if b < a)
    return (
        f"WAL on disk (MiB): first {sizes[0] / MIB:.2f}, max {max(sizes) / MIB:.2f}, last {sizes[-1] / MIB:.2f}; "
        f"shrank {shrank} times (compactions)"
    )


def buffered_line(samples: Sequence[Sample]) -> str:
    """The broker's buffered transitions after the warm-up: mean, max."""
    counts = [s.buffered for s in samples if s.buffered is not None]
    return f"buffered transitions: mean {sum(counts) / len(counts):.1f}, max {max(counts)}"


def last_line(rows: Sequence[RoleGrowth], steps: tuple[int, int]) -> str:
    """The last line: the worst role's RSS growth per 1,000 steps in %, against the target, and the worst open-file
    and thread growth (target: none), over the learner steps `steps` (first, last after the warm-up)."""
    roles = [r for r in rows if r.role != ALL]
    measured = [r for r in roles if not math.isnan(r.rss_pct_per_k)]
    if not measured:
        return (
            f"soak RSS growth per 1000 learner steps: not measured (learner steps {steps[0]}..{steps[1]} after "
            f"the warm-up; run longer); target < {RSS_TARGET_PCT:.0f}%"
        )
    worst = max(measured, key=lambda r: r.rss_pct_per_k)
    fds = max(measured, key=lambda r: r.fds_per_k)
    threads = max(measured, key=lambda r: r.threads_per_k)
    met = "met" if worst.rss_pct_per_k < RSS_TARGET_PCT else "not met"
    return (
        f"soak RSS growth per 1000 learner steps, worst role: {worst.rss_pct_per_k:.2f}% ({worst.role}; "
        f"target < {RSS_TARGET_PCT:.0f}%: {met}); open files {fds.fds_per_k:+.1f} ({fds.role}), threads "
        f"{threads.threads_per_k:+.1f} ({threads.role}) per 1000 steps (target 0); steps {steps[0]}..{steps[1]}"
    )


def report(samples: Sequence[Sample], warmup_frac: float) -> list[str]:
    """Every line printed after the run, from its samples."""
    kept = with_total(after_warmup(samples, warmup_frac))
    if len(kept) < 2:
        return [f"soak: {len(kept)} samples after the warm-up (of {len(samples)}): run longer or sample more often"]
    rows = growth_table(kept)
    steps = (kept[0].step or 0, kept[-1].step or 0)
    return [
        f"# {len(kept)} samples of {len(samples)} after the warm-up ({kept[0].t:.0f} s..{kept[-1].t:.0f} s), "
        f"learner steps {steps[0]}..{steps[1]}",
        *table_lines(rows),
        wal_line(kept),
        buffered_line(kept),
        last_line(rows, steps),
    ]


# ------------------------------------------------------------------------------------ the readings
def tree_usage(root: psutil.Process) -> dict[str, Usage]:
    """RSS, open files and threads of `root` and every descendant, summed by role (a process that exits meanwhile
    is left out)."""
    totals: dict[str, Usage] = {}
    for p in [root, *root.children(recursive=True)]:
        try:
            with p.oneshot():
                u = Usage(1, p.memory_info().rss, p.num_fds(), p.num_threads())
                name = harness.role(p.cmdline())
        except psutil.Error:
            continue
        totals[name] = Usage(*map(sum, zip(totals.get(name, Usage(0, 0, 0, 0)), u)))
    return totals


def folder_bytes(folder: Path) -> int:
    """The bytes of the files in `folder` (0 while it does not exist; a file deleted meanwhile counts 0)."""
    total = 0
    for f in folder.glob("*") if folder.is_dir() else []:
        try:
            total += f.stat().st_size
        except FileNotFoundError:  # a compaction removed an old segment
            pass
    return total


class Sampler(harness.Periodic):
    """Reads the run's processes (from the launcher's `pid`), its WAL and its dashboard every `every_s` seconds in
    a thread of this process while the block runs."""

    def __init__(self, pid: int, run_dir: Path, every_s: float):
        super().__init__(every_s)
        self.root, self.run_dir = psutil.Process(pid), run_dir
        self.t0 = time.time()
        self.samples: list[Sample] = []
        self.dashboard = ""

    def tick(self) -> bool:
        try:
            roles = tree_usage(self.root)
        except psutil.Error:  # the launcher exited
            return False
        step, buffered = self._broker()
        self.samples.append(
            Sample(time.time() - self.t0, step, buffered, folder_bytes(self.run_dir / WAL_FOLDER), roles)
        )
        return True

    def _broker(self) -> tuple[int | None, int | None]:
        """(the learner's version, the broker's buffered transitions) from the dashboard; (None, None) until it
        answers. Its address is in the run's resolved config (the launcher picks the port), read until it answers:
        the file may be read while it is being written."""
        try:
            if not self.dashboard:
                cfg = config_mod.load(self.run_dir / "config.yaml").broker
                self.dashboard = f"http://{advertised_host(cfg.dashboard_host)}:{cfg.dashboard_port}"
            state = json.loads(urllib.request.urlopen(f"{self.dashboard}/api/state", timeout=5).read())
            return int(state["learner"]["version"]), int(state["gauges"]["buffered_transitions"])
        except (OSError, ValueError, KeyError, yaml.YAMLError, OmegaConfBaseException):
            self.dashboard = ""  # not written yet, or not listening yet
            return None, None


# ------------------------------------------------------------------------------------ the run
def main() -> None:
    parser = harness.arguments(__doc__)
    parser.add_argument("--minutes", type=float, default=60.0, help="how long the job runs (default 60)")
    parser.add_argument("--sample-s", type=float, default=10.0, help="seconds between samples (default 10)")
    parser.add_argument(
        "--warmup-frac", type=float, default=0.2, help="the first part of the run left out of the figures (default 0.2)"
    )
    parser.add_argument("--keep", default="", help="folder for the run (default: a new temporary folder)")
    parser.add_argument("overrides", nargs="*", help="launcher overrides, after `--` (e.g. actors.count=2)")
    args = parser.parse_args()
    if not 0 <= args.warmup_frac < 1 or args.minutes <= 0 or args.sample_s <= 0:
        parser.error("--minutes and --sample-s must be > 0 and --warmup-frac in [0, 1)")
    _, folder = harness.begin(
        "",
        "bench-soak-",
        args.keep,
        about=f"the default job for {args.minutes:g} min, sampled every {args.sample_s:g} s; "
        f"growth per 1000 learner steps after the first {args.warmup_frac:.0%}",
    )
    run_dir = folder / "run"
    overrides = [f"trainer.total_steps={FOREVER_STEPS}", "broker.dashboard_port=0", *args.overrides]
    print(f"# run folder {run_dir}; launcher overrides: {' '.join(overrides)}", flush=True)
    done = harness.run_launcher(
        run_dir,
        overrides,
        "of the soak",
        timeout_s=args.minutes * 60,
        stop_ok=True,
        watch=lambda pid: Sampler(pid, run_dir, args.sample_s),
    )
    summary = json.loads((run_dir / "summary.json").read_text())
    print(
        f"# ran {done.wall_s:.0f} s, {summary.get('status')} at learner step {summary.get('learner_version')}; "
        f"processes left: {summary.get('processes_left') or 'none'}",
        flush=True,
    )
    for line in report(done.watched.samples, args.warmup_frac):
        print(line, flush=True)


if __name__ == "__main__":
    main()
