"""A ReAct-style agent written only against the `openai` package (plus gateway/episode_client.py, standard library
only), trained by agentstream through its OpenAI-compatible gateway. Nothing in the loop knows about training:
point it at any OpenAI-compatible server and it runs the same; pointed at a run's gateway, every call it makes is
one step of a training episode, and the checker's verdict is the episode's reward. The task and the command line
around the loop come with agentstream (gateway/shop_task.py, gateway/agent_runner.py): this file is the agent, and
runs as it is wherever agentstream is installed.

    # One command: start a local run with the gateway and no actors, then play episodes until it ends
    .venv/bin/python examples/openai_agent.py --launch              # run overrides may follow: trainer.total_steps=20
    # Or against a run that is up (started with gateway.enabled=true; it prints `gateway:` and writes RUN/gateway_url)
    .venv/bin/python examples/openai_agent.py --gateway $(cat RUN/gateway_url) --episodes 16 --group-size 4

The task (gateway/shop_task.py): a question about a small shop (prices in TABLE), answered with two tools,
`lookup` (a price) and `calculator` (arithmetic); `check` compares the number in the final answer with the task's.
Episodes of one task id form a group of --group-size (the run's env.group_size): GRPO compares them. The tiny local
model will not solve the tasks (a random network writes no tool calls by itself: the first turn asks for one with
`tool_choice="required"`, which the engine writes under the tools' JSON schema); the point is that the loop trains.
`--record FILE` writes every call's prompt and answer token ids (vLLM's `return_token_ids`) as JSON lines.
"""

from __future__ import annotations

import functools
import sys

import openai
from openai import OpenAI

from gateway.agent_runner import Recorder, Settings, main
from gateway.episode_client import open_episode
from gateway.shop_task import SYSTEM, TOOLS, Task, check, run_tool


@functools.cache
def shared_client() -> OpenAI:
    """One `OpenAI` client for the process's episodes: each episode takes a copy with its own base URL and key
    (`with_options`, ~0.1 ms) that shares its HTTP connection pool. A new client per episode costs ~20 ms of CPU."""
    return OpenAI(base_url="http://127.0.0.1/unused", api_key="unused", max_retries=2)


def play(gateway: str, task: Task, task_id: str, s: Settings, rec: Recorder) -> dict:
    """One episode: think, act (tool calls), observe, until an answer without tool calls or max_turns."""
    with open_episode(gateway, task_id, key=s.key) as ep:
        client = shared_client().with_options(base_url=ep.base_url, api_key=ep.api_key)
        messages: list[dict] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": task.question}]
        answer, calls, answered = "", 0, False
        for turn in range(s.max_turns):
            try:
                r = client.chat.completions.create(
                    model=s.model,
                    messages=messages,
                    tools=TOOLS,
                    max_tokens=s.max_tokens,
                    temperature=s.temperature,
                    tool_choice=s.first_tool_choice if turn == 0 else "auto",
                    extra_body={"return_token_ids": True} if s.record else None,
                )
            except openai.BadRequestError as exc:  # the chat outgrew the model's context: the episode ends here
                if exc.code != "context_length_exceeded" or turn == 0:
                    raise
                turn -= 1
                break
            msg = r.choices[0].message
            messages.append(msg.model_dump(exclude_none=True))  # the answer goes back exactly as it came
            rec.call(ep, task_id, turn, r.model_dump())
            if not msg.tool_calls:
                answer, answered = msg.content or "", True
                break
            for call in msg.tool_calls:
                calls += 1
                messages.append(
                    {
                        "role": "tool",
                        "tool_call_id": call.id,
                        "content": run_tool(call.function.name, call.function.arguments),
                    }
                )
        reward = check(task, answer)
        ep.finish(reward=reward, truncated=not answered)  # truncated: still acting after max_turns
    rec.end(ep, task_id, reward, turn + 1)
    return {"reward": reward, "tool_calls": calls, "steps": turn + 1}


if __name__ == "__main__":
    sys.exit(main(play, "openai-agent", __doc__))
