"""Train on a `verifiers` environment (prime-rl's environment format), unchanged, through the run's gateway.

verifiers runs in a venv of its own (`.cache/verifiers-venv`, made by scripts/setup.sh: verifiers 0.3.1, the last
release with the classic API that published environments use): its dependency set (datasets, mcp, prime-*,
renderers; verifiers 0.4 pins openai<3) stays out of the project's. This program runs there and speaks to the run
only through the gateway's HTTP API (gateway/episode_client.py; --launch and --record are gateway/agent_runner.py's,
as examples/openai_agent.py's are; both are standard library and `openai` only, and come from the checkout this file
sits in when the venv does not install agentstream):

    # One command: start a local run with the gateway and no actors (with .venv's python), then play until it ends
    .cache/verifiers-venv/bin/python examples/verifiers_env.py --env my_env --launch     # run overrides may follow
    # Or against a run that is up (started with gateway.enabled=true; it writes RUN/gateway_url)
    .cache/verifiers-venv/bin/python examples/verifiers_env.py --env my_env --gateway $(cat RUN/gateway_url)

`--env NAME` is loaded by verifiers' own loader, `verifiers.load_environment(NAME, **--env-args)` (a module `NAME`,
dashes as underscores, with a `load_environment(**kwargs)`: installed in the verifiers venv, or in --env-dir). Its
dataset rows are the group seeds: group k plays row k mod rows (task id `<env>/<example_id>#<k>`), G = --group-size
rollouts per group. Each rollout is the environment's own loop, `env.rollout(row, client, model, sampling_args)`
(SingleTurnEnv, MultiTurnEnv, ToolEnv, ...: its system prompt, parser, tools and turn limit), with verifiers' own
chat-completions client on the rollout's gateway episode; every model call it makes is one step of that episode.
Once the G rollouts ended, the env's rubric scores them together (`env.rubric.score_group`, as verifiers'
`generate` does) and each episode finishes with its rollout's reward.

Failures outside the model never crash the runner and never train: a rollout that raised or made no model call, a
model call the gateway or an engine failed, a rubric that raised, a reward function that raised (verifiers scores
it 0 and logs an error; that log line is heard here), a reward that is not a finite number: the group is given up
(`POST /episodes/<id>/abandon`), dropped whole at once and counted (the gateway's `gateway_episodes_abandoned`, the
broker's `transitions_dropped_infra_agent_failed`), and the run goes on. An answer that is the model's own (empty,
unparseable, a bad tool call) is not a failure: the rubric scores it.

An environment of verifiers' new API (`verifiers.v1`: `--env` names a module whose `__all__` exports a `vf.Taskset`,
or one of verifiers' own tasksets such as textarena) is played on the same groups and rules: each episode is the env's
own `Env.run_episode(task, ctx)`, its harness's calls going through verifiers' interception server and `EvalClient`
to the episode's gateway URL, and it finishes with its trace's reward (the Task's `@vf.reward`s). `--env-args` is
then the taskset's config, `--env-config` verifiers' env config over what the runner sets (V1Game says what).

An episode ends truncated when its rollout stopped while the model was still calling tools (the env's max_turns),
outgrew the engines' context, or ran past the env's timeout. `--first-tool-choice required` forces each rollout's
first call to be a tool call (a tiny random model writes none by itself); the env is otherwise untouched. `--record
FILE` writes every call's prompt and answer token ids (vLLM's `return_token_ids`) and each episode's end as JSON
lines, as examples/openai_agent.py does.
"""

from __future__ import annotations

import argparse
import asyncio
import contextvars
import copy
import functools
import importlib.util
import itertools
import json
import logging
import math
import signal
import sys
import time
import types
import urllib.error
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

if importlib.util.find_spec("gateway") is None:  # the verifiers venv does not install the project: this checkout's
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # gateway/ (standard library and openai only)

try:
    import openai
    import verifiers as vf
    import verifiers.v1 as vf1
    from openai import AsyncOpenAI
    from verifiers.clients import OpenAIChatCompletionsClient
    from verifiers.v1.dialects.chat import message_to_wire
    from verifiers.v1.utils.generic import deep_merge
    from verifiers.v1.utils.loaders import default_harness_id, env_config_type, load_environment, resolve_env_config
except ImportError as exc:  # run with the project's python, or the verifiers venv is missing
    raise SystemExit(
        f"[verifiers] {exc}: run this with the verifiers venv's python, "
        f".cache/verifiers-venv/bin/python (bash scripts/setup.sh makes it)"
    ) from None

try:
    from gateway.agent_runner import ROOT, Recorder, end_launch, launch, wait_for_url
    from gateway.episode_client import Episode, GatewayError, open_episode
