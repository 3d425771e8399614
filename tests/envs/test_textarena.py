"""TextArena's two-player games as one seat against a fixed opponent (envs/arena.py), on the real `textarena` games.

Scripted games are played to the end against the "first legal move" opponent, whose replies are worked out by hand
below; then invalid answers, a game that raises (inline and through the actors' episode loop), random-opponent games
over many seeds, the global RNG left alone, self-play (both seats by the caller: turns alternate, both outcomes at the
end, an invalid answer's random move in the seat's place), and whole games through the actor (`Actor.play`: env ->
memory -> engine -> transitions to the broker) with a scripted engine; self-play matches through the actor are in
tests/actors/test_self_play.py. ~2 s.
"""

from __future__ import annotations

import random
import re
from typing import Any

import numpy as np
import pytest
import textarena
from textarena.envs.TicTacToe.env import TicTacToeEnv

import envs
from actors.actor import Actor
from actors.episode import Answer, EnvCalls, EnvFailure, play
from actors.spec import ActorSpec
from agentstream.config import Config
from agentstream.wire.messages import GroupGrant, Transition
from engines.client import Generation
from envs.arena import SUPPORTED, parse_move
from envs.base import Action, ParseFailure

ENV = "agentstream/TextArena-v0"


def act(move: str) -> str:
    return f"<action>{move}</action>"


def make(**kwargs: Any):
    return envs.make(ENV, **kwargs)


# Tic Tac Toe, cells numbered 0-8 row by row; player 0 ('O') moves first. The "first" opponent takes the lowest free
# cell. As seat 0:
#   win:  we 4, it 0; we 2, it 1; we 6: 2-4-6 is our diagonal -> +1 after our 3rd move.
#   draw: we 1, it 0; we 3, it 2; we 4, it 5; we 6, it 7; we 8: X O X / O O X / O X O, no line, board full -> 0.
# As seat 1 (it opens): it 0; we 8, it 1; we 7, it 2: 0-1-2 is its row -> -1 after our 2nd move.
SCRIPTS = {"win": (0, ["4", "2", "6"], 1.0), "draw": (0, ["1", "3", "4", "6", "8"], 0.0), "loss": (1, ["8", "7"], -1.0)}


@pytest.mark.parametrize("outcome", sorted(SCRIPTS))
def test_tictactoe_scripted_games_end_with_the_games_reward(outcome: str) -> None:
    seat, moves, expected = SCRIPTS[outcome]
    env = make(seat=seat, opponent="first", max_steps=9)
    obs, info = env.reset(seed=11)
    assert info["seat"] == seat and f"You are Player {seat} in Tic Tac Toe" in env.instructions
    rewards, ended = [], []
    for move in moves:
        assert move in info["admissible_actions"]
        obs, reward, terminated, truncated, info = env.step(act(move))
        assert info["valid"] and not truncated
        rewards.append(reward)
        ended.append(terminated)
    assert rewards == [0.0] * (len(moves) - 1) + [expected]  # the outcome comes at the end, nothing before
    assert ended == [False] * (len(moves) - 1) + [True]
    assert info["success"] is (expected > 0) and info["admissible_actions"] == [] and "Game over" in obs


# Kuhn Poker (KuhnPoker-v0: 3 rounds, each player antes 1, round 1 opened by player 1, then alternating). The
# "first" opponent checks when it may (the tree lists check before bet) and folds to a bet (fold before call). So
# betting at every turn wins every pot: with seat 0 it checks, we bet, it folds (rounds 1 and 3), or we open with a
# bet and it folds (round 2); with seat 1 the other way round. 3 rounds x +1 chip: we finish +3, it -3 -> reward +1,
# after exactly 3 of our moves, whatever the cards.
@pytest.mark.parametrize("seat", [0, 1])
def test_kuhn_poker_always_betting_beats_the_folding_opponent(seat: int) -> None:
    env = make(game="KuhnPoker-v0", seat=seat, opponent="first", max_steps=10)
    obs, info = env.reset(seed=5)
    assert info["admissible_actions"] == ["check", "bet"] and "Your card is" in obs
    steps = 0
    while True:
        obs, reward, terminated, truncated, info = env.step(act("bet"))
        steps += 1
        if terminated or truncated:
            break
        assert reward == 0.0
    assert (steps, reward, terminated, info["success"]) == (3, 1.0, True, True)
    assert "Player 0: '3'; Player 1: '-3'" in obs if seat == 0 else "Player 0: '-3'; Player 1: '3'" in obs


