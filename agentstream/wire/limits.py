"""What a decoded message must also satisfy before a receiver acts on it: the run-dependent checks.

`agentstream.wire.messages.decode` checks every value by its type (bounded ints and strings, finite floats, 1-D arrays
of the right dtype). This module checks what needs the run's facts or relates fields to each other: token
ids within the model's vocabulary, prompt + response within the engines' context, as many log-probs as
response tokens, log-probs that are finite and <= 0, versions in order, a batch's lengths that add up,
images of 1, 3 or 4 channels within the image bytes a transition may carry, whose shapes add up to their bytes,
addresses that are addresses (the learner's weight address, which the broker hands on).

    limits = limits_for(cfg.model, cfg.engines, cfg.broker)        # the broker, once
    msg = check_limits(decode(frames, max_bytes), limits)    # raises ProtocolError(code=...) on a bad message

Every failure is a `ProtocolError` whose `code` is one of `agentstream.wire.messages.REJECT_CODES`.
"""

from __future__ import annotations

import json
import logging
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from agentstream.config import BrokerConfig, EnginesConfig, ModelConfig
from agentstream.wire.messages import (
    MAX_NAME_CHARS,
    Batch,
    BatchRequest,
    Hello,
    Message,
    ProtocolError,
    Transition,
    Transitions,
    VersionUpdate,
    WeightUpdate,
)

log = logging.getLogger(__name__)

WEIGHT_FORMATS = ("safetensors", "peft_adapter", "stream_join", "stream")
"""`WeightUpdate.format` values a weight sidecar can apply."""
LOGPROB_SLACK = 1e-3
"""A log-probability is <= 0; this much above 0 is let through as rounding of a server's answer."""


@dataclass(frozen=True)
class Limits:
    """Run-dependent bounds on a message's content (0: unknown, not checked)."""

    vocab_size: int = 0
    """Token ids must be < this (the model's `vocab_size`: the rows of its embedding)."""
    max_tokens: int = 0
    """Prompt + response tokens of one transition (the engines' max_model_len)."""
    max_image_bytes: int = 0
    """Image bytes (n*H*W*C) of one transition (broker.max_image_bytes)."""


def model_vocab_size(model_path: str) -> int:
    """`vocab_size` from a Hugging Face model directory's config.json (also under `text_config`); 0 if absent."""
    try:
        config = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return 0
    for node in (config, config.get("text_config") or {}):
        if isinstance(node, dict) and isinstance(node.get("vocab_size"), int) and node["vocab_size"] > 0:
            return node["vocab_size"]
    return 0


def limits_for(model: ModelConfig, engines: EnginesConfig, broker: BrokerConfig) -> Limits:
    """The limits of a run: its model's vocabulary, its engines' context length, the broker's image bound."""
    vocab = model_vocab_size(model.path)
    if not vocab:
        log.warning("no vocab_size in %s/config.json: token ids are only checked to be >= 0", model.path)
    return Limits(vocab_size=vocab, max_tokens=engines.max_model_len, max_image_bytes=broker.max_image_bytes)


def check_limits(msg: Message, limits: Limits) -> Message:
    """`msg` if it satisfies `limits` and its fields agree with each other; else raises ProtocolError."""
    check = _CHECKS.get(type(msg))
    if check is not None:
        check(msg, limits)
    return msg


def _fail(msg: Message, text: str, code: str) -> None:
    raise ProtocolError(f"{msg.kind}: {text}", code)


def _check_token_ids(msg: Message, name: str, ids: np.ndarray, limits: Limits) -> None:
    if not ids.size:
        return
    # One pass in the usual case; viewed as uint32 a negative id is >= 2**31, above any vocabulary
    if ids.dtype == np.int32 and int(ids.view(np.uint32).max()) < (limits.vocab_size or 2**31):
        return
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0:
        _fail(msg, f"{name} holds {lo}; token ids are >= 0", "out_of_vocab")
    if limits.vocab_size and hi >= limits.vocab_size:
        _fail(
            msg,
            f"{name} holds {hi}, outside the model's vocabulary of {limits.vocab_size} "
            f"(is the actor's model the broker's model.path?)",
            "out_of_vocab",
        )


def _check_logprobs(msg: Message, logprobs: np.ndarray) -> None:
    # Two passes in the usual case; nan makes max() nan (not <=), +-inf fails one of the two
    if not logprobs.size or (float(logprobs.max()) <= LOGPROB_SLACK and math.isfinite(float(logprobs.min()))):
        return
    if not np.isfinite(logprobs).all():
        _fail(msg, f"logprobs hold {int((~np.isfinite(logprobs)).sum())} nan/inf values", "non_finite")
    if logprobs.size and float(logprobs.max()) > LOGPROB_SLACK:
        _fail(msg, f"logprobs hold {float(logprobs.max()):.4g}; a log-probability is <= 0", "out_of_range")


