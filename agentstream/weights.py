"""Streamed weight sync, both ends: parameters in buckets over a torch.distributed group from the learner's
sending rank (rank 0 of the group, `learner.publish`) to every engine worker (ranks 1..W, `engines.worker_ext`),
never through a file. The bucket format and the group live here, in the ground, because both ends use them.

    layout = StreamLayout.of([(name, tensor) ...], dtype="bfloat16", bucket_bytes=256 << 20)
    # learner rank 0                                   # each engine worker (engines.worker_ext)
    group = open_group(host, port, 0, world, "gloo")   group = open_group(host, port, rank, world, "gloo")
    send_buckets(group, layout, tensors)               for pairs in receive_buckets(group, layout, device):
                                                           model.load_weights(pairs)

`backend` is "gloo" on CPU and "nccl" on GPUs: the same code path. The group is torch's own ProcessGroupGloo /
ProcessGroupNCCL over a TCPStore that the sender hosts; it never touches either side's default group (the
learner's FSDP group, vLLM's own). A bucket is one flat byte buffer: the parameters of `layout.buckets()[i]`
cast to the engine's dtype, each at a 64-byte aligned offset. One bucket is in flight while the next is
packed (the sender's two buffers alternate: it never holds more than two buckets beyond the one parameter
being gathered) or loaded (workers). Imports no vLLM (the learner runs without it) and nothing of the project but
the ground's registry (`agentstream.registry`).
"""

from __future__ import annotations

import datetime
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from agentstream.registry import lookup, unknown_name

WIRE_DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "int64": torch.int64,
    "int32": torch.int32,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
_ALIGN = 64  # bytes: every tensor in a bucket starts at a multiple of it, so its view has the dtype's alignment