def test_invalid_answers_do_not_move_the_game_and_cost_the_penalty() -> None:
    env = make(seat=0, opponent="first", max_steps=9)
    env.reset(seed=0)
    obs, _, _, _, info = env.step(act("4"))  # it replies 0
    board = info["anchor"]
    for text in ["4", act("4"), act("0"), act("9"), act("center"), ""]:  # no tag, occupied, off the board, junk
        again, reward, terminated, truncated, info = env.step(text)
        assert (again, reward, terminated, truncated, info["valid"]) == (obs, -0.2, False, False, False)
        assert info["parse_error"] and info["anchor"] == board
    _, reward, _, _, info = env.step(act("[2]"))  # TextArena's own bracketed form is accepted too
    assert info["valid"] and info["anchor"] == "seat 0: XXO/.O./..."  # our 2, its 1
    kuhn = make(game="KuhnPoker-v0", seat=0, opponent="first")
    kuhn.reset(seed=0)
    _, reward, _, _, info = kuhn.step(act("call"))  # nothing to call: it checked
    assert (reward, info["valid"]) == (-0.2, False) and "legal moves: check, bet" in info["parse_error"]


def test_invalid_answers_until_the_step_limit_truncate_without_a_game_reward() -> None:
    env = make(seat=0, max_steps=5)
    env.reset(seed=0)
    rewards = [env.step("pass")[1] for _ in range(4)]
    _, reward, terminated, truncated, _ = env.step("pass")
    # 5 x -0.2 = -1.0: stalling costs as much as the loss it avoids
    assert rewards + [reward] == [-0.2] * 5 and (terminated, truncated) == (False, True)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("<action>4</action>", Action("4")),
        ("I pick <ACTION> [4] </ACTION>", Action("4")),
        ("<action>'Bet'</action>", Action("bet")),
        ("<action>5</action>", ParseFailure("")),
        ("4", ParseFailure("")),
        (None, ParseFailure("")),
    ],
)
def test_parse_move(text: Any, expected: Any) -> None:
    got = parse_move(text, ["0", "4", "bet"])
    assert type(got) is type(expected) and (isinstance(got, ParseFailure) or got == expected)


class RaisingTicTacToe(TicTacToeEnv):
    """Tic Tac Toe whose step raises once cell 8 is played: a game with a bug."""

    def step(self, action: str):
        if "8" in action:
            raise KeyError("a bug in the game")
        return super().step(action)


textarena.register(id="AgentstreamRaisingTicTacToe-v0-raw", entry_point=RaisingTicTacToe)


async def test_a_game_that_raises_fails_the_step_and_the_actor_sees_an_env_failure() -> None:
    env = make(game="AgentstreamRaisingTicTacToe-v0", seat=0, opponent="first")
    env.reset(seed=0)
    env.step(act("4"))
    with pytest.raises(KeyError, match="a bug in the game"):
        env.step(act("8"))

    import memory

    answers = iter([act("4"), act("8")])
    with pytest.raises(EnvFailure) as failure:  # what the actor retries on the same seed (infra_failures_raised)
        await play(env, memory.make("last_k", k=2), lambda turn: Answer(next(answers)), seed=0, calls=EnvCalls())
    assert failure.value.cause == "raised"


