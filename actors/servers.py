"""Servers of a fixed model that the actors ask beside their policy's engines: LLM judges (actors/judge.py) and
distillation teachers (actors/teacher.py). Their weights never change; the launcher starts them as judge-<i> or
teacher-<i> with the engines' server command and restarts one that dies (launcher/supervisor.py).

    servers = FixedServers(clients)
    client = servers.pick()            # fewest requests in flight; one that just failed only when all did
    with servers.using(client):
        ...                            # on a failure: servers.failed(client)
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import Iterator, Sequence

from engines.client import EngineClient


class FixedServers:
    """Picks a server: the one with the fewest requests in flight (ties: in turn), among those that did not fail in
    the last `down_s` seconds (all of them when every one did)."""

    down_s = 10.0

    def __init__(self, clients: Sequence[EngineClient], what: str):
        if not clients:
            raise ValueError(f"no {what} server was given: the launcher passes their URLs")
        self.clients = list(clients)
        self.load = {c.url: 0 for c in self.clients}
        self._down: dict[str, float] = {}
        self._rr = itertools.count()

    def pick(self, avoid: str = "") -> EngineClient:
        """The server to ask now; `avoid`: a URL to take only when it is the only one (a retry goes elsewhere)."""
        now = time.monotonic()
        up = [c for c in self.clients if now - self._down.get(c.url, -1e9) > self.down_s] or self.clients
        up = [c for c in up if c.url != avoid] or up
        start = next(self._rr) % len(up)
        turn = up[start:] + up[:start]
        return min(turn, key=lambda c: self.load[c.url])

    @contextlib.contextmanager
    def using(self, client: EngineClient) -> Iterator[EngineClient]:
        """`client` counted as having one more request in flight while the block runs."""
        self.load[client.url] += 1
        try:
            yield client
        finally:
            self.load[client.url] -= 1

    def failed(self, client: EngineClient) -> None:
        """`client` failed a request: the others are asked first for a while."""
        self._down[client.url] = time.monotonic()


__all__ = ["FixedServers"]
