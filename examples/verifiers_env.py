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
    from openai import AsyncOpenAI
    from verifiers.clients import OpenAIChatCompletionsClient
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


# ------------------------------------------------------------------------------------------------ the runner
class Runner:
    """Plays groups of an environment's rollouts against a gateway, `concurrency` groups at a time."""

    def __init__(self, env: Any, env_id: str, rows: list[dict], gateway: str, group_size: int, s: Settings):
        self.env, self.env_id, self.rows, self.gateway, self.G, self.s = env, env_id, rows, gateway, group_size, s
        self.rec = Recorder(s.record)
        self.tally = Tally()
        self.sampling = copy.deepcopy(env.sampling_args)  # as verifiers' generate: the env's, then the caller's
        extra = dict(self.sampling.get("extra_body") or {})
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
        """Group k: row k mod rows, G rollouts of the env's own loop, scored together, finished or given up."""
        row = self.rows[k % len(self.rows)]
        task_id = f"{self.env_id}/{row.get('example_id', k % len(self.rows))}#{k}"
        eps = await self.blocking(self.open_group, task_id)
        clients = [EpisodeClient(ep, task_id, self.http, self.s, self.rec) for ep in eps]
        states = await asyncio.gather(
            *(self.env.rollout(copy.deepcopy(row), c, self.s.model, self.sampling) for c in clients),
            return_exceptions=True,
        )
        why = next((w for w in map(rollout_failure, states, clients) if w), None) or await score(self.env, states)
        if why is not None:
            print(f"[verifiers] group {eps[0].group_id} ({task_id}) given up: {why}", flush=True)
            self.tally.abandoned[why.split(":", 1)[0]] += 1
            if not (await self.blocking(self.settle, [functools.partial(eps[0].abandon, why)]))[0]:
                self.tally.lost += len(eps)
                return
            for ep in eps:
                self.rec.write({"episode": ep.id, "task_id": task_id, "group_id": ep.group_id, "abandoned": why})
            return
        rewards, cuts = [float(st["reward"]) for st in states], list(map(truncated, states, clients))
        ended = await self.blocking(
            self.settle, [functools.partial(ep.finish, reward=r, truncated=t) for ep, r, t in zip(eps, rewards, cuts)]
        )
        for ep, client, state, reward, cut, ok in zip(eps, clients, states, rewards, cuts, ended):
            if not ok:
                self.tally.lost += 1
                continue
            metrics = {name: float(v) for name, v in (state.get("metrics") or {}).items()}
            self.rec.write(
                {
                    "episode": ep.id,
                    "task_id": task_id,
                    "group_id": ep.group_id,
                    "reward": reward,
                    "steps": client.calls,
                    "truncated": cut,
                    "stop_condition": state.get("stop_condition"),
                    "metrics": metrics,
                }
            )
            self.tally.rewards.append(reward)
            self.tally.calls += client.calls
            self.tally.tool_calls += client.tool_calls
            self.tally.truncated += cut

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
def load_env(name: str, env_args: dict, env_dir: Path | None) -> Any:
    """The environment, by verifiers' own loader (its module's `load_environment(**env_args)`)."""
    if env_dir is not None:
        sys.path.insert(0, str(env_dir.resolve()))
    import datasets

    datasets.disable_progress_bars()  # the env's dataset.map calls: noise in a run's log
    env = vf.load_environment(name, **env_args)
    # After loading: verifiers' setup_logging (run as its classic API loads, or by the env) clears its logger's
    # handlers. Its Rubric logs a raising reward function at ERROR, which any VF_LOG_LEVEL up to ERROR lets through.
    logging.getLogger("verifiers").addHandler(RewardErrors())
    return env


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
    p.add_argument("--env", required=True, help="the environment: a module with load_environment(**kwargs)")
    p.add_argument("--env-args", default="{}", help="load_environment's keyword arguments, as a JSON object")
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
        env = load_env(args.env, env_args, args.env_dir)
        rows = dataset_rows(env, args.split, args.num_examples)
        print(
            f"[verifiers] {args.env}: {type(env).__name__}, {len(rows)} rows, groups of {args.group_size}", flush=True
        )
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
        play(env, args.env, rows, gateway, episodes // args.group_size, args.group_size, args.concurrency, s)
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


async def play(
    env: Any, env_id: str, rows: list[dict], gateway: str, groups: int, group_size: int, concurrency: int, s: Settings
) -> tuple[Tally, bool]:
    """The runner on this event loop: what it played, and whether a signal stopped it. SIGTERM and SIGINT stop it
    after the groups in flight (verifiers' Environment installs handlers of its own that exit at once: these
    replace them)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    tally = await Runner(env, env_id, rows, gateway, group_size, s).run(groups, concurrency, stop)
    return tally, stop.is_set()


if __name__ == "__main__":
    sys.exit(main())