except ModuleNotFoundError as exc:  # a copy of this file, away from the checkout
    raise SystemExit(
        f"[verifiers] {exc}: agentstream's gateway/ is not importable in this venv; run this file from "
        "the checkout's examples/, or with PYTHONPATH=<the checkout>"
    ) from None

T = TypeVar("T")
GONE = (urllib.error.URLError, ConnectionError, openai.APIConnectionError)
"""The gateway stopped answering: the run ended (or the gateway is down)."""


@dataclass
class Settings:
    model: str = "policy"
    max_tokens: int | None = None
    """None: the env's sampling_args, else the run's sampling.max_tokens."""
    temperature: float | None = None
    first_tool_choice: str = "auto"
    record: Path | None = None
    key: str = ""  # the run's gateway key (its gateway.key_file), if it has one
    request_timeout_s: float = 120.0


@dataclass
class Tally:
    """What the runner played: finished episodes, and the groups it gave up by why."""

    rewards: list[float] = field(default_factory=list)
    calls: int = 0
    tool_calls: int = 0
    truncated: int = 0
    abandoned: Counter[str] = field(default_factory=Counter)
    lost: int = 0
    """Episodes the gateway no longer had open when finished or given up (it restarted, or dropped their group
    meanwhile): not played again."""


# ------------------------------------------------------------------------------------------------ reward failures
REWARD_ERRORS: contextvars.ContextVar[list[str] | None] = contextvars.ContextVar("reward_errors", default=None)
"""The reward-function errors verifiers logged while the current group was being scored (None outside scoring)."""
VERIFIERS_REWARD_ERROR = ("Error calling reward function", "Error calling group reward function")
"""How verifiers' Rubric logs a reward function that raised (it then scores it 0.0)."""


class RewardErrors(logging.Handler):
    """Hears verifiers' Rubric log a reward function that raised. Groups are scored concurrently on one event loop:
    the context variable says which group's scoring a record belongs to (asyncio copies it into the scoring's
    subtasks), so a failure is charged to its own group only."""

    def emit(self, record: logging.LogRecord) -> None:
        errors = REWARD_ERRORS.get()
        if errors is not None and record.levelno >= logging.ERROR:
            message = record.getMessage()
            if message.startswith(VERIFIERS_REWARD_ERROR):
                errors.append(message)


# ------------------------------------------------------------------------------------------------ the client
class EpisodeClient(OpenAIChatCompletionsClient):
    """verifiers' own chat-completions client, on one gateway episode's URL. Besides what verifiers does with each
    call, it counts the calls and tool calls, forces the first call's `tool_choice` (--first-tool-choice) and writes
    every answer with its token ids (--record)."""

    def __init__(self, ep: Episode, task_id: str, http: Any, s: Settings, rec: Recorder):
        super().__init__(
            AsyncOpenAI(
                base_url=ep.base_url, api_key=ep.api_key, http_client=http, max_retries=0, timeout=s.request_timeout_s
            )
        )
        self.ep, self.task_id, self.s, self.rec = ep, task_id, s, rec
        self.calls = self.tool_calls = 0
        self.acting = False
        """Whether the latest answer held tool calls (the model was still acting when the rollout stopped)."""

    async def get_native_response(
        self, prompt: Any, model: str, sampling_args: dict, tools: Any = None, **kwargs: Any
    ) -> Any:
        if tools and self.calls == 0 and self.s.first_tool_choice != "auto":
            sampling_args = {**sampling_args, "tool_choice": self.s.first_tool_choice}
        response = await super().get_native_response(prompt, model, sampling_args, tools, **kwargs)
        body = response.model_dump()
        choice = body["choices"][0]
        names = [c["function"]["name"] for c in choice["message"].get("tool_calls") or []]
        self.rec.write(
            {
                "episode": self.ep.id,
                "task_id": self.task_id,
                "group_id": self.ep.group_id,
                "turn": self.calls,
                "prompt_token_ids": body.get("prompt_token_ids"),
                "token_ids": choice.get("token_ids"),
                "tool_calls": names,
                "finish_reason": choice.get("finish_reason"),
                "content": choice["message"].get("content"),
            }
        )
        self.calls, self.tool_calls, self.acting = self.calls + 1, self.tool_calls + len(names), bool(names)
        return response

    async def close(self) -> None:
        """Nothing: the HTTP client is shared by every episode, and closed once at the end."""


# ------------------------------------------------------------------------------------------------ judging a group
def causes(exc: BaseException | None) -> list[BaseException]:
    """`exc` and what it was raised from."""
    out: list[BaseException] = []
    while exc is not None and exc not in out:
        out.append(exc)
        exc = exc.__cause__ or exc.__context__
    return out


