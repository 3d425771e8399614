"""Self-play through the actor (actors/actor.py `play_match` over actors/episode.py `play_match`): TextArena with
`opponent=self`, both seats answered by a scripted engine through the real actor path (the env, one memory per seat,
the chat template, transitions to the broker), the outcomes worked out by hand below; then the actor's lanes against
the real broker (broker.server.Broker on ZeroMQ, in this loop), which opens one group per seat with one grant; then a
match whose env raises, retried or dropped in both seats' groups; then a frozen seat (`opponent=frozen`): one seat's
steps sent, the other's turns answered by the engine's frozen copy, one group per grant. The real vLLM engine plays
self-play in tests/test_e2e_envs.py, a frozen seat in tests/engines/test_engines_lora.py. ~3 s.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from typing import Any

import numpy as np
import pytest
import textarena
from e2e_testing import broker_and_client, check_accounting
from textarena.envs.TicTacToe.env import TicTacToeEnv

from actors.actor import Actor, EpisodeResult
from actors.spec import ActorSpec
from agentstream.config import Config
from agentstream.models import FROZEN_ADAPTER_NAME
from agentstream.wire.messages import ABANDON, ABANDON_GROUP, GroupGrant, Transition
from engines.client import Generation

ENV = "agentstream/TextArena-v0"
PENALTY = -0.25  # the actor's invalid-action penalty here (trainer.invalid_action_penalty)


def config(game: str = "TicTacToe-v0", **over: Any) -> Config:
    cfg = Config()
    cfg.env.name, cfg.env.max_steps, cfg.env.kwargs = ENV, 9, {"game": game, "opponent": "self"}
    cfg.memory.k, cfg.memory.max_prompt_tokens = 2, 100_000
    cfg.trainer.invalid_action_penalty = PENALTY
    for key, value in over.items():
        section, name = key.split("__")
        setattr(getattr(cfg, section), name, value)
    return cfg


class ByteTokenizer:
    """Chat template: the messages' contents joined by '|'; token ids: that text's UTF-8 bytes."""

    eos_token_id = 0

    def apply_chat_template(self, conversation: list[dict[str, str]], **kwargs: Any) -> list[int]:
        return list("|".join(m["content"] for m in conversation).encode())


def answer(text: str, n: int) -> list[Generation]:
    ids = np.frombuffer(text.encode(), dtype=np.uint8).astype(np.int32)
    return [Generation(ids, np.zeros(len(ids), np.float32), text, "stop", 0, 0) for _ in range(n)]


def seat_and_legal(prompt_ids: list[int]) -> tuple[int, list[str]]:
    """The seat whose turn the prompt is (its newest "You are player N.") and the legal moves it lists."""
    text = bytes(prompt_ids).decode()
    return (
        int(re.findall(r"You are player (\d)\.", text)[-1]),
        re.findall(r"Your legal moves: (.*)\.", text)[-1].split(", "),
    )


class ScriptedSeats:
    """Answers each seat's turns from its own script, in order ("junk": an answer without tags)."""

    url = "http://e:1"

    def __init__(self, scripts: dict[int, list[str]]) -> None:
        self.scripts = {seat: iter(moves) for seat, moves in scripts.items()}

    async def sample(
        self, prompt_ids: list[int], sampling: Any, n: int, seed: int | None = None, images: Any = None
    ) -> list[Generation]:
        seat, _ = seat_and_legal(prompt_ids)
        move = next(self.scripts[seat])
        return answer(move if move == "junk" else f"<action>{move}</action>", n)


class Policy:
    """Answers every turn with a move chosen from the legal ones by `choose` (both seats alike)."""

    url = "http://e:1"

    def __init__(self, choose: Any) -> None:
        self.choose = choose

    async def sample(
        self, prompt_ids: list[int], sampling: Any, n: int, seed: int | None = None, images: Any = None
    ) -> list[Generation]:
        return answer(f"<action>{self.choose(seat_and_legal(prompt_ids)[1])}</action>", n)


class Broker_:
    """Keeps what the actor sends."""

    def __init__(self) -> None:
        self.sent: list[Transition] = []

    async def send_transition(self, t: Transition) -> None:
        self.sent.append(t)


