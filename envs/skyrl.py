"""SkyRL-Gym environments inside agentstream's protocol, with every service they need generated locally.

A task family turns a seed into a skyrl-gym env plus its prompt, and owns the parser for its action tags:

    text2sql  skyrl `text2sql` on a generated SQLite company database; `<sql>` runs a query,
              `<think>...</think><solution>SQL</solution>` ends the episode (reward 1 if its rows equal the
              gold query's, 0 if not, -1 if skyrl's format check fails: it wants `<think>` before each reply)
    search    skyrl `search` against a BM25 retriever over a generated encyclopedia, served on loopback
              HTTP; `<search>query</search>` retrieves, `<answer>...</answer>` ends (exact match)
    code      a generated stdin/stdout task, single turn, ```python ...``` graded in a sandboxed subprocess
              (`skyrl_env="lcb"` grades it with skyrl's own LiveCodeBench grader instead: a fork, no limits)
    multitool one env, three tools (search the encyclopedia, read-only SQL on the company database, python in
              the sandbox), each task needing one of them; Hermes/Qwen `<tool_call>{"name": ..., "arguments":
              {...}}</tool_call>` calls, results in `<tool_response>`, `<answer>...</answer>` ends (1 if right)

    env = envs.make("agentstream/SkyRL-v0", task="text2sql", max_steps=5)
    obs, info = env.reset(seed=0)
    obs, reward, terminated, truncated, info = env.step("<think>count</think><sql>SELECT 1</sql>")

Steps block (SQLite, HTTP, subprocesses), hence `blocking = True`: the actor runs them in a thread.
"""

from __future__ import annotations

import json
import re
import shutil
import tempfile
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

from agentstream.registry import lookup
from envs.base import Action, ParseFailure, ParseResult, StepResult, TextGame, text_space


@dataclass
class SkyRLTask:
    """One episode's set-up: what `skyrl_gym.make` and `init` need, and how a scripted agent succeeds."""

    prompt: str
    extras: dict[str, Any]
    env_config: Any = None
    gold: dict[str, Any] = field(default_factory=dict)


class TaskFamily(Protocol):
    skyrl_env: str
    instructions: str

    def task(self, seed: int, max_steps: int) -> SkyRLTask: ...

    def parse(self, text: str) -> ParseResult: ...

    def close(self) -> None: ...


def _tag_parser(tags: tuple[str, ...]) -> Callable[[str], ParseResult]:
    patterns = [(tag, re.compile(rf"<{tag}>(.*?)</{tag}>", re.DOTALL)) for tag in tags]
    shown = " or ".join(f"<{t}>...</{t}>" for t in tags)

    def parse(text: str) -> ParseResult:
        """Action(text) when `text` holds a non-empty tag the skyrl env acts on. Never raises."""
        if not isinstance(text, str):
            return ParseFailure(f"expected text, got {type(text).__name__}")
        for _tag, pattern in patterns:
            match = pattern.search(text)
            if match and match.group(1).strip():
                return Action(text)  # skyrl's env parses the text itself; this only vets it
        return ParseFailure(f"no non-empty {shown} found")

    return parse


parse_sql_action = _tag_parser(("solution", "sql"))
parse_search_action = _tag_parser(("answer", "search"))
_CODE_RE = re.compile(r"```(?:\w+)?\n(.*?)```", re.DOTALL)  # skyrl's lcb extractor


def parse_multitool_action(text: str) -> ParseResult:
    """Action(text) when `text` holds a non-empty <answer> or at least one tool call, all well formed and naming
    known tools; else why not. Never raises."""
    if not isinstance(text, str):
        return ParseFailure(f"expected text, got {type(text).__name__}")
    from envs.tools.multitool import invalid_reason  # skyrl_gym (pandas: 1.6 s) loads once this family is used

    reason = invalid_reason(text)
    return Action(text) if reason is None else ParseFailure(reason)


def parse_code_action(text: str) -> ParseResult:
    """Action(text) when `text` holds a non-empty ``` code block. Never raises."""
    if not isinstance(text, str):
        return ParseFailure(f"expected text, got {type(text).__name__}")
    blocks = _CODE_RE.findall(text)
    if not blocks or not blocks[-1].strip():
        return ParseFailure("no ```python ...``` code block found")
    return Action(text)