def outgrew_context(err: BaseException | None) -> bool:
    """The gateway refused a call whose prompt no longer fit the engines' context (400 context_length_exceeded)."""
    return any(isinstance(e, openai.BadRequestError) and e.code == "context_length_exceeded" for e in causes(err))


def rollout_failure(state: Any, client: EpisodeClient) -> str | None:
    """Why a rollout failed for reasons outside the model (a `kind: detail` text), or None. An error that is the
    model's own answer (empty, invalid; verifiers' InvalidModelResponseError) or a chat that outgrew the context
    ends the rollout normally."""
    if isinstance(state, BaseException):
        return f"rollout_raised: {type(state).__name__}: {state}"
    if client.calls == 0:
        return f"no_call: the rollout made no model call ({state.get('error')!r})"
    err = state.get("error")
    if err is None or isinstance(err, vf.InvalidModelResponseError) or outgrew_context(err):
        return None
    if isinstance(err, (vf.ModelError, vf.InfraError)):
        return f"model_call_failed: {type(err).__name__}: {causes(err)[-1]!r}"
    return None  # the env's own stop on an error (a tool error it was told to stop on, ...): its rubric scores it


async def score(env: Any, states: list[Any]) -> str | None:
    """Score the group with the env's rubric, as verifiers does (`score_group`, then each state's cleanup); why the
    scores cannot be trained on (a `kind: detail` text), or None."""
    errors: list[str] = []
    token = REWARD_ERRORS.set(errors)
    try:
        if env.score_rollouts:
            await env.rubric.score_group(states)
        else:
            await env.rubric.dummy_score_group(states)
        for state in states:
            await env.rubric.cleanup(state)
    except Exception as exc:  # a rubric of the env's is arbitrary code: whatever it raises, the run goes on
        return f"rubric_raised: {type(exc).__name__}: {exc}"
    finally:
        REWARD_ERRORS.reset(token)
    if errors:
        return f"reward_function_raised: {errors[0]}"
    for state in states:
        reward = state.get("reward")
        if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
            return f"reward_not_finite: {reward!r}"
    return None


def truncated(state: Any, client: EpisodeClient) -> bool:
    """The rollout stopped before its natural end: still calling tools at the env's max_turns, a chat that outgrew
    the context, or the env's timeout."""
    return bool(
        state.get("timed_out")
        or state.get("prompt_too_long")
        or outgrew_context(state.get("error"))
        or (state.get("stop_condition") == "max_turns_reached" and client.acting)
    )


# ------------------------------------------------------------------------------------------------ verifiers.v1
V1_HARNESS = "agentstream_chat"
"""ChatHarness's id: verifiers imports a harness by id (see register_chat_harness)."""
V1_CALLS = "agentstream_calls"
"""`trace.info` key where ChatHarness keeps each call's token ids and answer, for the runner's --record."""
V1_KEY_VAR = "AGENTSTREAM_EPISODE_KEY"
"""The env var verifiers reads the API key from; unset (sent as "EMPTY"): an episode's URL carries its key."""
V1_LIMITS = ("max_turns", "max_input_tokens", "max_output_tokens", "max_total_tokens", "context_length")
"""verifiers' stop conditions of a rollout cut short by a framework limit: such an episode ends truncated."""
V1_MODEL_ERRORS = ("ProviderError", "InterceptionError")


class ChatHarness(vf1.Harness[vf1.HarnessConfig]):
    """A tool-less chat seat, in this process: one chat-completions call on the conversation so far, as verifiers'
    `null` harness program makes, without the program (and the `uv` provisioning that needs the package index).
    Each segment relaunches on the whole conversation (`SUPPORTS_RESUME`: verifiers' default `resume`), so a
    multi-turn env's later calls carry the earlier answers exactly as the gateway returned them."""

    APPENDS_SYSTEM_PROMPT = True
    SUPPORTS_RESUME = True
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(
        self,
        ctx: vf1.ModelContext,
        trace: vf1.Trace,
        runtime: vf1.Runtime,
        endpoint: str,
        secret: str,
        mcp_urls: dict[str, str],
        data: vf1.TaskData,
    ) -> vf1.ProgramResult:
        system, prompt = self.resolve_prompt(data)
        messages: list[dict] = [{"role": "system", "content": system}] if system else []
        if isinstance(prompt, str):
            messages.append({"role": "user", "content": prompt})
        else:
            messages.extend(message_to_wire(m) for m in prompt or [])
        # The interception server holds the real error (the gateway's, an engine's) and the rollout records it;
        # a refused turn (a limit, a @stop) is verifiers' stop condition. Either way: exit non-zero, as a program.
        timeout = Settings.request_timeout_s  # a call past it fails the rollout (given up), as a classic one does
        async with openai.AsyncOpenAI(base_url=endpoint, api_key=secret, max_retries=0, timeout=timeout) as client:
            try:
                completion = await client.chat.completions.create(model=ctx.model, messages=messages)
            except openai.APIConnectionError as exc:  # no answer in time (a timeout is one): the model call failed
                raise vf1.ProviderError(f"no answer from the interception server: {exc!r}", status_code=504) from exc
            except openai.APIError as exc:
                return vf1.ProgramResult(exit_code=1, stdout="", stderr=f"{type(exc).__name__}: {exc}")
        body = completion.model_dump()
        choice = body["choices"][0]
        trace.info.setdefault(V1_CALLS, []).append(
            {
                "prompt_token_ids": body.get("prompt_token_ids"),
                "token_ids": choice.get("token_ids"),
                "tool_calls": [c["function"]["name"] for c in choice["message"].get("tool_calls") or []],
                "finish_reason": choice.get("finish_reason"),
                "content": choice["message"].get("content"),
            }
        )
        return vf1.ProgramResult(exit_code=0, stdout="", stderr="")


