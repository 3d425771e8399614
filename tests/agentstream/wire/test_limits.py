"""Untrusted input: each kind of bad value is refused with its reason code (agentstream.wire.messages.REJECT_CODES),
by `decode` (type-level checks) or `limits.check_limits` (run-dependent checks). Runs in < 1 s."""

import dataclasses
import json
import random

import msgpack
import numpy as np
import pytest

from agentstream.config import BrokerConfig, EnginesConfig, ModelConfig
from agentstream.wire import messages as P
from agentstream.wire.limits import Limits, check_limits, limits_for, model_vocab_size

LIMITS = Limits(vocab_size=512, max_tokens=64)


def transition(**kw) -> P.Transition:
    base = {
        "traj_id": "a.0.g1",
        "group_id": 1,
        "actor": "actor-0",
        "step": 0,
        "prompt_ids": np.array([1, 2, 511], np.int32),
        "response_ids": np.array([3, 4], np.int32),
        "logprobs": np.array([-0.5, 0.0], np.float32),
        "version_lo": 0,
        "version_hi": 1,
        "reward": 1.0,
        "done": True,
        "truncated": False,
        "valid": True,
    }
    base.update(kw)
    return P.Transition(**base)


def code_of(frames, limits: Limits = LIMITS) -> str:
    """The reject code of `frames` ("" when the message is accepted)."""
    try:
        check_limits(P.decode([bytes(f) for f in frames]), limits)
    except P.ProtocolError as exc:
        assert exc.code in P.REJECT_CODES, exc.code
        return exc.code
    return ""


def with_header(msg: P.Message, **changes) -> list[bytes]:
    """`msg` encoded, then its msgpack header edited (what a hostile sender can do)."""
    frames = [bytes(f) for f in P.encode(msg)]
    header = msgpack.unpackb(frames[0])
    header.update(changes)
    return [msgpack.packb(header), *frames[1:]]


def test_a_valid_transition_passes() -> None:
    assert code_of(P.encode(transition())) == ""


BAD_TRANSITIONS = [
    # Token 512 is the first id outside a 512-entry vocabulary (ids 0..511).
    ({"prompt_ids": np.array([1, 512], np.int32)}, "out_of_vocab"),
    ({"response_ids": np.array([-1, 4], np.int32)}, "out_of_vocab"),
    ({"logprobs": np.array([np.nan, -1.0], np.float32)}, "non_finite"),
    ({"logprobs": np.array([-np.inf, -1.0], np.float32)}, "non_finite"),
    ({"logprobs": np.array([0.5, -1.0], np.float32)}, "out_of_range"),  # a log-probability is <= 0
    ({"logprobs": np.array([-1.0], np.float32)}, "inconsistent"),  # 1 log-prob for 2 response tokens
    # 3 prompt + 62 response tokens = 65 > max_tokens 64; 3 + 61 = 64 is the largest that passes (below).
    ({"response_ids": np.zeros(62, np.int32), "logprobs": np.zeros(62, np.float32)}, "too_long"),
    ({"version_lo": 2, "version_hi": 1}, "out_of_range"),
    ({"step": -1}, "out_of_range"),
    ({"reward": float("nan")}, "non_finite"),
    ({"reward": float("inf")}, "non_finite"),
    ({"token_rewards": np.array([0.5], np.float32)}, "inconsistent"),  # 1 token reward for 2 response tokens
    ({"token_rewards": np.array([0.5, np.nan], np.float32)}, "non_finite"),
]


@pytest.mark.parametrize("changes, code", BAD_TRANSITIONS)
def test_bad_transitions_are_refused_with_their_code(changes, code) -> None:
    assert code_of(P.encode(transition(**changes))) == code


@pytest.mark.parametrize("changes, code", BAD_TRANSITIONS)
def test_one_bad_transition_refuses_its_bundle_with_the_same_code(changes, code) -> None:
    good = transition(traj_id="a.0.g1.ok")
    assert code_of(P.encode(P.Transitions.of([good, good]))) == ""
    assert code_of(P.encode(P.Transitions.of([good, transition(**changes), good]))) == code


def test_the_longest_transition_that_fits_passes() -> None:
    msg = transition(response_ids=np.zeros(61, np.int32), logprobs=np.zeros(61, np.float32))  # 3 + 61 = 64
    assert code_of(P.encode(msg)) == ""