class Text2SQLFamily:
    skyrl_env = "text2sql"
    instructions = (
        "Answer the question about the SQLite database by writing SQL. Start every reply with "
        "<think>your reasoning</think>. To run an exploratory query, add <sql>QUERY</sql>; you will see its "
        "result. When you are sure, reply <think>...</think><solution>FINAL SQL QUERY</solution>: its result "
        "is compared with the correct query's."
    )

    def __init__(self) -> None:
        self._root = tempfile.mkdtemp(prefix="agentstream-text2sql-")

    def task(self, seed: int, max_steps: int) -> SkyRLTask:
        from skyrl_gym.envs.sql.env import Text2SQLEnvConfig

        from envs.tools import sql_tasks

        shutil.rmtree(f"{self._root}/spider", ignore_errors=True)  # one database at a time per env
        t = sql_tasks.make_task(seed, self._root)
        prompt = f"Database schema:\n{sql_tasks.SCHEMA}\n\nQuestion: {t.question}"
        extras = {
            "db_id": t.db_id,
            "reward_spec": {"ground_truth": t.gold_sql},
            "data": "spider",
            "max_turns": max_steps,
        }
        return SkyRLTask(prompt, extras, Text2SQLEnvConfig(db_path=self._root), {"sql": t.gold_sql})

    parse = staticmethod(parse_sql_action)

    def close(self) -> None:
        shutil.rmtree(self._root, ignore_errors=True)


class SearchFamily:
    skyrl_env = "search"
    instructions = (
        "Answer the question using a search engine over an encyclopedia. To search, reply "
        "<search>your query</search>; the top documents come back inside <information>. When you know the "
        "answer, reply <answer>the answer, as short as possible</answer>."
    )

    def __init__(self, corpus_seed: int = 0, n_towns: int = 300, topk: int = 3):
        from envs.tools import retriever

        self.topk = topk
        self._towns = retriever.make_corpus(corpus_seed, n_towns)
        self._server = retriever.acquire_server(corpus_seed, n_towns)

    def task(self, seed: int, max_steps: int) -> SkyRLTask:
        from skyrl_gym.envs.search.env import SearchEnvConfig

        from envs.tools import retriever

        t = retriever.make_task(seed, self._towns)
        config = SearchEnvConfig(search_url=self._server.url, topk=self.topk, timeout=10, log_requests=False)
        extras = {"reward_spec": {"ground_truth": {"target": t.answers}}, "max_turns": max_steps}
        return SkyRLTask(f"Question: {t.question}", extras, config, {"answers": t.answers, "town": t.town})

    parse = staticmethod(parse_search_action)

    def close(self) -> None:
        from envs.tools import retriever

        if self._server is not None:
            retriever.release_server(self._server)
            self._server = None


class CodeFamily:
    instructions = (
        "Write a Python 3 program that reads standard input and writes standard output as the task says. "
        "Reply with the whole program in one ```python ...``` block. It is run against hidden tests."
    )

    def __init__(
        self, n_tests: int = 5, time_limit_s: float = 5.0, memory_mb: int = 256, skyrl_env: str = "agentstream_code"
    ):
        from envs.tools import code_tasks

        code_tasks.register_skyrl_env()
        self.skyrl_env, self.n_tests = skyrl_env, n_tests
        self.time_limit_s, self.memory_mb = time_limit_s, memory_mb

    def task(self, seed: int, max_steps: int) -> SkyRLTask:
        from envs.tools import code_tasks

        t = code_tasks.make_task(seed, self.n_tests)
        example = t.tests[0]
        prompt = f"{t.statement}\n\nExample input:\n{example['input']}\nExample output:\n{example['output']}"
        extras = {
            "reward_spec": {"ground_truth": json.dumps(t.tests)},
            "time_limit_s": self.time_limit_s,
            "memory_mb": self.memory_mb,
        }
        return SkyRLTask(prompt, extras, None, {"solution": t.solution})

    parse = staticmethod(parse_code_action)

    def close(self) -> None:
        pass


