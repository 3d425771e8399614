"""What a received message may hold: the header's limits, one check per header field (chosen once per field
from its type hint), and the decoding of an array frame. Every fault is a `ProtocolError` whose `code` names
its kind (`REJECT_CODES`); `agentstream.wire.messages` builds the checks of each message kind from these."""

from __future__ import annotations

import math
import typing
from typing import Any, Callable, Literal

import msgpack
import numpy as np

# Arrays travel as these dtypes, little-endian, whatever the sender's platform.
ARRAY_DTYPES: dict[str, np.dtype[Any]] = {
    "int32": np.dtype("<i4"),
    "float32": np.dtype("<f4"),
    "uint8": np.dtype("u1"),
    "bool": np.dtype("?"),
}


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
ARRAY_FIELD_DTYPES = {
    "prompt_ids": "int32",
    "response_ids": "int32",
    "logprobs": "float32",
    "group_index": "int32",
    "traj_index": "int32",
    "step_index": "int32",
    "prompt_lens": "int32",
    "response_lens": "int32",
    "rewards": "float32",
    "dones": "bool",
    "valid": "bool",
    "version_lo": "int32",
    "version_hi": "int32",
    "token_rewards": "float32",
    "images": "uint8",
    "image_shapes": "int32",
    "image_data": "uint8",
}  # (Transitions' prompt_lens/response_lens/prompt_ids/response_ids/logprobs are covered by the same names)
"""The dtype each array field must travel as (a field not listed takes any of ARRAY_DTYPES)."""
ARRAY_FIELD_NDIM = {"images": 4, "image_shapes": 2}
"""The dimensions of each array field that is not 1-D: a Transition's images [n, H, W, C], a bundle's or batch's
image shapes [N, 4]."""


def _refuse_ext(code: int, data: bytes) -> Any:
    raise ValueError(f"msgpack ext type {code} is not part of the protocol")


def unpack_header(buf: Any) -> dict[str, Any]:
    try:
        header = msgpack.unpackb(
            buf,
            raw=False,
            strict_map_key=True,
            max_str_len=4 * MAX_TEXT_CHARS,
            max_bin_len=0,
            max_array_len=MAX_LIST_ITEMS,
            max_map_len=MAX_DICT_ITEMS,
            max_ext_len=0,
            ext_hook=_refuse_ext,
        )
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        raise ProtocolError(
            f"header is not valid msgpack within the limits: {exc.__class__.__name__}", "bad_header"
        ) from None
    if not isinstance(header, dict):
        raise ProtocolError(f"header must be a map, got {type(header).__name__}", "bad_header")
    return header


_SCALAR_TYPES: dict[Any, tuple[type, ...]] = {
    int: (int,),
    float: (float, int),
    bool: (bool,),
    str: (str,),
    dict: (dict,),
    list: (list,),
}


def field_checker(kind: str, name: str, hint: Any) -> Callable[[Any], None]:
    """The check of header field `kind.name` by its type hint, decided once per field (deciding it per
    value was a third of the broker's decode time, bench/broker.py)."""
    where = f"{kind}.{name}"
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
            raise ProtocolError(
                f"{where}: expected {getattr(hint, '__name__', hint)}, got {type(value).__name__}", "bad_type"
            )
        check(value)

    return typed


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
        raise ProtocolError(f"{where}: expected a string, number, bool or nil, got {type(value).__name__}", "bad_type")


def decode_array(kind: str, specs: dict[str, Any], spec: Any, buf: Any) -> tuple[str, Any]:
    if not (isinstance(spec, list) and len(spec) == 3 and isinstance(spec[0], str) and isinstance(spec[2], list)):
        raise ProtocolError(f"{kind}: malformed array descriptor {str(spec)[:80]}", "bad_array")
    name, dtype_name, shape = spec
    hint = specs.get(name)
    if hint not in (np.ndarray, bytes):
        raise ProtocolError(f"{kind}: field {name[:40]!r} is not an array field", "bad_array")
    # Python ints: a product of declared dims cannot wrap around.
    ndim = ARRAY_FIELD_NDIM.get(name, 1)
    if len(shape) != ndim or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        raise ProtocolError(f"{kind}.{name}: bad shape {str(shape)[:80]} (must be {ndim}-D)", "bad_array")
    if hint is bytes:
        if dtype_name != "bytes" or shape[0] != len(buf):
            raise ProtocolError(f"{kind}.{name}: expected {shape} raw bytes, got {len(buf)}", "bad_array")
        return name, bytes(buf)
    dtype = ARRAY_DTYPES.get(dtype_name) if isinstance(dtype_name, str) else None
    if dtype is None:
        raise ProtocolError(f"{kind}.{name}: unknown dtype {str(dtype_name)[:20]!r}", "bad_dtype")
    want = ARRAY_FIELD_DTYPES.get(name)
    if want is not None and dtype_name != want:
        raise ProtocolError(f"{kind}.{name}: must be {want}, got {dtype_name}", "bad_dtype")
    count = math.prod(shape)
    if count * dtype.itemsize != len(buf):
        raise ProtocolError(f"{kind}.{name}: {len(buf)} bytes do not hold {shape} of {dtype_name}", "bad_array")
    arr = np.frombuffer(buf, dtype=dtype, count=count) if count else np.zeros(0, dtype)
    return name, arr.reshape(shape) if ndim > 1 else arr


def plain_arrays(layout: tuple, arrays: Any, bufs: list[Any], values: dict[str, Any], omitted: dict[str, Any]) -> bool:
    """The data frames of a message whose `_arrays` must be exactly `layout` ((field, dtype) in order), or
    `layout` without its last len(`omitted`) fields (their values then taken from `omitted`: `encode` leaves
    out image fields that hold nothing), decoded into `values`; False (values unfinished) for anything else,
    which `decode_array` then judges."""
    n = len(arrays) if type(arrays) is list else -1
    if (n != len(layout) and n != len(layout) - len(omitted)) or len(bufs) != n + 1:
        return False
    for (name, dtype), spec, buf in zip(layout, arrays, bufs[1:]):
        if type(spec) is not list or len(spec) != 3 or spec[0] != name or spec[1] != dtype:
            return False
        shape = spec[2]
        if type(shape) is not list or len(shape) != ARRAY_FIELD_NDIM.get(name, 1):
            return False
        if len(shape) == 1:  # the usual array: no loop
            count = shape[0]
            if type(count) is not int or count < 0:
                return False
        elif all(type(d) is int and d >= 0 for d in shape):
            count = math.prod(shape)
        else:
            return False
        dt = ARRAY_DTYPES[dtype]
        if count * dt.itemsize != len(buf):
            return False
        arr = np.frombuffer(buf, dtype=dt, count=count) if count else np.zeros(0, dt)
        values[name] = arr if len(shape) == 1 else arr.reshape(shape)
    if n < len(layout):
        values.update(omitted)
    return True
