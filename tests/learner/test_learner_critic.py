"""The critic and the algorithm-driven train step: clipped value loss by hand and against verl's
`compute_value_loss` written out in float64, entropy forward equals the policy's log-probs, and two gloo ranks
training PPO/GAE with a critic, a frozen reference (KL in the loss), an entropy bonus, dual-clip and
sequence-level masked IS, finishing with finite losses."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from learner_oracles import clipped_value_loss_reference
from learner_testing import FakeBroker, make_batch, run_ranks

from agentstream.config import Config, save
from learner.batching import Sequences, make_micro_batches
from learner.critic import clipped_value_loss
from learner.losses import VALUE_LOSS_AGGREGATIONS, value_loss_weights
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
    # tokens [1, 3]: token-mean 0.5 (1 * 1.69 + 3 * 0.09) / 4 = 0.245; seq-mean-token-sum 0.5 (1.69 + 0.27) / 2
    # = 0.49; seq-mean-token-mean 0.5 (1.69 + 0.09) / 2 = 0.445 (as without tokens)
    tokens = torch.tensor([1, 3])
    for agg, want in [("token-mean", 0.245), ("seq-mean-token-sum", 0.49), ("seq-mean-token-mean", 0.445)]:
        loss, _ = clipped_value_loss(
            v, old, ret, torch.ones(2, dtype=torch.bool), value_clip=0.2, tokens=tokens, agg=agg
        )
        assert float(loss) == pytest.approx(want)
    # a step with no response token counts nowhere: tokens [1, 0] -> step 0 alone: 0.845 in every mode
    for agg in VALUE_LOSS_AGGREGATIONS:
        loss, stats = clipped_value_loss(
            v, old, ret, torch.ones(2, dtype=torch.bool), value_clip=0.2, tokens=torch.tensor([1, 0]), agg=agg
        )
        assert float(loss) == pytest.approx(0.845) and stats["value_tokens"] == 1.0
    with pytest.raises(KeyError, match="known: token-mean, seq-mean-token-sum, seq-mean-token-mean"):
        clipped_value_loss(v, old, ret, torch.ones(2, dtype=torch.bool), value_clip=0.2, agg="token-sum")
    g = torch.Generator().manual_seed(0)
    for i in range(10):
        v, old, ret = (torch.randn(6, generator=g) for _ in range(3))
        n = torch.randint(0, 5, (6,), generator=g)
        agg = list(VALUE_LOSS_AGGREGATIONS)[i % 3]
        loss, _ = clipped_value_loss(v, old, ret, torch.ones(6, dtype=torch.bool), value_clip=0.3, tokens=n, agg=agg)
        assert float(loss) == pytest.approx(
            clipped_value_loss_reference(v.tolist(), old.tolist(), ret.tolist(), 0.3, n.tolist(), agg), rel=1e-5
        )


def test_a_value_inside_the_clip_range_is_never_counted_as_clipped():
    # float32 V_old = 5.9606385, V = -12.633348, R = -12.078951, value_clip 100 (V is well inside the range):
    # V_old + (V - V_old) rounds to -12.633348465 (one ulp off V), whose loss is larger: the old formula counted it
    # as clipped. verl's clip_by_value (a clamp) returns V itself: same loss, not clipped.
    v, old, ret = (torch.tensor([x]) for x in (-12.633347511291504, 5.960638523101807, -12.078950881958008))
    assert float(old + (v - old)) != float(v)  # the rounding this guards against
    loss, stats = clipped_value_loss(v, old, ret, torch.ones(1, dtype=torch.bool), value_clip=100.0)
    assert stats["value_clip_frac"] == 0.0 and float(loss) == 0.5 * float((v - ret) ** 2)


def verl_compute_value_loss(vpreds, returns, values, mask, cliprange_value, loss_agg_mode):
    """verl's compute_value_loss on [B, L] token rows: clip_by_value(vpreds, values - c, values + c) (= max(min(x,
    hi), lo)); 0.5 * agg_loss(max of the two squared errors); clipfrac = masked_mean(vf_losses2 > vf_losses1).
    agg_loss: token-mean sum / tokens; seq-mean-token-sum sum_b (sum_t) / seqs; seq-mean-token-mean
    sum_b (sum_t / (n_b + 1e-8)) / seqs. E.g. one token V = 1, V_old = 0.5, R = 2, c = 0.2: V_clip = 0.7,
    max(1, 1.69) = 1.69 -> 0.845, clipfrac 1."""
    clipped = torch.max(torch.min(vpreds, values + cliprange_value), values - cliprange_value)
    l1, l2 = (vpreds - returns) ** 2, (clipped - returns) ** 2
    loss_mat, m = torch.max(l1, l2), mask.double()
    seq_mask = (m.sum(-1) > 0).double()
    if loss_agg_mode == "token-mean":
        agg = (loss_mat * m).sum() / m.sum()
    elif loss_agg_mode == "seq-mean-token-sum":
        agg = ((loss_mat * m).sum(-1) * seq_mask).sum() / seq_mask.sum()
    else:
        agg = ((loss_mat * m).sum(-1) / (m.sum(-1) + 1e-8) * seq_mask).sum() / seq_mask.sum()
    return 0.5 * agg, ((l2 > l1).double() * m).sum() / (m.sum() + 1e-8)


def test_verl_value_loss_by_hand():
    one = lambda x: torch.tensor([[x]], dtype=torch.float64)  # noqa: E731
    loss, frac = verl_compute_value_loss(one(1.0), one(2.0), one(0.5), one(1.0), 0.2, "token-mean")
    assert (float(loss), float(frac)) == pytest.approx((0.845, 1.0))


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
def test_clipped_value_loss_is_verls_with_one_value_per_step(agg):
    # A step's value, old value and return stand for each of its response tokens (verl has one per token).
    g = torch.Generator().manual_seed(5)
    for _ in range(20):
        b, length = int(torch.randint(2, 9, (1,), generator=g)), 6
        v, old, ret = (torch.randn(b, generator=g, dtype=torch.float64) * s for s in (1.0, 1.0, 2.0))
        v[0], ret[0] = 1e6, -1e6  # extreme: far outside the clip range
        old[1] = v[1]  # V = V_old: inside, never clipped
        mask = (torch.rand(b, length, generator=g) > 0.4).double()  # holes; a row may be empty
        mask[0, 0] = 1.0
        tile = lambda x: x[:, None].expand(b, length)  # noqa: E731, B023  # only called in this iteration
        want, want_frac = verl_compute_value_loss(tile(v), tile(ret), tile(old), mask, 0.3, agg)
        loss, stats = clipped_value_loss(
            v, old, ret, torch.ones(b, dtype=torch.bool), value_clip=0.3, tokens=mask.sum(-1).long(), agg=agg
        )
        assert float(loss) == pytest.approx(float(want), rel=1e-6, abs=1e-6)
        assert stats["value_clip_frac"] == pytest.approx(float(want_frac), abs=1e-6)
        # split over W = 2 ranks with the critic's global denominator (sum of the denominator parts / W):
        # the ranks' losses average to the whole batch's
        _, part = value_loss_weights(agg, mask.sum(-1))
        denom = max(float(part.sum()), 1.0) / 2
        halves = [
            clipped_value_loss(
                v[r],
                old[r],
                ret[r],
                torch.ones(len(r), dtype=torch.bool),
                value_clip=0.3,
                tokens=mask.sum(-1).long()[r],
                agg=agg,
                denom=denom,
            )[0]
            for r in (torch.arange(0, b, 2), torch.arange(1, b, 2))
        ]
        assert float(sum(halves)) / 2 == pytest.approx(float(want), rel=1e-6, abs=1e-6)


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
    shares = {
        (s, r): make_batch(
            s, r, np.random.default_rng(10 * s + r), n_groups=1 + r, vocab=vocab, max_steps=3, learner_version=s
        )
        for s in range(STEPS)
        for r in (0, 1)
    }
    argv = ["--config", str(tmp_path / "config.yaml"), "--out", str(tmp_path / "run"), "--engines", "0"]
    with FakeBroker(lambda step, rank: shares[step, rank]) as broker:
        run_ranks(2, argv + ["--broker", broker.address], timeout_s=120)
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
            int((shares[u.version - 1, r].response_lens > 0).sum()) for r in (0, 1)
        )