class MultiToolFamily:
    skyrl_env = "agentstream_multitool"
    instructions = (
        "Answer the question with the tools the task lists (search, sql, python). To call one, reply "
        '<tool_call>{"name": ..., "arguments": {...}}</tool_call>; each result comes back inside '
        "<tool_response>. When you know the answer, reply <answer>the answer, as short as possible</answer>."
    )

    def __init__(self, corpus_seed: int = 0, n_towns: int = 300, time_limit_s: float = 5.0, memory_mb: int = 256):
        from envs.tools import multitool, retriever

        multitool.register_skyrl_env()
        self.time_limit_s, self.memory_mb = time_limit_s, memory_mb
        self._towns = retriever.make_corpus(corpus_seed, n_towns)
        self._root = tempfile.mkdtemp(prefix="agentstream-multitool-")
        self._server = retriever.acquire_server(corpus_seed, n_towns)

    def task(self, seed: int, max_steps: int) -> SkyRLTask:
        from envs.tools import multitool

        shutil.rmtree(f"{self._root}/spider", ignore_errors=True)  # one database at a time per env
        t = multitool.make_task(seed, self._towns, self._root)
        extras = {
            "reward_spec": {"ground_truth": t.answers},
            "max_turns": max_steps,
            "db_path": t.db_path,
            "search_url": self._server.url,
            "time_limit_s": self.time_limit_s,
            "memory_mb": self.memory_mb,
        }
        gold = {"answer": t.answers[0], "tool": t.kind, "call": t.call}
        return SkyRLTask(multitool.prompt(t.question), extras, None, gold)

    parse = staticmethod(parse_multitool_action)

    def close(self) -> None:
        from envs.tools import retriever

        if self._server is not None:
            retriever.release_server(self._server)
            self._server = None
        shutil.rmtree(self._root, ignore_errors=True)


FAMILIES: dict[str, Callable[..., TaskFamily]] = {
    "text2sql": Text2SQLFamily,
    "search": SearchFamily,
    "code": CodeFamily,
    "multitool": MultiToolFamily,
}


class SkyRLGymEnv(TextGame):
    """A skyrl-gym env per episode, driven through `init(prompt_messages)` / `step(text)`."""

    metadata = {"render_modes": []}
    blocking = True

    def __init__(self, task: str = "text2sql", max_steps: int = 5, **task_kwargs: Any):
        family = lookup(FAMILIES, task, "skyrl task")
        self.task_name, self.max_steps = task, max_steps
        self.family = family(**task_kwargs)
        self.instructions = self.family.instructions
        self.observation_space = text_space(max_length=65536)
        self.action_space = text_space(max_length=65536)
        self.task: SkyRLTask | None = None
        self._env: Any = None
        self._obs = ""
        self._steps = 0

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[str, dict[str, Any]]:
        import skyrl_gym

        super().reset(seed=seed)
        task_seed = int(self.np_random.integers(2**31)) if seed is None else seed
        self._close_episode()
        self.task = self.family.task(task_seed, self.max_steps)
        self._env = skyrl_gym.make(self.family.skyrl_env, env_config=self.task.env_config, extras=self.task.extras)
        messages, _ = self._env.init([{"role": "user", "content": self.task.prompt}])
        self._obs = "\n".join(m["content"] for m in messages)
        self._steps = 0
        return self._obs, self._info(valid=True, success=False)

    def _started(self) -> bool:
        return self._env is not None

    def _parse(self, action: str) -> ParseResult:
        return self.family.parse(action)

    def _invalid(self) -> tuple[str, dict[str, Any]]:
        return self._obs, self._info(valid=False, success=False)

    def _step(self, text: str) -> StepResult:
        out = self._env.step(text)
        reward, done = float(out["reward"]), bool(out["done"])
        self._obs = "\n".join(m["content"] for m in out["observations"]).strip() or "(the episode is over)"
        info = self._info(valid=True, success=done and reward >= 1.0)
        info["skyrl_metadata"] = out.get("metadata") or {}
        return self._obs, reward, done, False, info

    def _info(self, valid: bool, success: bool) -> dict[str, Any]:
        return {"valid": valid, "success": success, "anchor": f"step {self._steps}\n{self._obs}"}

    def _close_episode(self) -> None:
        if self._env is not None:
            self._env.close()
            self._env = None

    def close(self) -> None:
        self._close_episode()
        self.family.close()
