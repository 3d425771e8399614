"""The wire protocol: every message that crosses a socket, and the only code that knows its bytes.

A message is a list of ZeroMQ frames:

    frame 0      msgpack header {"v": PROTOCOL_VERSION, "kind": ..., <scalar fields>,
                                  "_arrays": [[field, dtype, shape], ...]}
    frame 1..n   one raw little-endian buffer per array (or bytes) field, in `_arrays` order

Token ids and log-probs are numpy arrays sent as raw frames (zero-copy above ~64 kB); nothing is ever
pickled. `decode` validates everything it is given and raises `ProtocolError` saying what was wrong, so a
receiver can count the bad message and keep serving.

Shapes: T = tokens of one response, P = tokens of one prompt, N = transitions in a batch,
S = sum of prompt lengths in a batch, R = sum of response lengths in a batch.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Union

import msgpack
import numpy as np

PROTOCOL_VERSION = 1

# Arrays travel as these dtypes, little-endian, whatever the sender's platform.
_ARRAY_DTYPES = {"int32": np.dtype("<i4"), "float32": np.dtype("<f4"), "uint8": np.dtype("u1"), "bool": np.dtype("?")}


class ProtocolError(ValueError):
    """A message that cannot be decoded or is not valid; the text says which part was wrong, and `code`
    names the kind of fault in one word (receivers count rejections by it; see REJECT_CODES)."""

    def __init__(self, message: str, code: str = "malformed"):
        super().__init__(message)
        self.code = code


REJECT_CODES = {
    "oversized": "larger than the receiver's limit (broker.max_message_bytes)",
    "bad_frames": "no frames, or not as many data frames as the header announces",
    "bad_header": "frame 0 is not a msgpack map within the header limits (no ext types)",
    "bad_version": "another PROTOCOL_VERSION",
    "unknown_kind": "a kind no message has",
    "unknown_field": "a field the kind does not have",
    "missing_field": "a required field is absent",
    "bad_type": "a field of the wrong type",
    "bad_array": "a malformed array descriptor, shape or size",
    "bad_dtype": "an array of the wrong dtype",
    "too_long": "a string, dict, list or token sequence over its limit",
    "non_finite": "nan or inf where a finite number is needed",
    "out_of_range": "a number outside what the field can mean",
    "out_of_vocab": "a token id outside the model's vocabulary",
    "inconsistent": "fields that contradict each other (e.g. lengths)",
    "not_accepted": "a valid message this receiver does not take",
}
"""Every `ProtocolError.code`, with what it means."""


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
    weights: str = ""  # the learner's weight publisher (ZeroMQ address weight agents connect to); "": unknown
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
    kind: Literal["group_request"] = "group_request"


@dataclass(frozen=True)
class GroupGrant:
    """Permission to start a group: its id, the env seed its G episodes share, and the oldest policy
    version its tokens may come from (the actor waits for its engine to reach it)."""

    group_id: int
    seed: int
    min_version: int
    request: int = -1  # the GroupRequest.request it answers
    kind: Literal["group_grant"] = "group_grant"


@dataclass(frozen=True)
class Transition:
    """One env step of one trajectory (contract 1)."""

    traj_id: str
    group_id: int
    actor: str
    step: int
    prompt_ids: np.ndarray  # [P] int32
    response_ids: np.ndarray  # [T] int32
    logprobs: np.ndarray  # [T] float32, behaviour log-probs of response_ids
    version_lo: int  # oldest policy version that may have produced a token of the response
    version_hi: int  # newest
    reward: float
    done: bool
    truncated: bool
    valid: bool
    anchor: str = ""  # the env's anchor observation (GiGPO step groups)
    info: dict = field(default_factory=dict)
    incarnation: int = 0  # delivery key (actor, incarnation, seq): the broker acknowledges and de-duplicates
    seq: int = -1  # 0, 1, 2, ... per actor incarnation; -1: no key (never acknowledged, never de-duplicated)
    kind: Literal["transition"] = "transition"


TRANSITION_ITEM_FIELDS = ("traj_id", "group_id", "step", "version_lo", "version_hi", "reward", "done", "truncated",
                          "valid", "anchor", "info", "seq")
"""A Transition's header fields as one item of `Transitions.items` (positional, in this order)."""
MAX_BUNDLE = 4096
"""Transitions in one `Transitions` message at most."""