def actor_for(cfg: Config, broker: Any, engine: Any) -> Actor:
    return Actor(ActorSpec.from_config(cfg), "actor-0", 0, broker, [engine], ByteTokenizer())


def by_traj(sent: list[Transition]) -> dict[str, list[Transition]]:
    out: dict[str, list[Transition]] = {}
    for t in sent:
        out.setdefault(t.traj_id, []).append(t)
    return out


# Tic Tac Toe, seat 0 ('O') first. Seat 0 plays 0 4 5 7, seat 1 plays 1 2 3 6: O X X / X O O / X O . with no line,
# cell 8 the only one left. Seat 0's fifth answer has no tags: -0.2 (the env) and a random legal move in its place,
# which can only be 8: the diagonal 0-4-8, seat 0 wins. So seat 0: 5 steps, rewards 0 0 0 0 and -0.2 + 1 - 0.25 (the
# actor's penalty) = 0.55; seat 1: 4 steps, rewards 0 0 0 -1 (its outcome on its last step, sent after seat 0's).
FORCED_WIN = {0: ["0", "4", "5", "7", "junk"], 1: ["1", "2", "3", "6"]}


async def test_a_match_sends_each_seat_as_a_trajectory_of_its_own_group() -> None:
    cfg = config()
    assert ActorSpec.from_config(cfg).episode.seats == 2
    broker = Broker_()
    actor = actor_for(cfg, broker, engine := ScriptedSeats(FORCED_WIN))
    results = await actor.play_match(GroupGrant(group_id=10, seed=3, min_version=0), ["a", "b"], engine)  # type: ignore
    # A seat's step goes once what followed it is known: the other seat's reply, or the end of the game.
    assert [(t.traj_id, t.step) for t in broker.sent] == [
        ("a", 0),
        ("b", 0),
        ("a", 1),
        ("b", 1),
        ("a", 2),
        ("b", 2),
        ("a", 3),
        ("a", 4),
        ("b", 3),
    ]
    a, b = by_traj(broker.sent)["a"], by_traj(broker.sent)["b"]
    assert {t.group_id for t in a} == {10} and {t.group_id for t in b} == {11}  # seat s: group grant.group_id + s
    assert [t.reward for t in a] == pytest.approx([0, 0, 0, 0, 0.55]) and [t.reward for t in b] == [0, 0, 0, -1]
    assert [t.valid for t in a] == [True] * 4 + [False] and all(t.valid for t in b)
    assert [t.done for t in a] == [False] * 4 + [True] and [t.done for t in b] == [False] * 3 + [True]
    assert not any(t.truncated for t in a + b)
    assert a[-1].info["success"] and not b[-1].info["success"]
    assert [t.anchor for t in a[:2]] == ["seat 0: .../.../...", "seat 0: OX./.../..."]
    assert [t.anchor for t in b[:2]] == ["seat 1: O../.../...", "seat 1: OX./.O./..."]
    for seat, steps in ((0, a), (1, b)):  # each seat's prompts are its own: its rules, its observations
        for t in steps:
            prompt = bytes(t.prompt_ids.astype(np.uint8)).decode()
            assert f"You are Player {seat} in Tic Tac Toe" in prompt and f"You are player {1 - seat}." not in prompt
    assert results == [EpisodeResult(5, pytest.approx(0.55), True), EpisodeResult(4, -1.0, False)]
    assert (actor.counters["episodes"], actor.counters["successes"], actor.counters["invalid_actions"]) == (2, 1, 1)


def bet_or_call(legal: list[str]) -> str:
    return "bet" if "bet" in legal else "call"


