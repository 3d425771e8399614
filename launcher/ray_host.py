"""The Ray actor behind each process of a run on Ray (launcher.ray_backend): it runs one child process on its node.

A module of its own, importing only what it uses: every process of the run has one of these in a Ray worker, and
that worker imports this module (not the launcher's), so it holds ~Ray's own memory and little more.
"""

from __future__ import annotations

import asyncio
import random
import signal
import socket
from pathlib import Path

from launcher import procs
from launcher.procs import CHILD_ENV

PORTS_FROM = 20_000  # above Ray's worker ports (10002-19999 by default)


class ProcessHost:
    """A Ray actor that runs one child process of the run on its node: started, awaited, signalled and ended here
    (`launcher.procs`: a session of its own, its group signalled, marked descendants ended)."""

    def __init__(self) -> None:
        self.proc = None

    def where(self) -> tuple[str, str]:
        """(this node's IP as the cluster knows it, this node's Ray id)."""
        import ray

        return ray.util.get_node_ip_address(), ray.get_runtime_context().get_node_id()

    def free_ports(self, host: str, n: int) -> list[int]:
        """`n` distinct ports free on this node's `host` now (all held until all are chosen), drawn below the
        kernel's ephemeral range: the Ray workers that start on the node before our processes bind (sidecars,
        joiners) take ephemeral ports, and one of them took a port picked with bind-to-0 (a broker's dashboard)."""
        low, _ = (int(x) for x in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
        candidates = random.sample(range(PORTS_FROM, max(low, PORTS_FROM + 1000)), 200)
        socks: list[socket.socket] = []
        try:
            for port in candidates:
                s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                try:
                    s.bind((host, port))
                except OSError:
                    s.close()
                    continue
                socks.append(s)
                if len(socks) == n:
                    return [s.getsockname()[1] for s in socks]
            raise OSError(f"no {n} free ports on {host} between {PORTS_FROM} and {low}")
        finally:
            for s in socks:
                s.close()

    def start(self, argv: list[str], env: dict[str, str], log_path: str, cwd: str) -> int:
        self.proc = procs.start(argv, Path(log_path), env, Path(cwd))
        return self.proc.pid

    async def wait(self) -> int:
        return await asyncio.to_thread(self.proc.wait)

    def signal(self, sig: int) -> None:
        if self.proc is not None:
            procs.signal_group(self.proc, sig)

    def end(self, marker: str) -> tuple[list[str], list[str]]:
        """SIGKILL the group, then every process on this node with the incarnation's marker that is outside it
        (torchrun's ranks, anything reparented). Returns (found outside the group, still alive after the wait)."""
        if self.proc is None:
            return [], []
        procs.signal_group(self.proc, signal.SIGKILL)
        self.proc.wait()
        ended, _ = procs.end_marked(CHILD_ENV, marker, other_than_group=self.proc.pid)
        _, alive = procs.end_marked(CHILD_ENV, marker)
        return ended, alive


__all__ = ["ProcessHost"]
