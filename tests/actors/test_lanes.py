"""The actor's lanes (actors/actor.py): K episodes at once, whatever the length of the other episodes of their
group. Logic only: `play` is replaced by a sleep of a drawn length and the broker by a stub that grants groups
(the real actor, broker and engine run in tests/test_e2e.py). <1 s."""

from __future__ import annotations

import asyncio
import random
from types import SimpleNamespace

from actors.actor import Actor
from actors.spec import ActorSpec
from agentstream.config import Config
from agentstream.wire.messages import GroupGrant


class Broker:
    """Grants groups 0, 1, 2, ... each after `delay` seconds, up to `limit` of them (then never again)."""

    def __init__(self, limit: int, delay: float = 0.0):
        self.limit, self.delay, self.granted = limit, delay, 0

    async def request_group(self, groups: int = 1) -> GroupGrant:
        if self.granted >= self.limit:
            await asyncio.Event().wait()
        await asyncio.sleep(self.delay)
        self.granted += 1
        return GroupGrant(group_id=self.granted - 1, seed=100 + self.granted, min_version=0)


def make_actor(k: int, g: int, broker: Broker) -> Actor:
    cfg = Config()
    cfg.actors.episodes_per_actor, cfg.env.group_size = k, g
    engines = [SimpleNamespace(url="http://e:1")]
    return Actor(ActorSpec.from_config(cfg), "actor-0", 0, broker, engines, tokenizer=None)  # type: ignore[arg-type]


async def play_lanes(actor: Actor, length: dict[str, float], timeout: float = 5.0) -> list[tuple[str, str, float]]:
    """Run the lanes until the broker has no more groups and every episode ended; each episode sleeps
    length[traj_id] seconds. Returns (event, traj_id, time) for every start and end, in order."""
    events: list[tuple[str, str, float]] = []
    loop = asyncio.get_running_loop()

    async def play(grant: GroupGrant, traj_id: str, engine: object, share_first_turn: bool = False) -> None:
        assert grant.seed == 101 + grant.group_id  # the episode plays its own group's seed
        events.append(("start", traj_id, loop.time()))
        await asyncio.sleep(length[traj_id])
        events.append(("end", traj_id, loop.time()))

    actor.play = play  # type: ignore[method-assign]
    lanes = [asyncio.create_task(actor._lane()) for _ in range(actor.spec.episodes_per_actor)]
    try:
        async with asyncio.timeout(timeout):
            while len([e for e in events if e[0] == "end"]) < len(length):
                await asyncio.sleep(0.005)
    finally:
        for lane in lanes:
            lane.cancel()
        await asyncio.gather(*lanes, return_exceptions=True)
    return events


async def test_every_granted_episode_is_played_once_and_open_groups_stay_within_the_bound() -> None:
    """Property over random lengths: each group's G episodes (index 0..G-1) start once and end; at no time
    are more than K episodes running or more than K/G + 1 groups started and not finished."""
    rng = random.Random(0)
    for trial in range(6):
        g = rng.choice([1, 2, 4])
        k = g * rng.randint(1, 3)
        groups = rng.randint(3, 9)
        length = {
            f"actor-0.0.g{gid}.{i}": rng.choice([0.0, 0.001, 0.003, 0.02]) for gid in range(groups) for i in range(g)
        }
        actor = make_actor(k, g, Broker(groups, delay=rng.choice([0.0, 0.002])))
        events = await play_lanes(actor, length)
        starts = [t for e, t, _ in events if e == "start"]
        assert sorted(starts) == sorted(length), trial  # all of them, once each
        running: set[str] = set()
        started: set[str] = set()
        ended: dict[str, int] = {}
        peak_open = 0
        for e, t, _ in events:
            gid = t.split(".")[2]
            if e == "start":
                running.add(t)
                started.add(gid)
            else:
                running.discard(t)
                ended[gid] = ended.get(gid, 0) + 1
            assert len(running) <= k
            peak_open = max(peak_open, len([x for x in started if ended.get(x, 0) < g]))
        assert peak_open <= k // g + 1, (trial, peak_open)


async def test_a_lane_starts_the_next_group_while_its_group_waits_for_one_long_episode() -> None:
    """K = 4, G = 2 (two groups fill the lanes, one more may be in play): episode 0 of groups 0, 1 and 2 takes
    0.3 s, every other episode 0.01 s. The lanes that finish early start group 2 at once, not when group 0
    ends at 0.3 s (as one slot per group would); group 3 waits for a group to end: 3 are in play."""
    length = {f"actor-0.0.g{gid}.{i}": 0.01 for gid in range(4) for i in range(2)}
    for gid in range(3):
        length[f"actor-0.0.g{gid}.0"] = 0.3
    events = await play_lanes(make_actor(4, 2, Broker(4)), length)
    t0 = events[0][2]
    first_start: dict[str, float] = {}
    for e, t, at in events:
        if e == "start":
            first_start.setdefault(t.split(".")[2], at - t0)
    assert first_start["g1"] < 0.05 and first_start["g2"] < 0.1
    assert first_start["g3"] >= 0.29
