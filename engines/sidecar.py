"""The weight sidecar: runs beside one vLLM server and swaps the learner's new weights into it.

    python -m engines.sidecar --name engine-0 --url http://127.0.0.1:8000 \\
        --learner tcp://127.0.0.1:5600 --broker tcp://127.0.0.1:5555 [--workdir DIR] [--stats-interval 1.0]
        [--curve-keys KEYS]    # CURVE to learner and broker with KEYS/client.* (agentstream.wire.curve)
        [--frozen-every N]     # LoRA: also serve a frozen copy, refreshed every N versions (a frozen seat)

What it does:
  1. waits for the server's /health, labels the server's weights version "0";
  2. registers with the learner's `WeightPublisher` (a DEALER with identity = --name, sending
     `EngineStatus`) and with the broker (`Hello`, `EngineStatus`);
  3. for each `WeightUpdate`: writes the safetensors bytes to WORKDIR/v{version}/model.safetensors (a LoRA
     adapter, format "peft_adapter": a peft adapter directory), then on the running server: pause (keep:
     in-flight requests are frozen, not dropped) -> reload through `engines.worker_ext` (an adapter:
     /v1/load_lora_adapter in place, under `agentstream.models.LORA_ADAPTER_NAME`) -> label the new version
     -> reset the prefix cache (and the encoder and multimodal caches) -> resume; reports the new
     version to learner and broker and deletes older weight folders. Updates that queue up behind a
     running one are skipped in favour of the newest (each holds full weights);
     with --frozen-every N (a frozen seat, engines.frozen_every), the first adapter applied in each block of N
     versions is also loaded, in the same pause, under `agentstream.models.FROZEN_ADAPTER_NAME` from a folder of
     its own (WORKDIR/frozen, kept until the next refresh: vLLM may read it again while it serves that name);
     with --stream-workers (engines.weight_sync=stream) the weights come over the learner's weight group
     instead: "stream_join" has the server's workers join it (/init_weight_transfer_engine), "stream" takes a
     version from its broadcast (pause keep -> /start_weight_update -> /update_weights ->
     /finish_weight_update -> label -> reset prefix cache -> resume); nothing is written, nothing skipped;
  4. every --stats-interval: `Stats` to the broker, an `EngineStatus` heartbeat to the learner (so a
     restarted learner finds its engines again), and a /health check of the server;
  5. follows the learner when it is placed again elsewhere: given its record (--learner RUN/learner.json, the main
     launch's sidecars), to the address the record names, read every interval; given a plain address (a launch that
     joined the run), to the one the broker's Welcome names (the learner tells the broker where it publishes), which
     it asks for (Hello) once the connection has been down --learner-lost-s or silent --learner-silent-s, and again as
     often while that lasts. A new connection gets the newest weights; `learner_moves_followed` counts the moves.

Exit status: 0 after SIGTERM/SIGINT (a running update is finished first; the last Stats carry
final=True); 1 if the server died or an update failed (the error says which step). After a failed
update the server is left paused on purpose: resuming half-loaded weights under the old version label
would hand actors wrong tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import shutil
import tempfile
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from agentstream.models import FROZEN_ADAPTER_NAME
from agentstream.process import on_stop_signals, run_process
from agentstream.wire.client import AsyncClient, RecordLink, follow_address, follow_record
from agentstream.wire.curve import load_client_keys, secure_client
from agentstream.wire.limits import Limits, check_limits
from agentstream.wire.messages import EngineStatus, Hello, ProtocolError, Stats, WeightUpdate, decode, encode
from agentstream.wire.reconnect import keep_alive
from engines.control import (
    FROZEN_FOLDER,
    ApplyError,
    ServerControl,
    ServerDied,
    frozen_due,
    prune_weight_dirs,
    write_adapter,
    write_weights,
)
from engines.server import ServerNotReady, wait_ready

log = logging.getLogger("engines.sidecar")

STREAM_FORMATS = ("stream_join", "stream")  # WeightUpdate formats of the streamed weight sync


class _Stop(Exception):
    """Raised inside the sidecar's task group to end it after SIGTERM."""


