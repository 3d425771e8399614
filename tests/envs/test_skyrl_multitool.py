"""SkyRL multi-tool env: a scripted agent that calls the right tool and answers from its response wins on every
task kind; wrong answers, malformed calls and odd tool input never raise and never pay."""

import json
import os
import random
import re
import string
import warnings

import pytest
from gymnasium.utils.env_checker import check_env

import envs
from envs.base import Action, ParseFailure
from envs.skyrl import parse_multitool_action
from envs.tools.multitool import KINDS, answer_matches, run_code, run_sql


@pytest.fixture(scope="module")
def env():
    env = envs.make("agentstream/SkyRL-v0", task="multitool", max_steps=3)
    yield env
    env.close()


def call(name: str, **arguments: str) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def responses(obs: str) -> list[str]:
    return re.findall(r"<tool_response>\n(.*?)\n</tool_response>", obs, re.DOTALL)


_ARTICLE = re.compile(
    r'"(?P<town>\w+)"\n(?P=town) is a town in the province of (?P<province>\w+), on the banks of '
    r"the (?P<river>[\w ]+ River)\. It was founded in (?P<founded>\d+) by (?P<founder>[\w ]+)\. "
    r"Its main export is (?P<export>\w+)\."
)
_FIELD = {
    "In which year": "founded",
    "Who founded": "founder",
    "What is the main export": "export",
    "In which province": "province",
    "On which river": "river",
}


def answer_from(question: str, kind: str, response: str) -> str:
    """What a reader of the tool response answers (the gold answer is never looked at)."""
    if kind == "search":
        articles = {m["town"]: m for m in _ARTICLE.finditer(json.loads(response)["result"])}
        town = next(t for t in articles if re.search(rf"\b{t}\b", question))
        return articles[town][next(f for q, f in _FIELD.items() if question.startswith(q))]
    if kind == "sql":
        return response.splitlines()[-1]  # under the header line: the one value
    return response.strip()  # python: what the program printed


def test_scripted_agent_uses_the_right_tool_and_answers_from_its_response(env) -> None:
    kinds = set()
    for seed in range(6):
        obs, _ = env.reset(seed=seed)
        question = obs.rsplit("Question: ", 1)[1]
        gold = env.task.gold
        kinds.add(gold["tool"])
        obs, r, term, _, info = env.step(call(gold["call"]["name"], **gold["call"]["arguments"]))
        assert info["valid"] and not term and r == 0.0
        [response] = responses(obs)
        answer = answer_from(question, gold["tool"], response)
        _, r, term, _, info = env.step(f"I found it. <answer>{answer}</answer>")
        assert term and r == 1.0 and info["success"], (seed, question, response)
        env.reset(seed=seed)
        _, r, term, _, info = env.step("<answer>Atlantis 42</answer>")
        assert term and r == 0.0 and not info["success"]
    assert kinds == set(KINDS)  # seed % 3 picks the kind: six seeds hold each twice


def test_answers_match_up_to_case_space_punctuation_and_number_format() -> None:
    assert answer_matches("  ada   STONE. ", ["Ada Stone"])  # case, inner and outer space, a final period
    assert answer_matches("**98,500.0**", ["98500"])  # markdown and a thousands comma; 98500.0 == 98500
    assert answer_matches("1e3", ["1000"])  # 1e3 = 1000
    assert not answer_matches("-5", ["5"])  # the sign is not surrounding punctuation
    assert not answer_matches("Ada", ["Ada Stone"])
    assert not answer_matches("1,2", ["12"])  # not a thousands separator: compared as text
    assert answer_matches("Zyzy River", ["Kalo", "zyzy river"])  # any accepted answer


@pytest.mark.parametrize(
    "text, error",
    [
        ('<tool_call>{"name": "sql", "arguments": {"query": </tool_call>', "bad_json"),
        ('<tool_call>{"name": "browse", "arguments": {"url": "x"}}</tool_call>', "unknown_tool"),
        ('<tool_call>{"name": "sql", "arguments": {"query": "SELECT 1"}}', "truncated"),  # the reply stopped
        ('<tool_call>{"name": "sql", "arguments": ["SELECT 1"]}</tool_call>', "bad_call"),
        (
            '<tool_call>{"name": "sql", "arguments": {"query": "SELECT 1"}}</tool_call><tool_call>{</tool_call>',
            "bad_json",
        ),
        ("The answer is probably 4.", None),
        ("<answer>  </answer>", None),
    ],
)
def test_malformed_or_missing_calls_are_invalid_and_do_not_move(env, text: str, error: str | None) -> None:
    obs0, _ = env.reset(seed=1)
    obs, r, term, trunc, info = env.step(text)
    assert (obs, r, term, trunc, info["valid"]) == (obs0, 0.0, False, False, False)
    expected = f"malformed tool call ({error})" if error else "no tool call and no non-empty <answer>"
    assert info["parse_error"].startswith(expected)


