"""The gateway's episode registry (gateway/episodes.py): open episodes, and a bounded memory of ended ones.

.venv/bin/python -m pytest tests/gateway/test_episodes.py -q -p no:cacheprovider      # < 1 s
"""

from __future__ import annotations

import numpy as np
import pytest

from agentstream.wire.messages import ABANDON, ABANDON_GROUP, GroupGrant, Transition
from gateway.episodes import GatewayEpisode, Registry
from gateway.protocol import ApiError


def episode(eid: str) -> GatewayEpisode:
    return GatewayEpisode(eid, "task", GroupGrant(group_id=3, seed=7, min_version=2), 0, f"gw.0.g3.{eid}", engine=None)


def refusal(reg: Registry, eid: str) -> tuple[int, str]:
    with pytest.raises(ApiError) as exc:
        reg.get(eid)
    return exc.value.status, exc.value.code


def test_ended_episodes_answer_409_or_410_until_they_age_out_then_404() -> None:
    reg = Registry(keep=2)
    a, b, c = episode("a"), episode("b"), episode("c")
    for e in (a, b, c):
        reg.add(e)
    assert len(reg) == 3 and reg.get("b") is b
    ids = np.arange(3, dtype=np.int32)
    a.step(ids, ids, np.zeros(3, np.float32), 2, 2, "gw", {}, True)
    a.finish(1.0, truncated=False)
    reg.ended(a)
    b.abandon("its agent went silent")
    reg.ended(b)
    assert len(reg) == 1 and list(reg.open) == ["c"]
    assert refusal(reg, "a") == (409, "episode_finished")
    assert refusal(reg, "b") == (410, "episode_abandoned")
    assert refusal(reg, "nope") == (404, "unknown_episode")
    c.abandon("its group was dropped")
    reg.ended(c)  # the third ended id: the oldest ("a") is forgotten, the memory stays at keep=2
    assert len(reg) == 0
    assert refusal(reg, "a") == (404, "unknown_episode")
    assert refusal(reg, "b") == (410, "episode_abandoned") and refusal(reg, "c") == (410, "episode_abandoned")


def test_the_abandon_marker_has_empty_arrays_and_says_what_to_drop() -> None:
    m = Transition.abandon_marker("gw.0.g3.1", 3, "gw", 4, 2, "agent_silent", whole_group=True)
    assert (m.traj_id, m.group_id, m.actor, m.step, m.version_lo, m.version_hi) == ("gw.0.g3.1", 3, "gw", 4, 2, 2)
    assert m.prompt_ids.size == m.response_ids.size == m.logprobs.size == 0
    assert m.prompt_ids.dtype == np.int32 and m.logprobs.dtype == np.float32
    assert not m.valid and not m.done and m.info == {ABANDON: "agent_silent", ABANDON_GROUP: True}
