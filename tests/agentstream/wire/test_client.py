"""The actor's broker client over a real ZeroMQ socket pair: transitions that come together go out together
(one Transitions message, cut by count and by bytes), in seq order; acknowledged ones are forgotten; without an
acknowledgement every unacknowledged one is sent again."""

import asyncio
import contextlib
import dataclasses
import random

import numpy as np
import pytest
import zmq
import zmq.asyncio

from agentstream.wire.client import BUNDLE_BYTES, AsyncClient, bundles
from agentstream.wire.messages import MAX_BUNDLE, Ack, Transition, Transitions, decode, encode
from agentstream.wire.reconnect import take_over_reconnects


def tr(i: int) -> Transition:
    return Transition(
        traj_id=f"t{i}",
        group_id=7,
        actor="actor-0",
        step=i,
        prompt_ids=np.arange(2 + i, dtype=np.int32),
        response_ids=np.arange(i % 3, dtype=np.int32),
        logprobs=np.full(i % 3, -0.25, np.float32),
        version_lo=0,
        version_hi=0,
        reward=float(i),
        done=False,
        truncated=False,
        valid=True,
        info={"i": i},
    )


async def received(router: zmq.asyncio.Socket, n: int) -> tuple[bytes, list[int], list[Transition]]:
    """(the client's identity, the size of each message, the transitions in order) until `n` came."""
    sizes, got, ident = [], [], b""
    while len(got) < n:
        ident, *frames = await asyncio.wait_for(router.recv_multipart(copy=False), 10)
        msg = decode(frames)
        ts = msg.split() if isinstance(msg, Transitions) else [msg]
        sizes.append(len(ts))
        got += ts
    return ident.bytes, sizes, got


@contextlib.asynccontextmanager
async def connected(incarnation: int, ack_timeout_s: float):
    """(a started client named actor-0, the ROUTER it is connected to over loopback); both closed after."""
    router = zmq.asyncio.Context.instance().socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    client = AsyncClient(f"tcp://127.0.0.1:{port}", "actor-0")
    await client.start(incarnation=incarnation, max_unacked=64, ack_timeout_s=ack_timeout_s)
    try:
        yield client, router
    finally:
        await client.close()
        router.close(linger=0)


def test_transitions_sent_together_arrive_bundled_in_order_and_are_resent_until_acknowledged() -> None:
    async def main() -> None:
        async with connected(incarnation=3, ack_timeout_s=0.4) as (client, router):
            await asyncio.gather(*(client.send_transition(tr(i)) for i in range(10)))
            ident, sizes, got = await received(router, 10)
            assert sum(sizes) == 10 and len(sizes) < 10  # fewer messages than transitions
            assert [t.seq for t in got] == list(range(10)) and {t.incarnation for t in got} == {3}
            for want, t in zip((tr(i) for i in range(10)), got):
                assert (t.traj_id, t.step, t.reward, t.info) == (want.traj_id, want.step, want.reward, want.info)
                np.testing.assert_array_equal(t.prompt_ids, want.prompt_ids)
                np.testing.assert_array_equal(t.logprobs, want.logprobs)
            assert client.unacked == 10
            await router.send_multipart([ident, *encode(Ack(actor="actor-0", incarnation=3, upto=5))])
            for _ in range(100):
                if client.unacked == 4:
                    break
                await asyncio.sleep(0.01)
            assert client.unacked == 4  # 0..5 acknowledged
            _, _, again = await received(router, 4)  # nothing acknowledged for 0.4 s: 6..9 come again
            assert [t.seq for t in again] == [6, 7, 8, 9] and client.counters["transitions_resent"] >= 4

    asyncio.run(main())


def pictured(i: int, side: int) -> Transition:
    """tr(i) with one side x side RGB picture."""
    return dataclasses.replace(tr(i), images=np.full((1, side, side, 3), i % 256, np.uint8))


def array_bytes(t: Transition) -> int:
    return t.prompt_ids.nbytes + t.response_ids.nbytes + t.logprobs.nbytes + t.images.nbytes


def test_bundles_keep_the_order_and_stay_within_the_count_and_the_bytes() -> None:
    rng = random.Random(0)
    for _ in range(200):
        limit = rng.choice([1, 500, 3000, 20_000])
        ts = [
            pictured(i, rng.choice([0, 4, 20, 40])) if rng.random() < 0.7 else tr(i) for i in range(rng.randint(0, 60))
        ]
        runs = list(bundles(ts, limit))
        assert [t for run in runs for t in run] == ts and all(runs)
        for run in runs:
            assert len(run) == 1 or sum(map(array_bytes, run)) <= limit  # over the limit only alone
        for a, b in zip(runs, runs[1:]):  # each cut was needed: the next transition did not fit
            assert sum(map(array_bytes, a)) + array_bytes(b[0]) > limit
    assert [len(r) for r in bundles([tr(i % 50) for i in range(MAX_BUNDLE + 5)])] == [MAX_BUNDLE, 5]


