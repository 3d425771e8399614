"""Client side of the broker: what actors, learner ranks and weight sidecars use to talk to it.

Every client is a ZeroMQ DEALER connected to the broker's ROUTER; its identity is its name, so the broker's
registry and dashboard know who sent what. All bytes go through `agentstream.wire.messages`.

    client = SyncClient("tcp://127.0.0.1:5555", name="learner-0")       # blocking (learner)
    batch = client.request(BatchRequest(step=0, rank=0, world_size=2))

    client = AsyncClient("tcp://127.0.0.1:5555", name="actor-0")        # asyncio (actors, agents)
    await client.start(); grant = await client.request_group(); await client.send(transition)
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import time
from collections import deque
from collections.abc import Callable, Iterator

import zmq
import zmq.asyncio

from agentstream.wire.addresses import read_record
from agentstream.wire.curve import load_client_keys, secure_client
from agentstream.wire.messages import (
    MAX_BUNDLE,
    Ack,
    GroupGrant,
    GroupRequest,
    Message,
    Reject,
    Transition,
    Transitions,
    Welcome,
    decode,
    encode,
)
from agentstream.wire.reconnect import keep_alive

log = logging.getLogger(__name__)


class BrokerUnavailable(RuntimeError):
    """The broker did not answer in time."""


def _configure(sock: zmq.Socket, name: str, hwm: int, curve_keys_dir: str = "", max_message_bytes: int = 0) -> None:
    """Identity, queues, and (security) CURVE with the key folder's client pair, and a frame-size bound."""
    if curve_keys_dir:
        secure_client(sock, load_client_keys(curve_keys_dir))
    if max_message_bytes:  # a larger frame from the server drops the connection before it is buffered
        sock.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
    sock.setsockopt(zmq.IDENTITY, name.encode())
    sock.setsockopt(zmq.SNDHWM, hwm)
    sock.setsockopt(zmq.RCVHWM, hwm)
    sock.setsockopt(zmq.LINGER, 5000)  # on close, flush what was sent (bounded)
    keep_alive(sock)  # a connection lost to a partition is made again


class RecordLink:
    """Where a client reaches a server that may move. Given an address (tcp://HOST:PORT) it stays there; given the
    path of the server's record (RUN/broker.json or RUN/learner.json, `agentstream.wire.addresses`) it starts at the
    address the record names under `key` and moves with it: a server started again elsewhere rewrites it. Clients ask
    `moved()` while they wait on the server (a stat of the file; read again only when it changed) and reconnect."""

    def __init__(self, where: str, key: str = "address"):
        self.record, self.key = ("" if "://" in where else where), key
        self._seen = 0  # the record's mtime when it was last read
        self.address = where
        if self.record and self.moved() is None:
            raise BrokerUnavailable(
                f"no record with an address at {where}: give the address (tcp://HOST:PORT), or "
                f"the record the running run wrote (RUN/broker.json, RUN/learner.json)"
            )

    def moved(self) -> str | None:
        """The new address when the record names another one than `address` (which becomes it), else None."""
        try:
            mtime = os.stat(self.record).st_mtime_ns if self.record else self._seen
        except OSError:
            return None
        if mtime == self._seen or (record := read_record(self.record, self.key)) is None:
            return None
        self._seen = mtime
        if record[self.key] == self.address:
            return None
        self.address = record[self.key]
        return self.address


def follow_record(sock: zmq.Socket, link: RecordLink, name: str) -> bool:
    """Reconnect `sock` to the server's new address if its record names one; True if it did."""
    old = link.address
    new = link.moved()
    if new is None:
        return False
    _reconnect(sock, old, new)
    log.warning("%s: %s moved to %s (its record %s); following it", name, old, new, link.record)
    return True


def follow_address(sock: zmq.Socket, link: RecordLink, address: str, name: str, told_by: str) -> bool:
    """Reconnect `sock` to `address`, where `told_by` says the server is now (a client with no record to read:
    the broker's Welcome names the learner's weight address), unless `link` points there already or `address` is
    empty; True if it did. `link.address` becomes `address`."""
    if not address or address == link.address:
        return False
    old, link.address = link.address, address
    _reconnect(sock, old, address)
    log.warning("%s: %s moved to %s (said %s); following it", name, old, address, told_by)
    return True


