"""Image frames on the wire: random image sets round-trip through Transition, Transitions and Batch exactly, a
text-only message carries no image frame, and every malformed image (shape, dtype, bytes, channels, size) is
refused with its reason. Seeded random loops (no hypothesis here); runs in about a second."""

import dataclasses
import random

import msgpack
import numpy as np
import pytest

from agentstream.wire import messages as P
from agentstream.wire.limits import Limits, check_limits

LIMITS = Limits(vocab_size=512, max_tokens=64, max_image_bytes=1200)


def random_images(rng: random.Random, n_max: int = 3) -> np.ndarray:
    """n in 0..n_max images of one random size, 1, 3 or 4 channels, within LIMITS (3 x 10 x 10 x 4 = 1,200 bytes)."""
    n = rng.randint(0, n_max)
    if n == 0:
        return np.zeros((0, 0, 0, 0), np.uint8)
    shape = (n, rng.randint(1, 10), rng.randint(1, 10), rng.choice([1, 3, 4]))
    return np.random.default_rng(rng.getrandbits(32)).integers(0, 256, shape, dtype=np.uint8)


def transition(seq: int = -1, images: np.ndarray | None = None, **kw) -> P.Transition:
    base = {
        "traj_id": "a.0.g1",
        "group_id": 1,
        "actor": "actor-0",
        "step": 0,
        "prompt_ids": np.array([1, 2], np.int32),
        "response_ids": np.array([3], np.int32),
        "logprobs": np.array([-0.5], np.float32),
        "version_lo": 0,
        "version_hi": 0,
        "reward": 1.0,
        "done": True,
        "truncated": False,
        "valid": True,
        "seq": seq,
    }
    if images is not None:
        base["images"] = images
    return P.Transition(**{**base, **kw})


def wire(msg: P.Message) -> list[bytes]:
    return [bytes(f) for f in P.encode(msg)]


def through(msg: P.Message, limits: Limits = LIMITS) -> P.Message:
    return check_limits(P.decode(wire(msg)), limits)


def assert_images(got: np.ndarray, want: np.ndarray) -> None:
    assert got.dtype == np.uint8 and got.shape == want.shape and np.array_equal(got, want)


def test_random_image_sets_round_trip_through_transition_and_transitions() -> None:
    rng = random.Random(0)
    for _ in range(300):
        sent = [random_images(rng) for _ in range(rng.randint(1, 5))]
        ts = [transition(seq=i, step=i, images=imgs) for i, imgs in enumerate(sent)]
        assert_images(through(ts[0]).images, sent[0])
        got = through(P.Transitions.of(ts)).split()
        assert len(got) == len(sent)
        for g, want in zip(got, sent):
            assert_images(g.images, want)


def test_random_image_sets_round_trip_through_a_batch() -> None:
    """The columns are written out by hand here (reference): each transition's (n, H, W, C), then its bytes."""
    rng = random.Random(1)
    for _ in range(200):
        sent = [random_images(rng) for _ in range(rng.randint(0, 5))]
        shapes = np.array([s.shape for s in sent], np.int32).reshape(len(sent), 4)
        data = np.array([b for s in sent for b in s.tobytes()], np.uint8)
        n = len(sent)
        batch = P.Batch(
            step=0,
            rank=0,
            learner_version=0,
            group_size=1,
            group_index=np.zeros(n, np.int32),
            traj_index=np.arange(n, dtype=np.int32),
            step_index=np.zeros(n, np.int32),
            prompt_lens=np.zeros(n, np.int32),
            response_lens=np.zeros(n, np.int32),
            rewards=np.zeros(n, np.float32),
            dones=np.ones(n, bool),
            valid=np.ones(n, bool),
            version_lo=np.zeros(n, np.int32),
            version_hi=np.zeros(n, np.int32),
            prompt_ids=np.zeros(0, np.int32),
            response_ids=np.zeros(0, np.int32),
            logprobs=np.zeros(0, np.float32),
            image_shapes=shapes,
            image_data=data,
        )
        got = through(batch)
        for i, want in enumerate(sent):
            assert_images(got.images_of(i), want)


def test_text_only_messages_carry_no_image_frame() -> None:
    """A transition without images encodes exactly as before images existed: 4 arrays, none of them an image."""
    for msg, arrays in (
        (transition(), ["prompt_ids", "response_ids", "logprobs", "token_rewards"]),
        (
            P.Transitions.of([transition(seq=0), transition(seq=1, step=1)]),
            ["prompt_lens", "response_lens", "prompt_ids", "response_ids", "logprobs", "token_rewards"],
        ),
    ):
        frames = wire(msg)
        assert [a[0] for a in msgpack.unpackb(frames[0])["_arrays"]] == arrays and len(frames) == len(arrays) + 1
    got = through(P.Transitions.of([transition(seq=0), transition(seq=1, step=1)])).split()
    assert [g.images.shape for g in got] == [(0, 0, 0, 0)] * 2
    # A 112 x 112 RGB frame (a Sokoban screen) adds its 37,632 bytes and one descriptor, nothing more.
    image = np.zeros((1, 112, 112, 3), np.uint8)
    text, imaged = wire(transition()), wire(transition(images=image))
    assert len(imaged) == len(text) + 1 and len(imaged[-1]) == 112 * 112 * 3


