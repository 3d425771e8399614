"""Policy losses, KL estimators, loss aggregation, and the objective that composes them.

    loss, stats = policy_objective(PolicyLossInput(logp, prox_logp, behav_logp, adv, mask),
                                   loss="ppo_clip", clip_low=0.2, clip_high=0.28, off_policy="tis", ...)

Registries, one signature each:
  - POLICY_LOSSES: `(inp, *, clip_low, clip_high, dual_clip) -> (per-token terms [B, T], stats)`
  - KL_ESTIMATORS (a table with verl's aliases): `(logp, ref_logp) -> per-token KL estimate [B, T]`
  - LOSS_AGGREGATIONS: how per-token terms become one scalar (token-mean, token-sum, seq-mean-...)
  - VALUE_LOSS_AGGREGATIONS: how the critic's per-step value losses become one (verl's critic loss_agg_mode)
  - off-policy corrections live in `learner.offpolicy`.
`policy_objective_reference` in tests/learner/learner_oracles.py is the slow, obvious version of the whole
objective (python floats). tests/learner/test_learner_losses.py holds each against verl's `core_algos.py` formula.

Shapes: B = sequences (one response per row), T = tokens per row.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Protocol

import torch
from torch import Tensor

from agentstream.registry import Registry, lookup
from learner.offpolicy import OFF_POLICY

PPO_LOG_RATIO_CLAMP = 20.0  # verl's compute_policy_loss_vanilla: log r clamped to [-20, 20] before exp
GSPO_LOG_RATIO_MAX = 10.0  # verl's compute_policy_loss_gspo: the sequence's log ratio clamped at 10


@dataclass(frozen=True)
class PolicyLossInput:
    """Per-token tensors of B sequences padded to T tokens; only `mask` tokens count."""

    logp: Tensor  # [B, T] log pi_theta(token), with grad
    prox_logp: Tensor  # [B, T] log pi_prox: the policy before this step's update (detached)
    behav_logp: Tensor  # [B, T] log pi_behav: the policy that sampled the token
    advantages: Tensor  # [B] or [B, T]
    mask: Tensor  # [B, T] bool
    ref_logp: Tensor | None = None  # [B, T] reference policy, for a KL term in the loss
    entropy: Tensor | None = None  # [B, T] entropy of pi_theta at the token's position, with grad

    def token_advantages(self) -> Tensor:
        return self.advantages[:, None].expand_as(self.logp) if self.advantages.dim() == 1 else self.advantages


class PolicyLossFn(Protocol):
    """Every policy loss: per-token terms l_t [B, T] (to be minimised) and stats over masked tokens."""

    def __call__(
        self, inp: PolicyLossInput, *, clip_low: float, clip_high: float, dual_clip: float
    ) -> tuple[Tensor, dict[str, float]]: ...


POLICY_LOSSES: Registry[PolicyLossFn] = Registry("policy loss")
"""Every policy loss: `@POLICY_LOSSES.register(name)`; `POLICY_LOSSES.get(name)` lists the known ones for an unknown
name."""


def _clipped_surrogate(
    ratio: Tensor, adv: Tensor, m: Tensor, clip_low: float, clip_high: float, dual_clip: float
) -> tuple[Tensor, dict[str, float]]:
    """max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high)), and for A < 0 with dual_clip = c > 1:
    min(that, -c A) (Ye et al. 2020, "Mastering Complex Control in MOBA Games", dual-clip PPO)."""
    surr = -adv * ratio  # [B, T]
    surr_clipped = -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)  # [B, T]
    per_token = torch.maximum(surr, surr_clipped)  # [B, T]
    dual = torch.zeros_like(m)
    if dual_clip > 0:
        cap = -adv * dual_clip  # [B, T]
        dual = (adv < 0) & (per_token > cap)
        per_token = torch.where(dual, cap, per_token)
    with torch.no_grad():
        nf = m.sum().clamp(min=1).double()
        stats = {
            "ppo_ratio_mean": float(ratio.detach()[m].double().sum() / nf),
            "ppo_clip_frac": float((surr_clipped > surr).detach()[m].double().sum() / nf),
            "dual_clip_frac": float(dual[m].double().sum() / nf),
        }
    return per_token, stats


@POLICY_LOSSES.register("ppo_clip")
def ppo_clip(
    inp: PolicyLossInput, *, clip_low: float, clip_high: float, dual_clip: float
) -> tuple[Tensor, dict[str, float]]:
    """PPO-clip (Schulman et al. 2017, eq. 7) with separate bounds (DAPO clip-higher, Yu et al. 2025,
    eq. 10) and optional dual-clip c (0 = off):

        r_t = exp(clamp(logp_t - prox_logp_t, -20, 20))
        l_t = max(-A_t r_t, -A_t clip(r_t, 1 - clip_low, 1 + clip_high));   A_t < 0: l_t = min(l_t, -c A_t)

    As verl's `compute_policy_loss_vanilla` (its clamp of log r included), whose dual-clip is always on
    (clip_ratio_c = 3 by default): dual_clip=3 gives its numbers.
    """
    m = inp.mask.bool()
    ratio = torch.exp((inp.logp - inp.prox_logp).clamp(-PPO_LOG_RATIO_CLAMP, PPO_LOG_RATIO_CLAMP))  # [B, T]
    return _clipped_surrogate(ratio, inp.token_advantages(), m, clip_low, clip_high, dual_clip)


@POLICY_LOSSES.register("gspo")
def gspo(
    inp: PolicyLossInput, *, clip_low: float, clip_high: float, dual_clip: float
) -> tuple[Tensor, dict[str, float]]:
    """GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization", arXiv 2507.18071, eqs. 5-7 and
    GSPO-token eq. 13): the ratio is the geometric mean of the sequence's token ratios,

        s_b = exp( 1/|y_b| sum_t (logp_t - prox_logp_t) ),   l_t = max(-A s_{b,t}, -A clip(s_{b,t}, ...))
        s_{b,t} = sg[s_b] * pi(y_t) / sg[pi(y_t)]   (value s_b; gradient of s_b spread over the tokens)

    so that with `seq-mean-token-mean` aggregation the gradient is exactly GSPO's. Clip bounds are
    sequence-level (the paper uses 3e-4 / 4e-4). As verl's `compute_policy_loss_gspo`: log s_{b,t} clamped at
    10; verl has no dual-clip for GSPO (dual_clip=0 gives its numbers) and always aggregates seq-mean-token-mean.
    """
    m = inp.mask.bool()
    n = m.sum(-1, keepdim=True).clamp(min=1)  # [B, 1]
    log_s = (torch.where(m, inp.logp - inp.prox_logp, 0.0).sum(-1, keepdim=True) / n).detach()  # [B, 1]
    log_ratio = log_s + inp.logp - inp.logp.detach()  # [B, T]
    ratio = torch.exp(log_ratio.clamp(max=GSPO_LOG_RATIO_MAX))  # [B, T]
    return _clipped_surrogate(ratio, inp.token_advantages(), m, clip_low, clip_high, dual_clip)


# --------------------------------------------------------------------------------------- KL
def _k3(logp: Tensor, ref: Tensor) -> Tensor:
    """r - 1 - log r with log r = ref - logp: unbiased, low variance, >= 0. As verl's `low_var_kl`: log r is
    clamped to [-20, 20] (exp never overflows) and the estimate to [-10, 10] (a token whose estimate is past 10
    adds 10 and no gradient)."""
    log_r = (ref - logp).clamp(-20, 20)  # [B, T]
    return (torch.exp(log_r) - 1 - log_r).clamp(-10, 10)


def _k2(logp: Tensor, ref: Tensor) -> Tensor:
    return 0.5 * (logp - ref) ** 2


def _straight_through(forward: Callable[[Tensor, Tensor], Tensor]) -> Callable[[Tensor, Tensor], Tensor]:
    """`forward`'s value with k2's gradient (verl's `k1+`, `k3+`): k1's and k3's expected values are the KL,
    but their expected gradients are not its gradient, while k2's is."""

    def estimate(logp: Tensor, ref: Tensor) -> Tensor:
        backward = _k2(logp, ref)  # [B, T]
        return backward - backward.detach() + forward(logp, ref).detach()

    return estimate


KL_ESTIMATORS: dict[str, Callable[[Tensor, Tensor], Tensor]] = {
    # Schulman 2020, "Approximating KL divergence", with x ~ pi_theta and log r = ref_logp - logp; the names and
    # values are verl's `kl_penalty` (core_algos.py), aliases included.
    "k1": lambda logp, ref: logp - ref,  # -log r: unbiased, high variance, can be negative
    "abs": lambda logp, ref: (logp - ref).abs(),  # |log r|
    "k2": _k2,  # (log r)^2 / 2: biased, low variance; its gradient is the KL's in expectation
    "k3": _k3,
}
KL_ESTIMATORS.update(kl=KL_ESTIMATORS["k1"], mse=_k2, low_var_kl=_k3)
KL_ESTIMATORS.update(
    {f"{name}+": _straight_through(fn) for name, fn in list(KL_ESTIMATORS.items()) if fn is not _k2}
)  # k2+ would be k2 itself: verl has none


def kl_estimate(name: str, logp: Tensor, ref_logp: Tensor) -> Tensor:
    """Per-token estimate of KL(pi_theta || pi_ref) [B, T] with estimator `name` (k1, k2, k3, abs, their verl
    aliases kl, mse, low_var_kl, and `+` variants: the value of the estimator, the gradient of k2)."""
    return lookup(KL_ESTIMATORS, name, "KL estimator")(logp, ref_logp)


# --------------------------------------------------------------------------------------- aggregation
# name -> (per-sequence value from (token sum [B], token count [B], norm_length), or None for a token-level mode)
LOSS_AGGREGATIONS: dict[str, Callable[[Tensor, Tensor, int], Tensor] | None] = {
    "token-mean": None,  # sum_{b,t} l / (tokens)
    "token-sum": None,  # sum_{b,t} l (verl PR #7197: the global batch's sum)
    "seq-mean-token-sum": lambda s, n, L: s,  # sum_b (sum_t l) / (sequences)
    "seq-mean-token-mean": lambda s, n, L: s / n.clamp(min=1),  # sum_b (mean_t l) / (sequences)
    "seq-mean-token-sum-norm": lambda s, n, L: s / L,  # Dr. GRPO: sum_b (sum_t l / L) / (sequences)
}


def _aggregation(mode: str) -> Callable[[Tensor, Tensor, int], Tensor] | None:
    """LOSS_AGGREGATIONS[mode]. Not `lookup`: its error lists the known modes in the table's order, the default
    (token-mean) first, where `lookup` would sort them."""
    if mode not in LOSS_AGGREGATIONS:
        raise KeyError(f"unknown loss aggregation {mode!r}; known: {', '.join(LOSS_AGGREGATIONS)}")
    return LOSS_AGGREGATIONS[mode]


def aggregate(
    terms: Tensor,
    mask: Tensor,
    mode: str,
    *,
    norm_length: int = 1,
    token_denom: Tensor | float | None = None,
    seq_denom: Tensor | float | None = None,
) -> Tensor:
    """One scalar from per-token terms [B, T] (masked tokens only), as verl's `agg_loss`:

        token-mean               sum_{b,t} l_bt / D_tok
        token-sum                sum_{b,t} l_bt / D_tok                     (D_tok = 1 unless given)
        seq-mean-token-sum       sum_b (sum_t l_bt) / D_seq
        seq-mean-token-mean      sum_b (sum_t l_bt / n_b) / D_seq
        seq-mean-token-sum-norm  sum_b (sum_t l_bt / norm_length) / D_seq   (Dr. GRPO, Liu et al. 2025, sec. 3.1)

    D_tok (D_seq) = this call's masked tokens (sequences with a masked token) unless given: a caller
    normalising over micro-batches and ranks passes `loss_denominators`. verl's seq-mean-token-sum-norm has no
    D_seq (sum_b sum_t l_bt / norm_length): a factor D_seq apart, kept for the Dr. GRPO paper's 1/G
    (docs/algorithms.md).
    """
    per_seq = _aggregation(mode)
    m = mask.bool()
    tok_sum = torch.where(m, terms, 0.0).sum(-1)  # [B]
    n = m.sum(-1)  # [B]
    if per_seq is None:
        if token_denom is None:
            token_denom = n.sum().clamp(min=1) if mode == "token-mean" else 1.0
        return tok_sum.sum() / token_denom
    return per_seq(tok_sum, n, norm_length).sum() / ((n > 0).sum().clamp(min=1) if seq_denom is None else seq_denom)


def loss_denominators(mode: str, tokens: float, sequences: float, world_size: int) -> tuple[float, float]:
    """(token_denom, seq_denom) for `aggregate` on each of `world_size` ranks, from the global batch's masked
    tokens and sequences: FSDP averages the ranks' gradients (divides by W), so each rank divides its sum by
    (global count) / W and the averaged gradient is that of sum(all terms) / (global count); token-sum's count
    is 1 (each rank's sum times W: the averaged gradient is the global sum's, as verl's dp_size factor)."""
    _aggregation(mode)
    token_count = 1.0 if mode == "token-sum" else max(tokens, 1.0)
    return token_count / world_size, max(sequences, 1.0) / world_size


# name -> (weight of each step's value loss in the sum, its part of the denominator), from its response tokens
# n [B]. The critic has one value per step, standing for every response token of it (verl: one per token).
VALUE_LOSS_AGGREGATIONS: dict[str, Callable[[Tensor], tuple[Tensor, Tensor]]] = {
    "token-mean": lambda n: (n, n),  # sum_i n_i l_i / sum_i n_i      (verl's default)
    "seq-mean-token-sum": lambda n: (n, (n > 0).to(n.dtype)),  # sum_i n_i l_i / steps
    "seq-mean-token-mean": lambda n: ((n > 0).to(n.dtype), (n > 0).to(n.dtype)),  # sum_i l_i / steps
}


def value_loss_weights(mode: str, tokens: Tensor) -> tuple[Tensor, Tensor]:
    """(weight [B], denominator part [B]) of each step with `tokens` [B] response tokens under critic loss
    aggregation `mode`; a step without a response token counts in neither (verl: a fully masked sequence)."""
    try:  # not `lookup`: the error lists the modes in the table's order, verl's default first
        fn = VALUE_LOSS_AGGREGATIONS[mode]
    except KeyError:
        known = ", ".join(VALUE_LOSS_AGGREGATIONS)
        raise KeyError(f"unknown value loss aggregation {mode!r}; known: {known}") from None
    return fn(tokens.to(torch.float64))


# --------------------------------------------------------------------------------------- the objective
def policy_objective(
    inp: PolicyLossInput,
    *,
    loss: str = "ppo_clip",
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    dual_clip: float = 0.0,
    off_policy: str = "tis",
    is_level: str = "token",
    is_cap: float = 2.0,
    agg: str = "token-mean",
    norm_length: int = 1,
    entropy_coef: float = 0.0,
    kl_coef: float = 0.0,
    kl_estimator: str = "k3",
    token_denom: Tensor | float | None = None,
    seq_denom: Tensor | float | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """The learner's loss on one micro-batch:

        (w_t, keep_t) = off_policy(pi_prox / pi_behav)        learner.offpolicy, detached
        l_t = w_t * policy_loss_t - entropy_coef * H_t + kl_coef * KL_t(pi_theta || pi_ref)
        loss = aggregate(l_t over kept tokens)                dropped tokens still count in denominators

    Tokens outside `mask` may hold anything (nan, inf): they never reach the loss or its gradient.
    Stats are over masked tokens; `tokens` and `sequences` are this call's counts.
    """
    m = inp.mask.bool()
    clean = lambda t: None if t is None else torch.where(m, t, 0.0)  # noqa: E731  garbage -> 0 before any op
    inp = replace(
        inp,
        logp=clean(inp.logp),
        prox_logp=clean(inp.prox_logp),
        behav_logp=clean(inp.behav_logp),
        ref_logp=clean(inp.ref_logp),
        entropy=clean(inp.entropy),
        mask=m,
    )
    (weight, keep), stats = OFF_POLICY.get(off_policy)(inp.prox_logp, inp.behav_logp, m, level=is_level, cap=is_cap)
    pg, pg_stats = POLICY_LOSSES.get(loss)(inp, clip_low=clip_low, clip_high=clip_high, dual_clip=dual_clip)
    terms = weight * pg  # [B, T]
    stats = {**stats, **pg_stats, "sequences": float((m.sum(-1) > 0).sum())}
    nf = m.sum().clamp(min=1).double()
    if entropy_coef:
        if inp.entropy is None:
            raise ValueError("entropy_coef > 0 needs PolicyLossInput.entropy")
        terms = terms - entropy_coef * inp.entropy
    if inp.entropy is not None:
        stats["entropy_mean"] = float(inp.entropy.detach()[m].double().sum() / nf)
    if kl_coef:
        if inp.ref_logp is None:
            raise ValueError("kl_coef > 0 in the loss needs PolicyLossInput.ref_logp (a reference policy)")
        kl = kl_estimate(kl_estimator, inp.logp, inp.ref_logp)  # [B, T]
        terms = terms + kl_coef * kl
        stats["kl_mean"] = float(kl.detach()[m].double().sum() / nf)
    out = aggregate(
        torch.where(keep, terms, 0.0), m, agg, norm_length=norm_length, token_denom=token_denom, seq_denom=seq_denom
    )
    return out, stats
