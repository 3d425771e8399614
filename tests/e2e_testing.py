"""Helpers of the end-to-end tests (launcher runs as subprocesses)."""

import json
import os
import time
import urllib.request
from pathlib import Path


def processes_mentioning(needle: str) -> list[str]:
    out = []
    for pid in os.listdir("/proc"):
        if pid.isdigit() and int(pid) != os.getpid():
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if needle in cmd:
                out.append(f"{pid}: {cmd[:200]}")
    return out


def wait_for(predicate, timeout_s: float, what: str, poll_s: float = 0.5):
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll_s)
    raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}")


def api_state(port: int) -> dict | None:
    """The broker's /api/state on this dashboard port, or None while it does not answer."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/state", timeout=2) as resp:
            return json.loads(resp.read())
    except OSError:
        return None
