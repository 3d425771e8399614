"""The shop agent of examples/openai_agent.py written with LangGraph: `langgraph.prebuilt.create_react_agent` on
`langchain_openai.ChatOpenAI(base_url=<the episode's base_url>, ...)`, with the same two tools, `lookup` and
`calculator`. The ReAct graph (model node, tool node, back) is LangGraph's; agentstream sees only chat completions
and trains on them.

    # One command: start a local run with the gateway and no actors, then play episodes until it ends
    .venv/bin/python examples/langgraph_agent.py --launch            # run overrides may follow: trainer.total_steps=20
    # Or against a run that is up (started with gateway.enabled=true; it writes RUN/gateway_url)
    .venv/bin/python examples/langgraph_agent.py --gateway $(cat RUN/gateway_url) --episodes 16 --group-size 4

The options are examples/openai_agent.py's (gateway/agent_runner.py's command line; its `play_with` opens each
episode and counts and records the calls from the HTTP client ChatOpenAI is handed). The model is chosen per call
(create_react_agent's dynamic model): until a tool has run, its tools are bound with `tool_choice`
--first-tool-choice (`required` by default: the tiny local model writes no tool call by itself), then with `auto`.
--max-turns bounds the model calls (the graph's `recursion_limit`: a model call and a tool step each take one; at
the limit the prebuilt agent stops without running the last tools, and the episode ends truncated).
"""

from __future__ import annotations

import functools
import json
import sys
import warnings

import httpx2
import openai
from langchain_core.messages import ToolMessage
from langchain_core.tools import StructuredTool
from langchain_openai import ChatOpenAI
from langgraph.errors import GraphRecursionError
from langgraph.prebuilt import create_react_agent

from gateway.agent_runner import EpisodeCalls, Settings, extra_body, main, play_with, tls_context
from gateway.episode_client import Episode
from gateway.shop_task import SYSTEM, TOOLS, Task, run_tool

# create_react_agent moved to langchain.agents.create_agent in LangGraph 1.0; the prebuilt one still works.
warnings.filterwarnings("ignore", message=".*create_react_agent has been moved.*")


def shop_tool(spec: dict) -> StructuredTool:
    """One of the shop's tools (gateway.shop_task.TOOLS: the same JSON schema the engine writes calls under)."""
    fn = spec["function"]

    def invoke(**arguments: object) -> str:
        return run_tool(fn["name"], json.dumps(arguments))  # a bad call gets an error text back, never an exception

    return StructuredTool.from_function(
        func=invoke, name=fn["name"], description=fn["description"], args_schema=fn["parameters"]
    )


SHOP_TOOLS = [shop_tool(spec) for spec in TOOLS]


@functools.cache
def sync_client() -> httpx2.Client:
    """The synchronous client ChatOpenAI also builds (unused here: the graph runs async), one for the process instead
    of one per episode (~20 ms of CPU each: a new TLS context)."""
    return openai.DefaultHttpxClient(verify=tls_context())


async def run_agent(ep: Episode, task: Task, s: Settings, calls: EpisodeCalls) -> str:
    """One episode, LangGraph's way: the last message's text."""
    llm = ChatOpenAI(
        model=s.model,
        base_url=ep.base_url,
        api_key=ep.api_key,
        max_tokens=s.max_tokens,
        temperature=s.temperature,
        timeout=120,
        max_retries=2,
        disable_streaming=True,
        http_async_client=calls.http_client(),
        http_client=sync_client(),
        extra_body=extra_body(s),
    )
    first, later = (llm.bind_tools(TOOLS, tool_choice=choice) for choice in (s.first_tool_choice, "auto"))

    def model(state: dict, _runtime: object) -> object:
        acted = any(isinstance(m, ToolMessage) for m in state["messages"])
        return later if acted else first

    agent = create_react_agent(model, SHOP_TOOLS, prompt=SYSTEM)
    try:
        state = await agent.ainvoke(
            {"messages": [("user", task.question)]}, config={"recursion_limit": 2 * s.max_turns - 1}
        )
        return str(state["messages"][-1].content or "")
    except GraphRecursionError:  # out of steps while still acting: the episode ends truncated
        return ""
    finally:
        await llm.root_async_client.close()


if __name__ == "__main__":
    sys.exit(main(play_with(run_agent), "langgraph-agent", __doc__))