def _aligned(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


@dataclass(frozen=True)
class StreamLayout:
    """What one update sends, in order: names, wire dtype names and full shapes, and the bucket size. Both ends
    compute the same buckets from it, so only this (a few KB of JSON) travels ahead of the bytes."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    bucket_bytes: int

    def __post_init__(self) -> None:
        if not len(self.names) == len(self.dtype_names) == len(self.shapes):
            raise ValueError(
                f"a layout needs one dtype and one shape per name: {len(self.names)} names, "
                f"{len(self.dtype_names)} dtypes, {len(self.shapes)} shapes"
            )
        unknown = sorted(set(self.dtype_names) - WIRE_DTYPES.keys())
        if unknown:  # every unknown one at once, not only the first a lookup would meet
            raise ValueError(unknown_name("wire dtypes", unknown, WIRE_DTYPES))
        if self.bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes must be positive, got {self.bucket_bytes}")

    @classmethod
    def of(
        cls,
        params: Iterable[tuple[str, torch.Size | list[int], torch.dtype | str]],
        bucket_bytes: int,
        dtype: str | None = None,
    ) -> StreamLayout:
        """From (name, shape, dtype) triples; `dtype` (a WIRE_DTYPES name) replaces every floating dtype."""
        names: list[str] = []
        dtypes: list[str] = []
        shapes: list[list[int]] = []
        for name, shape, dt in params:
            dt_name = dt if isinstance(dt, str) else str(dt).removeprefix("torch.")
            names.append(name)
            if dtype is not None and lookup(WIRE_DTYPES, dt_name, "wire dtype").is_floating_point:
                dt_name = dtype
            dtypes.append(dt_name)
            shapes.append([int(s) for s in shape])
        return cls(names, dtypes, shapes, bucket_bytes)

    def nbytes(self, i: int) -> int:
        n = 1
        for s in self.shapes[i]:
            n *= s
        return n * WIRE_DTYPES[self.dtype_names[i]].itemsize

    def buckets(self) -> list[range]:
        """Consecutive parameter ranges, each at most `bucket_bytes` (aligned), except a lone parameter that is
        larger by itself."""
        out: list[range] = []
        start, used = 0, 0
        for i in range(len(self.names)):
            size = _aligned(self.nbytes(i))
            if used and used + size > self.bucket_bytes:
                out.append(range(start, i))
                start, used = i, 0
            used += size
        if start < len(self.names):
            out.append(range(start, len(self.names)))
        return out

    def bucket_size(self, bucket: range) -> int:
        return sum(_aligned(self.nbytes(i)) for i in bucket)

    def total_bytes(self) -> int:
        return sum(self.nbytes(i) for i in range(len(self.names)))

    def as_dict(self) -> dict:
        return {
            "names": self.names,
            "dtype_names": self.dtype_names,
            "shapes": self.shapes,
            "bucket_bytes": self.bucket_bytes,
        }


@dataclass(frozen=True)
class StreamSource:
    """What the learner's sending rank streams: the layout, and a fresh pass over its full parameters each
    call (gathered one by one, in layout order). `solo`: one learner rank holds the whole model, so it can
    stream again by itself (to an engine that (re)joins between updates); with more ranks every pass is a
    collective that all of them must join, so a pass happens only at an update."""

    layout: StreamLayout
    tensors: Callable[[], Iterator[tuple[str, torch.Tensor]]]
    device: torch.device
    solo: bool
    timeout_s: float = 300.0

    @property
    def backend(self) -> str:
        return "nccl" if self.device.type == "cuda" else "gloo"


def open_group(
    host: str, port: int, rank: int, world: int, backend: str, timeout_s: float, store: dist.Store | None = None
) -> dist.ProcessGroup:
    """Join (rank > 0) or host (rank 0, passing the `store` it made with `host_store`) the sync group.

    A worker says it is here (key joined/RANK) and waits for the sender's decision: "go" once every worker is
    here, "abort" when one did not come within `timeout_s` (the sender forms another group). So a worker of an
    abandoned group fails at once instead of waiting out gloo's own rendezvous. Raises RuntimeError (torch's
    store errors are RuntimeErrors) on "abort" or a timeout."""
    timeout = datetime.timedelta(seconds=timeout_s)
    if store is None:
        store = dist.TCPStore(host, port, world, is_master=False, timeout=timeout)
        store.set(f"joined/{rank}", "1")
        store.wait(["decision"], timeout)
        if store.get("decision") != b"go":
            raise RuntimeError(
                "the learner gave up on this weight group (a member did not join in time); "
                "it forms a new one at its next update"
            )
    else:
        try:
            store.wait([f"joined/{r}" for r in range(1, world)], timeout)
        except RuntimeError:
            store.set("decision", "abort")
            raise
        store.set("decision", "go")
    prefixed = dist.PrefixStore("agentstream-weights", store)
    if backend == "gloo":
        opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # there at runtime; torch's stub lacks it
        opts._timeout = timeout
        # Gloo's default device is the interface of this machine's host name; the group's own host keeps the
        # traffic where the run's addresses say (loopback in a one-host run).
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
        # A c10d Backend, used as a ProcessGroup: it has broadcast, which torch's stub lists only on ProcessGroup.
        return dist.ProcessGroupGloo(prefixed, rank, world, opts)  # type: ignore[return-value]
    if backend == "nccl":
        from torch.distributed import ProcessGroupNCCL  # absent from CPU builds of torch

        opts = ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return ProcessGroupNCCL(prefixed, rank, world, opts)  # type: ignore[return-value]  # as gloo's above
    raise ValueError(f"weight sync backend {backend!r}: use gloo (CPU) or nccl (GPU)")


def host_store(host: str, world: int, timeout_s: float) -> dist.TCPStore:
    """The sender's TCPStore on a free port of `host` (`store.port` says which); workers connect to it. Keep it
    alive a while after giving up on its group: its workers read the "abort" there."""
    return dist.TCPStore(
        host, 0, world, is_master=True, timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False
    )


def _pack(buffer: torch.Tensor, layout: StreamLayout, bucket: range, tensors: Iterator[torch.Tensor]) -> None:
    offset = 0
    for i in bucket:
        t = next(tensors)
        if list(t.shape) != layout.shapes[i]:
            raise ValueError(f"{layout.names[i]}: shape {list(t.shape)} differs from the layout's {layout.shapes[i]}")
        n = layout.nbytes(i)
        view = buffer[offset : offset + n].view(WIRE_DTYPES[layout.dtype_names[i]]).view(t.shape)
        view.copy_(t)  # casts to the wire dtype, and moves to the buffer's device
        offset += _aligned(n)


def _unpack(buffer: torch.Tensor, layout: StreamLayout, bucket: range) -> list[tuple[str, torch.Tensor]]:
    out, offset = [], 0
    for i in bucket:
        n = layout.nbytes(i)
        out.append(
            (
                layout.names[i],
                buffer[offset : offset + n].view(WIRE_DTYPES[layout.dtype_names[i]]).view(layout.shapes[i]),
            )
        )
        offset += _aligned(n)
    return out


def send_buckets(
    group: dist.ProcessGroup | None, layout: StreamLayout, tensors: Iterable[torch.Tensor], device: torch.device
) -> int:
    """Pack `tensors` (full parameters, in layout order) into buckets and broadcast each from rank 0.

    With `group` None nothing is sent, but `tensors` is still drained: on a sharded learner every rank
    gathers each parameter in step with the others (a collective), whether or not this rank sends.
    Returns the bytes broadcast."""
    it = iter(tensors)
    if group is None:
        for _ in it:
            pass
        return 0
    buckets = layout.buckets()
    largest = max((layout.bucket_size(b) for b in buckets), default=0)
    buffers: list[torch.Tensor] = []  # two at most, the second made only for a second bucket
    pending, sent = None, 0
    try:
        for k, bucket in enumerate(buckets):
            if len(buffers) <= k % 2:
                buffers.append(torch.empty(largest, dtype=torch.uint8, device=device))
            buffer = buffers[k % 2]
            _pack(buffer, layout, bucket, it)  # overlaps the previous bucket's broadcast
            if pending is not None:
                pending.wait()
            size = layout.bucket_size(bucket)
            pending = group.broadcast([buffer[:size]], dist.BroadcastOptions())
            sent += size
        if pending is not None:
            pending.wait()
    finally:
        for _ in it:  # a failed send still takes part in the rest of the gather (see above)
            pass
    return sent


def receive_buckets(
    group: dist.ProcessGroup, layout: StreamLayout, device: torch.device
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """The workers' end of `send_buckets`: yields each bucket's (name, tensor) pairs, views into a buffer of
    that bucket's own. Not reused: vLLM's layer-wise reload keeps the tensors of a layer until the layer is
    complete (a layer can span buckets), so a buffer lives as long as something holds a view of it."""
    buckets = layout.buckets()
    opts = dist.BroadcastOptions()

    def start(k: int) -> tuple[torch.Tensor, dist.Work]:
        buffer = torch.empty(layout.bucket_size(buckets[k]), dtype=torch.uint8, device=device)
        return buffer, group.broadcast([buffer], opts)

    pending = start(0) if buckets else None
    for k, bucket in enumerate(buckets):
        assert pending is not None  # start(k) ran for every bucket k: before the loop or in the step before
        buffer, work = pending
        work.wait()
        pending = start(k + 1) if k + 1 < len(buckets) else None  # the next bucket arrives while this one loads
        yield _unpack(buffer, layout, bucket)
