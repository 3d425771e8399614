"""EZPoints and Points24 (gym-cards, as verl-agent uses them) as text games: build a formula from cards.

The model appends one token per step (a card's number, an operator, a bracket, or `=`) to the formula;
`=` evaluates it and ends the episode. Rules and rewards follow gym-cards:
- +10 when the formula equals the target and uses every card exactly once (`success`), else -1 at `=`;
- a number that is not on an unused card costs -1 and puts a blank into the formula (it can no longer
  evaluate: gym-cards' rule, which makes such a slip unrecoverable);
- once the formula is longer than `max_formula_len` tokens the next step truncates the episode with -1.
Deviations, on purpose: evaluation is exact (fractions) and two adjacent numbers are a syntax error
(gym-cards `eval`s the joined string, so "1" then "2" would read as 12); Points24 deals only solvable
hands by default (`solvable_only=True`; gym-cards deals any four cards, ~20% of which cannot make 24).

EZPoints: two cards that can make 12 with + and *, tokens 1-10 + * =. Points24: four cards, target 24,
tokens 1-10 (1-13 with `face_cards_as_10=False`) + - * / ( ) =. Face cards count 10, an ace 1.

`observation="image"` also puts the dealt cards' picture in `info["image"]` (uint8 [72, 4 + 52 * cards, 3],
`envs.cards.deck.render_hand`: the same for the whole episode, as in gym-cards); the formula so far stays in
the text observation.

    env = envs.make("agentstream/Points24-v0", max_steps=20)
    obs, info = env.reset(seed=0)
    obs, reward, terminated, truncated, info = env.step("<action>8</action>")
"""

from __future__ import annotations

from typing import Any

import numpy as np

from envs.base import ParseResult, StepResult, TextGame, check_observation, parse_tagged, text_space
from envs.cards.deck import SUITS, Card, card_name, render_hand
from envs.cards.formula import Token, can_make, evaluate

BLANK = " "  # what an unavailable number leaves in the formula (gym-cards)


def token_choices(max_number: int, operators: tuple[str, ...]) -> dict[str, Token]:
    """Answer text -> token: the numbers 1..max_number, the operators and '='."""
    return {**{str(n): n for n in range(1, max_number + 1)}, **{op: op for op in operators}, "=": "="}


def parse_token(text: str, choices: dict[str, Token]) -> ParseResult:
    """The first `<action>TOKEN</action>` in `text` -> Action(int | operator | '='). Never raises."""
    return parse_tagged(text, choices, what="token")


def instructions(target: int, n_cards: int, operators: tuple[str, ...], max_number: int) -> str:
    ops = " ".join(operators)
    return (
        f"You build a formula that equals {target} from the numbers on {n_cards} playing cards, one token "
        f"at a time. Number cards count their value, jack, queen and king count "
        f"{'10' if max_number == 10 else '11, 12 and 13'}, an ace counts 1. Use every card's number exactly "
        f"once. Each step, append one token to the end of the formula: a card's number, an operator "
        f"({ops}) or '='. '=' evaluates the formula and ends the game: +10 if it equals {target} and uses "
        f"every card, -1 otherwise. Appending a number that is not on an unused card costs 1 point and "
        f"spoils the formula. Answer with one token, for example <action>{min(target // 2, max_number)}</action> "
        f"or <action>{operators[0]}</action> or <action>=</action>."
    )