def test_unknown_and_unsupported_games_say_what_is_supported() -> None:
    with pytest.raises(ValueError, match="not a TextArena game id.*TicTacToe-v0"):
        make(game="NoSuchGame-v0")
    with pytest.raises(ValueError, match="no adapter.*KuhnPoker-v0"):
        make(game="ConnectFour-v0")
    with pytest.raises(ValueError, match="opponent"):
        make(opponent="itself")
    with pytest.raises(ValueError, match="both seats; leave seat out"):
        make(opponent="self", seat=0)
    assert all(make(game=g).game == g for g in SUPPORTED)


@pytest.mark.parametrize("game", ["TicTacToe-v0", "KuhnPoker-v0"])
def test_random_games_end_with_a_zero_sum_outcome_and_seats_come_from_the_seed(game: str) -> None:
    env, rng = make(game=game, max_steps=50), random.Random(0)
    outcomes, seats = [], set()
    for seed in range(60):
        obs, info = env.reset(seed=seed)
        seats.add(info["seat"])
        while True:  # a random legal policy against the random opponent
            obs, reward, terminated, truncated, info = env.step(act(rng.choice(info["admissible_actions"])))
            assert info["valid"] and not truncated
            if terminated:
                break
        outcomes.append(reward)
    assert seats == {0, 1} and set(outcomes) <= {-1.0, 0.0, 1.0}
    assert {-1.0, 1.0} <= set(outcomes)  # both sides win some
    assert [make(game=game).reset(seed=s)[1]["seat"] for s in range(8)] == [
        make(game=game).reset(seed=s)[1]["seat"] for s in range(8)
    ]  # a group's copies play one seat


def test_kuhn_deals_come_from_the_seed_and_the_global_rng_is_left_alone() -> None:
    def deals(seed: int) -> list[str]:
        """The anchors (our card, chips, round) of a game in which we check or call, the opponent random."""
        env = make(game="KuhnPoker-v0", seat=0, opponent="random", max_steps=50)
        _, info = env.reset(seed=seed)
        anchors = [info["anchor"]]
        random.seed(123)  # another episode (or TextArena elsewhere) seeding the global RNG in between
        while True:
            move = "check" if "check" in info["admissible_actions"] else "call"
            _, _, terminated, _, info = env.step(act(move))
            anchors.append(info["anchor"])
            if terminated:
                return anchors

    random.seed(7)
    before = random.getstate()
    make(game="KuhnPoker-v0").reset(seed=3)
    assert random.getstate() == before  # resetting (TextArena deals) did not touch the global RNG
    first = deals(41)
    assert deals(41) == first
    assert len({tuple(deals(s)) for s in range(6)}) > 1  # and the seed does decide the deals


# ---- self-play: both seats by the caller -----------------------------------------------------------------------

# Tic Tac Toe, seat 0 ('O') first, both seats scripted: O0 X1 O4 X2 O5 X3 O7 X6 gives O X X / X O O / X O . with no
# line yet and cell 8 the only one left; O on 8 completes the diagonal 0-4-8: seat 0 wins (+1), seat 1 loses (-1).
TO_LAST_CELL = ["0", "1", "4", "2", "5", "3", "7", "6"]


def self_play(game: str = "TicTacToe-v0", max_steps: int = 9):
    return make(game=game, opponent="self", max_steps=max_steps)


def test_self_play_alternates_the_seats_and_ends_with_both_outcomes() -> None:
    env = self_play()
    obs, info = env.reset(seed=4)
    assert "You are Player 0 in Tic Tac Toe" in env.seat_instructions[0]
    assert "You are Player 1 in Tic Tac Toe" in env.seat_instructions[1]
    movers = []
    for move in TO_LAST_CELL:
        movers.append(info["seat"])
        assert obs.startswith(f"You are player {info['seat']}.") and move in info["admissible_actions"]
        obs, reward, terminated, truncated, info = env.step(act(move))
        assert (reward, terminated, truncated, info["valid"]) == (0.0, False, False, True)
    assert movers == [0, 1] * 4 and info["seat"] == 0 and info["admissible_actions"] == ["8"]
    assert info["anchor"] == "seat 0: OXX/XOO/XO."
    assert "Opponent (player 1): [6]" in obs  # what seat 1 did since seat 0's last move
    obs, reward, terminated, truncated, info = env.step(act("8"))
    assert (reward, terminated, truncated, info["success"]) == (1.0, True, False, True)  # the mover's outcome
    assert info["seat_rewards"] == [1.0, -1.0] and info["seat_observations"][0] == obs
    assert obs.endswith("You won.") and info["seat_observations"][1].endswith("You lost.")
    assert (
        info["seat_observations"][1].startswith("You are player 1.")
        and "Opponent (player 0): [8]" in info["seat_observations"][1]
    )