def _check_token_rewards(msg: Message, token_rewards: np.ndarray, tokens: int) -> None:
    if token_rewards.size not in (0, tokens):
        _fail(
            msg,
            f"{token_rewards.size} token rewards for {tokens} response tokens (send one per token, or none)",
            "inconsistent",
        )
    if token_rewards.size and not np.isfinite(token_rewards).all():
        _fail(msg, f"token_rewards hold {int((~np.isfinite(token_rewards)).sum())} nan/inf values", "non_finite")


IMAGE_CHANNELS = (1, 3, 4)
"""Channels an image may have: grey, RGB, RGBA."""


def _check_images(msg: Message, shapes: Sequence[Sequence[int]], data_bytes: int, limits: Limits) -> None:
    """`shapes`: each transition's (n, H, W, C), which must describe exactly `data_bytes` bytes (Python ints: a
    hostile shape's product cannot wrap around)."""
    total = 0
    for shape in shapes:
        n, h, w, c = shape
        if min(shape) < 0:
            _fail(msg, f"image_shapes hold {min(shape)}; n, H, W and C are >= 0", "out_of_range")
        if n and (h < 1 or w < 1 or c not in IMAGE_CHANNELS):
            _fail(
                msg,
                f"images of shape {list(shape)} (n, H, W, C): an image has H, W >= 1 and C in {IMAGE_CHANNELS}",
                "out_of_range",
            )
        size = n * h * w * c
        if limits.max_image_bytes and size > limits.max_image_bytes:
            _fail(
                msg,
                f"{size} image bytes in one transition exceed broker.max_image_bytes={limits.max_image_bytes}",
                "too_long",
            )
        total += size
    if total != data_bytes:
        _fail(msg, f"image_shapes describe {total} image bytes but {data_bytes} came", "inconsistent")


def _check_image_columns(msg: Transitions | Batch, items: int, limits: Limits) -> None:
    if not (msg.image_shapes.size or msg.image_data.size):  # text only: nothing to check
        return
    if msg.image_shapes.shape != (items, 4):
        _fail(
            msg,
            f"image_shapes is {list(msg.image_shapes.shape)}; it must be [{items}, 4]: (n, H, W, C) per transition",
            "inconsistent",
        )
    _check_images(msg, msg.image_shapes.tolist(), msg.image_data.size, limits)


def _transition(msg: Transition, limits: Limits) -> None:
    if msg.logprobs.shape != msg.response_ids.shape:
        _fail(msg, f"{msg.logprobs.size} logprobs for {msg.response_ids.size} response tokens", "inconsistent")
    n = msg.prompt_ids.size + msg.response_ids.size
    if limits.max_tokens and n > limits.max_tokens:
        _fail(msg, f"{n} prompt + response tokens exceed engines.max_model_len={limits.max_tokens}", "too_long")
    if msg.step < 0 or msg.group_id < 0:
        _fail(msg, f"step={msg.step}, group_id={msg.group_id}: both must be >= 0", "out_of_range")
    if not 0 <= msg.version_lo <= msg.version_hi:
        _fail(msg, f"version interval [{msg.version_lo}, {msg.version_hi}] must satisfy 0 <= lo <= hi", "out_of_range")
    _check_token_ids(msg, "prompt_ids", msg.prompt_ids, limits)
    _check_token_ids(msg, "response_ids", msg.response_ids, limits)
    _check_logprobs(msg, msg.logprobs)
    _check_token_rewards(msg, msg.token_rewards, msg.response_ids.size)
    if msg.images.shape[0]:  # n images (text only: none)
        _check_images(msg, [msg.images.shape], msg.images.size, limits)


def _transitions(msg: Transitions, limits: Limits) -> None:
    """Each transition's checks (`_transition`), the array ones in one pass over the concatenated arrays."""
    n = len(msg.items)
    if msg.prompt_lens.size != n or msg.response_lens.size != n:
        _fail(
            msg,
            f"{n} items but {msg.prompt_lens.size} prompt and {msg.response_lens.size} response lengths",
            "inconsistent",
        )
    for lens, ids in ((msg.prompt_lens, msg.prompt_ids), (msg.response_lens, msg.response_ids)):
        # One pass: as uint32 a negative length is >= 2**31, more than a message's token ids can be
        if int(lens.astype(np.int32, copy=False).view(np.uint32).sum(dtype=np.int64)) != ids.size:
            _fail(
                msg,
                f"lengths sum to {int(lens.sum(dtype=np.int64))} (each must be >= 0) but {ids.size} token ids came",
                "inconsistent",
            )
    if msg.logprobs.size != msg.response_ids.size:
        _fail(msg, f"{msg.logprobs.size} logprobs for {msg.response_ids.size} response tokens", "inconsistent")
    longest = int((msg.prompt_lens.astype(np.int64) + msg.response_lens).max())
    if limits.max_tokens and longest > limits.max_tokens:
        _fail(msg, f"{longest} prompt + response tokens exceed engines.max_model_len={limits.max_tokens}", "too_long")
    for traj_id, group_id, step, lo, hi, *_ in msg.items:
        if step < 0 or group_id < 0:
            _fail(msg, f"{traj_id}: step={step}, group_id={group_id}: both must be >= 0", "out_of_range")
        if not 0 <= lo <= hi:
            _fail(msg, f"{traj_id}: version interval [{lo}, {hi}] must satisfy 0 <= lo <= hi", "out_of_range")
    _check_token_ids(msg, "prompt_ids", msg.prompt_ids, limits)
    _check_token_ids(msg, "response_ids", msg.response_ids, limits)
    _check_logprobs(msg, msg.logprobs)
    _check_token_rewards(msg, msg.token_rewards, msg.response_ids.size)
    _check_image_columns(msg, n, limits)


