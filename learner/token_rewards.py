"""Rewards placed on response tokens: from per-step advantages to per-token ones.

A transition's `reward` is its step's whole reward; its `token_rewards` (when it has them) say which part of it
sits on which response token, the rest sitting on the last token as a scalar score does (verl's
`token_level_rewards`). Estimators that compare trajectories (GRPO, RLOO, GiGPO, REINFORCE++-baseline, online
DPO) use the sum, as verl does. Estimators whose advantage is a return (`AdvantageTraits.to_go`: REINFORCE++,
GAE) give each token its reward to go: a reward placed on token k counts for tokens 0..k of its response, not
for the tokens after it. With gamma = 1 (and lam = 1 for GAE, whose values are per step here) that is verl's
per-token return.

Shapes: N = transitions, R = sum of their response lengths.
"""

from __future__ import annotations

import torch
from torch import Tensor


def rewards_to_go(adv: Tensor, token_rewards: Tensor, lens: Tensor) -> Tensor:
    """Per-token advantages [R]: each token's step advantage `adv` [N] minus the token rewards [R] placed before
    it in its own response (`lens` [N]: each response's tokens). Every token's own reward stays in its advantage."""
    step = torch.repeat_interleave(torch.arange(lens.numel()), lens)  # [R] the transition of each token
    before = torch.cumsum(token_rewards.double(), 0) - token_rewards.double()  # [R] every earlier token of the batch
    first = (torch.cumsum(lens, 0) - lens)[step]  # [R] the first token of each token's response
    return (adv.double()[step] - (before - before[first])).to(adv.dtype)