def test_self_play_plays_a_random_legal_move_for_an_invalid_answer() -> None:
    env = self_play()
    env.reset(seed=4)
    obs, reward, terminated, truncated, info = env.step("no tags")  # seat 0's first answer
    assert (reward, terminated, truncated, info["valid"], info["seat"]) == (-0.2, False, False, False, 1)
    assert "no <action>" in info["parse_error"]
    board = info["anchor"].removeprefix("seat 1: ").replace("/", "")
    assert board.count("O") == 1 and board.count("X") == 0  # a move was made for seat 0; seat 1 is to move
    played = str(board.index("O"))
    obs, _, _, _, info = env.step(act(next(c for c in "012345678" if c != played)))  # seat 1
    assert obs.startswith(
        f"You are player 0.\nYour answer was invalid (no <action>...</action> tag found); a random "
        f"legal move was played for you: {played}."
    )
    # The random move that ends the game: seat 0's only cell wins, after the penalty: -0.2 + 1.
    env.reset(seed=4)
    for move in TO_LAST_CELL:
        env.step(act(move))
    obs, reward, terminated, truncated, info = env.step(act("9"))  # off the board
    assert (round(reward, 9), terminated, truncated, info["valid"]) == (0.8, True, False, False)
    assert info["seat_rewards"] == [1.0, -1.0] and "a random legal move was played for you: 8." in obs


@pytest.mark.parametrize("game", ["TicTacToe-v0", "KuhnPoker-v0"])
def test_self_play_games_always_end_zero_sum_whatever_is_answered(game: str) -> None:
    """A policy that answers a random legal move, or junk one time in three: every game ends by the game's rules
    within 9 steps (an invalid answer moves the game too), never truncated, with opposite outcomes (a draw: 0, 0)."""
    env, rng = self_play(game), random.Random(1)
    ends = set()
    for seed in range(40):
        obs, info = env.reset(seed=seed)
        steps = 0
        while True:
            answer = "junk" if rng.random() < 1 / 3 else act(rng.choice(info["admissible_actions"]))
            obs, reward, terminated, truncated, info = env.step(answer)
            steps += 1
            assert not truncated and steps <= 9
            if terminated:
                break
        r0, r1 = info["seat_rewards"]
        assert r0 == -r1 and r0 in (-1.0, 0.0, 1.0)
        ends.add(r0)
    assert {-1.0, 1.0} <= ends  # both seats win some


def test_self_play_deals_come_from_the_seed_and_kuhn_is_opened_by_player_1() -> None:
    """The G matches of a group start from one seed: the same deal, seen by each seat alone."""
    first = [self_play("KuhnPoker-v0").reset(seed=s) for s in (7, 7, 8)]
    assert first[0] == first[1] and first[0][1]["seat"] == 1 and first[0][0].startswith("You are player 1.")
    deals = {self_play("KuhnPoker-v0").reset(seed=s)[1]["anchor"] for s in range(12)}
    assert len(deals) > 1  # the seed decides the deal


