"""Addresses: a free port to bind, the name other hosts use to reach a bound socket, and the broker's record."""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path
from typing import Any


def free_port(host: str = "127.0.0.1") -> int:
    """A port the OS says is free now (bind to 0, read it back)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def advertised_host(host: str) -> str:
    """The name other processes use to reach a socket bound to `host`: a wildcard bind (0.0.0.0, ::, *)
    is reached through this machine's name; any other host as given."""
    return socket.getfqdn() if host in ("0.0.0.0", "::", "*", "") else host


def advertised_address(bind: str) -> str:
    """The address other processes connect to for a ZeroMQ socket bound at `bind` (tcp://HOST:PORT, as the launcher
    hands the learner its `weights_bind`): the host as `advertised_host` names it; "" when `bind` is no TCP address
    with a fixed port (a port the OS picks, "*" or 0, is known only to the socket)."""
    scheme, _, rest = bind.partition("://")
    host, _, port = rest.rpartition(":")
    if scheme != "tcp" or not host or not port.isdigit() or int(port) == 0:
        return ""
    host = advertised_host(host.strip("[]"))
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


BROKER_RECORD = "broker.json"
"""The broker's record in its run folder: the addresses it listens on now (`address`, `dashboard`). A broker started
again (on another port, or on another node from the run folder on shared storage) writes it anew; its clients read it
when they wait on the broker, and follow (`agentstream.wire.client.RecordLink`). A file in the run folder, not Ray's
key-value store: the broker's write-ahead log must be on storage every node reads for it to move at all, and a file
serves the local, Slurm and Ray backends alike."""
LEARNER_RECORD = "learner.json"
"""The learner's record in the run folder: where rank 0 publishes weights (`weights`), written by the launcher each
time it places the learner; the weight sidecars follow it as the broker's clients follow the broker's."""


def write_record(path: Path, **fields: str) -> Path:
    """Write a record (`fields`, the writer's pid and the time) to `path` atomically: readers never see half of one."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(json.dumps({**fields, "pid": os.getpid(), "at": time.time()}))
    os.replace(tmp, path)
    return path


def read_record(path: str | Path, key: str = "address") -> dict[str, Any] | None:
    """The record at `path`, or None when there is none (yet), it does not parse or it has no string `key`."""
    try:
        record = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and isinstance(record.get(key), str) else None
