"""Off-policy corrections: how the learner weights tokens sampled by an older (behaviour) policy.

    (weight, keep), stats = OFF_POLICY.get("tis")(prox_logp, behav_logp, mask, level="token", cap=2.0)

pi_behav sampled the tokens (the engine, possibly several versions behind); pi_prox is the learner's
policy before this step's update (with one optimizer step per batch: `logp.detach()` of the same forward).
Every correction returns a detached weight [B, T] that multiplies each token's policy-gradient term, and
`keep` [B, T]: tokens that stay in the loss (masked IS drops the others). Stats are over masked tokens.

Shapes: B = sequences (one response per row), T = tokens per row.
"""

from __future__ import annotations

import math
from typing import Protocol

import torch
from torch import Tensor

from agentstream.registry import Registry

LEVELS = ("token", "sequence")
# exp() of a log-ratio above this overflows float32; a ratio this large is capped or masked anyway.
_MAX_LOG_RATIO = 80.0


class OffPolicyFn(Protocol):
    """Every correction: `(prox_logp, behav_logp, mask, *, level, cap) -> (weight, keep, stats)`."""

    def __call__(
        self, prox_logp: Tensor, behav_logp: Tensor, mask: Tensor, *, level: str, cap: float
    ) -> tuple[tuple[Tensor, Tensor], dict[str, float]]: ...


OFF_POLICY: Registry[OffPolicyFn] = Registry("off-policy correction")
"""Every correction: `@OFF_POLICY.register(name)`; `OFF_POLICY.get(name)` lists the known ones for an unknown name."""


def log_is_ratio(prox_logp: Tensor, behav_logp: Tensor, mask: Tensor, level: str) -> Tensor:
    """log(pi_prox / pi_behav) [B, T], detached: per token, or per sequence (the sum over its masked
    tokens = log of the product of token ratios) broadcast to the sequence's tokens."""
    if level not in LEVELS:
        raise ValueError(f"importance-sampling level {level!r}: use one of {', '.join(LEVELS)}")
    m = mask.bool()
    log_r = torch.where(m, (prox_logp - behav_logp).detach(), 0.0)  # [B, T]
    if level == "sequence":
        log_r = log_r.sum(-1, keepdim=True).expand_as(log_r)  # [B, T]
    return log_r


def _ratio_stats(log_r: Tensor, m: Tensor, clipped: Tensor, masked: Tensor) -> dict[str, float]:
    ratio = torch.exp(log_r.clamp(max=_MAX_LOG_RATIO))  # [B, T]
    n = m.sum()
    nf = n.clamp(min=1).double()
    seq_masked = (masked & m).any(-1)  # [B]
    return {
        "tokens": float(n),
        "is_ratio_mean": float(ratio[m].double().sum() / nf),
        "is_ratio_max": float(ratio[m].max()) if bool(n) else 0.0,
        "is_clip_frac": float((clipped & m).double().sum() / nf),
        "is_mask_frac": float((masked & m).double().sum() / nf),
        "is_masked_tokens": float((masked & m).sum()),
        "is_masked_seqs": float(seq_masked.sum()),
    }


@OFF_POLICY.register("tis")
def truncated_is(
    prox_logp: Tensor, behav_logp: Tensor, mask: Tensor, *, level: str, cap: float
) -> tuple[tuple[Tensor, Tensor], dict[str, float]]:
    """Truncated importance sampling (Yao et al. 2025, "Your efficient RL framework secretly brings you
    off-policy RL training"; Espeholt et al. 2018, IMPALA's truncated rho):

        w = min(pi_prox / pi_behav, C)     per token, or per sequence (product of token ratios)
    """
    m = mask.bool()
    log_r = log_is_ratio(prox_logp, behav_logp, m, level)  # [B, T]
    weight = torch.exp(log_r.clamp(max=math.log(cap)))  # [B, T]
    clipped = log_r > math.log(cap)
    return (weight, m), _ratio_stats(log_r, m, clipped, torch.zeros_like(m))


