"""Advantage estimators beyond GRPO: hand-worked values, and fast == slow reference on random inputs."""

from __future__ import annotations

import math

import pytest
import torch

from learner.advantages import (
    ADVANTAGES, AdvantageInput, compute_advantages, discounted_returns, gae, gae_reference, gigpo, gigpo_reference,
    reinforce_pp, reinforce_pp_baseline, reinforce_pp_reference, returns_of, rloo, rloo_reference, whiten,
    whiten_reference, whitening_sums,
)


def inp_of(rewards, traj, group, steps, anchors=None, values=None) -> AdvantageInput:
    n = len(rewards)
    last = {t: max(s for s, u in zip(steps, traj) if u == t) for t in set(traj)}
    return AdvantageInput(
        rewards=torch.tensor(rewards, dtype=torch.float32), traj_index=torch.tensor(traj),
        group_index=torch.tensor(group), step_index=torch.tensor(steps),
        dones=torch.tensor([steps[i] == last[traj[i]] for i in range(n)]), anchors=anchors,
        values=None if values is None else torch.tensor(values, dtype=torch.float32),
    )


def gigpo_case() -> AdvantageInput:
    # group 0: trajectory A passes S -> M -> G1 (rewards 0, 0, 1); trajectory B passes S -> X -> M (0, 0, 0):
    #   both reach anchor M, A at step 1, B at step 2.
    # group 1: trajectories C and D both see an anchor also called "S", each with reward 3 (same string,
    #   other episode group: must not join group 0's step group S).
    # Rows are shuffled on purpose.
    rows = [  # (traj, group, step, reward, anchor)
        (1, 0, 2, 0.0, "M"), (0, 0, 0, 0.0, "S"), (2, 1, 0, 3.0, "S"), (0, 0, 2, 1.0, "G1"),
        (1, 0, 0, 0.0, "S"), (3, 1, 0, 3.0, "S"), (0, 0, 1, 0.0, "M"), (1, 0, 1, 0.0, "X"),
    ]
    traj, group, steps, rewards, anchors = (list(c) for c in zip(*rows))
    return inp_of(rewards, traj, group, steps, anchors=anchors)


def test_gigpo_shared_anchor_mean_norm_by_hand():
    # gamma = 0.5: discounted returns A: [0.25, 0.5, 1], B: [0, 0, 0]; C, D: [3], [3].
    # episode level (mean_norm): R_A = 1, R_B = 0 -> +0.5, -0.5; group 1 equal returns -> 0.
    # step groups: S(g0) = {A0: 0.25, B0: 0}  -> mean 0.125 -> A0 +0.125, B0 -0.125
    #              M(g0) = {A1: 0.5,  B2: 0}  -> mean 0.25  -> A1 +0.25,  B2 -0.25
    #              G1 = {A2}, X = {B1}: groups of one -> 0;  S(g1) = {C0: 3, D0: 3} -> equal -> 0
    # A = A_E + 1.0 * A_S:  A0 0.625, A1 0.75, A2 0.5;  B0 -0.625, B1 -0.5, B2 -0.75;  C0 = D0 = 0.
    adv, stats = gigpo(gigpo_case(), gamma=0.5, step_weight=1.0, norm_by_std=False)
    expected = {(0, 0): 0.625, (0, 1): 0.75, (0, 2): 0.5, (1, 0): -0.625, (1, 1): -0.5, (1, 2): -0.75,
                (2, 0): 0.0, (3, 0): 0.0}
    inp = gigpo_case()
    got = {(int(t), int(s)): float(a) for t, s, a in zip(inp.traj_index, inp.step_index, adv)}
    assert got == pytest.approx(expected, abs=1e-6)
    assert stats["step_groups"] == 5  # S(g0), M, G1, X, S(g1)
    assert stats["step_in_shared_group_frac"] == pytest.approx(6 / 8)  # all but G1 and X


def test_gigpo_mean_std_norm_by_hand():
    # episode: [1, 0] -> mean 0.5, unbiased std sqrt(0.5) = 0.70711 -> +-0.70711.
    # S(g0): [0.25, 0] -> std sqrt(2 * 0.125^2) = 0.17678 -> +-0.125 / 0.17678 = +-0.70711; M the same.
    # step_weight 0.5: A0 = 0.70711 + 0.35355 = 1.06066, A1 the same, A2 = 0.70711 + 0 = 0.70711;
    #                  B0 = B2 = -1.06066, B1 = -0.70711.
    h = 1 / math.sqrt(2)
    adv, _ = gigpo(gigpo_case(), gamma=0.5, step_weight=0.5, norm_by_std=True, eps=0.0)
    inp = gigpo_case()
    got = {(int(t), int(s)): float(a) for t, s, a in zip(inp.traj_index, inp.step_index, adv)}
    assert got == pytest.approx({(0, 0): 1.5 * h, (0, 1): 1.5 * h, (0, 2): h, (1, 0): -1.5 * h, (1, 1): -h,
                                 (1, 2): -1.5 * h, (2, 0): 0.0, (3, 0): 0.0}, abs=1e-5)


