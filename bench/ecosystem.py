"""What each way of bringing an agent costs per rollout, against the project's own actors on the same task:
steady rollouts/s side by side in one run, the CPU one rollout takes by process, the ratio to the actors last.

    .venv/bin/python -m bench.ecosystem [--steps 20] [--paths actors,openai,agents-sdk,langgraph,verifiers] [--keep DIR]

Each path is a short training run of the real launcher (`scripts/launch.py`: broker, one vLLM engine and its weight
sidecar, one learner rank), one after another, on the tiny model with the same trainer and sampling: groups of 4, 4
groups a step, 16 episodes in flight, one model call per rollout of at most 32 tokens at temperature 1.0, the
config's staleness bound. What plays:

- `actors` (the baseline, always run): one actor (`actors.count=1`, 16 episodes at a time) on
  `agentstream/Reasoning-v0`, reasoning-gym `basic_arithmetic`, one attempt: a question, one answer, a checker.
- `openai`: `examples/openai_agent.py --launch` (the gateway, `actors.count=0`; the plain `openai` client);
- `agents-sdk`: `examples/openai_agents_sdk.py --launch` (the OpenAI Agents SDK's Runner);
- `langgraph`: `examples/langgraph_agent.py --launch` (LangGraph's prebuilt ReAct graph);
- `verifiers`: `.cache/verifiers-venv/bin/python examples/verifiers_env.py --launch` on a verifiers `ToolEnv` written
  here (`VERIFIERS_ENV`) from the same shop: gateway/shop_task.py's questions, system prompt, tools and
  checker; each rollout verifiers' own `env.rollout`, each group scored by its rubric. Skipped, with the reason,
  when the verifiers venv is missing (`bash scripts/setup.sh` makes it); the SDK paths likewise when their
  packages are not installed (setup.sh's `agents` extra).

The task. The four gateway paths play the shop question of gateway/shop_task.py with `--max-turns 1
--first-tool-choice auto`, and the gateway renders with the model's own chat template (`gateway.chat_template=`;
the examples' launch sets one that writes the tools' schemas into the prompt, ~700 tokens of the tiny model's). The
tools still go with every request, the tiny model answers in text, and every rollout is one call on a prompt of the
system prompt and the question, as an actor's is on the instructions and the question. The actors cannot play the
shop (no env of it in envs/, and they send no tools), so they play the closest thing: a single-turn question with a
checker. The table says what each played: model calls per rollout, prompt and answer tokens per call (from the
broker's log); the learner's cost follows the tokens, so these should be close.

Per path: start-up = launch to the end of the learner's step 1; steady = the learner's steps after the first 1 +
bound (the staleness bound, 2: while the run starts, groups are made as far ahead as the bound lets them, and the
steps that train them run without waiting: a fast start, not a rate), their step times summed, as `bench.peer`
measures; rollouts/s = those steps x groups a step x G / steady s (whole groups, every one of them trained); "wait"
= the learner's share of those steps spent waiting for its batch (near 100%: the path sets the pace; near 0: the
learner does, and the path could go faster). CPU: every process of the run (the agent's own, the launcher and all it
started), read every 0.25 s by role (`harness.CpuSampler`): the cores each used over the steady steps / rollouts/s =
CPU ms one rollout costs there. On 2 busy cores a path's rate is about 2 / its CPU s per rollout, so the actors' CPU
per rollout over a path's bounds that path's ratio when every core is busy (a `#` line). The ratio to the actors'
rollouts/s ends each path's line, and the last line repeats them.
"""

from __future__ import annotations

import importlib.util
import json
import math
import signal
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from agentstream import config as config_mod
from agentstream.config import REPO_ROOT
from agentstream.wire.messages import ABANDON
from bench import harness

BASELINE = "actors"
G, GROUPS_PER_STEP, IN_FLIGHT, MAX_TOKENS, TEMPERATURE = 4, 4, 16, 32, 1.0
"""Every path's workload: group size, groups a learner step, episodes at a time, tokens per call, temperature."""
SAMPLE_S = 0.25
"""Seconds between two readings of a run's CPU."""
VF_PYTHON = REPO_ROOT / ".cache" / "verifiers-venv" / "bin" / "python"
VF_ENV_NAME = "agentstream_shop"
ROLES = (
    ("openai_agents_sdk.py", "agent (Agents SDK)"),
    ("langgraph_agent.py", "agent (LangGraph)"),
    ("openai_agent.py", "agent (openai)"),
    ("verifiers_env.py", "agent (verifiers)"),
    *harness.ROLES,
)
"""The agent's own process by its script, then the run's processes (`harness.ROLES`)."""
SHOP = "the shop question of gateway/shop_task.py (system prompt + question; tools sent, not rendered)"


