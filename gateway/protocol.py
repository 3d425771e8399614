"""The OpenAI bodies: the requests the gateway takes, checked (anything it cannot serve is an `ApiError`, a 4xx with an
OpenAI-style error body and a counter name, never a 500), and the answers it gives.

    req = chat_request(body, default_max_tokens=256)    # -> ChatRequest, or raises ApiError(400, ...)
    ApiError(404, "no episode 'x'", code="unknown_episode").body()
    envelope("chat.completion", "chatcmpl", model, prompt_ids, response_ids, choice, token_ids=False)
"""

from __future__ import annotations

import json
import math
import secrets
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from envs.toolcalls import ToolCall

ROLES = ("system", "developer", "user", "assistant", "tool")


class ApiError(Exception):
    """A request the gateway refuses: HTTP status, OpenAI error body, and the counter it is counted under."""

    def __init__(
        self, status: int, message: str, code: str, param: str | None = None, headers: dict[str, str] | None = None
    ):
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param
        self.headers = headers or {}

    @property
    def type(self) -> str:
        return {401: "authentication_error", 404: "not_found_error", 429: "rate_limit_error"}.get(
            self.status, "invalid_request_error"
        )

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad(message: str, param: str | None = None, code: str = "invalid_request") -> ApiError:
    return ApiError(400, message, code, param)


@dataclass(frozen=True)
class Sampling:
    """What a request asks of the engine."""

    max_tokens: int
    temperature: float
    top_p: float
    stop: list[str] = field(default_factory=list)
    seed: int | None = None
    logprobs: bool = False


@dataclass(frozen=True)
class ChatRequest:
    """A checked `POST /v1/chat/completions` body. `messages` are ready for a chat template (tool-call arguments
    as objects, text parts joined); `tool_choice` is "none", "auto", "required" or a function's name."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]]
    tool_choice: str
    sampling: Sampling
    return_token_ids: bool = False

    @property
    def tool_names(self) -> list[str]:
        return [t["function"]["name"] for t in self.tools]


@dataclass(frozen=True)
class CompletionRequest:
    """A checked `POST /v1/completions` body: the prompt as text or as token ids."""

    prompt: str | list[int]
    sampling: Sampling
    return_token_ids: bool = False


def _number(body: dict[str, Any], name: str, default: float, lo: float, hi: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not number or not math.isfinite(value) or not lo <= value <= hi:
        raise bad(f"'{name}' must be a number in [{lo}, {hi}], not {str(value)[:40]!r}", name)
    return float(value)


def sampling(body: dict[str, Any], default_max_tokens: int, max_tokens_limit: int, legacy: bool = False) -> Sampling:
    """The sampling fields shared by both endpoints. Only n=1 is served (each answer is one transition).
    `legacy` (/v1/completions): `logprobs` is an integer, 0 = the sampled tokens' log-probs only."""
    n = body.get("n", 1)
    if n != 1:
        raise bad(f"'n' must be 1 (each answer is one step of the episode), not {str(n)[:20]}", "n")
    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = body.get(key)
    if max_tokens is None:
        max_tokens = default_max_tokens
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or not 1 <= max_tokens <= max_tokens_limit:
        raise bad(f"'{key}' must be an integer in [1, {max_tokens_limit}], not {str(max_tokens)[:20]}", key)
    stop = body.get("stop")
    stop = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or len(stop) > 4 or not all(isinstance(s, str) and s for s in stop):
        raise bad("'stop' must be a non-empty string or a list of at most 4 of them", "stop")
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63):
        raise bad("'seed' must be a non-negative integer", "seed")
    top_logprobs = body.get("top_logprobs") or 0
    if top_logprobs:
        raise bad("'top_logprobs' is not served: only the sampled tokens' log-probs ('logprobs': true)", "top_logprobs")
    logprobs = body.get("logprobs")
    if legacy and logprobs is not None:
        if isinstance(logprobs, bool) or logprobs != 0:
            raise bad("'logprobs' must be 0 (the sampled tokens' log-probs; no alternatives are served)", "logprobs")
        logprobs = True
    elif logprobs is None:
        logprobs = False
    elif not isinstance(logprobs, bool):
        raise bad("'logprobs' must be a boolean", "logprobs")
    return Sampling(
        int(max_tokens),
        _number(body, "temperature", 1.0, 0.0, 2.0),
        _number(body, "top_p", 1.0, 1e-9, 1.0),
        list(stop),
        seed,
        bool(logprobs),
    )


