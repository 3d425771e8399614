"""TextArena's two-player games, one seat played by the policy and the other by a fixed opponent, or both seats by
the policy (self-play), or one by the policy and the other by a frozen copy of an earlier version of it.

    env = envs.make("agentstream/TextArena-v0", game="TicTacToe-v0", max_steps=9)          # seat from the seed
    env = envs.make("agentstream/TextArena-v0", game="KuhnPoker-v0", seat=1, opponent="random")
    env = envs.make("agentstream/TextArena-v0", game="KuhnPoker-v0", opponent="self")      # both seats: a match
    env = envs.make("agentstream/TextArena-v0", game="KuhnPoker-v0", opponent="frozen")    # a match, one seat trained
    obs, info = env.reset(seed=3)
    obs, reward, terminated, truncated, info = env.step("<action>4</action>")

In a run: `env.name=agentstream/TextArena-v0 +env.kwargs.game=KuhnPoker-v0` (`+env.kwargs.opponent=self`: self-play;
`+env.kwargs.opponent=frozen`: against a frozen copy, with `model.lora_rank > 0`).

The game is the `textarena` package's own (`textarena.make(game + "-raw")`: its rules, its texts, its zero-sum
outcome). One episode is one seat's side of one game: after each of the policy's moves, the opponent seat moves
(before the policy's first turn too, when it opens the game) until it is the policy's turn again or the game is
over. The reward comes at the end: the seat's reward from the game (TextArena's win 1, loss -1, draw 0), 0 before.
Which seat the policy plays is `seat` (0 or 1) or, with `seat=None`, drawn from the reset seed, so the G
episodes of a group (one seed) play the same seat against the same deal and both seats are trained.

Opponents (`opponent`): "random" (a uniformly random legal move, from the env's own RNG): the fixed opponent
that validation measures a win rate against; "first" (the first legal move in the game's order): a fixed,
exploitable opponent, deterministic, for scripted tests; "self": no opponent, the caller plays both seats; "frozen":
the same match, in which the caller trains one seat only (`trained_seat`: `seat`, or drawn from the reset seed) and
answers the other's turns with a frozen copy of an earlier policy (actors/actor.py).

Self-play (`opponent="self"`): every observation is the turn of the seat to move (`info["seat"]`), what that seat
saw since its own last move; a step's reward is the mover's; at the end `info["seat_rewards"]` and
`info["seat_observations"]` give both seats' outcomes and last observations, and `seat_instructions` each seat's
rules. `actors.episode.play_match` plays it: each seat's turns a trajectory of its own (docs/environments.md).
An invalid answer costs `invalid_reward` and a random legal move is played in the seat's place (its next
observation says so): a seat that stalled would leave the other seat, the policy too, waiting for a turn that might
never come, and a trajectory without a step cannot end. So every step is a move: `max_steps` counts both seats' turns,
and a game of Tic Tac Toe or Kuhn Poker (3 rounds) ends within 9. With `opponent="frozen"` all of this holds alike;
only `trained_seat` (and `instructions`, that seat's rules) differ.

The answer is `<action>MOVE</action>` with MOVE one of the legal moves the observation lists (`4`, `bet`; TextArena's
bracketed form `[4]` is accepted as well). Anything else, an illegal move included, is an invalid answer: the game
does not move and the step costs `invalid_reward` (-0.2: with `max_steps` at 5 or more, answering invalidly until
the step limit costs at least a loss). So TextArena's own invalid-move rule (a second invalid move in a row loses
the game) never fires; a move TextArena rejects although the adapter listed it as legal is a bug of the adapter and
raises, as does any exception of the game itself: the actor counts it as an infrastructure failure
(`infra_failures_raised`) and plays the seed again, never training on it.

TextArena draws its randomness (Kuhn Poker's deals) from the global `random` module and seeds it on reset; many
episodes share an actor's process, so every call into the game runs with the global state swapped for this env's
own (`_own_random`) and the global state restored after: episodes neither disturb one another nor the process.
A game is supported when an adapter (`ADAPTERS`) knows its legal moves and what the seat knows of its state.
"""

from __future__ import annotations

import contextlib
import json
import random
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from envs.base import TEXT_CHARSET, Action, EnvTraits, ParseFailure, ParseResult, StepResult, TextGame, text_space

SELF, FROZEN = "self", "frozen"
MATCHES = (SELF, FROZEN)
"""Opponents with which the caller plays every seat: the episode is a match (`actors.episode.play_match`)."""
OPPONENTS = ("random", "first", *MATCHES)
_ALLOWED = frozenset(TEXT_CHARSET)
_TAG = re.compile(r"<action>(.*?)</action>", re.DOTALL | re.IGNORECASE)