@dataclass(frozen=True)
class Transitions:
    """Actor -> broker: consecutive transitions of one actor incarnation in one message, taken by the broker
    one after another exactly as if they had come one by one (perf: one receive, one header and one pass of
    checks for all of them; scripts/bench_broker.py).

    Columnar: item i's scalar fields are `items[i]` (TRANSITION_ITEM_FIELDS order); its token arrays are
    slices of the concatenated arrays, cut by `prompt_lens` and `response_lens`."""

    actor: str
    incarnation: int
    items: list  # [N] lists, TRANSITION_ITEM_FIELDS order
    prompt_lens: np.ndarray  # [N] int32
    response_lens: np.ndarray  # [N] int32
    prompt_ids: np.ndarray  # [sum(prompt_lens)] int32
    response_ids: np.ndarray  # [sum(response_lens)] int32
    logprobs: np.ndarray  # [sum(response_lens)] float32
    kind: Literal["transitions"] = "transitions"

    @classmethod
    def of(cls, ts: list[Transition]) -> Transitions:
        """Bundle `ts` (one actor incarnation, at least one)."""
        first = ts[0]
        if any(t.actor != first.actor or t.incarnation != first.incarnation for t in ts):
            raise ValueError("a Transitions message holds one actor incarnation's transitions")
        return cls(
            actor=first.actor, incarnation=first.incarnation,
            items=[[getattr(t, f) for f in TRANSITION_ITEM_FIELDS] for t in ts],
            prompt_lens=np.array([t.prompt_ids.size for t in ts], np.int32),
            response_lens=np.array([t.response_ids.size for t in ts], np.int32),
            prompt_ids=np.concatenate([t.prompt_ids for t in ts]).astype(np.int32, copy=False),
            response_ids=np.concatenate([t.response_ids for t in ts]).astype(np.int32, copy=False),
            logprobs=np.concatenate([t.logprobs for t in ts]).astype(np.float32, copy=False))

    def split(self) -> list[Transition]:
        """The transitions, in order (their arrays view this message's).

        perf (scripts/bench_broker.py): each is made by filling its `__dict__`, not through the frozen
        dataclass's `__init__` (an `object.__setattr__` per field); the same object, as a test checks
        against `Transition(...)` for every field."""
        out, p, r = [], 0, 0
        new = object.__new__
        for item, n_p, n_r in zip(self.items, self.prompt_lens.tolist(), self.response_lens.tolist()):
            t = new(Transition)
            fields = t.__dict__
            fields.update(zip(TRANSITION_ITEM_FIELDS, item))
            fields.update(actor=self.actor, incarnation=self.incarnation, prompt_ids=self.prompt_ids[p:p + n_p],
                          response_ids=self.response_ids[r:r + n_r], logprobs=self.logprobs[r:r + n_r],
                          kind="transition")
            out.append(t)
            p, r = p + n_p, r + n_r
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
    """One rank's share of a global batch: whole groups, columnar (contract 3).

    Per transition i: its group (0..n_groups-1 within this share), trajectory (0..n_trajs-1), step index,
    reward, flags and version interval; token arrays are concatenated, split by the length arrays.
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
    kind: Literal["batch"] = "batch"


@dataclass(frozen=True)
class VersionUpdate:
    """Learner rank 0 -> broker: the policy version after an optimizer step, with the step's metrics."""

    version: int
    metrics: dict = field(default_factory=dict)
    checkpointed: int = -1  # newest version durably checkpointed: the broker may forget batches before it
    resumed: bool = False  # the learner restarted from a checkpoint at `version` (it may be lower than before)
    kind: Literal["version_update"] = "version_update"


# --------------------------------------------------------------------------------------- weights
@dataclass(frozen=True)
class EngineStatus:
    """Weight agent -> broker (and -> learner): the policy version its engine serves now."""

    engine: str
    url: str
    version: int
    epoch: int = 0  # WeightUpdate.epoch of the weights it runs (0: its initial weights)
    kind: Literal["engine_status"] = "engine_status"


