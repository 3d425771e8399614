"""Generated stdin/stdout programming tasks, and a SkyRL-Gym env that grades them in the sandbox.

A task is a pure function of its seed: a family (sum of multiples, word reversal, ...), its parameters and
`n_tests` test inputs; expected outputs come from a reference function, and `solution` is a reference
program (for scripted agents and tests). Tests use LiveCodeBench's format (`[{"input", "output",
"testtype": "stdin"}]`), so the same task also runs in skyrl-gym's own `lcb` env.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from typing import Any, Callable

from envs.tools.sandbox import outputs_match, run_python


@dataclass(frozen=True)
class CodeTask:
    statement: str
    tests: list[dict[str, str]]
    solution: str


def _numbers_input(rng: random.Random) -> tuple[str, list[int]]:
    xs = [rng.randint(-50, 100) for _ in range(rng.randint(1, 12))]
    return f"{len(xs)}\n{' '.join(map(str, xs))}\n", xs


def _sum_multiples(rng: random.Random) -> tuple[str, Callable[[random.Random], tuple[str, str]], str]:
    k = rng.randint(2, 7)
    statement = (
        f"The first line holds n; the second holds n integers. Print the sum of those integers that "
        f"are divisible by {k} (0 if there are none)."
    )

    def case(r: random.Random) -> tuple[str, str]:
        text, xs = _numbers_input(r)
        return text, f"{sum(x for x in xs if x % k == 0)}\n"

    solution = f"input()\nprint(sum(x for x in map(int, input().split()) if x % {k} == 0))\n"
    return statement, case, solution


def _spread(rng: random.Random) -> tuple[str, Callable[[random.Random], tuple[str, str]], str]:
    statement = "The first line holds n; the second holds n integers. Print the largest minus the smallest."

    def case(r: random.Random) -> tuple[str, str]:
        text, xs = _numbers_input(r)
        return text, f"{max(xs) - min(xs)}\n"

    return statement, case, "input()\nxs = list(map(int, input().split()))\nprint(max(xs) - min(xs))\n"


def _reverse_words(rng: random.Random) -> tuple[str, Callable[[random.Random], tuple[str, str]], str]:
    sep = rng.choice([" ", ","])
    shown = "a space" if sep == " " else "a comma"
    statement = (
        f"Read one line of words separated by {shown}. Print the words in reverse order, separated the same way."
    )
    words = ["apple", "river", "stone", "cloud", "ember", "maple", "delta", "quartz", "lumen", "fjord"]

    def case(r: random.Random) -> tuple[str, str]:
        ws = [r.choice(words) for _ in range(r.randint(1, 8))]
        return sep.join(ws) + "\n", sep.join(reversed(ws)) + "\n"

    return statement, case, f"print({sep!r}.join(reversed(input().split({sep!r}))))\n"


def _count_char(rng: random.Random) -> tuple[str, Callable[[random.Random], tuple[str, str]], str]:
    ch = rng.choice("aeiouxyz")
    statement = f"Read one line of lowercase letters. Print how many times the letter '{ch}' occurs in it."

    def case(r: random.Random) -> tuple[str, str]:
        s = "".join(r.choice("abcdeiouxyz") for _ in range(r.randint(0, 30)))
        return s + "\n", f"{s.count(ch)}\n"

    return statement, case, f"print(input().count({ch!r}))\n"


def _fibonacci(rng: random.Random) -> tuple[str, Callable[[random.Random], tuple[str, str]], str]:
    m = rng.choice([7, 10, 97, 1000, 10007])
    statement = f"Read n (0 <= n <= 5000). Print F(n) modulo {m}, where F(0) = 0, F(1) = 1 and F(n) = F(n-1) + F(n-2)."

    def fib(n: int) -> int:
        a, b = 0, 1
        for _ in range(n):
            a, b = b, (a + b) % m
        return a

    def case(r: random.Random) -> tuple[str, str]:
        n = r.randint(0, 5000)
        return f"{n}\n", f"{fib(n)}\n"

    solution = f"n = int(input())\na, b = 0, 1\nfor _ in range(n):\n    a, b = b, (a + b) % {m}\nprint(a)\n"
    return statement, case, solution


def _top_t(rng: random.Random) -> tuple[str, Callable[[random.Random], tuple[str, str]], str]:
    t = rng.randint(1, 3)
    statement = (
        f"The first line holds n; the second holds n integers. Print the {t} largest of them in "
        f"decreasing order on one line, separated by spaces (all of them if n < {t})."
    )

    def case(r: random.Random) -> tuple[str, str]:
        text, xs = _numbers_input(r)
        return text, " ".join(map(str, sorted(xs, reverse=True)[:t])) + "\n"

    solution = f"input()\nxs = sorted(map(int, input().split()), reverse=True)\nprint(' '.join(map(str, xs[:{t}])))\n"
    return statement, case, solution


FAMILIES = (_sum_multiples, _spread, _reverse_words, _count_char, _fibonacci, _top_t)


def make_task(seed: int, n_tests: int = 5) -> CodeTask:
    """The task for `seed` (a pure function of it)."""
    rng = random.Random(f"code-{seed}")
    statement, case, solution = rng.choice(FAMILIES)(rng)
    tests = []
    for _ in range(n_tests):
        text, expected = case(rng)
        tests.append({"input": text, "output": expected, "testtype": "stdin"})
    return CodeTask(statement, tests, solution)


def grade(code: str, tests: list[dict[str, str]], time_limit_s: float, memory_mb: int) -> tuple[float, str]:
    """(1.0 if every test passes else 0.0, feedback text) with the code run in the sandbox."""
    result = run_python(code, [t["input"] for t in tests], time_limit_s=time_limit_s, memory_mb=memory_mb)
    if result.status != "ok":
        return 0.0, f"{result.status}: {result.detail}".strip()
    for i, (test, out, err) in enumerate(zip(tests, result.outputs, result.errors)):
        if err is not None:
            return 0.0, f"test {i + 1}: {err}"
        if not outputs_match(out, test["output"]):
            return 0.0, f"test {i + 1}: wrong output"
    return 1.0, f"all {len(tests)} tests passed"


def _skyrl_env_class() -> type:
    from skyrl_gym.envs.base_text_env import BaseTextEnv, BaseTextEnvStepOutput
    from skyrl_gym.envs.lcb.livecodebench import extract_code_from_model

    class SandboxedCodeEnv(BaseTextEnv):
        """skyrl-gym's `lcb` contract (single turn, ```code``` in the reply, reward 1 iff all tests pass),
        graded in a sandboxed subprocess instead of a fork of the caller without memory limits."""

        def __init__(self, env_config: Any = None, extras: dict[str, Any] | None = None):
            super().__init__()
            extras = extras or {}
            self.tests = json.loads(extras["reward_spec"]["ground_truth"])
            self.time_limit_s = float(extras.get("time_limit_s", 5.0))
            self.memory_mb = int(extras.get("memory_mb", 256))

        def step(self, action: str) -> BaseTextEnvStepOutput:
            code = extract_code_from_model(action)
            if code is None:
                return BaseTextEnvStepOutput(
                    observations=[], reward=0.0, done=True, metadata={"parsed_code": None, "feedback": "no code block"}
                )
            reward, feedback = grade(code, self.tests, self.time_limit_s, self.memory_mb)
            return BaseTextEnvStepOutput(
                observations=[], reward=reward, done=True, metadata={"parsed_code": code, "feedback": feedback}
            )

    return SandboxedCodeEnv


SKYRL_ID = "agentstream_code"


def register_skyrl_env() -> None:
    """Make `skyrl_gym.make("agentstream_code", ...)` build the sandboxed code env (idempotent)."""
    import skyrl_gym

    if SKYRL_ID not in skyrl_gym.registry:
        skyrl_gym.register(id=SKYRL_ID, entry_point=_skyrl_env_class())
