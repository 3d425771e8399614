"""Rewards on response tokens in the learner: per-token advantages reach the right tokens, and a step trains on
them only where the estimator gives returns (REINFORCE++, GAE; the sums elsewhere). The numbers against verl's
formula are in test_learner_advantages.py (`test_*_with_token_rewards_is_verls`)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch
from learner_testing import make_batch

from agentstream.config import Config
from learner.batching import Sequences, make_micro_batches
from learner.model import load_policy
from learner.step import StepOptions, make_step_models, train_step


@pytest.mark.parametrize("packing", [False, True])
def test_per_token_advantages_reach_their_own_tokens(packing: bool) -> None:
    batch = make_batch(0, 0, np.random.default_rng(3), n_groups=3, group_size=2, max_steps=3)
    seqs = Sequences.from_batch(batch)
    adv = torch.arange(seqs.num_response_tokens, dtype=torch.float32) * 0.5  # [R] a different value per token
    mbs = make_micro_batches(seqs, adv, token_budget=64, packing=packing, per_token=True)
    seen = torch.cat([mb.token_index for mb in mbs])
    assert sorted(seen.tolist()) == list(range(seqs.num_response_tokens))  # every token once
    for mb in mbs:
        assert torch.equal(mb.advantages, adv[mb.token_index])
    # [N] per transition is the same as its value repeated over the transition's tokens
    step_adv = torch.arange(seqs.num_transitions, dtype=torch.float32)
    tiled = step_adv.repeat_interleave(seqs.response_lens)
    for a, b in zip(
        make_micro_batches(seqs, step_adv, 64, packing=packing),
        make_micro_batches(seqs, tiled, 64, packing=packing, per_token=True),
    ):
        assert torch.equal(a.advantages, b.advantages)
    with pytest.raises(ValueError, match="one per response token"):
        make_micro_batches(seqs, step_adv, 64, packing=packing, per_token=True)


@pytest.mark.parametrize("advantage, moves", [("reinforce_pp", True), ("grpo", False)])
def test_token_rewards_that_sum_to_zero_move_only_a_returns_estimator(
    one_rank, tiny_model_dir: Path, advantage: str, moves: bool
) -> None:
    # +1 on each response's first token and -1 on its last: every step's whole reward is unchanged. GRPO compares
    # the sums, so its step is bit for bit the step without token rewards; REINFORCE++ gives the first token +1
    # more than the others (its reward to go), so the same step moves the weights elsewhere.
    cfg = Config()
    cfg.model.path = str(tiny_model_dir)
    cfg.algorithm.advantage, cfg.algorithm.off_policy = advantage, "none"
    opts = StepOptions.from_config(cfg.learner, cfg.algorithm)
    device = torch.device("cpu")
    batch = make_batch(0, 0, np.random.default_rng(5), n_groups=2, group_size=2, max_steps=2)
    token_rewards = np.zeros(int(batch.response_lens.sum()), np.float32)
    ends = np.cumsum(batch.response_lens)
    token_rewards[ends - batch.response_lens] += 1.0
    token_rewards[ends - 1] -= 1.0  # a one-token response: +1 - 1 on the same token
    rewarded = dataclasses.replace(batch, token_rewards=token_rewards)

    def trained(b) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = load_policy(cfg.model.path, "float32", device, 1)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        metrics = train_step(
            model,
            optimizer,
            b,
            opts,
            version=0,
            world_size=1,
            device=device,
            models=make_step_models(cfg.model, cfg.algorithm, cfg.learner, device, 1),
        )
        assert np.isfinite(metrics["loss"])
        return [p.detach().full_tensor().clone() for p in model.parameters()]

    plain, with_tokens = trained(batch), trained(rewarded)
    same = all(torch.equal(a, b) for a, b in zip(plain, with_tokens))
    assert same is not moves
