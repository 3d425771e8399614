"""The rules an actor and the gateway share about the run's engines: which engine gets the next request
(engines/pool.py `EnginePool`) and the version interval a transition carries (engines/client.py `clamp_to_grant`).

    .venv/bin/python -m pytest tests/engines/test_pool.py -q
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from engines import pool as pool_module
from engines.client import clamp_to_grant
from engines.pool import EnginePool


def engines(*urls: str) -> list[Any]:
    return [SimpleNamespace(url=u) for u in urls]


def urls(picked: list[Any]) -> list[str]:
    return [e.url for e in picked]


def test_the_pool_goes_round_the_engines_and_takes_in_those_that_join() -> None:
    pool = EnginePool(engines("a", "b", "c"))
    assert urls([pool.pick() for _ in range(4)]) == ["a", "b", "c", "a"]
    pool.engines.append(SimpleNamespace(url="d"))  # as follow_engines does: the process's own list grows
    # picks 4 and 5 of the round over 4 engines: places 4 % 4 = 0 and 5 % 4 = 1.
    assert urls([pool.pick(), pool.pick()]) == ["a", "b"]


def test_a_failed_engine_sits_out_down_s_then_rejoins(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [100.0]
    monkeypatch.setattr(pool_module.time, "monotonic", lambda: now[0])
    a, b, c = pool_engines = engines("a", "b", "c")
    pool = EnginePool(pool_engines, down_s=10.0)
    pool.failed(b)  # at t=100: down until t=110 included
    # up: [a, c]; picks 0, 1, 2 -> a, c, a.
    assert urls([pool.pick() for _ in range(3)]) == ["a", "c", "a"]
    now[0] = 110.0
    assert pool.is_down(b) and not pool.is_down(a)
    now[0] = 110.5  # rejoined: up [a, b, c]; pick 3 -> place 0, pick 4 -> place 1
    assert urls([pool.pick(), pool.pick()]) == ["a", "b"]
    for e in (a, b, c):  # every engine failed lately: the round goes over all of them (pick 5 -> place 2)
        pool.failed(e)
    assert pool.pick() is c


def test_a_request_leaving_an_engine_goes_to_another() -> None:
    a, b, c = pool_engines = engines("a", "b", "c")
    pool = EnginePool(pool_engines)
    # leaving a: the round is over [b, c]; picks 0, 1, 2 -> b, c, b.
    assert urls([pool.pick(leaving=a) for _ in range(3)]) == ["b", "c", "b"]
    # leaving b: [a, c]; pick 3 -> place 1 -> c. One engine only: it is the one there is.
    assert pool.pick(leaving=b) is c
    only = EnginePool(engines("x"))
    assert only.pick(leaving=only.engines[0]) is only.engines[0]


def test_versions_are_raised_to_the_grants_oldest() -> None:
    # min_version 3: an interval (1, 5) becomes (3, 5); (4, 6) is left as it is; (0, 2) becomes (3, 3).
    assert clamp_to_grant(1, 5, 3) == (3, 5)
    assert clamp_to_grant(4, 6, 3) == (4, 6)
    assert clamp_to_grant(0, 2, 3) == (3, 3)
