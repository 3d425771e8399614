"""The slow, obvious references (test oracles) of the memory's fast paths, held against them by the tests beside
this module (`test_prompt.py`).

    from memory_oracles import largest_fitting_reference   # tests/memory is on pytest's `pythonpath`
"""

from __future__ import annotations

from typing import Callable


# --------------------------------------------------------------------------------------- memory.prompt
def largest_fitting_reference(n: int, fits: Callable[[int], bool]) -> int:
    """Slow, obvious `largest_fitting`: count down from n - 1 (drop the oldest until it fits)."""
    x = n - 1
    while x > 0 and not fits(x):
        x -= 1
    return x
