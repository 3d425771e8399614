"""agentstream.weights without vLLM: the bucket layout, and buckets over real gloo groups between processes."""

from __future__ import annotations

import io
import multiprocessing as mp
import time

import pytest
import torch

from agentstream.weights import StreamLayout, host_store, open_group, receive_buckets, send_buckets


def test_buckets_are_cut_by_aligned_size_and_a_large_parameter_stands_alone():
    # float32 [10] = 40 B -> 64 aligned; float32 [100] = 400 B -> 448; bfloat16 [3, 5] = 30 B -> 64;
    # float32 [300] = 1200 B -> 1216 (larger than a bucket by itself); float16 [4] = 8 B -> 64.
    layout = StreamLayout(
        ["a", "b", "c", "d", "e"],
        ["float32", "float32", "bfloat16", "float32", "float16"],
        [[10], [100], [3, 5], [300], [4]],
        bucket_bytes=512,
    )
    # a + b = 512 fills the first bucket exactly; c (64) opens the second; d (1216) cannot join it, and is alone;
    # e (64) opens the fourth.
    assert layout.buckets() == [range(0, 2), range(2, 3), range(3, 4), range(4, 5)]
    assert [layout.bucket_size(b) for b in layout.buckets()] == [512, 64, 1216, 64]
    assert layout.total_bytes() == 40 + 400 + 30 + 1200 + 8


def test_of_casts_floating_dtypes_only_and_refuses_bad_layouts():
    layout = StreamLayout.of(
        [("w", torch.Size([2, 3]), torch.float32), ("steps", [4], torch.int64)], 1024, dtype="bfloat16"
    )
    assert layout.dtype_names == ["bfloat16", "int64"] and layout.shapes == [[2, 3], [4]]
    with pytest.raises(ValueError, match="one dtype and one shape per name"):
        StreamLayout(["a", "b"], ["float32"], [[1], [1]], 64)
    with pytest.raises(ValueError, match=r"wire dtypes \['complex64'\]"):
        StreamLayout(["a"], ["complex64"], [[1]], 64)
    with pytest.raises(ValueError, match="bucket_bytes must be positive"):
        StreamLayout(["a"], ["float32"], [[1]], 0)


def _receive(port: int, rank: int, world: int, layout: StreamLayout, out: mp.Queue, die_after: int) -> None:
    group = open_group("127.0.0.1", port, rank, world, "gloo", 30)
    got = {}
    for k, pairs in enumerate(receive_buckets(group, layout, torch.device("cpu"))):
        if k == die_after:
            import os

            os._exit(3)  # a worker that dies mid-update
        got.update({name: t.clone() for name, t in pairs})
    # As bytes: a queued tensor would travel as a shared-memory handle that dies with this process.
    buf = io.BytesIO()
    torch.save(got, buf)
    out.put((rank, buf.getvalue()))


def _stream(params: dict[str, torch.Tensor], layout: StreamLayout, receivers: int, die_after: int = -1):
    ctx = mp.get_context("spawn")
    world = 1 + receivers
    store = host_store("127.0.0.1", world, 30)
    out = ctx.Queue()
    procs = [
        ctx.Process(target=_receive, args=(store.port, r, world, layout, out, die_after if r == 1 else -1))
        for r in range(1, world)
    ]
    for p in procs:
        p.start()
    try:
        group = open_group("127.0.0.1", store.port, 0, world, "gloo", 30, store=store)
        sent = send_buckets(group, layout, iter(params.values()), torch.device("cpu"))
        got = dict(out.get(timeout=60) for _ in procs)
        return sent, {rank: torch.load(io.BytesIO(data)) for rank, data in got.items()}
    finally:
        for p in procs:
            p.join(timeout=30)


@pytest.mark.parametrize("seed", [0, 1])
def test_random_parameters_reach_every_worker_cast_to_the_wire_dtype(seed):
    gen = torch.Generator().manual_seed(seed)
    params = {}
    for i in range(int(torch.randint(3, 12, (1,), generator=gen))):
        shape = [int(s) for s in torch.randint(1, 90, (int(torch.randint(1, 3, (1,), generator=gen)),), generator=gen)]
        params[f"layers.{i}.w"] = torch.randn(shape, generator=gen)
    params["step"] = torch.arange(7)  # integers are not cast
    layout = StreamLayout.of([(n, t.shape, t.dtype) for n, t in params.items()], bucket_bytes=4096, dtype="bfloat16")
    assert len(layout.buckets()) > 1
    sent, got = _stream(params, layout, receivers=2)
    assert sent == sum(layout.bucket_size(b) for b in layout.buckets())
    for rank in (1, 2):
        assert list(got[rank]) == list(params)
        for name, t in params.items():
            want = t.to(torch.bfloat16) if t.is_floating_point() else t
            assert got[rank][name].dtype == want.dtype and torch.equal(got[rank][name], want), (rank, name)


def test_a_worker_that_dies_mid_update_fails_the_send_instead_of_hanging_it():
    params = {f"w{i}": torch.full((1000,), float(i)) for i in range(8)}
    layout = StreamLayout.of([(n, t.shape, t.dtype) for n, t in params.items()], bucket_bytes=4000)  # one per bucket
    t0 = time.monotonic()
    with pytest.raises(RuntimeError):
        _stream(params, layout, receivers=1, die_after=2)
    assert time.monotonic() - t0 < 25  # the peer's socket closed: no waiting for the 30 s timeout


def _join_and_report(port: int, out: mp.Queue) -> None:
    t0 = time.monotonic()
    try:
        open_group("127.0.0.1", port, 1, 3, "gloo", 60)
        out.put(("formed", time.monotonic() - t0))
    except RuntimeError as exc:
        out.put((str(exc), time.monotonic() - t0))


def test_a_group_a_member_never_joins_is_given_up_and_its_workers_fail_at_once():
    # world 3, but only worker 1 comes: the sender gives up after its 2 s and says so; the worker, whose own timeout
    # is 60 s, reads the "abort" at once instead of waiting for gloo's rendezvous.
    ctx = mp.get_context("spawn")
    store = host_store("127.0.0.1", 3, 2)
    out = ctx.Queue()
    p = ctx.Process(target=_join_and_report, args=(store.port, out))
    p.start()
    with pytest.raises(RuntimeError):
        open_group("127.0.0.1", store.port, 0, 3, "gloo", 2, store=store)
    what, seconds = out.get(timeout=30)
    p.join(10)
    assert "gave up on this weight group" in what and seconds < 30