# Kuhn Poker (3 rounds), both seats betting when they may and calling otherwise: each round its opener bets and the
# other calls, one move each, so 3 steps per seat; every round is a called bet (a showdown for 2 chips), so the
# chips never tie: one seat ends +1, the other -1, on its last step, 0 before.
async def test_kuhn_matches_are_zero_sum_and_a_seed_replays_the_same_match() -> None:
    cfg = config("KuhnPoker-v0")
    winners = set()
    for seed in range(6):
        runs = []
        for _ in range(2):  # two matches of a group: the same seed
            broker = Broker_()
            engine = Policy(bet_or_call)
            await actor_for(cfg, broker, engine).play_match(
                GroupGrant(group_id=0, seed=seed, min_version=0), ["a", "b"], engine
            )  # type: ignore[arg-type]
            runs.append(by_traj(broker.sent))
        a, b = runs[0]["a"], runs[0]["b"]
        assert len(a) == len(b) == 3 and a[-1].done and b[-1].done
        assert [t.reward for t in a[:2] + b[:2]] == [0.0] * 4 and a[-1].reward == -b[-1].reward in (-1.0, 1.0)
        winners.add(0 if a[-1].reward > 0 else 1)
        for traj in ("a", "b"):  # the same deal and the same answers: the same prompts
            assert [t.prompt_ids.tolist() for t in runs[0][traj]] == [t.prompt_ids.tolist() for t in runs[1][traj]]
    assert winners == {0, 1}


def lowest(legal: list[str]) -> str:
    return min(legal, key=int)


@contextlib.asynccontextmanager
async def broker_and_actor(cfg: Config, engine: Any):
    """A broker (this loop) and one actor's lanes (this loop) playing on `engine`; both stopped on exit."""
    async with broker_and_client(cfg) as (broker, client):
        actor = Actor(ActorSpec.from_config(cfg), "actor-0", 0, client, [engine], ByteTokenizer())
        task = asyncio.create_task(actor.run())
        try:
            yield broker, actor
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


# Both seats take the lowest free cell: O0 X1 O2 X3 O4 X5 O6, and O has the diagonal 2-4-6 (no line before). Seat 0:
# 4 steps, return +1; seat 1: 3 steps, return -1, in every match of the group.
async def test_one_grant_opens_a_group_per_seat_at_the_broker() -> None:
    """The actor asks for 2 groups per grant: groups 0 (seat 0) and 1 (seat 1), G = 2 matches from one seed, each
    group complete with its G trajectories, the accounting exact. groups_per_step 2 at staleness bound 0 and no
    learner: the first request (2 groups, the whole step) is admitted, the next waits."""
    cfg = config(
        env__group_size=2,
        actors__episodes_per_actor=2,
        trainer__groups_per_step=2,
        trainer__max_staleness=0,
        learner__world_size=1,
        broker__track_keys=True,
        broker__logger=[],
        engines__max_model_len=8192,
    )  # (a byte per token: the rules alone are ~1000)
    async with broker_and_actor(cfg, Policy(lowest)) as (broker, actor):
        async with asyncio.timeout(20):
            while len(broker.buffer.ready) < 2:
                await asyncio.sleep(0.05)
        await asyncio.sleep(0.2)  # (time for a wrongly admitted third group to show)
        buffer = broker.buffer
        assert buffer.counts["groups_admitted"] == 2 and not buffer.open
        groups = sorted(buffer.ready, key=lambda g: g.group_id)
        assert [g.group_id for g in groups] == [0, 1] and groups[0].seed == groups[1].seed
        for seat, group in enumerate(groups):
            assert sorted(group.trajectories) == [f"actor-0.0.g{seat}.{i}" for i in range(2)]
            assert group.returns() == [1.0, 1.0] if seat == 0 else group.returns() == [-1.0, -1.0]
            assert all(t.anchor.startswith(f"seat {seat}:") for steps in group.trajectories.values() for t in steps)
            assert sorted(len(steps) for steps in group.trajectories.values()) == [4 - seat] * 2
        assert actor.counters["episodes"] == 4
    summary = broker.summary()
    check_accounting(summary)
    assert summary["transitions_ingested"] == 2 * (4 + 3)


class FlakyTicTacToe(TicTacToeEnv):
    """Tic Tac Toe whose third move raises the first `flaky` times it is played (a game with a passing bug)."""

    flaky = 0

    def step(self, action: str):
        if sum(cell != "" for row in self.state.game_state["board"] for cell in row) == 2 and FlakyTicTacToe.flaky:
            FlakyTicTacToe.flaky -= 1
            raise RuntimeError("a passing bug in the game")
        return super().step(action)


textarena.register(id="AgentstreamFlakyTicTacToe-v0-raw", entry_point=FlakyTicTacToe)