@dataclass(frozen=True)
class WeightUpdate:
    """Learner rank 0 -> weight agent: the weights of policy `version`, as one safetensors file.

    format "safetensors": full weights (HF key names). "peft_adapter": only a LoRA adapter, keyed as peft's
    adapter_model.safetensors, with its adapter_config.json text in the file's metadata
    (`engines.weights.serialize_adapter`)."""

    version: int
    payload: bytes  # a safetensors file
    format: str = "safetensors"  # "safetensors" | "peft_adapter"
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
    Hello, Welcome, GroupRequest, GroupGrant, Transition, Transitions, Ack, Stats, BatchRequest, Batch, VersionUpdate,
    EngineStatus, WeightUpdate, Reject,
]
_KINDS: dict[str, type] = {cls.__dataclass_fields__["kind"].default: cls for cls in typing.get_args(Message)}


def _field_specs(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


_SPECS = {kind: _field_specs(cls) for kind, cls in _KINDS.items()}
_REQUIRED = {
    kind: {
        f.name for f in dataclasses.fields(cls)
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    }
    for kind, cls in _KINDS.items()
}
_SCALAR_TYPES: dict[Any, tuple[type, ...]] = {
    int: (int,), float: (float, int), bool: (bool,), str: (str,), dict: (dict,), list: (list,),
}


def _array_dtype_name(arr: np.ndarray) -> str:
    for name, dt in _ARRAY_DTYPES.items():
        if arr.dtype == dt or (arr.dtype.kind == dt.kind and arr.dtype.itemsize == dt.itemsize):
            return name
    raise ProtocolError(f"array dtype {arr.dtype} cannot be sent; use one of {sorted(_ARRAY_DTYPES)}")


ZERO_COPY_MIN_BYTES = 65536
"""A frame this large is sent without copying; below it pyzmq's zero-copy path costs more than the copy
(measured here: ~3x per small message, scripts/bench_broker.py), so such messages are copied."""


def copy_when_sending(frames: list[bytes | memoryview]) -> bool:
    """pyzmq's `copy=` for `send_multipart(frames)`: False (zero-copy) only when a frame is large."""
    return not any(len(f) >= ZERO_COPY_MIN_BYTES for f in frames)


def encode(msg: Message) -> list[bytes | memoryview]:
    """A message -> frames. Arrays and bytes go as raw frames, without copying when contiguous."""
    header: dict[str, Any] = {"v": PROTOCOL_VERSION}
    arrays: list[list[Any]] = []
    frames: list[bytes | memoryview] = [b""]
    for f in dataclasses.fields(msg):
        value = getattr(msg, f.name)
        if isinstance(value, np.ndarray):
            name = _array_dtype_name(value)
            arr = np.ascontiguousarray(value, dtype=_ARRAY_DTYPES[name])
            arrays.append([f.name, name, list(arr.shape)])
            frames.append(memoryview(arr).cast("B") if arr.size else b"")
        elif isinstance(value, (bytes, bytearray, memoryview)):
            arrays.append([f.name, "bytes", [len(value)]])
            frames.append(value)
        else:
            header[f.name] = value
    header["_arrays"] = arrays
    frames[0] = msgpack.packb(header, use_bin_type=True)
    return frames


def decode(frames: list[bytes | memoryview | Any], max_bytes: int | None = None) -> Message:
    """Frames -> a message. Raises ProtocolError on anything malformed (never another exception).

    Beyond the shape of the message, every value is checked by its type (`_check_field`): ints within
    [-1, 2**31-1] (int64 for ids and seeds), finite floats, bounded strings, dicts and lists of scalars, 1-D
    arrays of the field's dtype. What depends on the run (vocabulary, context length) is checked by
    `broker.validation.validate`. msgpack builds nothing larger than the header limits, and no ext types."""
    bufs = [f.buffer if hasattr(f, "buffer") else f for f in frames]  # zmq.Frame -> memoryview
    if not bufs:
        raise ProtocolError("empty message (no frames)", "bad_frames")
    if max_bytes is not None:
        size = sum(len(b) for b in bufs)
        if size > max_bytes:
            raise ProtocolError(f"message of {size} bytes exceeds the limit of {max_bytes} "
                                f"(broker.max_message_bytes)", "oversized")
    header = _unpack_header(bufs[0])
    if header.get("v") != PROTOCOL_VERSION:
        raise ProtocolError(
            f"protocol version {str(header.get('v'))[:20]!r} is not {PROTOCOL_VERSION}: sender and receiver run "
            f"different agentstream versions", "bad_version"
        )
    kind = header.get("kind")
    cls = _KINDS.get(kind) if isinstance(kind, str) else None
    if cls is None:
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
        raise ProtocolError(f"{kind}: header announces {len(arrays) if isinstance(arrays, list) else '?'} arrays "
                            f"but {len(bufs) - 1} data frames came", "bad_frames")
    for spec, buf in zip(arrays, bufs[1:]):
        name, value = _decode_array(kind, specs, spec, buf)
        values[name] = value
    missing = _REQUIRED[kind] - values.keys()
    if missing:
        raise ProtocolError(f"{kind}: missing fields {sorted(missing)}", "missing_field")
    return cls(**values)


# Header limits. A header holds scalars, names, some free text (anchors, reasons, a config) and small dicts;
# msgpack refuses anything larger before building it, so a few bytes can never declare a huge object.
MAX_NAME_CHARS = 256
"""Ids and names (traj_id, actor, source, role, engine, name, format) and every dict key."""
MAX_TEXT_CHARS = 1 << 20
"""Any other string (anchor observations, reasons, URLs, a YAML config)."""
MAX_DICT_ITEMS = 1024
"""Entries of one dict field (stats counters/gauges, metrics, info)."""
MAX_LIST_ITEMS = 1 << 20
"""Items of one list field (a batch's anchors: one per transition)."""
INT32_MAX = 2**31 - 1
_NAME_FIELDS = frozenset({"traj_id", "actor", "source", "role", "engine", "name", "format"})
_INT64_FIELDS = frozenset({"group_id", "seed"})  # every other int also travels in int32 arrays (batches)
_NUMERIC_DICTS = frozenset({"counters", "gauges", "metrics"})  # the broker does arithmetic on their values
_NON_FINITE_OK = frozenset({"gauges", "metrics"})  # a diverged loss (nan) must reach the dashboard, not vanish
_ARRAY_FIELD_DTYPES = {
    "prompt_ids": "int32", "response_ids": "int32", "logprobs": "float32", "group_index": "int32",
    "traj_index": "int32", "step_index": "int32", "prompt_lens": "int32", "response_lens": "int32",
    "rewards": "float32", "dones": "bool", "valid": "bool", "version_lo": "int32", "version_hi": "int32",
}  # (Transitions' prompt_lens/response_lens/prompt_ids/response_ids/logprobs are covered by the same names)
"""The dtype each array field must travel as (a field not listed takes any of _ARRAY_DTYPES)."""


def _refuse_ext(code: int, data: bytes) -> Any:
    raise ValueError(f"msgpack ext type {code} is not part of the protocol")


def _unpack_header(buf: Any) -> dict[str, Any]:
    try:
        header = msgpack.unpackb(
            buf, raw=False, strict_map_key=True, max_str_len=4 * MAX_TEXT_CHARS, max_bin_len=0,
            max_array_len=MAX_LIST_ITEMS, max_map_len=MAX_DICT_ITEMS, max_ext_len=0, ext_hook=_refuse_ext,
        )
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        raise ProtocolError(f"header is not valid msgpack within the limits: {exc.__class__.__name__}",
                            "bad_header") from None
    if not isinstance(header, dict):
        raise ProtocolError(f"header must be a map, got {type(header).__name__}", "bad_header")
    return header


def _field_checker(kind: str, name: str, hint: Any) -> Callable[[Any], None]:
    """The check of header field `kind.name` by its type hint, decided once per field (perf: deciding it per
    value was a third of the broker's decode time, scripts/bench_broker.py)."""
    where = f"{kind}.{name}"
    if (kind, name) == ("transitions", "items"):
        return lambda value: _check_items(where, value)
    origin = typing.get_origin(hint)
    if origin is Literal:
        choices = typing.get_args(hint)

        def literal(value: Any) -> None:
            if value not in choices:
                raise ProtocolError(f"{where}: {str(value)[:40]!r} is not one of {choices}", "bad_type")
        return literal
    if hint in (np.ndarray, bytes):
        def frame_only(value: Any) -> None:
            raise ProtocolError(f"{where}: must travel as a data frame, not in the header", "bad_type")
        return frame_only
    allowed = _SCALAR_TYPES.get(origin or hint)
    no_bool = hint in (int, float)
    if hint is int:
        hi = 2**63 - 1 if name in _INT64_FIELDS else INT32_MAX
        check = lambda value: _check_int(where, value, hi)  # noqa: E731
    elif hint is float:
        check = lambda value: _check_number(where, value, finite=True)  # noqa: E731
    elif hint is str:
        limit = MAX_NAME_CHARS if name in _NAME_FIELDS else MAX_TEXT_CHARS
        check = lambda value: _check_text(where, value, limit)  # noqa: E731
    elif hint is dict:
        numeric, finite = name in _NUMERIC_DICTS, name not in _NON_FINITE_OK
        check = lambda value: _check_dict(where, value, numeric=numeric, finite=finite)  # noqa: E731
    elif hint is list:
        check = lambda value: _check_list(where, value)  # noqa: E731
    else:
        check = lambda value: None  # noqa: E731  (bool: its type is all there is to check)

    def typed(value: Any) -> None:
        if allowed is None or not isinstance(value, allowed) or (no_bool and isinstance(value, bool)):
            raise ProtocolError(f"{where}: expected {getattr(hint, '__name__', hint)}, got {type(value).__name__}",
                                "bad_type")
        check(value)
    return typed


def _check_items(where: str, value: Any) -> None:
    """`Transitions.items`: each item a list of a Transition's header fields, each checked as in a Transition."""
    if not isinstance(value, list) or not 1 <= len(value) <= MAX_BUNDLE:
        raise ProtocolError(f"{where}: expected a list of 1..{MAX_BUNDLE} items", "bad_type" if not isinstance(
            value, list) else "too_long")
    checks = [_CHECKERS["transition"][f] for f in TRANSITION_ITEM_FIELDS]
    for item in value:
        if _plainly_valid(item):
            continue
        if not isinstance(item, list) or len(item) != len(checks):
            raise ProtocolError(f"{where}: an item must list the {len(checks)} fields {TRANSITION_ITEM_FIELDS}",
                                "bad_type")
        for check, field_value in zip(checks, item):
            check(field_value)


def _plainly_valid(item: Any) -> bool:
    """perf: True for an item that every check of `_check_items` accepts, decided in one expression (the
    usual case); False sends it through those checks, which then say what is wrong. Never looser than them."""
    if type(item) is not list or len(item) != 12:
        return False
    traj_id, group_id, step, lo, hi, reward, done, truncated, valid, anchor, info, seq = item
    return (type(traj_id) is str and len(traj_id) <= MAX_NAME_CHARS and type(group_id) is int
            and 0 <= group_id < 2**63 and type(step) is int and 0 <= step <= INT32_MAX and type(lo) is int
            and 0 <= lo <= INT32_MAX and type(hi) is int and 0 <= hi <= INT32_MAX and type(reward) is float
            and math.isfinite(reward) and type(done) is bool and type(truncated) is bool and type(valid) is bool
            and type(anchor) is str and len(anchor) <= MAX_TEXT_CHARS and type(seq) is int and -1 <= seq <= INT32_MAX
            and type(info) is dict and len(info) <= MAX_DICT_ITEMS
            and all(type(k) is str and len(k) <= MAX_NAME_CHARS and (
                v is None or type(v) is bool or (type(v) is int and -(2**63) <= v <= 2**63)
                or (type(v) is float and math.isfinite(v)) or (type(v) is str and len(v) <= MAX_TEXT_CHARS))
                for k, v in info.items()))


def _check_list(where: str, value: list) -> None:
    if len(value) > MAX_LIST_ITEMS:
        raise ProtocolError(f"{where}: {len(value)} items, more than {MAX_LIST_ITEMS}", "too_long")
    for item in value:
        _check_scalar_value(where, item, numeric=False, finite=True)


def _check_int(where: str, value: int, hi: int) -> None:
    # -1 is the protocol's "none" (seq, request, checkpointed, an engine's unknown version); below is garbage.
    if not -1 <= value <= hi:
        raise ProtocolError(f"{where}: {value} is outside [-1, {hi}]", "out_of_range")


def _check_number(where: str, value: float, finite: bool) -> None:
    if isinstance(value, float) and finite and not math.isfinite(value):
        raise ProtocolError(f"{where}: {value} is not a finite number", "non_finite")
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > 2**63:
        raise ProtocolError(f"{where}: {value} does not fit 64 bits", "out_of_range")


def _check_text(where: str, value: str, limit: int) -> None:
    if len(value) > limit:
        raise ProtocolError(f"{where}: {len(value)} characters, more than {limit}", "too_long")


def _check_dict(where: str, value: dict, numeric: bool, finite: bool) -> None:
    if len(value) > MAX_DICT_ITEMS:
        raise ProtocolError(f"{where}: {len(value)} entries, more than {MAX_DICT_ITEMS}", "too_long")
    for key, item in value.items():
        if not isinstance(key, str):
            raise ProtocolError(f"{where}: keys must be strings, got {type(key).__name__}", "bad_type")
        _check_text(f"{where} key", key, MAX_NAME_CHARS)
        _check_scalar_value(f"{where}[{key[:40]!r}]", item, numeric, finite)


def _check_scalar_value(where: str, value: Any, numeric: bool, finite: bool) -> None:
    """An item of a dict or list field: a number, or (unless `numeric`) a short string, a bool or nil."""
    if isinstance(value, (int, float)):  # bools are ints: counters may be flags
        _check_number(where, value, finite)
    elif numeric:
        raise ProtocolError(f"{where}: expected a number, got {type(value).__name__}", "bad_type")
    elif isinstance(value, str):
        _check_text(where, value, MAX_TEXT_CHARS)
    elif value is not None:
        raise ProtocolError(f"{where}: expected a string, number, bool or nil, got {type(value).__name__}",
                            "bad_type")


def _decode_array(kind: str, specs: dict[str, Any], spec: Any, buf: Any) -> tuple[str, Any]:
    if not (isinstance(spec, list) and len(spec) == 3 and isinstance(spec[0], str) and isinstance(spec[2], list)):
        raise ProtocolError(f"{kind}: malformed array descriptor {str(spec)[:80]}", "bad_array")
    name, dtype_name, shape = spec
    hint = specs.get(name)
    if hint not in (np.ndarray, bytes):
        raise ProtocolError(f"{kind}: field {name[:40]!r} is not an array field", "bad_array")
    # Every array of the protocol is 1-D. Python ints: a product of declared dims cannot wrap around.
    if len(shape) != 1 or not isinstance(shape[0], int) or isinstance(shape[0], bool) or shape[0] < 0:
        raise ProtocolError(f"{kind}.{name}: bad shape {str(shape)[:80]} (arrays are 1-D)", "bad_array")
    if hint is bytes:
        if dtype_name != "bytes" or shape[0] != len(buf):
            raise ProtocolError(f"{kind}.{name}: expected {shape} raw bytes, got {len(buf)}", "bad_array")
        return name, bytes(buf)
    dtype = _ARRAY_DTYPES.get(dtype_name) if isinstance(dtype_name, str) else None
    if dtype is None:
        raise ProtocolError(f"{kind}.{name}: unknown dtype {str(dtype_name)[:20]!r}", "bad_dtype")
    want = _ARRAY_FIELD_DTYPES.get(name)
    if want is not None and dtype_name != want:
        raise ProtocolError(f"{kind}.{name}: must be {want}, got {dtype_name}", "bad_dtype")
    count = shape[0]
    if count * dtype.itemsize != len(buf):
        raise ProtocolError(f"{kind}.{name}: {len(buf)} bytes do not hold {shape} of {dtype_name}", "bad_array")
    arr = np.frombuffer(buf, dtype=dtype, count=count) if count else np.zeros(0, dtype)
    return name, arr


_CHECKERS = {kind: {name: _field_checker(kind, name, hint) for name, hint in specs.items()}
             for kind, specs in _SPECS.items()}


__all__ = ["PROTOCOL_VERSION", "REJECT_CODES", "Message", "ProtocolError", "encode", "decode", *(c.__name__ for c in typing.get_args(Message))]
