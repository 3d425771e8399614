"""Wire protocol: random round-trips, and every kind of malformed frame is a ProtocolError."""

import dataclasses
import random

import msgpack
import numpy as np
import pytest

from agentstream.wire import messages as P


def random_transition(rng: random.Random) -> P.Transition:
    n_p, n_r = rng.randint(0, 300), rng.randint(0, 64)
    return P.Transition(
        traj_id=f"a.{rng.randint(0, 9)}.g{rng.randint(0, 99)}",
        group_id=rng.randint(0, 10**6),
        actor="actor-0",
        step=rng.randint(0, 50),
        prompt_ids=np.array([rng.randint(0, 150_000) for _ in range(n_p)], dtype=np.int32),
        response_ids=np.array([rng.randint(0, 150_000) for _ in range(n_r)], dtype=np.int32),
        logprobs=np.array([-rng.random() * 10 for _ in range(n_r)], dtype=np.float32),
        version_lo=rng.randint(0, 5),
        version_hi=rng.randint(5, 9),
        reward=rng.uniform(-1, 1),
        done=rng.random() < 0.5,
        truncated=rng.random() < 0.5,
        valid=rng.random() < 0.5,
        anchor="ü grid\nP F",
        info={"success": rng.random() < 0.5},
        token_rewards=(
            np.array([rng.uniform(-1, 1) for _ in range(n_r)], np.float32)
            if rng.random() < 0.5
            else np.zeros(0, np.float32)
        ),
    )


def assert_same(a, b) -> None:
    assert type(a) is type(b)
    for f in dataclasses.fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, np.ndarray):
            assert x.dtype == y.dtype and x.shape == y.shape and np.array_equal(x, y), f.name
        else:
            assert x == y, f.name


def test_transition_round_trip_on_random_messages() -> None:
    rng = random.Random(0)
    for _ in range(200):
        msg = random_transition(rng)
        frames = P.encode(msg)
        assert len(frames) == 5  # header + 4 raw arrays: nothing pickled, nothing as lists
        assert_same(msg, P.decode([bytes(f) for f in frames]))


def test_transitions_split_back_into_the_same_transitions() -> None:
    rng = random.Random(1)
    for _ in range(50):
        ts = [dataclasses.replace(random_transition(rng), seq=i, incarnation=3) for i in range(rng.randint(1, 6))]
        got = P.decode([bytes(f) for f in P.encode(P.Transitions.of(ts))]).split()
        assert len(got) == len(ts)
        some = any(t.token_rewards.size for t in ts)  # then the others' come back as zeros, one per token
        for t, g in zip(ts, got):
            if some and not t.token_rewards.size:
                t = dataclasses.replace(t, token_rewards=np.zeros(t.response_ids.size, np.float32))
            assert_same(t, g)  # every field, the defaults included
            assert vars(g).keys() == vars(t).keys()  # nothing more, nothing less than Transition(...) sets
            with pytest.raises(dataclasses.FrozenInstanceError):
                g.step = 99  # still frozen


def test_a_bundle_carries_token_rewards_only_when_one_of_its_transitions_has_them() -> None:
    """Transitions without token rewards ride in a bundle that has some as zeros (the same rewards: the
    scalar `reward` holds the step's whole reward either way); a bundle with none carries an empty array."""
    plain = random_transition(random.Random(2))
    plain = dataclasses.replace(
        plain,
        response_ids=np.array([7, 8, 9], np.int32),
        logprobs=np.full(3, -1.0, np.float32),
        token_rewards=np.zeros(0, np.float32),
    )
    rewarded = dataclasses.replace(
        plain,
        response_ids=np.array([5, 6], np.int32),
        logprobs=np.full(2, -1.0, np.float32),
        token_rewards=np.array([0.25, -0.5], np.float32),
    )
    none = P.Transitions.of([plain, plain])
    assert none.token_rewards.size == 0
    assert [t.token_rewards.size for t in none.split()] == [0, 0]
    mixed = P.decode([bytes(f) for f in P.encode(P.Transitions.of([plain, rewarded, plain]))])
    assert mixed.token_rewards.tolist() == [0, 0, 0, 0.25, -0.5, 0, 0, 0]
    assert [t.token_rewards.tolist() for t in mixed.split()] == [[0, 0, 0], [0.25, -0.5], [0, 0, 0]]