class CardFormulaEnv(TextGame):
    """The shared game: cards, a formula of tokens, gym-cards' rewards (subclasses deal the cards)."""

    metadata = {"render_modes": []}
    target: int
    n_cards: int
    operators: tuple[str, ...]

    def __init__(self, max_steps: int, max_formula_len: int, max_number: int, observation: str):
        self.max_steps, self.max_formula_len, self.max_number = max_steps, max_formula_len, max_number
        self.observation = check_observation(observation)
        self.choices = token_choices(max_number, self.operators)
        self.instructions = instructions(self.target, self.n_cards, self.operators, max_number)
        self.observation_space = text_space()
        self.action_space = text_space()
        self.cards: list[Card] = []
        self.numbers: list[int] = []
        self.formula: list[Token] = []
        self.used: list[int] = []
        self._steps = 0
        self._done = False

    def deal(self, rng: np.random.Generator) -> list[Card]:
        raise NotImplementedError

    def value(self, card: Card) -> int:
        return min(card[0], 10) if self.max_number == 10 else card[0]

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[str, dict[str, Any]]:
        super().reset(seed=seed)
        self.cards = self.deal(self.np_random)
        self.numbers = [self.value(c) for c in self.cards]
        self.formula, self.used, self._steps, self._done = [], [], 0, False
        obs = self._observation()
        return obs, self._info(True, False, obs)

    def _started(self) -> bool:
        return bool(self.cards)

    def _parse(self, action: str) -> ParseResult:
        return parse_token(action, self.choices)

    def _invalid(self) -> tuple[str, dict[str, Any]]:
        obs = self._observation()
        return obs, self._info(False, False, obs)

    def _step(self, value: Token) -> StepResult:
        reward, terminated, truncated, success = self._apply(value)  # truncated: the formula grew too long
        obs = self._observation()
        return obs, reward, terminated, truncated, self._info(True, success, obs)

    def _apply(self, token: Token) -> tuple[float, bool, bool, bool]:
        """gym-cards' transition: (reward, terminated, truncated, success)."""
        if len(self.formula) > self.max_formula_len:
            return -1.0, False, True, False
        if isinstance(token, int):
            if token not in self.available():
                self.formula.append(BLANK)
                return -1.0, False, False, False
            self.used.append(token)
        if token == "=":
            value = evaluate(self.formula)
            success = value is not None and value == self.target and len(self.used) == self.n_cards
            return (10.0 if success else -1.0), True, False, success
        self.formula.append(token)
        return 0.0, False, False, False

    def available(self) -> list[int]:
        """The card numbers not used yet (with repeats), in card order."""
        left = list(self.used)
        out = []
        for n in self.numbers:
            if n in left:
                left.remove(n)
            else:
                out.append(n)
        return out

    def formula_text(self) -> str:
        return "".join(str(t) for t in self.formula)

    def _observation(self) -> str:
        return (
            f"Cards: {', '.join(card_name(c) for c in self.cards)}\n"
            f"Card numbers: {', '.join(map(str, self.numbers))}\n"
            f"Target: {self.target}\n"
            f"Current formula: '{self.formula_text()}'"
        )

    def _info(self, valid: bool, success: bool, anchor: str) -> dict[str, Any]:
        admissible = [str(n) for n in dict.fromkeys(self.available())] + list(self.operators) + ["="]
        info = {
            "valid": valid,
            "success": success,
            "anchor": anchor,
            "admissible_actions": admissible,
            "numbers": list(self.numbers),
            "formula": self.formula_text(),
        }
        if self.observation == "image":
            info["image"] = render_hand(self.cards)
        return info

    def close(self) -> None:
        pass


class EZPointsText(CardFormulaEnv):
    """Two cards that make 12 with + or *; gym-cards' EZPoints dealing (see the module docstring)."""

    target, n_cards, operators = 12, 2, ("+", "*")

    def __init__(self, max_steps: int = 10, max_formula_len: int = 5, observation: str = "text"):
        super().__init__(max_steps, max_formula_len, max_number=10, observation=observation)

    def deal(self, rng: np.random.Generator) -> list[Card]:
        first = int(rng.integers(2, 14))  # 2..K
        value = min(first, 10)
        # gym-cards: half the time the pair multiplies to 12 when it can, otherwise it adds up to 12
        second = 12 // value if value in (2, 3, 4, 6) and rng.random() <= 0.5 else 12 - value
        cards = [(first, SUITS[rng.integers(4)]), (second, SUITS[rng.integers(4)])]
        return cards[::-1] if rng.random() <= 0.5 else cards


class Points24Text(CardFormulaEnv):
    """Four cards, target 24, + - * / and brackets; gym-cards' Points24 (see the module docstring)."""

    target, n_cards, operators = 24, 4, ("+", "-", "*", "/", "(", ")")

    def __init__(
        self,
        max_steps: int = 30,
        max_formula_len: int = 20,
        face_cards_as_10: bool = True,
        solvable_only: bool = True,
        observation: str = "text",
    ):
        self.solvable_only = solvable_only
        super().__init__(max_steps, max_formula_len, max_number=10 if face_cards_as_10 else 13, observation=observation)

    def deal(self, rng: np.random.Generator) -> list[Card]:
        for _ in range(1000):
            cards = [(int(rng.integers(1, 14)), SUITS[rng.integers(4)]) for _ in range(self.n_cards)]
            if not self.solvable_only or can_make([self.value(c) for c in cards], self.target):
                return cards
        raise RuntimeError("no solvable hand in 1000 deals")
