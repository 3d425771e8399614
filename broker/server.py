"""The broker process: one ZeroMQ ROUTER for every client, the replay buffer, stats, and the dashboard.

    python -m broker.server --config RUN/config.yaml --port 5555 --dashboard-port 8787

Actors send Hello, GroupRequest (answered by GroupGrant when admission allows), Transition and Stats;
learner ranks send BatchRequest (answered by their share of that step's global batch, when it exists) and
rank 0 sends VersionUpdate (with where it publishes weights: the Welcome passes it on to joiners and to
weight sidecars that ask again); weight sidecars send EngineStatus and Stats. A malformed or oversized message is
answered with Reject, counted under `malformed_messages`, and the broker keeps serving. SIGTERM stops it.

When its write-ahead log cannot be written (a full disk), the broker stalls instead of dying: it reads no
more messages and sends nothing (no Ack: actors wait under actors.max_unacked), shows status `stalled` with
the reason on the dashboard, `wal_failing` in /metrics and an error in its log, retries every second, and
goes on, losing nothing, once the disk takes the log's pending records.

Once listening, it writes where (RUN/broker.json): a broker started again, on another port or node, from the log in
the run folder, is found there by every client (`agentstream.wire.client.RecordLink`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import zmq
import zmq.asyncio
from aiohttp import web

from agentstream import config as config_mod
from agentstream.process import on_stop_signals, run_process
from agentstream.wire.addresses import BROKER_RECORD, advertised_host, write_record
from agentstream.wire.curve import CurveServer
from agentstream.wire.limits import check_limits
from agentstream.wire.messages import (
    Ack,
    BatchRequest,
    EngineStatus,
    GroupGrant,
    GroupRequest,
    Hello,
    Message,
    ProtocolError,
    Reject,
    Stats,
    Transition,
    Transitions,
    VersionUpdate,
    Welcome,
    copy_when_sending,
    decode,
    encode,
)
from agentstream.wire.reconnect import take_over_reconnects
from broker import dashboard, views
from broker.buffer import ReplayBuffer
from broker.gallery import Gallery
from broker.sinks import MetricsSink, flatten, open_sinks
from broker.sockets import recv_frames, send_frames
from broker.spec import BrokerSpec, broker_spec
from broker.state import BrokerState
from broker.stats import ACTOR_COUNTERS, StatsBook
from broker.wal import FOLDER as WAL_FOLDER
from broker.wal import WriteAheadLog

log = logging.getLogger("broker")
MAX_GROUPS_PER_REQUEST = 8  # a GroupRequest opens one group per seat of a game (self-play: 2); more is garbage


class Broker:
    """The hub's message handlers around its logged state; `serve()` runs it until `stop()`. Every change of
    the buffer goes through `self.state` (broker.state), which logs it."""

    def __init__(
        self, spec: BrokerSpec, port: int, dashboard_port: int, run_name: str = "", run_dir: Path | None = None
    ):
        self.spec, self.cfg = spec, spec.broker
        self.total_steps = spec.trainer.total_steps
        c, t = spec.broker, spec.trainer
        buffer = ReplayBuffer(
            group_size=spec.group_size,
            groups_per_step=t.groups_per_step,
            world_size=spec.world_size,
            max_staleness=t.max_staleness,
            max_buffered_transitions=c.max_buffered_transitions,
            seed_base=spec.seed_base,
            drop_zero_variance=spec.dynamic_sampling,
            retain_formed=spec.retain_formed,
            partial_groups=c.dead_actor_groups,
            min_partial=c.min_partial_group,
            track_keys=c.track_keys,
            max_samples_per_group=t.max_samples_per_group,
            samples_per_insert=t.samples_per_insert,
        )
        wal = WriteAheadLog(run_dir / WAL_FOLDER, fsync=c.wal_fsync) if c.wal and run_dir else None
        self.state = BrokerState(buffer, wal, compact_every=c.wal_compact_events)
        self.buffer = buffer  # read here; changed only through self.state
        self._acks: dict[bytes, Ack] = {}  # acknowledgements to send once the log is flushed
        self._dead: set[str] = set()  # peers declared dead by the heartbeat check
        self.stats = StatsBook()
        self.port, self.dashboard_port, self.run_name = port, dashboard_port, run_name
        self.started = time.time()
        self.status, self.reason = "starting", ""
        self._status_before_stall, self._stall_logged_at = "", time.monotonic()
        self.learner_metrics: dict[str, float] = {}
        # Where the learner publishes weights, for the Welcome: as the run started, until the learner says otherwise
        # (VersionUpdate.weights: a learner placed again on another node). A broker restarted from its log starts from
        # the run's config again and learns it with the learner's next report (each step's, or the one it resends).
        self.weights = spec.weights
        self.engines: dict[str, EngineStatus] = {}
        self.malformed: deque[str] = deque(maxlen=20)  # the latest reasons, for the dashboard and logs
        self.rejected: dict[str, int] = {}
        self._group_waiters: deque[tuple[bytes, GroupRequest]] = deque()
        self._batch_waiters: list[tuple[bytes, BatchRequest]] = []
        self._stop = asyncio.Event()
        self._engine_followers: set[bytes] = set()  # actors that joined later: told when the engine list grows
        self._sock: zmq.asyncio.Socket | None = None
        self._direct: zmq.Socket | None = None  # the same socket, for sends without asyncio (see `serve`)
        self._outbox: list[list] = []  # replies held until the receive loop's round ends (`_send`)
        self._holding = False
        self._curve: CurveServer | None = None
        self._reject_log_at, self._rejects_unlogged = 0.0, 0
        # once-a-second points for the dashboard's charts, and the sinks that log them (opened by serve())
        self.run_dir = run_dir
        self.history: deque[dict[str, float | None]] = deque(maxlen=max(1, self.cfg.dashboard_history_s))
        self.sinks: list[MetricsSink] = []
        self.gallery = Gallery(self.cfg.dashboard_images)  # the newest observation pictures, for the dashboard

    # ------------------------------------------------------------------ lifecycle
    async def serve(self) -> None:
        self.sinks = open_sinks(self.cfg, self.run_dir, self.run_name)
        self.state.recover()  # before anyone is answered: a restarted broker continues where it stopped
        ctx = zmq.asyncio.Context.instance()
        self._sock = ctx.socket(zmq.ROUTER)
        if self.cfg.curve_keys_dir:  # only clients whose key is in KEYS/allowed get through
            self._curve = CurveServer(ctx, self.cfg.curve_keys_dir, on_deny=lambda key: self._count_denied())
            self._curve.secure(self._sock)
        self._sock.setsockopt(zmq.SNDHWM, self.cfg.high_water_mark)
        self._sock.setsockopt(zmq.RCVHWM, self.cfg.high_water_mark)
        # A frame above 4x the limit makes ZeroMQ drop the peer before any byte is buffered (a memory
        # guard); anything between the limit and that is received, rejected and counted by `decode`.
        self._sock.setsockopt(zmq.MAXMSGSIZE, 4 * self.cfg.max_message_bytes)
        self._sock.setsockopt(zmq.LINGER, 1000)
        take_over_reconnects(self._sock)  # a client back from a partition replaces its old connection
        self._sock.bind(f"tcp://{self.cfg.host}:{self.port or '*'}")  # 0: any free port (a restart elsewhere)
        self.port = int(self._sock.getsockopt(zmq.LAST_ENDPOINT).decode().rsplit(":", 1)[1])
        # Replies go out through a plain (shadow) socket, without an asyncio future per message (measured by
        # bench/broker.py). A ROUTER never blocks on send: at the high-water mark, or to a peer that left,
        # ZeroMQ drops the message (its resend protocol covers that), so a non-blocking send always returns.
        self._direct = zmq.Socket.shadow(self._sock.underlying)
        app = dashboard.make_app(
            self.snapshot,
            history_fn=lambda: list(self.history),
            history_s=self.cfg.dashboard_history_s,
            gallery=self.gallery,
        )
        app.router.add_get("/api/summary", self._summary_handler)
        runner = await dashboard.serve(app, self.cfg.dashboard_host, self.dashboard_port)
        self.dashboard_port = self.dashboard_port or int(runner.addresses[0][1])
        if self.run_dir is not None:  # where the clients find this broker (agentstream.wire.client.RecordLink)
            write_record(
                self.run_dir / BROKER_RECORD,
                address=f"tcp://{advertised_host(self.cfg.host)}:{self.port}",
                dashboard=f"http://{advertised_host(self.cfg.dashboard_host)}:{self.dashboard_port}",
            )
        self.status = "running"
        log.info(
            "broker on tcp://%s:%d (%s), dashboard http://%s:%d/",
            self.cfg.host,
            self.port,
            "CURVE" if self._curve else "no CURVE",
            self.cfg.dashboard_host,
            self.dashboard_port,
        )
        try:
            async with asyncio.TaskGroup() as tg:
                tg.create_task(self._receive_loop())
                tg.create_task(self._sample_loop())
                tg.create_task(self._liveness_loop())
                await self._stop.wait()
                raise _Stopped
        except* _Stopped:
            pass
        finally:
            self._close_sinks()  # the final point first
            await runner.cleanup()
            self._sock.close()
            if self._curve is not None:
                self._curve.stop()
            if self.state.wal is not None:
                self.state.wal.close()

    def stop(self) -> None:
        self._stop.set()

    async def _liveness_loop(self) -> None:
        """Heartbeats: an actor or engine silent for broker.heartbeat_timeout_s is declared dead. A dead
        actor's unfinished groups are settled by the configured rule; a dead engine stops counting for
        admission (actors move to the others) until it reports again."""
        while True:
            await asyncio.sleep(1.0)
            if self._wal_failing():  # the broker reads nothing meanwhile: silence says nothing of the peers
                continue
            now, changed = time.time(), False
            for peer in list(self.stats.peers.values()):
                if peer.final or peer.name in self._dead or now - peer.last_seen < self.cfg.heartbeat_timeout_s:
                    continue
                if peer.role == "actor":
                    self._dead.add(peer.name)
                    settled = self.state.drop_owner(peer.name, "actor_silent")
                    log.warning(
                        "%s silent for %.0fs: declared dead, %d unfinished groups settled",
                        peer.name,
                        now - peer.last_seen,
                        settled,
                    )
                    changed = True
                elif peer.role == "engine" and peer.name in self.buffer.engine_versions:
                    self._dead.add(peer.name)
                    self.state.engine_gone(peer.name)
                    log.warning(
                        "%s silent for %.0fs: declared dead, admission no longer waits for it",
                        peer.name,
                        now - peer.last_seen,
                    )
                    changed = True
            if changed:
                await self._serve_batches()
            self.state.maybe_compact()

    async def _sample_loop(self) -> None:
        while True:
            self._sample()
            await asyncio.sleep(1.0)

    async def _receive_loop(self) -> None:
        assert self._sock is not None
        # What already arrived is read through a plain (shadow) socket without blocking (bench/broker.py): ~9 us CPU
        # per message instead of ~42 us for an asyncio future per poll and per read.
        drain = zmq.Socket.shadow(self._sock.underlying)
        while True:
            if self._wal_failing():
                await self._wait_for_wal()
                continue
            # ZeroMQ signals its file descriptor on edges, and a send on the shadow socket (`_flush_outbox`) can
            # take the edge of a message that arrived meanwhile: ask the socket itself first, and never wait
            # on the descriptor longer than 50 ms (a bench run stalled for minutes without both).
            if not drain.get(zmq.EVENTS) & zmq.POLLIN:
                await self._sock.poll(50, zmq.POLLIN)
            # Take what already arrived, then flush the log once and send every reply (acknowledgements
            # together, one per client) at the end.
            self._holding = True
            try:
                for _ in range(256):
                    try:
                        frames = recv_frames(drain)
                    except zmq.Again:
                        break
                    await self._receive(frames)
                await self._flush_acks()
            finally:
                self._holding = False
                self._flush_outbox()

    async def _receive(self, frames: list) -> None:
        ident, body = frames[0].bytes, frames[1:]
        try:
            msg = check_limits(decode(body, max_bytes=self.cfg.max_message_bytes), self.spec.limits)
        except ProtocolError as exc:
            self._reject_input(ident, exc)
            await self._send(ident, Reject(reason=str(exc)))
            return
        try:
            await self.handle(ident, msg, body)
        except (ValueError, TypeError, KeyError, IndexError, AttributeError, ArithmeticError) as exc:
            # Input the checks let through must still never take the hub down; the traceback
            # is logged (a bug to fix), the message counted, and the broker keeps serving.
            log.exception("handling %s from %r failed", msg.kind, ident[:64])
            self._reject_input(ident, ProtocolError(f"{msg.kind} could not be handled: {exc!r}", "handler_error"))

    def _reject_input(self, ident: bytes, exc: ProtocolError) -> None:
        """Count a refused message under `protocol_<code>`; log at most one line a second (a flood of garbage
        must not become a flood of log lines)."""
        self.state.count_refused()
        key = f"protocol_{exc.code}"
        self.rejected[key] = self.rejected.get(key, 0) + 1
        self.malformed.append(f"{ident[:64].decode(errors='replace')}: {str(exc)[:500]}")
        now = time.monotonic()
        if now - self._reject_log_at < 1.0:
            self._rejects_unlogged += 1
            return
        log.warning(
            "rejected a message from %r: %s (and %d more since the last such line)",
            ident[:64],
            str(exc)[:500],
            self._rejects_unlogged,
        )
        self._reject_log_at, self._rejects_unlogged = now, 0

    def _count_denied(self) -> None:
        """A CURVE handshake with a key not in the allow-list (AllowList logs the key once)."""
        self.rejected["curve_denied"] = self.rejected.get("curve_denied", 0) + 1

    async def _flush_acks(self) -> None:
        acks, self._acks = self._acks, {}
        for ident, ack in acks.items():
            await self._send(ident, ack)  # the log is flushed before any of them leaves

    def _count_malformed(self, ident: bytes, reason: str) -> None:
        self.state.count_refused()
        self.malformed.append(f"{ident.decode(errors='replace')}: {reason}")
        log.warning("rejected a message from %r: %s", ident, reason)

    async def _send(self, ident: bytes, msg: Message) -> None:
        """Send `msg` to `ident`: at once, or (while the receive loop handles what arrived) with the others at
        the end of that round, after a single flush of the log."""
        self._outbox.append([ident, *encode(msg)])
        if not self._holding:
            self._flush_outbox()

    def _flush_outbox(self) -> None:
        if not self._outbox or not self._log_flushed():  # nothing leaves that depends on what the log lacks
            return
        out, self._outbox = self._outbox, []
        for frames in out:
            try:
                send_frames(self._direct, frames, copy=copy_when_sending(frames))  # small: copied
            except zmq.ZMQError as exc:  # not expected of a ROUTER; the peer's resend covers a lost reply
                log.warning("a reply to %r was not sent: %r", frames[0][:64], exc)

    def _log_flushed(self) -> bool:
        """Flush the write-ahead log; False while it cannot be written (the log's `error` says why)."""
        if self.state.wal is None:
            return True
        try:
            self.state.wal.flush()
        except OSError:
            return False
        return True

    def _wal_failing(self) -> bool:
        return self.state.wal is not None and self.state.wal.error is not None

    async def _wait_for_wal(self) -> None:
        """One second of a stall on an unwritable log (a full disk): say why, then try to write it again. Nothing
        is read meanwhile (actors back off under actors.max_unacked; ZeroMQ queues up to its high-water mark)
        and nothing is sent; once the log takes its pending records, the replies that waited go out."""
        wal = self.state.wal
        assert wal is not None and wal.error is not None
        if self.status != "stalled":
            self._status_before_stall, self.status = self.status, "stalled"
        self.reason = (
            f"the write-ahead log in {wal.folder} cannot be written ({wal.error.strerror or wal.error}): "
            f"nothing is acknowledged until it can; {wal.pending_bytes} bytes wait in memory"
        )
        if time.monotonic() - self._stall_logged_at >= 30:
            self._stall_logged_at = time.monotonic()  # the log said it when it began (broker.wal), then every 30 s
            log.error("stalled: %s", self.reason)
        await asyncio.sleep(1.0)
        if self._log_flushed():
            self.status, self.reason = self._status_before_stall, ""
            now = time.time()
            for peer in self.stats.peers.values():  # unread while stalled: their messages are only now read
                peer.last_seen = max(peer.last_seen, now)
            log.warning("the write-ahead log takes records again: acknowledging again")
            self._flush_outbox()

    # ------------------------------------------------------------------ handlers
    async def handle(self, ident: bytes, msg: Message, frames: list | None = None) -> None:
        """Act on one checked message (`frames`: as received, for the log)."""
        handler = self._handlers.get(type(msg))
        if handler is None:
            self._count_malformed(ident, f"{msg.kind} is not a message the broker accepts")
            await self._send(ident, Reject(reason=f"the broker does not accept {msg.kind} messages"))
            return
        await handler(self, ident, msg, frames)

    async def _on_transitions(self, ident: bytes, msg: Transition | Transitions, frames: list | None) -> None:
        # The log keeps the frames as received (written from the received buffers, not copied first).
        raw = (
            None
            if self.state.wal is None
            else ([f.buffer for f in frames] if frames else [bytes(f) for f in encode(msg)])
        )
        if isinstance(msg, Transition):
            ts, results, pictures = [msg], [self.state.ingest(msg, raw)], msg.images.size
        else:
            ts = msg.split()
            results, pictures = self.state.ingest_many(ts, raw), msg.image_shapes.size
        if pictures:  # the dashboard's gallery (a text run stops here)
            self.gallery.keep(ts, [res.outcome for res in results])
        completed, ack = False, None
        for res in results:
            if res.ack is not None:
                ack = res.ack
            completed |= res.outcome == "completed"
            if res.outcome == "rejected":
                reason = res.detail.split(":", 1)[0]
                self.rejected[reason] = self.rejected.get(reason, 0) + 1
                self._count_malformed(ident, f"transition rejected ({res.detail})")
        if ack is not None:
            self._acks[ident] = Ack(actor=msg.actor, incarnation=msg.incarnation, upto=ack)
        if completed:
            await self._serve_batches()

    async def _on_group_request(self, ident: bytes, msg: GroupRequest, _frames: list | None) -> None:
        if not 1 <= msg.groups <= MAX_GROUPS_PER_REQUEST:
            self._count_malformed(ident, f"group request for {msg.groups} groups")
            await self._send(
                ident,
                Reject(
                    reason=f"a group request opens 1 to {MAX_GROUPS_PER_REQUEST} groups "
                    f"(one per seat of a game), not {msg.groups}"
                ),
            )
            return
        known = self.state.grants.get(ident.decode(errors="replace"))
        if msg.request >= 0 and known is not None and known[0] == msg.incarnation and msg.request in known[1]:
            gid, seed, min_version = known[1][msg.request]  # a resent request: the grant it already got
            await self._send(ident, GroupGrant(group_id=gid, seed=seed, min_version=min_version, request=msg.request))
            return
        if not any(i == ident and r.request == msg.request >= 0 for i, r in self._group_waiters):
            self._group_waiters.append((ident, msg))  # (a resent request already waiting is not queued twice)
        await self._admit()

    async def _on_stats(self, ident: bytes, msg: Stats, _frames: list | None) -> None:
        self.stats.report(msg.source, msg.role, msg.counters, msg.gauges, msg.final)
        self._dead.discard(msg.source)
        if msg.final and msg.role == "actor":  # an actor that left will not finish its groups
            self._engine_followers.discard(ident)
            if self.state.drop_owner(msg.source, reason="actor_left"):
                await self._serve_batches()
        elif msg.final and msg.role == "engine" and msg.source in self.buffer.engine_versions:
            # Its sidecar stopped: admission no longer waits for it and joiners are not sent to it (it counts
            # again once it reports recent weights, as a restarted engine does).
            self.state.engine_gone(msg.source)
            await self._admit()

    async def _on_batch_request(self, ident: bytes, req: BatchRequest, _frames: list | None) -> None:
        if req.world_size != self.buffer.world_size or not 0 <= req.rank < req.world_size:
            reason = (
                f"rank {req.rank} of world {req.world_size} does not match the broker's "
                f"learner.world_size={self.buffer.world_size}"
            )
            await self._send(ident, Reject(reason=reason, step=req.step))
            return
        b = self.buffer
        if req.step > b.next_step and b.next_step == 0 and not b.formed:
            self.state.resume(req.step)  # a fresh broker and a learner resuming from its checkpoint
        self._batch_waiters = [(i, r) for i, r in self._batch_waiters if (r.step, r.rank) != (req.step, req.rank)]
        self._batch_waiters.append((ident, req))  # a resent request replaces the one it repeats
        await self._serve_batches()

    async def _on_version(self, _ident: bytes, msg: VersionUpdate, _frames: list | None) -> None:
        if msg.weights and msg.weights != self.weights:
            log.warning(
                "the learner publishes weights at %s now (was %s): joining launches and the sidecars that "
                "ask are told so",
                msg.weights,
                self.weights or "unknown",
            )
            self.weights = msg.weights
        if self.state.version(msg.version, msg.resumed, msg.checkpointed):
            self.state.maybe_compact(force=True)  # the learner checkpointed: what it consumed is safe
        if msg.resumed:
            log.warning("the learner resumed from its checkpoint at version %d", msg.version)
            await self._serve_batches()
        metrics = {k: float(v) for k, v in msg.metrics.items() if isinstance(v, (int, float))}
        if "mismatch_logp_abs_mean" not in metrics:  # measured only when the batch held tokens of the learner's
            # version (rare at a staleness bound > 0): the last measurement stays, with its mismatch_version
            metrics |= {
                k: v for k, v in self.learner_metrics.items() if k.startswith("mismatch_") and k != "mismatch_tokens"
            }
        self.learner_metrics = metrics
        if msg.version >= self.total_steps:
            self.status = "finished"  # the dashboard keeps showing the final state
        await self._admit()

    async def _on_engine_status(self, _ident: bytes, msg: EngineStatus, _frames: list | None) -> None:
        self.engines[msg.engine] = msg
        if await self._count_engine(msg):  # a late joiner counts once it serves recent weights
            self.state.engine_serving(msg.engine, msg.version)
        if msg.engine not in self.stats.peers:  # status may come before Hello
            self.stats.hello(msg.engine, "engine", 0, 0, msg.url)
        self.stats.peers[msg.engine].last_seen = time.time()
        await self._admit()

    async def _on_hello(self, ident: bytes, msg: Hello, _frames: list | None) -> None:
        self._dead.discard(msg.name)
        if msg.role == "actor" and self.state.observe(msg.name, msg.incarnation) == "new":
            await self._serve_batches()  # the old incarnation's groups were settled: room to admit
        self.stats.hello(msg.name, msg.role, msg.incarnation, msg.pid, msg.address)
        if msg.want_welcome:  # a process joining the run learns engines, weights, config
            await self._send(ident, self.welcome())
            if msg.role == "actor":
                self._engine_followers.add(ident)

    _handlers: dict[type, Callable[..., Awaitable[None]]] = {
        Transition: _on_transitions,
        Transitions: _on_transitions,
        GroupRequest: _on_group_request,
        Stats: _on_stats,
        BatchRequest: _on_batch_request,
        VersionUpdate: _on_version,
        EngineStatus: _on_engine_status,
        Hello: _on_hello,
    }
    """Message kind -> its handler; any other kind is refused (a weight update, a batch: not the broker's)."""

    # ------------------------------------------------------------------ processes joining a running run
    def welcome(self) -> Welcome:
        """What a joining process needs: usable engines, the learner's weight address, the run config."""
        return Welcome(
            engines=[e.url for name, e in sorted(self.engines.items()) if name in self.buffer.engine_versions],
            weights=self.weights,
            dashboard=f"http://{advertised_host(self.cfg.dashboard_host)}:{self.dashboard_port}/",
            learner_version=self.buffer.learner_version,
            config=self.spec.run_config,
        )

    async def _count_engine(self, msg: EngineStatus) -> bool:
        """Whether admission may rely on this engine's version. An engine that joins a run already past
        version 0 with older weights is left out (else admission would wait on it, and the learner that would
        bring it up to date waits for a batch) until the learner's next publish reaches it; then the actors
        that follow the engine list are told about it."""
        b = self.buffer
        if msg.engine in b.engine_versions and msg.version >= b.engine_versions[msg.engine]:
            return True
        if msg.engine in b.engine_versions:  # its version went back: a restarted server, a joiner again
            self.state.engine_gone(msg.engine)
            log.warning(
                "%s is back at version %d: admission does not wait for it until it catches up", msg.engine, msg.version
            )
        if b.learner_version > 0 and msg.version < b.learner_version - b.max_staleness:
            log.info(
                "%s joined at version %d (learner at %d): not used until it catches up",
                msg.engine,
                msg.version,
                b.learner_version,
            )
            return False
        if self._engine_followers:
            self.state.engine_serving(msg.engine, msg.version)  # before the Welcome, so that it lists this engine
            welcome = self.welcome()
            for ident in list(self._engine_followers):
                try:
                    await self._send(ident, welcome)
                except zmq.ZMQError:  # gone without saying so: it follows nothing any more
                    self._engine_followers.discard(ident)
        return True

    async def _admit(self) -> None:
        while self._group_waiters and self.buffer.admissible():
            ident, req = self._group_waiters.popleft()
            grant = self.state.admit(ident.decode(errors="replace"), req.incarnation, req.request, req.groups)
            if grant is not None:  # None: the request of an actor incarnation that was replaced
                await self._send(ident, grant)

    async def _serve_batches(self) -> None:
        waiting, self._batch_waiters = self._batch_waiters, []
        for ident, req in sorted(waiting, key=lambda w: w[1].step):
            if req.step not in self.buffer.formed:
                self.state.try_form(req.step)
            try:
                share = self.state.share(req.step, req.rank)
            except ValueError as exc:
                await self._send(ident, Reject(reason=str(exc), step=req.step))
                continue
            if share is None:
                self._batch_waiters.append((ident, req))
            else:
                await self._send(ident, share)
        await self._admit()  # serving frees buffer room

    # ------------------------------------------------------------------ views
    def _totals(self) -> dict[str, float]:
        totals = self.stats.role_totals("actor", ACTOR_COUNTERS)
        totals.update({k: float(v) for k, v in self.buffer.counts.items()})
        totals.update(self.stats.env_totals())
        totals["learner_version"] = float(self.buffer.learner_version)
        return totals

    def _sample(self) -> None:
        """Once a second: totals for the windowed rates, then one point for the charts and the sinks."""
        self.stats.sample(self._totals())
        point = flatten(views.dashboard_state(self.view()))
        self.history.append(point)
        for sink in list(self.sinks):
            try:
                sink.write(point)
            except (OSError, ValueError) as exc:  # a full disk must not stop the run: that sink stops
                log.error("metrics sink %s failed, no more points go to it: %r", type(sink).__name__, exc)
                self.sinks.remove(sink)

    def _close_sinks(self) -> None:
        if self.sinks:
            self._sample()  # the final state, so that the logs end where the run ended
        for sink in self.sinks:
            try:
                sink.close()
            except (OSError, RuntimeError, ValueError) as exc:  # best-effort: the run's result does not hang on it
                log.warning("closing metrics sink %s: %r", type(sink).__name__, exc)
        self.sinks = []

    async def _summary_handler(self, _request: web.Request) -> web.Response:
        return web.json_response(self.summary())

    def view(self) -> views.BrokerView:
        """What the views read, now."""
        return views.BrokerView(
            run_name=self.run_name,
            status=self.status,
            reason=self.reason,
            started=self.started,
            total_steps=self.total_steps,
            buffer=self.buffer,
            stats=self.stats,
            engines=self.engines,
            rejected=self.rejected,
            learner_metrics=self.learner_metrics,
            group_waiters=len(self._group_waiters),
            audit=self.state.audit,
            dead=frozenset(self._dead),
            wal=self._wal_stats(),
        )

    def _wal_stats(self) -> dict[str, float]:
        wal = self.state.wal
        if wal is None:
            return {}
        now_stalled = time.monotonic() - wal.failing_since if wal.failing_since is not None else 0.0
        return {
            "wal_failing": float(wal.error is not None),
            "wal_stalled_s": wal.stalled_s + now_stalled,
            "wal_pending_bytes": float(wal.pending_bytes),
            "wal_write_errors": float(wal.write_errors),
        }

    def summary(self) -> dict[str, Any]:
        """What the launcher writes to summary.json (`broker.views.summary`)."""
        return views.summary(self.view())

    def snapshot(self) -> dict[str, Any]:
        """The dashboard's state (schema in broker/dashboard.py), with the last few points for its charts and the
        observation pictures kept."""
        return {
            **views.dashboard_state(self.view()),
            "recent": list(self.history)[-5:],
            "images": self.gallery.entries(),
        }


class _Stopped(Exception):
    pass


async def _main(args: argparse.Namespace) -> None:
    run_dir = Path(args.config).parent
    cfg = config_mod.load(args.config)
    if args.host:  # started again on another node: that node's interface
        cfg.broker.host = cfg.broker.dashboard_host = args.host
    broker = Broker(broker_spec(cfg), args.port, args.dashboard_port, run_name=run_dir.name, run_dir=run_dir)
    on_stop_signals(broker.stop)
    await broker.serve()
    if args.summary:
        Path(args.summary).write_text(json.dumps(broker.summary(), indent=2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="run config written by the launcher")
    parser.add_argument("--port", type=int, required=True, help="ZeroMQ ROUTER port (0: any free one)")
    parser.add_argument("--dashboard-port", type=int, required=True, help="dashboard HTTP port (0: any free one)")
    parser.add_argument(
        "--host",
        default="",
        help="interface to bind both on (default: broker.host and "
        "broker.dashboard_host; a broker moved to another node binds that node's)",
    )
    parser.add_argument("--summary", default="", help="write the final summary JSON here on exit")
    args = parser.parse_args()
    run_process("broker", log, lambda: _main(args))


if __name__ == "__main__":
    main()
