"""One SkyRL-Gym env with three tools, where each task needs a different one and the model picks by tool call.

    register_skyrl_env()
    task = make_task(seed, retriever.make_corpus(), root="/tmp/dbs")
    env = skyrl_gym.make("agentstream_multitool", extras={"reward_spec": {"ground_truth": task.answers},
                         "max_turns": 5, "db_path": task.db_path, "search_url": server.url})
    env.init([{"role": "user", "content": prompt(task.question)}])
    env.step('<tool_call>{"name": "sql", "arguments": {"query": "SELECT COUNT(*) FROM employees"}}</tool_call>')

Tools (`TOOLS`, OpenAI schemas; the prompt lists them in Hermes/Qwen form): `search(query)` is skyrl's own
`SearchToolGroup` against the BM25 retriever over the generated encyclopedia (`retriever.py`); `sql(query)` runs
read-only SQLite on the episode's generated company database; `python(code)` runs in the sandbox (`sandbox.py`).
Calls are `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (parsed by `envs.toolcalls.parse_hermes`);
each call's result comes back as `<tool_response>\\n...\\n</tool_response>`, as Qwen's chat template writes them.
`<answer>...</answer>` ends the episode: reward 1 if it matches an accepted answer (`answer_matches`), else 0;
running out of turns ends it with 0. Nothing the model writes makes a step raise.
"""

from __future__ import annotations

import json
import math
import os
import random
import re
import shutil
import sqlite3
import string
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import skyrl_gym
from skyrl_gym.envs.base_text_env import BaseTextEnv, BaseTextEnvStepOutput
from skyrl_gym.tools import SearchToolGroup
from skyrl_gym.tools.core import ToolGroup, tool

from envs.toolcalls import ParsedTools, parse_hermes
from envs.tools import retriever, sql_tasks
from envs.tools.sandbox import run_python

SKYRL_ID = "agentstream_multitool"
MAX_CALLS_PER_TURN = 4  # a reply with more calls runs the first ones: one reply cannot hold the step for minutes
MAX_ROWS = 50
MAX_CHARS = 4000  # of one tool response


def _function(name: str, description: str, param: str, param_description: str) -> dict[str, Any]:
    parameters = {
        "type": "object",
        "properties": {param: {"type": "string", "description": param_description}},
        "required": [param],
    }
    return {"type": "function", "function": {"name": name, "description": description, "parameters": parameters}}


TOOLS = [
    _function(
        "search",
        "Search the encyclopedia of towns; returns the best-matching articles.",
        "query",
        "what to look for, e.g. a town's name",
    ),
    _function(
        "sql",
        "Run one read-only SQLite query on the company database; returns its rows.",
        "query",
        "a single SQL statement",
    ),
    _function(
        "python",
        "Run a Python 3 program; returns what it prints (or its error).",
        "code",
        "the whole program; print the result",
    ),
]
"""The tools as OpenAI function schemas (what a chat template's `tools` argument takes)."""
TOOL_NAMES = tuple(t["function"]["name"] for t in TOOLS)
_PARAM = {t["function"]["name"]: t["function"]["parameters"]["required"][0] for t in TOOLS}

_TOOLS_TEXT = "\n".join(json.dumps(t) for t in TOOLS)  # Qwen's template writes `tool | tojson`, one a line
PREAMBLE = f"""You can use three resources through tools:
- `search`: an encyclopedia of towns (province, river, founding year, founder, main export);
- `sql`: a SQLite company database with this schema:
{sql_tasks.SCHEMA}
- `python`: a Python 3 interpreter (only what the program prints comes back).

# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{_TOOLS_TEXT}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> \
XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>

Each result comes back inside <tool_response></tool_response>. When you know the answer, reply \
<answer>the answer, as short as possible</answer>."""
"""Everything the model is told before the question: resources, tools (Hermes style) and how to finish."""


def prompt(question: str) -> str:
    """The first user message of an episode."""
    return f"{PREAMBLE}\n\nQuestion: {question}"


# --- tasks -------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MultiToolTask:
    kind: str
    """search, sql or python: the tool the task needs."""
    question: str
    answers: list[str]
    """Accepted answers (any one matches)."""
    db_path: str
    """The episode's database (every task has one: the sql tool works in all of them)."""
    call: dict[str, Any]
    """A tool call whose response holds the answer (for scripted agents): {"name": ..., "arguments": {...}}."""


def _db_file(root: str, db_id: str) -> str:
    return os.path.join(root, "spider", "database", db_id, f"{db_id}.sqlite")  # sql_tasks' layout


