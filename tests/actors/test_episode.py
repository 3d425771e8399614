"""The one episode loop (actors/episode.py), and that the actor and the evaluator both play through it: a
three-cell corridor, a scripted answerer, and a tokenizer whose ids are the prompt's bytes, so every
expected value below is worked out by hand. <1 s."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np
import pytest

import actors.episode
from actors.actor import Actor
from actors.episode import Answer, StepRecord, Turn, play
from actors.evaluate import ValidationEpisode, play_episode
from actors.sampling import Sampler
from actors.spec import ActorSpec
from agentstream.config import Config
from agentstream.wire.messages import GroupGrant, Transition
from engines.client import EngineError, Generation

RIGHT, LEFT = "<action>right</action>", "<action>left</action>"


class Corridor:
    """Cells 0..3, the goal at 3; the episode starts at cell `seed`. RIGHT moves one cell (reward 1 and the
    end at the goal); any other answer is invalid: no move, reward 0. Records the thread of each call."""

    instructions = "Walk right."

    def __init__(self, max_steps: int = 8, blocking: bool = False, start: int | None = None):
        self.max_steps, self.blocking, self.start = max_steps, blocking, start  # start: a cell other than the seed
        self.threads: list[int] = []
        self.closed = False

    def _state(self) -> tuple[str, dict[str, Any]]:
        return f"at {self.pos}", {"anchor": f"cell{self.pos}", "admissible_actions": ["right"]}

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[str, dict[str, Any]]:
        self.threads.append(threading.get_ident())
        self.pos, self.steps = int(seed or 0) if self.start is None else self.start, 0
        return self._state()

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        self.threads.append(threading.get_ident())
        self.steps += 1
        valid = action == RIGHT
        self.pos += valid
        obs, info = self._state()
        done = self.pos == 3
        info.update(valid=valid, success=done)
        return obs, float(done), done, self.steps >= self.max_steps and not done, info

    def close(self) -> None:
        self.closed = True


class ByteTokenizer:
    """Chat template: the messages' contents joined by '|'; token ids: that text's UTF-8 bytes."""

    eos_token_id = 0

    def apply_chat_template(self, conversation: list[dict[str, str]], **kwargs: Any) -> list[int]:
        return list("|".join(m["content"] for m in conversation).encode())


# Start at cell 1 (seed 1); the answers: LEFT (invalid, stays at 1), RIGHT (to 2), RIGHT (to 3, the goal).
# last_k with k = 1 shows the newest step; the memory numbers steps from 1 ("Now (step n)").
SEED, SCRIPT = 1, [LEFT, RIGHT, RIGHT]
PROMPTS = [
    "Walk right.|Now (step 1):\nat 1",
    f"Walk right.|Recent steps:\nStep 1:\nat 1\nYou answered: {LEFT}\n\nNow (step 2):\nat 1",
    f"Walk right.|Recent steps:\nStep 2:\nat 1\nYou answered: {RIGHT}\n\nNow (step 3):\nat 2",
]
ANCHORS = ["cell1", "cell1", "cell2"]  # of the state acted in, not of the state reached
REWARDS = [0.0, 0.0, 1.0]
DONE = [False, False, True]
VALID = [False, True, True]


def memory_k1() -> Any:
    import memory

    return memory.make("last_k", k=1, tokenizer=ByteTokenizer(), max_prompt_tokens=10_000)


def scripted(answers: list[str]):
    it = iter(answers)

    def generate(turn: Turn) -> Answer:
        return Answer(next(it))

    return generate


async def test_on_step_sees_each_step_as_worked_out_by_hand() -> None:
    records: list[StepRecord[Answer]] = []
    env = Corridor()
    outcome = await play(env, memory_k1(), scripted(SCRIPT), records.append, seed=SEED)
    assert [r.turn.step for r in records] == [0, 1, 2]
    assert [r.turn.prompt_ids for r in records] == [list(p.encode()) for p in PROMPTS]
    assert [r.turn.anchor for r in records] == ANCHORS
    assert [r.turn.observation for r in records] == ["at 1", "at 1", "at 2"]
    assert [r.response.text for r in records] == SCRIPT
    assert [r.reward for r in records] == REWARDS
    assert [r.terminated for r in records] == DONE and not any(r.truncated for r in records)
    assert [r.valid for r in records] == VALID
    # 3 steps, env return 0 + 0 + 1 = 1, one invalid answer, the goal reached.
    assert (outcome.steps, outcome.env_return, outcome.invalid) == (3, 1.0, 1)
    assert outcome.success and outcome.ended
    assert not env.closed  # the caller owns the env


async def test_step_limit_and_truncation_end_the_episode() -> None:
    # Always LEFT: the env truncates at its max_steps = 2; a step_limit of 1 stops before the env does.
    env = Corridor(max_steps=2)
    records: list[StepRecord[Answer]] = []
    outcome = await play(env, memory_k1(), scripted([LEFT] * 5), records.append, seed=0)
    assert [(r.terminated, r.truncated) for r in records] == [(False, False), (False, True)]
    assert (outcome.steps, outcome.invalid, outcome.success, outcome.ended) == (2, 2, False, True)
    outcome = await play(env, memory_k1(), scripted([LEFT] * 5), seed=0, step_limit=1)
    assert (outcome.steps, outcome.ended) == (1, False)


async def test_a_blocking_env_runs_in_another_thread_and_the_callbacks_on_the_loop() -> None:
    env = Corridor(blocking=True)
    loop_thread = threading.get_ident()
    seen: list[int] = []

    async def generate(turn: Turn) -> Answer:
        seen.append(threading.get_ident())
        return Answer(RIGHT)

    async def on_step(record: StepRecord[Answer]) -> None:
        seen.append(threading.get_ident())

    outcome = await play(env, memory_k1(), generate, on_step, seed=SEED)
    assert outcome.steps == 2  # cell 1 -> 2 -> 3
    assert len(env.threads) == 3 and loop_thread not in env.threads  # reset and two steps, all in a thread
    assert seen == [loop_thread] * 4
    env = Corridor(blocking=False)
    await play(env, memory_k1(), scripted([RIGHT, RIGHT]), seed=SEED)
    assert env.threads == [loop_thread] * 3


class Engine:
    """Answers SCRIPT in order, as an engine would: response ids are the text's bytes, version 5."""

    url = "http://e:1"

    def __init__(self) -> None:
        self.answers, self.prompts = iter(SCRIPT), []

    async def generate(
        self, prompt_ids: list[int], sampling: Any, seed: int | None = None, images: Any = None
    ) -> Generation:
        self.prompts.append(list(prompt_ids))
        text = next(self.answers)
        ids = np.frombuffer(text.encode(), dtype=np.uint8).astype(np.int32)
        return Generation(ids, np.zeros(len(ids), np.float32), text, "stop", version_lo=5, version_hi=5)

    async def sample(
        self, prompt_ids: list[int], sampling: Any, n: int, seed: int | None = None, images: Any = None
    ) -> list[Generation]:
        return [await self.generate(prompt_ids, sampling, seed, images) for _ in range(n)]


