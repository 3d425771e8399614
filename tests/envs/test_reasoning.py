"""Reasoning-gym env: the generator's own answer scores 1, wrong answers less, feedback on retries."""

import random
import string

import pytest

import envs
from envs.base import Action, ParseFailure
from envs.reasoning import parse_answer, parse_last_number

DATASETS = ("basic_arithmetic", "countdown", "chain_sum", "puzzle24")


def test_parser_takes_the_last_answer_and_fails_typed() -> None:
    assert parse_answer("<answer>1</answer> no wait <answer> 2 </answer>") == Action("2")
    assert "no <answer>" in parse_answer("2").reason
    assert "empty" in parse_answer("<answer>  </answer>").reason
    assert isinstance(parse_answer(None), ParseFailure)  # type: ignore[arg-type]


def test_parser_never_raises_on_random_strings() -> None:
    rng = random.Random(0)
    pieces = ["<answer>", "</answer>", "<", ">", "/", "answer", "42"]
    for _ in range(3000):
        text = "".join(
            rng.choice(pieces) if rng.random() < 0.3 else rng.choice(string.printable + "ü\x00")
            for _ in range(rng.randint(0, 40))
        )
        assert isinstance(parse_answer(text), (Action, ParseFailure))


@pytest.mark.parametrize("dataset", DATASETS)
def test_gold_answer_succeeds_and_a_wrong_one_scores_lower(dataset: str) -> None:
    env = envs.make("agentstream/Reasoning-v0", dataset=dataset, max_steps=4)
    for seed in range(3):
        env.reset(seed=seed)
        gold = env.entry["answer"]
        _, reward, term, trunc, info = env.step(f"thinking... <answer>{gold}</answer>")
        assert (reward, term, trunc, info["success"], info["valid"]) == (1.0, True, False, True, True)
        env.reset(seed=seed)
        _, wrong, term, _, info = env.step("<answer>-123456789</answer>")
        assert term and not info["success"] and wrong < 1.0


def test_same_seed_same_question_and_arithmetic_alias() -> None:
    a = envs.make("agentstream/Reasoning-v0", dataset="arithmetic")  # alias of basic_arithmetic
    b = envs.make("agentstream/Reasoning-v0", dataset="basic_arithmetic")
    assert a.reset(seed=7)[0] == b.reset(seed=7)[0]
    assert a.reset(seed=7)[0] != a.reset(seed=8)[0]
    with pytest.raises(KeyError, match="known: .*countdown"):
        envs.make("agentstream/Reasoning-v0", dataset="no_such_generator")


def test_multi_turn_feedback_then_success_and_invalid_does_not_use_an_attempt() -> None:
    env = envs.make("agentstream/Reasoning-v0", dataset="basic_arithmetic", max_attempts=2, max_steps=5)
    obs0, _ = env.reset(seed=1)
    assert "2 attempts" in obs0
    obs, reward, term, _, info = env.step("no tags")
    assert (obs, reward, term, info["valid"]) == (obs0, 0.0, False, False)
    obs, reward, term, _, info = env.step("<answer>-123456789</answer>")
    assert not term and reward == 0.0 and "not correct" in obs and "1 attempt left" in obs
    _, reward, term, _, info = env.step(f"<answer>{env.entry['answer']}</answer>")
    assert term and reward == 1.0 and info["success"]
    env.reset(seed=1)
    env.step("<answer>-1</answer>")
    _, reward, term, _, info = env.step("<answer>-2</answer>")  # the last attempt ends the episode
    assert term and not info["success"] and reward < 1.0


def test_last_number_reads_a_sentence_when_there_is_no_tag() -> None:
    assert parse_last_number("5 + 8 is 13, and 13 it stays.") == Action("13")  # the last number
    assert parse_last_number("<answer>4</answer> then 7") == Action("4")  # a tag wins over the numbers
    assert parse_last_number("minus: -2.5") == Action("-2.5")
    assert "no number" in parse_last_number("thirteen").reason
    env = envs.make(
        "agentstream/Reasoning-v0",
        answer_format="last_number",
        max_steps=2,
        dataset_kwargs={"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1},
    )
    env.reset(seed=1000)  # reasoning-gym's item at seed 1000 with these kwargs: "Calculate 5 + 8."
    assert env.entry["answer"] == "13"
    _, reward, done, _, info = env.step("Adding them gives 13.")
    assert (reward, done, info["success"]) == (1.0, True, True)
    with pytest.raises(ValueError, match="answer_format='loose'.*tag, last_number"):
        envs.make("agentstream/Reasoning-v0", answer_format="loose")