# Lowest free cell again: seat 0 plays 0, seat 1 plays 1, and seat 0's second move (the game's third) raises. By then
# seat 0 has sent its first step (sent at its second turn) and seat 1 nothing (its first step waits for its next turn).
@pytest.mark.parametrize("retries", [1, 0])
async def test_a_failed_match_is_played_again_or_dropped_in_both_seats_groups(retries: int) -> None:
    FlakyTicTacToe.flaky = 1
    cfg = config("AgentstreamFlakyTicTacToe-v0", actors__episode_retries=retries)
    broker = Broker_()
    actor = actor_for(cfg, broker, engine := Policy(lowest))
    await actor._episode(GroupGrant(group_id=10, seed=3, min_version=0), 0, engine)  # type: ignore[arg-type]
    markers = [(t.traj_id, t.group_id, t.step, t.info[ABANDON_GROUP]) for t in broker.sent if ABANDON in t.info]
    assert actor.counters["infra_failures_raised"] == 1
    if retries:  # seat 0's sent step is withdrawn; seat 1 sent nothing to withdraw; the match is played again
        assert markers == [("actor-0.0.g10.0", 10, 1, False)]
        again = by_traj([t for t in broker.sent if ".r1" in t.traj_id])
        assert sorted(again) == ["actor-0.0.g10.0.r1", "actor-0.0.g11.0.r1"]
        assert [t.reward for t in again["actor-0.0.g10.0.r1"]] == [0, 0, 0, 1]  # O0 X1 O2 X3 O4 X5 O6, as above
        assert {t.group_id for t in again["actor-0.0.g11.0.r1"]} == {11}
    else:  # given up: both seats' groups are dropped whole
        assert markers == [("actor-0.0.g10.0", 10, 1, True), ("actor-0.0.g11.0", 11, 0, True)]
        assert len(broker.sent) == 3 and 10 in actor._failed_groups


# ---- a frozen seat: one seat trained, the other answered by the engine's frozen copy --------------------------------


class WithFrozenCopy:
    """An engine (`answers`: ScriptedSeats or Policy) whose frozen copy (`with_model`) answers from the same script and
    notes the seat of every turn it answers."""

    url = "http://e:1"

    def __init__(self, answers: Any) -> None:
        self.answers, self.copies, self.frozen_seats = answers, [], []
        self.policy_seats: list[int] = []

    async def sample(
        self, prompt_ids: list[int], sampling: Any, n: int, seed: int | None = None, images: Any = None
    ) -> list[Generation]:
        self.policy_seats += [seat_and_legal(prompt_ids)[0]] * n
        return await self.answers.sample(prompt_ids, sampling, n, seed, images)

    def with_model(self, model: str, base_while_absent: bool = False) -> Any:
        self.copies.append((model, base_while_absent))
        outer = self

        class FrozenCopy:
            url = outer.url

            async def sample(
                self, prompt_ids: list[int], sampling: Any, n: int, seed: int | None = None, images: Any = None
            ) -> list[Generation]:
                outer.frozen_seats += [seat_and_legal(prompt_ids)[0]] * n
                return await outer.answers.sample(prompt_ids, sampling, n, seed, images)

        return FrozenCopy()


def frozen_config(seat: int | None = None, **over: Any) -> Config:
    cfg = config(**over)
    cfg.env.kwargs = {**cfg.env.kwargs, "opponent": "frozen", **({"seat": seat} if seat is not None else {})}
    return cfg