def _tool_call(name: str, value: str) -> dict[str, Any]:
    return {"name": name, "arguments": {_PARAM[name]: value}}


def _as_text(value: Any) -> str:
    return str(int(value)) if isinstance(value, float) and value.is_integer() else str(value)


def _single_value(db_path: str, query: str) -> str | None:
    """The query's result as text when it is exactly one non-NULL value, else None."""
    conn = sqlite3.connect(db_path)
    try:
        rows = conn.execute(query).fetchall()
    finally:
        conn.close()
    return _as_text(rows[0][0]) if len(rows) == 1 and len(rows[0]) == 1 and rows[0][0] is not None else None


def _search_task(seed: int, towns: list[retriever.Town], root: str) -> MultiToolTask:
    t = retriever.make_task(seed, towns)
    db_path = _db_file(root, sql_tasks.make_task(seed, root).db_id)
    return MultiToolTask("search", t.question, t.answers, db_path, _tool_call("search", t.question))


def _sql_task(seed: int, towns: list[retriever.Town], root: str) -> MultiToolTask:
    """The first of sql_tasks' databases for this seed whose gold query gives one value (a list question
    with several rows, or an average over no rows, has no short answer)."""
    attempt = 0
    while True:
        t = sql_tasks.make_task(seed + attempt * 2**32, root)  # distinct for every (seed, attempt): seeds < 2**32
        db_path = _db_file(root, t.db_id)
        value = _single_value(db_path, t.gold_sql)
        if value is not None:
            return MultiToolTask("sql", t.question, [value], db_path, _tool_call("sql", t.gold_sql))
        shutil.rmtree(os.path.dirname(db_path))
        attempt += 1


def _primes_below(n: int) -> int:
    sieve = bytearray([1]) * n
    sieve[:2] = b"\x00\x00"
    for i in range(2, math.isqrt(n - 1) + 1):
        if sieve[i]:
            sieve[i * i :: i] = bytes(len(range(i * i, n, i)))
    return sum(sieve)


def _power_digit_sum(rng: random.Random) -> tuple[str, int, str]:
    n = rng.randint(200, 3000)
    return (
        f"What is the sum of the decimal digits of 2**{n} (2 to the power {n})?",
        sum(map(int, str(2**n))),
        f"print(sum(int(d) for d in str(2**{n})))",
    )


def _factorial_digit_sum(rng: random.Random) -> tuple[str, int, str]:
    n = rng.randint(50, 500)
    return (
        f"What is the sum of the decimal digits of {n}! ({n} factorial)?",
        sum(map(int, str(math.factorial(n)))),
        f"import math\nprint(sum(int(d) for d in str(math.factorial({n}))))",
    )


def _prime_count(rng: random.Random) -> tuple[str, int, str]:
    n = rng.randint(10_000, 200_000)
    code = (
        f"n = {n}\nprime = [True] * n\nprime[0] = prime[1] = False\nfor i in range(2, int(n ** 0.5) + 1):\n"
        f"    if prime[i]:\n        for j in range(i * i, n, i):\n            prime[j] = False\nprint(sum(prime))"
    )
    return f"How many prime numbers are there below {n}?", _primes_below(n), code


_COMPUTATIONS = (_power_digit_sum, _factorial_digit_sum, _prime_count)
"""Each: rng -> (question, answer, a program that prints the answer): long by hand, short in Python."""


def _python_task(seed: int, towns: list[retriever.Town], root: str) -> MultiToolTask:
    rng = random.Random(f"multitool-python-{seed}")
    question, answer, code = rng.choice(_COMPUTATIONS)(rng)
    db_path = _db_file(root, sql_tasks.make_task(seed, root).db_id)
    return MultiToolTask("python", question, [str(answer)], db_path, _tool_call("python", code))


_MAKERS = {"search": _search_task, "sql": _sql_task, "python": _python_task}
KINDS = tuple(_MAKERS)


def make_task(seed: int, towns: list[retriever.Town], root: str) -> MultiToolTask:
    """The task for `seed`, a pure function of it and the corpus: `seed % 3` picks the kind (so any three
    consecutive seeds hold one of each), the seed the rest. Writes the episode's database under `root`."""
    return _MAKERS[KINDS[seed % len(KINDS)]](seed, towns, root)


# --- answers and actions -----------------------------------------------------------------------------------

_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_SURROUNDING = string.punctuation + string.whitespace
_NUMBER_EDGE = _SURROUNDING.replace("+", "").replace("-", "").replace(".", "")  # keep signs and decimal points
_THOUSANDS = re.compile(r"[+-]?\d{1,3}(,\d{3})+(\.\d*)?")