def register_chat_harness() -> None:
    """verifiers loads a harness by id: it imports the module of that name and takes the one Harness subclass its
    `__all__` exports (`verifiers/v1/utils/loaders.py`). ChatHarness lives in this script, so it gets a module of
    its own name."""
    module = types.ModuleType(V1_HARNESS, ChatHarness.__doc__)
    module.ChatHarness, module.__all__ = ChatHarness, ["ChatHarness"]  # type: ignore[attr-defined]
    sys.modules.setdefault(V1_HARNESS, module)


class V1Game:
    """A v1 env's tasks, played in groups: group k plays task k mod tasks, G episodes of it, each on its own
    gateway episode; `workers` envs, one per concurrent group (an env serves one group at a time).

    How a v1 episode reaches the gateway, in verifiers' own code (0.3.1): `Env.run_episode(task, ctx)` plays the
    env's `run()`; each seat's harness calls verifiers' interception server (localhost aiohttp,
    `verifiers/v1/interception/server.py`), which sends every model call upstream through the rollout's client:
    `EvalClient` for a `vf.EvalClientConfig`, an httpx relay to any OpenAI-compatible `base_url`
    (`verifiers/v1/clients/eval.py`). So each episode gets a `ModelContext` whose client is its gateway URL, and each
    call its harness makes is one step of that episode. verifiers' trainer path (`vf.TrainClientConfig`: prompts
    rendered client-side for vLLM's `/inference/v1/generate`) is not used: the gateway renders.

    One trainable trajectory per episode: an env with more than one seat (a judge, a second player) is refused; an
    episode that ran its seat more than once (best-of-n) is given up. v1 rewards are per trace (`@vf.reward` on the
    Task, `trace.record_reward` in the env's `run()`/`finalize()`); no group rubric."""

    def __init__(self, name: str, taskset_args: dict, env_config: dict, num_examples: int, workers: int):
        register_chat_harness()
        config = resolve_env_config(deep_merge(v1_defaults(name), {"taskset": taskset_args} | env_config))
        seats = [n for n, f in type(config).model_fields.items() if isinstance(f.default, vf1.AgentConfig)]
        if len(seats) != 1:
            raise SystemExit(
                f"[verifiers] {name}: its env declares {len(seats)} seats ({', '.join(seats)}); the runner trains "
                "envs with one (each episode is one trajectory of the policy)"
            )
        self.name, self.seat, self.config = name, seats[0], config
        pool = [load_environment(config) for _ in range(workers)]
        self.env = pool[0]  # (its taskset gives the tasks)
        self.envs: asyncio.Queue[vf1.Env] = asyncio.Queue()
        for env in pool:
            self.envs.put_nowait(env)
        taskset = self.env.taskset
        if taskset.INFINITE and num_examples < 0:
            raise SystemExit(f"[verifiers] {name} is an infinite taskset: bound it with --num-examples N")
        self.tasks = list(taskset.head(num_examples) if num_examples >= 0 else taskset)
        if not self.tasks:
            raise SystemExit(f"[verifiers] {name}: its taskset holds no tasks")

    def describe(self) -> str:
        harness = (getattr(self.config, self.seat).harness or vf1.default_agent_harness(self.name)).id
        return f"v1 {type(self.env).__name__} (seat {self.seat!r}, harness {harness!r}), {len(self.tasks)} tasks"

    def label(self, k: int) -> str:
        """Group k's task id at the gateway."""
        task = self.tasks[k % len(self.tasks)]
        idx = task.data.idx if task.data.idx is not None else task.key[:12]
        return f"{self.name}/{idx}#{k}"

    async def play(self, k: int, base_urls: list[str], model: str, sampling: dict) -> tuple[str | None, list[dict]]:
        """Group k's G episodes, one per gateway episode URL: why the group cannot be trained on, or each
        episode's end (reward, truncated, steps, tool_calls, stop_condition, metrics, calls)."""
        task = self.tasks[k % len(self.tasks)]
        ctxs = [
            vf1.ModelContext(
                model=model,
                client=vf1.EvalClientConfig(base_url=url, api_key_var=V1_KEY_VAR),
                sampling=vf1.Sampling(**sampling),
            )
            for url in base_urls
        ]
        env = await self.envs.get()
        try:
            async with env.serving():
                episodes = await asyncio.gather(*(env.run_episode(task, c) for c in ctxs), return_exceptions=True)
        finally:
            self.envs.put_nowait(env)
        why = next((w for w in map(v1_failure, episodes) if w), None)
        return (why, []) if why else (None, [v1_end(e) for e in episodes])  # type: ignore[arg-type]