# FORCED_WIN again, one seat trained. Seat 0 trained: its 5 steps are sent, rewards 0 0 0 0 0.55 (its junk answer: the
# env's -0.2 and the actor's -0.25, the random move 8 wins +1); seat 1's 4 turns go to the frozen copy, nothing of them
# is sent. Seat 1 trained: its 4 steps, rewards 0 0 0 -1 (it loses after seat 0's random move), and seat 0's 5 turns
# (one invalid) are the frozen copy's.
@pytest.mark.parametrize("seat, rewards, frozen_turns", [(0, [0, 0, 0, 0, 0.55], 4), (1, [0, 0, 0, -1], 5)])
async def test_a_frozen_match_sends_only_the_trained_seats_steps(
    seat: int, rewards: list[float], frozen_turns: int
) -> None:
    cfg = frozen_config(seat, trainer__invalid_action_penalty=PENALTY)
    spec = ActorSpec.from_config(cfg)
    assert (spec.episode.seats, spec.episode.trained_seats, spec.episode.frozen) == (2, 1, True)
    broker = Broker_()
    engine = WithFrozenCopy(ScriptedSeats(FORCED_WIN))
    actor = actor_for(cfg, broker, engine)
    results = await actor.play_match(GroupGrant(group_id=10, seed=3, min_version=0), ["a"], engine)  # type: ignore
    assert [t.traj_id for t in broker.sent] == ["a"] * len(rewards) and {t.group_id for t in broker.sent} == {10}
    assert [t.step for t in broker.sent] == list(range(len(rewards)))
    assert [t.reward for t in broker.sent] == pytest.approx(rewards) and broker.sent[-1].done
    assert all(t.anchor.startswith(f"seat {seat}:") for t in broker.sent)
    for t in broker.sent:  # the trained seat's own prompts: its rules, its observations
        assert f"You are Player {seat} in Tic Tac Toe" in bytes(t.prompt_ids.astype(np.uint8)).decode()
    # Every turn of the other seat went to the frozen copy (FROZEN_ADAPTER_NAME, the base model until it is loaded).
    assert engine.copies == [(FROZEN_ADAPTER_NAME, True)]
    assert engine.frozen_seats == [1 - seat] * frozen_turns and engine.policy_seats == [seat] * len(rewards)
    assert results == [EpisodeResult(len(rewards), pytest.approx(sum(rewards)), seat == 0)]
    assert actor.counters["episodes"] == 1 and actor.counters["frozen_steps"] == frozen_turns
    assert actor.counters["frozen_invalid_actions"] == (1 if seat == 1 else 0)
    assert actor.counters["invalid_actions"] == (1 if seat == 0 else 0)  # (counted for sent steps only)


# Both seats take the lowest free cell (the frozen copy too): O has the diagonal 2-4-6 after 4 moves, X lost after 3.
async def test_a_frozen_seat_grant_opens_one_group_of_the_trained_seat() -> None:
    """With a frozen seat the actor asks for 1 group per grant: group 0, G = 2 matches from one seed, each a trajectory
    of the trained seat (drawn from the seed) that the broker completes; groups_per_step 1 at bound 0, no learner: only
    that group is admitted. The accounting is exact and counts the trained seat's steps only."""
    cfg = frozen_config(
        env__group_size=2,
        actors__episodes_per_actor=2,
        trainer__groups_per_step=1,
        trainer__max_staleness=0,
        learner__world_size=1,
        broker__track_keys=True,
        broker__logger=[],
        engines__max_model_len=8192,
    )
    engine = WithFrozenCopy(Policy(lowest))
    async with broker_and_actor(cfg, engine) as (broker, actor):
        async with asyncio.timeout(20):
            while len(broker.buffer.ready) < 1:
                await asyncio.sleep(0.05)
        await asyncio.sleep(0.2)  # (time for a wrongly admitted second group to show)
        buffer = broker.buffer
        assert buffer.counts["groups_admitted"] == 1 and not buffer.open
        (group,) = buffer.ready
        assert group.group_id == 0 and sorted(group.trajectories) == [f"actor-0.0.g0.{i}" for i in range(2)]
        anchors = {t.anchor[:6] for steps in group.trajectories.values() for t in steps}
        assert len(anchors) == 1  # one seat trained in the whole group
        seat = int(anchors.pop()[-1])
        assert group.returns() == ([1.0, 1.0] if seat == 0 else [-1.0, -1.0])
        assert [len(steps) for steps in group.trajectories.values()] == [4 - seat] * 2
        assert set(engine.frozen_seats) == {1 - seat} and set(engine.policy_seats) == {seat}
        assert actor.counters["episodes"] == 2 and actor.counters["frozen_steps"] == 2 * (3 + seat)
    summary = broker.summary()
    check_accounting(summary)
    assert summary["transitions_ingested"] == 2 * (4 - seat)