def test_gigpo_without_anchors_is_refused_and_empty_anchor_is_alone():
    inp = inp_of([1.0, 0.0], traj=[0, 1], group=[0, 0], steps=[0, 0])
    with pytest.raises(ValueError, match="anchor"):
        compute_advantages("gigpo", inp)
    # empty anchors: no step group forms, only the episode part remains (= GRPO mean_norm: +-0.5)
    adv, _ = gigpo(inp_of([1.0, 0.0], [0, 1], [0, 0], [0, 0], anchors=["", ""]), norm_by_std=False)
    assert adv.tolist() == pytest.approx([0.5, -0.5])


def test_rloo_by_hand():
    # group 0 returns [1, 0, 0, 1] (traj 0 has two steps 0.5 + 0.5): A_j = R_j - mean(others):
    #   traj 0: 1 - (0 + 0 + 1)/3 = 2/3; traj 1: 0 - 2/3 = -2/3. Group 1 is one trajectory: 0.
    adv, _ = rloo(inp_of([0.5, 0.5, 0.0, 0.0, 1.0, 7.0], traj=[0, 0, 1, 2, 3, 4], group=[0, 0, 0, 0, 0, 1],
                         steps=[0, 1, 0, 0, 0, 0]))
    assert adv.tolist() == pytest.approx([2 / 3, 2 / 3, -2 / 3, -2 / 3, 2 / 3, 0.0])


def test_reinforce_pp_by_hand():
    # traj 0 rewards [0, 1], gamma 0.5 -> G = [0.5, 1]; traj 1 [0] -> G = [0].
    # batch [0.5, 1, 0]: mean 0.5, unbiased std sqrt((0 + 0.25 + 0.25) / 2) = 0.5 -> A = [0, 1, -1].
    inp = inp_of([0.0, 1.0, 0.0], traj=[0, 0, 1], group=[0, 0, 1], steps=[0, 1, 0])
    adv, _ = reinforce_pp(inp, gamma=0.5, eps=0.0)
    assert adv.tolist() == pytest.approx([0.0, 1.0, -1.0])
    # baseline: each trajectory alone in its group: A' = G - mean_g(R) = [0.5 - 1, 1 - 1, 0 - 0] = [-0.5, 0, 0];
    # mean -1/6; deviations [-1/3, 1/6, 1/6]; var (1/9 + 1/36 + 1/36) / 2 = 1/12; std 0.288675
    # -> A = [-1.1547, 0.57735, 0.57735].
    adv, _ = reinforce_pp_baseline(inp, gamma=0.5, eps=0.0)
    assert adv.tolist() == pytest.approx([-2 / math.sqrt(3), 1 / math.sqrt(3), 1 / math.sqrt(3)], abs=1e-5)
    torch.testing.assert_close(discounted_returns(inp, 0.5), torch.tensor([0.5, 1.0, 0.0], dtype=torch.float64))


def test_gae_by_hand():
    # rewards [0, 1], values [0.5, 0.8], gamma 0.9, lam 0.5 (steps given in reverse order on purpose):
    #   delta_1 = 1 + 0.9 * 0 - 0.8 = 0.2;  A_1 = 0.2
    #   delta_0 = 0 + 0.9 * 0.8 - 0.5 = 0.22;  A_0 = 0.22 + 0.9 * 0.5 * 0.2 = 0.31
    #   returns = A + V = [0.81, 1.0]
    inp = inp_of([1.0, 0.0], traj=[0, 0], group=[0, 0], steps=[1, 0], values=[0.8, 0.5])
    adv, _ = gae(inp, gamma=0.9, lam=0.5)
    assert adv.tolist() == pytest.approx([0.2, 0.31])
    assert returns_of("gae", inp, adv).tolist() == pytest.approx([1.0, 0.81])
    with pytest.raises(ValueError, match="values"):
        compute_advantages("gae", inp_of([1.0], [0], [0], [0]))


