"""What the example agents share around their own loop: the command line, groups of episodes played at once,
`--record`, a local run started for `--launch`; and, for an agent written with an SDK, one episode around its run.

    from gateway.agent_runner import main
    def play(gateway, task, task_id, settings, recorder) -> dict: ...  # one episode of a gateway/shop_task.py task
    sys.exit(main(play, "my-agent", __doc__))                           # --launch, or --gateway URL; see --help

`main` parses the options (--launch or --gateway, --episodes, --group-size, --max-turns, --record, ...), starts a
local run with the gateway and no actors when asked (`launch`: the checkout's scripts/launch.py) and plays groups of
the shop's tasks with the agent's `play`, --concurrency episodes at a time (`play_many`). examples/openai_agent.py
(the plain `openai` loop) runs under it, and so do, through `play_with` (an episode around an SDK's run, its calls
counted and recorded from the HTTP client the SDK is handed), examples/openai_agents_sdk.py and
examples/langgraph_agent.py; examples/verifiers_env.py takes its Recorder and launch helpers. Standard library,
`openai` and gateway/episode_client.py only: it runs in the verifiers venv too.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import itertools
import json
import signal
import ssl
import subprocess
import sys
import threading
import time
import urllib.error
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import openai

from gateway.episode_client import Episode, GatewayError, open_episode
from gateway.shop_task import TASKS, Task, check

if TYPE_CHECKING:
    import httpx2

ROOT = Path(__file__).resolve().parents[1]
"""The checkout this package sits in: its scripts/launch.py starts a run for --launch, and runs/ holds that run."""


# ------------------------------------------------------------------------------------------------ the agent
@dataclass
class Settings:
    model: str = "policy"
    max_turns: int = 4
    max_tokens: int = 64
    temperature: float = 1.0
    first_tool_choice: str = "required"
    record: Path | None = None
    key: str = ""  # the run's gateway key (its gateway.key_file), if it has one


class Recorder:
    """--record: one JSON line per call and per finished episode (thread-safe)."""

    def __init__(self, path: Path | None):
        self.path, self.lock = path, threading.Lock()
        if path is not None:
            path.write_text("")

    def write(self, row: dict) -> None:
        if self.path is not None:
            with self.lock, self.path.open("a") as f:
                f.write(json.dumps(row) + "\n")

    def call(self, ep: Episode, task_id: str, turn: int, body: dict) -> None:
        """One answered chat call, from its response body (JSON): the token ids are there with `return_token_ids`."""
        choice = body["choices"][0]
        self.write(
            {
                "episode": ep.id,
                "task_id": task_id,
                "group_id": ep.group_id,
                "turn": turn,
                "prompt_token_ids": body.get("prompt_token_ids"),
                "token_ids": choice.get("token_ids"),
                "tool_calls": [c["function"]["name"] for c in choice["message"].get("tool_calls") or []],
                "finish_reason": choice.get("finish_reason"),
            }
        )

    def end(self, ep: Episode, task_id: str, reward: float, steps: int) -> None:
        """One finished episode: its reward and its number of model calls."""
        self.write({"episode": ep.id, "task_id": task_id, "group_id": ep.group_id, "reward": reward, "steps": steps})


Play = Callable[[str, Task, str, Settings, Recorder], dict]
"""One episode: (gateway URL, task, task id, settings, recorder) -> {"reward", "tool_calls", "steps"}."""


def play_many(
    gateway: str,
    episodes: int,
    group_size: int,
    concurrency: int,
    s: Settings,
    stop: threading.Event,
    play_episode: Play,
) -> list[dict]:
    """`episodes` episodes (0: until the gateway goes away), group k of `group_size` on task k mod len(TASKS)
    under task id `<task>#<k>`, `concurrency` at a time, each played by `play_episode`. Stops early when the
    gateway stops answering."""
    rec, results, gone = Recorder(s.record), [], threading.Event()
    counter = iter(range(episodes)) if episodes else itertools.count()  # 0: until the gateway goes away

    def worker() -> None:
        while not (stop.is_set() or gone.is_set()):
            i = next(counter, None)
            if i is None:
                return
            k = i // group_size
            task = TASKS[k % len(TASKS)]
            try:
                results.append(play_episode(gateway, task, f"{task.id}#{k}", s, rec))
            except (urllib.error.URLError, ConnectionError, openai.APIConnectionError) as exc:
                gone.set()  # the run ended (or the gateway is down): stop starting episodes
                print(f"[agent] the gateway stopped answering ({exc.__class__.__name__}); stopping", flush=True)
            except GatewayError as exc:
                gone.set()
                print(f"[agent] the gateway refused: {exc}; stopping", flush=True)

    with ThreadPoolExecutor(concurrency) as pool:
        for future in [pool.submit(worker) for _ in range(concurrency)]:
            future.result()  # an agent bug surfaces here
    return results


# ------------------------------------------------------------------------------------------------ one command
def launch(overrides: list[str], group_size: int, run_dir: Path, python: str = sys.executable) -> subprocess.Popen:
    """A local run whose only player is this agent: gateway on, no actors, the ChatML-with-tools template (the
    tiny model's own template ignores tools). `python`: the project's interpreter (an agent in a venv of its own,
    as examples/verifiers_env.py is, passes .venv's)."""
    argv = [
        python,
        str(ROOT / "scripts" / "launch.py"),
        "gateway.enabled=true",
        "actors.count=0",
        "gateway.chat_template=gateway/templates/chatml_tools.jinja",
        f"env.group_size={group_size}",
        f"actors.episodes_per_actor={group_size}",
        f"run.output_dir={run_dir}",
        *overrides,
    ]
    print(f"[agent] starting the run: {' '.join(argv[1:])}", flush=True)
    return subprocess.Popen(argv, cwd=ROOT, start_new_session=True)


def end_launch(proc: subprocess.Popen, stopped: bool, tag: str) -> int:
    """Wait for the run this agent launched to end (its learner's last step) and return its exit code; `stopped`
    (the agent was told to stop): ask the launcher to stop first, which stops its processes and writes summary.json.
    Ctrl-C while waiting stops it too."""
    if stopped:
        proc.send_signal(signal.SIGINT)
    print(f"[{tag}] waiting for the run to end (the learner's last step)", flush=True)
    try:
        return proc.wait()
    except KeyboardInterrupt:
        proc.send_signal(signal.SIGINT)
        return proc.wait()


def wait_for_url(run_dir: Path, proc: subprocess.Popen, timeout_s: float = 600) -> str:
    """The gateway's URL, once the launch wrote RUN/gateway_url (it does when the gateway answers)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        path = run_dir / "gateway_url"
        if path.is_file() and path.read_text().strip():
            return path.read_text().strip()
        if proc.poll() is not None:
            raise SystemExit(f"[agent] the launch exited with code {proc.returncode} before its gateway answered")
        time.sleep(0.5)
    raise SystemExit(f"[agent] no {run_dir / 'gateway_url'} within {timeout_s:.0f}s")


def main(play_episode: Play, name: str, doc: str | None) -> int:
    """The command line (--launch or --gateway, episodes, settings), each episode played by `play_episode`: an
    agent's whole program. `name` names the runs it launches (runs/<name>-<time>), `doc` is its --help text."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gateway", default="", help="a run's gateway URL (RUN/gateway_url)")
    p.add_argument("--launch", action="store_true", help="start a local run (scripts/launch.py) and play against it")
    p.add_argument(
        "--episodes",
        type=int,
        default=None,
        help="episodes to play (a multiple of --group-size; 0: until the run ends; default 16, with --launch 0)",
    )
    p.add_argument("--group-size", type=int, default=4, help="episodes per task id (the run's env.group_size)")
    p.add_argument("--concurrency", type=int, default=0, help="episodes at a time (default: 2 x group size)")
    p.add_argument("--max-turns", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument(
        "--first-tool-choice",
        default="required",
        choices=("required", "auto"),
        help="tool_choice of each episode's first call (required: act before answering)",
    )
    p.add_argument("--model", default="policy", help="the model name sent (the gateway serves the run's policy)")
    p.add_argument("--record", type=Path, default=None, help="write every call's token ids here (JSON lines)")
    p.add_argument("--key-file", type=Path, default=None, help="the run's gateway key file (gateway.key_file), if any")
    p.add_argument("overrides", nargs="*", help="with --launch: run config overrides (key=value)")
    args = p.parse_args()
    episodes = args.episodes if args.episodes is not None else (0 if args.launch else 16)
    if episodes % args.group_size or episodes < 0:
        p.error(f"--episodes={episodes} must be a multiple of --group-size={args.group_size} (whole groups)")
    if bool(args.gateway) == args.launch:
        p.error("give either --gateway URL (a run that is up) or --launch (start one here)")
    key = args.key_file.read_text().splitlines()[0].strip() if args.key_file else ""
    settings = Settings(
        args.model, args.max_turns, args.max_tokens, args.temperature, args.first_tool_choice, args.record, key
    )
    stop, proc = threading.Event(), None
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    gateway = args.gateway
    if args.launch:
        run_dir = ROOT / "runs" / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"
        run_dir = Path(next((o.split("=", 1)[1] for o in args.overrides if o.startswith("run.output_dir=")), run_dir))
        proc = launch([o for o in args.overrides if not o.startswith("run.output_dir=")], args.group_size, run_dir)
        gateway = wait_for_url(run_dir, proc)
    print(f"[agent] playing against {gateway}", flush=True)
    t0 = time.monotonic()
    try:
        results = play_many(
            gateway, episodes, args.group_size, args.concurrency or 2 * args.group_size, settings, stop, play_episode
        )
    except KeyboardInterrupt:
        stop.set()
        results = []
    code = 0 if proc is None else end_launch(proc, stop.is_set(), "agent")
    n = len(results)
    mean = sum(r["reward"] for r in results) / n if n else 0.0
    calls = sum(r["tool_calls"] for r in results)
    print(
        f"[agent] {n} episodes in {time.monotonic() - t0:.1f}s: mean reward {mean:.3f}, {calls} tool calls, "
        f"{sum(r['steps'] for r in results)} model calls",
        flush=True,
    )
    return code


# ------------------------------------------------------------------------------------------------ an SDK's episode
class EpisodeCalls:
    """The chat calls of one episode, as the gateway answered them. The SDK is handed an `openai` HTTP client
    (httpx2) whose response hook reads every chat completion: the calls and tool calls are counted there and, with
    --record, written with their token ids, whatever the SDK keeps of the raw answer."""

    def __init__(self, ep: Episode, task_id: str, rec: Recorder):
        self.ep, self.task_id, self.rec = ep, task_id, rec
        self.calls = self.tool_calls = 0
        self.acting = False
        """Whether the latest answer held tool calls (the agent was still acting when its run stopped)."""

    async def on_response(self, response: httpx2.Response) -> None:
        if (
            response.request.method != "POST"
            or not response.request.url.path.endswith("/chat/completions")
            or response.status_code != 200
        ):
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
    """A `Play` for an SDK (as examples/openai_agent.py's `play` is one for the plain client): open the episode, run
    the SDK's agent (its own event loop, in the worker thread that plays it), reward the final answer. An answer is
    final when the last call wrote no tool call; an agent stopped at its turn limit while still acting ends the
    episode truncated, as does a chat that outgrew the model's context."""

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
