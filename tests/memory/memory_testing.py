"""The hand-made episode that the summary and key-events tests work their expected text out from."""

from __future__ import annotations

import memory

GRID = "F F\nF F"
BAD = "no <action>...</action> tag found"
# (observation, answer, reward, info) of a hand-made 6-step episode
EPISODE = [
    (f"{GRID}\nYou are at row 0, column 0.", "<action>right</action>", 0.0, {"valid": True}),
    (f"{GRID}\nYou are at row 0, column 1.", "I think up", 0.0, {"valid": False, "parse_error": BAD}),
    (f"{GRID}\nYou are at row 0, column 1.", "<action> down </action>", 0.0, {"valid": True}),
    (f"{GRID}\nYou are at row 1, column 1.", "<action>right</action>", 0.5, {"valid": True}),
    (
        f"{GRID}\nYou are at row 1, column 2.",
        "<action>right</action>",
        0.0,
        {"valid": True, "key_event": "found the key"},
    ),
    (f"{GRID}\nYou are at row 1, column 3.", "<action>down</action>", 0.0, {"valid": True}),
]
NOW = f"{GRID}\nYou are at row 2, column 3."


def played(kind: str, **kw) -> memory.Memory:
    mem = memory.make(kind, **kw)
    mem.reset("RULES")
    for obs, answer, reward, info in EPISODE:
        mem.record(obs, answer, reward=reward, info=info)
    return mem
