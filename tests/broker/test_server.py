"""The broker process's message handling over real ZeroMQ sockets: admission, assembly, serving,
and bad input (malformed or oversized messages are rejected, counted, and the broker keeps serving)."""

import asyncio

import numpy as np
import pytest
import zmq
import zmq.asyncio
from broker_testing import recv, start_broker
from e2e_testing import dealer

from agentstream.config import Config
from agentstream.wire import messages as P


def small_config() -> Config:
    cfg = Config()
    cfg.env.group_size = 2
    cfg.trainer.groups_per_step = 1
    cfg.trainer.max_staleness = 0
    cfg.learner.world_size = 1
    cfg.broker.max_message_bytes = 4096
    return cfg


def step(gid: int, traj: str, done: bool) -> P.Transition:
    return P.Transition(
        traj_id=traj,
        group_id=gid,
        actor="a",
        step=0,
        prompt_ids=np.array([1, 2], np.int32),
        response_ids=np.array([3], np.int32),
        logprobs=np.array([-0.5], np.float32),
        version_lo=0,
        version_hi=0,
        reward=1.0,
        done=done,
        truncated=False,
        valid=True,
    )


async def test_group_is_admitted_assembled_and_served() -> None:
    broker, task, address = await start_broker(small_config())
    actor, learner = dealer(address, "actor-0"), dealer(address, "learner-0")
    try:
        await actor.send_multipart(P.encode(P.EngineStatus(engine="e", url="u", version=0)))
        await actor.send_multipart(P.encode(P.GroupRequest(actor="actor-0")))
        grant = await recv(actor)
        assert isinstance(grant, P.GroupGrant) and grant.min_version == 0
        await actor.send_multipart(P.encode(P.GroupRequest(actor="actor-0")))  # bound 0: waits for version 1
        await learner.send_multipart(P.encode(P.BatchRequest(step=0, rank=0, world_size=1)))
        for traj in ("t0", "t1"):
            await actor.send_multipart(P.encode(step(grant.group_id, traj, done=True)))
        batch = await recv(learner)
        assert isinstance(batch, P.Batch) and batch.step == 0 and batch.traj_index.tolist() == [0, 1]
        assert batch.prompt_ids.tolist() == [1, 2, 1, 2] and batch.response_ids.tolist() == [3, 3]
        assert not await actor.poll(200)  # the second group is not admitted before version 1
        await learner.send_multipart(P.encode(P.VersionUpdate(version=1)))
        await actor.send_multipart(P.encode(P.EngineStatus(engine="e", url="u", version=1)))
        grant2 = await recv(actor)
        assert isinstance(grant2, P.GroupGrant) and grant2.min_version == 1
        s = broker.summary()
        assert (s["transitions_ingested"], s["transitions_trained"], s["groups_trained"]) == (2, 2, 1)
    finally:
        broker.stop()
        await task
        actor.close()
        learner.close()


async def test_a_group_request_opens_one_to_eight_groups() -> None:
    broker, task, address = await start_broker(small_config())
    actor = dealer(address, "actor-0")
    try:
        for groups in (0, 9):
            await actor.send_multipart(P.encode(P.GroupRequest(actor="actor-0", request=groups, groups=groups)))
            reply = await recv(actor)
            assert isinstance(reply, P.Reject) and f"not {groups}" in reply.reason
        await actor.send_multipart(P.encode(P.GroupRequest(actor="actor-0", request=1, groups=2)))
        grant = await recv(actor)
        assert isinstance(grant, P.GroupGrant) and grant.group_id == 0 and sorted(broker.buffer.open) == [0, 1]
        assert broker.summary()["messages_rejected"]["malformed"] == 2
    finally:
        broker.stop()
        await task
        actor.close()


