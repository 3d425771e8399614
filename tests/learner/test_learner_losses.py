"""Policy losses, off-policy corrections, KL estimators, aggregation: by hand, fast == reference, and each
against verl's formula (verl/trainer/ppo/core_algos.py) written out here in float64."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from learner_oracles import policy_objective_reference

from learner.losses import (
    KL_ESTIMATORS,
    LOSS_AGGREGATIONS,
    PolicyLossInput,
    aggregate,
    gspo,
    kl_estimate,
    loss_denominators,
    policy_objective,
    ppo_clip,
)
from learner.model import _logprob_and_entropy
from learner.offpolicy import OFF_POLICY

LN = math.log


def one_row(logp, prox, adv, behav=None, mask=None) -> PolicyLossInput:
    logp = torch.tensor([logp], dtype=torch.float32, requires_grad=True)
    prox = torch.tensor([prox])
    return PolicyLossInput(
        logp=logp,
        prox_logp=prox,
        behav_logp=prox if behav is None else torch.tensor([behav]),
        advantages=torch.tensor([adv]),
        mask=torch.ones_like(prox, dtype=torch.bool) if mask is None else torch.tensor([mask]),
    )


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
    loss, _ = policy_objective(
        inp, loss="gspo", clip_low=0.2, clip_high=0.5, agg="seq-mean-token-mean", off_policy="none"
    )
    assert float(loss.detach()) == pytest.approx(-math.sqrt(2), abs=1e-6)
    loss.backward()
    assert inp.logp.grad[0].tolist() == pytest.approx([-math.sqrt(2) / 2] * 2, abs=1e-6)


def test_aggregation_modes_by_hand():
    # terms [[1, 2, 3], [4, x, x]] (x masked):
    #   token-mean (1+2+3+4)/4 = 2.5; token-sum 10; seq-mean-token-sum (6 + 4)/2 = 5; seq-mean-token-mean
    #   (2 + 4)/2 = 3; seq-mean-token-sum-norm with L = 4: (6/4 + 4/4)/2 = 1.25; with global denominators
    #   8 tokens / 5 seqs: token-mean 10/8 = 1.25, seq-mean-token-sum 10/5 = 2; token-sum on one of W = 2 ranks
    #   (token_denom 1/2): 20, whose average with the other rank's is the global sum.
    terms = torch.tensor([[1.0, 2.0, 3.0], [4.0, float("nan"), 9.0]])
    mask = torch.tensor([[True, True, True], [True, False, False]])
    assert float(aggregate(terms, mask, "token-mean")) == pytest.approx(2.5)
    assert float(aggregate(terms, mask, "token-sum")) == pytest.approx(10.0)
    assert float(aggregate(terms, mask, "seq-mean-token-sum")) == pytest.approx(5.0)
    assert float(aggregate(terms, mask, "seq-mean-token-mean")) == pytest.approx(3.0)
    assert float(aggregate(terms, mask, "seq-mean-token-sum-norm", norm_length=4)) == pytest.approx(1.25)
    assert float(aggregate(terms, mask, "token-mean", token_denom=8.0)) == pytest.approx(1.25)
    assert float(aggregate(terms, mask, "seq-mean-token-sum", seq_denom=5.0)) == pytest.approx(2.0)
    assert float(aggregate(terms, mask, "token-sum", token_denom=0.5)) == pytest.approx(20.0)
    # the step's denominators for 8 tokens and 5 sequences over W = 2 ranks: (8/2, 5/2); token-sum (1/2, 5/2)
    assert loss_denominators("token-mean", 8.0, 5.0, 2) == (4.0, 2.5)
    assert loss_denominators("token-sum", 8.0, 5.0, 2) == (0.5, 2.5)
    assert loss_denominators("seq-mean-token-mean", 0.0, 0.0, 2) == (0.5, 0.5)  # an empty batch: never 0
    with pytest.raises(KeyError, match="known: token-mean, token-sum"):
        aggregate(terms, mask, "sum")


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
    (w, keep), stats = OFF_POLICY.get("mis")(prox, behav, mask, level="token", cap=2.0)
    assert w[0].tolist() == pytest.approx([1.0, 0.0, 0.0, 1.5]) and keep[0].tolist() == [True, False, False, True]
    assert stats["is_masked_tokens"] == 2 and stats["is_mask_frac"] == 0.5 and stats["is_masked_seqs"] == 1
    # sequence level: seq 0 ratios [1.5, 1.5] -> product 2.25 > 2: dropped whole; seq 1 [3, 1/2] -> 1.5 kept
    behav = -torch.tensor([[LN(1.5), LN(1.5)], [LN(3), -LN(2)]])
    (w, keep), stats = OFF_POLICY.get("mis")(
        torch.zeros(2, 2), behav, torch.ones(2, 2, dtype=torch.bool), level="sequence", cap=2.0
    )
    assert keep.tolist() == [[False, False], [True, True]] and w[1].tolist() == pytest.approx([1.5, 1.5])
    assert stats["is_masked_seqs"] == 1 and stats["is_masked_tokens"] == 2
    # TIS caps the same sequences at 2 (seq 0: 2.25 -> 2); decoupled keeps 2.25; none weights 1
    (w, _), stats = OFF_POLICY.get("tis")(
        torch.zeros(2, 2), behav, torch.ones(2, 2, dtype=torch.bool), level="sequence", cap=2.0
    )
    assert w.flatten().tolist() == pytest.approx([2.0, 2.0, 1.5, 1.5]) and stats["is_clip_frac"] == 0.5
    assert stats["is_ratio_max"] == pytest.approx(2.25)
    (w, _), _ = OFF_POLICY.get("decoupled")(
        torch.zeros(2, 2), behav, torch.ones(2, 2, dtype=torch.bool), level="sequence", cap=2.0
    )
    assert w.flatten().tolist() == pytest.approx([2.25, 2.25, 1.5, 1.5])
    with pytest.raises(KeyError, match="known: decoupled, mis, none, tis"):
        OFF_POLICY.get("vtrace")


def test_objective_entropy_and_kl_terms_by_hand():
    # one token, r = 1, A = 1, w = 1: pg = -1; entropy 0.7 with coef 0.1 -> -0.07;
    # KL k1 with logp = ln 0.5, ref = ln 0.25: 0.693147 * coef 0.5 = 0.346574. loss = -1 - 0.07 + 0.346574
    inp = PolicyLossInput(
        logp=torch.tensor([[LN(0.5)]]),
        prox_logp=torch.tensor([[LN(0.5)]]),
        behav_logp=torch.tensor([[LN(0.5)]]),
        advantages=torch.tensor([1.0]),
        mask=torch.tensor([[True]]),
        ref_logp=torch.tensor([[LN(0.25)]]),
        entropy=torch.tensor([[0.7]]),
    )
    loss, stats = policy_objective(inp, entropy_coef=0.1, kl_coef=0.5, kl_estimator="k1")
    assert float(loss) == pytest.approx(-1.07 + 0.346574, abs=1e-6)
    assert stats["kl_mean"] == pytest.approx(0.693147, abs=1e-6) and stats["entropy_mean"] == pytest.approx(0.7)
    with pytest.raises(ValueError, match="ref_logp"):
        policy_objective(
            PolicyLossInput(inp.logp, inp.prox_logp, inp.behav_logp, inp.advantages, inp.mask), kl_coef=0.1
        )


def test_objective_matches_reference_on_random_inputs():
    g = torch.Generator().manual_seed(7)
    combos = itertools.product(
        ["ppo_clip", "gspo"], ["tis", "mis", "decoupled", "none"], ["token", "sequence"], list(LOSS_AGGREGATIONS)
    )
    for loss_name, off, level, agg in combos:
        b, t = int(torch.randint(1, 5, (1,), generator=g)), int(torch.randint(1, 7, (1,), generator=g))
        prox = -torch.rand(b, t, generator=g) * 4
        shift = torch.randn(b, t, generator=g) * 0.3
        shift[0, 0] = [25.0, -25.0, 12.0, 0.0][b % 4]  # past the clamps (ppo_clip: +-20, gspo: 10)
        inp = PolicyLossInput(
            logp=prox + shift,
            prox_logp=prox,
            behav_logp=prox + torch.randn(b, t, generator=g) * 0.5,
            advantages=torch.randn(b, generator=g) if t % 2 else torch.randn(b, t, generator=g),
            mask=torch.rand(b, t, generator=g) > 0.25,
            ref_logp=prox + torch.randn(b, t, generator=g) * 0.3,
            entropy=torch.rand(b, t, generator=g),
        )
        kw = dict(
            loss=loss_name,
            off_policy=off,
            is_level=level,
            agg=agg,
            clip_low=0.2,
            clip_high=0.28,
            dual_clip=3.0,
            is_cap=1.8,
            norm_length=8,
            entropy_coef=0.01,
            kl_coef=0.1,
            kl_estimator=["k1", "k2", "k3"][b % 3],
        )
        fast, _ = policy_objective(inp, **kw)
        assert float(fast) == pytest.approx(policy_objective_reference(inp, **kw), rel=1e-4, abs=1e-5), kw


# --------------------------------------------------------------------------------------- verl, written out
def verl_agg_loss(
    loss_mat, mask, mode, dp_size=1, batch_num_tokens=None, global_batch_size=None, loss_scale_factor=None
):
    """agg_loss, with token-sum as verl PR #7197 adds it (the masked local sum times dp_size). E.g. terms
    [[1, 2, 3], [4, x, x]]: token-mean 10/4, token-sum 10, seq-mean-token-sum (6 + 4)/2, seq-mean-token-mean
    (2 + 4)/2, seq-mean-token-sum-norm (6 + 4) / loss_scale_factor (no division by the sequences)."""
    m = mask.double()
    masked = torch.where(mask.bool(), loss_mat, 0.0) * m
    seq_mask = (m.sum(-1) > 0).double()
    gbs = seq_mask.sum() if global_batch_size is None else global_batch_size
    if mode == "token-mean":
        return masked.sum() / (m.sum() if batch_num_tokens is None else batch_num_tokens) * dp_size
    if mode == "token-sum":
        return masked.sum() * dp_size
    if mode == "seq-mean-token-sum":
        return (masked.sum(-1) * seq_mask).sum() / gbs * dp_size
    if mode == "seq-mean-token-mean":
        return (masked.sum(-1) / (m.sum(-1) + 1e-8) * seq_mask).sum() / gbs * dp_size
    assert mode == "seq-mean-token-sum-norm"
    return masked.sum() / (loss_mat.shape[-1] if loss_scale_factor is None else loss_scale_factor)


def verl_vanilla(old_logp, logp, adv, mask, clip_low, clip_high, clip_ratio_c, mode, **agg):
    """compute_policy_loss_vanilla: log r clamped to [-20, 20]; dual-clip always on (clip_ratio_c > 1).
    E.g. r = 5, A = -1, clip 0.2: max(5, 1.2) = 5 -> min(3, 5) = 3 with c = 3."""
    log_r = torch.clamp(logp - old_logp, min=-20.0, max=20.0)
    ratio = torch.exp(log_r)
    pg1 = -adv * ratio
    pg2 = -adv * torch.clamp(ratio, 1 - clip_low, 1 + clip_high)
    clip1 = torch.maximum(pg1, pg2)
    pg3 = -adv * clip_ratio_c
    pg = torch.where(adv < 0, torch.min(pg3, clip1), clip1)
    m = mask.double()
    clipfrac = ((pg2 > pg1).double() * m).sum() / (m.sum() + 1e-8)
    lower = ((clip1 > pg3).double() * (adv < 0).double() * m).sum() / (m.sum() + 1e-8)
    return verl_agg_loss(pg, mask, mode, **agg), clipfrac, lower


def verl_gspo(old_logp, logp, adv, mask, clip_low, clip_high, **agg):
    """compute_policy_loss_gspo: s = exp(mean log ratio) as a token ratio sg[s] pi/sg[pi], log clamped at 10, no
    dual-clip, always seq-mean-token-mean. E.g. log ratios [ln 2, 0]: s = sqrt 2; clip_high 0.28 -> -1.28 A."""
    nak = logp - old_logp
    lengths = mask.double().sum(-1).clamp(min=1)
    seq = (nak * mask).sum(-1) / lengths
    log_s = torch.clamp(logp - logp.detach() + seq.detach()[:, None], max=10.0)
    s = torch.exp(log_s)
    pg = torch.maximum(-adv * s, -adv * torch.clamp(s, 1 - clip_low, 1 + clip_high))
    return verl_agg_loss(pg, mask, "seq-mean-token-mean", **agg)


def verl_entropy_from_logits(logits):
    """verl/utils/torch_functional.py entropy_from_logits: logsumexp(z) - sum softmax(z) z. E.g. z = [0, 0]:
    ln 2 - 0 = 0.693147."""
    p = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (p * logits).sum(-1)


def test_verl_references_by_hand():
    terms = torch.tensor([[1.0, 2.0, 3.0], [4.0, float("nan"), 9.0]], dtype=torch.float64)
    mask = torch.tensor([[True, True, True], [True, False, False]])
    assert [
        float(verl_agg_loss(terms, mask, m)) for m in ("token-mean", "token-sum", "seq-mean-token-sum")
    ] == pytest.approx([2.5, 10.0, 5.0])
    assert float(verl_agg_loss(terms, mask, "seq-mean-token-mean")) == pytest.approx(3.0)
    assert float(verl_agg_loss(terms, mask, "seq-mean-token-sum-norm", loss_scale_factor=4)) == pytest.approx(2.5)
    one = torch.tensor([[0.0]], dtype=torch.float64)
    loss, _, lower = verl_vanilla(
        one, one + LN(5), -torch.ones(1, 1, dtype=torch.float64), torch.ones(1, 1), 0.2, 0.2, 3.0, "token-mean"
    )
    assert (float(loss), float(lower)) == pytest.approx((3.0, 1.0))
    two = torch.tensor([[LN(2), 0.0]], dtype=torch.float64)
    assert float(
        verl_gspo(
            torch.zeros(1, 2, dtype=torch.float64),
            two,
            torch.ones(1, 2, dtype=torch.float64),
            torch.ones(1, 2),
            0.2,
            0.28,
        )
    ) == pytest.approx(-1.28)
    assert float(verl_entropy_from_logits(torch.zeros(2, dtype=torch.float64))) == pytest.approx(LN(2))


def random_policy_batch(g: torch.Generator, b: int = 7, t: int = 6):
    """Rows [B, T] float64: old log-probs, new log-probs (some log ratios past +-20 and 10), advantages (zeros,
    both signs, large: 1e6 on a log ratio of -25), a mask with holes and an empty row, entropies, reference
    log-probs."""
    old = -torch.rand(b, t, generator=g, dtype=torch.float64) * 4
    logp = old + torch.randn(b, t, generator=g, dtype=torch.float64) * 0.4
    logp[0, :3] = old[0, :3] + torch.tensor([25.0, -25.0, 15.0], dtype=torch.float64)
    logp[1, :] = old[1, :] + 12.0  # a sequence whose mean log ratio is past GSPO's clamp (10)
    adv = torch.randn(b, t, generator=g, dtype=torch.float64) * 2
    adv[2] = 0.0
    adv[3, :2] = torch.tensor([1e4, -1e4], dtype=torch.float64)
    adv[0, 1] = 1e6  # at log ratio -25: verl's clamp gives -1e6 e^-20 = -2.1e-3, e^-25 would give -1.4e-5
    mask = torch.rand(b, t, generator=g) > 0.3
    mask[0, :3] = mask[1, :] = True
    mask[4] = False  # an empty response
    ent = torch.rand(b, t, generator=g, dtype=torch.float64) * 3
    ref = old + torch.randn(b, t, generator=g, dtype=torch.float64)
    return old, logp, adv, mask, ent, ref


RANKS = [[0, 3, 5], [1, 4], [2, 6]]  # W = 3 ranks' rows (rank 1 holds the empty response)


@pytest.mark.parametrize("mode", ["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean"])
def test_ppo_clip_dual_clip_entropy_and_kl_are_verls_on_every_rank(mode):
    # Per rank: verl's ppo_loss (workers/utils/losses.py) with global batch info = pg - c_H agg(H) + c_KL agg(KL);
    # ours: one aggregate of the per-token sum with the step's denominators. Values, gradients and clip fractions.
    g = torch.Generator().manual_seed(17)
    for _ in range(5):
        old, logp, adv, mask, ent, ref = random_policy_batch(g)
        tokens, seqs = float(mask.sum()), float((mask.sum(-1) > 0).sum())
        agg = dict(dp_size=3, batch_num_tokens=tokens, global_batch_size=seqs)
        token_denom, seq_denom = loss_denominators(mode, tokens, seqs, 3)
        for rows in RANKS:
            x_ours, x_verl = logp[rows].clone().requires_grad_(), logp[rows].clone().requires_grad_()
            for clip_high, c in [(0.2, 3.0), (0.28, 10.0)]:  # vanilla PPO, and clip-higher with a loose dual-clip
                inp = PolicyLossInput(
                    logp=x_ours,
                    prox_logp=old[rows],
                    behav_logp=old[rows],
                    advantages=adv[rows],
                    mask=mask[rows],
                    ref_logp=ref[rows],
                    entropy=ent[rows],
                )
                ours, stats = policy_objective(
                    inp,
                    loss="ppo_clip",
                    clip_low=0.2,
                    clip_high=clip_high,
                    dual_clip=c,
                    off_policy="none",
                    agg=mode,
                    entropy_coef=0.01,
                    kl_coef=0.1,
                    kl_estimator="low_var_kl",
                    token_denom=token_denom,
                    seq_denom=seq_denom,
                )
                pg, clipfrac, lower = verl_vanilla(
                    old[rows], x_verl, adv[rows], mask[rows], 0.2, clip_high, c, mode, **agg
                )
                verl = (
                    pg
                    - 0.01 * verl_agg_loss(ent[rows], mask[rows], mode, **agg)
                    + 0.1 * verl_agg_loss(verl_kl("low_var_kl", x_verl, ref[rows]), mask[rows], mode, **agg)
                )
                assert float(ours.detach()) == pytest.approx(float(verl.detach()), rel=1e-6, abs=1e-6)
                if mask[rows].any():
                    assert (stats["ppo_clip_frac"], stats["dual_clip_frac"]) == pytest.approx(
                        (float(clipfrac), float(lower)), abs=1e-6
                    )
                ours.backward()
                verl.backward()
                assert torch.allclose(x_ours.grad, x_verl.grad, rtol=1e-6, atol=1e-6)
                if rows[0] == 0:  # row 0's first token has log ratio 25: clamped, no gradient (a gradient of -A e^25)
                    assert float(x_ours.grad[0, 0]) == 0.0
                x_ours.grad = x_verl.grad = None


def test_gspo_is_verls_on_every_rank():
    g = torch.Generator().manual_seed(19)
    for _ in range(5):
        old, logp, adv, mask, _, _ = random_policy_batch(g)
        adv = adv[:, :1].expand_as(adv)  # a sequence-level advantage, as GRPO's
        tokens, seqs = float(mask.sum()), float((mask.sum(-1) > 0).sum())
        agg = dict(dp_size=3, batch_num_tokens=tokens, global_batch_size=seqs)
        _, seq_denom = loss_denominators("seq-mean-token-mean", tokens, seqs, 3)
        for rows in RANKS:
            x_ours, x_verl = logp[rows].clone().requires_grad_(), logp[rows].clone().requires_grad_()
            inp = PolicyLossInput(
                logp=x_ours, prox_logp=old[rows], behav_logp=old[rows], advantages=adv[rows], mask=mask[rows]
            )
            ours, _ = policy_objective(
                inp,
                loss="gspo",
                clip_low=3e-4,
                clip_high=4e-4,
                dual_clip=0.0,
                off_policy="none",
                agg="seq-mean-token-mean",
                seq_denom=seq_denom,
            )
            verl = verl_gspo(old[rows], x_verl, adv[rows], mask[rows], 3e-4, 4e-4, **agg)
            assert float(ours.detach()) == pytest.approx(float(verl.detach()), rel=1e-6, abs=1e-6)
            ours.backward()
            verl.backward()
            assert torch.allclose(x_ours.grad, x_verl.grad, rtol=1e-6, atol=1e-6)


def test_seq_mean_token_sum_norm_is_verls_times_the_sequences():
    # verl: sum of every sequence's token sum / loss_scale_factor; here also / (global sequences), the Dr. GRPO
    # paper's 1/G: a constant factor apart (each rank's loss times D_seq = seqs / W is verl's with dp_size W).
    g = torch.Generator().manual_seed(23)
    old, logp, adv, mask, _, _ = random_policy_batch(g)
    seqs = float((mask.sum(-1) > 0).sum())
    _, seq_denom = loss_denominators("seq-mean-token-sum-norm", float(mask.sum()), seqs, 3)
    for rows in RANKS:
        inp = PolicyLossInput(
            logp=logp[rows], prox_logp=old[rows], behav_logp=old[rows], advantages=adv[rows], mask=mask[rows]
        )
        ours, _ = policy_objective(
            inp, off_policy="none", agg="seq-mean-token-sum-norm", norm_length=16, dual_clip=3.0, seq_denom=seq_denom
        )
        verl, _, _ = verl_vanilla(
            old[rows],
            logp[rows],
            adv[rows],
            mask[rows],
            0.2,
            0.28,
            3.0,
            "seq-mean-token-sum-norm",
            loss_scale_factor=16,
        )
        assert float(ours) * seq_denom == pytest.approx(float(verl), rel=1e-9, abs=1e-9)


def test_token_sum_averages_to_the_global_sum():
    # three ranks' token-sum losses with token_denom 1/3 average to the sum of every masked token's term
    g = torch.Generator().manual_seed(29)
    old, logp, adv, mask, _, _ = random_policy_batch(g)
    token_denom, _ = loss_denominators("token-sum", float(mask.sum()), 0.0, 3)
    losses = [
        float(
            policy_objective(
                PolicyLossInput(logp[r], old[r], old[r], adv[r], mask[r]),
                off_policy="none",
                agg="token-sum",
                token_denom=token_denom,
            )[0]
        )
        for r in RANKS
    ]
    terms, _ = ppo_clip(PolicyLossInput(logp, old, old, adv, mask), clip_low=0.2, clip_high=0.28, dual_clip=0.0)
    assert sum(losses) / 3 == pytest.approx(float(terms[mask].sum()), rel=1e-9)
    inp = PolicyLossInput(logp, old, old, adv, mask)
    assert float(policy_objective(inp, off_policy="none", agg="token-sum")[0]) == pytest.approx(
        policy_objective_reference(inp, off_policy="none", agg="token-sum"), rel=1e-9
    )


def test_entropy_is_verls_entropy_from_logits():
    # the learner's entropy (learner.model) against verl's formula in float64. The learner computes in float32
    # (as verl's chunked path): float32 rounding near ln 64 = 4.16 leaves up to ~2e-6, hence 1e-5 here.
    g = torch.Generator().manual_seed(31)
    logits = torch.randn(40, 64, generator=g) * torch.tensor([0.1, 1.0, 5.0, 30.0]).repeat(10)[:, None]  # [C, V]
    logits[0, :] = 0.0  # uniform: ln 64
    logits[1, 0] = 1e4  # one token takes it all: 0
    targets = torch.randint(0, 64, (40,), generator=g)
    _, ours = _logprob_and_entropy(logits, targets, entropy=True)
    verl = verl_entropy_from_logits(logits.double())
    assert torch.allclose(ours.double(), verl, atol=1e-5, rtol=0)
    assert float(ours[0]) == pytest.approx(math.log(64), abs=1e-5) and float(ours[1]) == pytest.approx(0.0, abs=1e-6)


def test_logprob_mismatch_by_hand():
    from learner.offpolicy import logprob_mismatch

    # learner - engine over the masked tokens: 0.0, +0.1, -0.2 (the fourth token, -5.0 apart, is not in the mask).
    # |.|: 0 + 0.1 + 0.2 = 0.3, max 0.2; k3(x) = e^x - 1 - x: k3(0) = 0, k3(0.1) = 1.1051709 - 1.1 = 0.0051709,
    # k3(-0.2) = 0.8187308 - 0.8 = 0.0187308; sum 0.0239017.
    behav = torch.tensor([-1.0, -2.0, -3.0, -4.0])
    learner = torch.tensor([-1.0, -1.9, -3.2, -9.0])
    got = logprob_mismatch(learner, behav, torch.tensor([True, True, True, False]))
    assert got["mismatch_tokens"] == 3
    assert got["mismatch_abs_sum"] == pytest.approx(0.3, abs=1e-6)
    assert got["max:mismatch_abs_max"] == pytest.approx(0.2, abs=1e-6)
    assert got["mismatch_kl_sum"] == pytest.approx(0.0239017, abs=1e-6)
    none = logprob_mismatch(learner, behav, torch.zeros(4, dtype=torch.bool))
    assert none == {
        "mismatch_tokens": 0.0,
        "mismatch_abs_sum": 0.0,
        "mismatch_kl_sum": 0.0,
        "max:mismatch_abs_max": 0.0,
    }
