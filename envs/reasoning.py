"""Reasoning tasks from reasoning-gym: any of its procedural generators, one item per seed.

The item is a pure function of the reset seed (`reasoning_gym.create_dataset(name, seed=seed, size=1)[0]`),
so the G episodes of a group get the same question, and it is scored by the generator's own verifier
(`dataset.score_answer`, a float in [0, 1]; some generators give a small credit, e.g. 0.01, to a
well-formed wrong answer). The model answers with `<answer>...</answer>`. With `max_attempts > 1` a wrong
answer is answered with feedback and the model tries again; the episode ends on a correct answer or on the
last attempt, whose score is the reward.

    env = envs.make("agentstream/Reasoning-v0", dataset="countdown", max_attempts=3, max_steps=6)
    obs, info = env.reset(seed=3)
    obs, reward, terminated, truncated, info = env.step("<answer>39 - 14 + 93 + 51</answer>")
"""

from __future__ import annotations

import functools
import json
import re
from typing import Any

from agentstream.registry import unknown_name
from envs.base import Action, ParseFailure, ParseResult, StepResult, TextGame, text_space

# Names people reach for that reasoning-gym spells differently.
ALIASES = {"arithmetic": "basic_arithmetic", "math": "basic_arithmetic"}
_ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL | re.IGNORECASE)

INSTRUCTIONS = (
    "Solve the problem. Think step by step if it helps, then give only your final answer inside "
    "<answer>...</answer>, in the format the problem asks for."
)


def parse_answer(text: str) -> ParseResult:
    """The last `<answer>...</answer>` in `text` -> Action(stripped answer). Never raises."""
    if not isinstance(text, str):
        return ParseFailure(f"expected text, got {type(text).__name__}")
    matches = _ANSWER_RE.findall(text)
    if not matches:
        return ParseFailure("no <answer>...</answer> tag found")
    answer = matches[-1].strip()  # the last tag: models often restate a corrected answer at the end
    if not answer:
        return ParseFailure("the <answer> tag is empty")
    return Action(answer)


_NUMBER_RE = re.compile(r"-?\d+(?:\.\d+)?")
ANSWER_FORMATS = ("tag", "last_number")


def parse_last_number(text: str) -> ParseResult:
    """The last `<answer>` tag as `parse_answer` reads it, else the last number in `text` (lm-eval's "flexible
    extract" for GSM8K): a small chat model that states the result in a sentence is scored on it. Never raises."""
    tagged = parse_answer(text)
    if isinstance(tagged, Action) or not isinstance(text, str):
        return tagged
    numbers = _NUMBER_RE.findall(text)
    return Action(numbers[-1]) if numbers else ParseFailure("no <answer>...</answer> tag and no number found")


def dataset_names() -> list[str]:
    """Every reasoning-gym generator name."""
    import reasoning_gym

    return sorted(reasoning_gym.factory.DATASETS)


def resolve_name(name: str) -> str:
    """A generator name, or a KeyError that lists the known ones."""
    name = ALIASES.get(name, name)
    known = dataset_names()
    if name not in known:
        raise KeyError(unknown_name("reasoning-gym dataset", name, known))
    return name


@functools.lru_cache(maxsize=4096)
def _item(name: str, seed: int, kwargs_json: str) -> tuple[Any, dict[str, Any]]:
    # Cached so that the G resets of a group (same seed) generate the item once; some generators take
    # tens of milliseconds (puzzle24 searches for a solvable hand).
    import reasoning_gym

    dataset = reasoning_gym.create_dataset(name, seed=seed, size=1, **json.loads(kwargs_json))
    return dataset, dataset[0]


def load_item(name: str, seed: int, dataset_kwargs: dict[str, Any] | None = None) -> tuple[Any, dict[str, Any]]:
    """(dataset, entry) for generator `name` at `seed`; the entry has `question`, `answer`, `metadata`."""
    return _item(resolve_name(name), int(seed), json.dumps(dataset_kwargs or {}, sort_keys=True))


def score(dataset: Any, entry: dict[str, Any], answer: str) -> float:
    """The generator's own verifier; a verifier that crashes on a malformed answer scores 0."""
    try:
        return float(dataset.score_answer(answer, entry))
    except Exception:  # noqa: BLE001 - third-party scorers raise anything on odd answers; an odd answer is wrong
        return 0.0


class ReasoningEnv(TextGame):
    """A reasoning-gym item as a text game (see the module docstring)."""

    metadata = {"render_modes": []}
    instructions = INSTRUCTIONS

    def __init__(
        self,
        dataset: str = "basic_arithmetic",
        max_attempts: int = 1,
        max_steps: int | None = None,
        dataset_kwargs: dict[str, Any] | None = None,
        answer_format: str = "tag",
    ):
        if max_attempts < 1:
            raise ValueError(f"max_attempts={max_attempts}: must be at least 1")
        if answer_format not in ANSWER_FORMATS:
            raise ValueError(
                f"answer_format={answer_format!r}: use one of {', '.join(ANSWER_FORMATS)} (last_number: "
                f"without a tag, the last number in the answer is read)"
            )
        self.answer_format = answer_format
        self.dataset_name = resolve_name(dataset)
        self.dataset_kwargs = dict(dataset_kwargs or {})
        self.max_attempts = max_attempts
        # Unparseable answers do not use up an attempt but do use up steps.
        self.max_steps = max_steps if max_steps is not None else 2 * max_attempts
        self.observation_space = text_space(max_length=65536)
        self.action_space = text_space(max_length=65536)
        self._dataset: Any = None
        self._entry: dict[str, Any] = {}
        self._attempts: list[str] = []
        self._steps = 0
        self._obs = ""

    @property
    def entry(self) -> dict[str, Any]:
        """The current item (question, answer, metadata): for scripted agents and tests."""
        return self._entry

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[str, dict[str, Any]]:
        super().reset(seed=seed)
        item_seed = int(self.np_random.integers(2**31)) if seed is None else seed
        self._dataset, self._entry = load_item(self.dataset_name, item_seed, self.dataset_kwargs)
        self._attempts, self._steps = [], 0
        self._obs = self._entry["question"]
        if self.max_attempts > 1:
            self._obs += f"\n\nYou have {self.max_attempts} attempts."
        return self._obs, self._info(valid=True, success=False)

    def _started(self) -> bool:
        return self._dataset is not None

    def _parse(self, action: str) -> ParseResult:
        return parse_last_number(action) if self.answer_format == "last_number" else parse_answer(action)

    def _invalid(self) -> tuple[str, dict[str, Any]]:
        return self._obs, self._info(valid=False, success=False)

    def _step(self, answer: str) -> StepResult:
        self._attempts.append(answer)
        value = score(self._dataset, self._entry, answer)
        success = value >= 1.0
        left = self.max_attempts - len(self._attempts)
        terminated = success or left == 0
        if not terminated:
            self._obs = self._feedback(answer, left)
            value = 0.0  # only the attempt that ends the episode is scored
        info = self._info(valid=True, success=success)
        info["score"] = value
        return self._obs, value, terminated, False, info

    def _feedback(self, answer: str, left: int) -> str:
        return (
            f"{self._entry['question']}\n\nYour answer {answer!r} is not correct. "
            f"You have {left} attempt{'s' if left != 1 else ''} left."
        )

    def _info(self, valid: bool, success: bool) -> dict[str, Any]:
        anchor = f"{self._entry.get('question', '')}\nattempts: {json.dumps(self._attempts)}"
        return {"valid": valid, "success": success, "anchor": anchor, "dataset": self.dataset_name}

    def close(self) -> None:
        self._dataset = None