async def test_malformed_and_oversized_messages_are_rejected_counted_and_survived() -> None:
    broker, task, address = await start_broker(small_config())
    client = dealer(address, "mallory")
    try:
        bad = [
            [b"\xc1garbage"],
            [P.encode(P.GroupRequest(actor="x"))[0][:-3]],
            P.encode(P.WeightUpdate(version=1, payload=b"x" * 5000)),  # over the 4096-byte limit
            P.encode(
                P.Batch(
                    step=0,
                    rank=0,
                    learner_version=0,
                    group_size=1,
                    group_index=np.zeros(0, np.int32),
                    traj_index=np.zeros(0, np.int32),
                    step_index=np.zeros(0, np.int32),
                    prompt_lens=np.zeros(0, np.int32),
                    response_lens=np.zeros(0, np.int32),
                    rewards=np.zeros(0, np.float32),
                    dones=np.zeros(0, bool),
                    valid=np.zeros(0, bool),
                    version_lo=np.zeros(0, np.int32),
                    version_hi=np.zeros(0, np.int32),
                    prompt_ids=np.zeros(0, np.int32),
                    response_ids=np.zeros(0, np.int32),
                    logprobs=np.zeros(0, np.float32),
                )
            ),  # well-formed, but not for the broker
        ]
        for frames in bad:
            await client.send_multipart(frames)
            reply = await recv(client)
            assert isinstance(reply, P.Reject) and reply.reason
        await client.send_multipart(P.encode(step(999, "t", done=True)))  # a transition of no admitted group
        await client.send_multipart(P.encode(P.GroupRequest(actor="mallory")))
        assert isinstance(await recv(client), P.GroupGrant)  # still serving
        s = broker.summary()
        # 2 unparseable headers + 1 oversized are protocol rejections (counted by code); the batch and the
        # unknown group are refused by the handlers: 5 malformed in all.
        assert s["messages_rejected"] == {
            "malformed": 5,
            "unknown_group": 1,
            "protocol_bad_header": 2,
            "protocol_oversized": 1,
        }
        assert s["transitions_ingested"] == 0
    finally:
        broker.stop()
        await task
        client.close()


def test_the_broker_socket_helpers_move_whole_multipart_messages() -> None:
    import time

    from broker.sockets import recv_frames, send_frames

    ctx = zmq.Context()
    router, dealer_sock = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
    try:
        port = router.bind_to_random_port("tcp://127.0.0.1")
        dealer_sock.setsockopt(zmq.IDENTITY, b"peer")
        dealer_sock.connect(f"tcp://127.0.0.1:{port}")
        dealer_sock.setsockopt(zmq.RCVTIMEO, 5000)
        with pytest.raises(zmq.Again):  # nothing was sent yet
            recv_frames(router)
        messages = [[b"a", b"", b"ccc"], [b"single"], [b"x" * 70_000, b"y"]]
        for m in messages:
            dealer_sock.send_multipart(m)
        got, deadline = [], time.monotonic() + 5
        while len(got) < len(messages) and time.monotonic() < deadline:
            try:
                got.append([f.bytes for f in recv_frames(router)])
            except zmq.Again:
                time.sleep(0.01)
        assert got == [[b"peer", *m] for m in messages]  # the sender's identity, then each message's parts whole
        for m in messages:
            send_frames(router, [b"peer", *m], copy=len(m[0]) < 65536)
        assert [dealer_sock.recv_multipart() for _ in messages] == messages
    finally:
        router.close(0)
        dealer_sock.close(0)
        ctx.term()


async def test_the_last_mismatch_measurement_stays_until_the_next() -> None:
    # The learner measures the train-inference mismatch only on steps whose batch held tokens of its own version;
    # a step without keeps the last figures (and their version) in /metrics, with that step's count of 0.
    from broker.prometheus import render_prometheus
    from broker.views import dashboard_state

    broker, task, address = await start_broker(small_config())
    learner = dealer(address, "learner-0")
    measured = {
        "loss": 0.5,
        "mismatch_tokens": 40.0,
        "mismatch_logp_abs_mean": 2e-6,
        "mismatch_logp_abs_max": 1e-5,
        "mismatch_kl": 3e-12,
        "mismatch_version": 1.0,
    }
    try:
        await learner.send_multipart(P.encode(P.VersionUpdate(version=1, metrics=measured)))
        await learner.send_multipart(
            P.encode(P.VersionUpdate(version=2, metrics={"loss": 0.4, "mismatch_tokens": 0.0}))
        )
        for _ in range(100):
            if broker.learner_metrics.get("loss") == 0.4:
                break
            await asyncio.sleep(0.02)
        assert broker.learner_metrics == {**measured, "loss": 0.4, "mismatch_tokens": 0.0}
        text = render_prometheus(dashboard_state(broker.view())).decode()
        assert "agentstream_learner_mismatch_version 1.0" in text
        assert "agentstream_learner_mismatch_logp_abs_mean 2e-06" in text
        assert "agentstream_learner_mismatch_tokens 0.0" in text
    finally:
        broker.stop()
        await task
        learner.close()