def v1_defaults(name: str) -> dict:
    """The env config the runner starts from (`--env-config` is merged over it, as verifiers' `[env]` block):
    - each seat's runtime is `subprocess`: verifiers' default, `prime`, is a remote sandbox that needs Prime's API key
      and a tunnel back to the interception server;
    - a seat gets ChatHarness unless the taskset ships a harness: verifiers' fallback, `bash`, and every built-in
      harness are PEP 723 programs provisioned with `uv sync --script` from the package index (after `pip install
      --user uv` when uv is missing: `verifiers/v1/runtimes/base.py`, `prepare_uv_script`), which an offline machine
      cannot do; choose one with `--env-config '{"agent": {"harness": {"id": "null"}}}'`;
    - one interception `server`, up per group (`Env.serving()`), so a group's G model clients (one per episode URL)
      close with it."""
    seat: dict[str, Any] = {"runtime": {"type": "subprocess"}}
    if default_harness_id(name) == "bash":  # verifiers' fallback: the taskset ships no harness
        seat["harness"] = {"id": V1_HARNESS}
    cls = env_config_type(name)
    seats = {n: seat for n, f in cls.model_fields.items() if isinstance(f.default, vf1.AgentConfig)}
    return {"taskset": {"id": name}, "interception": {"type": "server"}, **seats}


def v1_failure(episode: vf1.Episode | BaseException) -> str | None:
    """Why an episode cannot be trained on (a `kind: detail` text), or None. A model's own answer (empty, cut at
    max_tokens, a refused turn) is not a failure: the task's rewards score it."""
    if isinstance(episode, BaseException):
        return f"rollout_raised: {type(episode).__name__}: {episode}"
    if episode.errors:  # the env's run() or finalize() raised
        return f"rollout_raised: {episode.errors[-1].type}: {episode.errors[-1].message}"
    if len(episode.traces) != 1:
        return f"episode_traces: the episode ran its seat {len(episode.traces)} times (one trajectory each is needed)"
    trace = episode.traces[0]
    err = trace.last_error
    if not trace.ok and err is not None:
        if err.type in V1_MODEL_ERRORS:
            return f"model_call_failed: {err.type}: {err.message}"
        if err.type == "TaskError" and "scoring" in err.message:
            return f"reward_function_raised: {err.message}"
        return f"rollout_raised: {err.type}: {err.message}"
    if trace.num_turns == 0:
        return f"no_call: the rollout made no model call (stop: {trace.stop_condition})"
    reward = trace.reward
    if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
        return f"reward_not_finite: {reward!r}"
    return None


def v1_end(episode: vf1.Episode) -> dict:
    """A trained episode's end, from its one trace."""
    trace = episode.traces[0]
    return {
        "reward": float(trace.reward),
        "truncated": trace.stop_condition in V1_LIMITS,
        "steps": trace.num_turns,
        "tool_calls": sum(len(m.tool_calls or []) for m in trace.assistant_messages),
        "stop_condition": trace.stop_condition,
        "metrics": {n: float(v) for n, v in trace.metrics.items() if v is not None}
        | {n: r.score for n, r in trace.rewards.items() if r is not None},
        "calls": trace.info.get(V1_CALLS, []),
    }