@dataclass
class SidecarSpec:
    """Command-line options of the sidecar."""

    name: str
    url: str
    learner: str
    broker: str
    workdir: str | None = None
    stats_interval: float = 1.0
    ready_timeout_s: float = 240.0
    apply_timeout_s: float = 600.0
    dead_after_s: float = 30.0
    initial_version: int = 0  # -1: the server's weights are unknown (a server started elsewhere)
    curve_keys_dir: str = ""  # broker.curve_keys_dir (CURVE to learner and broker); "": none
    max_weight_bytes: int = 32 << 30  # a bigger frame from the learner drops the connection
    stream_workers: int = 0  # the server's workers that join the learner's weight group (0: files only)
    frozen_every: int = 0  # adapters: refresh the frozen copy (FROZEN_ADAPTER_NAME) every this many versions; 0: none
    learner_lost_s: float = 5.0  # a plain `learner` address: ask the broker where the learner is after this long
    # without a connection to it (and again every as long while that lasts)
    learner_silent_s: float = 60.0  # ... or after this long connected without a message from it


def learner_lost(now: float, up: bool, since: float, asked_at: float, lost_s: float, silent_s: float) -> bool:
    """Whether a sidecar given the learner's address (no record to read) asks the broker where the learner is: once
    the connection has been down for `lost_s` (`since`: when it went down, or was made to a new address), or up without
    a message from the learner for `silent_s` (`since`: its last message); then again every as long while that lasts
    (`asked_at`: when it last asked). Monotonic seconds."""
    return now - max(since, asked_at) >= (silent_s if up else lost_s)


