"""SkyRL-Gym adapter: gold agents succeed on text2sql, search and code; the sandbox holds its limits."""

import random
import string
import time

import pytest

import envs
from envs.base import Action, ParseFailure
from envs.skyrl import SkyRLGymEnv, parse_code_action, parse_search_action, parse_sql_action
from envs.tools.sandbox import run_python


@pytest.fixture(scope="module")
def sql_env():
    env = envs.make("agentstream/SkyRL-v0", task="text2sql", max_steps=4)
    yield env
    env.close()


def test_blocking_is_declared() -> None:
    assert SkyRLGymEnv.blocking is True


def test_text2sql_gold_query_succeeds_and_a_wrong_one_does_not(sql_env) -> None:
    for seed in range(4):
        obs, info = sql_env.reset(seed=seed)
        assert "CREATE TABLE employees" in obs and "Question:" in obs
        obs, r, term, _, info = sql_env.step("<think>look</think><sql>SELECT COUNT(*) FROM employees</sql>")
        assert not term and r == 0.0 and "24" in obs  # 24 generated employees
        gold = sql_env.task.gold["sql"]
        _, r, term, _, info = sql_env.step(f"<think>done</think><solution>{gold}</solution>")
        assert term and r == 1.0 and info["success"]
    sql_env.reset(seed=0)
    _, r, term, _, info = sql_env.step("<think>guess</think><solution>SELECT 'nobody'</solution>")
    assert term and r == 0.0 and not info["success"]


def test_text2sql_same_seed_same_prompt_and_invalid_does_not_move(sql_env) -> None:
    obs_a, _ = sql_env.reset(seed=3)
    obs, r, term, _, info = sql_env.step("SELECT 1")  # no tags: not an action
    assert (obs, r, term, info["valid"]) == (obs_a, 0.0, False, False)
    assert sql_env.reset(seed=3)[0] == obs_a


def test_search_gold_agent_finds_the_answer_in_the_retrieved_document() -> None:
    env = envs.make("agentstream/SkyRL-v0", task="search", max_steps=3)
    try:
        for seed in range(4):
            obs, _ = env.reset(seed=seed)
            answer = env.task.gold["answers"][0]
            obs, r, term, _, info = env.step(f"<search>{obs.removeprefix('Question: ')}</search>")
            assert not term and r == 0.0 and "<information>" in obs and answer in obs
            _, r, term, _, info = env.step(f"<answer>{answer}</answer>")
            assert term and r == 1.0 and info["success"]
        env.reset(seed=0)
        _, r, term, _, info = env.step("<answer>Atlantis</answer>")
        assert term and r == 0.0 and not info["success"]
    finally:
        env.close()


def test_code_correct_solution_passes_wrong_fails() -> None:
    env = envs.make("agentstream/SkyRL-v0", task="code", max_steps=2)
    for seed in range(4):
        obs_a, _ = env.reset(seed=seed)
        assert env.reset(seed=seed)[0] == obs_a
        solution = env.task.gold["solution"]
        _, r, term, _, info = env.step(f"Here:\n```python\n{solution}```")
        assert term and r == 1.0 and info["success"], info["skyrl_metadata"]
        env.reset(seed=seed)
        _, r, term, _, info = env.step("```python\nprint(0)\n```")
        assert term and r == 0.0 and not info["success"]
    env.close()


def test_sandbox_kills_an_infinite_loop_and_a_memory_hog() -> None:
    start = time.monotonic()
    result = run_python("while True:\n    pass\n", ["\n"], time_limit_s=1.0)
    assert result.status == "timeout" and time.monotonic() - start < 3.0
    hog = "blocks = []\nwhile True:\n    blocks.append(bytearray(10**7))\n"
    start = time.monotonic()
    result = run_python(hog, ["\n"], time_limit_s=5.0, memory_mb=128)
    assert time.monotonic() - start < 5.0  # stopped by the 128 MiB limit, not the clock
    assert result.status == "crash" or result.errors[0].startswith("MemoryError")
    sleeper = "import time\ntime.sleep(30)\n"  # wall clock, not CPU: only the parent's timeout catches it
    start = time.monotonic()
    assert run_python(sleeper, ["\n"], time_limit_s=0.5).status == "timeout" and time.monotonic() - start < 2.0
    assert (
        run_python("import socket\nsocket.create_connection(('127.0.0.1', 9))", ["\n"]).errors[0].startswith("OSError")
    )


@pytest.mark.parametrize("parse", [parse_sql_action, parse_search_action, parse_code_action])
def test_parsers_never_raise_on_random_strings(parse) -> None:
    rng = random.Random(0)
    pieces = [
        "<sql>",
        "</sql>",
        "<solution>",
        "</solution>",
        "<search>",
        "</search>",
        "<answer>",
        "</answer>",
        "```",
        "```python\n",
        "\n",
    ]
    for _ in range(2000):
        text = "".join(
            rng.choice(pieces) if rng.random() < 0.3 else rng.choice(string.printable)
            for _ in range(rng.randint(0, 40))
        )
        assert isinstance(parse(text), (Action, ParseFailure))
    assert isinstance(parse(None), ParseFailure)  # type: ignore[arg-type]
