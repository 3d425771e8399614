"""The critic and the algorithm-driven train step: clipped value loss by hand, entropy forward equals the
policy's log-probs, and two gloo ranks training PPO/GAE with a critic, a frozen reference (KL in the loss),
an entropy bonus, dual-clip and sequence-level masked IS, finishing with finite losses."""

from __future__ import annotations

import math
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp
from learner_testing import FakeBroker, make_batch, spawn_rank

from agentstream.config import Config, save
from agentstream.wire.addresses import free_port
from learner.batching import Sequences, make_micro_batches
from learner.critic import clipped_value_loss, clipped_value_loss_reference
from learner.model import response_logprobs, token_logprobs
from learner.step import reference_logprobs

STEPS = 2


def test_clipped_value_loss_by_hand():
    # V = [1, 0], V_old = [0.5, 0.5], R = [2, 0], clip 0.2:
    #   i0: V_clip = 0.5 + 0.2 = 0.7: max((1-2)^2 = 1, (0.7-2)^2 = 1.69) = 1.69 -> 0.845
    #   i1: V_clip = 0.5 - 0.2 = 0.3: max(0, 0.09) = 0.09 -> 0.045;   mean 0.445, both clipped
    v, old, ret = torch.tensor([1.0, 0.0]), torch.tensor([0.5, 0.5]), torch.tensor([2.0, 0.0])
    loss, stats = clipped_value_loss(v, old, ret, torch.ones(2, dtype=torch.bool), value_clip=0.2)
    assert float(loss) == pytest.approx(0.445) and stats["value_clip_frac"] == 1.0
    g = torch.Generator().manual_seed(0)
    for _ in range(10):
        v, old, ret = (torch.randn(6, generator=g) for _ in range(3))
        loss, _ = clipped_value_loss(v, old, ret, torch.ones(6, dtype=torch.bool), value_clip=0.3)
        assert float(loss) == pytest.approx(clipped_value_loss_reference(v.tolist(), old.tolist(), ret.tolist(), 0.3),
                                            rel=1e-5)


def test_entropy_forward_matches_policy_logprobs_and_reference_needs_a_source(tiny_model_dir: Path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    batch = make_batch(0, 0, np.random.default_rng(1), n_groups=1, vocab=int(model.config.vocab_size))
    seqs = Sequences.from_batch(batch)
    for packing in (False, True):
        mb = make_micro_batches(seqs, torch.zeros(seqs.num_transitions), 4096, packing=packing)[0]
        logp, ent = token_logprobs(model, mb, entropy=True)
        torch.testing.assert_close(logp, response_logprobs(model, mb), atol=1e-5, rtol=0)
        assert bool((ent > 0).all()) and bool((ent <= math.log(model.config.vocab_size) + 1e-4).all())
    with pytest.raises(RuntimeError, match="algorithm.reference=frozen_copy or LoRA"):
        reference_logprobs(model, mb)
    torch.testing.assert_close(reference_logprobs(model, mb, frozen=model), response_logprobs(model, mb).detach())


def test_two_ranks_ppo_with_critic_finish_with_finite_losses(tiny_model_dir: Path, tmp_path: Path):
    cfg = Config()
    cfg.run.output_dir = str(tmp_path)
    cfg.model.path = str(tiny_model_dir)
    cfg.learner.world_size = 2
    cfg.learner.micro_batch_tokens = 64
    cfg.trainer.total_steps = STEPS
    a = cfg.algorithm
    a.advantage, a.gamma, a.lam, a.critic_lr = "gae", 0.9, 0.9, 1e-3
    a.whiten_advantages = True  # over both ranks' shares (an all-reduce of the sums; the ranks hold 1 and 2 groups)
    a.kl_coef, a.reference, a.kl_estimator, a.entropy_coef, a.dual_clip = 0.05, "frozen_copy", "k3", 0.01, 3.0
    a.off_policy, a.is_level, a.loss_agg = "mis", "sequence", "seq-mean-token-mean"
    save(cfg, tmp_path / "config.yaml")
    vocab = 320
    shares = {(s, r): make_batch(s, r, np.random.default_rng(10 * s + r), n_groups=1 + r, vocab=vocab, max_steps=3,
                                 learner_version=s) for s in range(STEPS) for r in (0, 1)}
    argv = ["--config", str(tmp_path / "config.yaml"), "--out", str(tmp_path / "run"), "--engines", "0"]
    with FakeBroker(lambda step, rank: shares[step, rank]) as broker:
        ctx = mp.start_processes(spawn_rank, args=(2, free_port(), argv + ["--broker", broker.address]), nprocs=2,
                                 join=False, start_method="spawn")
        deadline = time.monotonic() + 120
        while not ctx.join(timeout=1.0):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    p.kill()
                pytest.fail("learner ranks still running after 120s")
    updates = [m for _, m in broker.of_kind("version_update")]
    assert [u.version for u in updates] == list(range(1, STEPS + 1))
    for u in updates:
        m = u.metrics
        for k in ("loss", "grad_norm", "critic_value_loss", "critic_grad_norm", "kl_mean", "entropy_mean"):
            assert math.isfinite(m[k]), (k, m[k])
        assert m["critic_value_loss"] > 0 and m["entropy_mean"] > 0 and m["kl_mean"] >= 0
        assert 0.0 <= m["valid_action_ratio"] <= 1.0
        assert sum(v for k, v in m.items() if k.startswith("staleness_frac_")) == pytest.approx(1.0)
        assert m["is_masked_seqs"] <= m["sequences"] and m["sequences"] == sum(
            int((shares[u.version - 1, r].response_lens > 0).sum()) for r in (0, 1))
