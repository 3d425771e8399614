"""Addresses: a free port to bind, and the name other hosts use to reach a bound socket."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A port the OS says is free now (bind to 0, read it back)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def advertised_host(host: str) -> str:
    """The name other processes use to reach a socket bound to `host`: a wildcard bind (0.0.0.0, ::, *)
    is reached through this machine's name; any other host as given."""
    return socket.getfqdn() if host in ("0.0.0.0", "::", "*", "") else host
