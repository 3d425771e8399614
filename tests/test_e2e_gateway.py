"""The example agent (examples/openai_agent.py, the real `openai` client) trains a real run through the gateway.

One command, as a user runs it: `python examples/openai_agent.py --launch ...` starts the launcher with
gateway.enabled=true and actors.count=0 (the agent is the only player), waits for RUN/gateway_url, plays 6
episodes (3 groups of 2, the first call of each forced to be a tool call) and waits for the run to end. The engine
is the session's vLLM server (`tiny_engine`, through engines.external_urls, as tests/test_e2e_envs.py does); the
broker, learner (1 rank), weight sidecar and gateway are the launcher's real processes.

    .venv/bin/python -m pytest tests/test_e2e_gateway.py -q -p no:cacheprovider      # ~35 s + the vLLM server

Checked: the learner took its 3 steps and the engine serves version 3; the broker's log holds exactly the calls the
agent made (prompt and answer token ids as the agent saw them, the checker's reward on each episode's last
step), and all of them were trained; a tool call's result went back and the next prompt extended the previous
prompt + answer ids token-exactly; the gateway's counters in /metrics are the agent's counts; nothing is left
running.
"""

import re
import sys
from pathlib import Path

import pytest
from e2e_testing import agent_run_overrides, check_logged_calls, processes_mentioning, run_agent, tool_round_trips

from agentstream.wire.addresses import free_port

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.e2e
G, GROUPS, STEPS = 2, 3, 3


def metric(text: str, name: str, labels: str = "") -> float:
    match = re.search(rf"^{re.escape(name + labels)} (\S+)$", text, re.MULTILINE)
    assert match, f"{name}{labels} missing from /metrics"
    return float(match.group(1))


@pytest.fixture(scope="module")
def run(tiny_engine, tmp_path_factory: pytest.TempPathFactory) -> dict:
    model, url = tiny_engine
    tmp = tmp_path_factory.mktemp("gateway-run")
    run_dir, record = tmp / "run", tmp / "calls.jsonl"
    argv = [
        sys.executable,
        "examples/openai_agent.py",
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
        "3",
        "--record",
        str(record),
        *agent_run_overrides(run_dir, model, url, STEPS, free_port()),
    ]
    return run_agent(argv, run_dir, record) | {"model": model}


def test_the_run_trains_its_steps_on_the_agents_groups_and_leaves_nothing(run: dict) -> None:
    s = run["summary"]
    print(f"gateway e2e wall time: {run['wall_s']:.1f}s")
    assert s["status"] == "finished" and s["processes_left"] == [], s["reason"]
    assert s["learner_version"] == STEPS and s["engine_versions"] == {"engine-0": STEPS}  # versions advanced
    assert s["trained_group_shapes"] == {f"{G}/{G}": GROUPS} and s["episodes"] == G * GROUPS
    n = len(run["calls"])
    assert s["transitions_sent"] == s["transitions_ingested"] == s["transitions_trained"] == n >= G * GROUPS
    assert len(run["ends"]) == G * GROUPS
    url = (run["dir"] / "gateway_url").read_text().strip()  # what the launch printed is what it wrote
    assert re.match(r"http://127\.0\.0\.1:\d+$", url) and f"[agentstream] gateway:    {url}" in run["out"]
    assert processes_mentioning(str(run["dir"])) == []


def test_the_broker_logged_exactly_the_calls_the_agent_made(run: dict) -> None:
    logged = check_logged_calls(run, GROUPS, G)  # 3 groups of 2 trajectories, from 3 task ids
    assert all(0 <= t.version_lo <= t.version_hi <= STEPS for t in logged)


def test_tool_calls_round_trip_token_exactly(run: dict) -> None:
    firsts: dict = {}
    for c in run["calls"]:
        firsts.setdefault(c["episode"], c)
    assert all(c["turn"] == 0 for c in firsts.values())  # a later call exists only after a tool call was answered
    assert tool_round_trips(run["calls"], run["model"]) >= 1, [c["finish_reason"] for c in run["calls"]]
    m = run["metrics"]
    tool_calls = sum(len(c["tool_calls"]) for c in run["calls"])
    assert metric(m, "agentstream_gateway_tool_calls_total") == tool_calls >= 1
    forced_failed = sum(1 for c in run["calls"] if c["turn"] == 0 and not c["tool_calls"])
    assert metric(m, "agentstream_gateway_tool_parse_failures_total") >= forced_failed


def test_the_gateway_counts_like_an_actor_in_metrics(run: dict) -> None:
    m, n = run["metrics"], len(run["calls"])
    assert metric(m, "agentstream_episodes_total") == G * GROUPS
    assert metric(m, "agentstream_env_steps_total") == metric(m, "agentstream_gateway_calls_total") == n
    assert metric(m, "agentstream_env_episodes_total", '{env="gateway"}') == G * GROUPS
    assert metric(m, "agentstream_gateway_episodes_opened_total") == G * GROUPS
    assert metric(m, "agentstream_gateway_prompts_extended_total") == n - G * GROUPS  # every later call extended
    assert metric(m, "agentstream_gateway_requests_total") >= n + 2 * G * GROUPS  # calls, opens, finishes
    assert "# HELP agentstream_gateway_calls_total Model calls the gateway answered" in m
