"""Images through the broker over real ZeroMQ sockets: an actor's transitions carry images (lone and bundled, of
different sizes, some without), malformed image messages are refused and counted while the broker keeps serving,
the learner's Batch holds exactly the images sent, in order, and a broker restarted from its write-ahead log (its
events, or a snapshot of them) serves the same images. A few seconds."""

from pathlib import Path

import numpy as np
import pytest
import zmq.asyncio
from broker_testing import recv, start_broker
from e2e_testing import dealer

from agentstream.config import Config
from agentstream.wire import messages as P

MAX_IMAGE_BYTES = 4096
RNG = np.random.default_rng(0)
A = RNG.integers(0, 256, (2, 8, 8, 3), dtype=np.uint8)  # 384 bytes: 2 RGB images
B = RNG.integers(0, 256, (1, 5, 7, 1), dtype=np.uint8)  # 35 bytes: 1 grey image of another size
C = RNG.integers(0, 256, (3, 4, 4, 4), dtype=np.uint8)  # 192 bytes: 3 RGBA images
NONE = np.zeros((0, 0, 0, 0), np.uint8)


def config(run_dir: Path | None = None) -> Config:
    cfg = Config()
    cfg.env.group_size, cfg.trainer.groups_per_step, cfg.trainer.max_staleness, cfg.learner.world_size = 2, 1, 0, 1
    cfg.broker.max_image_bytes, cfg.broker.logger = MAX_IMAGE_BYTES, []
    if run_dir is not None:
        cfg.run.output_dir = str(run_dir)
    return cfg


def step(gid: int, traj: str, n: int, done: bool, images: np.ndarray, seq: int) -> P.Transition:
    return P.Transition(
        traj_id=traj,
        group_id=gid,
        actor="actor-0",
        step=n,
        prompt_ids=np.array([1, 2], np.int32),
        response_ids=np.array([3], np.int32),
        logprobs=np.array([-0.5], np.float32),
        version_lo=0,
        version_hi=0,
        reward=1.0,
        done=done,
        truncated=False,
        valid=True,
        images=images,
        seq=seq,
    )


async def play_group(actor: zmq.asyncio.Socket) -> None:
    """One group of 2 two-step trajectories, its 4 steps in 3 messages: t0/0 alone (A), t0/1 (B) and t1/0 (no
    images) bundled, t1/1 alone (C); returns once the broker acknowledged all 4 (seq 0..3: they are in its log)."""
    await actor.send_multipart(P.encode(P.GroupRequest(actor="actor-0")))
    grant = await recv(actor)
    assert isinstance(grant, P.GroupGrant)
    gid = grant.group_id
    for msg in (
        step(gid, "t0", 0, False, A, 0),
        P.Transitions.of([step(gid, "t0", 1, True, B, 1), step(gid, "t1", 0, False, NONE, 2)]),
        step(gid, "t1", 1, True, C, 3),
    ):
        await actor.send_multipart(P.encode(msg))
    acked = -1
    while acked < 3:
        ack = await recv(actor)
        assert isinstance(ack, P.Ack), ack
        acked = ack.upto


async def assert_batch_holds_the_images(address: str) -> None:
    """The learner's share of step 0: trajectories in order (t0, t1), steps in order, each with its images."""
    learner = dealer(address, "learner-0")
    try:
        await learner.send_multipart(P.encode(P.BatchRequest(step=0, rank=0, world_size=1)))
        batch = await recv(learner)
        assert isinstance(batch, P.Batch)
        assert batch.traj_index.tolist() == [0, 0, 1, 1] and batch.step_index.tolist() == [0, 1, 0, 1]
        assert batch.image_shapes.tolist() == [[2, 8, 8, 3], [1, 5, 7, 1], [0, 0, 0, 0], [3, 4, 4, 4]]
        assert batch.image_data.size == 384 + 35 + 192
        for i, want in enumerate([A, B, NONE, C]):
            got = batch.images_of(i)
            assert got.dtype == np.uint8 and got.shape == want.shape and np.array_equal(got, want), i
    finally:
        learner.close()


def bad_image_messages() -> dict[str, list]:
    """Malformed image messages, each under the reject code it must be counted by."""

    def frames(msg: P.Message) -> list:
        return [bytes(f) for f in P.encode(msg)]

    two_channels = frames(step(0, "x", 0, True, np.zeros((1, 4, 4, 2), np.uint8), -1))
    over = frames(step(0, "x", 0, True, np.zeros((1, 40, 40, 3), np.uint8), -1))  # 4,800 > 4,096 bytes
    floats = frames(step(0, "x", 0, True, A.astype(np.float32), -1))
    bundle = frames(P.Transitions.of([step(0, "x", 0, False, A, -1), step(0, "x", 1, True, B, -1)]))
    bundle[-2] = np.array([2, 8, 8, 3, 2, 5, 7, 1], np.int32).tobytes()  # 2 grey images claimed, 1 sent
    return {"out_of_range": two_channels, "too_long": over, "bad_dtype": floats, "inconsistent": bundle}


async def test_images_reach_the_learners_batch_and_bad_images_are_refused_and_counted() -> None:
    broker, task, address = await start_broker(config())
    actor, mallory = dealer(address, "actor-0"), dealer(address, "mallory")
    try:
        for code, frames in bad_image_messages().items():
            await mallory.send_multipart(frames)
            reply = await recv(mallory)
            assert isinstance(reply, P.Reject) and "image" in reply.reason, (code, reply)
        await play_group(actor)  # still serving
        await assert_batch_holds_the_images(address)
        s = broker.summary()
        assert s["messages_rejected"] == {
            "malformed": 4,
            "protocol_out_of_range": 1,
            "protocol_too_long": 1,
            "protocol_bad_dtype": 1,
            "protocol_inconsistent": 1,
        }
        assert (s["transitions_ingested"], s["transitions_trained"]) == (4, 4)
    finally:
        broker.stop()
        await task
        actor.close()
        mallory.close()


@pytest.mark.parametrize("snapshot", [False, True], ids=["events", "snapshot"])
async def test_a_restarted_broker_serves_the_same_images_from_its_log(tmp_path: Path, snapshot: bool) -> None:
    cfg = config(tmp_path)
    broker, task, address = await start_broker(cfg, tmp_path)
    actor = dealer(address, "actor-0")
    try:
        await play_group(actor)  # acknowledged: in the log, not yet served
        if snapshot:
            assert broker.state.maybe_compact(force=True)
    finally:
        broker.stop()
        await task
        actor.close()
    broker, task, address = await start_broker(cfg, tmp_path)
    try:
        assert broker.state.recovered_snapshot == snapshot
        await assert_batch_holds_the_images(address)
    finally:
        broker.stop()
        await task