@pytest.mark.parametrize(
    "changes, code",
    [
        ({"step": 2**31}, "out_of_range"),  # one past int32: would overflow a batch's step_index
        ({"group_id": 2**64 - 1}, "out_of_range"),  # msgpack's largest uint
        ({"version_lo": -2}, "out_of_range"),  # -1 is the protocol's "none"; below is garbage
        ({"traj_id": "x" * (P.MAX_NAME_CHARS + 1)}, "too_long"),
        ({"info": {"k": [1, 2]}}, "bad_type"),  # nested containers are refused
        ({"info": {"k": {"nested": 1}}}, "bad_type"),
        ({"info": {str(i): i for i in range(P.MAX_DICT_ITEMS + 1)}}, "bad_header"),  # msgpack's map limit
        ({"info": {"k": float("nan")}}, "non_finite"),
        ({"done": 1}, "bad_type"),
        ({"reward": "1.0"}, "bad_type"),
        ({"info": {"k": msgpack.ExtType(1, b"payload")}}, "bad_header"),  # no ext types, ever
    ],
)
def test_bad_header_values_are_refused(changes, code) -> None:
    assert code_of(with_header(transition(), **changes)) == code


def test_array_descriptors_dtypes_and_shapes_are_checked() -> None:
    frames = [bytes(f) for f in P.encode(transition())]
    header = msgpack.unpackb(frames[0])
    assert [a[0] for a in header["_arrays"]] == ["prompt_ids", "response_ids", "logprobs", "token_rewards"]

    def edited(i: int, spec: list) -> list[bytes]:
        h = json.loads(json.dumps(header))
        h["_arrays"][i] = spec
        return [msgpack.packb(h), *frames[1:]]

    # prompt_ids as float32: 3 x 4 bytes would fit the frame, but token ids must be int32.
    assert code_of(edited(0, ["prompt_ids", "float32", [3]])) == "bad_dtype"
    # A huge declared size is compared with the frame's real length, never allocated.
    assert code_of(edited(0, ["prompt_ids", "int32", [2**40]])) == "bad_array"
    # Two dims whose int64 product wraps to 0 (2**32 * 2**32 = 2**64): only 1-D arrays exist.
    assert code_of(edited(0, ["prompt_ids", "int32", [2**32, 2**32]])) == "bad_array"
    assert code_of(edited(0, ["prompt_ids", "int32", []])) == "bad_array"
    assert code_of(edited(0, ["prompt_ids", "int32", [-3]])) == "bad_array"
    assert code_of(edited(0, ["prompt_ids", "int32"])) == "bad_array"
    assert code_of(frames[:-1]) == "bad_frames"  # a data frame missing
    assert code_of([*frames, b"\x00" * 8]) == "bad_frames"  # one too many


def test_other_kinds_are_checked() -> None:
    assert code_of(P.encode(P.BatchRequest(step=0, rank=2, world_size=2))) == "out_of_range"
    assert code_of(P.encode(P.BatchRequest(step=0, rank=0, world_size=0))) == "out_of_range"
    assert code_of(P.encode(P.WeightUpdate(version=1, payload=b"x", format="pickle"))) == "out_of_range"
    assert code_of(P.encode(P.Hello(role="actor", name="a", incarnation=-1))) == "out_of_range"
    assert code_of(P.encode(P.Stats(source="a", role="actor", counters={"x": "many"}))) == "bad_type"
    assert code_of(P.encode(P.Stats(source="a", role="actor", counters={"x": float("inf")}))) == "non_finite"
    # A diverged loss is reported, not refused: gauges and metrics may be nan.
    assert code_of(P.encode(P.Stats(source="a", role="learner", gauges={"loss": float("nan")}))) == ""
    assert code_of(P.encode(P.VersionUpdate(version=3, metrics={"loss": float("nan")}))) == ""


@pytest.mark.parametrize(
    "weights, code",
    [
        ("", ""),  # not said: the broker keeps the address it has
        ("tcp://10.0.0.9:41000", ""),
        ("tcp://host-b.example.org:5556", ""),
        ("tcp://[fe80::1]:5556", ""),
        ("tcp://10.0.0.9:65535", ""),  # the highest port; one more is none
        ("tcp://10.0.0.9:65536", "out_of_range"),
        ("tcp://10.0.0.9:0", "out_of_range"),
        ("http://10.0.0.9:5556", "out_of_range"),
        ("tcp://10.0.0.9", "out_of_range"),
        ("tcp://a b:1", "out_of_range"),
        ("tcp://10.0.0.9:5556/x", "out_of_range"),
        # 6 + 250 + 5 = 261 characters > MAX_NAME_CHARS (256): an address that long is no address
        ("tcp://" + "a" * 250 + ":5556", "too_long"),
    ],
)
def test_the_learners_weight_address_must_be_one(weights: str, code: str) -> None:
    """The broker hands a VersionUpdate's `weights` to every process that joins: only tcp://HOST:PORT gets through."""
    assert code_of(P.encode(P.VersionUpdate(version=3, resumed=True, weights=weights))) == code


