"""bench/soak.py's figures: the slope of a value against the learner's step, the warm-up left out, the table, the WAL
and buffered lines and the last line; and its readings of a process tree and a folder. (The soak itself runs the
launcher for an hour: a benchmark, run by hand; docs/benchmarks.md.)"""

from __future__ import annotations

import math
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from bench import harness, soak
from bench.soak import MIB, Sample, Usage


def sample(
    t: float,
    step: int | None,
    rss_mib: float,
    fds: int = 30,
    threads: int = 10,
    wal_mib: float = 1.0,
    buffered: int | None = 0,
    role: str = "learner",
) -> Sample:
    return Sample(t, step, buffered, int(wal_mib * MIB), {role: Usage(1, int(rss_mib * MIB), fds, threads)})


def test_slope_is_the_least_squares_fit() -> None:
    assert soak.slope([0, 1, 2, 3], [1, 3, 5, 7]) == pytest.approx(2.0)  # y = 1 + 2x, exactly
    # xs 0, 1, 2 (mean 1), ys 0, 2, 1 (mean 1): sum (x-1)(y-1) = (-1)(-1) + 0 + (1)(0) = 1, sum (x-1)^2 = 2 -> 0.5
    assert soak.slope([0, 1, 2], [0, 2, 1]) == pytest.approx(0.5)
    assert math.isnan(soak.slope([5, 5, 5], [1, 2, 3]))  # x does not vary
    assert math.isnan(soak.slope([1], [1]))
    with pytest.raises(ValueError):
        soak.slope([1, 2], [1])


