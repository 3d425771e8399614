"""The wire protocol: every message that crosses a socket; with `agentstream.wire.fields`, the only code that knows its
bytes.

A message is a list of ZeroMQ frames:

    frame 0      msgpack header {"v": PROTOCOL_VERSION, "kind": ..., <scalar fields>,
                                  "_arrays": [[field, dtype, shape], ...]}
    frame 1..n   one raw little-endian buffer per array (or bytes) field, in `_arrays` order

Token ids and log-probs are numpy arrays sent as raw frames (zero-copy above ~64 kB); nothing is ever
pickled. `decode` validates everything it is given and raises `ProtocolError` saying what was wrong, so a
receiver can count the bad message and keep serving.

Images (vision-language agents): a transition carries the images of its prompt as one raw uint8 frame
[n, H, W, C], never pickled and never a reference to images sent before, so that every transition stays
self-contained (the broker's write-ahead log rebuilds each one on its own, and a lost message leaves nothing
dangling); the price is that an image shown in k prompts is sent k times (a 112x112x3 Sokoban frame: 37 KB).
A bundle or a batch carries each transition's (n, H, W, C) and all their bytes end to end. Image fields that
hold nothing are left out of the message: a text-only transition costs no byte more.

Shapes: T = tokens of one response, P = tokens of one prompt, N = transitions in a batch,
S = sum of prompt lengths in a batch, R = sum of response lengths in a batch; n = images of one transition,
each H x W pixels of C channels (1, 3 or 4), B = sum of the image bytes (n*H*W*C) in a bundle or batch.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import typing
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Union

import msgpack
import numpy as np

from agentstream.wire.fields import (
    ARRAY_DTYPES,
    INT32_MAX,
    MAX_DICT_ITEMS,
    MAX_LIST_ITEMS,
    MAX_NAME_CHARS,
    MAX_TEXT_CHARS,
    REJECT_CODES,
    ProtocolError,
    decode_array,
    field_checker,
    plain_arrays,
    unpack_header,
)

PROTOCOL_VERSION = 2


# --------------------------------------------------------------------------------------- actors -> broker
@dataclass(frozen=True)
class Hello:
    """First message of every client: who it is (the broker's registry and dashboard table)."""

    role: str  # actor | learner | engine | launcher
    name: str
    incarnation: int = 0
    pid: int = 0
    address: str = ""
    want_welcome: bool = False  # answer with Welcome (clients that join a running run: launcher roles, actors)
    kind: Literal["hello"] = "hello"


@dataclass(frozen=True)
class Welcome:
    """Broker -> a client whose Hello asked for it (and again to actors when the engine list grows): what a
    process joining a running run needs. `engines` lists only engines serving weights recent enough to be
    used now; `config` is the run's resolved config (YAML), so joiners play the same env with the same model."""

    engines: list = field(default_factory=list)  # [str] base URLs of the vLLM servers
    weights: str = ""  # the learner's weight publisher (ZeroMQ address weight sidecars connect to) as the learner
    # last said (VersionUpdate.weights), else as the run started; "": unknown
    dashboard: str = ""  # the dashboard's URL
    learner_version: int = 0
    config: str = ""  # the run's config as YAML (agentstream.config.save)
    kind: Literal["welcome"] = "welcome"


@dataclass(frozen=True)
class GroupRequest:
    """An actor asks to start one group; the broker answers with GroupGrant once admission allows."""

    actor: str
    incarnation: int = 0
    request: int = -1  # per-incarnation request number: a resent request gets the same grant back
    groups: int = 1  # groups opened at once, one per seat of a self-play game (broker.buffer `admit`): 1 to 8
    kind: Literal["group_request"] = "group_request"


@dataclass(frozen=True)
class GroupGrant:
    """Permission to start a group: its id, the env seed its G episodes share, and the oldest policy
    version its tokens may come from (the actor waits for its engine to reach it). A request for n groups opens
    ids group_id .. group_id + n - 1, all played from `seed` (self-play: seat s's trajectories in group_id + s)."""

    group_id: int
    seed: int
    min_version: int
    request: int = -1  # the GroupRequest.request it answers
    kind: Literal["group_grant"] = "group_grant"


_NO_TOKEN_REWARDS = np.zeros(0, np.float32)  # read-only: shared by every transition without token rewards
_NO_TOKEN_REWARDS.flags.writeable = False
_NO_IMAGES = np.zeros((0, 0, 0, 0), np.uint8)  # read-only: the images of every transition without any
_NO_IMAGES.flags.writeable = False
_NO_IMAGE_SHAPES = np.zeros((0, 4), np.int32)  # read-only: the image columns of a bundle or batch without images
_NO_IMAGE_SHAPES.flags.writeable = False
_NO_IMAGE_DATA = np.zeros(0, np.uint8)
_NO_IMAGE_DATA.flags.writeable = False


ABANDON = "abandon"
"""`Transition.info` key of an abandon marker: not a step but the end of a failed attempt of its trajectory, its value
the cause ("timeout", "raised", "engine"; lower-case letters and _). Its token arrays are empty. The broker drops every
step of the trajectory (dropped as `infra_<cause>`), which frees its place in the group for a retry under a new
traj_id; with `info[ABANDON_GROUP]` true the whole group is dropped instead (the actor gave up on the episode)."""
ABANDON_GROUP = "abandon_group"


@dataclass(frozen=True)
class Transition:
    """One env step of one trajectory. The actor -> broker contract. (Or, with `info[ABANDON]`, an abandon marker.)

    `images` are the images of its prompt, in the order the prompt shows them, sent in full with every
    transition whose prompt shows them (self-contained: see the module's docstring)."""

    traj_id: str
    group_id: int
    actor: str
    step: int
    prompt_ids: np.ndarray  # [P] int32
    response_ids: np.ndarray  # [T] int32
    logprobs: np.ndarray  # [T] float32, behaviour log-probs of response_ids
    version_lo: int  # oldest policy version that may have produced a token of the response
    version_hi: int  # newest
    reward: float  # the step's whole reward, `token_rewards` included
    done: bool
    truncated: bool
    valid: bool
    anchor: str = ""  # the env's anchor observation (GiGPO step groups)
    info: dict = field(default_factory=dict)
    token_rewards: np.ndarray = field(default_factory=lambda: _NO_TOKEN_REWARDS)  # [T] float32 or [0]: the part of
    # `reward` placed on each response token (the rest sits on the last token, as a scalar score does); [0]: none
    images: np.ndarray = field(default_factory=lambda: _NO_IMAGES)  # [n, H, W, C] uint8, C in (1, 3, 4); n = 0: none
    incarnation: int = 0  # delivery key (actor, incarnation, seq): the broker acknowledges and de-duplicates
    seq: int = -1  # 0, 1, 2, ... per actor incarnation; -1: no key (never acknowledged, never de-duplicated)
    kind: Literal["transition"] = "transition"

    @classmethod
    def abandon_marker(
        cls, traj_id: str, group_id: int, actor: str, step: int, version: int, cause: str, whole_group: bool
    ) -> Transition:
        """The abandon marker (ABANDON) that ends a failed attempt of `traj_id` after its `step` sent steps,
        or with `whole_group` its whole group; `version`: the group's grant's min_version."""
        empty_ids = np.zeros(0, np.int32)
        return cls(
            traj_id=traj_id,
            group_id=group_id,
            actor=actor,
            step=step,
            prompt_ids=empty_ids,
            response_ids=empty_ids,
            logprobs=np.zeros(0, np.float32),
            version_lo=version,
            version_hi=version,
            reward=0.0,
            done=False,
            truncated=False,
            valid=False,
            info={ABANDON: cause, ABANDON_GROUP: whole_group},
        )


TRANSITION_ITEM_FIELDS = (
    "traj_id",
    "group_id",
    "step",
    "version_lo",
    "version_hi",
    "reward",
    "done",
    "truncated",
    "valid",
    "anchor",
    "info",
    "seq",
)
"""A Transition's header fields as one item of `Transitions.items` (positional, in this order)."""
MAX_BUNDLE = 4096
"""Transitions in one `Transitions` message at most."""


@dataclass(frozen=True)
class Transitions:
    """Actor -> broker: consecutive transitions of one actor incarnation in one message, taken by the broker
    one after another exactly as if they had come one by one (one receive, one header and one pass of
    checks for all of them; bench/broker.py).

    Columnar: item i's scalar fields are `items[i]` (TRANSITION_ITEM_FIELDS order); its token arrays are
    slices of the concatenated arrays, cut by `prompt_lens` and `response_lens`; its images are the next
    n*H*W*C bytes of `image_data`, (n, H, W, C) = `image_shapes[i]`."""

    actor: str
    incarnation: int
    items: list  # [N] lists, TRANSITION_ITEM_FIELDS order
    prompt_lens: np.ndarray  # [N] int32
    response_lens: np.ndarray  # [N] int32
    prompt_ids: np.ndarray  # [sum(prompt_lens)] int32
    response_ids: np.ndarray  # [sum(response_lens)] int32
    logprobs: np.ndarray  # [sum(response_lens)] float32
    token_rewards: np.ndarray = field(default_factory=lambda: _NO_TOKEN_REWARDS)  # [sum(response_lens)] or [0]: none
    image_shapes: np.ndarray = field(default_factory=lambda: _NO_IMAGE_SHAPES)  # [N, 4] int32 or [0, 4]: no images
    image_data: np.ndarray = field(default_factory=lambda: _NO_IMAGE_DATA)  # [B] uint8
    kind: Literal["transitions"] = "transitions"

    @classmethod
    def of(cls, ts: list[Transition]) -> Transitions:
        """Bundle `ts` (one actor incarnation, at least one)."""
        first = ts[0]
        if any(t.actor != first.actor or t.incarnation != first.incarnation for t in ts):
            raise ValueError("a Transitions message holds one actor incarnation's transitions")
        image_shapes, image_data = image_columns(ts)
        return cls(
            actor=first.actor,
            incarnation=first.incarnation,
            items=[[getattr(t, f) for f in TRANSITION_ITEM_FIELDS] for t in ts],
            prompt_lens=np.array([t.prompt_ids.size for t in ts], np.int32),
            response_lens=np.array([t.response_ids.size for t in ts], np.int32),
            prompt_ids=np.concatenate([t.prompt_ids for t in ts]).astype(np.int32, copy=False),
            response_ids=np.concatenate([t.response_ids for t in ts]).astype(np.int32, copy=False),
            logprobs=np.concatenate([t.logprobs for t in ts]).astype(np.float32, copy=False),
            token_rewards=token_rewards_column(ts),
            image_shapes=image_shapes,
            image_data=image_data,
        )

    def split(self) -> list[Transition]:
        """The transitions, in order (their arrays view this message's).

        perf (bench/broker.py): each is made by filling its `__dict__`, not through the frozen
        dataclass's `__init__` (an `object.__setattr__` per field); the same object, as a test checks
        against `Transition(...)` for every field."""
        out, p, r = [], 0, 0
        new = object.__new__
        per_token = self.token_rewards.size > 0
        images = (
            cut_images(self.image_shapes, self.image_data) if self.image_shapes.size else itertools.repeat(_NO_IMAGES)
        )
        for item, n_p, n_r, imgs in zip(self.items, self.prompt_lens.tolist(), self.response_lens.tolist(), images):
            t = new(Transition)
            fields = t.__dict__
            fields.update(zip(TRANSITION_ITEM_FIELDS, item))
            fields.update(
                actor=self.actor,
                incarnation=self.incarnation,
                prompt_ids=self.prompt_ids[p : p + n_p],
                response_ids=self.response_ids[r : r + n_r],
                logprobs=self.logprobs[r : r + n_r],
                token_rewards=self.token_rewards[r : r + n_r] if per_token else _NO_TOKEN_REWARDS,
                images=imgs,
                kind="transition",
            )
            out.append(t)
            p, r = p + n_p, r + n_r
        return out


def token_rewards_column(ts: list[Transition]) -> np.ndarray:
    """The token rewards of `ts` end to end, one per response token (0 where a transition has none); [0] when
    none of them has any (a bundle or batch without token rewards carries an empty array)."""
    if not any(t.token_rewards.size for t in ts):
        return _NO_TOKEN_REWARDS
    return np.concatenate(
        [t.token_rewards if t.token_rewards.size else np.zeros(t.response_ids.size, np.float32) for t in ts]
    ).astype(np.float32, copy=False)


def image_columns(ts: list[Transition]) -> tuple[np.ndarray, np.ndarray]:
    """The images of `ts` as a bundle's or batch's columns: (n, H, W, C) of each [N, 4] and all their bytes end
    to end [B]; both empty when none of them has an image."""
    if not any(t.images.size for t in ts):
        return _NO_IMAGE_SHAPES, _NO_IMAGE_DATA
    if any(t.images.ndim != 4 or t.images.dtype != np.uint8 for t in ts):
        raise ValueError("Transition.images must be a uint8 array [n, H, W, C] (n = 0: none)")
    return np.array([t.images.shape for t in ts], np.int32), np.concatenate([t.images.reshape(-1) for t in ts])


def cut_images(shapes: np.ndarray, data: np.ndarray) -> list[np.ndarray]:
    """Inverse of `image_columns`: each transition's images [n, H, W, C] (views of `data`; none: [0, 0, 0, 0])."""
    out, start = [], 0
    for shape in shapes.tolist():  # Python ints: cheaper than numpy's for the few rows of a bundle
        end = start + shape[0] * shape[1] * shape[2] * shape[3]
        out.append(data[start:end].reshape(shape) if end > start else _NO_IMAGES)
        start = end
    return out


@dataclass(frozen=True)
class Ack:
    """Broker -> actor: every transition of this incarnation with seq <= `upto` is in the broker's log.

    Cumulative (go-back-N): the broker takes seq n only after n-1, so the actor resends from upto+1."""

    actor: str
    incarnation: int
    upto: int
    kind: Literal["ack"] = "ack"


@dataclass(frozen=True)
class Stats:
    """Counters (monotonic totals since the process started) and gauges (current values) of one process."""

    source: str
    role: str
    counters: dict = field(default_factory=dict)
    gauges: dict = field(default_factory=dict)
    final: bool = False  # the process is exiting; these are its last numbers
    kind: Literal["stats"] = "stats"


# --------------------------------------------------------------------------------------- learner <-> broker
@dataclass(frozen=True)
class BatchRequest:
    """Learner rank `rank` asks for its share of global batch `step`."""

    step: int
    rank: int
    world_size: int
    kind: Literal["batch_request"] = "batch_request"


@dataclass(frozen=True)
class Batch:
    """One rank's share of a global batch: whole groups, columnar.

    Per transition i: its group (0..n_groups-1 within this share), trajectory (0..n_trajs-1), step index,
    reward, flags and version interval; token arrays are concatenated, split by the length arrays; its
    prompt's images are `images_of(i)` ((n, H, W, C) = `image_shapes[i]`, their bytes the next of `image_data`).
    """

    step: int
    rank: int
    learner_version: int  # the learner's version when the batch was formed
    group_size: int
    group_index: np.ndarray  # [N] int32
    traj_index: np.ndarray  # [N] int32
    step_index: np.ndarray  # [N] int32
    prompt_lens: np.ndarray  # [N] int32
    response_lens: np.ndarray  # [N] int32
    rewards: np.ndarray  # [N] float32
    dones: np.ndarray  # [N] bool (done or truncated: last step of its trajectory)
    valid: np.ndarray  # [N] bool
    version_lo: np.ndarray  # [N] int32
    version_hi: np.ndarray  # [N] int32
    prompt_ids: np.ndarray  # [S] int32
    response_ids: np.ndarray  # [R] int32
    logprobs: np.ndarray  # [R] float32
    anchors: list = field(default_factory=list)  # [N] str
    token_rewards: np.ndarray = field(default_factory=lambda: _NO_TOKEN_REWARDS)  # [R] float32, or [0]: none
    image_shapes: np.ndarray = field(default_factory=lambda: _NO_IMAGE_SHAPES)  # [N, 4] int32, or [0, 4]: no images
    image_data: np.ndarray = field(default_factory=lambda: _NO_IMAGE_DATA)  # [B] uint8
    kind: Literal["batch"] = "batch"

    @functools.cached_property
    def _images(self) -> list[np.ndarray]:
        return cut_images(self.image_shapes, self.image_data)

    def images_of(self, i: int) -> np.ndarray:
        """Transition i's images [n, H, W, C] uint8, in its prompt's order (a view of `image_data`);
        [0, 0, 0, 0]: none."""
        return self._images[i] if self.image_shapes.size else _NO_IMAGES


@dataclass(frozen=True)
class VersionUpdate:
    """Learner rank 0 -> broker: the policy version after an optimizer step, with the step's metrics (and where the
    learner's weights are published, which the broker's Welcome passes on)."""

    version: int
    metrics: dict = field(default_factory=dict)
    checkpointed: int = -1  # newest version durably checkpointed: the broker may forget batches before it
    resumed: bool = False  # the learner restarted from a checkpoint at `version` (it may be lower than before)
    weights: str = ""  # where rank 0 publishes weights now (tcp://HOST:PORT, as Welcome.weights); "": not said. A
    # learner placed again elsewhere tells the broker so, which tells processes that join (and sidecars that ask)
    kind: Literal["version_update"] = "version_update"


# --------------------------------------------------------------------------------------- weights
@dataclass(frozen=True)
class EngineStatus:
    """Weight sidecar -> broker (and -> learner): the policy version its engine serves now."""

    engine: str
    url: str
    version: int
    epoch: int = 0  # WeightUpdate.epoch of the weights it runs (0: its initial weights)
    link: int = 0  # times its connection to the learner was made (0: not yet); what was queued on an older one is lost
    workers: int = 0  # its server's workers that take streamed weights (engines.weight_sync=stream); 0: files only
    group: int = 0  # the learner's weight group its workers are in (WeightUpdate format "stream_join"); 0: none
    kind: Literal["engine_status"] = "engine_status"


@dataclass(frozen=True)
class WeightUpdate:
    """Learner rank 0 -> weight sidecar: the weights of policy `version`, as one safetensors file, or what to do
    to take them from the learner's weight group.

    format "safetensors": full weights (HF key names). "peft_adapter": only a LoRA adapter, keyed as peft's
    adapter_model.safetensors, with its adapter_config.json text in the file's metadata
    (`learner.publish.serialize_adapter`). Streamed weights (`agentstream.weights`), payload a JSON object:
    "stream_join": join the group (`engines.worker_ext.StreamInit` fields, and "group": its number);
    "stream": take `version` from the group's broadcast (`agentstream.weights.StreamLayout` fields, and "group")."""

    version: int
    payload: bytes  # a safetensors file, or JSON for the stream formats
    format: str = "safetensors"  # "safetensors" | "peft_adapter" | "stream_join" | "stream"
    epoch: int = 0  # the publishing learner process: a restarted learner's older version still replaces newer ones
    kind: Literal["weight_update"] = "weight_update"


# --------------------------------------------------------------------------------------- errors
@dataclass(frozen=True)
class Reject:
    """Broker -> client: the request was refused; `reason` says why and how to fix it."""

    reason: str
    step: int = -1  # the refused BatchRequest's step (-1: not a batch request): a refused resend of an answered
    # request reaches a learner that has moved on, which tells it from a refusal of its current request
    kind: Literal["reject"] = "reject"


Message = Union[
    Hello,
    Welcome,
    GroupRequest,
    GroupGrant,
    Transition,
    Transitions,
    Ack,
    Stats,
    BatchRequest,
    Batch,
    VersionUpdate,
    EngineStatus,
    WeightUpdate,
    Reject,
]
_KINDS: dict[str, type] = {cls.__dataclass_fields__["kind"].default: cls for cls in typing.get_args(Message)}


def _field_specs(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


_SPECS = {kind: _field_specs(cls) for kind, cls in _KINDS.items()}
_FIELD_NAMES = {cls: tuple(f.name for f in dataclasses.fields(cls)) for cls in _KINDS.values()}
_PLAIN_DEFAULTS: dict[str, dict[str, Any] | None] = {
    kind: None
    if any(f.default_factory is not dataclasses.MISSING for f in dataclasses.fields(cls))
    else {f.name: f.default for f in dataclasses.fields(cls) if f.default is not dataclasses.MISSING}
    for kind, cls in _KINDS.items()
}
"""Each kind's field defaults, for decoding without `__init__`; None for a kind with a default factory
(a fresh dict or list per message), which is made by its `__init__`."""
_REQUIRED = {
    kind: {
        f.name
        for f in dataclasses.fields(cls)
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    }
    for kind, cls in _KINDS.items()
}


def _array_dtype_name(arr: np.ndarray) -> str:
    for name, dt in ARRAY_DTYPES.items():
        if arr.dtype == dt or (arr.dtype.kind == dt.kind and arr.dtype.itemsize == dt.itemsize):
            return name
    raise ProtocolError(f"array dtype {arr.dtype} cannot be sent; use one of {sorted(ARRAY_DTYPES)}")


_OMITTED_WHEN_EMPTY = frozenset({"images", "image_shapes", "image_data"})
"""Array fields `encode` leaves out when they hold nothing (decoded as their defaults): text costs nothing extra."""
ZERO_COPY_MIN_BYTES = 65536
"""A frame this large is sent without copying; below it pyzmq's zero-copy path costs more than the copy
(measured here: ~3x per small message, bench/broker.py), so such messages are copied."""


def copy_when_sending(frames: Sequence[bytes | bytearray | memoryview]) -> bool:
    """pyzmq's `copy=` for `send_multipart(frames)`: False (zero-copy) only when a frame is large."""
    return not any(len(f) >= ZERO_COPY_MIN_BYTES for f in frames)


def encode(msg: Message) -> list[bytes | bytearray | memoryview]:
    """A message -> frames. Arrays and bytes go as raw frames, without copying when contiguous."""
    header: dict[str, Any] = {"v": PROTOCOL_VERSION}
    arrays: list[list[Any]] = []
    frames: list[bytes | bytearray | memoryview] = [b""]
    values = msg.__dict__
    for name in _FIELD_NAMES[type(msg)]:
        value = values[name]
        if isinstance(value, np.ndarray):
            if name in _OMITTED_WHEN_EMPTY and not value.size:
                continue
            dtype = _array_dtype_name(value)
            arr = np.ascontiguousarray(value, dtype=ARRAY_DTYPES[dtype])
            arrays.append([name, dtype, list(arr.shape)])
            # An ndarray has the buffer protocol; numpy's stub declares its __buffer__ only for Python 3.12+.
            frames.append(memoryview(arr).cast("B") if arr.size else b"")  # type: ignore[arg-type]
        elif isinstance(value, (bytes, bytearray, memoryview)):
            arrays.append([name, "bytes", [len(value)]])
            frames.append(value)
        else:
            header[name] = value
    header["_arrays"] = arrays
    frames[0] = msgpack.packb(header, use_bin_type=True)
    return frames


def decode(frames: Sequence[bytes | memoryview | Any], max_bytes: int | None = None) -> Message:
    """Frames -> a message. Raises ProtocolError on anything malformed (never another exception).

    Beyond the shape of the message, every value is checked by its type (`agentstream.wire.fields.field_checker`): ints
    within [-1, 2**31-1] (int64 for ids and seeds), finite floats, bounded strings, dicts and lists of scalars,
    arrays of the field's dtype and dimensions (1-D but for `images` [n, H, W, C] and `image_shapes` [N, 4]). What
    depends on the run (vocabulary, context length, image bytes) is checked by `agentstream.wire.limits.check_limits`.
    msgpack builds nothing larger than the header limits, and no ext types."""
    bufs = [f.buffer if hasattr(f, "buffer") else f for f in frames]  # zmq.Frame -> memoryview
    if not bufs:
        raise ProtocolError("empty message (no frames)", "bad_frames")
    if max_bytes is not None:
        size = sum(len(b) for b in bufs)
        if size > max_bytes:
            raise ProtocolError(
                f"message of {size} bytes exceeds the limit of {max_bytes} (broker.max_message_bytes)", "oversized"
            )
    header = unpack_header(bufs[0])
    if header.get("v") != PROTOCOL_VERSION:
        raise ProtocolError(
            f"protocol version {str(header.get('v'))[:20]!r} is not {PROTOCOL_VERSION}: sender and receiver run "
            f"different agentstream versions",
            "bad_version",
        )
    kind = header.get("kind")
    plain = _PLAIN_DECODERS.get(kind) if isinstance(kind, str) else None
    if plain is not None:
        fast = plain(header, bufs)
        if fast is not None:
            return fast
    cls = _KINDS.get(kind) if isinstance(kind, str) else None
    if cls is None or not isinstance(kind, str):  # kind is a str whenever cls was found: narrows it
        raise ProtocolError(f"unknown message kind {str(kind)[:40]!r}; known: {sorted(_KINDS)}", "unknown_kind")
    specs, checkers = _SPECS[kind], _CHECKERS[kind]
    values: dict[str, Any] = {}
    for name, value in header.items():
        if name in ("v", "_arrays"):
            continue
        check = checkers.get(name)
        if check is None:
            raise ProtocolError(f"{kind}: unknown field {str(name)[:40]!r}", "unknown_field")
        check(value)
        values[name] = value
    arrays = header.get("_arrays", [])
    if not isinstance(arrays, list) or len(arrays) != len(bufs) - 1:
        raise ProtocolError(
            f"{kind}: header announces {len(arrays) if isinstance(arrays, list) else '?'} arrays "
            f"but {len(bufs) - 1} data frames came",
            "bad_frames",
        )
    for spec, buf in zip(arrays, bufs[1:]):
        name, value = decode_array(kind, specs, spec, buf)
        values[name] = value
    missing = _REQUIRED[kind] - values.keys()
    if missing:
        raise ProtocolError(f"{kind}: missing fields {sorted(missing)}", "missing_field")
    defaults = _PLAIN_DEFAULTS[kind]
    if defaults is None:
        return cls(**values)
    msg: Message = object.__new__(cls)  # what the frozen dataclass's __init__ makes, without a setattr per field
    msg.__dict__.update(defaults)
    msg.__dict__.update(values)
    return msg


def _check_items(where: str, value: Any) -> None:
    """`Transitions.items`: each item a list of a Transition's header fields, each checked as in a Transition."""
    if not isinstance(value, list) or not 1 <= len(value) <= MAX_BUNDLE:
        raise ProtocolError(
            f"{where}: expected a list of 1..{MAX_BUNDLE} items",
            "bad_type" if not isinstance(value, list) else "too_long",
        )
    checks = [_CHECKERS["transition"][f] for f in TRANSITION_ITEM_FIELDS]
    for item in value:
        if _plainly_valid(item):
            continue
        if not isinstance(item, list) or len(item) != len(checks):
            raise ProtocolError(
                f"{where}: an item must list the {len(checks)} fields {TRANSITION_ITEM_FIELDS}", "bad_type"
            )
        for check, field_value in zip(checks, item):
            check(field_value)


_TRANSITIONS_ARRAYS = (
    ("prompt_lens", "int32"),
    ("response_lens", "int32"),
    ("prompt_ids", "int32"),
    ("response_ids", "int32"),
    ("logprobs", "float32"),
    ("token_rewards", "float32"),
    ("image_shapes", "int32"),
    ("image_data", "uint8"),
)
"""A Transitions message's data frames as `encode` writes them: (field, dtype), in this order."""
_NO_BUNDLE_IMAGES = {"image_shapes": _NO_IMAGE_SHAPES, "image_data": _NO_IMAGE_DATA}
"""The last fields of `_TRANSITIONS_ARRAYS`, left out of a bundle without images, and their values then."""


def _plain_transitions(header: dict[str, Any], bufs: list[Any]) -> Transitions | None:
    """perf (bench/broker.py): the usual Transitions message, decoded in one pass of plain checks (no
    per-field dispatch); None sends anything unusual through `decode`'s general path, which accepts exactly
    what this accepts and says what is wrong with the rest."""
    actor, incarnation, items = header.get("actor"), header.get("incarnation"), header.get("items")
    # 6: v, kind, _arrays and the 3 header fields, every one present
    if not (
        len(header) == 6
        and type(actor) is str
        and len(actor) <= MAX_NAME_CHARS
        and type(incarnation) is int
        and -1 <= incarnation <= INT32_MAX
        and type(items) is list
        and 1 <= len(items) <= MAX_BUNDLE
        and all(map(_plainly_valid, items))
    ):
        return None
    msg = object.__new__(Transitions)
    values = msg.__dict__
    if not plain_arrays(_TRANSITIONS_ARRAYS, header.get("_arrays"), bufs, values, _NO_BUNDLE_IMAGES):
        return None
    values.update(actor=actor, incarnation=incarnation, items=items, kind="transitions")
    return msg


_TRANSITION_ARRAYS = (*_TRANSITIONS_ARRAYS[2:6], ("images", "uint8"))
"""A Transition message's data frames as `encode` writes them."""
_NO_TRANSITION_IMAGES = {"images": _NO_IMAGES}


def _plain_transition(header: dict[str, Any], bufs: list[Any]) -> Transition | None:
    """perf (bench/broker.py --one-per-message; an actor sends a lone step as a Transition): the usual
    Transition message, its header fields checked as one item of a bundle (`_plainly_valid`, the same checks);
    None sends anything unusual through `decode`'s general path."""
    if len(header) != 17:  # v, kind, _arrays and the 14 header fields, every one present
        return None
    actor, incarnation = header.get("actor"), header.get("incarnation")
    item = [header.get(f) for f in TRANSITION_ITEM_FIELDS]
    if not (
        type(actor) is str
        and len(actor) <= MAX_NAME_CHARS
        and type(incarnation) is int
        and -1 <= incarnation <= INT32_MAX
        and _plainly_valid(item)
    ):
        return None
    msg = object.__new__(Transition)
    values = msg.__dict__
    if not plain_arrays(_TRANSITION_ARRAYS, header.get("_arrays"), bufs, values, _NO_TRANSITION_IMAGES):
        return None
    values.update(zip(TRANSITION_ITEM_FIELDS, item))
    values.update(actor=actor, incarnation=incarnation, kind="transition")
    return msg


_PLAIN_DECODERS = {"transitions": _plain_transitions, "transition": _plain_transition}
"""The kinds a broker receives most, decoded by plain checks first (`decode` falls back when they say None)."""


def _plainly_valid(item: Any) -> bool:
    """True for an item that every check of `_check_items` accepts, decided in one expression (the
    usual case); False sends it through those checks, which then say what is wrong. Never looser than them."""
    if type(item) is not list or len(item) != 12:
        return False
    traj_id, group_id, step, lo, hi, reward, done, truncated, valid, anchor, info, seq = item
    return (
        type(traj_id) is str
        and len(traj_id) <= MAX_NAME_CHARS
        and type(group_id) is int
        and 0 <= group_id < 2**63
        and type(step) is int
        and 0 <= step <= INT32_MAX
        and type(lo) is int
        and 0 <= lo <= INT32_MAX
        and type(hi) is int
        and 0 <= hi <= INT32_MAX
        and type(reward) is float
        and math.isfinite(reward)
        and type(done) is bool
        and type(truncated) is bool
        and type(valid) is bool
        and type(anchor) is str
        and len(anchor) <= MAX_TEXT_CHARS
        and type(seq) is int
        and -1 <= seq <= INT32_MAX
        and type(info) is dict
        and len(info) <= MAX_DICT_ITEMS
        and all(
            type(k) is str
            and len(k) <= MAX_NAME_CHARS
            and (
                v is None
                or type(v) is bool
                or (type(v) is int and -(2**63) <= v <= 2**63)
                or (type(v) is float and math.isfinite(v))
                or (type(v) is str and len(v) <= MAX_TEXT_CHARS)
            )
            for k, v in info.items()
        )
    )


_CHECKERS: dict[str, dict[str, Callable[[Any], None]]] = {
    kind: {name: field_checker(kind, name, hint) for name, hint in specs.items()} for kind, specs in _SPECS.items()
}
_CHECKERS["transitions"]["items"] = lambda value: _check_items("transitions.items", value)


__all__ = [
    "ABANDON",
    "ABANDON_GROUP",
    "PROTOCOL_VERSION",
    "REJECT_CODES",
    "MAX_DICT_ITEMS",
    "MAX_LIST_ITEMS",
    "MAX_NAME_CHARS",
    "MAX_TEXT_CHARS",
    "Message",
    "ProtocolError",
    "encode",
    "decode",
    *(c.__name__ for c in typing.get_args(Message)),
]
