"""Policy losses, off-policy corrections, KL estimators, aggregation: by hand, and fast == reference."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from learner.losses import (
    KL_ESTIMATORS,
    PolicyLossInput,
    aggregate,
    gspo,
    kl_estimate,
    policy_objective,
    policy_objective_reference,
    ppo_clip,
)
from learner.offpolicy import get_off_policy

LN = math.log


def one_row(logp, prox, adv, behav=None, mask=None) -> PolicyLossInput:
    logp = torch.tensor([logp], dtype=torch.float32, requires_grad=True)
    prox = torch.tensor([prox])
    return PolicyLossInput(logp=logp, prox_logp=prox, behav_logp=prox if behav is None else torch.tensor([behav]),
                           advantages=torch.tensor([adv]), mask=torch.ones_like(prox, dtype=torch.bool)
                           if mask is None else torch.tensor([mask]))


def test_ppo_clip_higher_and_dual_clip_by_hand():
    # ratios r = exp(logp - prox) = [1.5, 5, 2, 5]; advantages [1, -1, -1, 1]; clip 0.2 / 0.28, dual c = 3:
    #   t0: A=1,  r=1.5: max(-1.5, -1.28) = -1.28 (clip-higher bound 1.28; symmetric 0.2 would give -1.2)
    #   t1: A=-1, r=5:   max(5, 1.28) = 5 -> dual-clip min(5, 3) = 3
    #   t2: A=-1, r=2:   max(2, 1.28) = 2 < 3, unchanged
    #   t3: A=1,  r=5:   max(-5, -1.28) = -1.28 (dual-clip only touches A < 0)
    inp = one_row([LN(1.5), LN(5), LN(2), LN(5)], [0.0] * 4, [1.0, -1.0, -1.0, 1.0])
    terms, stats = ppo_clip(inp, clip_low=0.2, clip_high=0.28, dual_clip=3.0)
    assert terms[0].tolist() == pytest.approx([-1.28, 3.0, 2.0, -1.28], abs=1e-6)
    assert stats["dual_clip_frac"] == pytest.approx(0.25) and stats["ppo_clip_frac"] == pytest.approx(0.5)
    terms[0].sum().backward()
    # gradient -A r where unclipped (t2: +1 * 2 = 2), 0 where clipped (t0, t3) or dual-clipped (t1)
    assert inp.logp.grad[0].tolist() == pytest.approx([0.0, 0.0, 2.0, 0.0], abs=1e-6)
    terms, _ = ppo_clip(inp, clip_low=0.2, clip_high=0.2, dual_clip=0.0)
    assert terms[0].tolist() == pytest.approx([-1.2, 5.0, 2.0, -1.2], abs=1e-6)


def test_gspo_sequence_ratio_by_hand():
    # one sequence, token log-ratios [ln 2, 0]: s = exp((ln 2 + 0) / 2) = sqrt(2) = 1.41421, A = 1.
    #   clip 0.2 / 0.28: s clipped at 1.28 -> every token's term -1.28, no gradient;
    #   clip 0.2 / 0.5:  s = 1.41421 unclipped -> terms -1.41421; with seq-mean-token-mean the loss is
    #   -s and d loss / d logp_t = -s * 1/2 = -0.70711 for both tokens (GSPO's gradient, spread evenly).
    inp = one_row([LN(2), 0.0], [0.0, 0.0], [1.0])
    terms, _ = gspo(inp, clip_low=0.2, clip_high=0.28, dual_clip=0.0)
    assert terms[0].tolist() == pytest.approx([-1.28, -1.28], abs=1e-6)
    loss, _ = policy_objective(inp, loss="gspo", clip_low=0.2, clip_high=0.5, agg="seq-mean-token-mean", off_policy="none")
    assert float(loss.detach()) == pytest.approx(-math.sqrt(2), abs=1e-6)
    loss.backward()
    assert inp.logp.grad[0].tolist() == pytest.approx([-math.sqrt(2) / 2] * 2, abs=1e-6)


def test_aggregation_modes_by_hand():
    # terms [[1, 2, 3], [4, x, x]] (x masked):
    #   token-mean (1+2+3+4)/4 = 2.5; seq-mean-token-sum (6 + 4)/2 = 5; seq-mean-token-mean (2 + 4)/2 = 3;
    #   seq-mean-token-sum-norm with L = 4: (6/4 + 4/4)/2 = 1.25; with global denominators 8 tokens / 5 seqs:
    #   token-mean 10/8 = 1.25, seq-mean-token-sum 10/5 = 2.
    terms = torch.tensor([[1.0, 2.0, 3.0], [4.0, float("nan"), 9.0]])
    mask = torch.tensor([[True, True, True], [True, False, False]])
    assert float(aggregate(terms, mask, "token-mean")) == pytest.approx(2.5)
    assert float(aggregate(terms, mask, "seq-mean-token-sum")) == pytest.approx(5.0)
    assert float(aggregate(terms, mask, "seq-mean-token-mean")) == pytest.approx(3.0)
    assert float(aggregate(terms, mask, "seq-mean-token-sum-norm", norm_length=4)) == pytest.approx(1.25)
    assert float(aggregate(terms, mask, "token-mean", token_denom=8.0)) == pytest.approx(1.25)
    assert float(aggregate(terms, mask, "seq-mean-token-sum", seq_denom=5.0)) == pytest.approx(2.0)
    with pytest.raises(KeyError, match="known: token-mean"):
        aggregate(terms, mask, "token-sum")


def test_kl_estimators_by_hand():
    # pi = 0.5, pi_ref = 0.25: log r = log(pi_ref / pi) = -ln 2 = -0.693147
    #   k1 = -log r = 0.693147;  k2 = (log r)^2 / 2 = 0.240227;  k3 = r - 1 - log r = 0.5 - 1 + 0.693147 = 0.193147
    logp, ref = torch.tensor([LN(0.5)]), torch.tensor([LN(0.25)])
    assert float(kl_estimate("k1", logp, ref)) == pytest.approx(0.693147, abs=1e-6)
    assert float(kl_estimate("k2", logp, ref)) == pytest.approx(0.240227, abs=1e-6)
    assert float(kl_estimate("k3", logp, ref)) == pytest.approx(0.193147, abs=1e-6)
    with pytest.raises(KeyError, match="known: abs, abs\\+, k1, k1\\+, k2, k3, k3\\+, kl, kl\\+, low_var_kl"):
        kl_estimate("k4", logp, ref)


def verl_kl(name: str, logp: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """verl's `kl_penalty` (verl/trainer/ppo/core_algos.py), written out here in float64: the forward value of
    the named estimator, and for a name ending in `+` the straight-through k2 gradient."""
    base = name.removesuffix("+")
    if base in ("kl", "k1"):
        forward = logp - ref
    elif base == "abs":
        forward = (logp - ref).abs()
    elif base in ("mse", "k2"):
        forward = 0.5 * (logp - ref).square()
    else:  # low_var_kl, k3
        kl = torch.clamp(ref - logp, min=-20, max=20)
        forward = torch.clamp(torch.exp(kl) - kl - 1, min=-10, max=10)
    if not name.endswith("+"):
        return forward
    backward = 0.5 * (logp - ref).square()
    return backward - backward.detach() + forward.detach()


def test_a_huge_ratio_gives_verls_clamped_k3_and_no_gradient():
    # log r = ref - logp = 25 -> clamped to 20: e^20 - 1 - 20 = 4.85e8, then clamped to 10 (verl's low_var_kl);
    # at the clamp the estimate does not depend on logp: gradient 0. log r = -ln 2 stays 0.193147 (above).
    logp = torch.tensor([-30.0, LN(0.5)], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([-5.0, LN(0.25)], dtype=torch.float64)
    k = kl_estimate("k3", logp, ref)
    assert k.tolist() == pytest.approx([10.0, 0.193147], abs=1e-6)
    k.sum().backward()
    # d/dlogp (r - 1 - log r) = -r + 1 with r = 0.5: 0.5 for the second token
    assert logp.grad.tolist() == pytest.approx([0.0, 0.5], abs=1e-9)


@pytest.mark.parametrize("name", sorted(KL_ESTIMATORS))
def test_every_kl_estimator_is_verls_on_random_and_extreme_inputs(name):
    gen = torch.Generator().manual_seed(7)
    logp = torch.randn(4, 9, generator=gen, dtype=torch.float64) * 3 - 2  # [B, T]
    ref = torch.randn(4, 9, generator=gen, dtype=torch.float64) * 3 - 2
    logp[0, :3], ref[0, :3] = torch.tensor([-40.0, -1e-3, -25.0]), torch.tensor([-1e-3, -40.0, -25.0])  # extremes
    ours_in, verl_in = logp.clone().requires_grad_(), logp.clone().requires_grad_()
    ours, theirs = kl_estimate(name, ours_in, ref), verl_kl(name, verl_in, ref)
    assert torch.allclose(ours, theirs, atol=1e-6, rtol=0)
    (ours * torch.linspace(0.5, 2, 9, dtype=torch.float64)).sum().backward()
    (theirs * torch.linspace(0.5, 2, 9, dtype=torch.float64)).sum().backward()
    assert torch.allclose(ours_in.grad, verl_in.grad, atol=1e-6, rtol=0)


def test_straight_through_variants_take_k2s_gradient():
    # k3+ at log r = -ln 2: value k3 = 0.193147; gradient of k2 = (logp - ref) = ln 2 = 0.693147
    logp = torch.tensor([LN(0.5)], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([LN(0.25)], dtype=torch.float64)
    k = kl_estimate("k3+", logp, ref)
    k.backward()
    assert float(k.detach()) == pytest.approx(0.193147, abs=1e-6)
    assert float(logp.grad) == pytest.approx(0.693147, abs=1e-6)


def test_masked_is_counts_tokens_and_sequences():
    # token level, C = 2, log(prox/behav) = [0, ln 3, -ln 3, ln 1.5]: ratios 3 > 2 and 1/3 < 1/2 leave [1/2, 2]
    #   -> 2 of 4 tokens dropped; weights [1, 0, 0, 1.5]
    prox = torch.zeros(1, 4)
    behav = -torch.tensor([[0.0, LN(3), -LN(3), LN(1.5)]])
    mask = torch.ones(1, 4, dtype=torch.bool)
    (w, keep), stats = get_off_policy("mis")(prox, behav, mask, level="token", cap=2.0)
    assert w[0].tolist() == pytest.approx([1.0, 0.0, 0.0, 1.5]) and keep[0].tolist() == [True, False, False, True]
    assert stats["is_masked_tokens"] == 2 and stats["is_mask_frac"] == 0.5 and stats["is_masked_seqs"] == 1
    # sequence level: seq 0 ratios [1.5, 1.5] -> product 2.25 > 2: dropped whole; seq 1 [3, 1/2] -> 1.5 kept
    behav = -torch.tensor([[LN(1.5), LN(1.5)], [LN(3), -LN(2)]])
    (w, keep), stats = get_off_policy("mis")(torch.zeros(2, 2), behav, torch.ones(2, 2, dtype=torch.bool),
                                             level="sequence", cap=2.0)
    assert keep.tolist() == [[False, False], [True, True]] and w[1].tolist() == pytest.approx([1.5, 1.5])
    assert stats["is_masked_seqs"] == 1 and stats["is_masked_tokens"] == 2
    # TIS caps the same sequences at 2 (seq 0: 2.25 -> 2); decoupled keeps 2.25; none weights 1
    (w, _), stats = get_off_policy("tis")(torch.zeros(2, 2), behav, torch.ones(2, 2, dtype=torch.bool),
                                          level="sequence", cap=2.0)
    assert w.flatten().tolist() == pytest.approx([2.0, 2.0, 1.5, 1.5]) and stats["is_clip_frac"] == 0.5
    assert stats["is_ratio_max"] == pytest.approx(2.25)
    (w, _), _ = get_off_policy("decoupled")(torch.zeros(2, 2), behav, torch.ones(2, 2, dtype=torch.bool),
                                            level="sequence", cap=2.0)
    assert w.flatten().tolist() == pytest.approx([2.25, 2.25, 1.5, 1.5])
    with pytest.raises(KeyError, match="known: decoupled, mis, none, tis"):
        get_off_policy("vtrace")


def test_objective_entropy_and_kl_terms_by_hand():
    # one token, r = 1, A = 1, w = 1: pg = -1; entropy 0.7 with coef 0.1 -> -0.07;
    # KL k1 with logp = ln 0.5, ref = ln 0.25: 0.693147 * coef 0.5 = 0.346574. loss = -1 - 0.07 + 0.346574
    inp = PolicyLossInput(logp=torch.tensor([[LN(0.5)]]), prox_logp=torch.tensor([[LN(0.5)]]),
                          behav_logp=torch.tensor([[LN(0.5)]]), advantages=torch.tensor([1.0]),
                          mask=torch.tensor([[True]]), ref_logp=torch.tensor([[LN(0.25)]]), entropy=torch.tensor([[0.7]]))
    loss, stats = policy_objective(inp, entropy_coef=0.1, kl_coef=0.5, kl_estimator="k1")
    assert float(loss) == pytest.approx(-1.07 + 0.346574, abs=1e-6)
    assert stats["kl_mean"] == pytest.approx(0.693147, abs=1e-6) and stats["entropy_mean"] == pytest.approx(0.7)
    with pytest.raises(ValueError, match="ref_logp"):
        policy_objective(PolicyLossInput(inp.logp, inp.prox_logp, inp.behav_logp, inp.advantages, inp.mask), kl_coef=0.1)


def test_objective_matches_reference_on_random_inputs():
    g = torch.Generator().manual_seed(7)
    combos = itertools.product(["ppo_clip", "gspo"], ["tis", "mis", "decoupled", "none"], ["token", "sequence"],
                               ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
    for loss_name, off, level, agg in combos:
        b, t = int(torch.randint(1, 5, (1,), generator=g)), int(torch.randint(1, 7, (1,), generator=g))
        prox = -torch.rand(b, t, generator=g) * 4
        inp = PolicyLossInput(
            logp=prox + torch.randn(b, t, generator=g) * 0.3, prox_logp=prox,
            behav_logp=prox + torch.randn(b, t, generator=g) * 0.5,
            advantages=torch.randn(b, generator=g) if t % 2 else torch.randn(b, t, generator=g),
            mask=torch.rand(b, t, generator=g) > 0.25, ref_logp=prox + torch.randn(b, t, generator=g) * 0.3,
            entropy=torch.rand(b, t, generator=g),
        )
        kw = dict(loss=loss_name, off_policy=off, is_level=level, agg=agg, clip_low=0.2, clip_high=0.28,
                  dual_clip=3.0, is_cap=1.8, norm_length=8, entropy_coef=0.01, kl_coef=0.1,
                  kl_estimator=["k1", "k2", "k3"][b % 3])
        fast, _ = policy_objective(inp, **kw)
        assert float(fast) == pytest.approx(policy_objective_reference(inp, **kw), rel=1e-4, abs=1e-5), kw
