"""Advantage estimators and policy losses: hand-worked values, and fast == slow reference on random inputs."""

from __future__ import annotations

import math

import pytest
import torch
from learner_oracles import grpo_reference
from learner_testing import ppo_clip_tis, ppo_clip_tis_reference

from learner.advantages import ADVANTAGES, AdvantageInput, compute_advantages, grpo
from learner.losses import POLICY_LOSSES


def adv_input(rewards, traj, group, steps=None) -> AdvantageInput:
    n = len(rewards)
    steps = steps if steps is not None else [0] * n
    dones = [i == n - 1 or traj[i + 1] != traj[i] for i in range(n)]
    return AdvantageInput(
        rewards=torch.tensor(rewards, dtype=torch.float32),
        traj_index=torch.tensor(traj),
        group_index=torch.tensor(group),
        step_index=torch.tensor(steps),
        dones=torch.tensor(dones),
    )


def test_grpo_one_group_by_hand():
    # Returns [1, 0, 0, 1]: mean 0.5; unbiased std = sqrt(4 * 0.25 / 3) = sqrt(1/3) = 0.57735;
    # A = +-0.5 / 0.57735 = +-sqrt(3)/2 = +-0.86603.  Dr. GRPO (mean only): A = +-0.5.
    inp = adv_input([1.0, 0.0, 0.0, 1.0], traj=[0, 1, 2, 3], group=[0, 0, 0, 0])
    adv, stats = grpo(inp, norm_by_std=True, eps=0.0)
    s = math.sqrt(3) / 2
    torch.testing.assert_close(adv, torch.tensor([s, -s, -s, s]))
    adv, _ = grpo(inp, norm_by_std=False)
    torch.testing.assert_close(adv, torch.tensor([0.5, -0.5, -0.5, 0.5]))
    assert stats["zero_std_group_frac"] == 0.0


def test_grpo_multi_step_trajectories_by_hand():
    # group 0: traj 0 steps [0, 1] -> R=1; traj 1 steps [0, 0, 0] -> R=0.
    #   mean 0.5, unbiased std = sqrt((0.25 + 0.25) / 1) = 0.70711; A = +-0.5/0.70711 = +-0.70711.
    #   every step of a trajectory gets its trajectory's advantage.
    # group 1: traj 2 [2] -> R=2; traj 3 [1, 1] -> R=2: std 0, A = 0 for all (no signal).
    # group 2: traj 4 alone -> no baseline, A = 0.
    # Steps are interleaved on purpose: the estimator must not rely on order.
    rewards = [0.0, 0.0, 2.0, 1.0, 0.0, 1.0, 1.0, 0.0, 5.0]
    traj = [0, 1, 2, 0, 1, 3, 3, 1, 4]
    group = [7, 7, 3, 7, 7, 3, 3, 7, 9]
    steps = [0, 0, 0, 1, 1, 0, 1, 2, 0]
    adv, stats = grpo(adv_input(rewards, traj, group, steps), eps=0.0)
    h = 1 / math.sqrt(2)
    torch.testing.assert_close(adv, torch.tensor([h, -h, 0.0, h, -h, 0.0, 0.0, -h, 0.0]))
    assert stats["zero_std_group_frac"] == pytest.approx(2 / 3)  # groups 1 and 2
    assert stats["return_mean"] == pytest.approx((1 + 0 + 2 + 2 + 5) / 5)