# ------------------------------------------------------------------------------------------------ the runner
class Runner:
    """Plays groups of an environment's rollouts against a gateway, `concurrency` groups at a time: a classic env's
    rows (`env`, `rows`), or a v1 env's tasks (`v1`)."""

    def __init__(
        self, env: Any, env_id: str, rows: list[dict], gateway: str, group_size: int, s: Settings, v1: Any = None
    ):
        self.env, self.env_id, self.rows, self.gateway, self.G, self.s = env, env_id, rows, gateway, group_size, s
        self.v1 = v1
        self.rec = Recorder(s.record)
        self.tally = Tally()
        self.sampling = copy.deepcopy(env.sampling_args) if v1 is None else {}  # as verifiers' generate: the env's,
        extra = dict(self.sampling.get("extra_body") or {})  # then the caller's
        if s.record:
            extra["return_token_ids"] = True  # vLLM's: the answer carries its prompt's and its own token ids
        self.sampling["extra_body"] = extra
        if s.max_tokens is not None:
            self.sampling["max_tokens"] = s.max_tokens
        if s.temperature is not None:
            self.sampling["temperature"] = s.temperature
        self.http = openai.DefaultAsyncHttpxClient()
        self.pool: ThreadPoolExecutor | None = None

    async def blocking(self, fn: Callable[..., T], *args: Any) -> T:
        """The episode API (urllib) in a thread of the runner's own: opening may wait minutes for admission, and a
        shared pool could let waiting opens starve the finishes that the admission waits for."""
        return await asyncio.get_running_loop().run_in_executor(self.pool, functools.partial(fn, *args))

    def open_group(self, task_id: str) -> list[Episode]:
        return [open_episode(self.gateway, task_id, key=self.s.key) for _ in range(self.G)]

    async def play_group(self, k: int) -> None:
        """Group k: G rollouts of row (or v1 task) k mod rows, scored, then finished or given up."""
        if self.v1 is not None:
            task_id = self.v1.label(k)
        else:
            row = self.rows[k % len(self.rows)]
            task_id = f"{self.env_id}/{row.get('example_id', k % len(self.rows))}#{k}"
        eps = await self.blocking(self.open_group, task_id)
        if self.v1 is not None:
            why, ends = await self.v1.play(k, [ep.base_url for ep in eps], self.s.model, self.sampling)
        else:
            why, ends = await self.play_rows(row, task_id, eps)
        if why is not None:
            print(f"[verifiers] group {eps[0].group_id} ({task_id}) given up: {why}", flush=True)
            self.tally.abandoned[why.split(":", 1)[0]] += 1
            if not (await self.blocking(self.settle, [functools.partial(eps[0].abandon, why)]))[0]:
                self.tally.lost += len(eps)
                return
            for ep in eps:
                self.rec.write({"episode": ep.id, "task_id": task_id, "group_id": ep.group_id, "abandoned": why})
            return
        ended = await self.blocking(
            self.settle,
            [functools.partial(ep.finish, reward=e["reward"], truncated=e["truncated"]) for ep, e in zip(eps, ends)],
        )
        for ep, e, ok in zip(eps, ends, ended):
            if not ok:
                self.tally.lost += 1
                continue
            for turn, call in enumerate(e.pop("calls", [])):  # a v1 episode's calls, as its harness saw them
                self.rec.write({"episode": ep.id, "task_id": task_id, "group_id": ep.group_id, "turn": turn, **call})
            self.rec.write({"episode": ep.id, "task_id": task_id, "group_id": ep.group_id, **e})
            self.tally.rewards.append(e["reward"])
            self.tally.calls += e["steps"]
            self.tally.tool_calls += e["tool_calls"]
            self.tally.truncated += e["truncated"]

    async def play_rows(self, row: dict, task_id: str, eps: list[Episode]) -> tuple[str | None, list[dict]]:
        """A classic env's G rollouts of `row` (the env's own loop), scored together by its rubric: why the group
        cannot be trained on, or each episode's end."""
        clients = [EpisodeClient(ep, task_id, self.http, self.s, self.rec) for ep in eps]
        states = await asyncio.gather(
            *(self.env.rollout(copy.deepcopy(row), c, self.s.model, self.sampling) for c in clients),
            return_exceptions=True,
        )
        why = next((w for w in map(rollout_failure, states, clients) if w), None) or await score(self.env, states)
        if why is not None:
            return why, []
        return None, [
            {
                "reward": float(state["reward"]),
                "steps": client.calls,
                "truncated": truncated(state, client),
                "stop_condition": state.get("stop_condition"),
                "metrics": {name: float(v) for name, v in (state.get("metrics") or {}).items()},
                "tool_calls": client.tool_calls,
            }
            for state, client in zip(states, clients)
        ]

    def settle(self, ends: list[Callable[[], Any]]) -> list[bool]:
        """Each episode's finish or abandon, in a runner thread; False for one the gateway no longer has open (it
        restarted, or dropped the group meanwhile: counted there), which costs that episode only."""
        out = []
        for end in ends:
            try:
                end()
                out.append(True)
            except GatewayError as exc:
                if exc.status not in (404, 409, 410):
                    raise
                out.append(False)
        return out

    async def run(self, groups: int, concurrency: int, stop: asyncio.Event) -> Tally:
        """`groups` groups (0: until the gateway goes away or `stop`), `concurrency` at a time."""
        counter = iter(range(groups)) if groups else itertools.count()
        gone = asyncio.Event()

        async def worker() -> None:
            while not (stop.is_set() or gone.is_set()):
                k = next(counter, None)
                if k is None:
                    return
                try:
                    await self.play_group(k)
                except GONE as exc:
                    gone.set()
                    print(f"[verifiers] the gateway stopped answering ({exc.__class__.__name__}); stopping", flush=True)
                except GatewayError as exc:
                    gone.set()
                    print(f"[verifiers] the gateway refused: {exc}; stopping", flush=True)

        self.pool = ThreadPoolExecutor(concurrency, thread_name_prefix="episode-api")
        try:
            async with asyncio.TaskGroup() as tg:
                for _ in range(concurrency):
                    tg.create_task(worker())
        finally:
            self.pool.shutdown(wait=False, cancel_futures=True)
            await self.http.aclose()
        return self.tally


