"""The shop agent of examples/openai_agent.py written with the OpenAI Agents SDK (`openai-agents`, import `agents`):
an `agents.Agent` with two function tools, `lookup` and `calculator`, its model an `OpenAIChatCompletionsModel` on
the episode's `openai.AsyncOpenAI` client, pointed at the gateway. The agent loop (call, run the tools, call again)
is the SDK's; agentstream sees only chat completions and trains on them.

    # One command: start a local run with the gateway and no actors, then play episodes until it ends
    .venv/bin/python examples/openai_agents_sdk.py --launch          # run overrides may follow: trainer.total_steps=20
    # Or against a run that is up (started with gateway.enabled=true; it writes RUN/gateway_url)
    .venv/bin/python examples/openai_agents_sdk.py --gateway $(cat RUN/gateway_url) --episodes 16 --group-size 4

The options are examples/openai_agent.py's (gateway/agent_runner.py's command line; its `play_with` opens each
episode and counts and records the calls from the HTTP client the SDK is handed). The first call's `tool_choice` is
--first-tool-choice (`required` by default: the tiny local model writes no tool call by itself); the SDK sets it
back to `auto` once a tool has run (`Agent.reset_tool_choice`). --max-turns bounds the SDK's turns
(`Runner.run(max_turns=...)`): an agent still calling tools then ends its episode truncated. Tracing is off: nothing
leaves the machine.
"""

from __future__ import annotations

import sys

from agents import (
    Agent,
    FunctionTool,
    MaxTurnsExceeded,
    ModelSettings,
    OpenAIChatCompletionsModel,
    RunConfig,
    Runner,
    set_tracing_disabled,
)
from openai import AsyncOpenAI

from gateway.agent_runner import EpisodeCalls, Settings, extra_body, main, play_with
from gateway.episode_client import Episode
from gateway.shop_task import SYSTEM, TOOLS, Task, run_tool


def shop_tool(spec: dict) -> FunctionTool:
    """One of the shop's tools (gateway.shop_task.TOOLS: the same JSON schema the engine writes calls under)."""
    fn = spec["function"]

    async def invoke(_ctx: object, arguments: str) -> str:
        return run_tool(fn["name"], arguments)  # a bad call gets an error text back, never an exception

    return FunctionTool(
        name=fn["name"], description=fn["description"], params_json_schema=fn["parameters"], on_invoke_tool=invoke
    )


SHOP_TOOLS = [shop_tool(spec) for spec in TOOLS]


async def run_agent(ep: Episode, task: Task, s: Settings, calls: EpisodeCalls) -> str:
    """One episode, the SDK's way: its final output ("" when it stopped at --max-turns still acting)."""
    client = AsyncOpenAI(
        base_url=ep.base_url, api_key=ep.api_key, max_retries=2, timeout=120, http_client=calls.http_client()
    )
    agent = Agent(
        name="shop",
        instructions=SYSTEM,
        tools=SHOP_TOOLS,
        model=OpenAIChatCompletionsModel(model=s.model, openai_client=client),
        model_settings=ModelSettings(
            tool_choice=s.first_tool_choice,
            max_tokens=s.max_tokens,
            temperature=s.temperature,
            extra_body=extra_body(s),
        ),
    )
    try:
        result = await Runner.run(
            agent, task.question, max_turns=s.max_turns, run_config=RunConfig(tracing_disabled=True)
        )
        return str(result.final_output or "")
    except MaxTurnsExceeded:
        return ""
    finally:
        await client.close()


if __name__ == "__main__":
    set_tracing_disabled(True)  # the SDK would otherwise export traces to OpenAI's servers
    sys.exit(main(play_with(run_agent), "openai-agents-sdk", __doc__))
