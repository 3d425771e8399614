"""Learner side of weight sync: rank 0 pushes full weights to every engine's weight sidecar.

    pub = WeightPublisher("tcp://127.0.0.1:5600")        # learner.weight_port; sidecars connect to it
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    pub.publish(version, state)                           # rank 0 only; returns at once
    pub.publish_stream(version, StreamSource(...))        # or: streamed (agentstream.weights), returns when sent
    pub.wait_for(version, n_engines=cfg.engines.count, timeout_s=120)
    pub.close()

Streamed (engines.weight_sync=stream): the sidecars of servers that take streamed weights say so
(`EngineStatus.workers`); the publisher forms a weight group with the engines that need the new version
(`WeightUpdate` "stream_join" to each, then its own end of `agentstream.weights.open_group`), keeps it while they
stay the same, tells each sidecar the layout ("stream") and broadcasts the buckets. A group that fails (an engine
died mid-update, or never joined) is dropped, and the next update forms a new one. An engine that registers
between updates gets the newest weights at once when one learner rank holds them all (`StreamSource.solo`),
otherwise at the next update (a pass over the parameters is a collective of every rank).

Transport: a ZeroMQ ROUTER here, one DEALER per weight sidecar (`engines.sidecar`, identity = engine name).
An sidecar registers by sending `EngineStatus` with the version its server runs, and acknowledges every
update with another `EngineStatus`. Updates are whole safetensors files (full weights, or with LoRA the
whole adapter: `publish_adapter`), so only the newest matters:
an sidecar that registers late, restarts, or was too slow to take the last one gets the newest version
as soon as it reports an older one. Synchronous code (the learner has no event loop); nothing here
blocks except `wait_for`.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from typing import Any

import torch
import zmq
from safetensors.torch import save

from agentstream.models import ADAPTER_CONFIG_KEY
from agentstream.weights import StreamSource, host_store, open_group, send_buckets
from agentstream.wire.addresses import advertised_host
from agentstream.wire.curve import CurveServer
from agentstream.wire.messages import EngineStatus, ProtocolError, WeightUpdate, decode, encode
from agentstream.wire.reconnect import take_over_reconnects

log = logging.getLogger(__name__)

# Per-sidecar send queue in messages: at most about two full weight sets wait in memory for a slow sidecar.
# A send that would exceed it is dropped; that sidecar gets the newest weights when it next reports.
_SEND_HWM = 4
_RETRY_AFTER_S = 30.0  # a failed stream is tried again between updates after this long
_SILENT_S = 5.0  # an engine silent this long (or 3 of its status intervals) is not asked into a weight group
_MAX_INBOUND_BYTES = 1 << 16  # what a sidecar sends (EngineStatus) is a few hundred bytes


def serialize_state_dict(state_dict: dict[str, torch.Tensor], dtype: torch.dtype | None = None) -> bytes:
    """A full state dict -> safetensors bytes (contiguous CPU tensors, HF key names kept).

    Tied weights: an HF model's state dict holds `lm_head.weight` as the very tensor of
    `model.embed_tokens.weight`. safetensors refuses shared memory, and the engine re-ties the head itself
    (`engines.worker_ext`), so an exact alias of an earlier key is left out, as `save_pretrained` does.
    A tensor that only partly overlaps another is copied instead.
    """
    out: dict[str, torch.Tensor] = {}
    seen: dict[tuple, str] = {}  # exact tensor identity -> first key
    storages: set[int] = set()
    for key, value in state_dict.items():
        t = value.detach()
        ident = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype, t.device)
        if ident in seen and t.numel() > 0:
            log.debug("%s is an alias of %s (tied weights): not sent", key, seen[ident])
            continue
        seen[ident] = key
        if dtype is not None and t.is_floating_point():
            t = t.to(dtype)
        t = t.cpu().contiguous()
        if t.untyped_storage().data_ptr() in storages and t.numel() > 0:
            t = t.clone()  # a view into a tensor already stored: safetensors needs its own memory
        storages.add(t.untyped_storage().data_ptr())
        out[key] = t
    return save(out)


def serialize_adapter(
    state_dict: dict[str, torch.Tensor], config: dict[str, Any], dtype: torch.dtype | None = None
) -> bytes:
    """A LoRA adapter -> one safetensors file: the tensors as peft's adapter_model.safetensors holds them
    (keys `base_model.model.<module>.lora_A.weight`), and adapter_config.json's text in the metadata, so
    that one payload is the whole adapter directory (`engines.control.write_adapter` unfolds it)."""
    if not state_dict or not all("lora_" in k for k in state_dict):
        raise ValueError(f"an adapter holds only lora_ tensors; got {sorted(state_dict)[:5]}")
    out = {k: (v.detach() if dtype is None else v.detach().to(dtype)).cpu().contiguous() for k, v in state_dict.items()}
    return save(out, metadata={"format": "pt", ADAPTER_CONFIG_KEY: json.dumps(config, sort_keys=True)})


class WeightPublisher:
    """Rank 0's end of the weight channel. Not thread-safe: call it from one thread."""

    def __init__(
        self,
        bind_address: str,
        dtype: torch.dtype | None = None,
        linger_ms: int = 1000,
        curve_keys_dir: str = "",
        epoch: int = 0,
    ):
        """Bind a ROUTER at `bind_address` (e.g. tcp://127.0.0.1:5600, or tcp://127.0.0.1:* for any free
        port; `self.address` says which). `dtype` casts floating tensors
        before sending (e.g. bfloat16 halves the bytes for a bf16 engine); None sends them as given.
        `curve_keys_dir` (broker.curve_keys_dir): only sidecars whose key is in its allowed/ connect."""
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.ROUTER)
        # CURVE with the run's allow-list; sidecars only ever send small statuses, so a larger
        # frame drops its sender before anything is buffered.
        self._curve = CurveServer(self._ctx, curve_keys_dir) if curve_keys_dir else None
        if self._curve is not None:
            self._curve.secure(self._sock)
        self._sock.setsockopt(zmq.MAXMSGSIZE, _MAX_INBOUND_BYTES)
        # Raise on a send to an identity that is not connected (instead of dropping it silently), so a
        # vanished sidecar is forgotten and re-registers when it comes back.
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._sock.setsockopt(zmq.SNDHWM, _SEND_HWM)
        self._sock.setsockopt(zmq.LINGER, linger_ms)
        take_over_reconnects(self._sock)  # a sidecar back from a partition replaces its old connection
        self._sock.bind(bind_address)
        # The address sidecars connect to: with port 0 or "*" in bind_address, the port the OS picked.
        self.address: str = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._dtype = dtype
        self._latest: tuple[int, bytes, str] | None = None  # (version, safetensors payload, WeightUpdate.format)
        self._acked: dict[str, int] = {}  # engine -> version its server runs (last EngineStatus; -1: another epoch)
        self.epoch = epoch  # sent with every update: sidecars running another learner process's weights take ours
        self._sent: dict[str, int] = {}  # engine -> newest version queued to it
        self._links: dict[str, int] = {}  # engine -> EngineStatus.link: its connection's number
        self._workers: dict[str, int] = {}  # engine -> EngineStatus.workers (> 0: it takes streamed weights)
        self._source: StreamSource | None = None  # the newest streamed version's parameters
        self._group: _Group | None = None  # the weight group formed last, while it works
        self._generation = 0  # number of the newest group
        self._failed_at = -float("inf")  # when a stream last failed
        self._stores: list[Any] = []  # the newest groups' TCPStores, kept so that their late workers read "abort"
        self._seen: dict[str, float] = {}  # engine -> when its last EngineStatus came
        self._gap: dict[str, float] = {}  # engine -> the time between its last two
        self.stream_host = advertised_host(bind_address.split("://")[-1].rsplit(":", 1)[0].strip("[]"))
        self._closed = False

    # ------------------------------------------------------------------------------------- public
    def publish(self, version: int, state_dict: dict[str, torch.Tensor]) -> None:
        """Serialise `state_dict` (full weights) once and send it as `version` to every registered sidecar."""
        self._publish(version, lambda: serialize_state_dict(state_dict, self._dtype), "safetensors")

    def publish_adapter(self, version: int, state_dict: dict[str, torch.Tensor], config: dict[str, Any]) -> None:
        """Send a LoRA adapter (peft key names, and its adapter_config.json content) as `version`."""
        self._publish(version, lambda: serialize_adapter(state_dict, config, self._dtype), "peft_adapter")

    def _publish(self, version: int, serialize: Any, fmt: str) -> None:
        if self._latest is not None and version <= self._latest[0]:
            raise ValueError(f"version {version} is not newer than the last published {self._latest[0]}")
        self._poll(0)  # take registrations that arrived since the last call
        t0 = time.perf_counter()
        payload = serialize()
        self._latest = (version, payload, fmt)
        for engine in list(self._acked):
            self._send_latest(engine)
        log.info(
            "published version %d (%.1f MB, %.2f s) to %s",
            version,
            len(payload) / 1e6,
            time.perf_counter() - t0,
            sorted(self._sent),
        )

    def publish_stream(self, version: int, source: StreamSource) -> None:
        """Stream `version` to every engine that takes streamed weights and does not run it; returns when the
        last bucket is sent. Without such an engine (or on a failure, which is logged: those engines get the
        weights again later) the source is still passed over unless `source.solo`, since on a sharded learner
        every rank gathers each parameter in step."""
        if self._latest is not None and version <= self._latest[0]:
            raise ValueError(f"version {version} is not newer than the last published {self._latest[0]}")
        self._poll(0)
        self._latest, self._source = (version, b"", "stream"), source
        files_only = sorted(e for e in self._acked if self._workers.get(e, 0) == 0)
        if files_only:
            log.warning(
                "engines %s take weights as files only (their sidecars run without --stream-workers): they get "
                "no streamed version; start them with the run's engines.weight_sync",
                files_only,
            )
        self._stream(version, source)

    def stream_pending(self) -> bool:
        """Whether an engine that takes streamed weights needs the newest streamed version (it (re)joined since):
        a learner of several ranks then streams it `stream_again`, all ranks together."""
        if self._closed or self._latest is None or self._latest[2] != "stream" or self._backing_off():
            return False
        self._poll(0)
        return bool(self._stream_targets(self._latest[0]))

    def _backing_off(self) -> bool:
        """After a failed stream, streams between updates wait a while (an engine that cannot join would otherwise
        hold the learner for a timeout every time it asks); the next update tries at once."""
        return time.monotonic() < self._failed_at + _RETRY_AFTER_S

    def stream_again(self, version: int, source: StreamSource) -> None:
        """Stream the newest version (`version`, the same weights) to the engines that need it."""
        if self._latest is None or version != self._latest[0]:
            raise ValueError(
                f"stream_again({version}): the newest version published is {self._latest[0] if self._latest else None}"
            )
        self._stream(version, source)

    def service(self) -> None:
        """Take the registrations that arrived (a restarted or joining sidecar) and send it the newest weights;
        call it while waiting for something else, so that a late sidecar never waits for the next publish
        (streamed weights: when the source is `solo`)."""
        if self._closed:
            return
        self._poll(0)
        if self._source is not None and self._source.solo and self._latest is not None and not self._backing_off():
            version = self._latest[0]
            if self._stream_targets(version):
                self._stream(version, self._source)

    def engine_versions(self) -> dict[str, int]:
        """The version each registered engine reported last (processes pending messages first)."""
        self._poll(0)
        return dict(self._acked)

    def wait_for(self, version: int, n_engines: int, timeout_s: float) -> dict[str, int]:
        """Block until `n_engines` engines run `version` or newer; returns every engine's version.

        Raises TimeoutError naming the versions seen when that does not happen within `timeout_s`.
        """
        deadline = time.monotonic() + timeout_s
        while True:
            done = sum(v >= version for v in self._acked.values())
            if done >= n_engines:
                return dict(self._acked)
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(
                    f"{done} of {n_engines} engines run version >= {version} after {timeout_s:.0f} s; "
                    f"versions seen: {dict(sorted(self._acked.items()))}. Check that every weight sidecar is "
                    f"running and connects to {self.address} (its log says why an update failed)."
                )
            self._poll(min(left, 1.0))
            self.service()  # a streamed version reaches an engine that (re)joined meanwhile (a solo source)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._sock.close()
            if self._curve is not None:
                self._curve.stop()

    def __enter__(self) -> WeightPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------------------------ internal
    def _poll(self, timeout_s: float) -> None:
        """Handle every message that is waiting; wait up to `timeout_s` for the first one."""
        timeout_ms = max(0, int(timeout_s * 1000))
        while self._sock.poll(timeout_ms, zmq.POLLIN):
            timeout_ms = 0  # after the first message, only take what is already there
            frames = self._sock.recv_multipart(copy=False)
            self._handle(frames[0].bytes.decode(errors="replace"), frames[1:])

    def _handle(self, engine: str, frames: list) -> None:
        try:
            msg = decode(frames, max_bytes=_MAX_INBOUND_BYTES)
        except ProtocolError as exc:
            log.warning("bad message from %r ignored: %s", engine, exc)
            return
        if not isinstance(msg, EngineStatus):
            log.warning("unexpected %s from %r ignored (weight sidecars send engine_status)", msg.kind, engine)
            return
        previous = self._acked.get(engine)
        # Weights of another learner process (before a restart from a checkpoint) count as none of ours.
        self._acked[engine] = msg.version if msg.epoch == self.epoch or msg.epoch == 0 and msg.version <= 0 else -1
        link, self._links[engine] = self._links.get(engine, 0), msg.link
        self._workers[engine] = msg.workers
        now = time.monotonic()
        self._gap[engine] = now - self._seen.get(engine, now)
        self._seen[engine] = now
        lost = False
        if previous is None or msg.version < previous:
            # New sidecar, or a restarted one (its version went back): whatever we sent it is gone.
            log.info("engine %r registered at version %d (%s)", engine, msg.version, msg.url)
            self._sent.pop(engine, None)
            lost = True
        elif link not in (0, msg.link):  # connected again (after a partition): what was queued went with the old one
            log.info("engine %r connected again at version %d: it gets the newest weights again", engine, msg.version)
            self._sent.pop(engine, None)
            lost = True
        if lost and self._group is not None and engine in self._group.members:
            self._group = None  # its workers left the group (or may have missed joining it)
        self._send_latest(engine)

    def _send_latest(self, engine: str) -> None:
        """Send the newest weights to `engine` unless it runs them or they are already on their way."""
        if self._latest is None:
            return
        version, payload, fmt = self._latest
        if fmt == "stream" or self._acked.get(engine, -1) >= version or self._sent.get(engine, -1) >= version:
            return  # streamed weights are sent by publish_stream and service, never from inside a poll
        if self._send(engine, WeightUpdate(version=version, payload=payload, format=fmt, epoch=self.epoch)):
            self._sent[engine] = version

    def _send(self, engine: str, msg: WeightUpdate) -> bool:
        """Queue `msg` to `engine`; False (logged) when it cannot take it now or is gone."""
        try:
            self._sock.send_multipart([engine.encode(), *encode(msg)], flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:
            log.warning(
                "engine %r is still taking earlier weights; it gets version %d when it reports", engine, msg.version
            )
            return False
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EHOSTUNREACH:
                raise
            log.warning("engine %r is not connected any more; forgotten until it registers again", engine)
            self._forget(engine)
            return False
        return True

    def _forget(self, engine: str) -> None:
        self._acked.pop(engine, None)
        self._sent.pop(engine, None)
        if self._group is not None and engine in self._group.members:
            self._group = None  # its workers are gone: the group cannot broadcast any more

    # --------------------------------------------------------------------------------- streamed weights
    def _stream_targets(self, version: int) -> dict[str, int]:
        """The engines that take streamed weights and neither run `version` nor were sent it -> their workers."""
        # An engine silent for a few heartbeats (its node died) is left out: a group waits for every member.
        now = time.monotonic()
        return {
            e: self._workers[e]
            for e, v in sorted(self._acked.items())
            if self._workers.get(e, 0) > 0
            and v < version
            and self._sent.get(e, -1) < version
            and now - self._seen.get(e, 0.0) < max(_SILENT_S, 3 * self._gap.get(e, 0.0))
        }

    def _stream(self, version: int, source: StreamSource) -> None:
        targets = self._stream_targets(version)
        tensors = (t for _, t in source.tensors()) if targets or not source.solo else iter(())
        t0 = time.perf_counter()
        try:
            if not targets:
                return
            group = self._join(targets, version, source)
            layout = json.dumps({**source.layout.as_dict(), "group": group.number}).encode()
            for engine in targets:
                if not self._send(
                    engine, WeightUpdate(version=version, payload=layout, format="stream", epoch=self.epoch)
                ):
                    raise RuntimeError(f"engine {engine!r} could not be told to take version {version}")
            sent = send_buckets(group.pg, source.layout, tensors, source.device)
            self._sent.update(dict.fromkeys(targets, version))
            log.info(
                "streamed version %d (%.1f MB, %.2f s) to group %d: %s",
                version,
                sent / 1e6,
                time.perf_counter() - t0,
                group.number,
                sorted(targets),
            )
        except (RuntimeError, ValueError, TimeoutError) as exc:  # torch's store and gloo errors are RuntimeErrors
            self._group, self._failed_at = None, time.monotonic()
            log.error(
                "streaming version %d to %s failed after %.1f s: %s; the next update forms a new weight group",
                version,
                sorted(targets),
                time.perf_counter() - t0,
                exc,
            )
        finally:
            if not source.solo:
                for _ in tensors:  # the other ranks gather every parameter: keep in step with them
                    pass

    def _join(self, members: dict[str, int], version: int, source: StreamSource) -> _Group:
        """The weight group of exactly `members` (engine -> workers): the current one, or a new one they join."""
        if self._group is not None and self._group.members == members:
            return self._group
        self._group = None
        self._generation += 1
        world = 1 + sum(members.values())
        store = host_store(self.stream_host, world, source.timeout_s)
        self._stores = [*self._stores[-3:], store]
        offset = 1
        for engine, workers in members.items():
            info = {
                "host": self.stream_host,
                "port": store.port,
                "rank_offset": offset,
                "world_size": world,
                "backend": source.backend,
                "timeout_s": source.timeout_s,
                "group": self._generation,
            }
            if not self._send(
                engine,
                WeightUpdate(
                    version=version, payload=json.dumps(info).encode(), format="stream_join", epoch=self.epoch
                ),
            ):
                raise RuntimeError(f"engine {engine!r} could not be asked to join weight group {self._generation}")
            offset += workers
        pg = open_group(self.stream_host, store.port, 0, world, source.backend, source.timeout_s, store=store)
        self._group = _Group(self._generation, dict(members), store, pg)
        log.info("weight group %d formed: %s (%d ranks, %s)", self._generation, sorted(members), world, source.backend)
        return self._group


@dataclass(frozen=True)
class _Group:
    """A formed weight group: its number, its engines (-> workers), and the sender's end."""

    number: int
    members: dict[str, int]
    store: Any  # the TCPStore the group met at: kept alive with it
    pg: Any  # torch.distributed.ProcessGroup