# ------------------------------------------------------------------------------------------------ one command
def load_env(name: str, env_args: dict) -> Any:
    """The environment, by verifiers' own loader (its module's `load_environment(**env_args)`)."""
    import datasets

    datasets.disable_progress_bars()  # the env's dataset.map calls: noise in a run's log
    env = vf.load_environment(name, **env_args)
    # After loading: verifiers' setup_logging (run as its classic API loads, or by the env) clears its logger's
    # handlers. Its Rubric logs a raising reward function at ERROR, which any VF_LOG_LEVEL up to ERROR lets through.
    logging.getLogger("verifiers").addHandler(RewardErrors())
    return env


def v1_taskset(name: str) -> bool:
    """Whether `name` is a taskset of verifiers' new API (`verifiers.v1`): one of verifiers' own
    (`verifiers/v1/tasksets/`), or a module whose `__all__` exports a `verifiers.v1.Taskset` subclass (it is
    imported here, as either loader would)."""
    module = name.rsplit("/", 1)[-1].split("@", 1)[0].replace("-", "_").lower()
    if (Path(vf.__file__).parent / "v1" / "tasksets" / module).exists():
        return True
    if importlib.util.find_spec(module) is None:
        return False  # the classic loader says what is missing
    found = importlib.import_module(module)
    exported = [getattr(found, n, None) for n in getattr(found, "__all__", ())]
    return any(isinstance(o, type) and issubclass(o, vf1.Taskset) for o in exported)


def load(args: argparse.Namespace, env_args: dict, env_config: dict) -> tuple[Any, list[dict], Any, str]:
    """The env's rows (classic) or its v1 game, and what it is, in words."""
    if args.env_dir is not None:
        sys.path.insert(0, str(args.env_dir.resolve()))
    if v1_taskset(args.env):
        game = V1Game(args.env, env_args, env_config, args.num_examples, args.concurrency)
        return None, [], game, game.describe()
    if env_config:
        raise SystemExit(f"[verifiers] --env-config is for a v1 env (verifiers.v1); {args.env} is a classic one")
    env = load_env(args.env, env_args)
    rows = dataset_rows(env, args.split, args.num_examples)
    return env, rows, None, f"{type(env).__name__}, {len(rows)} rows"


def dataset_rows(env: Any, split: str, n: int) -> list[dict]:
    """The env's rows (`example_id`, `prompt` with the env's system prompt, `answer`, `info`, ...) as verifiers'
    generate takes them."""
    dataset = env.get_eval_dataset(n=n) if split == "eval" else env.get_dataset(n=n)
    rows = dataset.to_list()
    if not rows:
        raise SystemExit(f"[verifiers] the env's {split} dataset is empty")
    return rows