def test_the_warm_up_and_samples_without_a_step_are_left_out() -> None:
    samples = [sample(t, step=t // 10, rss_mib=100) for t in range(10, 101, 10)]  # t = 10, 20, ..., 100 s
    samples[5] = sample(60, step=None, rss_mib=100)  # the dashboard did not answer
    # 0.2 of the run (launch to the last sample, 100 s) = 20 s: t = 20..100 stay (9), less the one at 60 s
    kept = soak.after_warmup(samples, 0.2)
    assert [s.t for s in kept] == [20, 30, 40, 50, 70, 80, 90, 100]
    assert soak.after_warmup(samples, 0.0)[0].t == 10 and soak.after_warmup([], 0.2) == []
    # still starting at 20 and 30 s (the learner at step 0): the warm-up lasts until its first step
    starting = [sample(t, step=max(0, t // 10 - 3), rss_mib=100) for t in range(10, 101, 10)]
    assert [s.t for s in soak.after_warmup(starting, 0.2)] == [40, 50, 60, 70, 80, 90, 100]


def test_a_linear_series_gives_its_growth_per_1000_steps() -> None:
    # steps 100..400, RSS 200, 202, 204, 206 MiB: 0.02 MiB a step = 20 MiB per 1000 = 10% of 200 (the first value)
    # fds flat at 30: 0; threads 10, 10, 11, 11: steps' mean 250, threads' 10.5:
    # sum (x-250)(y-10.5) = (-150)(-.5) + (-50)(-.5) + (50)(.5) + (150)(.5) = 200; sum (x-250)^2 = 50000 -> 0.004 a step
    samples = [
        sample(t, step, rss, threads=th)
        for t, step, rss, th in [(10, 100, 200, 10), (20, 200, 202, 10), (30, 300, 204, 11), (40, 400, 206, 11)]
    ]
    g = soak.role_growth(samples, "learner")
    assert g.rss == (pytest.approx(200), pytest.approx(206))
    assert g.rss_per_k == pytest.approx(20.0) and g.rss_pct_per_k == pytest.approx(10.0)
    assert g.fds == (30, 30) and g.fds_per_k == pytest.approx(0.0)
    assert g.threads == (10, 11) and g.threads_per_k == pytest.approx(4.0)
    line = soak.last_line([g], (100, 400))
    assert "10.00% (learner; target < 5%: not met)" in line and "steps 100..400" in line


def test_a_flat_series_after_the_warm_up_has_no_growth() -> None:
    # RSS grows 100 -> 400 MiB during the warm-up (t < 0.25 x 80 = 20 s), then stays at 500 while the learner moves
    warm = [sample(5, 0, 100), sample(10, 1, 400)]
    steady = [sample(t, step, 500, fds=40, threads=12) for t, step in [(20, 10), (40, 20), (60, 30), (80, 40)]]
    lines = soak.report(warm + steady, 0.25)
    assert lines[0].startswith("# 4 samples of 6 after the warm-up (20 s..80 s), learner steps 10..40")
    learner = next(line for line in lines if line.startswith("learner "))
    assert learner.split() == [
        "learner",
        "1",
        "500.0",
        "->",
        "500.0",
        "+0.00",
        "+0.00",
        "40",
        "->",
        "40",
        "+0.0",
        "12",
        "->",
        "12",
        "+0.0",
    ]
    assert lines[-1].startswith("soak RSS growth per 1000 learner steps, worst role: 0.00% (learner; target < 5%: met)")


def test_roles_add_up_to_the_whole_run_and_the_largest_comes_first() -> None:
    s = Sample(1, 5, 0, 0, {"broker": Usage(1, 10 * MIB, 20, 3), "actor": Usage(2, 30 * MIB, 50, 8)})
    total = soak.with_total([s, Sample(2, 6, 0, 0, dict(s.roles))])
    assert total[0].roles[soak.ALL] == Usage(3, 40 * MIB, 70, 11)  # 1 + 2 processes, 10 + 30 MiB, 20 + 50, 3 + 8
    rows = soak.growth_table(total)
    assert [r.role for r in rows] == ["actor", "broker", "all"]
    assert rows[0].rss_per_k == 0.0 and rows[0].rss_pct_per_k == 0.0  # steps 5 and 6, the same values: flat
    lines = soak.table_lines(rows)
    assert len(lines) == 4 and lines[0].split()[:2] == ["role", "procs"]


def test_a_role_missing_from_a_sample_is_skipped_there() -> None:
    # the actor between two lives at step 2: its line is fitted on steps 1 and 3 only: 50 -> 70 MiB over 2 steps
    samples = [sample(1, 1, 50, role="actor"), Sample(2, 2, 0, 0, {}), sample(3, 3, 70, role="actor")]
    g = soak.role_growth(samples, "actor")
    assert g.rss_per_k == pytest.approx(10_000.0)  # 10 MiB a step
    with pytest.raises(ValueError, match="no sample holds role 'broker'"):
        soak.role_growth(samples, "broker")


def test_too_few_steps_say_so_instead_of_a_figure() -> None:
    samples = [sample(t, 7, 100 + t) for t in (10, 20, 30)]  # the learner at step 7 all along: no slope
    lines = soak.report(samples, 0.0)
    assert "n/a" in next(line for line in lines if line.startswith("learner "))
    assert lines[-1].startswith("soak RSS growth per 1000 learner steps: not measured (learner steps 7..7")
    assert soak.report(samples[:1], 0.0) == [
        "soak: 1 samples after the warm-up (of 1): run longer or sample more often"
    ]


def test_the_wal_and_buffered_lines() -> None:
    # WAL 1, 2, 3 MiB, compacted to 1, then 2: first 1, max 3, last 2, shrank once; buffered 4, 8, 6 (one sample
    # without the dashboard): mean 6, max 8
    samples = [
        sample(i, i, 100, wal_mib=w, buffered=b)
        for i, (w, b) in enumerate([(1, 4), (2, None), (3, 8), (1, 6), (2, None)])
    ]
    assert soak.wal_line(samples) == "WAL on disk (MiB): first 1.00, max 3.00, last 2.00; shrank 1 times (compactions)"
    assert soak.buffered_line(samples) == "buffered transitions: mean 6.0, max 8"


def test_processes_are_named_by_role() -> None:
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1", "-m", "learner.train"]
    assert harness.role(torchrun) == "torchrun"  # before learner.train, which its command line names too
    assert harness.role([sys.executable, "-u", "-m", "learner.train", "--config", "/tmp/x"]) == "learner"
    assert harness.role(["VLLM::EngineCore"]) == "vLLM engine core"
    assert harness.role([sys.executable, "-m", "gateway", "--config", "/tmp/gateway/config.yaml"]) == "gateway"
    assert harness.role([sys.executable, "-m", "actors.actor", "--config", "/tmp/gateway-run/x.yaml"]) == "actor"
    assert harness.role([sys.executable, "-c", "from multiprocessing.resource_tracker import main"]) == "other"


def test_a_process_tree_is_read_by_role(tmp_path: Path) -> None:
    code = "import time; time.sleep(10)"
    proc = subprocess.Popen([sys.executable, "-c", code, "broker.server"])  # named like the broker
    try:
        child = psutil.Process(proc.pid)
        deadline = time.time() + 10
        while "broker.server" not in child.cmdline() and time.time() < deadline:
            time.sleep(0.01)  # between fork and exec the child still shows the test's own command line
        usage = soak.tree_usage(child)
    finally:
        proc.kill()
        proc.wait()
    assert set(usage) == {"broker"}
    u = usage["broker"]
    assert u.procs == 1 and u.rss > 1 * MIB and u.fds >= 3 and u.threads >= 1  # stdin, stdout, stderr at least
    (tmp_path / "wal-000001.log").write_bytes(b"x" * 10)
    (tmp_path / "wal-000002.log").write_bytes(b"x" * 20)
    assert soak.folder_bytes(tmp_path) == 30 and soak.folder_bytes(tmp_path / "missing") == 0
