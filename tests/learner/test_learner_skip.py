"""Samples that carry no gradient skip the policy update's forward and backward (`learner.step.zero_gradient_samples`):
on a batch that mixes groups of equal rewards (GRPO: every advantage 0) with groups that learn, the update is the
same as without the skip, and the skipped samples and tokens are counted; a term that reads every token (an entropy
bonus, a KL in the loss) turns the skip off."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch
from learner_testing import make_batch

from agentstream.config import Config
from learner.batching import Sequences
from learner.model import load_policy
from learner.step import Skipped, StepOptions, train_step, zero_gradient_samples


def mixed_batch():
    """4 groups of 2 one-step trajectories; groups 0 and 2 have equal rewards (0, 0 and 1, 1): their advantages
    are 0."""
    batch = make_batch(0, 0, np.random.default_rng(5), n_groups=4, group_size=2, max_steps=1, vocab=300)
    rewards = np.array([0, 0, 0, 1, 1, 1, 1, 0], np.float32)  # by transition: one step each, group = index // 2
    assert list(batch.group_index) == [0, 0, 1, 1, 2, 2, 3, 3]
    return dataclasses.replace(batch, rewards=rewards)


def step(model_dir: Path, batch, skip: bool, **algo: float) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
    cfg = Config()
    cfg.learner.skip_zero_advantage = skip
    for k, v in algo.items():
        setattr(cfg.algorithm, k, v)
    torch.manual_seed(0)
    model = load_policy(str(model_dir), "float32", torch.device("cpu"), 1)
    # SGD: the update is the gradient itself (AdamW's first step divides each gradient by its own size, which would
    # blow a rounding difference in a gradient of ~1e-9 up to a whole step)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    metrics = train_step(
        model,
        optimizer,
        batch,
        StepOptions.from_config(cfg.learner, cfg.algorithm),
        version=0,
        world_size=1,
        device=torch.device("cpu"),
    )
    weights = {
        n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone() for n, p in model.named_parameters()
    }
    return metrics, weights


def test_skipping_zero_advantage_groups_gives_the_same_update(one_rank, tiny_model_dir: Path) -> None:
    batch = mixed_batch()
    skipped, kept = step(tiny_model_dir, batch, skip=True), step(tiny_model_dir, batch, skip=False)
    zero = batch.response_lens[[0, 1, 4, 5]].sum()  # groups 0 and 2
    assert skipped[0]["skipped_samples"] == 4 and skipped[0]["skipped_tokens"] == zero
    assert kept[0]["skipped_samples"] == 0
    assert skipped[0]["trained_tokens"] == batch.response_lens.sum() - zero  # only the learning groups ran
    assert skipped[0]["tokens"] == kept[0]["tokens"] == kept[0]["trained_tokens"] == batch.response_lens.sum()
    for name, w in kept[1].items():
        assert torch.allclose(skipped[1][name], w, atol=1e-8, rtol=0), name  # lr x rounding of the gradient
    assert skipped[0]["loss"] == pytest.approx(kept[0]["loss"], abs=1e-6)
    assert skipped[0]["grad_norm"] == pytest.approx(kept[0]["grad_norm"], rel=1e-5)
    assert kept[0]["grad_norm"] > 0  # the update moved the weights: the comparison above could fail


def test_a_batch_with_no_gradient_still_steps_the_optimizer_alike(one_rank, tiny_model_dir: Path) -> None:
    """Every group's rewards equal: every sample is skipped, a zero-weight micro-batch keeps the step's collectives."""
    batch = dataclasses.replace(mixed_batch(), rewards=np.array([0, 0, 1, 1, 0, 0, 1, 1], np.float32))
    skipped, kept = step(tiny_model_dir, batch, skip=True), step(tiny_model_dir, batch, skip=False)
    assert skipped[0]["skipped_samples"] == 8 and skipped[0]["trained_tokens"] == 0
    assert skipped[0]["grad_norm"] == kept[0]["grad_norm"] == 0.0
    for name, w in kept[1].items():
        assert torch.equal(skipped[1][name], w), name


@pytest.mark.parametrize("algo", [{"entropy_coef": 0.01}, {"kl_coef": 0.1, "kl_in_reward": False}])
def test_a_term_that_reads_every_token_turns_the_skip_off(algo: dict[str, float]) -> None:
    cfg = Config()
    for k, v in algo.items():
        setattr(cfg.algorithm, k, v)
    seqs = Sequences.from_batch(mixed_batch())
    zeros = torch.zeros(seqs.num_transitions)
    assert zero_gradient_samples(seqs, zeros, False, StepOptions.from_config(cfg.learner, cfg.algorithm)) == Skipped(
        None
    )


def test_per_token_advantages_skip_a_sample_only_when_all_its_tokens_are_zero() -> None:
    seqs = Sequences.from_batch(mixed_batch())
    lens = seqs.response_lens.tolist()
    adv = torch.zeros(sum(lens))  # [R]
    adv[sum(lens[:3]) + lens[3] - 1] = 0.5  # the last token of sample 3
    got = zero_gradient_samples(seqs, adv, True, StepOptions.from_config(Config().learner, Config().algorithm))
    assert got.trained.tolist() == [False, False, False, True, False, False, False, False]
    assert got.samples == 7 and got.tokens == sum(lens) - lens[3]
