"""Demonstrations of the ACTION FORMAT for the supervised warm start (learner/sft.py fits them).

A randomly initialised tiny model almost never writes a parseable action, so RL has nothing to learn from
(every step is invalid, every advantage zero). These demonstrations teach the format only:

- prompts are exactly what an actor sends: random play through the actors' own loop (`actors.episode.play`),
  the real memory module and the model's chat template;
- each answer is `<action>A</action>` (`FormatSpec.template`) + the end-of-turn token, with A drawn UNIFORMLY
  from the env's admissible actions (or from `FormatSpec.answers`, e.g. other items' answers for an env with
  free-form answers), independent of the observation. The env steps on that same action, so the prompts
  cover the states (and history lines) random play reaches, and a model that fits the answers learns
  nothing about the solution (its best fit is a uniform choice);
- or, with `FormatSpec.teacher`, A is the teacher's choice for the state (launcher/warm_start.py gives FrozenLake a
  deliberately imperfect scripted one), and the prompts are the states the teacher reaches: a model that fits
  these answers must read the state, which gives RL something to sharpen (docs/experiments.md).

`success_rate` plays held-out seeds with any answerer (a teacher, a model) and says how often it succeeds.

    demos = format_demos(FormatSpec("agentstream/FrozenLake-v0", {"map_size": 5}, 16, "last_k", 2), tok, 200)

`python -m launcher.warm_start` (launcher/warm_start.py) is the command that makes them, fits them and writes a
model directory.
"""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import envs
import memory
from actors import episode
from actors.episode import Answer, EpisodeOutcome, StepRecord, Turn
from envs.base import TRAIN_SEEDS


@dataclass(frozen=True)
class FormatSpec:
    """Which env and memory the demonstration prompts come from (the same ones the RL run uses)."""

    env: str
    """Registered env id."""
    env_kwargs: dict[str, Any] = field(default_factory=dict)
    """The env's constructor arguments."""
    max_steps: int = 8
    """Episode step limit during random play."""
    memory: str = "last_k"
    """Memory module that builds each prompt."""
    k: int = 2
    """Memory k (recent steps shown)."""
    max_prompt_tokens: int = 0
    """Prompt token budget (0: none)."""
    template: str = "<action>{}</action>"
    """How an answer is written: the env's action format around the chosen answer."""
    answers: tuple[str, ...] = ()
    """Answers to draw from, whatever the prompt (e.g. the answers of other Reasoning items); empty: the env's
    info['admissible_actions'] at each step."""
    teacher: Callable[[Turn, random.Random], str] | None = None
    """The answer for a state (what goes inside `template`), e.g. an imperfect scripted policy; None: drawn as above,
    whatever the state."""


@dataclass(frozen=True)
class Demo:
    """One demonstration: the prompt ids an actor would send and the answer ids the model should write."""

    prompt_ids: list[int]
    response_ids: list[int]


def format_demos(spec: FormatSpec, tokenizer: Any, episodes: int, seed: int = 0) -> list[Demo]:
    """Random play of `episodes` training-seed episodes; one Demo per step (see the module docstring)."""
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError("the tokenizer has no eos_token: the answer needs an end-of-turn token to stop on")
    rng = random.Random(seed)
    demos: list[Demo] = []

    def answer(turn: Turn) -> Answer:
        if spec.teacher is not None:
            text = spec.template.format(spec.teacher(turn, rng))
            return Answer(text, tokenizer.encode(text, add_special_tokens=False) + [eos])
        actions = spec.answers or turn.info.get("admissible_actions")
        if not actions:
            raise ValueError(
                f"{spec.env} lists no info['admissible_actions']; give the format warm start answers "
                "to draw from (FormatSpec.answers)"
            )
        text = spec.template.format(rng.choice(list(actions)))
        return Answer(text, tokenizer.encode(text, add_special_tokens=False) + [eos])

    def keep(step: StepRecord[Answer]) -> None:
        assert step.turn.prompt_ids is not None  # the memory has the tokenizer
        demos.append(Demo(step.turn.prompt_ids, step.response.response_ids))

    async def play_all() -> None:
        env = envs.make(spec.env, max_steps=spec.max_steps, **spec.env_kwargs)
        try:
            for _ in range(episodes):
                mem = memory.make(
                    spec.memory, k=spec.k, tokenizer=tokenizer, max_prompt_tokens=spec.max_prompt_tokens or None
                )
                await episode.play(env, mem, answer, keep, seed=TRAIN_SEEDS[rng.randrange(10**8)])
        finally:
            env.close()

    asyncio.run(play_all())
    return demos


WARM_STAMP = "agentstream_warm_start.json"
"""The file launcher/warm_start.py leaves in the model directory it makes: its inputs' hash and what it measured."""


def warm_start_success(model_dir: str | Path) -> dict[str, float]:
    """What the warm start that made `model_dir` measured on the held-out lakes: {"teacher": its teacher's success,
    "warm_model": the warm model's} ({} for a model it did not make, or one made without a teacher)."""
    stamp = Path(model_dir) / WARM_STAMP
    try:
        made = json.loads(stamp.read_text())
    except (OSError, ValueError):
        return {}
    if "teacher_success" not in made:
        return {}
    return {"teacher": float(made["teacher_success"]), "warm_model": float(made["warm_success"])}


def success_rate(
    spec: FormatSpec,
    answer: Callable[[Turn], Answer | Awaitable[Answer]],
    seeds: Sequence[int],
    tokenizer: Any = None,
    finished: Callable[[], None] | None = None,
) -> float:
    """The share of episodes, one per seed, that `answer` wins, all played at once on one event loop (an answerer
    that batches sees every live episode's turn before it answers; `finished()` is called as each one ends). With
    a `tokenizer`, turns carry the prompt ids an actor would send."""

    async def one(seed: int) -> EpisodeOutcome:
        env = envs.make(spec.env, max_steps=spec.max_steps, **spec.env_kwargs)
        mem = memory.make(spec.memory, k=spec.k, tokenizer=tokenizer, max_prompt_tokens=spec.max_prompt_tokens or None)
        try:
            return await episode.play(env, mem, answer, seed=seed)
        finally:
            env.close()
            if finished is not None:
                finished()

    async def play_all() -> list[EpisodeOutcome]:
        return await asyncio.gather(*(one(s) for s in seeds))

    outcomes = asyncio.run(play_all())
    return sum(o.success for o in outcomes) / max(1, len(outcomes))


__all__ = ["WARM_STAMP", "Demo", "FormatSpec", "format_demos", "success_rate", "warm_start_success"]