def _batch(msg: Batch, limits: Limits) -> None:
    per_transition = (
        "group_index",
        "traj_index",
        "step_index",
        "prompt_lens",
        "response_lens",
        "rewards",
        "dones",
        "valid",
        "version_lo",
        "version_hi",
    )
    n = msg.group_index.size
    if any(getattr(msg, f).size != n for f in per_transition) or len(msg.anchors) not in (0, n):
        _fail(msg, f"per-transition fields do not all hold {n} entries", "inconsistent")
    for lens, ids in ((msg.prompt_lens, msg.prompt_ids), (msg.response_lens, msg.response_ids)):
        if (n and int(lens.min()) < 0) or int(lens.sum(dtype=np.int64)) != ids.size:
            _fail(msg, f"lengths sum to {int(lens.sum(dtype=np.int64))} but {ids.size} token ids came", "inconsistent")
    if msg.logprobs.size != msg.response_ids.size:
        _fail(msg, f"{msg.logprobs.size} logprobs for {msg.response_ids.size} response tokens", "inconsistent")
    if not np.isfinite(msg.rewards).all():
        _fail(msg, "rewards hold nan/inf values", "non_finite")
    _check_token_ids(msg, "prompt_ids", msg.prompt_ids, limits)
    _check_token_ids(msg, "response_ids", msg.response_ids, limits)
    _check_logprobs(msg, msg.logprobs)
    _check_token_rewards(msg, msg.token_rewards, msg.response_ids.size)
    _check_image_columns(msg, n, limits)


def _batch_request(msg: BatchRequest, limits: Limits) -> None:
    if msg.step < 0 or msg.world_size < 1 or not 0 <= msg.rank < msg.world_size:
        _fail(
            msg,
            f"step={msg.step}, rank={msg.rank}, world_size={msg.world_size}: need step >= 0 and 0 <= rank < world_size",
            "out_of_range",
        )


def _hello(msg: Hello, limits: Limits) -> None:
    if msg.incarnation < 0 or msg.pid < 0:
        _fail(msg, f"incarnation={msg.incarnation}, pid={msg.pid}: both must be >= 0", "out_of_range")


def _version_update(msg: VersionUpdate, limits: Limits) -> None:
    if msg.version < 0:
        _fail(msg, f"version={msg.version} must be >= 0", "out_of_range")
    if msg.weights:  # handed on to every process that joins: an address, or nothing
        _check_tcp_address(msg, "weights", msg.weights)


TCP_ADDRESS = re.compile(r"tcp://(?:[A-Za-z0-9.-]+|\[[0-9A-Fa-f:.]+\]):([0-9]{1,5})")
"""A ZeroMQ TCP address one process hands another: tcp://HOST:PORT (a host name, IPv4, or [IPv6])."""


def _check_tcp_address(msg: Message, name: str, value: str) -> None:
    if len(value) > MAX_NAME_CHARS:
        _fail(msg, f"{name} is {len(value)} characters long; an address has at most {MAX_NAME_CHARS}", "too_long")
    match = TCP_ADDRESS.fullmatch(value)
    if match is None or not 1 <= int(match.group(1)) <= 65535:
        _fail(msg, f"{name}={value[:80]!r} is not a ZeroMQ address tcp://HOST:PORT (port 1..65535)", "out_of_range")


def _weight_update(msg: WeightUpdate, limits: Limits) -> None:
    if msg.format not in WEIGHT_FORMATS or msg.version < 0:
        _fail(
            msg,
            f"format={msg.format!r}, version={msg.version}: need a format in {WEIGHT_FORMATS} and version >= 0",
            "out_of_range",
        )


_CHECKS: dict[type, Callable[..., None]] = {
    Transition: _transition,
    Transitions: _transitions,
    Batch: _batch,
    BatchRequest: _batch_request,
    Hello: _hello,
    VersionUpdate: _version_update,
    WeightUpdate: _weight_update,
}

__all__ = [
    "IMAGE_CHANNELS",
    "LOGPROB_SLACK",
    "TCP_ADDRESS",
    "WEIGHT_FORMATS",
    "Limits",
    "limits_for",
    "model_vocab_size",
    "check_limits",
]