class Broker:
    def __init__(self) -> None:
        self.sent: list[Transition] = []

    async def send_transition(self, t: Transition) -> None:
        self.sent.append(t)


@pytest.fixture
def spec(monkeypatch: pytest.MonkeyPatch) -> tuple[ActorSpec, list[str]]:
    """An ActorSpec whose env is the Corridor and memory last_k k = 1; the list logs each loop's callers."""
    cfg = Config()
    cfg.memory.k, cfg.memory.max_prompt_tokens, cfg.trainer.invalid_action_penalty = 1, 10_000, -0.25
    monkeypatch.setattr("actors.spec.envs.make", lambda name, **kwargs: Corridor(**kwargs))
    calls: list[str] = []
    real_play = actors.episode.play

    async def logged_play(*args: Any, **kwargs: Any):
        calls.append(asyncio.current_task().get_name())  # type: ignore[union-attr]
        return await real_play(*args, **kwargs)

    monkeypatch.setattr(actors.episode, "play", logged_play)
    return ActorSpec.from_config(cfg), calls


async def test_the_actor_plays_through_the_loop(spec: tuple[ActorSpec, list[str]]) -> None:
    actor_spec, calls = spec
    broker, engine = Broker(), Engine()
    actor = Actor(actor_spec, "actor-0", 0, broker, [engine], ByteTokenizer())  # type: ignore[arg-type]
    result = await asyncio.create_task(
        actor.play(GroupGrant(group_id=7, seed=SEED, min_version=6), "t", engine), name="actor"
    )
    assert calls == ["actor"]
    sent = broker.sent
    assert [t.step for t in sent] == [0, 1, 2]
    assert [t.prompt_ids.tolist() for t in sent] == [list(p.encode()) for p in PROMPTS] == engine.prompts
    assert [t.anchor for t in sent] == ANCHORS
    # The actor adds the invalid-action penalty (-0.25) to the env reward of the invalid first step.
    assert [t.reward for t in sent] == [-0.25, 0.0, 1.0]
    assert [t.done for t in sent] == DONE and [t.valid for t in sent] == VALID
    assert [(t.version_lo, t.version_hi) for t in sent] == [(6, 6)] * 3  # raised to the grant's min_version 6
    assert [bytes(t.response_ids.astype(np.uint8)).decode() for t in sent] == SCRIPT
    assert (result.steps, result.total_reward, result.success) == (3, 0.75, True)  # -0.25 + 0 + 1
    assert actor.counters["invalid_actions"] == 1 and actor.counters["episodes"] == 1
    assert actor.in_flight == 0 and actor.policy_version == 5