@dataclass(frozen=True)
class Way:
    """One way of bringing an agent: how it is started and what it plays."""

    name: str
    played: str
    script: str = ""
    """The example that plays through the gateway (empty: the project's actors)."""
    modules: tuple[str, ...] = ()
    """What it imports that the project's venv may lack (then it is skipped)."""


WAYS = (
    Way(BASELINE, "agentstream/Reasoning-v0 basic_arithmetic, one attempt (instructions + question)"),
    Way("openai", f"{SHOP}; the plain openai client", "examples/openai_agent.py"),
    Way("agents-sdk", f"{SHOP}; the OpenAI Agents SDK's Runner", "examples/openai_agents_sdk.py", ("agents",)),
    Way(
        "langgraph",
        f"{SHOP}; LangGraph's create_react_agent",
        "examples/langgraph_agent.py",
        ("langgraph", "langchain_openai"),
    ),
    Way(
        "verifiers",
        f"{SHOP} as a verifiers 0.3.1 ToolEnv, max_turns 1, scored by its rubric",
        "examples/verifiers_env.py",
    ),
)
BY_NAME = {w.name: w for w in WAYS}

VERIFIERS_ENV = '''"""The examples' shop (gateway/shop_task.py) as a verifiers ToolEnv: its questions, system prompt,
tools and checker (written by bench/ecosystem.py; its runner, examples/verifiers_env.py, imports the gateway/)."""
import json
from typing import Literal

import verifiers as vf
from datasets import Dataset

from gateway.shop_task import SYSTEM, TABLE, TASKS, check, run_tool

BY_ID = {task.id: task for task in TASKS}


def lookup(item: Literal[tuple(sorted(TABLE))]) -> str:
    """The price of one item in the shop."""
    return run_tool("lookup", json.dumps({"item": item}))


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression (+ - * / and parentheses)."""
    return run_tool("calculator", json.dumps({"expression": expression}))


def load_environment(max_turns: int = 1) -> vf.Environment:
    def correct(completion, answer) -> float:
        return check(BY_ID[answer], (completion[-1].content or "") if completion else "")  # none: an empty answer

    rows = [{"question": task.question, "answer": task.id} for task in TASKS]
    return vf.ToolEnv(dataset=Dataset.from_list(rows), tools=[lookup, calculator], max_turns=max_turns,
                      system_prompt=SYSTEM, rubric=vf.Rubric(funcs=[correct]))
'''


# ------------------------------------------------------------------------------------ the figures (pure)
def parse_paths(text: str) -> list[str]:
    """`--paths`: a comma list of WAYS' names -> those names in WAYS' order, the baseline always first (its
    rollouts/s is every ratio's denominator). An unknown name raises ValueError listing the known ones."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in BY_NAME]
    if unknown:
        raise ValueError(f"unknown path(s) {', '.join(unknown)}; known: {', '.join(BY_NAME)}")
    return [w.name for w in WAYS if w.name == BASELINE or w.name in names]


@dataclass(frozen=True)
class Steady:
    """The learner's steady steps of one run."""

    steps: int  # how many were measured
    seconds: float  # their step times, summed
    rollouts_per_s: float
    wait_frac: float  # of `seconds`, spent waiting for a batch


def steady(rows: Sequence[dict], rollouts_per_step: int, skip: int) -> Steady:
    """From the learner's rows (learner_metrics.jsonl, one a step, in any order): its steps after the first `skip`
    (step 1 waits for the start-up, and the next `bound` steps train groups that were made meanwhile, as far ahead as
    the staleness bound let them: a fast start, not a steady rate), rollouts/s = those steps x rollouts_per_step /
    their summed step times."""
    ordered = sorted((r for r in rows if "version" in r), key=lambda r: r["version"])[skip:]
    if not ordered:
        raise ValueError(
            f"{len(rows)} learner steps, all of them among the first {skip}: nothing steady to measure (more --steps)"
        )
    seconds = sum(r["step_time_s"] for r in ordered)
    return Steady(
        len(ordered),
        seconds,
        len(ordered) * rollouts_per_step / seconds,
        sum(r["batch_wait_s"] for r in ordered) / seconds,
    )


