"""One gateway episode around an agent SDK's run: what examples/openai_agents_sdk.py and examples/langgraph_agent.py
share. The SDK is handed an `openai` HTTP client (httpx2) whose response hook reads every chat completion the
gateway answers: the calls and tool calls are counted there and, with --record, written with their token ids as
examples/openai_agent.py writes them, whatever the SDK keeps of the raw answer. The command line, the shop's tools,
the tasks and the checker are examples/openai_agent.py's.
"""

from __future__ import annotations

import asyncio
import functools
import json
import ssl
from collections.abc import Awaitable, Callable

import httpx2
import openai

from gateway.episode_client import Episode, open_episode
from openai_agent import Play, Recorder, Settings, Task, check


class EpisodeCalls:
    """The chat calls of one episode, as the gateway answered them."""

    def __init__(self, ep: Episode, task_id: str, rec: Recorder):
        self.ep, self.task_id, self.rec = ep, task_id, rec
        self.calls = self.tool_calls = 0
        self.acting = False
        """Whether the latest answer held tool calls (the agent was still acting when its run stopped)."""

    async def on_response(self, response: httpx2.Response) -> None:
        if response.request.method != "POST" or not response.request.url.path.endswith("/chat/completions") \
                or response.status_code != 200:
            return
        body = json.loads(await response.aread())  # read once here; the client reuses the bytes
        self.rec.call(self.ep, self.task_id, self.calls, body)
        names = body["choices"][0]["message"].get("tool_calls") or []
        self.calls, self.tool_calls, self.acting = self.calls + 1, self.tool_calls + len(names), bool(names)

    def http_client(self) -> httpx2.AsyncClient:
        """An HTTP client for the SDK's `openai.AsyncOpenAI` (openai's defaults, plus the hook; the process's TLS
        context: a client that makes its own loads the CA bundle again, ~20 ms of CPU an episode)."""
        return openai.DefaultAsyncHttpxClient(event_hooks={"response": [self.on_response]}, verify=tls_context())


@functools.cache
def tls_context() -> ssl.SSLContext:
    """One TLS context for every HTTP client of the process (the gateway is plain HTTP here; the context is made
    anyway, whenever a client is)."""
    return ssl.create_default_context()


def extra_body(s: Settings) -> dict | None:
    """vLLM's `return_token_ids` when recording: the answer then carries its prompt's and its own token ids."""
    return {"return_token_ids": True} if s.record else None


SdkRun = Callable[[Episode, Task, Settings, EpisodeCalls], Awaitable[str]]
"""An SDK's run of one episode on the episode's gateway URL: returns the final answer's text."""


def play_with(run: SdkRun) -> Play:
    """examples/openai_agent.py's `play` for an SDK: open the episode, run the SDK's agent (its own event loop, in
    the worker thread that plays it), reward the final answer. An answer is final when the last call wrote no tool
    call; an agent stopped at its turn limit while still acting ends the episode truncated, as does a chat that
    outgrew the model's context."""
    def play(gateway: str, task: Task, task_id: str, s: Settings, rec: Recorder) -> dict:
        with open_episode(gateway, task_id, key=s.key) as ep:
            calls = EpisodeCalls(ep, task_id, rec)
            try:
                answer = asyncio.run(run(ep, task, s, calls))
            except openai.BadRequestError as exc:
                if exc.code != "context_length_exceeded" or calls.calls == 0:
                    raise
                answer = ""
            answered = calls.calls > 0 and not calls.acting
            reward = check(task, answer) if answered else 0.0
            ep.finish(reward=reward, truncated=not answered)
        rec.end(ep, task_id, reward, calls.calls)
        return {"reward": reward, "tool_calls": calls.tool_calls, "steps": calls.calls}
    return play
