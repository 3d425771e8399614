"""Child processes: each in its own session, stopped by signalling its whole group.

A vLLM server is three processes and torchrun has one per rank: signalling only the parent leaves orphans
holding ports and memory, so every child starts a new session and `stop` signals the group, waits, and
escalates to SIGKILL.

A group is not enough once the leader died: vLLM's EngineCore stays in the dead API server's group after a
kill -9 (reparented to init, holding gigabytes), and torchrun starts each rank in a session of its own. The
supervisor therefore puts a marker in every child's environment (`RUN_ENV`, `CHILD_ENV`), which every
descendant inherits wherever it is reparented; `marked` finds them by reading /proc/<pid>/environ, and
`end_marked` ends them.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import IO


def start(
    argv: list[str], log_path: Path, env: dict[str, str] | None = None, cwd: Path | None = None
) -> subprocess.Popen:
    """Start `argv` in a new session, stdout+stderr appended to `log_path`."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log: IO[bytes] = open(log_path, "ab")
    try:
        return subprocess.Popen(
            argv,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, **(env or {})},
            cwd=cwd,
            start_new_session=True,
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


RUN_ENV = "AGENTSTREAM_RUN"
"""In every child's environment: the run folder (absolute). Tests look for leftovers of a run by it."""
CHILD_ENV = "AGENTSTREAM_CHILD"
"""In every child's environment: `<launcher pid>/<child name>/<serial>`, one value per started incarnation."""
_serial = itertools.count()


def child_marker(name: str) -> str:
    """A fresh `CHILD_ENV` value for one incarnation of child `name` of this process."""
    return f"{os.getpid()}/{name}/{next(_serial)}"


def marked(key: str, value: str, prefix: bool = False, other_than_group: int = 0) -> dict[int, str]:
    """{pid: description} of every live process (not this one, no zombie) whose environment has `key=value`,
    or with `prefix`, a `key` whose value starts with `value`. Found wherever it is now: in another group or
    session, or reparented to init. Only processes whose environment this user may read are seen.
    `other_than_group`: leave out the members of this process group."""
    needle, me, out = f"{key}={value}".encode(), os.getpid(), {}
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == me:
            continue
        try:
            env = Path(f"/proc/{name}/environ").read_bytes()
        except OSError:  # gone meanwhile, or not ours to read
            continue
        hit = next((e for e in env.split(b"\0") if e == needle or (prefix and e.startswith(needle))), None)
        if hit is None or _zombie(int(name)) or (other_than_group and _pgid(int(name)) == other_than_group):
            continue
        try:
            cmd = Path(f"/proc/{name}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue
        out[int(name)] = f"{hit.decode(errors='replace').split('=', 1)[1]}: pid {name} ({cmd[:100]})"
    return out


def _stat(pid: int) -> list[str]:
    """/proc/<pid>/stat's fields after the command name: [state, ppid, pgrp, ...]; [] once it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return []


def _zombie(pid: int) -> bool:
    """Dead: gone, or a zombie (init reaps reparented ones a while later)."""
    stat = _stat(pid)
    return not stat or stat[0] in ("Z", "X")


def _pgid(pid: int) -> int:
    stat = _stat(pid)
    return int(stat[2]) if len(stat) > 2 else 0


def end_marked(
    key: str, value: str, prefix: bool = False, other_than_group: int = 0, timeout_s: float = 5.0
) -> tuple[list[str], list[str]]:
    """SIGKILL every process `marked(key, value, prefix, other_than_group)` finds and wait up to `timeout_s`
    for each to die. Returns (descriptions of those found, descriptions of those still alive after the wait)."""
    found = marked(key, value, prefix, other_than_group)
    for pid in found:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    alive, deadline = set(found), time.monotonic() + timeout_s
    while alive and time.monotonic() < deadline:
        time.sleep(0.05)
        alive = {pid for pid in alive if not _zombie(pid)}
    return list(found.values()), [found[pid] for pid in alive]


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