def test_a_bundle_gives_each_transition_its_own_images_whatever_their_sizes() -> None:
    grey = np.arange(2 * 3 * 4, dtype=np.uint8).reshape(2, 3, 4, 1)
    rgba = np.full((1, 5, 2, 4), 7, np.uint8)
    bundle = through(
        P.Transitions.of(
            [transition(seq=0, images=grey), transition(seq=1, step=1), transition(seq=2, step=2, images=rgba)]
        )
    )
    # Rows (n, H, W, C); bytes 2*3*4*1 = 24 of grey then 1*5*2*4 = 40 of rgba.
    assert bundle.image_shapes.tolist() == [[2, 3, 4, 1], [0, 0, 0, 0], [1, 5, 2, 4]]
    assert bundle.image_data.size == 64 and bundle.image_data[:24].tolist() == list(range(24))
    got = bundle.split()
    assert_images(got[0].images, grey)
    assert got[1].images.shape == (0, 0, 0, 0)
    assert_images(got[2].images, rgba)


def edited(msg: P.Message, field: str, spec=None, frame: bytes | None = None) -> list[bytes]:
    """`msg` encoded, its `field` array descriptor [name, dtype, shape] and/or data frame replaced."""
    frames = wire(msg)
    header = msgpack.unpackb(frames[0])
    i = [a[0] for a in header["_arrays"]].index(field)
    if spec is not None:
        header["_arrays"][i] = spec
    if frame is not None:
        frames[i + 1] = frame
    return [msgpack.packb(header), *frames[1:]]


def refusal(frames: list[bytes]) -> tuple[str, str]:
    with pytest.raises(P.ProtocolError) as exc:
        check_limits(P.decode(frames), LIMITS)
    return exc.value.code, str(exc.value)


RGB = np.ones((1, 2, 2, 3), np.uint8)  # 12 bytes
BUNDLE = P.Transitions.of([transition(seq=0, images=RGB), transition(seq=1, step=1, images=RGB)])


@pytest.mark.parametrize(
    "frames, code, needle",
    [
        (wire(transition(images=RGB.astype(np.float32))), "bad_dtype", "transition.images: must be uint8"),
        (wire(transition(images=RGB[0])), "bad_array", "transition.images: bad shape [2, 2, 3] (must be 4-D)"),
        (
            edited(transition(images=RGB), "images", frame=bytes(11)),
            "bad_array",
            "transition.images: 11 bytes do not hold",
        ),
        (edited(transition(images=RGB), "images", ["images", "uint8", [1, 2, 3, 2]]), "out_of_range", "C in (1, 3, 4)"),
        (edited(transition(images=RGB), "images", ["images", "uint8", [3, 0, 2, 2]], b""), "out_of_range", "H, W >= 1"),
        # 1,200 bytes pass (LIMITS.max_image_bytes); 1,203 do not.
        (wire(transition(images=np.zeros((1, 1, 401, 3), np.uint8))), "too_long", "1203 image bytes"),
        (
            edited(BUNDLE, "image_shapes", ["image_shapes", "int32", [8]]),
            "bad_array",
            "transitions.image_shapes: bad shape",
        ),
        (
            edited(BUNDLE, "image_data", ["image_data", "int32", [6]]),
            "bad_dtype",
            "transitions.image_data: must be uint8",
        ),
        (
            edited(
                BUNDLE, "image_shapes", ["image_shapes", "int32", [1, 4]], np.array([1, 2, 2, 3], np.int32).tobytes()
            ),
            "inconsistent",
            "image_shapes is [1, 4]; it must be [2, 4]",
        ),
        # Rows say 2 + 1 images of 12 bytes = 36 bytes; 24 came.
        (
            edited(BUNDLE, "image_shapes", frame=np.array([2, 2, 2, 3, 1, 2, 2, 3], np.int32).tobytes()),
            "inconsistent",
            "describe 36 image bytes but 24 came",
        ),
        (
            edited(BUNDLE, "image_shapes", frame=np.array([-1, 2, 2, 3, 1, 2, 2, 3], np.int32).tobytes()),
            "out_of_range",
            "image_shapes hold -1",
        ),
        (
            wire(
                P.Transitions.of(
                    [transition(seq=0, images=RGB), transition(seq=1, images=np.zeros((2, 1, 201, 3), np.uint8))]
                )
            ),
            "too_long",
            "1206 image bytes in one transition exceed broker.max_image_bytes=1200",
        ),
    ],
)
def test_malformed_images_are_refused_with_the_reason(frames, code, needle) -> None:
    got_code, text = refusal(frames)
    assert got_code == code
    assert needle in text, text


def test_the_image_limit_is_per_transition_and_zero_means_none() -> None:
    at_limit = np.zeros((1, 20, 20, 3), np.uint8)  # 1,200 bytes = LIMITS.max_image_bytes
    bundle = P.Transitions.of([transition(seq=i, step=i, images=at_limit) for i in range(3)])  # 3,600 in the message
    assert len(through(bundle).split()) == 3
    over = transition(images=np.zeros((2, 20, 20, 3), np.uint8))
    assert refusal(wire(over))[0] == "too_long"
    assert through(over, dataclasses.replace(LIMITS, max_image_bytes=0)).images.shape == (2, 20, 20, 3)


def test_a_bundle_refuses_images_that_are_not_uint8_before_sending() -> None:
    with pytest.raises(ValueError, match=r"uint8 array \[n, H, W, C\]"):
        P.Transitions.of([transition(seq=0, images=RGB.astype(np.int16)), transition(seq=1)])
