"""A ReAct-style agent written only against the `openai` package (plus gateway/episode_client.py, standard library
only), trained by agentstream through its OpenAI-compatible gateway. Nothing in the loop knows about training:
point it at any OpenAI-compatible server and it runs the same; pointed at a run's gateway, every call it makes is
one step of a training episode, and the checker's verdict is the episode's reward.

    # One command: start a local run with the gateway and no actors, then play episodes until it ends
    .venv/bin/python examples/openai_agent.py --launch              # run overrides may follow: trainer.total_steps=20
    # Or against a run that is up (started with gateway.enabled=true; it prints `gateway:` and writes RUN/gateway_url)
    .venv/bin/python examples/openai_agent.py --gateway $(cat RUN/gateway_url) --episodes 16 --group-size 4

The task: a question about a small shop (prices in TABLE), answered with two tools, `lookup` (a price) and
`calculator` (arithmetic); `check` compares the number in the final answer with the task's. Episodes of one task
id form a group of --group-size (the run's env.group_size): GRPO compares them. The tiny local model will not
solve the tasks (a random network writes no tool calls by itself: the first turn asks for one with
`tool_choice="required"`, which the engine writes under the tools' JSON schema); the point is that the loop trains.
`--record FILE` writes every call's prompt and answer token ids (vLLM's `return_token_ids`) as JSON lines.
"""

from __future__ import annotations

import argparse
import ast
import itertools
import functools
import json
import operator
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import openai
from openai import OpenAI

from gateway.episode_client import Episode, GatewayError, open_episode

ROOT = Path(__file__).resolve().parents[1]

# ------------------------------------------------------------------------------------------------ the tools
TABLE = {"apple": 3, "bread": 4, "cheese": 12, "milk": 2, "coffee": 9, "tea": 5}
"""The shop's prices: what `lookup` reads."""

TOOLS = [
    {"type": "function", "function": {
        "name": "lookup", "description": "The price of one item in the shop.",
        "parameters": {"type": "object", "properties": {"item": {"type": "string", "enum": sorted(TABLE)}},
                       "required": ["item"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "calculator", "description": "Evaluate an arithmetic expression (+ - * / and parentheses).",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string",
                                                                       "pattern": "^[0-9+*/(). -]{1,30}$"}},
                       "required": ["expression"], "additionalProperties": False}}},
]
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.USub: operator.neg, ast.UAdd: operator.pos}


def calculate(expression: str) -> float:
    """+ - * / on numbers, nothing else (no names, no calls: safe on a model's text)."""
    def ev(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.operand))
        raise ValueError("only numbers, + - * / and parentheses")
    return ev(ast.parse(expression[:200], mode="eval").body)


def run_tool(name: str, arguments: str) -> str:
    """A tool call's result as the text the model reads next; a bad call gets an error text, never an exception."""
    try:
        args = json.loads(arguments)
        if name == "lookup":
            item = str(args.get("item", "")).lower()
            return f"{item} costs {TABLE[item]}" if item in TABLE else f"error: no item {item!r} (see {sorted(TABLE)})"
        if name == "calculator":
            return str(calculate(str(args.get("expression", ""))))
        return f"error: no tool {name!r}"
    except (ValueError, TypeError, SyntaxError, ZeroDivisionError, RecursionError, AttributeError) as exc:
        return f"error: {exc}"


# ------------------------------------------------------------------------------------------------ the tasks
@dataclass(frozen=True)
class Task:
    id: str
    question: str
    answer: float