def arguments() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--env",
        required=True,
        help="the environment: a module with load_environment(**kwargs), or a v1 taskset (verifiers.v1)",
    )
    p.add_argument(
        "--env-args", default="{}", help="load_environment's keyword arguments (v1: the taskset's config), as JSON"
    )
    p.add_argument(
        "--env-config",
        default="{}",
        help="v1 only: verifiers' env config ([env]: seats' harness, runtime, max_turns), as JSON, over the runner's",
    )
    p.add_argument("--env-dir", type=Path, default=None, help="a folder that holds the env's module (if not installed)")
    p.add_argument("--split", default="train", choices=("train", "eval"), help="the env's dataset to take rows from")
    p.add_argument("--num-examples", type=int, default=-1, help="rows to use (-1: all)")
    p.add_argument("--gateway", default="", help="a run's gateway URL (RUN/gateway_url)")
    p.add_argument("--launch", action="store_true", help="start a local run (scripts/launch.py) and play against it")
    p.add_argument(
        "--launcher-python",
        default=str(ROOT / ".venv" / "bin" / "python"),
        help="with --launch: the project's python, which runs scripts/launch.py",
    )
    p.add_argument(
        "--episodes",
        type=int,
        default=None,
        help="episodes to play (a multiple of --group-size; 0: until the run ends; default 16, with --launch 0)",
    )
    p.add_argument("--group-size", type=int, default=4, help="rollouts per row and group (the run's env.group_size)")
    p.add_argument("--concurrency", type=int, default=2, help="groups at a time")
    p.add_argument("--max-tokens", type=int, default=None, help="per call (default: the env's, else the run's)")
    p.add_argument("--temperature", type=float, default=None, help="(default: the env's, else 1.0)")
    p.add_argument(
        "--first-tool-choice",
        default="auto",
        choices=("auto", "required"),
        help="tool_choice of each rollout's first call when the env has tools (required: act first)",
    )
    p.add_argument("--model", default="policy", help="the model name sent (the gateway serves the run's policy)")
    p.add_argument("--record", type=Path, default=None, help="write every call's token ids here (JSON lines)")
    p.add_argument("--key-file", type=Path, default=None, help="the run's gateway key file (gateway.key_file), if any")
    p.add_argument("overrides", nargs="*", help="with --launch: run config overrides (key=value)")
    return p


def main() -> int:
    p = arguments()
    args = p.parse_args()
    episodes = args.episodes if args.episodes is not None else (0 if args.launch else 16)
    if episodes % args.group_size or episodes < 0:
        p.error(f"--episodes={episodes} must be a multiple of --group-size={args.group_size} (whole groups)")
    if bool(args.gateway) == args.launch:
        p.error("give either --gateway URL (a run that is up) or --launch (start one here)")
    try:
        env_args = json.loads(args.env_args)
    except ValueError as exc:
        p.error(f"--env-args is not JSON: {exc}")
    if not isinstance(env_args, dict):
        p.error("--env-args must be a JSON object")
    try:
        env_config = json.loads(args.env_config)
    except ValueError as exc:
        p.error(f"--env-config is not JSON: {exc}")
    if not isinstance(env_config, dict):
        p.error("--env-config must be a JSON object")
    key = args.key_file.read_text().splitlines()[0].strip() if args.key_file else ""
    s = Settings(args.model, args.max_tokens, args.temperature, args.first_tool_choice, args.record, key)
    proc, gateway = None, args.gateway
    if args.launch:  # started first: the run comes up while verifiers loads the env (seconds of imports)
        run_dir = ROOT / "runs" / f"verifiers-{time.strftime('%Y%m%d-%H%M%S')}"
        run_dir = Path(next((o.split("=", 1)[1] for o in args.overrides if o.startswith("run.output_dir=")), run_dir))
        proc = launch(
            [o for o in args.overrides if not o.startswith("run.output_dir=")],
            args.group_size,
            run_dir,
            python=args.launcher_python,
        )
    try:
        env, rows, v1, what = load(args, env_args, env_config)
        print(f"[verifiers] {args.env}: {what}, groups of {args.group_size}", flush=True)
        if proc is not None:
            gateway = wait_for_url(run_dir, proc)
    except BaseException:  # a broken env (or Ctrl-C): the run started for it stops too
        if proc is not None:
            proc.send_signal(signal.SIGINT)
            proc.wait()
        raise
    print(f"[verifiers] playing against {gateway}", flush=True)
    t0 = time.monotonic()
    tally, stopped = asyncio.run(
        play(
            Runner(env, args.env, rows, gateway, args.group_size, s, v1), episodes // args.group_size, args.concurrency
        )
    )
    wall = time.monotonic() - t0
    code = 0 if proc is None else end_launch(proc, stopped, "verifiers")
    n = len(tally.rewards)
    mean = sum(tally.rewards) / n if n else 0.0
    given_up = sum(tally.abandoned.values())
    print(
        f"[verifiers] {n} episodes in {wall:.1f}s ({n / wall if wall else 0.0:.2f} rollouts/s): mean reward "
        f"{mean:.3f}, {tally.calls} model calls, {tally.tool_calls} tool calls, {tally.truncated} truncated; "
        f"{given_up} groups given up {dict(tally.abandoned)}, {tally.lost} episodes lost",
        flush=True,
    )
    return code


async def play(runner: Runner, groups: int, concurrency: int) -> tuple[Tally, bool]:
    """The runner on this event loop: what it played, and whether a signal stopped it. SIGTERM and SIGINT stop it
    after the groups in flight (verifiers' Environment installs handlers of its own that exit at once: these
    replace them)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    tally = await runner.run(groups, concurrency, stop)
    return tally, stop.is_set()


if __name__ == "__main__":
    sys.exit(main())
