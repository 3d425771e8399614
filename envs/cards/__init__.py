"""gym-cards' four games (verl-agent's versions) as text envs: EZPoints, Points24, NumberLine, Blackjack.

gym-cards has no PyPI release and renders pictures; these are text versions with gym-cards' rules and
rewards (deviations are listed in each module), each drawing its randomness from its own `np_random`.
EZPoints and Points24 also draw the dealt cards (`observation="image"`, `envs.cards.deck`).
"""

from envs.cards.arithmetic import EZPointsText, Points24Text
from envs.cards.blackjack import BlackjackText
from envs.cards.numberline import NumberLineText

__all__ = ["BlackjackText", "EZPointsText", "NumberLineText", "Points24Text"]