def test_every_kind_round_trips() -> None:
    msgs = [
        P.Hello(role="actor", name="a", incarnation=2, pid=7, address="x"),
        P.GroupRequest(actor="a"),
        P.GroupGrant(group_id=3, seed=4, min_version=1),
        P.Stats(source="a", role="actor", counters={"x": 1}, gauges={"y": 2.5}, final=True),
        P.BatchRequest(step=1, rank=0, world_size=2),
        P.VersionUpdate(version=3, metrics={"loss": 0.5}),
        P.VersionUpdate(version=3, resumed=True, checkpointed=3, weights="tcp://10.0.0.9:41000"),
        P.EngineStatus(engine="e", url="http://h:1", version=2),
        P.WeightUpdate(version=1, payload=b"\x00\x01abc"),
        P.Reject(reason="no"),
    ]
    for msg in msgs:
        assert_same(msg, P.decode(P.encode(msg)))


def test_fields_left_out_take_their_defaults_and_each_message_its_own_dicts() -> None:
    import msgpack

    only_required = msgpack.packb({"v": P.PROTOCOL_VERSION, "kind": "group_request", "actor": "a", "_arrays": []})
    got = P.decode([only_required])
    assert got == P.GroupRequest(actor="a") and (got.incarnation, got.request) == (0, -1)
    stats = msgpack.packb({"v": P.PROTOCOL_VERSION, "kind": "stats", "source": "s", "role": "actor", "_arrays": []})
    a, b = P.decode([stats]), P.decode([stats])
    assert a == P.Stats(source="s", role="actor") and a.counters is not b.counters  # a fresh dict each


def test_arrays_travel_raw_little_endian() -> None:
    msg = random_transition(random.Random(1))
    frames = P.encode(msg)
    assert bytes(frames[1]) == msg.prompt_ids.astype("<i4").tobytes()
    # A big-endian array on the sender is converted, not misread.
    be = dataclasses.replace(msg, prompt_ids=msg.prompt_ids.astype(">i4"))
    assert np.array_equal(P.decode(P.encode(be)).prompt_ids, msg.prompt_ids)


def header(**kw) -> bytes:
    base = {"v": P.PROTOCOL_VERSION, "kind": "group_request", "actor": "a", "_arrays": []}
    base.update(kw)
    return msgpack.packb(base)


@pytest.mark.parametrize(
    "frames, needle",
    [
        ([], "empty"),
        ([b"\xc1\xff"], "msgpack"),
        ([msgpack.packb([1, 2])], "must be a map"),
        ([header(v=99)], "protocol version"),
        ([header(kind="nope")], "unknown message kind"),
        ([header(extra=1)], "unknown field"),
        ([header(actor=5)], "expected str"),
        ([msgpack.packb({"v": P.PROTOCOL_VERSION, "kind": "group_grant", "group_id": 1, "_arrays": []})], "missing"),
        ([header(), b"x"], "arrays"),
        (
            [
                msgpack.packb(
                    {
                        "v": P.PROTOCOL_VERSION,
                        "kind": "weight_update",
                        "version": True,
                        "_arrays": [["payload", "bytes", [1]]],
                    }
                ),
                b"a",
            ],
            "expected int",
        ),
    ],
)
def test_malformed_frames_are_rejected(frames, needle) -> None:
    with pytest.raises(P.ProtocolError, match=needle):
        P.decode(frames)


def test_array_size_mismatch_and_bad_dtype_are_rejected() -> None:
    frames = [bytes(f) for f in P.encode(random_transition(random.Random(2)))]
    with pytest.raises(P.ProtocolError, match="do not hold"):
        P.decode([frames[0], frames[1] + b"\x00", *frames[2:]])
    hdr = msgpack.unpackb(frames[0])
    hdr["_arrays"][0][1] = "float64"
    with pytest.raises(P.ProtocolError, match="unknown dtype"):
        P.decode([msgpack.packb(hdr), *frames[1:]])
    hdr["_arrays"][0] = ["traj_id", "int32", [0]]
    with pytest.raises(P.ProtocolError, match="not an array field"):
        P.decode([msgpack.packb(hdr), *frames[1:]])


def test_oversized_message_is_rejected() -> None:
    frames = P.encode(P.WeightUpdate(version=1, payload=b"x" * 1000))
    with pytest.raises(P.ProtocolError, match="exceeds the limit"):
        P.decode(frames, max_bytes=500)


def test_random_garbage_never_raises_anything_but_protocol_error() -> None:
    rng = random.Random(3)
    good = [bytes(f) for f in P.encode(random_transition(rng))]
    for _ in range(2000):
        frames = [bytearray(f) for f in good]
        for _ in range(rng.randint(1, 4)):  # flip random bytes, or cut frames
            i = rng.randrange(len(frames))
            if frames[i] and rng.random() < 0.7:
                frames[i][rng.randrange(len(frames[i]))] = rng.randrange(256)
            else:
                frames[i] = frames[i][: rng.randrange(len(frames[i]) + 1)]
        try:
            P.decode([bytes(f) for f in frames])
        except P.ProtocolError:
            pass