HEADER = (
    "You play a two-player game against an opponent. Each turn you see what happened since your last move "
    "and your legal moves. Answer with one legal move between tags, e.g. <action>{example}</action>."
)


@dataclass(frozen=True)
class Adapter:
    """What this env needs of a TextArena game beyond its own API (pure functions of its `game_state`)."""

    legal: Callable[[dict[str, Any], int], list[str]]
    """The seat-to-move's legal moves (lower case, without brackets), in the game's order."""
    view: Callable[[dict[str, Any], int], str]
    """What `seat` knows of the state (no hidden information of the other seat): GiGPO's anchor."""
    example: str
    """A move to show in the instructions."""


def _tictactoe_legal(state: dict[str, Any], seat: int) -> list[str]:
    return [str(r * 3 + c) for r in range(3) for c in range(3) if state["board"][r][c] == ""]


def _tictactoe_view(state: dict[str, Any], seat: int) -> str:
    return "/".join("".join(cell or "." for cell in row) for row in state["board"])


def _kuhn_legal(state: dict[str, Any], seat: int) -> list[str]:
    tree = state["current_legal_action_tree"]
    return list(tree) if isinstance(tree, dict) else []


def _kuhn_view(state: dict[str, Any], seat: int) -> str:
    tree = state["current_legal_action_tree"]
    return json.dumps(
        {
            "round": state["current_round"],
            "card": state["player_cards"][seat],
            "chips": [state["player_chips"][0], state["player_chips"][1]],
            "pot": state["pot"],
            "to_act": tree if isinstance(tree, str) else sorted(tree),
        },
        sort_keys=True,
    )


def _adapters() -> list[tuple[type, Adapter]]:
    """(TextArena game class, adapter): a subclass of a supported game is supported too."""
    from textarena.envs.KuhnPoker.env import KuhnPokerEnv
    from textarena.envs.TicTacToe.env import TicTacToeEnv

    return [
        (TicTacToeEnv, Adapter(_tictactoe_legal, _tictactoe_view, "4")),
        (KuhnPokerEnv, Adapter(_kuhn_legal, _kuhn_view, "bet")),
    ]


SUPPORTED = ("TicTacToe-v0", "KuhnPoker-v0", "KuhnPoker-v0-short", "KuhnPoker-v0-medium", "KuhnPoker-v0-long")
"""Registered TextArena ids this env has adapters for (any subclass of their game classes works too)."""
MOVES = (*(str(cell) for cell in range(9)), "check", "bet", "call", "fold")
"""Every move of the supported games: Tic Tac Toe's cells, Kuhn Poker's actions."""


def traits(kwargs: Mapping[str, Any]) -> EnvTraits:
    """What the env declares with `kwargs` (`envs.registry.traits`): a match (opponent self or frozen) has two
    seats, a frozen one trains one of them; validation plays one seat against the random opponent."""
    opponent = kwargs.get("opponent")
    return EnvTraits(
        seats=2 if opponent in MATCHES else 1,
        frozen_seat=opponent == FROZEN,
        one_seat_kwargs=(("opponent", "random"),) if opponent in MATCHES else (),
        parser="envs.arena:parse_move",
        moves=MOVES,
    )


def parse_move(text: object, legal: Sequence[str]) -> ParseResult:
    """The first `<action>MOVE</action>` in `text` -> `Action(MOVE)` when MOVE (stripped, lower-cased, without
    TextArena's brackets) is one of `legal`. Never raises."""
    if not isinstance(text, str):
        return ParseFailure(f"expected text, got {type(text).__name__}")
    match = _TAG.search(text)
    if match is None:
        return ParseFailure("no <action>...</action> tag found")
    move = match.group(1).strip().strip("[]'\"").strip().lower()
    if move not in legal:
        shown = move if len(move) <= 40 else move[:40] + "..."
        return ParseFailure(f"{shown!r} is not a legal move now; legal moves: {', '.join(legal)}")
    return Action(move)


def clean(text: str) -> str:
    """`text` with every character outside the observation charset replaced by '?'."""
    return "".join(ch if ch in _ALLOWED else "?" for ch in text)