async def test_the_evaluator_plays_through_the_loop(spec: tuple[ActorSpec, list[str]]) -> None:
    actor_spec, calls = spec
    engine = Engine()
    episode = play_episode(actor_spec.episode, engine, ByteTokenizer(), SEED)  # type: ignore[arg-type]
    result = await asyncio.create_task(episode, name="evaluator")
    assert calls == ["evaluator"]
    assert engine.prompts == [list(p.encode()) for p in PROMPTS]  # exactly the actor's prompts
    assert result == ValidationEpisode(success=True, env_return=1.0, steps=3, invalid=1)  # env reward only: no penalty


async def test_a_cancel_that_comes_as_an_env_call_ends_is_never_lost(monkeypatch: pytest.MonkeyPatch) -> None:
    """EnvCalls.call with a timeout, cancelled in the very loop turn in which its call's answer arrives, raises
    CancelledError. With asyncio.wait_for (Python 3.11) it returned the answer instead: the cancel was lost, and the
    actor's lane played on while its actor (or a test) waited for it to stop."""
    import types

    class InlineThread:  # the call runs at once; its answer, then the cancel, are queued for the next loop turn
        def __init__(self, target: Callable[[], None], **_: object) -> None:
            self.target = target

        def start(self) -> None:
            self.target()  # (its answer goes through loop.call_soon_threadsafe)
            asyncio.get_running_loop().call_soon(asyncio.current_task().cancel)

    monkeypatch.setattr(actors.episode, "threading", types.SimpleNamespace(Thread=InlineThread))
    calls = actors.episode.EnvCalls(timeout_s=10.0)
    for _ in range(5):
        with pytest.raises(asyncio.CancelledError):
            await asyncio.create_task(calls.call(True, lambda: "answer"))


class GroupEngine:
    """Answers RIGHT to every request, each answer labelled with a version of its own (1, 2, 3, ...); records
    (n, prompt) of every request; with `fail_shared`, a request of n > 1 fails as a dead engine's would."""

    def __init__(self, url: str, fail_shared: bool = False) -> None:
        self.url, self.fail_shared = url, fail_shared
        self.requests: list[tuple[int, str]] = []
        self.answered = 0

    async def sample(
        self, prompt_ids: list[int], sampling: Any, n: int, seed: int | None = None, images: Any = None
    ) -> list[Generation]:
        self.requests.append((n, bytes(prompt_ids).decode()))
        await asyncio.sleep(0.001)
        if n > 1 and self.fail_shared:
            raise EngineError(f"{self.url}: injected failure")
        ids = np.frombuffer(RIGHT.encode(), dtype=np.uint8).astype(np.int32)
        self.answered += n
        return [
            Generation(ids, np.zeros(len(ids), np.float32), RIGHT, "stop", v, v)
            for v in range(self.answered - n + 1, self.answered + 1)
        ]


