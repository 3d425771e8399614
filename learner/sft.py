"""Supervised warm start on the ACTION FORMAT: teach a model to answer `<action>NAME</action>`, not how to win.

A randomly initialised tiny model almost never writes a parseable action, so every step is an invalid
action, every group's returns are equal, and every advantage is zero: RL has nothing to learn from. This
module makes demonstrations of the format only and fits them with a masked next-token loss:

- prompts are exactly what an actor would send: real env observations from random play, through the real
  memory module, rendered with the model's own chat template;
- each answer is `<action>A</action>` + the end-of-turn token, with A drawn UNIFORMLY from the env's
  admissible actions, independent of the observation. A model that fits these answers writes valid
  actions, and its choice among them carries no knowledge of the solution (its best fit is uniform).

Letters used in shape comments: B = batch rows, T = tokens per row, V = vocabulary.

    demos = format_demos(FormatSpec("agentstream/FrozenLake-v0", {"map_size": 5}, 16, "last_k", 2), tok, 200)
    losses = train_sft(model, demos, SftOptions(steps=300), pad_id=tok.pad_token_id)

`scripts/warm_start.py` is the command that runs this and writes a model directory.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from envs.base import TRAIN_SEEDS

IGNORE = -100
"""Label of a token the loss skips (prompt tokens and padding)."""


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


@dataclass(frozen=True)
class Demo:
    """One demonstration: the prompt ids an actor would send and the answer ids the model should write."""

    prompt_ids: list[int]
    response_ids: list[int]


@dataclass(frozen=True)
class SftOptions:
    """How long and how fast to fit the demonstrations."""

    steps: int = 300
    """Optimizer steps."""
    batch_size: int = 32
    """Demonstrations per step."""
    lr: float = 1e-3
    """AdamW learning rate (constant after a short linear warm-up)."""
    warmup: int = 20
    """Linear warm-up steps."""
    seed: int = 0
    """Seed of batch sampling."""


def format_demos(spec: FormatSpec, tokenizer: Any, episodes: int, seed: int = 0) -> list[Demo]:
    """Random play of `episodes` training-seed episodes; one Demo per step (see the module docstring).

    The env steps on the same uniformly drawn action the Demo answers with, so the prompts cover the states
    (and history lines) that random play reaches."""
    import envs
    import memory

    rng = random.Random(seed)
    env = envs.make(spec.env, max_steps=spec.max_steps, **spec.env_kwargs)
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError("the tokenizer has no eos_token: the answer needs an end-of-turn token to stop on")
    demos: list[Demo] = []
    try:
        for ep in range(episodes):
            mem = memory.make(spec.memory, k=spec.k, tokenizer=tokenizer, max_prompt_tokens=spec.max_prompt_tokens or None)
            obs, info = env.reset(seed=TRAIN_SEEDS[rng.randrange(10**8)])
            mem.reset(env.instructions)
            done = False
            while not done:
                actions = info.get("admissible_actions")
                if not actions:
                    raise ValueError(f"{spec.env} lists no info['admissible_actions']; the format warm start needs them")
                answer = f"<action>{rng.choice(list(actions))}</action>"
                prompt = mem.fitter.token_ids(mem.messages(obs))  # the actor's own path to its prompt ids
                demos.append(Demo(prompt, tokenizer.encode(answer, add_special_tokens=False) + [eos]))
                next_obs, _, terminated, truncated, info = env.step(answer)
                mem.record(obs, answer, info=info)
                obs, done = next_obs, terminated or truncated
    finally:
        env.close()
    return demos


def collate(demos: list[Demo], pad_id: int) -> tuple[Tensor, Tensor, Tensor]:
    """Right-padded (input_ids, labels, attention_mask), each [B, T]; labels are IGNORE except on answers."""
    width = max(len(d.prompt_ids) + len(d.response_ids) for d in demos)
    ids = torch.full((len(demos), width), pad_id, dtype=torch.long)  # [B, T]
    labels = torch.full((len(demos), width), IGNORE, dtype=torch.long)  # [B, T]
    mask = torch.zeros((len(demos), width), dtype=torch.long)  # [B, T]
    for row, d in enumerate(demos):
        seq = d.prompt_ids + d.response_ids
        ids[row, : len(seq)] = torch.tensor(seq)
        labels[row, len(d.prompt_ids): len(seq)] = torch.tensor(d.response_ids)
        mask[row, : len(seq)] = 1
    return ids, labels, mask


def answer_loss(logits: Tensor, labels: Tensor) -> tuple[Tensor, dict[str, float]]:
    """Mean cross-entropy of the labelled tokens: -1/N sum_{t: y_t != IGNORE} log p(y_t | x_<t).

    logits [B, T, V] predict the token after each position, so they are compared with labels shifted by
    one. Returns (loss, {"loss", "token_accuracy", "tokens"})."""
    pred = logits[:, :-1, :].float()  # [B, T-1, V]
    target = labels[:, 1:]  # [B, T-1]
    keep = target != IGNORE  # [B, T-1]
    n = int(keep.sum())
    if n == 0:
        raise ValueError("no labelled tokens in the batch: every demonstration needs a non-empty answer")
    loss = nn.functional.cross_entropy(pred[keep], target[keep])
    acc = (pred[keep].argmax(-1) == target[keep]).float().mean()
    return loss, {"loss": float(loss.detach()), "token_accuracy": float(acc), "tokens": float(n)}


def train_sft(model: nn.Module, demos: list[Demo], opts: SftOptions, pad_id: int,
              log_every: int = 50) -> list[dict[str, float]]:
    """Fit `demos` with `answer_loss` for `opts.steps` AdamW steps; returns each step's stats."""
    if not demos:
        raise ValueError("no demonstrations to train on")
    rng = random.Random(opts.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=opts.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / max(1, opts.warmup)))
    model.train()
    history = []
    for step in range(opts.steps):
        ids, labels, mask = collate(rng.sample(demos, min(opts.batch_size, len(demos))), pad_id)
        logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits  # [B, T, V]
        loss, stats = answer_loss(logits, labels)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        history.append(stats)
        if log_every and (step % log_every == 0 or step == opts.steps - 1):
            print(f"[warm-start] step {step + 1}/{opts.steps} loss {stats['loss']:.4f} "
                  f"answer-token accuracy {stats['token_accuracy']:.3f}", flush=True)
    model.eval()
    return history


__all__ = ["IGNORE", "Demo", "FormatSpec", "SftOptions", "answer_loss", "collate", "format_demos", "train_sft"]
