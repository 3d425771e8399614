"""Advantage estimators beyond GRPO: hand-worked values, fast == slow reference on random inputs, and each
estimator against verl's formula (verl/trainer/ppo/core_algos.py) written out here in float64."""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict

import pytest
import torch
from learner_oracles import (
    gae_reference,
    gigpo_reference,
    grpo_reference,
    reinforce_pp_reference,
    rewards_to_go_reference,
    rloo_reference,
    whiten_reference,
)

from learner.advantages import (
    ADVANTAGES,
    AdvantageInput,
    advantage_traits,
    compute_advantages,
    discounted_returns,
    gae,
    gigpo,
    grpo,
    reinforce_pp,
    reinforce_pp_baseline,
    returns_of,
    rloo,
    whiten,
    whiten_batch,
    whitening_sums,
)
from learner.token_rewards import rewards_to_go


def inp_of(rewards, traj, group, steps, anchors=None, values=None, tokens=None) -> AdvantageInput:
    n = len(rewards)
    last = {t: max(s for s, u in zip(steps, traj) if u == t) for t in set(traj)}
    return AdvantageInput(
        rewards=torch.tensor(rewards, dtype=torch.float32),
        traj_index=torch.tensor(traj),
        group_index=torch.tensor(group),
        step_index=torch.tensor(steps),
        dones=torch.tensor([steps[i] == last[traj[i]] for i in range(n)]),
        anchors=anchors,
        values=None if values is None else torch.tensor(values, dtype=torch.float32),
        tokens=None if tokens is None else torch.tensor(tokens),
    )