def random_input(g: torch.Generator, with_values: bool = True) -> AdvantageInput:
    n_traj = int(torch.randint(1, 25, (1,), generator=g))
    group_of_traj = torch.randint(0, 5, (n_traj,), generator=g)
    lens = torch.randint(1, 6, (n_traj,), generator=g)
    traj = torch.repeat_interleave(torch.arange(n_traj), lens)
    steps = torch.cat([torch.randperm(int(n), generator=g) * 2 + 1 for n in lens])  # gaps: only the order counts
    perm = torch.randperm(traj.numel(), generator=g)
    traj, steps = traj[perm], steps[perm]
    group = group_of_traj[traj] * 7
    rewards = torch.where(torch.rand(traj.numel(), generator=g) < 0.5, 0.0, torch.randn(traj.numel(), generator=g))
    anchors = [["a", "b", "c", ""][int(i)] for i in torch.randint(0, 4, (traj.numel(),), generator=g)]
    return AdvantageInput(rewards=rewards, traj_index=traj * 3 + 1, group_index=group, step_index=steps,
                          dones=torch.zeros_like(traj, dtype=torch.bool), anchors=anchors,
                          values=torch.randn(traj.numel(), generator=g) if with_values else None)


def test_estimators_match_references_on_random_inputs():
    g = torch.Generator().manual_seed(3)
    for _ in range(25):
        inp = random_input(g)
        for norm in (True, False):
            kw = dict(gamma=0.9, step_weight=0.7, norm_by_std=norm)
            torch.testing.assert_close(gigpo(inp, **kw)[0], gigpo_reference(inp, **kw), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(rloo(inp)[0], rloo_reference(inp), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(reinforce_pp(inp, gamma=0.8)[0], reinforce_pp_reference(inp, gamma=0.8),
                                   rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(reinforce_pp_baseline(inp, gamma=0.8)[0],
                                   reinforce_pp_reference(inp, gamma=0.8, baseline=True), rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(gae(inp, gamma=0.9, lam=0.7)[0], gae_reference(inp, gamma=0.9, lam=0.7),
                                   rtol=1e-5, atol=1e-5)


def test_every_estimator_runs_through_the_registry():
    inp = random_input(torch.Generator().manual_seed(5))
    opts = dict(norm_by_std=True, gamma=0.9, lam=0.9, step_weight=1.0)  # the trainer passes all of them
    for name in ADVANTAGES:
        adv, stats = compute_advantages(name, inp, **opts)
        assert adv.shape == inp.rewards.shape and torch.isfinite(adv).all(), name
        assert "advantage_abs_mean" in stats


def test_whitening_by_hand():
    # advantages [1, 3] over 1 and 3 response tokens: the samples are 1, 3, 3, 3
    #   mean = 10 / 4 = 2.5; unbiased var = (1.5^2 + 3 * 0.5^2) / 3 = (2.25 + 0.75) / 3 = 1.0
    #   -> (1 - 2.5) / 1 = -1.5 and (3 - 2.5) / 1 = 0.5
    adv, tokens = torch.tensor([1.0, 3.0]), torch.tensor([1, 3])
    assert whitening_sums(adv, tokens) == (4.0, 10.0, 28.0)
    torch.testing.assert_close(whiten(adv, *whitening_sums(adv, tokens), eps=0.0), torch.tensor([-1.5, 0.5]))
    one = torch.tensor([0.7])
    assert torch.equal(whiten(one, *whitening_sums(one, torch.tensor([1]))), one)  # a single token: unchanged


def test_whitening_matches_reference_and_sums_add_up_across_ranks():
    g = torch.Generator().manual_seed(5)
    for _ in range(20):
        n = int(torch.randint(2, 40, (1,), generator=g))
        adv = torch.randn(n, generator=g, dtype=torch.float64) * 3 + 1
        tokens = torch.randint(0, 9, (n,), generator=g)
        tokens[0] = max(int(tokens[0]), 2)
        got = whiten(adv, *whitening_sums(adv, tokens))
        torch.testing.assert_close(got, torch.tensor(whiten_reference(adv.tolist(), tokens.tolist()), dtype=torch.float64))
        w = tokens.double()
        assert abs(float((w * got).sum())) < 1e-9 * n  # zero mean over tokens
        # two ranks holding halves of the batch: their sums add up to the whole batch's
        k = n // 2
        parts = [whitening_sums(adv[:k], tokens[:k]), whitening_sums(adv[k:], tokens[k:])]
        whole = whitening_sums(adv, tokens)
        for i in range(3):
            assert abs(parts[0][i] + parts[1][i] - whole[i]) < 1e-9 * max(1.0, abs(whole[i]))
