"""Tool-call parsers (envs/toolcalls.py): well-formed, malformed, truncated and random answers; never raises.

.venv/bin/python -m pytest tests/envs/test_toolcalls.py -q -p no:cacheprovider      # < 2 s
"""

import json
import random
import string

import pytest

from envs.toolcalls import PARSE_ERRORS, TOOL_PARSERS, ParsedTools, ToolCall, get_parser, parse

TOOLS = {"lookup", "calc"}


def test_hermes_well_formed_calls_and_the_text_around_them() -> None:
    text = (
        'Let me check.\n<tool_call>\n{"name": "lookup", "arguments": {"key": "paris"}}\n</tool_call>\n'
        '<tool_call>{"name": "calc", "arguments": "{\\"expr\\": \\"1+2\\"}"}</tool_call>'
    )
    got = parse("hermes", text, TOOLS)
    # Two calls; arguments given as a JSON string are read as the object it holds; the text before is content.
    assert got == ParsedTools(
        "Let me check.", [ToolCall("lookup", '{"key": "paris"}'), ToolCall("calc", '{"expr": "1+2"}')]
    )
    assert parse("qwen", text, TOOLS) == got


def test_only_calls_means_no_content_and_no_call_means_plain_content() -> None:
    assert parse("hermes", '<tool_call>{"name": "calc", "arguments": {}}</tool_call>', TOOLS) == ParsedTools(
        None, [ToolCall("calc", "{}")]
    )
    assert parse("hermes", "just words", TOOLS) == ParsedTools("just words")


@pytest.mark.parametrize(
    "text, reason",
    [
        ('<tool_call>{"name": "lookup", "arguments": {"key": "par', "truncated"),  # max_tokens hit inside the call
        ('<tool_call>{"name": "lookup"}</tool_call> and <tool_call>{"name"', "truncated"),
        ("<tool_call>{name: lookup}</tool_call>", "bad_json"),
        ('<tool_call>["lookup"]</tool_call>', "bad_call"),
        ('<tool_call>{"name": 3, "arguments": {}}</tool_call>', "bad_call"),
        ('<tool_call>{"name": "calc", "arguments": [1, 2]}</tool_call>', "bad_call"),
        ('<tool_call>{"name": "calc", "arguments": "not json"}</tool_call>', "bad_call"),
        ('<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>', "unknown_tool"),
        ("<tool_call>" + "[" * 100000 + "</tool_call>", "bad_json"),  # deeper than json recurses: no RecursionError
    ],
)
def test_a_malformed_call_comes_back_as_the_whole_text_with_its_reason(text: str, reason: str) -> None:
    got = parse("hermes", text, TOOLS)
    assert got == ParsedTools(text, [], reason)
    assert reason in PARSE_ERRORS


def test_json_parser_for_forced_calls() -> None:
    assert parse("json", '{"name": "calc", "arguments": {"a": 1}}', TOOLS) == ParsedTools(
        None, [ToolCall("calc", '{"a": 1}')]
    )
    assert parse(
        "json", '[{"name": "calc", "arguments": {}}, {"name": "lookup", "arguments": {}}]', TOOLS
    ).tool_calls == [ToolCall("calc", "{}"), ToolCall("lookup", "{}")]
    assert parse("json", '{"name": "calc", "argu', TOOLS).error == "truncated"
    assert parse("json", "hello", TOOLS).error == "bad_json"
    assert parse("json", '{"name": "nope", "arguments": {}}', TOOLS).error == "unknown_tool"


def test_an_unknown_parser_lists_the_known_ones() -> None:
    with pytest.raises(ValueError, match="hermes"):
        get_parser("mistral-v9")


def _random_text(rng: random.Random) -> str:
    """Random mixes of the syntax parsers look for (tags, braces, quotes, names) with random characters."""
    pieces = [
        "<tool_call>",
        "</tool_call>",
        "{",
        "}",
        "[",
        "]",
        '"',
        ":",
        ",",
        '"name"',
        '"arguments"',
        '"calc"',
        '"lookup"',
        "null",
        "1e999",
        "\\",
        "\n",
        " ",
        '{"name": "calc", "arguments": {}}',
        "\ud800",
        "\x00",
    ]
    out = []
    for _ in range(rng.randint(0, 40)):
        out.append(
            rng.choice(pieces)
            if rng.random() < 0.6
            else "".join(rng.choice(string.printable) for _ in range(rng.randint(1, 5)))
        )
    return "".join(out)


@pytest.mark.parametrize("name", sorted(TOOL_PARSERS))
def test_random_text_never_raises_and_is_either_calls_or_all_the_text(name: str) -> None:
    rng = random.Random(1234)
    seen = set()
    for _ in range(3000):
        text = _random_text(rng)
        got = parse(name, text, TOOLS)  # must not raise
        seen.add(got.error if got.error else ("calls" if got.tool_calls else "content"))
        if got.error is not None:
            assert got.error in PARSE_ERRORS and got.content == text and got.tool_calls == []
        for call in got.tool_calls:  # every call returned is a known tool with a JSON object as arguments
            assert call.name in TOOLS and isinstance(json.loads(call.arguments), dict)
    # The random texts reached the parser's different outcomes, not only one of them.
    assert {"calls", "bad_json"} <= seen and len(seen) >= 4, seen
