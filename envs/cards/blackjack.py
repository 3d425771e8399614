"""Blackjack (gym-cards/gymnasium Blackjack-v1) as a text game: hit or stand against the dealer.

gymnasium's rules: an infinite deck; face cards count 10, an ace 11 unless that busts; the dealer draws
to 17. Rewards: +1 win, -1 loss, 0 draw (+1.5 for a natural with `natural=True`). `success` is a win.
The deal comes from the env's own RNG, seeded by `reset(seed=...)`. Answer `<action>hit</action>` or
`<action>stand</action>` (`stick` works too).

    env = envs.make("agentstream/Blackjack-v0", max_steps=10)
"""

from __future__ import annotations

from typing import Any

from gymnasium.envs.toy_text.blackjack import BlackjackEnv, sum_hand, usable_ace

from envs.base import Action, ParseFailure, ParseResult, StepResult, TextGame, parse_tagged, text_space

ACTIONS = ("stand", "hit")  # gymnasium's indices: 0 stick, 1 hit
_CHOICES = {"stand": 0, "stick": 0, "hit": 1}

INSTRUCTIONS = (
    "You play blackjack against the dealer. Get as close to 21 as you can without going over. Number "
    "cards count their value, J, Q and K count 10, an ace counts 11 unless that takes you over 21, then 1. "
    "'hit' takes another card; 'stand' ends your turn, then the dealer draws until 17 or more. Over 21 "
    "loses at once. A win earns 1, a loss costs 1, a draw is 0. The deck is infinite. "
    "Answer with <action>hit</action> or <action>stand</action>."
)


def parse_action(text: str) -> ParseResult:
    """The first `<action>hit|stand|stick</action>` in `text` -> Action(1 hit, 0 stand). Never raises."""
    return parse_tagged(text, _CHOICES, what="action")


def _cards(hand: list[int]) -> str:
    return ", ".join("A" if c == 1 else str(c) for c in hand)


def _total(hand: list[int]) -> str:
    soft = " (an ace counts 11)" if usable_ace(hand) else ""
    return f"{sum_hand(hand)}{soft}"


class BlackjackText(TextGame):
    """Blackjack with text observations and text actions (see the module docstring)."""

    metadata = {"render_modes": []}
    instructions = INSTRUCTIONS

    def __init__(self, max_steps: int = 10, natural: bool = False, sab: bool = False):
        self.max_steps = max_steps
        self.observation_space = text_space()
        self.action_space = text_space()
        self._game = BlackjackEnv(natural=natural, sab=sab)
        self._dealt = False
        self._result: float | None = None
        self._steps = 0

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[str, dict[str, Any]]:
        super().reset(seed=seed)
        self._game.reset(seed=int(self.np_random.integers(2**31)))
        self._dealt, self._result, self._steps = True, None, 0
        obs = self._observation()
        return obs, self._info(True, obs)

    def _started(self) -> bool:
        return self._dealt

    def _parse(self, action: str) -> ParseResult:
        """Also invalid, on purpose: any move once the hand is decided (the game has nothing left to play)."""
        parsed = parse_action(action)
        if isinstance(parsed, Action) and self._result is not None:
            return ParseFailure("the game is over")
        return parsed

    def _invalid(self) -> tuple[str, dict[str, Any]]:
        obs = self._observation()
        return obs, self._info(False, obs)

    def _step(self, value: int) -> StepResult:
        _, reward, terminated, _, _ = self._game.step(value)
        if terminated:
            self._result = float(reward)
        obs = self._observation()
        return obs, float(reward), bool(terminated), False, self._info(True, obs)

    def _observation(self) -> str:
        player, dealer = self._game.player, self._game.dealer
        lines = [f"Your cards: {_cards(player)} (total {_total(player)})"]
        if self._result is None:
            lines.append(f"Dealer shows: {_cards(dealer[:1])}")
        else:
            outcome = "You win." if self._result > 0 else "You lose." if self._result < 0 else "Draw."
            lines += [f"Dealer's cards: {_cards(dealer)} (total {_total(dealer)})", outcome]
        return "\n".join(lines)

    def _info(self, valid: bool, anchor: str) -> dict[str, Any]:
        return {
            "valid": valid,
            "success": bool(self._result is not None and self._result > 0),
            "anchor": anchor,
            "admissible_actions": ["hit", "stand"] if self._result is None else [],
        }

    def close(self) -> None:
        pass