def test_transitions_with_large_pictures_go_out_in_messages_under_the_byte_bound() -> None:
    async def main() -> None:
        async with connected(incarnation=1, ack_timeout_s=30) as (client, router):
            ts = [pictured(i, 1024) for i in range(6)]  # 3 MiB each: at most 2 fit in BUNDLE_BYTES (8 MiB)
            await asyncio.gather(*(client.send_transition(t) for t in ts))
            _, sizes, got = await received(router, 6)
            assert max(sizes) <= BUNDLE_BYTES // array_bytes(ts[0]) == 2 and sum(sizes) == 6
            assert [t.seq for t in got] == list(range(6))
            assert [int(t.images[0, 0, 0, 0]) for t in got] == list(range(6))

    asyncio.run(main())


def test_a_router_hands_an_identity_over_to_its_new_connection() -> None:
    """take_over_reconnects: a client that connects again under its identity while its old connection still looks
    open to the server (a partition ended only the client's end of it) is served on the new one. Without
    ROUTER_HANDOVER the server ignores it for as long as the old connection lasts."""
    ctx = zmq.Context.instance()
    server = ctx.socket(zmq.ROUTER)
    take_over_reconnects(server)
    server.bind("tcp://127.0.0.1:*")
    clients = []
    for n in range(2):
        client = ctx.socket(zmq.DEALER)
        client.setsockopt(zmq.IDENTITY, b"actor-0")
        client.setsockopt(zmq.LINGER, 0)
        client.connect(server.getsockopt_string(zmq.LAST_ENDPOINT))
        client.send(f"hello {n}".encode())
        assert server.poll(5000) and server.recv_multipart() == [b"actor-0", f"hello {n}".encode()]
        clients.append(client)
    server.send_multipart([b"actor-0", b"ack"])
    assert clients[1].poll(5000) and clients[1].recv() == b"ack" and not clients[0].poll(100)
    for sock in (*clients, server):
        sock.close(0)


def test_clients_given_the_brokers_record_follow_it_to_a_new_address(tmp_path) -> None:
    """A broker started again elsewhere rewrites its record: the asyncio client resends its unacknowledged
    transitions there, the blocking client its unanswered request; a client given a plain address stays put."""
    from agentstream.wire.addresses import BROKER_RECORD, write_record
    from agentstream.wire.client import BrokerUnavailable, RecordLink, SyncClient
    from agentstream.wire.messages import BatchRequest, VersionUpdate

    async def main() -> None:
        ctx = zmq.asyncio.Context.instance()
        first, second = ctx.socket(zmq.ROUTER), ctx.socket(zmq.ROUTER)
        old = first.bind_to_random_port("tcp://127.0.0.1")
        record = write_record(
            tmp_path / BROKER_RECORD, address=f"tcp://127.0.0.1:{old}", dashboard="http://127.0.0.1:1"
        )
        client = AsyncClient(str(record), "actor-0")
        assert client.link.address == f"tcp://127.0.0.1:{old}"
        await client.start(incarnation=1, max_unacked=64, ack_timeout_s=0.4)
        try:
            await asyncio.gather(*(client.send_transition(tr(i)) for i in range(3)))
            await received(first, 3)  # the first broker got them, and died without acknowledging
            first.close(linger=0)
            new = second.bind_to_random_port("tcp://127.0.0.1")
            write_record(tmp_path / BROKER_RECORD, address=f"tcp://127.0.0.1:{new}", dashboard="http://127.0.0.1:1")
            _, _, again = await received(second, 3)
            assert [t.seq for t in again] == [0, 1, 2] and client.counters["broker_moves_followed"] == 1
            assert client.link.address == f"tcp://127.0.0.1:{new}"
        finally:
            await client.close()

        blocking = SyncClient(str(record), "learner-0")  # the record names the second broker now
        third = zmq.Context.instance().socket(zmq.ROUTER)
        moved = third.bind_to_random_port("tcp://127.0.0.1")
        try:
            write_record(tmp_path / BROKER_RECORD, address=f"tcp://127.0.0.1:{moved}", dashboard="http://127.0.0.1:1")
            request = BatchRequest(step=0, rank=0, world_size=1)
            answer = VersionUpdate(version=4)

            def serve() -> None:  # the third broker answers the request that reaches it
                ident, *frames = third.recv_multipart()
                assert decode(frames) == request
                third.send_multipart([ident, *encode(answer)])

            server = asyncio.get_running_loop().run_in_executor(None, serve)
            assert blocking.request(request, timeout_s=10, resend_every_s=0.3) == answer
            await server
            assert blocking.moves_followed == 1
        finally:
            blocking.close()
            third.close(linger=0)
            second.close(linger=0)

    asyncio.run(main())
    assert RecordLink("tcp://127.0.0.1:5").moved() is None  # an address is never re-resolved
    with pytest.raises(BrokerUnavailable, match="no record with an address at"):
        RecordLink(str(tmp_path / "none.json"))
