"""Supervised warm start on the ACTION FORMAT: fit demonstrations with a masked next-token loss.

A randomly initialised tiny model almost never writes a parseable action, so every step is an invalid
action, every group's returns are equal, and every advantage is zero: RL has nothing to learn from. The
demonstrations (actors/demos.py) pair prompts exactly as an actor sends them with a uniformly drawn
admissible action `<action>A</action>` + the end-of-turn token; this module fits the answers only (the
prompt tokens are masked out of the loss). It takes any records with `prompt_ids` and `response_ids`.

Letters used in shape comments: B = batch rows, T = tokens per row, V = vocabulary.

    losses = train_sft(model, demos, SftOptions(steps=300), pad_id=tok.pad_token_id)

`python -m launcher.warm_start` (launcher/warm_start.py) is the command that makes the demonstrations, runs this
and writes a model directory.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor, nn

IGNORE = -100
"""Label of a token the loss skips (prompt tokens and padding)."""


class Demonstration(Protocol):
    """One prompt and the answer the model should write to it, as token ids."""

    @property
    def prompt_ids(self) -> list[int]: ...

    @property
    def response_ids(self) -> list[int]: ...


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


def collate(demos: Sequence[Demonstration], pad_id: int) -> tuple[Tensor, Tensor, Tensor]:
    """Right-padded (input_ids, labels, attention_mask), each [B, T]; labels are IGNORE except on answers."""
    width = max(len(d.prompt_ids) + len(d.response_ids) for d in demos)
    ids = torch.full((len(demos), width), pad_id, dtype=torch.long)  # [B, T]
    labels = torch.full((len(demos), width), IGNORE, dtype=torch.long)  # [B, T]
    mask = torch.zeros((len(demos), width), dtype=torch.long)  # [B, T]
    for row, d in enumerate(demos):
        seq = d.prompt_ids + d.response_ids
        ids[row, : len(seq)] = torch.tensor(seq)
        labels[row, len(d.prompt_ids) : len(seq)] = torch.tensor(d.response_ids)
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


def train_sft(
    model: nn.Module, demos: Sequence[Demonstration], opts: SftOptions, pad_id: int, log_every: int = 50
) -> list[dict[str, float]]:
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
            print(
                f"[warm-start] step {step + 1}/{opts.steps} loss {stats['loss']:.4f} "
                f"answer-token accuracy {stats['token_accuracy']:.3f}",
                flush=True,
            )
    model.eval()
    return history


__all__ = ["IGNORE", "Demonstration", "SftOptions", "answer_loss", "collate", "train_sft"]