def _reconnect(sock: zmq.Socket, old: str, new: str) -> None:
    with contextlib.suppress(zmq.ZMQError):  # already gone
        sock.disconnect(old)
    sock.connect(new)  # what was queued for the old one is lost: every client sends again until answered


BUNDLE_BYTES = 8 * 1024 * 1024
"""Array bytes one Transitions message carries at most (a transition with more goes alone). Pictures make
transitions large, and the broker refuses a message over broker.max_message_bytes (64 MiB) whole, every time it
is resent: a bundle is cut by bytes as well as by count (MAX_BUNDLE)."""


def bundles(ts: list[Transition], max_bytes: int = BUNDLE_BYTES) -> Iterator[list[Transition]]:
    """`ts` in order, in runs of at most MAX_BUNDLE transitions and `max_bytes` array bytes (token ids, log-probs,
    pictures); a transition over `max_bytes` alone makes a run."""
    run: list[Transition] = []
    size = 0
    for t in ts:
        n = t.prompt_ids.nbytes + t.response_ids.nbytes + t.logprobs.nbytes + t.images.nbytes
        if run and (len(run) == MAX_BUNDLE or size + n > max_bytes):
            yield run
            run, size = [], 0
        run.append(t)
        size += n
    if run:
        yield run


class SyncClient:
    """Blocking client (the learner's ranks)."""

    def __init__(self, address: str, name: str, hwm: int = 1000, curve_keys_dir: str = "", max_message_bytes: int = 0):
        """`address`: the broker's, or its record (`RecordLink`: followed while a request waits);
        `curve_keys_dir`: broker.curve_keys_dir (empty: no CURVE); `max_message_bytes`: 0 = no bound."""
        self.link = RecordLink(address)
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.DEALER)
        _configure(self._sock, name, hwm, curve_keys_dir, max_message_bytes)
        self._sock.connect(self.link.address)
        self.name = name
        self.moves_followed = 0

    def follow(self) -> bool:
        """Reconnect if the broker's record names a new address (call it while the broker is silent)."""
        moved = follow_record(self._sock, self.link, self.name)
        self.moves_followed += moved
        return moved

    def send(self, msg: Message) -> None:
        self._sock.send_multipart(encode(msg), copy=False)

    def request(
        self,
        msg: Message,
        timeout_s: float | None = None,
        resend_every_s: float | None = None,
        before: tuple[Message, ...] = (),
        accept: Callable[[Message], bool] | None = None,
        on_wait: Callable[[], None] | None = None,
    ) -> Message:
        """Send `msg` and wait for the broker's answer (a Reject raises).

        With `resend_every_s`, `msg` is sent again, after the messages `before`, while no answer comes (a
        broker restarted from its log lost the request; all of them must be idempotent). `on_wait` is called
        about once a second while no answer has come. Answers `accept` refuses (repeats of an
        earlier answer, refusals of an earlier resend) are skipped."""
        deadline = float("inf") if timeout_s is None else time.monotonic() + timeout_s
        resend = False
        while True:
            if resend:
                self.follow()
            for m in (*before, msg) if resend else (msg,):
                self.send(m)
            resend = True
            resend_at = min(deadline, time.monotonic() + (resend_every_s or float("inf")))
            while (now := time.monotonic()) < resend_at or resend_at == float("inf"):
                wait = None if resend_at == float("inf") else resend_at - now
                if on_wait is not None:
                    wait = 1.0 if wait is None else min(wait, 1.0)
                reply = self.receive(wait, accept, msg.kind)
                if reply is not None:
                    return reply
                if on_wait is None or time.monotonic() >= resend_at:
                    break
                on_wait()  # e.g. the learner's weight publisher serving a restarted engine
            if time.monotonic() >= deadline:
                raise BrokerUnavailable(f"no answer from the broker to {msg.kind} within {timeout_s}s")

    def receive(
        self, timeout_s: float | None, accept: Callable[[Message], bool] | None = None, what: str = "a request"
    ) -> Message | None:
        """The next message `accept` takes (all, without it), or None after `timeout_s` (None: wait for one); a
        Reject raises, naming `what` was refused."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            left_ms = None if deadline is None else int((deadline - time.monotonic()) * 1000)
            if (
                left_ms is not None
                and left_ms <= 0
                or not self._sock.poll(None if left_ms is None else max(1, left_ms))
            ):
                return None
            reply = decode(self._sock.recv_multipart(copy=False))
            if accept is not None and not accept(reply):
                continue
            if isinstance(reply, Reject):
                raise RuntimeError(f"broker refused {what}: {reply.reason}")
            return reply

    def close(self) -> None:
        self._sock.close()


class AsyncClient:
    """asyncio client (actors, weight sidecars). Group grants arrive whenever admission allows."""

    def __init__(
        self, address: str, name: str, hwm: int = 10_000, curve_keys_dir: str = "", max_message_bytes: int = 0
    ):
        """`address`: the broker's, or its record (`RecordLink`: looked at every ack_timeout_s / 2 and followed);
        `curve_keys_dir`: broker.curve_keys_dir (empty: no CURVE); `max_message_bytes`: 0 = no bound."""
        self.link = RecordLink(address)
        self._ctx = zmq.asyncio.Context.instance()
        self._sock = self._ctx.socket(zmq.DEALER)
        _configure(self._sock, name, hwm, curve_keys_dir, max_message_bytes)
        self._sock.connect(self.link.address)
        self.name = name
        self._reader: asyncio.Task[None] | None = None
        self.rejects: list[str] = []
        self.welcomes: asyncio.Queue[Welcome] = asyncio.Queue()  # answers to Hello(want_welcome=True)
        # At-least-once delivery of transitions (see `send_transition`), and resent group requests.
        self.incarnation, self.max_unacked, self.ack_timeout_s = 0, 256, 5.0
        self._seq = 0
        self._unacked: deque[Transition] = deque()  # keyed, oldest first
        self._outgoing: list[Transition] = []  # keyed, not sent yet (`_send_loop` sends them together)
        self._wake = asyncio.Event()
        self._sender: asyncio.Task[None] | None = None
        self._room = asyncio.Condition()
        self._last_progress = time.monotonic()  # last ack that freed something (or last resend)
        self._requests: dict[int, tuple[GroupRequest, asyncio.Future[GroupGrant]]] = {}
        self._next_request = 0
        self._resender: asyncio.Task[None] | None = None
        self.counters: dict[str, int] = {
            "transitions_resent": 0,
            "group_requests_resent": 0,
            "acks": 0,
            "transition_messages": 0,
            "broker_moves_followed": 0,
        }

    async def start(self, incarnation: int = 0, max_unacked: int = 256, ack_timeout_s: float = 5.0) -> None:
        self.incarnation, self.max_unacked, self.ack_timeout_s = incarnation, max_unacked, ack_timeout_s
        self._reader = asyncio.create_task(self._read(), name=f"{self.name}-broker-reader")
        self._resender = asyncio.create_task(self._resend_loop(), name=f"{self.name}-resender")
        self._sender = asyncio.create_task(self._send_loop(), name=f"{self.name}-sender")

    @property
    def unacked(self) -> int:
        return len(self._unacked)

    async def send_transition(self, t: Transition) -> None:
        """Send `t` under the next delivery key and keep it until the broker acknowledges it; waits while
        `max_unacked` are outstanding (back-pressure from a slow or absent broker). Transitions that come
        while one is being sent go out together, as one Transitions message (no waiting added)."""
        async with self._room:
            await self._room.wait_for(lambda: len(self._unacked) < self.max_unacked)
            keyed = dataclasses.replace(t, incarnation=self.incarnation, seq=self._seq)
            self._seq += 1
            if not self._unacked:
                self._last_progress = time.monotonic()  # the ack clock starts with the oldest outstanding one
            self._unacked.append(keyed)
            self._outgoing.append(keyed)
            self._wake.set()

    async def _send_loop(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._outgoing:
                batch = next(bundles(self._outgoing))
                self._outgoing = self._outgoing[len(batch) :]
                await self._send_transitions(batch)

    async def _send_transitions(self, ts: list[Transition]) -> None:
        msg = ts[0] if len(ts) == 1 else Transitions.of(ts)
        self.counters["transition_messages"] += 1
        await self._sock.send_multipart(encode(msg), copy=False)

    async def drain(self, timeout_s: float) -> int:
        """Wait (bounded) until the broker acknowledged everything sent; returns how many are still not."""
        with contextlib.suppress(asyncio.TimeoutError):
            async with asyncio.timeout(timeout_s):
                async with self._room:
                    await self._room.wait_for(lambda: not self._unacked)
        return len(self._unacked)

    async def _on_ack(self, ack: Ack) -> None:
        if ack.incarnation != self.incarnation:
            return
        async with self._room:
            freed = 0
            while self._unacked and self._unacked[0].seq <= ack.upto:
                self._unacked.popleft()
                freed += 1
            if freed:
                self.counters["acks"] += 1
                self._last_progress = time.monotonic()
                self._room.notify_all()

    async def _resend_loop(self) -> None:
        """Go-back-N: nothing acknowledged for ack_timeout_s -> resend every unacknowledged transition in
        order (the broker takes each seq once); pending group requests are resent too (the broker answers a
        repeated request with the grant it already gave). A broker that moved is followed first."""
        while True:
            await asyncio.sleep(self.ack_timeout_s / 2)
            if follow_record(self._sock, self.link, self.name):  # a broker that moved has everything unacked resent
                self.counters["broker_moves_followed"] += 1
                self._last_progress = 0.0
                for _, fut in self._requests.values():
                    fut.sent_at = 0.0  # type: ignore[attr-defined]
            if self._unacked and time.monotonic() - self._last_progress > self.ack_timeout_s:
                pending = list(self._unacked)
                for batch in bundles(pending):
                    await self._send_transitions(batch)
                self.counters["transitions_resent"] += len(pending)
                self._last_progress = time.monotonic()
            for req, fut in list(self._requests.values()):
                if not fut.done() and time.monotonic() - getattr(fut, "sent_at", 0.0) > self.ack_timeout_s:
                    fut.sent_at = time.monotonic()  # type: ignore[attr-defined]
                    self.counters["group_requests_resent"] += 1
                    await self.send(req)

    async def send(self, msg: Message) -> None:
        await self._sock.send_multipart(encode(msg), copy=False)

    async def request_group(self, groups: int = 1) -> GroupGrant:
        """Ask to start one group (`groups`: that many at once, ids grant.group_id + 0 .. groups - 1); returns when
        the broker admits it."""
        fut: asyncio.Future[GroupGrant] = asyncio.get_running_loop().create_future()
        req = GroupRequest(actor=self.name, incarnation=self.incarnation, request=self._next_request, groups=groups)
        self._next_request += 1
        self._requests[req.request] = (req, fut)
        fut.sent_at = time.monotonic()  # type: ignore[attr-defined]
        try:
            await self.send(req)
            return await fut
        finally:
            self._requests.pop(req.request, None)

    async def _read(self) -> None:
        while True:
            msg = decode(await self._sock.recv_multipart(copy=False))
            if isinstance(msg, Ack):
                await self._on_ack(msg)
            elif isinstance(msg, GroupGrant):
                pending = self._requests.get(msg.request)
                if pending is not None and not pending[1].done():
                    pending[1].set_result(msg)  # a grant for a request already answered is a repeat: ignored
            elif isinstance(msg, Reject):
                self.rejects.append(msg.reason)
            elif isinstance(msg, Welcome):
                self.welcomes.put_nowait(msg)

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._reader
        for task in (self._resender, self._sender):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        for _, fut in self._requests.values():
            fut.cancel()
        self._sock.close()