def final_answer(text: str) -> str | None:
    """The last non-empty `<answer>...</answer>` in `text`, stripped, or None."""
    answers = [a.strip() for a in _ANSWER.findall(text)]
    return next((a for a in reversed(answers) if a), None)


def _number(text: str) -> float | None:
    t = text.strip(_NUMBER_EDGE).rstrip(".")
    if _THOUSANDS.fullmatch(t):
        t = t.replace(",", "")
    try:
        value = float(t)
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def _normalise(text: str) -> str:
    return " ".join(text.lower().split()).strip(_SURROUNDING)


def answer_matches(answer: str, accepted: list[str]) -> bool:
    """Whether `answer` equals one of `accepted` up to case, whitespace and surrounding punctuation; numerically
    when both parse as numbers ("98,500.0" matches "98500")."""
    number = _number(answer)
    for gold in accepted:
        gold_number = _number(gold)
        if number is not None and gold_number is not None:
            if number == gold_number:
                return True
        elif _normalise(answer) == _normalise(gold):
            return True
    return False


_WHY = {
    "truncated": "a <tool_call> is never closed with </tool_call>",
    "bad_json": "the text inside <tool_call></tool_call> is not JSON",
    "bad_call": 'a call is not {"name": string, "arguments": object}',
    "unknown_tool": f"a call names a tool other than {', '.join(TOOL_NAMES)}",
}
_HOW = (
    'call a tool with <tool_call>{"name": "search", "arguments": {"query": "..."}}</tool_call> '
    "or finish with <answer>...</answer>"
)


def invalid_reason(text: str) -> str | None:
    """None when the env acts on `text` (a non-empty `<answer>`, or at least one tool call with every call well
    formed and naming a known tool); else why not, worded for the model. Never raises on a str."""
    return None if final_answer(text) is not None else _why_not(parse_hermes(text, TOOL_NAMES))


def _why_not(parsed: ParsedTools) -> str | None:
    """Why the env cannot act on these parsed tool calls (None: it can)."""
    if parsed.error is not None:
        return f"malformed tool call ({parsed.error}): {_WHY.get(parsed.error, parsed.error)}; {_HOW}"
    if not parsed.tool_calls:
        return f"no tool call and no non-empty <answer>...</answer> found; {_HOW}"
    return None


# --- tools -------------------------------------------------------------------------------------------------


def _clip(text: str) -> str:
    return text if len(text) <= MAX_CHARS else f"{text[:MAX_CHARS]}\n... (cut at {MAX_CHARS} characters)"


_READ_ONLY = {
    sqlite3.SQLITE_SELECT,
    sqlite3.SQLITE_READ,
    sqlite3.SQLITE_FUNCTION,
    sqlite3.SQLITE_RECURSIVE,
    sqlite3.SQLITE_PRAGMA,
}


def _authorize(action: int, *_: Any) -> int:
    # mode=ro alone still lets ATTACH and VACUUM INTO create files: allow reading and nothing else
    return sqlite3.SQLITE_OK if action in _READ_ONLY else sqlite3.SQLITE_DENY


def run_sql(db_path: str, query: str, time_limit_s: float) -> str:
    """The rows of one read-only query as text (a header line, then one line per row, at most MAX_ROWS), or
    `error: ...`. Stopped after `time_limit_s`; never raises for anything in `query`."""
    deadline = time.monotonic() + time_limit_s
    try:
        conn = sqlite3.connect(
            f"{Path(db_path).as_uri()}?mode=ro", uri=True, isolation_level=None, check_same_thread=False
        )
    except sqlite3.Error as exc:
        return f"error: cannot open the database: {exc}"
    try:
        conn.setlimit(sqlite3.SQLITE_LIMIT_LENGTH, 1 << 20)  # one value at most 1 MiB: no giant group_concat
        conn.set_authorizer(_authorize)
        conn.set_progress_handler(lambda: time.monotonic() > deadline, 10_000)
        cursor = conn.execute(query)
        rows = cursor.fetchmany(MAX_ROWS + 1)
        names = [d[0] for d in cursor.description or ()]
    except (sqlite3.Error, ValueError) as exc:  # ValueError: text sqlite cannot take (lone surrogates)
        if time.monotonic() > deadline:
            return f"error: the query ran over {time_limit_s:g} s and was stopped"
        return f"error: {exc}"
    finally:
        conn.close()
    lines = [" | ".join(names)] if names else []
    lines += [" | ".join("NULL" if v is None else _as_text(v) for v in row) for row in rows[:MAX_ROWS]]
    if not rows:
        lines.append("(no rows)")
    if len(rows) > MAX_ROWS:
        lines.append(f"(only the first {MAX_ROWS} rows are shown)")
    return _clip("\n".join(lines))