def test_batches_must_add_up() -> None:
    def batch(**kw) -> P.Batch:
        def n2(dt):
            return np.zeros(2, dt)

        base = {
            "step": 0,
            "rank": 0,
            "learner_version": 0,
            "group_size": 2,
            "group_index": n2(np.int32),
            "traj_index": np.array([0, 1], np.int32),
            "step_index": n2(np.int32),
            "prompt_lens": np.array([2, 1], np.int32),
            "response_lens": np.array([1, 1], np.int32),
            "rewards": n2(np.float32),
            "dones": np.ones(2, bool),
            "valid": np.ones(2, bool),
            "version_lo": n2(np.int32),
            "version_hi": n2(np.int32),
            "prompt_ids": np.array([1, 2, 3], np.int32),
            "response_ids": np.array([4, 5], np.int32),
            "logprobs": np.array([-1, -2], np.float32),
        }
        base.update(kw)
        return P.Batch(**base)

    assert code_of(P.encode(batch())) == ""
    # prompt_lens say 2 + 2 = 4 prompt tokens; 3 came.
    assert code_of(P.encode(batch(prompt_lens=np.array([2, 2], np.int32)))) == "inconsistent"
    assert code_of(P.encode(batch(rewards=np.zeros(3, np.float32)))) == "inconsistent"
    assert code_of(P.encode(batch(rewards=np.array([0, np.nan], np.float32)))) == "non_finite"
    assert code_of(P.encode(batch(token_rewards=np.array([1, -1], np.float32)))) == ""  # one per response token
    assert code_of(P.encode(batch(token_rewards=np.array([1, -1, 0], np.float32)))) == "inconsistent"
    assert code_of(P.encode(batch(token_rewards=np.array([1, np.inf], np.float32)))) == "non_finite"


@pytest.mark.parametrize("bundle", [False, True])
def test_random_mutations_never_raise_anything_but_protocol_error(bundle: bool) -> None:
    """Property: whatever bytes arrive, decode + check_limits either accept or raise ProtocolError with a known
    code (never another exception), and every transition of an accepted message satisfies the limits."""
    rng = random.Random(5)
    msg = P.Transitions.of([transition(), transition(step=1, seq=1)]) if bundle else transition()
    good = [bytes(f) for f in P.encode(msg)]
    accepted = 0
    for _ in range(3000):
        frames = [bytearray(f) for f in good]
        for _ in range(rng.randint(1, 3)):
            i = rng.randrange(len(frames))
            if frames[i]:
                frames[i][rng.randrange(len(frames[i]))] = rng.randrange(256)
        try:
            got = check_limits(P.decode([bytes(f) for f in frames]), LIMITS)
        except P.ProtocolError as exc:
            assert exc.code in P.REJECT_CODES
            continue
        accepted += 1
        assert isinstance(got, type(msg))
        for t in got.split() if bundle else [got]:
            assert t.logprobs.size == t.response_ids.size and t.prompt_ids.size + t.response_ids.size <= 64
            assert np.isfinite(t.logprobs).all() and (t.logprobs <= 1e-3).all() and 0 <= t.version_lo <= t.version_hi
            ids = np.concatenate([t.prompt_ids, t.response_ids])
            assert ids.min() >= 0 and ids.max() < LIMITS.vocab_size
    assert accepted > 0  # some mutations (e.g. of a token id within the vocabulary) are harmless


def test_limits_come_from_the_model_config(tmp_path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 777}))
    limits = limits_for(
        dataclasses.replace(ModelConfig(), path=str(tmp_path)),
        dataclasses.replace(EnginesConfig(), max_model_len=300),
        dataclasses.replace(BrokerConfig(), max_image_bytes=1234),
    )
    assert (limits.vocab_size, limits.max_tokens, limits.max_image_bytes) == (777, 300, 1234)
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"vocab_size": 9}}))  # multimodal layout
    assert model_vocab_size(str(tmp_path)) == 9
    assert model_vocab_size(str(tmp_path / "absent")) == 0  # unknown: ids only checked to be >= 0


