"""The supervisor ends whatever a dead child left: real process trees shaped like vLLM's and torchrun's, real
SIGKILLs, no full run (a few seconds).

Each child here is a parent that starts a "core" in its own process group (as vLLM's API server starts its
EngineCore: a kill -9 of the parent leaves it running, reparented to init) and a "rank" in a session of its own
(as torchrun starts its ranks). The supervisor must end both before it starts the next incarnation, and the
end-of-run check (`Launcher.stop_all`, summary.json's `processes_left`) must find and end any it missed.

    .venv/bin/python -m pytest tests/launcher/test_supervisor_leftovers.py -q
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

import pytest

from agentstream.config import Config
from launcher.commands import Command
from launcher.procs import RUN_ENV, marked
from launcher.supervisor import Launcher

TREE = r"""
import os, subprocess, sys, time
out, prev = sys.argv[1], sys.argv[2]
def running(pid):
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] not in "ZX"
    except OSError:
        return False
# What the previous incarnation left, as this one starts: must be nothing.
left = [int(p) for p in open(prev).read().split()[:3] if running(int(p))] if os.path.exists(prev) else []
sleeper = [sys.executable, "-c", "import time; time.sleep(300)"]
core = subprocess.Popen(sleeper)  # same group as this process: outlives it after a kill -9
rank = subprocess.Popen(sleeper, start_new_session=True)  # a session of its own: no group signal reaches it
with open(out + ".tmp", "w") as f:
    f.write(f"{os.getpid()} {core.pid} {rank.pid} left:{','.join(map(str, left))}")
os.replace(out + ".tmp", out)
time.sleep(300)
"""


def running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in "ZX"
    except OSError:
        return False


async def tree_pids(path: Path) -> tuple[list[int], str]:
    """(parent, core, rank) pids the tree wrote, and what it found left of the previous incarnation."""
    for _ in range(200):  # 20 s at most; a python start takes ~0.1 s
        if path.exists():
            *pids, left = path.read_text().split()
            return [int(p) for p in pids], left.removeprefix("left:")
        await asyncio.sleep(0.1)
    raise AssertionError(f"{path} never appeared")


def tree_command(launcher: Launcher, name: str, role: str, out: Path, prev: Path, incarnation: int = 0) -> Command:
    return launcher.commands.command(
        name, role, [sys.executable, "-c", TREE, str(out), str(prev)], incarnation=incarnation
    )


@pytest.fixture
def launcher(tmp_path: Path):
    cfg = Config()
    cfg.actors.max_restarts = 1
    cfg.run.shutdown_timeout_s = 5
    launcher = Launcher(cfg, tmp_path)

    def actor_command(i: int, incarnation: int = 0) -> Command:  # the tree instead of a real actor
        return tree_command(
            launcher,
            f"actor-{i}",
            "actor",
            tmp_path / f"actor-{incarnation}.pids",
            tmp_path / f"actor-{incarnation - 1}.pids",
            incarnation,
        )

    launcher.commands.actor = actor_command  # type: ignore[method-assign]
    yield launcher
    for pid in marked(RUN_ENV, str(tmp_path.resolve())):  # whatever a failed assertion left running
        os.kill(pid, signal.SIGKILL)


async def test_a_restart_ends_the_dead_incarnations_tree_and_the_end_of_run_check_finds_what_was_missed(
    launcher: Launcher, tmp_path: Path
) -> None:
    await launcher.spawn(launcher.commands.actor(0))
    supervise = asyncio.create_task(launcher.supervise())
    try:
        first, _ = await tree_pids(tmp_path / "actor-0.pids")
        assert all(running(p) for p in first)
        os.kill(first[0], signal.SIGKILL)  # the parent alone, as a kill -9 of vLLM's API server
        second, left_at_start = await tree_pids(tmp_path / "actor-1.pids")
        # Core and rank of incarnation 0 were gone before incarnation 1 started (it looked), and are gone now.
        assert left_at_start == "" and not any(running(p) for p in first), (left_at_start, first)
        assert all(running(p) for p in second) and launcher.actor_restarts == 1
    finally:
        supervise.cancel()
        await asyncio.gather(supervise, return_exceptions=True)

    # The old defect, on purpose: a child dropped from the supervisor's list without being stopped (as the
    # engine restart path did), its parent killed alone. Its core and rank are nobody's children any more.
    stray = await launcher.spawn(tree_command(launcher, "engine-0", "engine", tmp_path / "engine.pids", tmp_path / "-"))
    (parent, core, rank), _ = await tree_pids(tmp_path / "engine.pids")
    launcher.children.remove(stray)
    os.kill(parent, signal.SIGKILL)
    await stray.proc.wait()

    left = await launcher.stop_all()
    # The orderly stops ended the live actor's tree (not a leftover); the check found the engine's two strays.
    assert sorted(left) == sorted(
        [
            f"{stray.marker}: pid {core} ({sys.executable} -c import time; time.sleep(300)): ended at the end",
            f"{stray.marker}: pid {rank} ({sys.executable} -c import time; time.sleep(300)): ended at the end",
        ]
    ), left
    assert not any(running(p) for p in [*second, core, rank])
    assert marked(RUN_ENV, str(tmp_path.resolve())) == {}
