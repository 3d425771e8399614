"""What the actor and the evaluator processes need of the run config, taken from it once in their `main()`.

    spec = ActorSpec.from_config(config.load("RUN/config.yaml"))
    env, mem = spec.episode.make_env(), spec.episode.make_memory(tokenizer)

Everything below `main()` receives one of these frozen specs, never the whole `Config`: what a process
depends on is written here, and a test builds one without a run folder. The sub-configs are copied, so
changing the `Config` afterwards changes no spec.
"""

from __future__ import annotations

import copy
import functools
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

import envs
import memory
from agentstream.config import Config, EnvConfig, MemoryConfig, SamplingConfig
from agentstream.models import base_model_name, served_model_name
from envs.base import EnvTraits, TextEnv


@dataclass(frozen=True)
class EpisodeSpec:
    """How one episode is played: which env, which memory within which prompt budget, how to sample."""

    env: EnvConfig
    memory: MemoryConfig
    max_prompt_tokens: int
    """The prompt budget: `memory.max_prompt_tokens`, else what the engine's context leaves after the answer."""
    sampling: SamplingConfig

    @classmethod
    def from_config(cls, cfg: Config) -> EpisodeSpec:
        budget = cfg.memory.max_prompt_tokens or cfg.engines.max_model_len - cfg.sampling.max_tokens
        return cls(copy.deepcopy(cfg.env), copy.deepcopy(cfg.memory), budget, copy.deepcopy(cfg.sampling))

    def make_env(self) -> TextEnv:
        """A new env (the caller closes it)."""
        return envs.make(self.env.name, max_steps=self.env.max_steps, **self.env.kwargs)

    @property
    def traits(self) -> EnvTraits:
        """What the env declares with these kwargs (`envs.registry.traits`; nothing is built)."""
        return envs.traits(self.env.name, self.env.kwargs)

    @property
    def seats(self) -> int:
        """Seats of one game whose turns the actor answers: 2 in a match (an episode is a match,
        `actors.episode.play_match`, with a memory per seat), else 1 (`EnvTraits.seats`)."""
        return self.traits.seats

    @property
    def frozen(self) -> bool:
        """A match with a frozen seat (`EnvTraits.frozen_seat`): its turns are sampled from a frozen copy of an
        earlier policy (`agentstream.models.FROZEN_ADAPTER_NAME`) and never sent; the env's `trained_seat` trains."""
        return self.traits.frozen_seat

    @property
    def trained_seats(self) -> int:
        """Seats whose turns are trained, each seat's trajectories in a group of its own (the groups one grant opens):
        2 in self-play, else 1."""
        return self.traits.trained_seats

    def make_memory(self, tokenizer: Any) -> memory.Memory:
        """A new memory that tokenizes with the model's `tokenizer` (prompt ids, the budget)."""
        m = self.memory
        cost, placeholder = image_cost(tokenizer.name_or_path) if m.images != "none" else (0, "")
        return memory.make(
            m.kind,
            k=m.k,
            max_events=m.max_events,
            tokenizer=tokenizer,
            max_prompt_tokens=self.max_prompt_tokens,
            images=m.images,
            image_tokens=m.image_tokens or cost,
            image_placeholder=placeholder,
        )


@functools.lru_cache(maxsize=None)
def image_cost(model_path: str) -> tuple[int, str]:
    """(prompt tokens one image adds beyond its placeholder in the model at `model_path`, as its processor expands
    a small picture (models that tile large pictures cost more for those; give memory.image_tokens then); the
    placeholder's text)."""
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(model_path)
    placeholder = processor.image_token if hasattr(processor, "image_token") else "<image>"
    ids = processor(text=placeholder, images=[np.zeros((32, 32, 3), np.uint8)], add_special_tokens=False)["input_ids"]
    return len(ids[0]) - 1, placeholder


@dataclass(frozen=True)
class ClientSpec:
    """How a process tokenizes and reaches the broker and the engines."""

    model_path: str
    """The policy's directory: its tokenizer makes the prompt ids."""
    model_name: str
    """The model name engine requests ask for (the adapter's when training LoRA)."""
    base_model_name: str | None
    """With LoRA, the name asked for while an engine serves version 0 (no adapter yet); else None."""
    curve_keys_dir: str
    """Key folder for the broker connection's CURVE encryption and authentication ("": plain TCP, loopback only)."""
    request_timeout_s: float
    """How long an engine request may take, failovers included."""
    stall_timeout_s: float = 30.0
    """A request unanswered this long has its engine probed; a probe unanswered this long: the engine stalled."""

    @classmethod
    def from_config(cls, cfg: Config) -> ClientSpec:
        return cls(
            cfg.model.path,
            served_model_name(cfg.model),
            base_model_name(cfg.model),
            cfg.broker.curve_keys_dir,
            cfg.engines.request_timeout_s,
            cfg.engines.stall_timeout_s,
        )


@dataclass(frozen=True)
class JudgeSpec:
    """How an actor's judge scores a finished episode (`judges.*`; actors/judge.py, docs/judges.md)."""

    model_path: str
    """The judge's model directory: its tokenizer and chat template make the judge's prompt ids."""
    template: str
    score_pattern: str
    default_score: float
    combine: str
    weight: float
    sampling: SamplingConfig
    """judges.max_tokens and judges.temperature (top_p 1)."""
    timeout_s: float
    max_prompt_tokens: int
    """What the judge's context leaves for the prompt after its answer: engines.max_model_len - judges.max_tokens."""

    @classmethod
    def from_config(cls, cfg: Config) -> JudgeSpec | None:
        """None when judges are off (judges.count = 0)."""
        j = cfg.judges
        if j.count < 1:
            return None
        return cls(
            j.model or cfg.model.path,
            j.template,
            j.score_pattern,
            j.default_score,
            j.combine,
            j.weight,
            SamplingConfig(max_tokens=j.max_tokens, temperature=j.temperature, top_p=1.0),
            j.timeout_s,
            cfg.engines.max_model_len - j.max_tokens,
        )


