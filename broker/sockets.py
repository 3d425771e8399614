"""Multipart receive and send on the broker's ROUTER socket without pyzmq's per-part overheads (measured by
bench/broker.py)."""

from __future__ import annotations

import zmq

_NOBLOCK, _MORE_NOBLOCK = int(zmq.NOBLOCK), int(zmq.SNDMORE | zmq.NOBLOCK)


def recv_frames(sock: zmq.Socket) -> list[zmq.Frame]:
    """`sock.recv_multipart(zmq.NOBLOCK, copy=False)`, each part's more-flag read from the part itself
    (bench/broker.py: pyzmq asks the socket for RCVMORE after every part, through an enum conversion;
    ~5 us of ~19 per 7-part message here). Raises zmq.Again when nothing waits; the parts after the first
    are there already (ZeroMQ delivers a multipart message whole)."""
    frame = sock.recv(_NOBLOCK, copy=False)
    frames = [frame]
    while frame.more:
        frame = sock.recv(_NOBLOCK, copy=False)
        frames.append(frame)
    return frames


def send_frames(sock: zmq.Socket, frames: list, copy: bool) -> None:
    """`sock.send_multipart(frames, zmq.NOBLOCK, copy=copy)` with its flags as plain ints (pyzmq ORs enum
    flags for every part)."""
    for frame in frames[:-1]:
        sock.send(frame, _MORE_NOBLOCK, copy=copy)
    sock.send(frames[-1], _NOBLOCK, copy=copy)