def test_odd_arguments_and_failing_tools_come_back_as_text(env) -> None:
    env.reset(seed=1)
    obs, _, term, _, info = env.step(call("sql", sql="SELECT 1") + call("sql", query="DELETE FROM employees"))
    assert info["valid"] and not term
    assert responses(obs) == ['error: sql takes {"query": string}', "error: not authorized"]
    obs, _, term, _, _ = env.step(
        call("python", code="print(1)\nraise ValueError('boom')") + call("sql", query="SELECT nope FROM nowhere")
    )
    assert responses(obs) == ["1\nerror: ValueError: boom", "error: no such table: nowhere"] and not term
    obs, r, term, _, _ = env.step(call("python", code="pass"))
    assert responses(obs) == ["(no output: print the result to see it)"]
    assert term and r == 0.0  # the third turn of max_steps=3 and still no answer: over, reward 0


def test_sql_is_read_only_and_time_limited(env) -> None:
    env.reset(seed=1)
    db = env.task.extras["db_path"]
    for query in ["ATTACH DATABASE 'x.db' AS x", "VACUUM INTO 'x.db'", "CREATE TABLE t (x)"]:
        assert run_sql(db, query, 1.0).startswith("error:")
    assert not os.path.exists("x.db")
    endless = "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) SELECT COUNT(*) FROM c"
    assert run_sql(db, endless, 0.2) == "error: the query ran over 0.2 s and was stopped"
    # 24 employees, at most 50 rows shown: 24 lines under the header; none when nothing matches
    assert len(run_sql(db, "SELECT id FROM employees", 1.0).splitlines()) == 1 + 24
    assert run_sql(db, "SELECT id FROM employees WHERE id < 0", 1.0) == "id\n(no rows)"
    assert run_sql(db, "SELECT 1; SELECT 2", 1.0).startswith("error:")
    assert run_code("while True:\n    pass", 0.5, 128).startswith("error: timeout")


def test_calls_per_reply_are_capped_and_running_out_of_turns_ends_with_zero(env) -> None:
    env.reset(seed=2)
    obs, _, term, _, _ = env.step(call("sql", query="SELECT 7 AS n") * 5)  # one more than a reply may run
    assert responses(obs)[:4] == ["n\n7"] * 4 and responses(obs)[4].startswith("error: at most 4") and not term
    env.step("no call")  # invalid: counts against max_steps, not against the skyrl env's turns
    _, r, term, trunc, info = env.step(call("python", code="print(3)"))
    assert (r, term or trunc, info["success"]) == (0.0, True, False)


def test_same_seed_same_prompt_and_gymnasium_check() -> None:
    a = envs.make("agentstream/SkyRL-v0", task="multitool", max_steps=3)
    b = envs.make("agentstream/SkyRL-v0", task="multitool", max_steps=3)
    try:
        for seed in (0, 4, 10**9 + 2):
            obs, _ = a.reset(seed=seed)
            assert "CREATE TABLE employees" in obs and "<tools>" in obs and "Question:" in obs
            assert b.reset(seed=seed)[0] == obs and a.reset(seed=seed)[0] == obs
        assert a.reset(seed=0)[0] != a.reset(seed=3)[0]
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            check_env(a)
    finally:
        a.close()
        b.close()


def test_close_releases_the_retriever_and_the_databases() -> None:
    env = envs.make("agentstream/SkyRL-v0", task="multitool")
    env.reset(seed=1)
    server, root = env.family._server, env.family._root
    refs = server.refs
    assert os.path.isdir(root)
    env.close()
    assert server.refs == refs - 1 and not os.path.exists(root)


def test_parse_never_raises_on_random_strings() -> None:
    rng = random.Random(0)
    pieces = [
        "<tool_call>",
        "</tool_call>",
        "<answer>",
        "</answer>",
        '{"name": "sql", "arguments": {"query": "x"}}',
        '{"name": ',
        '"arguments"',
        "{",
        "}",
        "[",
        "]",
        '"',
        "\n",
        "\ud800",
        "\x00",
    ]
    kinds = set()
    for _ in range(3000):
        text = "".join(
            rng.choice(pieces) if rng.random() < 0.4 else rng.choice(string.printable)
            for _ in range(rng.randint(0, 40))
        )
        result = parse_multitool_action(text)
        assert isinstance(result, (Action, ParseFailure))
        kinds.add(type(result))
    assert kinds == {Action, ParseFailure}
    assert isinstance(parse_multitool_action(None), ParseFailure)  # type: ignore[arg-type]