@dataclass(frozen=True)
class Played:
    """What a run's finished rollouts were, from the broker's log."""

    rollouts: int
    calls_per_rollout: float
    prompt_tokens: float  # per call
    answer_tokens: float  # per call


def played(calls: Iterable[tuple[str, int, int, bool]]) -> Played:
    """`calls`: (trajectory id, prompt tokens, answer tokens, whether it ended the trajectory) per logged model call.
    Only trajectories that ended count (a group given up, or still open when the run stopped, is left out)."""
    by_traj: dict[str, list[tuple[int, int]]] = {}
    ended: set[str] = set()
    for traj, prompt, answer, end in calls:
        by_traj.setdefault(traj, []).append((prompt, answer))
        if end:
            ended.add(traj)
    kept = [c for traj in ended for c in by_traj[traj]]
    if not kept:
        return Played(0, math.nan, math.nan, math.nan)
    return Played(
        len(ended), len(kept) / len(ended), sum(p for p, _ in kept) / len(kept), sum(a for _, a in kept) / len(kept)
    )


def cpu_ms_per_rollout(cores: dict[str, float], rollouts_per_s: float) -> dict[str, float]:
    """CPU ms one rollout costs per role: the cores a role used on average / rollouts per second x 1000."""
    return {role: 1000 * c / rollouts_per_s for role, c in cores.items()}


@dataclass(frozen=True)
class Result:
    way: Way
    startup_s: float
    steady: Steady
    played: Played
    cpu_ms: dict[str, float]  # per rollout, by role, most first (empty: too few readings)


HEADER = (
    f"{'path':<10} {'calls/rollout':>13} {'prompt tok':>10} {'answer tok':>10} {'start-up s':>10} "
    f"{'steady s':>8} {'wait':>5} {'rollouts/s':>10} {'CPU ms/rollout':>14} {'vs actors':>9}"
)


def ratio(r: Result, baseline: Result) -> float:
    """A path's steady rollouts/s over the actors'."""
    return r.steady.rollouts_per_s / baseline.steady.rollouts_per_s


def row_line(r: Result, baseline: Result) -> str:
    """A path's line of the table: what it played, its figures, its ratio to the actors last."""
    cpu = sum(r.cpu_ms.values()) if r.cpu_ms else float("nan")
    return (
        f"{r.way.name:<10} {r.played.calls_per_rollout:>13.2f} {r.played.prompt_tokens:>10.1f} "
        f"{r.played.answer_tokens:>10.1f} {r.startup_s:>10.1f} {r.steady.seconds:>8.2f} "
        f"{r.steady.wait_frac:>5.0%} {r.steady.rollouts_per_s:>10.2f} {cpu:>14.1f} {ratio(r, baseline):>8.2f}x"
    )


def cpu_line(r: Result) -> str:
    """A `#` line: where one rollout's CPU went, by process, most first."""
    if not r.cpu_ms:
        return f"# {r.way.name}: CPU: too few readings in the steady steps"
    parts = ", ".join(f"{role} {ms:.1f}" for role, ms in r.cpu_ms.items() if ms >= 0.05)
    return f"# {r.way.name}: CPU ms per rollout by process: {parts} = {sum(r.cpu_ms.values()):.1f}"


def cpu_ratio_line(results: Sequence[Result]) -> str:
    """A `#` line: the actors' CPU per rollout over each path's (what each ratio can reach with every core busy)."""
    base = next(r for r in results if r.way.name == BASELINE)
    total = {r.way.name: sum(r.cpu_ms.values()) if r.cpu_ms else float("nan") for r in results}
    parts = [f"{name} {total[BASELINE] / ms:.2f}x" for name, ms in total.items() if name != base.way.name]
    return "# the actors' CPU ms per rollout over each path's (its ratio with every core busy): " + (
        ", ".join(parts) if parts else "no other path ran"
    )