# ---------------------------------------------------------------------------------- the sidecar
class WeightSidecar:
    """One sidecar for one server; `await WeightSidecar(spec).run()` returns the exit status."""

    def __init__(self, spec: SidecarSpec):
        self.spec = spec
        self.version = spec.initial_version  # version the server runs now (-1: unknown until the first update)
        self.epoch = 0  # WeightUpdate.epoch of the running weights (0: the server's initial weights)
        self.updates = 0  # updates applied
        self.skipped = 0  # updates superseded by a newer one before they were applied
        self.last_sync_s = 0.0  # seconds the last update took, file write to resume
        # The frozen copy's version (spec.frozen_every > 0): the server's initial weights (the base model; no adapter
        # under FROZEN_ADAPTER_NAME yet) until the first refresh.
        self.frozen_version = spec.initial_version
        self._own_workdir = spec.workdir is None
        self.workdir = Path(spec.workdir or tempfile.mkdtemp(prefix=f"agentstream-{spec.name}-"))
        self._pending: WeightUpdate | None = None  # newest file update not applied yet
        self._stream: deque[WeightUpdate] = deque()  # stream_join/stream messages: each taken, in order
        self.group = 0  # the learner's weight group the server's workers are in (0: none)
        self._wake = asyncio.Event()
        self._apply_lock = asyncio.Lock()  # held while an update is applied; shutdown waits for it
        self._learner: zmq.asyncio.Socket | None = None
        self._learner_link: RecordLink | None = None
        self._learner_events: zmq.asyncio.Socket | None = None  # its monitor: each time the connection is made or lost
        self.link = 0  # times the connection to the learner was made (EngineStatus.link)
        self.learner_moves = 0  # times the learner was followed to another address (its record, or the broker's word)
        self._learner_up = False  # connected to the learner now (its socket's monitor says)
        self._learner_since = time.monotonic()  # when the connection went down (or was started); up: the last message
        self._asked_at = -float("inf")  # when the broker was last asked where the learner is
        self._broker: AsyncClient | None = None
        self._server: ServerControl | None = None

    async def run(self) -> int:
        stop = asyncio.Event()
        on_stop_signals(stop.set)
        status = 0
        async with aiohttp.ClientSession() as session:
            self._server = ServerControl(self.spec.url, session, self.spec.apply_timeout_s)
            try:
                async with asyncio.TaskGroup() as tg:
                    tg.create_task(self._stop_on(stop))
                    await self._start()
                    tg.create_task(self._receive())
                    tg.create_task(self._watch_link())
                    tg.create_task(self._apply_loop())
                    tg.create_task(self._report_loop())
            except* _Stop:
                log.info("stopping at version %d after %d updates", self.version, self.updates)
            except* (ApplyError, ServerDied, ServerNotReady) as group:
                for exc in group.exceptions:
                    log.error("%s", exc)
                status = 1
            finally:
                await self._close()
        return status

    async def _start(self) -> None:
        """Wait for the server, label it version 0, register with learner and broker."""
        assert self._server is not None
        log.info("waiting for the vLLM server at %s", self.spec.url)
        await wait_ready(self.spec.url, self.spec.ready_timeout_s)
        await self._server.set_version(self.version)
        ctx = zmq.asyncio.Context.instance()
        self._learner = ctx.socket(zmq.DEALER)
        self._learner.setsockopt(zmq.IDENTITY, self.spec.name.encode())
        self._learner.setsockopt(zmq.RCVHWM, 4)  # full weight sets: the newest is all that matters
        self._learner.setsockopt(zmq.SNDHWM, 16)  # statuses only; see _to_learner
        self._learner.setsockopt(zmq.LINGER, 1000)
        self._learner.setsockopt(zmq.MAXMSGSIZE, self.spec.max_weight_bytes)
        keep_alive(self._learner)
        self._learner_events = self._learner.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)
        if self.spec.curve_keys_dir:
            secure_client(self._learner, load_client_keys(self.spec.curve_keys_dir))
        self._learner_link = RecordLink(self.spec.learner, key="weights")  # followed in _follow_learner
        self._learner.connect(self._learner_link.address)
        self._learner_since = time.monotonic()  # (not connected yet: `_follow_learner` counts from here)
        self._broker = AsyncClient(self.spec.broker, name=self.spec.name, curve_keys_dir=self.spec.curve_keys_dir)
        await self._broker.start()
        await self._broker.send(Hello(role="engine", name=self.spec.name, address=self.spec.url, pid=os.getpid()))
        await self._send_status()
        log.info("ready at version %d; learner %s, broker %s", self.version, self.spec.learner, self.spec.broker)

    async def _stop_on(self, stop: asyncio.Event) -> None:
        await stop.wait()
        async with self._apply_lock:  # let a running update finish: never leave the server paused
            raise _Stop()

    async def _receive(self) -> None:
        """Learner socket -> the pending slot (only the newest update is kept)."""
        assert self._learner is not None
        while True:
            frames = await self._learner.recv_multipart(copy=False)
            self._learner_since = time.monotonic()  # the learner is there (`_follow_learner`)
            try:
                msg = check_limits(decode(frames, max_bytes=self.spec.max_weight_bytes), Limits())
            except ProtocolError as exc:
                log.warning("bad message from the learner ignored: %s", exc)
                continue
            if not isinstance(msg, WeightUpdate):
                log.warning("unexpected %s from the learner ignored", msg.kind)
                continue
            if msg.format in STREAM_FORMATS:
                # Never skipped: the learner's broadcast waits for this server's workers to take it.
                self._stream.append(msg)
                self._wake.set()
            else:
                self.offer(msg)

    async def _watch_link(self) -> None:
        """Count the connections made to the learner and say so at once: after a partition (or a learner that
        came back), the updates queued on the old connection are lost, and the new `link` number asks for the
        newest weights again (learner.publish.WeightPublisher). Whether the learner's current address is connected
        now is kept for `_follow_learner`."""
        assert self._learner_events is not None and self._learner_link is not None
        while True:
            event = parse_monitor_message(await self._learner_events.recv_multipart())
            current = event["endpoint"].decode(errors="replace") == self._learner_link.address  # not one left behind
            if event["event"] == zmq.EVENT_DISCONNECTED:
                if current and self._learner_up:
                    self._learner_up, self._learner_since = False, time.monotonic()
                    log.info("lost the connection to the learner at %s", self._learner_link.address)
                continue
            if current:
                self._learner_up, self._learner_since = True, time.monotonic()
            self.link += 1
            if self.link > 1:
                log.info("connected to the learner again (connection %d)", self.link)
            await self._to_learner(self._status())

    def offer(self, update: WeightUpdate) -> None:
        """Keep `update` as the one to apply next unless something at least as new is here already."""
        newest = self._pending.version if self._pending is not None else self.version
        epoch = self._pending.epoch if self._pending is not None else self.epoch
        if update.epoch == epoch and update.version <= newest:
            log.info("version %d ignored: %d is already here", update.version, newest)
            return
        if update.epoch != epoch:  # a restarted learner: its checkpoint's weights replace whatever runs here
            log.info(
                "version %d from a new learner process (epoch %d): replaces version %d",
                update.version,
                update.epoch,
                newest,
            )
        if self._pending is not None:
            self.skipped += 1
            log.info("version %d skipped: %d arrived before it was applied", self._pending.version, update.version)
        self._pending = update
        self._wake.set()

    async def _apply_loop(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._stream or self._pending is not None:
                async with self._apply_lock:
                    if self._stream:
                        await self._take_stream(self._stream.popleft())
                    else:
                        update, self._pending = self._pending, None
                        await self._apply(update)

    async def _take_stream(self, msg: WeightUpdate) -> None:
        """Join the learner's weight group, or take a version from its broadcast (`agentstream.weights`)."""
        assert self._server is not None
        try:
            info = json.loads(msg.payload)
            group = int(info.pop("group"))
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            log.warning("%s message without a readable JSON payload ignored (%r)", msg.format, exc)
            return
        if msg.format == "stream_join":
            if any(m.format == "stream_join" for m in self._stream):
                log.info("weight group %d skipped: the learner asked for a newer one since", group)
                return
            try:
                await self._server.join(info)
                self.group = group
                log.info("joined the learner's weight group %d (%s)", group, info)
            except ApplyError as exc:
                log.warning("could not join the learner's weight group %d: %s", group, exc)
            await self._send_status()
            return
        if group != self.group:
            log.error(
                "version %d is streamed to group %d; this server's workers are in group %s: not taken",
                msg.version,
                group,
                self.group or "none",
            )
            return
        t0 = time.perf_counter()
        try:
            await self._server.stream(info, msg.version)
        except ApplyError as exc:
            # Paused it stays: its workers may hold part of the new weights. Version -1 takes it out of admission
            # (the broker) and asks the learner for the weights again.
            log.error("streamed update to version %d failed: %s; paused until the next update", msg.version, exc)
            self.version = -1
            await self._send_status()
            return
        self.version, self.epoch = msg.version, msg.epoch
        self.updates += 1
        self.last_sync_s = time.perf_counter() - t0
        await self._send_status()
        log.info("now at version %d (streamed in group %d, %.3f s)", self.version, group, self.last_sync_s)

    async def _apply(self, update: WeightUpdate) -> None:
        assert self._server is not None
        t0 = time.perf_counter()
        writers = {"safetensors": write_weights, "peft_adapter": write_adapter}
        if update.format not in writers:
            raise ApplyError(
                f"update to version {update.version} has format {update.format!r}; this sidecar "
                f"knows {sorted(writers)} (are learner and sidecar the same agentstream version?)"
            )
        folder = await asyncio.to_thread(writers[update.format], self.workdir, update.version, update.payload)
        lora = update.format == "peft_adapter"
        frozen = None
        if lora and frozen_due(update.version, self.frozen_version, self.spec.frozen_every):
            frozen = await asyncio.to_thread(write_adapter, self.workdir, update.version, update.payload, FROZEN_FOLDER)
        try:
            reports = await self._server.apply(folder, update.version, lora=lora, frozen_dir=frozen)
        except ApplyError as exc:
            raise ApplyError(
                f"update to version {update.version} failed: {exc}. The server is left as it is (paused if the "
                f"pause went through), so that no token comes from half-loaded weights"
            ) from None
        self.version, self.epoch = update.version, update.epoch
        if frozen is not None:
            self.frozen_version = update.version
            log.info("the frozen copy (%s) is now version %d", FROZEN_ADAPTER_NAME, update.version)
        self.updates += 1
        self.last_sync_s = time.perf_counter() - t0
        await self._send_status()
        await asyncio.to_thread(prune_weight_dirs, self.workdir, folder)
        log.info(
            "now at version %d (%.1f MB in %.3f s; workers: %s)",
            self.version,
            len(update.payload) / 1e6,
            self.last_sync_s,
            reports,
        )

    async def _report_loop(self) -> None:
        """Stats to the broker, heartbeat to the learner (followed to where its record says), and the server's health,
        every interval."""
        assert self._server is not None and self._learner is not None and self._learner_link is not None
        last_ok = time.monotonic()
        while True:
            await asyncio.sleep(self.spec.stats_interval)
            await self._follow_learner()  # a learner placed on another node
            await self._send_stats(final=False)
            await self._send_status()  # also the broker's heartbeat: a restarted broker learns the version again
            if await self._server.healthy():
                last_ok = time.monotonic()
            elif time.monotonic() - last_ok > self.spec.dead_after_s:
                raise ServerDied(
                    f"the vLLM server at {self.spec.url} has not answered /health for {self.spec.dead_after_s:.0f} s; "
                    f"see its log for why it died"
                )

    async def _follow_learner(self) -> None:
        """Reconnect to the learner where it is now. Given its record: where the record names (the launch that runs
        the learner rewrites it). Given a plain address: where the broker's Welcome names (the learner tells the
        broker), asked for once the connection has been down, or silent, for long enough (`learner_lost`)."""
        assert self._learner is not None and self._learner_link is not None and self._broker is not None
        link = self._learner_link
        if link.record:
            moved = follow_record(self._learner, link, self.spec.name)
        else:
            welcome = None
            while not self._broker.welcomes.empty():  # the newest answer says it all
                welcome = self._broker.welcomes.get_nowait()
            moved = welcome is not None and follow_address(
                self._learner, link, welcome.weights, self.spec.name, "by the broker"
            )
            now = time.monotonic()
            if not moved and learner_lost(
                now,
                self._learner_up,
                self._learner_since,
                self._asked_at,
                self.spec.learner_lost_s,
                self.spec.learner_silent_s,
            ):
                self._asked_at = now
                await self._broker.send(
                    Hello(role="engine", name=self.spec.name, address=self.spec.url, pid=os.getpid(), want_welcome=True)
                )
        if moved:  # the new connection, once made, asks for the newest weights (`_watch_link`)
            self.learner_moves += 1
            self._learner_up, self._learner_since = False, time.monotonic()

    def _status(self) -> EngineStatus:
        return EngineStatus(
            engine=self.spec.name,
            url=self.spec.url,
            version=self.version,
            epoch=self.epoch,
            link=self.link,
            workers=self.spec.stream_workers,
            group=self.group,
        )

    async def _send_status(self) -> None:
        assert self._broker is not None
        await self._to_learner(self._status())
        await self._broker.send(self._status())

    async def _to_learner(self, msg: EngineStatus) -> None:
        """Never block on the learner: while it is away (restarting, or done) statuses are dropped, and
        the next heartbeat tells it where we are."""
        assert self._learner is not None
        try:
            await self._learner.send_multipart(encode(msg), flags=zmq.NOBLOCK)
        except zmq.Again:
            log.debug("learner not taking messages; status dropped")

    async def _send_stats(self, final: bool) -> None:
        if self._broker is None:
            return
        requests = await self._server.requests_in_flight() if self._server is not None and not final else 0
        await self._broker.send(
            Stats(
                source=self.spec.name,
                role="engine",
                final=final,
                counters={
                    "weight_updates": self.updates,
                    "weight_updates_skipped": self.skipped,
                    "learner_moves_followed": self.learner_moves,
                },
                gauges={
                    "version": self.version,
                    "weight_sync_s": self.last_sync_s,
                    "requests_in_flight": requests,
                    **({"frozen_version": self.frozen_version} if self.spec.frozen_every else {}),
                },
            )
        )

    async def _close(self) -> None:
        """Final stats, then sockets in reverse order of opening; a temporary workdir is removed."""
        try:
            await asyncio.wait_for(self._send_stats(final=True), timeout=2.0)  # a vanished broker must not hang us
        except (zmq.ZMQError, asyncio.TimeoutError) as exc:
            log.warning("final stats not sent: %r", exc)
        if self._broker is not None:
            await self._broker.close()
        if self._learner is not None:
            self._learner.disable_monitor()
            if self._learner_events is not None:
                self._learner_events.close()
            self._learner.close()
        if self._own_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)