def test_the_fast_acceptance_of_bundle_items_is_never_looser_than_the_checks() -> None:
    """Property: on random items near the edges, `_plainly_valid` accepts only what every per-field check
    of a Transition accepts (it exists only to skip those checks for the usual, well-formed item)."""
    rng = random.Random(7)
    edge = [
        0,
        1,
        -1,
        -2,
        2**31 - 1,
        2**31,
        2**63 - 1,
        2**63,
        0.5,
        -0.0,
        float("nan"),
        float("inf"),
        True,
        False,
        None,
        "",
        "x" * 257,
        "ok",
        [],
        {},
        {"a": 1},
        {"a": float("nan")},
        {"k" * 300: 1},
        {"a": [1]},
        {1: 2},
        {"a": "y" * (P.MAX_TEXT_CHARS + 1)},
        {"a": None},
        {"a": True},
    ]
    base = [getattr(transition(seq=3), f) for f in P.TRANSITION_ITEM_FIELDS]
    checks = [P._CHECKERS["transition"][f] for f in P.TRANSITION_ITEM_FIELDS]
    fast_accepted = 0
    for _ in range(20_000):
        item = list(base)
        for _ in range(rng.randint(0, 2)):
            item[rng.randrange(len(item))] = rng.choice(edge)
        if P._plainly_valid(item):
            fast_accepted += 1
            for check, value in zip(checks, item):
                check(value)  # raises if the fast path was looser
    assert fast_accepted > 1000


def test_the_fast_decoding_of_transitions_agrees_with_the_general_path(monkeypatch) -> None:
    """Property: on random bundles and lone transitions, with and without images, and random byte mutations of them,
    `decode`'s fast paths (`_plain_transitions`, `_plain_transition`) give the same message, or the same reject code,
    as the general path alone."""
    rng = random.Random(11)

    def outcome(frames):
        try:
            msg = P.decode(frames)
        except P.ProtocolError as exc:
            return exc.code
        arrays = [
            f
            for f in (
                "prompt_lens",
                "response_lens",
                "prompt_ids",
                "response_ids",
                "logprobs",
                "images",
                "image_shapes",
                "image_data",
            )
            if hasattr(msg, f)
        ]
        return (
            type(msg).__name__,
            sorted((k, repr(v)) for k, v in vars(msg).items() if k not in arrays),
            *(getattr(msg, f).tolist() for f in arrays),
            *(str(getattr(msg, f).dtype) for f in arrays),
            *(getattr(msg, f).shape for f in arrays),
        )

    cases = []
    for i in range(800):
        ts = [
            transition(
                traj_id=f"t{j}",
                step=j,
                seq=j,
                info={"k": j},
                anchor="a" * rng.randint(0, 3),
                prompt_ids=np.arange(rng.randint(0, 5), dtype=np.int32),
                response_ids=np.arange(n := rng.randint(0, 4), dtype=np.int32),
                logprobs=np.full(n, -0.25, np.float32),
                images=np.full((rng.randint(0, 2), 2, 3, 3), j, np.uint8) if i % 8 >= 4 else P._NO_IMAGES,
            )
            for j in range(rng.randint(1, 4))
        ]
        msg = P.Transitions.of(ts) if i % 4 < 2 else ts[0]
        frames = [bytearray(f) for f in P.encode(msg)]
        for _ in range(rng.randint(0, 2)) if i % 2 else ():
            k = rng.randrange(len(frames))
            if frames[k]:
                frames[k][rng.randrange(len(frames[k]))] = rng.randrange(256)
        cases.append([bytes(f) for f in frames])
    with_fast = [outcome(c) for c in cases]
    fast_taken = {"transitions": 0, "transition": 0, "with images": 0}
    for c in cases:
        try:
            header = P.unpack_header(c[0])
        except P.ProtocolError:
            continue
        plain = {"transitions": P._plain_transitions, "transition": P._plain_transition}.get(header.get("kind"))
        if plain is not None and plain(header, c) is not None:
            fast_taken[header["kind"]] += 1
            fast_taken["with images"] += any(a[0] in ("images", "image_shapes") for a in header["_arrays"])
    monkeypatch.setattr(P, "_plain_transitions", lambda header, bufs: None)
    monkeypatch.setattr(P, "_plain_transition", lambda header, bufs: None)
    assert with_fast == [outcome(c) for c in cases]
    # Both fast paths were taken, messages with images too, and both paths rejected some mutations.
    assert min(fast_taken.values()) > 200 and sum(isinstance(o, str) for o in with_fast) > 40