@dataclass(frozen=True)
class TeacherSpec:
    """How an actor asks a distillation teacher about each step (`distill.*`; actors/teacher.py,
    docs/distillation.md)."""

    coef: float
    """beta: a response token's reward is coef * (log pi_teacher - log pi_student)."""
    drop_task_reward: bool
    """distill.task_reward=drop: the teacher's signal replaces the env's reward (penalty and judge included)."""
    timeout_s: float
    retries: int
    """Failed requests asked again (another teacher first) before the step's group is dropped."""

    @classmethod
    def from_config(cls, cfg: Config) -> TeacherSpec | None:
        """None when distillation is off (distill.count = 0)."""
        d = cfg.distill
        if d.count < 1:
            return None
        return cls(d.coef, d.task_reward == "drop", d.timeout_s, d.retries)


@dataclass(frozen=True)
class ActorSpec:
    """Everything an actor process uses."""

    episode: EpisodeSpec
    client: ClientSpec
    episodes_per_actor: int
    """K: episodes played at once."""
    group_size: int
    """G: episodes per group (same seed)."""
    invalid_action_penalty: float
    """Added to the env reward of a step whose answer did not parse."""
    seed: int
    """The run's seed (the simulated step latency draws from it)."""
    log_interval_s: float
    """Seconds between two Stats reports."""
    max_unacked: int
    """Transitions kept until the broker acknowledges them; at this many, sending waits (back-pressure)."""
    ack_timeout_s: float
    """No acknowledgement this long: resend everything unacknowledged (the broker may have restarted)."""
    shutdown_timeout_s: float
    """How long a process gets to exit after SIGTERM; a stopping actor drains for half of it."""
    judge: JudgeSpec | None = None
    """How finished episodes are judged; None: no judge (judges.count = 0)."""
    token_reward: str = ""
    """`module:function` giving rewards on each step's response tokens (actors/token_rewards.py); "" none."""
    token_reward_kwargs: dict[str, Any] = field(default_factory=dict)
    """Its keyword arguments."""
    episode_retries: int = 2
    """An episode failed by its env (timeout, raised) or its engines is played again this many times, then dropped."""
    max_hung_steps: int = 8
    """Env steps left running after their timeout that the actor tolerates; one more and it exits."""
    share_first_turn: bool = True
    """A group's first turns are sampled in one request of n = group_size (actors.share_first_turn)."""
    teacher: TeacherSpec | None = None
    """How each step is scored by a distillation teacher; None: no teacher (distill.count = 0)."""

    @classmethod
    def from_config(cls, cfg: Config) -> ActorSpec:
        return cls(
            EpisodeSpec.from_config(cfg),
            ClientSpec.from_config(cfg),
            cfg.actors.episodes_per_actor,
            cfg.env.group_size,
            cfg.trainer.invalid_action_penalty,
            cfg.run.seed,
            cfg.run.log_interval_s,
            cfg.actors.max_unacked,
            cfg.actors.ack_timeout_s,
            cfg.run.shutdown_timeout_s,
            JudgeSpec.from_config(cfg),
            cfg.trainer.token_reward,
            dict(cfg.trainer.token_reward_kwargs),
            cfg.actors.episode_retries,
            cfg.actors.max_hung_steps,
            cfg.actors.share_first_turn,
            TeacherSpec.from_config(cfg),
        )


@dataclass(frozen=True)
class EvaluatorSpec:
    """Everything the evaluator process uses."""

    episode: EpisodeSpec
    """As the actors play, but sampled at `validation.temperature` (and, in a match, one seat against the fixed
    opponent its env declares, `EnvTraits.one_seat_kwargs`, not itself)."""
    client: ClientSpec
    episodes: int
    """Validation episodes, one per validation seed."""
    every: int
    """Validate every this many policy versions (and at version 0 and the final one)."""
    total_steps: int
    """The final policy version."""
    trajectories_per_version: int
    """Training trajectories behind one policy version: groups per step x group size."""

    @classmethod
    def from_config(cls, cfg: Config) -> EvaluatorSpec:
        """Validation plays one seat against the fixed opponent the env declares (`EnvTraits.one_seat_kwargs`), also
        when training is a match (self-play, a frozen seat): a win rate against a fixed opponent measures progress,
        one against itself does not."""
        episode = EpisodeSpec.from_config(cfg)
        episode = replace(episode, sampling=replace(episode.sampling, temperature=cfg.validation.temperature))
        traits = episode.traits
        if traits.seats > 1:
            one_seat = {**episode.env.kwargs, **dict(traits.one_seat_kwargs)}
            episode = replace(episode, env=replace(episode.env, kwargs=one_seat))
        return cls(
            episode,
            ClientSpec.from_config(cfg),
            cfg.validation.episodes,
            cfg.validation.every,
            cfg.trainer.total_steps,
            cfg.trainer.groups_per_step * cfg.env.group_size,
        )


__all__ = ["ActorSpec", "ClientSpec", "EpisodeSpec", "EvaluatorSpec", "JudgeSpec", "TeacherSpec"]