class GroupBroker(Broker):
    """Grants `groups` groups (seed 1: two steps to the goal); then a lane that asks for more stops, as when its actor
    is stopped."""

    def __init__(self, groups: int) -> None:
        super().__init__()
        self.left = groups

    async def request_group(self, groups: int = 1) -> GroupGrant:
        if not self.left:
            raise asyncio.CancelledError
        self.left -= 1
        return GroupGrant(group_id=self.left, seed=SEED, min_version=0)


async def play_groups(spec: ActorSpec, engines: list[GroupEngine], groups: int) -> tuple[Actor, GroupBroker]:
    """The actor's lanes (K = G = 4) play `groups` groups of the corridor to their end."""
    broker = GroupBroker(groups)
    actor = Actor(
        replace(spec, episodes_per_actor=4, group_size=4),
        "actor-0",
        0,
        broker,
        engines,  # type: ignore
        ByteTokenizer(),
    )
    lanes = [asyncio.create_task(actor._lane()) for _ in range(4)]
    async with asyncio.timeout(10):
        await asyncio.gather(*lanes, return_exceptions=True)
    assert actor.counters["episodes"] == groups * 4 and not actor._open
    return actor, broker


async def test_a_groups_first_turns_are_one_request_of_n_answers(
    spec: tuple[ActorSpec, list[str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """actors.share_first_turn: a group's 4 episodes start from one prompt; their first turns come from one request
    of n = 4, one answer each; their second turns (different prompts) ask one by one. A failed shared request has
    each episode ask on its own, on the other engine; an episode whose first prompt is not the group's asks on its
    own; with the option off, every turn asks on its own."""
    actor_spec, _ = spec
    first = PROMPTS[0]
    second = f"Walk right.|Recent steps:\nStep 1:\nat 1\nYou answered: {RIGHT}\n\nNow (step 2):\nat 2"
    engine = GroupEngine("http://e:1")
    actor, broker = await play_groups(actor_spec, [engine], groups=2)
    assert sorted(engine.requests) == [(1, second)] * 8 + [(4, first)] * 2
    firsts = [t for t in broker.sent if t.step == 0]
    for group in (0, 1):  # each episode got an answer of its own: a version of its own
        assert len({t.version_lo for t in firsts if t.group_id == group}) == 4
    assert {t.traj_id.rsplit(".", 1)[1] for t in firsts} == {"0", "1", "2", "3"} and not actor.sampler._first_turns

    dead, alive = GroupEngine("http://dead:1", fail_shared=True), GroupEngine("http://alive:1")
    monkeypatch.setattr(Sampler, "pick_engine", lambda self: dead if not self.counters["engine_failovers"] else alive)
    actor, broker = await play_groups(actor_spec, [dead, alive], groups=1)
    assert dead.requests == [(4, first)] and sorted(alive.requests) == [(1, first)] * 4 + [(1, second)] * 4
    assert actor.counters["engine_failovers"] == 4 and actor.counters["infra_failures"] == 0
    assert len(broker.sent) == 8 and not actor.sampler._first_turns

    starts = iter([1, 2, 1, 1])  # the second episode's env starts elsewhere than its group's others
    monkeypatch.setattr(Sampler, "pick_engine", lambda self: self.engines[0])
    monkeypatch.setattr("actors.spec.envs.make", lambda name, **kwargs: Corridor(start=next(starts)))
    engine = GroupEngine("http://e:1")
    actor, broker = await play_groups(actor_spec, [engine], groups=1)
    assert [n for n, prompt in engine.requests if prompt == first] == [4]
    assert (1, "Walk right.|Now (step 1):\nat 2") in engine.requests and len(broker.sent) == 3 * 2 + 1

    engine = GroupEngine("http://e:1")
    monkeypatch.setattr("actors.spec.envs.make", lambda name, **kwargs: Corridor(**kwargs))
    await play_groups(replace(actor_spec, share_first_turn=False), [engine], groups=1)
    assert sorted(engine.requests) == [(1, first)] * 4 + [(1, second)] * 4