@OFF_POLICY.register("mis")
def masked_is(
    prox_logp: Tensor, behav_logp: Tensor, mask: Tensor, *, level: str, cap: float
) -> tuple[tuple[Tensor, Tensor], dict[str, float]]:
    """Masked importance sampling (Yao et al. 2025, MIS; verl `rollout_is` mask mode): a token (or a
    whole sequence) whose ratio leaves [1/C, C] is dropped from the loss; the others are weighted by it:

        w = pi_prox / pi_behav  if 1/C <= pi_prox / pi_behav <= C,  else the token is dropped
    """
    m = mask.bool()
    log_r = log_is_ratio(prox_logp, behav_logp, m, level)  # [B, T]
    bound = math.log(cap)
    outside = (log_r > bound) | (log_r < -bound)  # [B, T]
    weight = torch.where(outside, 0.0, torch.exp(log_r.clamp(-bound, bound)))  # [B, T]
    return (weight, m & ~outside), _ratio_stats(log_r, m, torch.zeros_like(m), outside)


@OFF_POLICY.register("decoupled")
def decoupled(
    prox_logp: Tensor, behav_logp: Tensor, mask: Tensor, *, level: str, cap: float
) -> tuple[tuple[Tensor, Tensor], dict[str, float]]:
    """Decoupled PPO (Fu et al. 2025, AReaL, arXiv 2505.24298, eq. 5): clip against the proximal policy
    (the PPO ratio pi / pi_prox of the policy loss) and weight by the untruncated behaviour ratio:

        w = pi_prox / pi_behav         (`cap` is not used)
    """
    m = mask.bool()
    log_r = log_is_ratio(prox_logp, behav_logp, m, level)  # [B, T]
    weight = torch.exp(log_r.clamp(max=_MAX_LOG_RATIO))  # [B, T]
    none = torch.zeros_like(m)
    return (weight, m), _ratio_stats(log_r, m, none, none)


@OFF_POLICY.register("none")
def no_correction(
    prox_logp: Tensor, behav_logp: Tensor, mask: Tensor, *, level: str, cap: float
) -> tuple[tuple[Tensor, Tensor], dict[str, float]]:
    """No correction: w = 1 (the ratio pi_prox / pi_behav is still reported)."""
    m = mask.bool()
    log_r = log_is_ratio(prox_logp, behav_logp, m, level)  # [B, T]
    none = torch.zeros_like(m)
    return (torch.ones_like(log_r), m), _ratio_stats(log_r, m, none, none)


def logprob_mismatch(learner_logp: Tensor, behav_logp: Tensor, mask: Tensor) -> dict[str, float]:
    """Train-inference mismatch on the same weights: the engine's log-probs of its sampled tokens against the
    learner's, over the tokens in `mask` (those the engine sampled with the weights the learner holds now).

    Sums and a max, so that micro-batches and ranks add up (the step turns them into means):
      mismatch_tokens   n = |mask|
      mismatch_abs_sum  sum |log pi_learner - log pi_behav|
      mismatch_abs_max  max |log pi_learner - log pi_behav|
      mismatch_kl_sum   sum k3(r), r = pi_learner / pi_behav, k3 = r - 1 - log r (Schulman's estimator of
                        KL(pi_behav || pi_learner) from tokens sampled by pi_behav; >= 0, exact 0 at r = 1)

    Shapes: learner_logp, behav_logp, mask [Q] (one micro-batch's response tokens)."""
    m = mask.bool()
    log_r = (learner_logp.detach().double() - behav_logp.double())[m]  # [n]
    log_r = log_r.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    return {
        "mismatch_tokens": float(log_r.numel()),
        "mismatch_abs_sum": float(log_r.abs().sum()),
        "mismatch_kl_sum": float((log_r.exp() - 1 - log_r).sum()),
        "max:mismatch_abs_max": float(log_r.abs().max()) if log_r.numel() else 0.0,
    }