def test_grpo_matches_reference_on_random_inputs():
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        n_traj = int(torch.randint(1, 30, (1,), generator=g))
        group_of_traj = torch.randint(0, 6, (n_traj,), generator=g)
        lens = torch.randint(1, 5, (n_traj,), generator=g)
        traj = torch.repeat_interleave(torch.arange(n_traj), lens)
        perm = torch.randperm(traj.numel(), generator=g)
        traj = traj[perm] * 3 + 5  # shuffled, non-contiguous ids
        group = group_of_traj[(traj - 5) // 3] * 11
        rewards = torch.randn(traj.numel(), generator=g)
        inp = AdvantageInput(
            rewards=rewards,
            traj_index=traj,
            group_index=group,
            step_index=torch.zeros_like(traj),
            dones=torch.zeros_like(traj, dtype=torch.bool),
        )
        for norm in (True, False):
            fast, _ = grpo(inp, norm_by_std=norm)
            torch.testing.assert_close(fast, grpo_reference(inp, norm_by_std=norm), rtol=1e-5, atol=1e-5)


def test_grpo_equal_returns_give_exactly_zero():
    # Three trajectories with return 0.1 each: the float mean of equal values may round off 0.1, but equal
    # returns must give A = 0 exactly, not rounding noise divided by a ~1e-17 std (even with eps = 0).
    inp = adv_input([0.1, 0.1, 0.1], traj=[0, 1, 2], group=[0, 0, 0])
    for eps in (0.0, 1e-6):
        adv, stats = grpo(inp, eps=eps)
        assert adv.tolist() == [0.0, 0.0, 0.0] and stats["zero_std_group_frac"] == 1.0


def test_grpo_rejects_a_trajectory_in_two_groups():
    with pytest.raises(ValueError, match="one group"):
        grpo(adv_input([1.0, 0.0], traj=[0, 0], group=[0, 1]))


def test_registry_errors_and_options():
    with pytest.raises(KeyError, match="known: .*grpo"):
        ADVANTAGES.get("nope")
    with pytest.raises(KeyError, match="known: .*ppo_clip"):
        POLICY_LOSSES.get("nope")
    inp = adv_input([1.0, 0.0], traj=[0, 1], group=[0, 0])
    with pytest.raises(TypeError, match="norm_by_sdt"):
        compute_advantages("grpo", inp, norm_by_sdt=True)
    adv, _ = compute_advantages("grpo", inp, norm_by_std=False)
    torch.testing.assert_close(adv, torch.tensor([0.5, -0.5]))
    assert "grpo" in ADVANTAGES and "ppo_clip" in POLICY_LOSSES


def _hand_case():
    # Three tokens, clip_low 0.2, clip_high 0.28, tis_cap 2:
    #   t0: A=1,  r=1              -> max(-1, -1) = -1;          IS=1.5 -> w=1.5 -> l=-1.5
    #   t1: A=-1, r=1.5            -> max(1.5, 1.28) = 1.5;      IS=3   -> w=2   -> l=3.0  (TIS-clipped)
    #   t2: A=2,  r=1.5 -> clip 1.28: max(-3, -2.56) = -2.56;    IS=1   -> w=1   -> l=-2.56 (PPO-clipped)
    # loss = (-1.5 + 3.0 - 2.56) / 3 = -0.35333; IS mean (1.5 + 3 + 1) / 3 = 1.8333, max 3.
    # d loss / d logp = -w A r / 3 where unclipped: t0 -> -1.5/3 = -0.5, t1 -> 2*1.5/3 = 1.0, t2 -> 0.
    old = torch.tensor([[-1.0, -2.0, -3.0]])
    logp = (old + torch.tensor([[0.0, math.log(1.5), math.log(1.5)]])).requires_grad_()
    behav = old - torch.tensor([[math.log(1.5), math.log(3.0), 0.0]])
    return logp, old, behav, torch.tensor([[1.0, -1.0, 2.0]])


def test_ppo_clip_tis_by_hand():
    logp, old, behav, adv = _hand_case()
    mask = torch.ones(1, 3, dtype=torch.bool)
    loss, stats = ppo_clip_tis(logp, old, behav, adv, mask, clip_low=0.2, clip_high=0.28, tis_cap=2.0)
    assert float(loss.detach()) == pytest.approx(-1.06 / 3, abs=1e-5)
    assert stats["is_ratio_mean"] == pytest.approx(5.5 / 3, abs=1e-5)
    assert stats["is_ratio_max"] == pytest.approx(3.0, abs=1e-5)
    assert stats["ppo_clip_frac"] == pytest.approx(1 / 3)
    assert stats["tis_clip_frac"] == pytest.approx(1 / 3)
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[-0.5, 1.0, 0.0]]))
    # mask out t2: (-1.5 + 3.0) / 2 = 0.75; with denom=10: (-1.5 + 3.0) / 10 = 0.15
    mask[0, 2] = False
    loss, stats = ppo_clip_tis(logp, old, behav, adv, mask, clip_low=0.2, clip_high=0.28, tis_cap=2.0)
    assert float(loss.detach()) == pytest.approx(0.75, abs=1e-5) and stats["tokens"] == 2
    loss, _ = ppo_clip_tis(logp, old, behav, adv, mask, clip_low=0.2, clip_high=0.28, tis_cap=2.0, denom=10.0)
    assert float(loss.detach()) == pytest.approx(0.15, abs=1e-5)


def test_ppo_clip_tis_matches_reference_on_random_inputs():
    g = torch.Generator().manual_seed(1)
    for trial in range(10):
        b, t = int(torch.randint(1, 5, (1,), generator=g)), int(torch.randint(1, 9, (1,), generator=g))
        old = -torch.rand(b, t, generator=g) * 5
        logp = old + torch.randn(b, t, generator=g) * 0.4
        behav = old + torch.randn(b, t, generator=g) * 0.8
        adv = torch.randn(b, generator=g) if trial % 2 else torch.randn(b, t, generator=g)
        mask = torch.rand(b, t, generator=g) > 0.3
        kw = dict(clip_low=0.2, clip_high=0.28, tis_cap=1.5)
        fast, fstats = ppo_clip_tis(logp, old, behav, adv, mask, **kw)
        slow, sstats = ppo_clip_tis_reference(logp, old, behav, adv, mask, **kw)
        assert float(fast) == pytest.approx(slow, rel=1e-5, abs=1e-6)
        for k, v in sstats.items():
            assert fstats[k] == pytest.approx(v, rel=1e-5, abs=1e-6), k


def test_ppo_clip_tis_ignores_garbage_under_the_mask():
    logp = torch.tensor([[-1.0, float("-inf")]])
    behav = torch.tensor([[-1.0, float("nan")]])
    mask = torch.tensor([[True, False]])
    loss, stats = ppo_clip_tis(logp, logp, behav, torch.tensor([2.0]), mask, clip_low=0.2, clip_high=0.2, tis_cap=2.0)
    assert float(loss) == pytest.approx(-2.0) and stats["tokens"] == 1