class TextArenaEnv(TextGame):
    """One seat of a TextArena two-player game against a fixed opponent, or both seats (see the module docstring)."""

    metadata = {"render_modes": []}
    invalid_reward = -0.2

    def __init__(
        self,
        game: str = "TicTacToe-v0",
        seat: int | None = None,
        opponent: str = "random",
        max_steps: int = 9,
        invalid_reward: float = -0.2,
        game_kwargs: dict[str, Any] | None = None,
    ):
        import textarena

        if seat not in (None, 0, 1):
            raise ValueError(f"seat={seat!r}: use 0, 1, or None (drawn from the reset seed)")
        if opponent not in OPPONENTS:
            raise ValueError(f"opponent={opponent!r}: use one of {', '.join(OPPONENTS)}")
        if opponent == SELF and seat is not None:
            raise ValueError(f"seat={seat!r} with opponent={SELF!r}: the policy plays both seats; leave seat out")
        self.game, self.seat_option, self.opponent = game, seat, opponent
        self.max_steps, self.invalid_reward = max_steps, invalid_reward
        self.game_kwargs = dict(game_kwargs or {})
        try:
            probe = textarena.make(f"{game}-raw", **self.game_kwargs)
        except ValueError as exc:  # TextArena's "not found in registry"
            raise ValueError(
                f"game={game!r} is not a TextArena game id; supported here: {', '.join(SUPPORTED)}"
            ) from exc
        self.adapter = next((a for cls, a in _adapters() if isinstance(probe, cls)), None)
        if self.adapter is None:
            raise ValueError(
                f"game={game!r} has no adapter in envs/arena.py (its legal moves are unknown); "
                f"supported: {', '.join(SUPPORTED)}"
            )
        self._make = lambda: textarena.make(f"{game}-raw", **self.game_kwargs)
        self.instructions = HEADER.format(example=self.adapter.example)
        self.seat_instructions = (self.instructions, self.instructions)
        """Each seat's instructions (the game's rules for that seat), set by reset: self-play's memories take them."""
        self.observation_space = text_space()
        self.action_space = text_space()
        self._ta: Any = None
        self._rng_state: Any = None
        self.seat = 0  # the policy's seat; in a match the seat to move
        self.match = opponent in MATCHES
        self.trained_seat: int | None = None
        """opponent="frozen": the seat the trained policy plays (set by reset); the other is the frozen copy's."""
        self._notes = ["", ""]  # self-play: what each seat is told first at its next turn (a move made in its place)
        self._obs = ""
        self._steps = 0

    @contextlib.contextmanager
    def _own_random(self) -> Iterator[None]:
        """Run TextArena code with the global `random` state swapped for this env's own (module docstring)."""
        saved = random.getstate()
        random.setstate(self._rng_state)
        try:
            yield
        finally:
            self._rng_state = random.getstate()
            random.setstate(saved)

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[str, dict[str, Any]]:
        super().reset(seed=seed)
        self.seat = int(self.np_random.integers(2)) if self.seat_option is None else self.seat_option
        self.trained_seat = self.seat if self.opponent == FROZEN else None
        self._rng_state = random.Random(int(self.np_random.integers(2**63))).getstate()
        self._steps, self._notes = 0, ["", ""]
        with self._own_random():
            self._ta = self._make()  # a fresh game: Kuhn Poker shuffles its deck in place, round after round
            self._ta.reset(num_players=2, seed=None)  # (a seed here would seed the global RNG)
        header = HEADER.format(example=self.adapter.example)
        self.seat_instructions = tuple(f"{header}\n\n{self._messages(s, keep_prompt=True)}".strip() for s in (0, 1))
        if self.match:
            self.seat = self._state().current_player_id
        self.instructions = self.seat_instructions[self.seat if self.trained_seat is None else self.trained_seat]
        self._opponent_moves()  # (a game cannot end before the policy's first move)
        return self._turn()

    def step(self, action: str) -> StepResult:
        """`TextGame.step`; in self-play an invalid answer moves the game too (`_move_in_place`)."""
        obs, reward, terminated, truncated, info = super().step(action)
        if not self.match or info["valid"]:
            return obs, reward, terminated, truncated, info
        obs, reward, terminated, _, info = self._move_in_place(reward, info["parse_error"])
        return obs, reward, terminated, truncated and not terminated, info  # (truncated: that was the last step)

    def _started(self) -> bool:
        return self._ta is not None

    def _parse(self, action: str) -> ParseResult:
        return parse_move(action, self._legal())

    def _invalid(self) -> tuple[str, dict[str, Any]]:
        return self._obs, self._info(valid=False, success=False)

    def _step(self, value: str) -> StepResult:
        if self._play(value) or self._opponent_moves():
            return self._end()
        obs, info = self._turn()
        return obs, 0.0, False, False, info

    def _move_in_place(self, penalty: float, reason: str) -> StepResult:
        """Self-play, after an invalid answer (`penalty`): a random legal move in the seat's place (module docstring);
        the step stays invalid, and its reward is the penalty plus the game's outcome if that move ended it."""
        legal = self._legal()
        move = legal[int(self.np_random.integers(len(legal)))]
        self._notes[self.seat] = f"Your answer was invalid ({reason}); a random legal move was played for you: {move}."
        obs, reward, terminated, truncated, info = self._step(move)
        info.update(valid=False, parse_error=reason)
        return obs, penalty + reward, terminated, truncated, info

    # -- the game ------------------------------------------------------------------------------------------

    def _state(self) -> Any:
        return self._ta.state

    def _legal(self) -> list[str]:
        return self.adapter.legal(self._state().game_state, self._state().current_player_id)

    def _play(self, move: str) -> bool:
        """The seat to move plays `move` (legal by the adapter); whether the game is over."""
        mover = self._state().current_player_id
        with self._own_random():
            done, _ = self._ta.step(f"[{move}]")
        if self._state().error_count:
            raise RuntimeError(
                f"{self.game}: TextArena rejected [{move}] of player {mover}, which the adapter listed "
                f"as legal: fix the adapter in envs/arena.py"
            )
        return bool(done)

    def _opponent_moves(self) -> bool:
        """The opponent moves until it is the policy's turn or the game is over; whether it is over. Self-play: the
        seat to move is the policy's."""
        state = self._state()
        if self.match:
            if not state.done:
                self.seat = state.current_player_id
            return bool(state.done)
        while not state.done and state.current_player_id != self.seat:
            legal = self._legal()
            move = legal[0] if self.opponent == "first" else legal[int(self.np_random.integers(len(legal)))]
            if self._play(move):
                return True
        return bool(state.done)

    def _messages(self, seat: int, keep_prompt: bool = False) -> str:
        """The messages `seat` got since it last looked, as text (TextArena's own wording); taken from the game.
        `keep_prompt`: only the game's rules prompt (reset), the rest stays for the first turn."""
        from textarena import GAME_ID, ObservationType

        queue = self._state().observations[seat]
        taken = [m for m in queue if (m[2] == ObservationType.PROMPT) == keep_prompt]
        queue[:] = [m for m in queue if m not in taken]
        boards = [i for i, m in enumerate(taken) if m[2] == ObservationType.GAME_BOARD]
        lines: list[str] = []
        for i, (sender, text, kind) in enumerate(taken):
            if kind == ObservationType.GAME_BOARD and i != boards[-1]:
                continue  # only the newest board: the older ones are the same board a move or two before
            if lines and lines[-1] == text.strip():
                continue  # (Kuhn Poker announces a round twice to the seat that does not open it)
            if sender == GAME_ID:
                lines.append(text.strip())
            elif sender != seat:  # the seat's own answers are in the memory already
                lines.append(f"Opponent (player {sender}): {text.strip()}")
        return clean("\n".join(lines))

    def _turn(self) -> tuple[str, dict[str, Any]]:
        """The policy's turn: what it saw since its last move, and its legal moves."""
        seen = self._seen(self.seat)
        self._obs = clean(f"You are player {self.seat}.\n{seen}\nYour legal moves: {', '.join(self._legal())}.")
        return self._obs, self._info(valid=True, success=False)

    def _seen(self, seat: int) -> str:
        """What `seat` learns at its turn: a move made in its place (self-play), then the game's messages."""
        note, self._notes[seat] = self._notes[seat], ""
        return f"{note}\n{self._messages(seat)}" if note else self._messages(seat)

    def _end(self) -> StepResult:
        """The game is over: the mover's outcome; both seats' (self-play reads the other's) in `info`."""
        state = self._state()
        rewards = [float((state.rewards or {}).get(s, 0.0)) for s in (0, 1)]
        finals = []
        for s in (0, 1):  # (the fixed opponent's is read by nobody)
            outcome = "You won." if rewards[s] > 0 else "You lost." if rewards[s] < 0 else "Draw."
            reason = state.game_info[s].get("reason", "")
            finals.append(clean(f"You are player {s}.\n{self._seen(s)}\nGame over: {reason} {outcome}"))
        reward, self._obs = rewards[self.seat], finals[self.seat]
        info = self._info(valid=True, success=reward > 0)
        info.update(admissible_actions=[], game_reward=reward, seat_rewards=rewards, seat_observations=finals)
        return self._obs, reward, True, False, info

    def _info(self, valid: bool, success: bool) -> dict[str, Any]:
        state = self._state()
        view = self.adapter.view(state.game_state, self.seat)
        legal = self._legal() if not state.done and state.current_player_id == self.seat else []
        return {
            "valid": valid,
            "success": success,
            "anchor": f"seat {self.seat}: {view}",
            "admissible_actions": legal,
            "seat": self.seat,
        }

    def close(self) -> None:
        self._ta = None