def last_line(results: Sequence[Result]) -> str:
    """The last line: every path's steady rollouts/s over the actors' (measured in this run)."""
    base = next(r for r in results if r.way.name == BASELINE)
    others = [f"{r.way.name} {ratio(r, base):.2f}x" for r in results if r is not base]
    return f"steady rollouts/s against the project's own actors ({base.steady.rollouts_per_s:.2f}/s): " + (
        ", ".join(others) if others else "no other path ran"
    )


# ------------------------------------------------------------------------------------ the runs
def skip_reason(way: Way) -> str:
    """Why `way` cannot run here ("" when it can)."""
    if way.name == "verifiers" and not VF_PYTHON.exists():
        return f"{VF_PYTHON.relative_to(REPO_ROOT)} is missing (bash scripts/setup.sh makes it)"
    missing = [m for m in way.modules if importlib.util.find_spec(m) is None]
    return f"{', '.join(missing)} not installed (scripts/setup.sh, extra `agents`)" if missing else ""


def run_overrides(model: str, steps: int) -> list[str]:
    """The launcher overrides every path shares: the model, one learner rank, the groups, the sampling."""
    return [
        f"model.path={model}",
        "learner.world_size=1",
        f"env.group_size={G}",
        f"trainer.groups_per_step={GROUPS_PER_STEP}",
        f"trainer.total_steps={steps}",
        f"sampling.max_tokens={MAX_TOKENS}",
        f"sampling.temperature={TEMPERATURE}",
        "broker.dashboard_port=0",
        "run.shutdown_timeout_s=5",
    ]


def actor_overrides() -> list[str]:
    """The baseline's task and player: one actor, IN_FLIGHT episodes at a time, one answer per episode."""
    return [
        "env.name=agentstream/Reasoning-v0",
        "+env.kwargs.dataset=basic_arithmetic",
        "+env.kwargs.max_attempts=1",
        "env.max_steps=1",
        "actors.count=1",
        f"actors.episodes_per_actor={IN_FLIGHT}",
    ]