def _text(content: Any, where: str) -> str:
    """A message's content: a string, or a list of text parts (joined); images are not served."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad(f"{where}.content: only text parts are served ({{'type': 'text', 'text': ...}})", where)
            parts.append(part["text"])
        return "".join(parts)
    raise bad(f"{where}.content must be a string or a list of text parts", where)


def _tool_calls(calls: Any, where: str) -> list[dict[str, Any]]:
    """An assistant message's `tool_calls`, arguments decoded to objects (what chat templates expect)."""
    if not isinstance(calls, list):
        raise bad(f"{where}.tool_calls must be a list", where)
    out = []
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not isinstance(fn.get("arguments"), str):
            raise bad(
                f"{where}.tool_calls[{j}] must be {{'id', 'type': 'function', 'function': {{'name': str, "
                f"'arguments': JSON text}}}}",
                where,
            )
        try:
            args = json.loads(fn["arguments"])
        except (ValueError, RecursionError):
            raise bad(f"{where}.tool_calls[{j}].function.arguments is not JSON", where) from None
        if not isinstance(args, dict):
            raise bad(f"{where}.tool_calls[{j}].function.arguments must be a JSON object", where)
        out.append(
            {"id": str(call.get("id", "")), "type": "function", "function": {"name": fn["name"], "arguments": args}}
        )
    return out


def messages(value: Any) -> list[dict[str, Any]]:
    """The request's `messages`, checked and made ready for a chat template."""
    if not isinstance(value, list) or not value:
        raise bad("'messages' must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise bad(f"{where} must be an object with a 'role' in {ROLES}", "messages")
        role = "system" if m["role"] == "developer" else m["role"]
        msg: dict[str, Any] = {"role": role, "content": _text(m.get("content"), where)}
        if role == "assistant" and m.get("tool_calls"):
            msg["tool_calls"] = _tool_calls(m["tool_calls"], where)
        if role == "tool":
            msg["tool_call_id"] = str(m.get("tool_call_id", ""))
        out.append(msg)
    return out


def tools(value: Any) -> list[dict[str, Any]]:
    """The request's `tools`: function tools, each with a name and a JSON-schema object for its parameters."""
    if value is None:
        return []
    if not isinstance(value, list):
        raise bad("'tools' must be a list of {'type': 'function', 'function': {...}}", "tools")
    out, names = [], set()
    for i, t in enumerate(value):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(fn, dict):
            raise bad(f"tools[{i}] must be {{'type': 'function', 'function': {{'name', 'parameters'}}}}", "tools")
        name, params = fn.get("name"), fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(name, str) or not name or len(name) > 64 or name in names:
            raise bad(f"tools[{i}].function.name must be a unique non-empty string of at most 64 characters", "tools")
        if not isinstance(params, dict):
            raise bad(f"tools[{i}].function.parameters must be a JSON-schema object", "tools")
        if "description" in fn and not isinstance(fn["description"], str):
            raise bad(f"tools[{i}].function.description must be a string", "tools")
        names.add(name)
        out.append({"type": "function", "function": {**fn, "parameters": params}})
    return out


def tool_choice(value: Any, names: list[str]) -> str:
    """ "none" | "auto" | "required" | a function's name. Default: "auto" with tools, "none" without."""
    if value is None:
        return "auto" if names else "none"
    if value in ("none", "auto", "required"):
        if value == "required" and not names:
            raise bad("tool_choice 'required' needs 'tools'", "tool_choice")
        return str(value)
    fn = value.get("function") if isinstance(value, dict) else None
    if isinstance(fn, dict) and fn.get("name") in names:
        return str(fn["name"])
    raise bad(
        f"'tool_choice' must be 'none', 'auto', 'required' or {{'type': 'function', 'function': {{'name': "
        f"one of {names}}}}}",
        "tool_choice",
    )


def chat_request(body: Any, default_max_tokens: int, max_tokens_limit: int) -> ChatRequest:
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    ts = tools(body.get("tools"))
    names = [t["function"]["name"] for t in ts]
    return ChatRequest(
        messages(body.get("messages")),
        ts,
        tool_choice(body.get("tool_choice"), names),
        sampling(body, default_max_tokens, max_tokens_limit),
        bool(body.get("return_token_ids")),
    )


def completion_request(body: Any, default_max_tokens: int, max_tokens_limit: int) -> CompletionRequest:
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    ok = (
        isinstance(prompt, str)
        and prompt
        or (
            isinstance(prompt, list)
            and prompt
            and all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**31 for t in prompt)
        )
    )
    if not ok:
        raise bad("'prompt' must be one non-empty string or one non-empty list of token ids", "prompt")
    return CompletionRequest(
        prompt, sampling(body, default_max_tokens, max_tokens_limit, legacy=True), bool(body.get("return_token_ids"))
    )