TASKS = [
    Task("apples", "How much do 3 apples cost?", 3 * TABLE["apple"]),
    Task("breakfast", "How much do 1 coffee and 2 bread cost together?", TABLE["coffee"] + 2 * TABLE["bread"]),
    Task("cheese", "How much do 2 cheese cost?", 2 * TABLE["cheese"]),
    Task("tea-milk", "How much do 4 tea and 1 milk cost?", 4 * TABLE["tea"] + TABLE["milk"]),
    Task("change", "I pay 50 for 3 cheese. How much change do I get?", 50 - 3 * TABLE["cheese"]),
    Task("difference", "How much more does coffee cost than milk?", TABLE["coffee"] - TABLE["milk"]),
    Task("picnic", "How much do 2 apples, 1 bread and 1 cheese cost?",
         2 * TABLE["apple"] + TABLE["bread"] + TABLE["cheese"]),
    Task("split", "Two friends split the cost of 4 coffee equally. How much does each pay?", 4 * TABLE["coffee"] / 2),
]
SYSTEM = "Find prices with lookup, compute with calculator, then reply: ANSWER: <number>"
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def check(task: Task, answer: str) -> float:
    """1.0 if the last number in the final answer is the task's, else 0.0."""
    numbers = _NUMBER.findall(answer or "")
    return 1.0 if numbers and abs(float(numbers[-1]) - task.answer) < 1e-6 else 0.0


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
        self.write({"episode": ep.id, "task_id": task_id, "group_id": ep.group_id, "turn": turn,
                    "prompt_token_ids": body.get("prompt_token_ids"), "token_ids": choice.get("token_ids"),
                    "tool_calls": [c["function"]["name"] for c in choice["message"].get("tool_calls") or []],
                    "finish_reason": choice.get("finish_reason")})

    def end(self, ep: Episode, task_id: str, reward: float, steps: int) -> None:
        """One finished episode: its reward and its number of model calls."""
        self.write({"episode": ep.id, "task_id": task_id, "group_id": ep.group_id, "reward": reward, "steps": steps})


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
                    model=s.model, messages=messages, tools=TOOLS, max_tokens=s.max_tokens, temperature=s.temperature,
                    tool_choice=s.first_tool_choice if turn == 0 else "auto",
                    extra_body={"return_token_ids": True} if s.record else None)
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
                messages.append({"role": "tool", "tool_call_id": call.id,
                                 "content": run_tool(call.function.name, call.function.arguments)})
        reward = check(task, answer)
        ep.finish(reward=reward, truncated=not answered)  # truncated: still acting after max_turns
    rec.end(ep, task_id, reward, turn + 1)
    return {"reward": reward, "tool_calls": calls, "steps": turn + 1}


Play = Callable[[str, Task, str, Settings, Recorder], dict]
"""One episode: (gateway URL, task, task id, settings, recorder) -> {"reward", "tool_calls", "steps"}."""


def play_many(gateway: str, episodes: int, group_size: int, concurrency: int, s: Settings,
              stop: threading.Event, play_episode: Play = play) -> list[dict]:
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
    argv = [python, str(ROOT / "scripts" / "launch.py"), "gateway.enabled=true", "actors.count=0",
            "gateway.chat_template=gateway/templates/chatml_tools.jinja", f"env.group_size={group_size}",
            f"actors.episodes_per_actor={group_size}", f"run.output_dir={run_dir}", *overrides]
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


def main(play_episode: Play = play, name: str = "openai-agent", doc: str | None = __doc__) -> int:
    """The command line (--launch or --gateway, episodes, settings), each episode played by `play_episode`; the
    agents of examples/openai_agents_sdk.py and examples/langgraph_agent.py run under it too."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gateway", default="", help="a run's gateway URL (RUN/gateway_url)")
    p.add_argument("--launch", action="store_true", help="start a local run (scripts/launch.py) and play against it")
    p.add_argument("--episodes", type=int, default=None,
                   help="episodes to play (a multiple of --group-size; 0: until the run ends; default 16, with "
                        "--launch 0)")
    p.add_argument("--group-size", type=int, default=4, help="episodes per task id (the run's env.group_size)")
    p.add_argument("--concurrency", type=int, default=0, help="episodes at a time (default: 2 x group size)")
    p.add_argument("--max-turns", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--first-tool-choice", default="required", choices=("required", "auto"),
                   help="tool_choice of each episode's first call (required: act before answering)")
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
    settings = Settings(args.model, args.max_turns, args.max_tokens, args.temperature, args.first_tool_choice,
                        args.record, key)
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
        results = play_many(gateway, episodes, args.group_size, args.concurrency or 2 * args.group_size, settings,
                            stop, play_episode)
    except KeyboardInterrupt:
        stop.set()
        results = []
    code = 0 if proc is None else end_launch(proc, stop.is_set(), "agent")
    n = len(results)
    mean = sum(r["reward"] for r in results) / n if n else 0.0
    calls = sum(r["tool_calls"] for r in results)
    print(f"[agent] {n} episodes in {time.monotonic() - t0:.1f}s: mean reward {mean:.3f}, {calls} tool calls, "
          f"{sum(r['steps'] for r in results)} model calls", flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
