"""Rewards on response tokens, actor side (actors/token_rewards.py): a user's function that fails in any way is
counted by cause and never stops a step; `after_action` finds the first token after the action's closing tag with
a real tokenizer; the config check names what is wrong. Learner side: tests/learner/test_learner_token_rewards.py."""

from __future__ import annotations

import random

import numpy as np
import pytest

from actors.token_rewards import (
    FAILURES,
    TokenRewards,
    TokenRewardStep,
    after_action,
    per_token_cost,
    token_reward_errors,
)


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from agentstream.config import TINY_MODEL_DIR
    from launcher.tiny_model import ensure_tiny_model

    return AutoTokenizer.from_pretrained(ensure_tiny_model(TINY_MODEL_DIR))  # the run's tiny model, made if absent


def step_of(text: str, tokenizer) -> TokenRewardStep:
    ids = np.asarray(tokenizer.encode(text, add_special_tokens=False), np.int32)
    return TokenRewardStep("obs", text, ids, tokenizer, reward=0.0, valid=True)


def test_after_action_penalises_exactly_the_tokens_after_the_closing_tag(tokenizer) -> None:
    rng = random.Random(0)
    words = ["left", "up", "go", "north", "and", "then", "some", "more", "words", "<action>", "</action>", " ", "x"]
    tag, tagged = "</action>", 0
    for _ in range(200):
        text = "".join(rng.choice(words) + rng.choice(["", " "]) for _ in range(rng.randint(0, 12)))
        step = step_of(text, tokenizer)
        ids = step.response_ids.tolist()
        got = after_action(step, penalty=-0.5)
        assert len(got) == len(ids) and set(got) <= {0.0, -0.5}
        first = got.index(-0.5) if -0.5 in got else len(ids)
        assert got == [0.0] * first + [-0.5] * (len(ids) - first)  # every token after the first penalised one too
        if tag in tokenizer.decode(ids):
            # the tag is whole within tokens 0..first-1 and not within 0..first-2: `first` is the first token after it
            assert tag in tokenizer.decode(ids[:first]) and tag not in tokenizer.decode(ids[: first - 1])
            tagged += first < len(ids)
        else:
            assert first == len(ids)
    assert tagged > 50  # most random answers had text after the tag
    # by hand: nothing after the tag, or no tag at all, costs nothing
    assert set(after_action(step_of("<action>left</action>", tokenizer))) == {0.0}
    assert set(after_action(step_of("left words", tokenizer))) == {0.0}
    assert after_action(TokenRewardStep("o", "", np.zeros(0, np.int32), tokenizer, 0.0, True)) == []
    assert per_token_cost(step_of("go north", tokenizer), cost=-0.25) == [-0.25] * len(tokenizer.encode("go north"))


def test_every_failure_of_a_users_function_is_counted_and_never_raised(tokenizer) -> None:
    step = step_of("<action>up</action> more", tokenizer)
    t = step.response_ids.size

    def boom(step):
        raise RuntimeError("user bug")

    cases = [
        (boom, "raised"),
        (lambda s: "abc", "not_numbers"),
        (lambda s: [[1.0], [2.0, 3.0]], "not_numbers"),
        (lambda s: [0.0] * (t + 1), "wrong_length"),
        (lambda s: None, "wrong_length"),
        (lambda s: [float("nan")] * t, "non_finite"),
        (lambda s: [1e39] * t, "non_finite"),
    ]
    for fn, cause in cases:
        rewards = TokenRewards(fn)
        values, problem = rewards(step)
        assert (values.size, problem) == (0, cause), cause
        values, problem = rewards(step)  # again: counted each time
        assert rewards.counters == {"token_reward_failures": 2, f"token_reward_failures_{cause}": 2}
    assert set(c for _, c in cases) == set(FAILURES)
    good = TokenRewards.load("actors.token_rewards:per_token_cost", {"cost": -0.5})
    values, problem = good(step)
    assert problem == "" and values.dtype == np.float32 and values.tolist() == [-0.5] * t
    assert good.counters == {"token_reward_steps": 1, "token_reward_sum": -0.5 * t}


def test_the_config_check_says_what_is_wrong() -> None:
    assert token_reward_errors("", {}) == [] and token_reward_errors("actors.token_rewards:after_action", {}) == []
    assert token_reward_errors("actors.token_rewards:after_action", {"penalty": -0.1, "tag": "</a>"}) == []
    for spec, kwargs, says in [
        ("after_action", {}, "module:function"),
        ("no_such_module:f", {}, "cannot import"),
        ("actors.token_rewards:nope", {}, "has no function"),
        ("actors.token_rewards:after_action", {"penality": 1}, "penality"),
        ("", {"cost": 1}, "token_reward is not"),
    ]:
        (error,) = token_reward_errors(spec, kwargs)
        assert says in error, error
