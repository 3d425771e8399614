"""Socket options that let a run's ZeroMQ connections come back by themselves after a network partition
(tests/broker/test_faults.py, the partition test, cuts a link for longer than the broker's heartbeat timeout).

- ZMTP heartbeats on every socket: a connection over which nothing (not even a PONG) came for HEARTBEAT_TIMEOUT_MS
  after a PING is closed, and a DEALER reconnects on its own. Without them a half-open TCP connection lingers for
  the kernel's ~15 minutes of retransmissions, and a healed link waits out TCP's backoff (up to 2 minutes).
- ROUTER_HANDOVER on the servers (the broker, the learner's weight publisher): a client that reconnects under its
  identity takes the place of its old connection. Without it a ROUTER refuses the new connection for as long as the
  old one looks open on its side: after a partition that ended only the client's end of it, for good.
"""

from __future__ import annotations

import zmq

HEARTBEAT_IVL_MS = 2_000
HEARTBEAT_TIMEOUT_MS = 30_000
"""Longer than any pause a live process shows here (a busy 2-core machine, a weight update being applied)."""


def keep_alive(sock: zmq.Socket) -> None:
    """ZMTP heartbeats: close a connection that went silent, so that it is made again."""
    sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)


def take_over_reconnects(sock: zmq.Socket) -> None:
    """A ROUTER: heartbeats, and a reconnecting client replaces its old connection."""
    keep_alive(sock)
    sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
