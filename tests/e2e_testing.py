"""Helpers shared by tests: launcher runs as subprocesses, raw broker clients, TensorBoard files."""

import json
import os
import struct
import time
import urllib.request
from pathlib import Path

import zmq
import zmq.asyncio


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


def wait_for(predicate, timeout_s: float, what: str, poll_s: float = 0.5, run_dir: Path | None = None):
    """`predicate`'s first true value within `timeout_s`; on timeout, what the run `run_dir` said of itself."""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll_s)
    raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}"
                         + ("" if run_dir is None else f"; the run says:\n{run_account(run_dir)}"))


def run_account(run_dir: Path) -> str:
    """A run's own account of how it stands: its summary's status and reason, else its launch log's end."""
    summary = run_dir / "summary.json"
    if summary.exists():
        s = json.loads(summary.read_text())
        return f"status {s.get('status')}: {s.get('reason', '')}"
    log = run_dir / "launch.log"
    return "\n".join(log.read_text().splitlines()[-20:]) if log.exists() else "(nothing yet)"


def api_state(port: int) -> dict | None:
    """The broker's /api/state on this dashboard port, or None while it does not answer."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/state", timeout=2) as resp:
            return json.loads(resp.read())
    except OSError:
        return None


def dealer(address: str, name: str) -> zmq.asyncio.Socket:
    sock = zmq.asyncio.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, name.encode())
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    return sock


def read_tensorboard(logdir: Path) -> dict[str, list[tuple[int, float]]]:
    """(step, value) per tag from the TFRecord event files: u64 length, u32 crc, Event proto, u32 crc."""
    from tensorboardX.proto.event_pb2 import Event

    out: dict[str, list[tuple[int, float]]] = {}
    for path in sorted(logdir.glob("events.out.tfevents.*")):
        data, i = path.read_bytes(), 0
        while i + 12 <= len(data):
            (n,) = struct.unpack("<Q", data[i:i + 8])
            event = Event.FromString(data[i + 12:i + 12 + n])
            i += 12 + n + 4
            for v in event.summary.value:
                out.setdefault(v.tag, []).append((event.step, v.simple_value))
    return out
