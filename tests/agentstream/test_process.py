"""Every process's start-up and end (agentstream/process.py), in a real child process: a stop signal drains it and
it exits with its main's code, an error exits 1 with its traceback, and each log line has the format it was given.

    .venv/bin/python -m pytest tests/agentstream/test_process.py -q
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

CHILD = r"""
import asyncio, logging, sys
from agentstream.process import on_stop_signals, run_process

log = logging.getLogger("probe")

async def main() -> int:
    if sys.argv[1] == "fail":
        raise RuntimeError("boom")
    stop = asyncio.Event()
    on_stop_signals(stop.set)
    print("ready", flush=True)  # the signal handlers are in place
    await stop.wait()
    log.info("draining")
    return 7

run_process("probe-0", log, main, log_format="%(levelname)s [probe-0] %(message)s")
"""


def start(mode: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", CHILD, mode], cwd=ROOT, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_stop_signal_drains_the_process_and_it_exits_with_its_mains_code(sig: signal.Signals) -> None:
    proc = start("serve")
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    # Not killed by the signal (that would be -15 or -2): main set its event, logged, and returned 7.
    assert proc.returncode == 7, err
    lines = err.splitlines()
    # Both lines in the given format (level, the name in brackets, no time); the exit line names the process.
    assert lines[0] == "INFO [probe-0] draining", err
    assert re.fullmatch(r"INFO \[probe-0\] probe-0: exit 7 after \d+\.\ds", lines[1]), err
    assert len(lines) == 2, err


def test_an_error_exits_1_with_its_traceback_in_the_log() -> None:
    proc = start("fail")
    _, err = proc.communicate(timeout=30)
    # 1: what Python gives an uncaught exception; the traceback goes through the log, then the exit line.
    assert proc.returncode == 1, err
    lines = err.splitlines()
    assert lines[0] == "ERROR [probe-0] probe-0: failed", err
    assert "RuntimeError: boom" in lines, err
    assert re.fullmatch(r"INFO \[probe-0\] probe-0: exit 1 after \d+\.\ds", lines[-1]), err