def bearer(headers: Mapping[str, str]) -> str:
    """The token of an `Authorization: Bearer <token>` header, or ""."""
    auth = headers.get("Authorization", "")
    return auth[7:].strip() if auth.startswith("Bearer ") else ""


def reward_of(body: Any, required: bool) -> float:
    """The body's finite 'reward' (0 when absent and not `required`)."""
    value = body.get("reward") if isinstance(body, dict) else None
    if value is None and not required:
        return 0.0
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ApiError(400, "'reward' must be a finite number", "invalid_request", "reward")
    return float(value)


# ---------------------------------------------------------------------------------------------- answers
def tool_call_schema(tools: list[dict[str, Any]], names: list[str]) -> dict[str, Any]:
    """JSON schema of one call to one of `names` (what a forced `tool_choice` asks the engine to write)."""
    params = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    options = [
        {
            "type": "object",
            "properties": {"name": {"const": n}, "arguments": params[n]},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for n in names
    ]
    return options[0] if len(options) == 1 else {"anyOf": options}


def assistant_message(content: str | None, calls: list[ToolCall]) -> dict[str, Any]:
    """The answer's message, its tool calls with fresh ids."""
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = [
            {
                "id": f"call_{secrets.token_hex(12)}",
                "type": "function",
                "function": {"name": c.name, "arguments": c.arguments},
            }
            for c in calls
        ]
    return message


def token_logprobs(ids: Sequence[int], logprobs: Sequence[float], decode: Callable[[list[int]], str]) -> list[dict]:
    """Chat's `logprobs.content`: each sampled token's text and log-prob (-inf written as -9999, as OpenAI does)."""
    out = []
    for tid, lp in zip(ids, logprobs):
        token = decode([tid])
        out.append(
            {
                "token": token,
                "logprob": lp if math.isfinite(lp) else -9999.0,
                "bytes": list(token.encode()),
                "top_logprobs": [],
            }
        )
    return out


def envelope(
    obj: str,
    prefix: str,
    model: str,
    prompt: list[int],
    response_ids: list[int],
    choice: dict[str, Any],
    token_ids: bool,
) -> dict[str, Any]:
    """The response body around one choice, with usage; with `token_ids` (vLLM's `return_token_ids`) exactly
    the ids the transition carries."""
    n = len(response_ids)
    out: dict[str, Any] = {
        "id": f"{prefix}-{secrets.token_hex(12)}",
        "object": obj,
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
        "usage": {"prompt_tokens": len(prompt), "completion_tokens": n, "total_tokens": len(prompt) + n},
    }
    if token_ids:
        out["prompt_token_ids"] = list(prompt)
        choice["token_ids"] = response_ids
    return out


__all__ = [
    "ApiError",
    "ChatRequest",
    "CompletionRequest",
    "Sampling",
    "assistant_message",
    "bearer",
    "chat_request",
    "completion_request",
    "envelope",
    "reward_of",
    "token_logprobs",
    "tool_call_schema",
]