def test_a_frozen_match_is_self_play_with_one_trained_seat_from_the_seed_or_seat() -> None:
    """opponent="frozen": the same match as self-play (the same turns, an invalid answer's random move in the seat's
    place), plus the trained seat: drawn from the seed as a one-seat game's seat is (a group's G matches train one
    seat, groups cover both), or `seat`; the env's instructions are that seat's rules."""
    trained = []
    for seed in range(8):
        env = make(opponent="frozen")
        env.reset(seed=seed)
        trained.append(env.trained_seat)
    assert trained == [make().reset(seed=s)[1]["seat"] for s in range(8)] and set(trained) == {0, 1}
    seed = trained.index(1)
    frozen, mirror = make(opponent="frozen"), self_play()
    assert frozen.reset(seed=seed) == mirror.reset(seed=seed) and frozen.trained_seat == 1
    assert mirror.trained_seat is None
    assert "You are Player 1 in Tic Tac Toe" in frozen.instructions  # seat 0 opens, but seat 1 is the trained one
    for answer in ["junk", *(act(m) for m in "012345678")]:  # seat 0's junk: a random move for it, as in self-play
        got, want = frozen.step(answer), mirror.step(answer)
        assert got == want
        if got[2]:
            break
    assert got[2] and got[4]["seat_rewards"][0] == -got[4]["seat_rewards"][1]
    fixed = make(opponent="frozen", seat=0)
    assert [(fixed.reset(seed=s), fixed.trained_seat)[1] for s in range(4)] == [0] * 4
    with pytest.raises(ValueError, match="both seats; leave seat out"):
        make(opponent="self", seat=1)  # (a fixed seat is for the frozen opponent only)


# ---- whole games through the actor ------------------------------------------------------------------------------


class ByteTokenizer:
    """Chat template: the messages' contents joined by '|'; token ids: that text's UTF-8 bytes."""

    eos_token_id = 0

    def apply_chat_template(self, conversation: list[dict[str, str]], **kwargs: Any) -> list[int]:
        return list("|".join(m["content"] for m in conversation).encode())


class BettingEngine:
    """Reads the prompt's newest "Your legal moves: ..." line and answers bet when it may, else its first move."""

    url = "http://e:1"

    async def sample(
        self, prompt_ids: list[int], sampling: Any, n: int, seed: int | None = None, images: Any = None
    ) -> list[Generation]:
        legal = re.findall(r"Your legal moves: (.*)\.", bytes(prompt_ids).decode())[-1].split(", ")
        text = act("bet" if "bet" in legal else legal[0])
        ids = np.frombuffer(text.encode(), dtype=np.uint8).astype(np.int32)
        return [Generation(ids, np.zeros(len(ids), np.float32), text, "stop", 3, 3)] * n


class Broker:
    def __init__(self) -> None:
        self.sent: list[Transition] = []

    async def send_transition(self, t: Transition) -> None:
        self.sent.append(t)


@pytest.mark.parametrize("seed", [0, 1])  # one seed per seat (seat drawn from the seed)
async def test_whole_games_through_the_actor(seed: int) -> None:
    cfg = Config()
    cfg.env.name, cfg.env.max_steps = ENV, 10
    cfg.env.kwargs = {"game": "KuhnPoker-v0", "opponent": "first"}
    cfg.memory.k, cfg.memory.max_prompt_tokens = 2, 100_000
    broker, engine = Broker(), BettingEngine()
    actor = Actor(ActorSpec.from_config(cfg), "actor-0", 0, broker, [engine], ByteTokenizer())  # type: ignore[arg-type]
    result = await actor.play(GroupGrant(group_id=1, seed=seed, min_version=0), "t", engine)  # type: ignore[arg-type]
    sent = broker.sent
    # As worked out above: three bets, three folds, +1 at the third step; nothing invalid.
    assert [t.step for t in sent] == [0, 1, 2] and all(t.valid for t in sent)
    assert [t.reward for t in sent] == [0.0, 0.0, 1.0] and [t.done for t in sent] == [False, False, True]
    assert sent[-1].info["success"] and (result.steps, result.total_reward, result.success) == (3, 1.0, True)
    assert all(t.anchor.startswith("seat ") for t in sent)
