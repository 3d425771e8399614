"""Agents written with agent SDKs train a real run through the gateway, token-exactly: the OpenAI Agents SDK
(examples/openai_agents_sdk.py: `agents.Agent`, `OpenAIChatCompletionsModel` on the episode's `AsyncOpenAI`) and
LangGraph (examples/langgraph_agent.py: `create_react_agent` on `ChatOpenAI(base_url=<the episode's URL>)`).

Each runs as a user runs it, `python examples/<sdk>.py --launch ...`, as tests/test_e2e_gateway.py runs the plain
`openai` agent: the launcher with gateway.enabled=true and actors.count=0, the session's vLLM server (`tiny_engine`,
through engines.external_urls), 6 episodes (3 groups of 2; the first call of each forced to be a tool call, at most 3
model calls), 3 learner steps. The SDK runs its own loop (call, run the tools, call again); the example only reads
the gateway's answers off the HTTP client it hands the SDK (--record: prompt and answer token ids of every call).

    .venv/bin/python -m pytest tests/test_e2e_agent_sdks.py -q -p no:cacheprovider      # ~15 s per SDK + vLLM

Checked per SDK: the learner took its 3 steps on the agent's groups and nothing is left running; the broker's log
holds exactly the calls the SDK made, with the checker's reward on each episode's last step; a tool's result went
back and each later call's prompt ids extend the previous call's prompt + answer ids (the SDK sent the history back
as the gateway returned it: no prompt was rendered anew); the gateway's counters are the SDK's counts.
"""

import collections
import re
import sys
from pathlib import Path

import pytest
from e2e_testing import agent_run_overrides, check_logged_calls, processes_mentioning, run_agent, tool_round_trips

from agentstream.wire.addresses import free_port

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.e2e
G, GROUPS, STEPS, MAX_TURNS = 2, 3, 3, 3


def metric(text: str, name: str, labels: str = "") -> float:
    match = re.search(rf"^{re.escape(name + labels)} (\S+)$", text, re.MULTILINE)
    assert match, f"{name}{labels} missing from /metrics"
    return float(match.group(1))


@pytest.fixture(scope="module", params=["openai_agents_sdk", "langgraph_agent"])
def run(request: pytest.FixtureRequest, tiny_engine, tmp_path_factory: pytest.TempPathFactory) -> dict:
    model, url = tiny_engine
    tmp = tmp_path_factory.mktemp(request.param)
    run_dir, record = tmp / "run", tmp / "calls.jsonl"
    argv = [
        sys.executable,
        f"examples/{request.param}.py",
        "--launch",
        "--episodes",
        str(G * GROUPS),
        "--group-size",
        str(G),
        "--concurrency",
        "4",
        "--max-tokens",
        "64",
        "--max-turns",
        str(MAX_TURNS),
        "--record",
        str(record),
        *agent_run_overrides(run_dir, model, url, STEPS, free_port()),
    ]
    return run_agent(argv, run_dir, record) | {"sdk": request.param, "model": model}


def test_the_sdk_agent_trains_the_run_and_leaves_nothing(run: dict) -> None:
    s = run["summary"]
    print(f"{run['sdk']} e2e wall time: {run['wall_s']:.1f}s")
    assert s["status"] == "finished" and s["processes_left"] == [], s["reason"]
    assert s["learner_version"] == STEPS and s["engine_versions"] == {"engine-0": STEPS}
    assert s["trained_group_shapes"] == {f"{G}/{G}": GROUPS} and s["episodes"] == G * GROUPS
    n = len(run["calls"])
    assert s["transitions_sent"] == s["transitions_ingested"] == s["transitions_trained"] == n >= G * GROUPS
    assert len(run["ends"]) == G * GROUPS
    assert all(1 <= e["steps"] <= MAX_TURNS for e in run["ends"].values())  # the SDK's turns were bounded
    assert f"[agent] {G * GROUPS} episodes in" in run["out"]
    assert processes_mentioning(str(run["dir"])) == []


def test_the_broker_logged_exactly_the_calls_the_sdk_made(run: dict) -> None:
    check_logged_calls(run, GROUPS, G)


def test_the_sdks_tool_calls_round_trip_token_exactly(run: dict) -> None:
    by_episode = collections.defaultdict(list)
    for c in run["calls"]:
        by_episode[c["episode"]].append(c["turn"])
    assert all(turns == list(range(len(turns))) for turns in by_episode.values())
    # the SDK calls again only after it ran a tool
    assert tool_round_trips(run["calls"], run["model"]) >= 1, [c["finish_reason"] for c in run["calls"]]
    m, n = run["metrics"], len(run["calls"])
    assert metric(m, "agentstream_gateway_calls_total") == n
    assert metric(m, "agentstream_gateway_tool_calls_total") == sum(len(c["tool_calls"]) for c in run["calls"]) >= 1
    # The SDK sent each episode's history back exactly as the gateway returned it: every later call extended.
    assert metric(m, "agentstream_gateway_prompts_extended_total") == n - G * GROUPS
    assert metric(m, "agentstream_gateway_prompts_rendered_anew_total") == 0
