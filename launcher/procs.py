"""Child processes: each in its own session, stopped by signalling its whole group.

A vLLM server is three processes and torchrun has one per rank: signalling only the parent leaves orphans
holding ports and memory, so every child starts a new session and `stop` signals the group, waits, and
escalates to SIGKILL.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import IO


def start(argv: list[str], log_path: Path, env: dict[str, str] | None = None, cwd: Path | None = None) -> subprocess.Popen:
    """Start `argv` in a new session, stdout+stderr appended to `log_path`."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log: IO[bytes] = open(log_path, "ab")
    try:
        return subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env={**os.environ, **(env or {})}, cwd=cwd, start_new_session=True,
        )
    finally:
        log.close()  # the child holds its own descriptor


def signal_group(proc: subprocess.Popen, sig: int) -> None:
    """Send `sig` to the child's whole process group (it leads its own session)."""
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def stop(proc: subprocess.Popen, timeout_s: float = 20.0) -> int | None:
    """SIGTERM the group, wait up to `timeout_s`, then SIGKILL it. Returns the exit code."""
    if proc.poll() is None:
        signal_group(proc, signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            pass
    # Even when the leader exited, its group may hold stragglers (vLLM's EngineCore, torchrun's ranks).
    signal_group(proc, signal.SIGKILL)
    try:
        return proc.wait(5)
    except subprocess.TimeoutExpired:
        return None


def group_alive(pgid: int) -> bool:
    """Whether any process of group `pgid` still exists."""
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def wait_gone(pgids: list[int], timeout_s: float = 10.0) -> list[int]:
    """Wait until none of the groups has a live process; returns those that still do."""
    deadline = time.monotonic() + timeout_s
    alive = [p for p in pgids if group_alive(p)]
    while alive and time.monotonic() < deadline:
        time.sleep(0.1)
        alive = [p for p in alive if group_alive(p)]
    return alive


def kill_matching(*needles: str, sig: int = signal.SIGKILL) -> list[int]:
    """Signal every process whose command line contains all `needles`; returns their pids.

    For processes that outlived their group's leader in a session of their own (torchrun starts each rank
    in a new session: a kill -9 of torchrun leaves the ranks running)."""
    import psutil

    hit = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        cmd = " ".join(proc.info["cmdline"] or [])
        if proc.info["pid"] != os.getpid() and all(n in cmd for n in needles):
            with contextlib.suppress(psutil.Error):
                proc.send_signal(sig)
                hit.append(proc.info["pid"])
    return hit
