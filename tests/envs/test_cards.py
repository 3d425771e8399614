"""gym-cards games as text: exact formula evaluation, enumeration solves every dealt hand, gym-cards'
rewards for slips, a walk-to-target agent solves NumberLine, and Blackjack plays by gymnasium's rules."""

import itertools
from fractions import Fraction

import pytest

import envs
from envs.cards.formula import can_make, evaluate


def test_evaluate_by_hand() -> None:
    assert evaluate([2, "+", 3, "*", 4]) == 14  # precedence: 2 + 12
    assert evaluate(["(", 2, "+", 3, ")", "*", 4]) == 20
    assert evaluate([8, "/", "(", 3, "-", 8, "/", 3, ")"]) == 24  # 8 / (1/3), exact
    assert evaluate([1, "/", 3]) == Fraction(1, 3)
    for bad in ([], [1, 2], [1, "+"], ["(", 1], [1, ")"], [1, "/", 0], ["+", 1], [1, " ", 2]):
        assert evaluate(bad) is None, bad


def test_can_make_by_hand() -> None:
    assert can_make([3, 3, 8, 8], 24)  # 8 / (3 - 8/3)
    assert not can_make([1, 1, 1, 1], 24)  # at most (1+1)*(1+1) = 4
    assert can_make([2, 10], 12, ("+", "*")) and not can_make([5, 5], 12, ("+", "*"))


def enumerate_formula(numbers: list[int], target: int, operators: str) -> list[str] | None:
    """A token list that makes `target`, by brute force over orders, operators and bracket shapes,
    checked with Python's own arithmetic (independent of the env's evaluator)."""
    shapes = (
        ["{0}{o0}{1}"]
        if len(numbers) == 2
        else [
            "(({0}{o0}{1}){o1}{2}){o2}{3}",
            "({0}{o0}({1}{o1}{2})){o2}{3}",
            "({0}{o0}{1}){o1}({2}{o2}{3})",
            "{0}{o0}(({1}{o1}{2}){o2}{3})",
            "{0}{o0}({1}{o1}({2}{o2}{3}))",
        ]
    )
    for order in itertools.permutations(numbers):
        for ops in itertools.product(operators, repeat=len(numbers) - 1):
            for shape in shapes:
                tokens = tokens_of(shape.format(*order, **{f"o{i}": op for i, op in enumerate(ops)}))
                exact = "".join(f"Fraction({t})" if t.isdigit() else t for t in tokens)
                try:
                    if eval(exact) == target:  # noqa: S307 - test-only, text we generated
                        return tokens
                except ZeroDivisionError:
                    pass
    return None


def tokens_of(text: str) -> list[str]:
    for ch in "()+-*/":
        text = text.replace(ch, f" {ch} ")
    return text.split()


@pytest.mark.parametrize(
    "name,target,ops", [("agentstream/EZPoints-v0", 12, "+*"), ("agentstream/Points24-v0", 24, "+-*/")]
)
def test_enumeration_solves_every_dealt_hand(name, target, ops) -> None:
    env = envs.make(name, max_steps=40)
    for seed in range(8):
        obs, info = env.reset(seed=seed)
        plan = enumerate_formula(info["numbers"], target, ops)
        assert plan is not None, f"seed {seed}: no formula for {info['numbers']}"
        for token in plan:
            obs, reward, term, trunc, info = env.step(f"<action>{token}</action>")
            assert (reward, term, trunc, info["valid"]) == (0.0, False, False, True), (token, obs)
        obs, reward, term, trunc, info = env.step("<action>=</action>")
        assert (reward, term, info["success"]) == (10.0, True, True), obs


def test_ezpoints_slips_cost_as_in_gym_cards() -> None:
    env = envs.make("agentstream/EZPoints-v0")
    _, info = env.reset(seed=0)
    assert info["numbers"] == [2, 10]  # seed 0 deals 2 of diamonds and a queen (counts 10)
    _, r, term, _, info = env.step("<action>7</action>")  # not on a card: -1, a blank spoils the formula
    assert (r, term, info["formula"]) == (-1.0, False, " ")
    env.reset(seed=0)
    env.step("<action>2</action>")
    _, r, _, _, info = env.step("<action>2</action>")  # the 2 is used up
    assert r == -1.0 and "2" not in info["admissible_actions"]
    env.reset(seed=0)
    for t in ("2", "+", "10"):
        env.step(f"<action>{t}</action>")
    _, r, term, _, info = env.step("<action>*</action>")
    _, r, term, _, info = env.step("<action>=</action>")  # "2+10*" does not evaluate
    assert (r, term, info["success"]) == (-1.0, True, False)
    env.reset(seed=0)
    _, r, _, _, info = env.step("<action>twelve</action>")  # unparseable: no move, reward 0
    assert (r, info["valid"], info["formula"]) == (0.0, False, "")


def test_formula_length_limit_truncates() -> None:
    env = envs.make("agentstream/EZPoints-v0", max_steps=50)
    env.reset(seed=0)
    for _ in range(6):  # six tokens: longer than max_formula_len=5
        env.step("<action>+</action>")
    _, r, term, trunc, _ = env.step("<action>+</action>")
    assert (r, term, trunc) == (-1.0, False, True)


def test_numberline_walk_to_target() -> None:
    env = envs.make("agentstream/NumberLine-v0", max_position=5, max_steps=10)
    for seed in range(10):
        obs, info = env.reset(seed=seed)
        target, current = (int(line.split(": ")[1]) for line in obs.splitlines())
        assert target != current and 0 <= min(target, current) and max(target, current) <= 5
        for i in range(abs(target - current)):
            toward = "<action>+</action>" if target > current else "<action>-</action>"
            obs, reward, term, trunc, info = env.step(toward)
            last = i == abs(target - current) - 1
            assert (reward, term) == ((1.0, True) if last else (0.0, False))
        assert info["success"]
    obs, _ = env.reset(seed=0)
    target, current = (int(line.split(": ")[1]) for line in obs.splitlines())
    away = "<action>-</action>" if target > current else "<action>+</action>"
    assert env.step(away)[1] == -1.0  # not closer (also at the ends of the line)


def test_blackjack_hit_below_17_wins_some_and_rewards_match_text() -> None:
    env = envs.make("agentstream/Blackjack-v0")
    outcomes = []
    for seed in range(40):
        obs, info = env.reset(seed=seed)
        while True:
            total = int(obs.splitlines()[0].split("total ")[1].split(")")[0].split()[0])
            answer = "<action>hit</action>" if total < 17 else "<action>stand</action>"
            obs, reward, term, trunc, info = env.step(answer)
            if term:
                break
        expected = {"You win.": 1.0, "You lose.": -1.0, "Draw.": 0.0}[obs.splitlines()[-1]]
        assert reward == expected and info["success"] == (reward > 0)
        outcomes.append(reward)
        assert not env.step("<action>hit</action>")[4]["valid"]  # the hand is over
    assert outcomes.count(1.0) >= 8 and outcomes.count(-1.0) >= 8  # ~42% / ~49% with this policy