def run_code(code: str, time_limit_s: float, memory_mb: int) -> str:
    """What `code` prints with empty stdin, run in the sandbox, then its error if it raised; or `error: ...`."""
    result = run_python(code, [""], time_limit_s=time_limit_s, memory_mb=memory_mb)
    if result.status != "ok":
        return f"error: {result.status}: {result.detail}".strip()
    out, err = result.outputs[0].rstrip(), result.errors[0]
    text = "\n".join(part for part in (out, err and f"error: {err}") if part)
    return _clip(text or "(no output: print the result to see it)")


class SQLToolGroup(ToolGroup):
    def __init__(self, db_path: str, time_limit_s: float):
        self.db_path, self.time_limit_s = db_path, time_limit_s
        super().__init__(name="SQLToolGroup")

    @tool
    def sql(self, query: str) -> str:
        return run_sql(self.db_path, query, self.time_limit_s)


class PythonToolGroup(ToolGroup):
    def __init__(self, time_limit_s: float, memory_mb: int):
        self.time_limit_s, self.memory_mb = time_limit_s, memory_mb
        super().__init__(name="PythonToolGroup")

    @tool
    def python(self, code: str) -> str:
        return run_code(code, self.time_limit_s, self.memory_mb)


# --- the env -----------------------------------------------------------------------------------------------


class MultiToolEnv(BaseTextEnv):
    """extras: reward_spec.ground_truth (accepted answers), max_turns, db_path, search_url, and optionally
    time_limit_s (per sql/python call, default 5) and memory_mb (python, default 256)."""

    def __init__(self, env_config: Any = None, extras: dict[str, Any] | None = None):
        super().__init__()
        extras = extras or {}
        self.answers = list(extras["reward_spec"]["ground_truth"])
        self.max_turns = int(extras.get("max_turns", 5))
        time_limit_s = float(extras.get("time_limit_s", 5.0))
        self.init_tool_groups(
            [
                SearchToolGroup(search_url=extras["search_url"], topk=3, timeout=10, log_requests=False),
                SQLToolGroup(extras["db_path"], time_limit_s),
                PythonToolGroup(time_limit_s, int(extras.get("memory_mb", 256))),
            ]
        )

    def step(self, action: str) -> BaseTextEnvStepOutput:
        self.turns += 1
        answer = final_answer(action)
        if answer is not None:
            reward = 1.0 if answer_matches(answer, self.answers) else 0.0
            return BaseTextEnvStepOutput(observations=[], reward=reward, done=True, metadata={"answer": answer})
        parsed = parse_hermes(action, TOOL_NAMES)
        reason = _why_not(parsed)
        if reason is None:
            calls = parsed.tool_calls
            text = "\n".join(
                f"<tool_response>\n{self._call(c.name, c.arguments, i)}\n</tool_response>" for i, c in enumerate(calls)
            )
            metadata: dict[str, Any] = {"tool_calls": [c.name for c in calls]}
        else:
            text, metadata = f"error: {reason}", {"parse_error": reason}
        return BaseTextEnvStepOutput(
            observations=[{"role": "user", "content": text}],
            reward=0.0,
            done=self.turns >= self.max_turns,
            metadata=metadata,
        )

    def _call(self, name: str, arguments: str, index: int) -> str:
        """The response to one parsed call (its arguments are a JSON object's text, as the parser gives them)."""
        if index >= MAX_CALLS_PER_TURN:
            return f"error: at most {MAX_CALLS_PER_TURN} tool calls run per reply; this one did not"
        param = _PARAM[name]
        value = json.loads(arguments).get(param)
        if not isinstance(value, str):
            return f'error: {name} takes {{"{param}": string}}'
        try:
            return self._execute_tool(self.tool_to_toolgroup[name], name, [value])
        except Exception as exc:  # noqa: BLE001 - skyrl's search raises on odd replies; the model sees it
            return f"error: {name} failed: {exc}"


def register_skyrl_env() -> None:
    """Make `skyrl_gym.make("agentstream_multitool", ...)` build `MultiToolEnv` (idempotent)."""
    if SKYRL_ID not in skyrl_gym.registry:
        skyrl_gym.register(id=SKYRL_ID, entry_point=MultiToolEnv)