def agent_argv(way: Way, overrides: list[str], env_dir: Path) -> list[str]:
    """An example's one command (`--launch`, as a user runs it) with the shared workload; the gateway renders with
    the model's own chat template (the example's launch sets one that renders tools; this override comes later)."""
    overrides = [*overrides, "gateway.chat_template="]
    if way.name == "verifiers":
        return [
            str(VF_PYTHON),
            way.script,
            "--env",
            VF_ENV_NAME,
            "--env-dir",
            str(env_dir),
            "--launch",
            "--launcher-python",
            sys.executable,
            "--group-size",
            str(G),
            "--concurrency",
            str(IN_FLIGHT // G),
            "--max-tokens",
            str(MAX_TOKENS),
            "--temperature",
            str(TEMPERATURE),
            *overrides,
        ]
    return [
        sys.executable,
        way.script,
        "--launch",
        "--group-size",
        str(G),
        "--concurrency",
        str(IN_FLIGHT),
        "--max-turns",
        "1",
        "--first-tool-choice",
        "auto",
        "--max-tokens",
        str(MAX_TOKENS),
        "--temperature",
        str(TEMPERATURE),
        *overrides,
    ]


def run_agent(argv: list[str], log: Path, timeout_s: float) -> harness.Launched:
    """An example with `--launch` to its end (it ends when its run does), its whole tree sampled meanwhile; past
    `timeout_s`, or when the benchmark stops, SIGTERM (the example stops its run, which stops its processes)."""
    t0 = time.time()
    with harness.child(argv, log, signal.SIGTERM, 120) as proc, harness.CpuSampler(proc.pid, SAMPLE_S, ROLES) as cpu:
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            pass  # leaving the block stops it
    if proc.returncode != 0:
        raise RuntimeError(f"{argv[1]} exited {proc.returncode}; it printed ({log}):\n{log.read_text()[-3000:]}")
    return harness.Launched(t0, time.time() - t0, cpu)


def run_way(way: Way, model: str, steps: int, folder: Path, timeout_s: float) -> Result:
    """One path's training run, measured."""
    run_dir = folder / way.name / "run"
    overrides = run_overrides(model, steps)
    if way.name == BASELINE:
        done = harness.run_launcher(
            run_dir,
            [*overrides, *actor_overrides()],
            f"of the {way.name} path",
            timeout_s,
            watch=lambda pid: harness.CpuSampler(pid, SAMPLE_S, ROLES),
        )
    else:
        env_dir = folder / "verifiers-env"
        if way.name == "verifiers":
            env_dir.mkdir(parents=True, exist_ok=True)
            (env_dir / f"{VF_ENV_NAME}.py").write_text(VERIFIERS_ENV)
        argv = agent_argv(way, [*overrides, f"run.output_dir={run_dir}"], env_dir)
        done = run_agent(argv, folder / f"launch-{way.name}.log", timeout_s)
    return measure(way, run_dir, steps, done)


def measure(way: Way, run_dir: Path, steps: int, done: harness.Launched) -> Result:
    """A finished run's figures: its learner's steady steps, the broker's log, the CPU sampled over those steps."""
    from broker.state import logged_transitions

    summary = json.loads((run_dir / "summary.json").read_text())
    if summary.get("status") != "finished" or summary.get("learner_version") != steps:
        raise RuntimeError(
            f"the {way.name} run did not train its {steps} steps: status {summary.get('status')}, "
            f"learner version {summary.get('learner_version')}: {summary.get('reason')}"
        )
    bound = config_mod.load(run_dir / "config.yaml").trainer.max_staleness
    rows = harness.learner_rows(run_dir)
    s = steady(rows, GROUPS_PER_STEP * G, skip=bound + 1)
    last_step_end = (run_dir / "learner_metrics.jsonl").stat().st_mtime  # its row is the file's last write
    first_step_end = last_step_end - sum(r["step_time_s"] for r in rows if r.get("version", 0) > 1)
    steady_from = last_step_end - s.seconds
    calls = (
        (t.traj_id, len(t.prompt_ids), len(t.response_ids), bool(t.done or t.truncated))
        for t in logged_transitions(run_dir / "broker-wal")
        if ABANDON not in t.info
    )
    cores = done.watched.cores(steady_from, last_step_end)
    return Result(way, first_step_end - done.started, s, played(calls), cpu_ms_per_rollout(cores, s.rollouts_per_s))


def main() -> None:
    parser = harness.arguments(__doc__)
    parser.add_argument(
        "--steps", type=int, default=20, help="learner steps per path (steady: after the first 1 + the staleness bound)"
    )
    parser.add_argument(
        "--paths",
        default=",".join(BY_NAME),
        help=f"a comma list of {', '.join(BY_NAME)} (the baseline, {BASELINE}, always runs)",
    )
    parser.add_argument("--keep", default="", help="keep the run folders here (default: a temporary folder)")
    parser.add_argument("--run-timeout-s", type=float, default=900.0, help="the most one path's run may take")
    args = parser.parse_args()
    if args.steps < 5:
        parser.error(
            "--steps must be at least 5: step 1 holds the start-up, the next 2 (the staleness bound) what "
            "was made meanwhile"
        )
    try:
        names = parse_paths(args.paths)
    except ValueError as exc:
        parser.error(str(exc))
    model, folder = harness.begin(
        "",
        "bench-ecosystem-",
        args.keep,
        about=(
            f"each path a training run of {args.steps} learner steps, the tiny model: groups of {G}, "
            f"{GROUPS_PER_STEP} groups a step, {IN_FLIGHT} episodes in flight, one call of <= {MAX_TOKENS} tokens "
            f"a rollout at temperature {TEMPERATURE}; 1 vLLM engine, 1 learner rank, the config's staleness bound"
        ),
    )
    print(f"# runs in {folder}", flush=True)
    for name in names:
        print(f"# {name}: plays {BY_NAME[name].played}", flush=True)
    print(HEADER, flush=True)
    results: list[Result] = []
    for name in names:
        way = BY_NAME[name]
        why = skip_reason(way)
        if why:
            print(f"# {name}: skipped: {why}", flush=True)
            continue
        results.append(run_way(way, model, args.steps, folder, args.run_timeout_s))
        print(row_line(results[-1], results[0]), flush=True)
        print(cpu_line(results[-1]), flush=True)
    print(cpu_ratio_line(results), flush=True)
    print(last_line(results), flush=True)


if __name__ == "__main__":
    main()