def gigpo_case() -> AdvantageInput:
    # group 0: trajectory A passes S -> M -> G1 (rewards 0, 0, 1); trajectory B passes S -> X -> M (0, 0, 0):
    #   both reach anchor M, A at step 1, B at step 2.
    # group 1: trajectories C and D both see an anchor also called "S", each with reward 3 (same string,
    #   other episode group: must not join group 0's step group S).
    # Rows are shuffled on purpose.
    rows = [  # (traj, group, step, reward, anchor)
        (1, 0, 2, 0.0, "M"),
        (0, 0, 0, 0.0, "S"),
        (2, 1, 0, 3.0, "S"),
        (0, 0, 2, 1.0, "G1"),
        (1, 0, 0, 0.0, "S"),
        (3, 1, 0, 3.0, "S"),
        (0, 0, 1, 0.0, "M"),
        (1, 0, 1, 0.0, "X"),
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
    expected = {
        (0, 0): 0.625,
        (0, 1): 0.75,
        (0, 2): 0.5,
        (1, 0): -0.625,
        (1, 1): -0.5,
        (1, 2): -0.75,
        (2, 0): 0.0,
        (3, 0): 0.0,
    }
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
    assert got == pytest.approx(
        {
            (0, 0): 1.5 * h,
            (0, 1): 1.5 * h,
            (0, 2): h,
            (1, 0): -1.5 * h,
            (1, 1): -h,
            (1, 2): -1.5 * h,
            (2, 0): 0.0,
            (3, 0): 0.0,
        },
        abs=1e-5,
    )


def test_gigpo_without_anchors_is_refused_and_empty_anchor_is_alone():
    inp = inp_of([1.0, 0.0], traj=[0, 1], group=[0, 0], steps=[0, 0])
    with pytest.raises(ValueError, match="anchor"):
        compute_advantages("gigpo", inp)
    # empty anchors: no step group forms, only the episode part remains (= GRPO mean_norm: +-0.5)
    adv, _ = gigpo(inp_of([1.0, 0.0], [0, 1], [0, 0], [0, 0], anchors=["", ""]), norm_by_std=False)
    assert adv.tolist() == pytest.approx([0.5, -0.5])


def test_rloo_by_hand():
    # group 0 returns [1, 0, 0, 1] (traj 0 has two steps 0.5 + 0.5): A_j = R_j - mean(others):
    #   traj 0: 1 - (0 + 0 + 1)/3 = 2/3; traj 1: 0 - 2/3 = -2/3. Group 1 is one trajectory: 0, or its return 7
    #   with group_of_one="score" (verl's rloo).
    inp = inp_of(
        [0.5, 0.5, 0.0, 0.0, 1.0, 7.0], traj=[0, 0, 1, 2, 3, 4], group=[0, 0, 0, 0, 0, 1], steps=[0, 1, 0, 0, 0, 0]
    )
    assert rloo(inp)[0].tolist() == pytest.approx([2 / 3, 2 / 3, -2 / 3, -2 / 3, 2 / 3, 0.0])
    assert rloo(inp, group_of_one="score")[0].tolist() == pytest.approx([2 / 3, 2 / 3, -2 / 3, -2 / 3, 2 / 3, 7.0])


def test_reinforce_pp_by_hand():
    # traj 0 rewards [0, 1], gamma 0.5 -> G = [0.5, 1]; traj 1 [0] -> G = [0].
    # one token each: [0.5, 1, 0]: mean 0.5, unbiased var (0 + 0.25 + 0.25) / 2 = 0.25 -> A = [0, 1, -1]
    # (over sqrt(0.25 + 1e-8): 1 - 2e-8).
    inp = inp_of([0.0, 1.0, 0.0], traj=[0, 0, 1], group=[0, 0, 1], steps=[0, 1, 0])
    adv, _ = reinforce_pp(inp, gamma=0.5)
    assert adv.tolist() == pytest.approx([0.0, 1.0, -1.0], abs=1e-6)
    # tokens [1, 3, 2]: samples 0.5, 1, 1, 1, 0, 0: mean 3.5/6 = 7/12;
    #   squares (1/12)^2 + 3 (5/12)^2 + 2 (7/12)^2 = (1 + 75 + 98)/144 = 174/144; var = 174/144 / 5 = 29/120
    #   -> A = [-1/12, 5/12, -7/12] / sqrt(29/120) = [-0.169516, 0.847579, -1.186611]
    adv, _ = reinforce_pp(inp_of([0.0, 1.0, 0.0], [0, 0, 1], [0, 0, 1], [0, 1, 0], tokens=[1, 3, 2]), gamma=0.5)
    sd = math.sqrt(29 / 120)
    assert adv.tolist() == pytest.approx([-1 / 12 / sd, 5 / 12 / sd, -7 / 12 / sd], abs=1e-6)
    # whiten=False: the returns themselves (the learner whitens over the global batch)
    assert reinforce_pp(inp, gamma=0.5, whiten=False)[0].tolist() == [0.5, 1.0, 0.0]
    # baseline: each trajectory alone in its group, group_of_one="zero": the mean is its own return:
    # A' = G - R = [0.5 - 1, 1 - 1, 0 - 0] = [-0.5, 0, 0]; mean -1/6; deviations [-1/3, 1/6, 1/6];
    # var (1/9 + 1/36 + 1/36) / 2 = 1/12; std 0.288675 -> A = [-1.1547, 0.57735, 0.57735].
    adv, _ = reinforce_pp_baseline(inp, gamma=0.5)
    assert adv.tolist() == pytest.approx([-2 / math.sqrt(3), 1 / math.sqrt(3), 1 / math.sqrt(3)], abs=1e-5)
    # group_of_one="score" (verl): the mean of a group of one is 0, A' = G = [0.5, 1, 0] -> as REINFORCE++: [0, 1, -1]
    adv, _ = reinforce_pp_baseline(inp, gamma=0.5, group_of_one="score")
    assert adv.tolist() == pytest.approx([0.0, 1.0, -1.0], abs=1e-6)
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
    return AdvantageInput(
        rewards=rewards,
        traj_index=traj * 3 + 1,
        group_index=group,
        step_index=steps,
        dones=torch.zeros_like(traj, dtype=torch.bool),
        anchors=anchors,
        values=torch.randn(traj.numel(), generator=g) if with_values else None,
    )


def test_estimators_match_references_on_random_inputs():
    g = torch.Generator().manual_seed(3)
    for i in range(25):
        inp = random_input(g)
        if i % 2:  # response tokens per step, zeros included
            inp = AdvantageInput(**{**inp.__dict__, "tokens": torch.randint(0, 6, inp.rewards.shape, generator=g)})
        for one in ("zero", "score"):
            for norm in (True, False):
                kw = dict(gamma=0.9, step_weight=0.7, norm_by_std=norm, group_of_one=one)
                torch.testing.assert_close(gigpo(inp, **kw)[0], gigpo_reference(inp, **kw), rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(
                rloo(inp, group_of_one=one)[0], rloo_reference(inp, group_of_one=one), rtol=1e-5, atol=1e-5
            )
            for white in (True, False):
                kw = dict(gamma=0.8, whiten=white)
                torch.testing.assert_close(
                    reinforce_pp_baseline(inp, **kw, group_of_one=one)[0],
                    reinforce_pp_reference(inp, **kw, baseline=True, group_of_one=one),
                    rtol=1e-4,
                    atol=1e-4,
                )
        for white in (True, False):
            torch.testing.assert_close(
                reinforce_pp(inp, gamma=0.8, whiten=white)[0],
                reinforce_pp_reference(inp, gamma=0.8, whiten=white),
                rtol=1e-4,
                atol=1e-4,
            )
        torch.testing.assert_close(
            gae(inp, gamma=0.9, lam=0.7)[0], gae_reference(inp, gamma=0.9, lam=0.7), rtol=1e-5, atol=1e-5
        )


def test_every_estimator_runs_through_the_registry():
    inp = random_input(torch.Generator().manual_seed(5))
    # the trainer passes all of them; each estimator gets only its own (gae declares neither group_of_one nor whiten)
    opts = dict(norm_by_std=True, gamma=0.9, lam=0.9, step_weight=1.0, group_of_one="score", whiten=False)
    # online DPO also reads each step's log-probs under the policy and the reference
    inp = AdvantageInput(
        **{
            **inp.__dict__,
            "logp": -torch.rand(inp.rewards.numel()) * 9,
            "ref_logp": -torch.rand(inp.rewards.numel()) * 9,
        }
    )
    for name in ADVANTAGES:
        adv, stats = compute_advantages(name, inp, **opts, beta=0.1)
        assert adv.shape == inp.rewards.shape and torch.isfinite(adv).all(), name
        assert "advantage_abs_mean" in stats
    assert {n for n in ADVANTAGES if advantage_traits(n).whitens} == {"reinforce_pp", "reinforce_pp_baseline"}
    with pytest.raises(ValueError, match="group_of_one='verl' is unknown; use one of zero, score"):
        compute_advantages("grpo", inp, group_of_one="verl")
    with pytest.raises(ValueError, match="AdvantageInput.tokens has shape"):
        AdvantageInput(**{**inp.__dict__, "tokens": torch.ones(inp.rewards.numel() + 1)})


def test_whitening_by_hand():
    # advantages [1, 3] over 1 and 3 response tokens: the samples are 1, 3, 3, 3
    #   mean = 10 / 4 = 2.5; unbiased var = (1.5^2 + 3 * 0.5^2) / 3 = (2.25 + 0.75) / 3 = 1.0
    #   -> (1 - 2.5) / 1 = -1.5 and (3 - 2.5) / 1 = 0.5     (verl's 1e-8 beside the count moves them by ~1e-8)
    adv, tokens = torch.tensor([1.0, 3.0]), torch.tensor([1, 3])
    assert whitening_sums(adv, tokens) == (4.0, 10.0, 28.0)
    assert whitening_sums(adv, tokens, centre=2.0) == (4.0, 2.0, 4.0)  # around 2: -1, +1, +1, +1
    torch.testing.assert_close(whiten(adv, *whitening_sums(adv, tokens), eps=0.0), torch.tensor([-1.5, 0.5]))
    torch.testing.assert_close(
        whiten(adv, *whitening_sums(adv, tokens, 2.0), eps=0.0, centre=2.0), torch.tensor([-1.5, 0.5])
    )
    torch.testing.assert_close(whiten_batch(adv, tokens), torch.tensor([-1.5, 0.5]))
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
        torch.testing.assert_close(
            got, torch.tensor(whiten_reference(adv.tolist(), tokens.tolist()), dtype=torch.float64)
        )
        w = tokens.double()
        assert abs(float((w * got).sum())) < 1e-7 * n  # zero mean over tokens (but for verl's 1e-8 beside the count)
        # two ranks holding halves of the batch: their sums (around any shared centre) add up to the whole batch's
        k = n // 2
        for centre in (0.0, 1.3):
            parts = [whitening_sums(adv[:k], tokens[:k], centre), whitening_sums(adv[k:], tokens[k:], centre)]
            whole = whitening_sums(adv, tokens, centre)
            for i in range(3):
                assert abs(parts[0][i] + parts[1][i] - whole[i]) < 1e-9 * max(1.0, abs(whole[i]))


# --------------------------------------------------------------------------------------- verl, written out
# Each function below is verl's (verl/trainer/ppo/core_algos.py, verl/utils/torch_functional.py,
# verl/utils/groupwise.py) transcribed in float64 on verl's layout: B responses (rows), L token positions,
# `index` the group of each row. One row is one env step of a one-step trajectory here.
def verl_masked_whiten(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """masked_whiten: masked_mean divides by (count + 1e-8); masked_var unbiased (count / (count - 1));
    (values - mean) * rsqrt(var + 1e-8). E.g. [1, 3, 3, 3]: mean 2.5, var 1 -> [-1.5, 0.5, 0.5, 0.5]."""
    m = mask.double()
    n = m.sum()
    mean = (values * m).sum() / (n + 1e-8)
    var = ((values - mean) ** 2 * m).sum() / (n + 1e-8) * n / (n - 1)
    return (values - mean) * torch.rsqrt(var + 1e-8)


def verl_grpo(scores: list[float], index: list[int], eps: float = 1e-6, norm_by_std: bool = True) -> list[float]:
    """compute_grpo_outcome_advantage (the loop): a group of one has mean 0 and std 1; torch.std is unbiased.
    E.g. scores [1, 0, 0, 1] in one group and [3] alone: mean 0.5, std sqrt(1/3) = 0.577350
    -> +-0.5 / (0.577350 + 1e-6) = +-0.866024; 3 / (1 + 1e-6)."""
    members = defaultdict(list)
    for s, i in zip(scores, index):
        members[i].append(s)
    mean, std = {}, {}
    for i, ss in members.items():
        t = torch.tensor(ss, dtype=torch.float64)
        mean[i], std[i] = (0.0, 1.0) if len(ss) == 1 else (float(t.mean()), float(t.std()))
    return [(s - mean[i]) / (std[i] + eps) if norm_by_std else s - mean[i] for s, i in zip(scores, index)]


def verl_grpo_vectorized(scores: list[float], index: list[int], eps: float = 1e-6) -> list[float]:
    """compute_grpo_vectorized_outcome_advantage via group_mean_std: std = sqrt(max(var, eps)) (a floor of
    sqrt(1e-6) = 1e-3), a group of one mean 0 std 1. E.g. [0, 1e-4]: std 7.07e-5 is floored to 1e-3
    -> +-5e-5 / (1e-3 + 1e-6) = +-0.04995, where the loop gives +-5e-5 / (7.07e-5 + 1e-6) = +-0.69725."""
    members = defaultdict(list)
    for s, i in zip(scores, index):
        members[i].append(s)
    stat = {}
    for i, ss in members.items():
        c, s1, s2 = len(ss), sum(ss), sum(x * x for x in ss)
        var = (s2 - s1 * s1 / c) / max(c - 1, 1)
        stat[i] = (0.0, 1.0) if c == 1 else (s1 / c, math.sqrt(max(var, eps)))
    return [(s - stat[i][0]) / (stat[i][1] + eps) for s, i in zip(scores, index)]


def verl_rloo(scores: list[float], index: list[int], vectorized: bool = False) -> list[float]:
    """compute_rloo_outcome_advantage: s G/(G-1) - mean G/(G-1); a group of one keeps s (the loop) or gets 0
    (rloo_vectorized: `* (c > 1)`). E.g. [1, 0, 0, 1]: 1 * 4/3 - 0.5 * 4/3 = 2/3."""
    members = defaultdict(list)
    for s, i in zip(scores, index):
        members[i].append(s)
    out = []
    for s, i in zip(scores, index):
        c, mean = len(members[i]), sum(members[i]) / len(members[i])
        out.append(s * c / (c - 1) - mean * c / (c - 1) if c > 1 else (0.0 if vectorized else s))
    return out


def verl_reinforce_pp(token_level_rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """compute_reinforce_plus_plus_outcome_advantage: discounted returns over tokens, the running return reset
    at every masked position, then masked_whiten * mask. E.g. one row, rewards [0, 0, 1], mask [1, 0, 1], gamma 1:
    returns [0, 1, 1] (the hole at position 1 resets the running return: position 0 gets 0)."""
    returns = torch.zeros_like(token_level_rewards)
    running = torch.zeros(token_level_rewards.shape[0], dtype=torch.float64)
    for t in reversed(range(token_level_rewards.shape[1])):
        running = token_level_rewards[:, t] + gamma * running
        returns[:, t] = running
        running = running * mask[:, t]
    return verl_masked_whiten(returns, mask) * mask, returns


def verl_reinforce_pp_baseline(token_level_rewards: torch.Tensor, mask: torch.Tensor, index: list[int]) -> torch.Tensor:
    """compute_reinforce_plus_plus_baseline_outcome_advantage: score - group mean (a group of one: mean 0),
    tiled over the row's tokens, masked_whiten * mask."""
    scores = token_level_rewards.sum(-1)
    members = defaultdict(list)
    for s, i in zip(scores.tolist(), index):
        members[i].append(s)
    centred = torch.tensor(
        [
            s - (0.0 if len(members[i]) == 1 else sum(members[i]) / len(members[i]))
            for s, i in zip(scores.tolist(), index)
        ],
        dtype=torch.float64,
    )
    return verl_masked_whiten(centred[:, None].expand_as(mask) * mask, mask) * mask


def verl_gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float):
    """compute_gae_advantage_return: masked positions carry nextvalues and lastgaelam through unchanged;
    returns = A + V; A then masked_whiten-ed. E.g. rewards [0, x, 1], values [0.5, x, 0.8], mask [1, 0, 1],
    gamma 0.9, lam 0.5: A_2 = 1 - 0.8 = 0.2; A_0 = 0 + 0.9 * 0.8 - 0.5 + 0.45 * 0.2 = 0.31 (the hole skipped)."""
    next_v = last = torch.zeros(rewards.shape[0], dtype=torch.float64)
    out = []
    for t in reversed(range(rewards.shape[1])):
        delta = rewards[:, t] + gamma * next_v - values[:, t]
        new = delta + gamma * lam * last
        next_v = values[:, t] * mask[:, t] + (1 - mask[:, t]) * next_v
        last = new * mask[:, t] + (1 - mask[:, t]) * last
        out.append(last)
    adv = torch.stack(out[::-1], dim=1)
    return verl_masked_whiten(adv, mask), adv + values


def test_verl_references_by_hand():
    # the worked examples in the docstrings above
    assert verl_masked_whiten(
        torch.tensor([1.0, 3.0, 3.0, 3.0], dtype=torch.float64), torch.ones(4)
    ).tolist() == pytest.approx([-1.5, 0.5, 0.5, 0.5], abs=1e-7)
    assert verl_grpo([1.0, 0.0, 0.0, 1.0, 3.0], [0, 0, 0, 0, 1]) == pytest.approx(
        [0.866024, -0.866024, -0.866024, 0.866024, 3 / (1 + 1e-6)], abs=1e-6
    )
    assert verl_grpo_vectorized([0.0, 1e-4], [0, 0]) == pytest.approx([-0.04995005, 0.04995005], abs=1e-7)
    assert verl_grpo([0.0, 1e-4], [0, 0]) == pytest.approx([-0.697246, 0.697246], abs=1e-6)
    assert verl_rloo([1.0, 0.0, 0.0, 1.0, 7.0], [0, 0, 0, 0, 1]) == pytest.approx([2 / 3, -2 / 3, -2 / 3, 2 / 3, 7])
    assert verl_rloo([7.0], [1], vectorized=True) == [0.0]
    one = torch.tensor([[0.0, 0.0, 1.0]], dtype=torch.float64)
    _, returns = verl_reinforce_pp(one, torch.tensor([[1.0, 0.0, 1.0]], dtype=torch.float64), gamma=1.0)
    assert returns[0].tolist() == [0.0, 1.0, 1.0]
    _, ret = verl_gae(
        torch.tensor([[0.0, 9.0, 1.0]], dtype=torch.float64),
        torch.tensor([[0.5, 9.0, 0.8]], dtype=torch.float64),
        torch.tensor([[1.0, 0.0, 1.0]], dtype=torch.float64),
        0.9,
        0.5,
    )
    assert [ret[0, 0] - 0.5, ret[0, 2] - 0.8] == pytest.approx([0.31, 0.2])


def verl_rows(g: torch.Generator, length: int = 7, holes: bool = True, extreme: bool = False):
    """A random verl batch of one-step trajectories: scores [B] (groups of 1..5, some all equal, some extreme),
    group index [B], response mask [B, L] (some rows empty; holes inside a response when `holes`), and the
    token-level rewards [B, L] with each score on its row's last unmasked token (verl's score: their sum)."""
    scores, index = [], []
    while len(scores) < 3 or torch.rand(1, generator=g) < 0.8:
        size = int(torch.randint(1, 6, (1,), generator=g))
        kind = int(torch.randint(0, 4, (1,), generator=g))
        base = (
            [float(torch.randint(0, 2, (1,), generator=g)) for _ in range(size)]
            if kind == 0
            else [float(torch.randint(-3, 4, (1,), generator=g))] * size
            if kind == 1
            else torch.randn(size, generator=g, dtype=torch.float64).tolist()
        )
        if extreme and kind == 3:  # a large offset with a small spread, or a huge spread
            base = [1e6 + 1e-2 * x for x in base] if len(scores) % 2 else [1e8 * x for x in base]
        scores += base
        index += [len(set(index)) * 3 + 1] * size
    b = len(scores)
    lens = torch.randint(0, length + 1, (b,), generator=g)
    lens[0] = max(int(lens[0]), 2)  # at least two tokens in the batch
    mask = (torch.arange(length)[None, :] < lens[:, None]).double()
    if holes:
        mask = mask * (torch.rand(b, length, generator=g) > 0.25).double()
        mask[:, 0] = (lens > 0).double()
    last = (mask * torch.arange(1, length + 1)).argmax(-1)
    rewards = torch.zeros(b, length, dtype=torch.float64)
    rewards[torch.arange(b), last] = torch.tensor(scores, dtype=torch.float64) * (mask.sum(-1) > 0)
    return rewards.sum(-1).tolist(), index, mask, rewards  # an empty response's score is 0 (nowhere to put it)


def one_step_input(scores, index, mask) -> AdvantageInput:
    b = len(scores)
    return AdvantageInput(
        rewards=torch.tensor(scores, dtype=torch.float64),
        traj_index=torch.arange(b) * 2 + 5,
        group_index=torch.tensor(index),
        step_index=torch.zeros(b, dtype=torch.long),
        dones=torch.ones(b, dtype=torch.bool),
        tokens=mask.sum(-1).long(),
    )


@pytest.mark.parametrize("extreme", [False, True])
def test_grpo_and_rloo_are_verls(extreme):
    g = torch.Generator().manual_seed(11 + extreme)
    for _ in range(30):
        scores, index, mask, _ = verl_rows(g, extreme=extreme)
        inp = one_step_input(scores, index, mask)
        alone = [index.count(i) == 1 for i in index]
        for norm in (True, False):
            verl = torch.tensor(verl_grpo(scores, index, norm_by_std=norm), dtype=torch.float64)
            ours = grpo(inp, norm_by_std=norm, group_of_one="score")[0]
            torch.testing.assert_close(ours, verl, atol=1e-6, rtol=0)
            # zero (the default): the same but a group of one gets 0
            torch.testing.assert_close(
                grpo(inp, norm_by_std=norm)[0], torch.where(torch.tensor(alone), 0.0, verl), atol=1e-6, rtol=0
            )
            torch.testing.assert_close(
                grpo_reference(inp, norm_by_std=norm, group_of_one="score"), verl, atol=1e-6, rtol=0
            )
        # RLOO: score is verl's rloo, zero its rloo_vectorized
        torch.testing.assert_close(
            rloo(inp, group_of_one="score")[0],
            torch.tensor(verl_rloo(scores, index), dtype=torch.float64),
            atol=1e-6,
            rtol=0,
        )
        torch.testing.assert_close(
            rloo(inp)[0],
            torch.tensor(verl_rloo(scores, index, vectorized=True), dtype=torch.float64),
            atol=1e-6,
            rtol=0,
        )


def test_grpo_is_verls_loop_not_its_vectorized_form_below_a_std_of_1e3():
    # verl's grpo_vectorized floors the std at sqrt(eps) = 1e-3: on [0, 1e-4] it gives +-0.04995 where the loop
    # (and this project) give +-0.697246. With every group's std above 1e-3 the two agree (checked on random groups).
    inp = one_step_input([0.0, 1e-4], [0, 0], torch.ones(2, 1))
    assert grpo(inp)[0].tolist() == pytest.approx([-0.697246, 0.697246], abs=1e-6)
    assert verl_grpo_vectorized([0.0, 1e-4], [0, 0]) != pytest.approx(grpo(inp)[0].tolist(), abs=1e-3)
    g = torch.Generator().manual_seed(4)
    for _ in range(20):
        scores, index, mask, _ = verl_rows(g)
        spread = {i: torch.tensor([s for s, j in zip(scores, index) if j == i], dtype=torch.float64) for i in index}
        if all(len(v) < 2 or float(v.var()) >= 1e-6 or float(v.var()) == 0 for v in spread.values()):
            torch.testing.assert_close(
                grpo(one_step_input(scores, index, mask), group_of_one="score")[0],
                torch.tensor(verl_grpo_vectorized(scores, index), dtype=torch.float64),
                atol=1e-6,
                rtol=0,
            )


def test_gigpo_episode_level_group_of_one():
    # one trajectory alone in its group, two steps with rewards [0, 2] and anchors "a", "b" (step groups of one):
    #   zero: episode 0, steps 0 -> A = [0, 0]
    #   score: episode R = 2 -> 2 / (1 + 1e-6) (norm_by_std) or 2; step level still 0 (verl-agent: mean = itself)
    inp = inp_of([0.0, 2.0], traj=[0, 0], group=[0, 0], steps=[0, 1], anchors=["a", "b"])
    assert gigpo(inp)[0].tolist() == [0.0, 0.0]
    assert gigpo(inp, group_of_one="score")[0].tolist() == pytest.approx([2 / (1 + 1e-6)] * 2, abs=1e-6)
    assert gigpo(inp, group_of_one="score", norm_by_std=False)[0].tolist() == [2.0, 2.0]


@pytest.mark.parametrize("extreme", [False, True])
def test_reinforce_pp_is_verls(extreme):
    # gamma = 1 and contiguous responses: verl discounts over a response's tokens and resets at every hole
    # (docs/algorithms.md); a one-step trajectory's tokens all share its return here.
    g = torch.Generator().manual_seed(21 + extreme)
    for _ in range(30):
        scores, index, mask, rewards = verl_rows(g, holes=False, extreme=extreme)
        verl, _ = verl_reinforce_pp(rewards, mask, gamma=1.0)  # [B, L]
        inp = one_step_input(scores, index, mask)
        ours = reinforce_pp(inp)[0]  # [B]
        assert torch.allclose((ours[:, None] * mask), verl, atol=1e-6, rtol=0)
        # the step's version: whiten=False, then the same sums over all ranks' tokens (two halves here)
        raw = reinforce_pp(inp, whiten=False)[0]
        k = len(scores) // 2
        first = [sum(x) for x in zip(whitening_sums(raw[:k], inp.tokens[:k]), whitening_sums(raw[k:], inp.tokens[k:]))]
        centre = first[1] / first[0]
        sums = [
            sum(x)
            for x in zip(
                whitening_sums(raw[:k], inp.tokens[:k], centre), whitening_sums(raw[k:], inp.tokens[k:], centre)
            )
        ]
        assert torch.allclose(whiten(raw, *sums, centre=centre)[:, None] * mask, verl, atol=1e-6, rtol=0)


@pytest.mark.parametrize("extreme", [False, True])
def test_reinforce_pp_baseline_is_verls(extreme):
    g = torch.Generator().manual_seed(31 + extreme)
    for _ in range(30):
        scores, index, mask, rewards = verl_rows(g, holes=True, extreme=extreme)
        inp = one_step_input(scores, index, mask)
        verl = verl_reinforce_pp_baseline(rewards, mask, index)  # [B, L]
        ours = reinforce_pp_baseline(inp, group_of_one="score")[0]  # [B]
        assert torch.allclose(ours[:, None] * mask, verl, atol=1e-6, rtol=0)
        # zero: a group of one is centred on its own score (0 for one step): verl's with that score set to 0
        alone = torch.tensor([index.count(i) == 1 for i in index])
        verl_zero = verl_reinforce_pp_baseline(torch.where(alone[:, None], 0.0, rewards), mask, index)
        assert torch.allclose(reinforce_pp_baseline(inp)[0][:, None] * mask, verl_zero, atol=1e-6, rtol=0)


def test_whitening_is_verls_masked_whiten_on_extreme_values():
    g = torch.Generator().manual_seed(8)
    for offset, scale in [(0.0, 1.0), (1e6, 1e-2), (-3e7, 1.0), (0.0, 1e8), (5.0, 1e-9)]:
        for _ in range(10):
            n = int(torch.randint(2, 30, (1,), generator=g))
            adv = offset + scale * torch.randn(n, generator=g, dtype=torch.float64)  # [N]
            tokens = torch.randint(0, 6, (n,), generator=g)
            tokens[0] = 2
            mask = (torch.arange(6)[None, :] < tokens[:, None]).double()  # [N, 6]
            verl = verl_masked_whiten(adv[:, None].expand_as(mask), mask)[:, 0]
            seen = tokens > 0  # a step without tokens: verl masks it out (here it is whitened, and never used)
            assert torch.allclose(whiten_batch(adv, tokens)[seen], verl[seen], atol=1e-6, rtol=0), (offset, scale)


def test_gae_is_verls_with_holes_in_the_mask():
    # verl's row = one trajectory, its unmasked positions = the steps (step_index = the position: holes are gaps)
    g = torch.Generator().manual_seed(41)
    for _ in range(20):
        j, length = int(torch.randint(1, 6, (1,), generator=g)), int(torch.randint(2, 8, (1,), generator=g))
        rewards = torch.randn(j, length, generator=g, dtype=torch.float64)
        values = torch.randn(j, length, generator=g, dtype=torch.float64) * 3
        mask = (torch.rand(j, length, generator=g) > 0.3).double()
        mask[0, 0] = mask[0, -1] = 1.0  # at least two positions
        whitened, returns = verl_gae(rewards, values, mask, gamma=0.9, lam=0.8)
        rows, cols = mask.nonzero(as_tuple=True)
        inp = AdvantageInput(
            rewards=rewards[rows, cols],
            traj_index=rows,
            group_index=torch.zeros_like(rows),
            step_index=cols,
            dones=torch.zeros_like(rows, dtype=torch.bool),
            values=values[rows, cols],
        )
        adv, _ = gae(inp, gamma=0.9, lam=0.8)
        torch.testing.assert_close(returns_of("gae", inp, adv), returns[rows, cols], atol=1e-6, rtol=0)
        torch.testing.assert_close(whiten_batch(adv), whitened[rows, cols], atol=1e-6, rtol=0)


# --------------------------------------------------------------------------------------- rewards on tokens
def token_rows(g: torch.Generator, extreme: bool = False):
    """`verl_rows` (contiguous responses) with rewards also on random tokens of each response, as verl's
    token_level_rewards may hold; returns what verl sees and what the wire carries: each step's whole reward
    (the row's sum), its token rewards (the row's rewards before its last token) and its response lengths."""
    scores, index, mask, rewards = verl_rows(g, holes=False, extreme=extreme)
    lens = mask.sum(-1).long()  # [B]
    placed = torch.randn(rewards.shape, generator=g, dtype=torch.float64)
    placed = placed * (torch.rand(rewards.shape, generator=g) < 0.3)
    placed = placed * (torch.arange(rewards.shape[1])[None, :] < (lens[:, None] - 1))  # before each row's last token
    rewards = rewards + placed * (1e4 if extreme else 1.0)
    token_rewards = torch.cat([rewards[b, : int(lens[b])] for b in range(len(scores))])  # [R]
    return rewards.sum(-1).tolist(), index, mask, rewards, token_rewards, lens


def test_rewards_to_go_by_hand_and_against_the_reference():
    # a step whose advantage is 5 with 1.0 on its 2nd token of 3: tokens 0 and 1 keep 5 (the reward is theirs),
    # token 2 comes after it: 4. An empty response takes nothing; the next response starts afresh.
    got = rewards_to_go(torch.tensor([5.0, 9.0, 2.0]), torch.tensor([0.0, 1.0, 0.0, 0.5, 0.5]), torch.tensor([3, 0, 2]))
    assert got.tolist() == [5.0, 5.0, 4.0, 2.0, 1.5]
    g = torch.Generator().manual_seed(3)
    for _ in range(50):
        n = int(torch.randint(1, 9, (1,), generator=g))
        lens = torch.randint(0, 6, (n,), generator=g)
        adv, tr = (
            torch.randn(n, generator=g, dtype=torch.float64),
            torch.randn(int(lens.sum()), generator=g, dtype=torch.float64),
        )
        ref = rewards_to_go_reference(adv.tolist(), tr.tolist(), lens.tolist())
        assert rewards_to_go(adv, tr, lens).tolist() == pytest.approx(ref, abs=1e-12)


def per_token(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """verl's [B, L] rows, contiguous from position 0, as this project's [R] (the responses end to end)."""
    return x[mask.bool()]


@pytest.mark.parametrize("extreme", [False, True])
def test_reinforce_pp_with_token_rewards_is_verls(extreme):
    # verl's per-token return at gamma = 1 is the step's return less the rewards placed before the token
    g = torch.Generator().manual_seed(51 + extreme)
    for _ in range(30):
        scores, index, mask, rewards, token_rewards, lens = token_rows(g, extreme)
        verl, verl_returns = verl_reinforce_pp(rewards, mask, gamma=1.0)  # [B, L]
        inp = one_step_input(scores, index, mask)
        to_go = rewards_to_go(reinforce_pp(inp, whiten=False)[0], token_rewards, lens)  # [R]
        torch.testing.assert_close(to_go, per_token(verl_returns, mask), atol=1e-6, rtol=0)
        torch.testing.assert_close(whiten_batch(to_go), per_token(verl, mask), atol=1e-6, rtol=0)


def test_gae_with_token_rewards_is_verls_at_gamma_and_lam_1():
    # one value per step (verl: the same value at each of its tokens): verl's per-token GAE at gamma = lam = 1 is
    # sum_{k >= t} r_k - V, the step's GAE less the rewards placed before the token
    g = torch.Generator().manual_seed(61)
    for _ in range(30):
        scores, index, mask, rewards, token_rewards, lens = token_rows(g)
        values = torch.randn(len(scores), generator=g, dtype=torch.float64) * 2  # [B]
        verl_whitened, verl_returns = verl_gae(rewards, values[:, None].expand_as(mask), mask, gamma=1.0, lam=1.0)
        inp = dataclasses.replace(one_step_input(scores, index, mask), values=values)
        to_go = rewards_to_go(gae(inp, gamma=1.0, lam=1.0)[0], token_rewards, lens)  # [R]
        verl_adv = per_token(verl_returns - values[:, None], mask)
        torch.testing.assert_close(to_go, verl_adv, atol=1e-6, rtol=0)
        torch.testing.assert_close(whiten_batch(to_go), per_token(verl_whitened, mask), atol=1e-6, rtol=0)
