"""Online DPO (and SPIN): preference pairs formed inside each group, the DPO loss as per-step advantages.

    adv, stats = compute_advantages("online_dpo", AdvantageInput(..., logp=..., ref_logp=...), beta=0.1)
    # learner.advantages registers `online_dpo`: per-step inputs summed per trajectory, then `dpo_advantages`

Within each group (the G trajectories of one task) the trajectory with the highest return is `chosen` and
the one with the lowest `rejected` (the first such trajectory by id where several share the value); a group
whose returns are all equal is a tie and a group of one has no pair: both are skipped and counted. A
trajectory's log-probability is the sum of its steps' response log-probs, so a multi-turn trajectory
counts every token it generated. DPO (Rafailov et al. 2023, "Direct Preference Optimization", eq. 7):

    z_p = beta * [(log pi(c) - log pi_ref(c)) - (log pi(r) - log pi_ref(r))]
    L   = 1/P sum_p -log sigmoid(z_p)                              P = pairs of the global batch

Its gradient is -1/P sum_p beta sigmoid(-z_p) [grad log pi(c) - grad log pi(r)]: the gradient of the
policy-gradient surrogate -sum_t A_t log pi(y_t) with A = +beta sigmoid(-z_p) / P on every step of the
chosen trajectory, -beta sigmoid(-z_p) / P on every step of the rejected one and 0 elsewhere. So online
DPO runs through the same learner step as GRPO: this estimator turns pairs into advantages, and the
policy loss at ratio 1 (one update per batch) with `token-sum` aggregation has exactly DPO's gradient.
The reference is a frozen copy of the policy refreshed every `algorithm.ref_update_every` versions (SPIN:
the opponent is the previous iteration's model).

Shapes: N = transitions (env steps), J = trajectories, K = groups, P = pairs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor


@dataclass(frozen=True)
class Pairs:
    """The (chosen, rejected) trajectories of each group that has one, and what was skipped."""

    chosen: Tensor  # [P] long, dense trajectory ids
    rejected: Tensor  # [P] long
    ties: int  # groups of two or more whose returns are all equal
    lone: int  # groups of one trajectory


def preference_pairs(returns: Tensor, group: Tensor, n_groups: int) -> Pairs:
    """Per group (dense ids [J] -> 0..K-1), the first trajectory with the highest return [J] and the first
    with the lowest; equal returns (ties) and groups of one give no pair."""
    j = torch.arange(returns.numel())
    big = returns.numel()
    hi = torch.full((n_groups,), -math.inf, dtype=returns.dtype).scatter_reduce(0, group, returns, "amax")  # [K]
    lo = torch.full((n_groups,), math.inf, dtype=returns.dtype).scatter_reduce(0, group, returns, "amin")  # [K]
    first = lambda hit: torch.full((n_groups,), big).scatter_reduce(0, group, torch.where(hit, j, big), "amin")  # noqa: E731
    best, worst = first(returns == hi[group]), first(returns == lo[group])  # [K]
    size = torch.bincount(group, minlength=n_groups)  # [K]
    paired = (size > 1) & (hi > lo)  # [K]
    return Pairs(best[paired], worst[paired], ties=int(((size > 1) & (hi == lo)).sum()), lone=int((size == 1).sum()))


def dpo_loss(
    policy_chosen: Tensor, policy_rejected: Tensor, ref_chosen: Tensor, ref_rejected: Tensor, beta: float
) -> tuple[Tensor, Tensor]:
    """DPO's loss per pair [P] and its logit z [P] from sequence log-probs [P] of the policy and the reference."""
    z = beta * ((policy_chosen - ref_chosen) - (policy_rejected - ref_rejected))  # [P]
    return -F.logsigmoid(z), z


def dpo_advantages(
    returns: Tensor,
    logp: Tensor,
    ref_logp: Tensor,
    group: Tensor,
    n_groups: int,
    *,
    beta: float,
    pair_count: float = 0.0,
) -> tuple[Tensor, dict[str, float]]:
    """Online DPO's advantage of each trajectory [J] (see the module docstring): +-beta sigmoid(-z_p) / P on pair
    p's chosen and rejected trajectories, 0 elsewhere. returns, logp, ref_logp: per trajectory [J] (sums over its
    steps); group: dense group ids [J]. `pair_count`: P, the global batch's pairs (a learner spread over ranks sums
    them first); 0 = these trajectories' pairs."""
    pairs = preference_pairs(returns, group, n_groups)
    losses, z = dpo_loss(
        logp[pairs.chosen], logp[pairs.rejected], ref_logp[pairs.chosen], ref_logp[pairs.rejected], beta
    )  # [P] each
    n = pairs.chosen.numel()
    per = pair_count or max(n, 1)  # P
    scale = beta * torch.sigmoid(-z) / per  # [P]
    adv = torch.zeros(returns.numel(), dtype=torch.float64).index_add_(0, pairs.chosen, scale)  # [J]
    adv.index_add_(0, pairs.rejected, -scale)
    return adv, {  # the means are over the P pairs: these pairs' share of them (GLOBAL_SHARES)
        "dpo_pair_count": float(n),
        "dpo_tie_count": float(pairs.ties),
        "dpo_lone_count": float(pairs.lone),
        "dpo_loss": float(losses.sum()) / per,
        "dpo_accuracy": float((z > 0).double().sum()) / per,  # the policy prefers chosen more than ref does
        "dpo_margin": float(z.sum() / beta) / per,
    }


GLOBAL_SHARES = frozenset({"dpo_loss", "dpo_accuracy", "dpo_margin"})
"""`dpo_advantages` stats that are means over the global batch's P pairs, each rank giving its pairs' share (their
sum / P): a learner spread over ranks sums them, where it averages other stats."""
