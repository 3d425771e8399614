"""Tool-call parsers: a model's text -> OpenAI `tool_calls` and the text left as content. Never raises.

    result = parse("hermes", text, tool_names={"lookup", "calc"})
    result.content, result.tool_calls, result.error      # error: None, or why the calls came back as text

One registry (`TOOL_PARSERS`), one signature: `(text, tool_names) -> ParsedTools`. A parser either finds
every tool call in the text, well formed and naming a known tool, or returns the whole text as plain content
with `error` set to one of `PARSE_ERRORS` (the gateway counts it); it never raises, whatever the text.

Formats:
- `hermes` (alias `qwen`): Hermes / Qwen2.5 / Qwen3 `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
  blocks, any number, the text outside them as content.
- `json`: the whole text is one call object or a list of them (what the gateway asks the engine for, under a
  JSON schema, when `tool_choice` forces a call).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any

from agentstream.registry import Registry, unknown_name


@dataclass(frozen=True)
class ToolCall:
    """One parsed call: the function's name and its arguments as a JSON object's text (OpenAI's form)."""

    name: str
    arguments: str


@dataclass(frozen=True)
class ParsedTools:
    """What a parser made of one answer."""

    content: str | None
    """Text outside the calls (None when nothing but calls); the whole text when `error` is set."""
    tool_calls: list[ToolCall] = field(default_factory=list)
    error: str | None = None
    """None, or one of PARSE_ERRORS: why the text is returned as plain content."""


PARSE_ERRORS = ("truncated", "bad_json", "bad_call", "unknown_tool")
"""truncated: a call opened and never closed (e.g. max_tokens hit); bad_json: a call's body is not JSON;
bad_call: JSON, but not {"name": str, "arguments": object}; unknown_tool: a name the request's tools lack."""

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE), re.DOTALL)


def _loads(text: str) -> tuple[Any, bool]:
    """(value, True) for JSON text; (None, False) otherwise. Deep nesting raises RecursionError in `json`."""
    try:
        return json.loads(text), True
    except (ValueError, RecursionError):
        return None, False


def _call(obj: Any, tool_names: Collection[str]) -> ToolCall | str:
    """A decoded call object -> ToolCall, or the PARSE_ERRORS reason it is not one. `arguments` (or
    `parameters`, as some models write) must be an object, or a string holding one's JSON."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return "bad_call"
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        args, ok = _loads(args)
        if not ok:
            return "bad_call"
    if not isinstance(args, dict):
        return "bad_call"
    if obj["name"] not in tool_names:
        return "unknown_tool"
    try:
        return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))
    except (ValueError, RecursionError):  # a value json cannot write back (nesting deeper than it recurses)
        return "bad_call"


def parse_hermes(text: str, tool_names: Collection[str]) -> ParsedTools:
    """`<tool_call>{json}</tool_call>` blocks (Hermes, Qwen2.5, Qwen3)."""
    if OPEN not in text:
        return ParsedTools(text)
    calls: list[ToolCall] = []
    for match in _BLOCK.finditer(text):
        obj, ok = _loads(match.group(1).strip())
        if not ok:
            return ParsedTools(text, error="bad_json")
        call = _call(obj, tool_names)
        if isinstance(call, str):
            return ParsedTools(text, error=call)
        calls.append(call)
    rest = _BLOCK.sub("", text)
    if OPEN in rest:  # a block left open: the answer stopped inside a call
        return ParsedTools(text, error="truncated")
    content = rest.replace(CLOSE, "").strip()
    return ParsedTools(content or None, calls)


def parse_json(text: str, tool_names: Collection[str]) -> ParsedTools:
    """The whole text is one call object, or a list of them."""
    obj, ok = _loads(text.strip())
    if not ok:
        stripped = text.strip()
        return ParsedTools(text, error="truncated" if stripped[:1] in "{[" and stripped else "bad_json")
    calls: list[ToolCall] = []
    for item in obj if isinstance(obj, list) and obj else [obj]:
        call = _call(item, tool_names)
        if isinstance(call, str):
            return ParsedTools(text, error=call)
        calls.append(call)
    return ParsedTools(None, calls)


Parser = Callable[[str, Collection[str]], ParsedTools]
TOOL_PARSERS: Registry[Parser] = Registry("tool-call parser")
for _name, _parser in (("hermes", parse_hermes), ("qwen", parse_hermes), ("json", parse_json)):
    TOOL_PARSERS.add(_name, _parser)


def get_parser(name: str) -> Parser:
    """The parser registered as `name`; an unknown name lists the known ones (a ValueError: a bad setting)."""
    if name not in TOOL_PARSERS:
        raise ValueError(unknown_name(TOOL_PARSERS.what, name, TOOL_PARSERS))
    return TOOL_PARSERS.get(name)


def parse(name: str, text: str, tool_names: Collection[str]) -> ParsedTools:
    """Parse `text` with the parser registered as `name` (raises only for an unknown parser name)."""
    return get_parser(name)(text, tool_names)


__all__ = [
    "PARSE_ERRORS",
    "TOOL_PARSERS",
    "ParsedTools",
    "ToolCall",
    "get_parser",
    "parse",
    "parse_hermes",
    "parse_json",
]