# ---------------------------------------------------------------------------------- command line
def parse_args(argv: list[str] | None = None) -> SidecarSpec:
    p = argparse.ArgumentParser(prog="python -m engines.sidecar", description=__doc__.split("\n")[0])
    p.add_argument("--name", required=True, help="engine name (ZeroMQ identity, stats source)")
    p.add_argument("--url", required=True, help="the vLLM server, e.g. http://127.0.0.1:8000")
    p.add_argument(
        "--learner",
        required=True,
        help="the learner's weight ROUTER, e.g. tcp://127.0.0.1:5600, or its record (RUN/learner.json: followed)",
    )
    p.add_argument(
        "--broker",
        required=True,
        help="the broker's ROUTER, e.g. tcp://127.0.0.1:5555, or its record (RUN/broker.json: followed)",
    )
    p.add_argument("--workdir", default=None, help="where weights are written (default: a temporary folder)")
    p.add_argument("--stats-interval", type=float, default=1.0, help="seconds between Stats reports")
    p.add_argument("--ready-timeout", type=float, default=240.0, help="seconds to wait for the server at start")
    p.add_argument("--apply-timeout", type=float, default=600.0, help="seconds one server call may take")
    p.add_argument(
        "--dead-after",
        type=float,
        default=30.0,
        help="seconds without /health before giving up (a loaded CPU machine can stall a live server ~10 s)",
    )
    p.add_argument(
        "--initial-version",
        type=int,
        default=0,
        choices=(0, -1),
        help="0: the server runs the model's own weights; -1: unknown (a server started elsewhere): "
        "no group is admitted on it until the learner's first weights arrive",
    )
    p.add_argument("--curve-keys", default="", help="key folder (broker.curve_keys_dir): CURVE to learner and broker")
    p.add_argument(
        "--max-weight-bytes",
        type=int,
        default=32 << 30,
        help="largest weight update accepted from the learner (a larger one drops the connection)",
    )
    p.add_argument(
        "--stream-workers",
        type=int,
        default=0,
        help="the server's workers (its tensor-parallel size) that take streamed weights: the server "
        "runs with --weight-transfer-config for engines.worker_ext's backend; 0: files only",
    )
    p.add_argument(
        "--frozen-every",
        type=int,
        default=0,
        help="LoRA adapters: also load the first adapter of every block of this many versions under "
        "the frozen copy's name (engines.frozen_every, for a frozen seat); 0: no frozen copy",
    )
    p.add_argument(
        "--learner-lost-s",
        type=float,
        default=5.0,
        help="a plain --learner address: ask the broker where the learner is after this many seconds "
        "without a connection to it (a learner placed again elsewhere), and again as often",
    )
    p.add_argument(
        "--learner-silent-s",
        type=float,
        default=60.0,
        help="... or after this many seconds connected to it without a message from it",
    )
    a = p.parse_args(argv)
    return SidecarSpec(
        a.name,
        a.url,
        a.learner,
        a.broker,
        a.workdir,
        a.stats_interval,
        a.ready_timeout,
        a.apply_timeout,
        a.dead_after,
        a.initial_version,
        curve_keys_dir=a.curve_keys,
        max_weight_bytes=a.max_weight_bytes,
        stream_workers=a.stream_workers,
        frozen_every=a.frozen_every,
        learner_lost_s=a.learner_lost_s,
        learner_silent_s=a.learner_silent_s,
    )


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    run_process(
        args.name,
        log,
        lambda: WeightSidecar(args).run(),
        log_format=f"%(asctime)s %(levelname)s {args.name} sidecar: %(message)s",
    )


if __name__ == "__main__":
    main()
