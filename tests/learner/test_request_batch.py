"""A learner rank's batch request against a real ZeroMQ ROUTER that answers as a broker would.

Regression (seen in CI): the first batch took 30 s to form, so the learner resent its request for step 0;
the resend reached the broker after step 0 was served and released, and the broker's refusal of it reached
the learner while it waited for step 1, which it took as a refusal of its own request and died.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import zmq
from learner_testing import make_batch

from agentstream.wire.client import SyncClient
from agentstream.wire.messages import BatchRequest, Reject, decode, encode
from learner.train import request_batch


def broker_answering(replies: list) -> tuple[str, threading.Thread, list]:
    """A ROUTER that waits for one request, then sends `replies` in order; returns what it received."""
    sock = zmq.Context.instance().socket(zmq.ROUTER)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    received: list = []

    def serve() -> None:
        try:
            if sock.poll(10_000):
                ident, *frames = sock.recv_multipart(copy=False)
                received.append(decode(frames))
                for reply in replies:
                    sock.send_multipart([ident, *encode(reply)], copy=False)
        finally:
            sock.close(linger=2000)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return f"tcp://127.0.0.1:{port}", thread, received


def test_a_refused_resend_of_an_earlier_step_is_skipped():
    batch = make_batch(1, 0, np.random.default_rng(0))
    stale = Reject(reason="batch 0 was already served and released (the broker is at step 1)", step=0)
    address, thread, received = broker_answering([stale, make_batch(0, 0, np.random.default_rng(1)), batch])
    client = SyncClient(address, "learner-0")
    try:
        reply = request_batch(client, step=1, rank=0, world=1, timeout_s=10)
    finally:
        client.close()
    thread.join(5)
    assert received == [BatchRequest(step=1, rank=0, world_size=1)]
    assert (reply.step, reply.rank) == (1, 0)
    np.testing.assert_array_equal(reply.response_ids, batch.response_ids)


@pytest.mark.parametrize("step", [1, -1])  # this step's refusal, or one that names no step (a config mismatch)
def test_a_refusal_of_this_request_fails_with_the_brokers_reason(step: int):
    address, thread, _ = broker_answering([Reject(reason="the broker's reason", step=step)])
    client = SyncClient(address, "learner-0")
    try:
        with pytest.raises(RuntimeError, match="broker refused batch_request: the broker's reason"):
            request_batch(client, step=1, rank=0, world=1, timeout_s=10)
    finally:
        client.close()
    thread.join(5)
