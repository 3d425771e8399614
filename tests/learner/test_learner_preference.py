"""Online DPO: pairs, the DPO loss and its gradient by hand, fast == slow reference, and the learner's policy
objective carrying exactly DPO's gradient."""

from __future__ import annotations

import dataclasses
import math
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from learner_oracles import online_dpo_reference
from learner_testing import FakeBroker, make_batch, run_ranks

from agentstream.config import Config, save
from learner.advantages import AdvantageInput, compute_advantages, count_pairs, online_dpo
from learner.batching import Sequences, make_micro_batches
from learner.losses import PolicyLossInput, policy_objective
from learner.model import load_policy
from learner.preference import preference_pairs
from learner.step import (
    StepOptions,
    advantage_input,
    make_step_models,
    refresh_reference,
    sequence_logprobs,
    train_step,
)


def inp_of(rewards, traj, group, logp, ref_logp, steps=None) -> AdvantageInput:
    steps = steps if steps is not None else [0] * len(rewards)
    return AdvantageInput(
        rewards=torch.tensor(rewards, dtype=torch.float64),
        traj_index=torch.tensor(traj),
        group_index=torch.tensor(group),
        step_index=torch.tensor(steps),
        dones=torch.ones(len(rewards), dtype=torch.bool),
        logp=torch.tensor(logp, dtype=torch.float64),
        ref_logp=torch.tensor(ref_logp, dtype=torch.float64),
    )


def test_one_pair_by_hand():
    # group 0: trajectory 0 (return 1, the chosen) and 1 (return 0, the rejected); beta = 0.5.
    #   log pi: c -2.0, r -3.0;  log pi_ref: c -2.5, r -2.5
    #   z = 0.5 * ((-2.0 + 2.5) - (-3.0 + 2.5)) = 0.5 * (0.5 + 0.5) = 0.5
    #   loss = -log sigmoid(0.5) = log(1 + e^-0.5) = 0.474077
    #   A_c = +0.5 * sigmoid(-0.5) = 0.5 * 0.377541 = 0.188771,  A_r = -0.188771
    adv, stats = online_dpo(inp_of([1.0, 0.0], [0, 1], [0, 0], [-2.0, -3.0], [-2.5, -2.5]), beta=0.5)
    assert adv.tolist() == pytest.approx([0.188771, -0.188771], abs=1e-6)
    assert stats["dpo_loss"] == pytest.approx(0.474077, abs=1e-6)
    assert stats["dpo_pair_count"] == 1 and stats["dpo_accuracy"] == 1.0
    assert stats["dpo_margin"] == pytest.approx(1.0)  # z / beta


def test_multi_turn_sums_steps_and_ties_and_lone_groups_are_skipped_and_counted():
    # group 0: trajectory 0 has two steps (rewards 0 + 1, log pi -1 + -1 = -2, ref -1.5 + -1.5 = -3),
    #          trajectory 1 one step (reward 0.5, log pi -1, ref -1), trajectory 2 one step (reward 0, log pi -4,
    #          ref -2): chosen 0 (return 1), rejected 2 (return 0); 1 is in neither.
    #          z = 1 * ((-2 + 3) - (-4 + 2)) = 1 + 2 = 3;  A = sigmoid(-3) = 0.0474259 on both of 0's steps.
    # group 1: trajectories 3 and 4 both return 2: a tie.   group 2: trajectory 5 alone.
    inp = inp_of(
        rewards=[0.0, 1.0, 0.5, 0.0, 2.0, 2.0, 7.0],
        traj=[0, 0, 1, 2, 3, 4, 5],
        group=[0, 0, 0, 0, 1, 1, 2],
        logp=[-1.0, -1.0, -1.0, -4.0, -1.0, -1.0, -1.0],
        ref_logp=[-1.5, -1.5, -1.0, -2.0, -1.0, -1.0, -1.0],
        steps=[0, 1, 0, 0, 0, 0, 0],
    )
    adv, stats = online_dpo(inp, beta=1.0)
    a = 1 / (1 + math.exp(3))
    assert adv.tolist() == pytest.approx([a, a, 0.0, -a, 0.0, 0.0, 0.0], abs=1e-9)
    assert (stats["dpo_pair_count"], stats["dpo_tie_count"], stats["dpo_lone_count"]) == (1, 1, 1)
    assert count_pairs(inp) == 1


def test_first_trajectory_wins_among_equal_best_returns():
    # returns 1, 1, 0: trajectories 0 and 1 share the best return; 0 (the lower id) is chosen, 2 rejected.
    pairs = preference_pairs(torch.tensor([1.0, 1.0, 0.0], dtype=torch.float64), torch.tensor([0, 0, 0]), 1)
    assert (pairs.chosen.tolist(), pairs.rejected.tolist()) == ([0], [2])


def random_case(rng: random.Random) -> AdvantageInput:
    rows = []
    traj = 0
    for g in range(rng.randint(1, 6)):
        for _ in range(rng.choice([1, 2, 3, 4])):
            reward_choices = [0.0, 1.0] if rng.random() < 0.7 else [1.0]  # some groups all equal: ties
            for s in range(rng.randint(1, 3)):
                rows.append((rng.choice(reward_choices), traj, g, rng.uniform(-30, 0), rng.uniform(-30, 0), s))
            traj += 1
    rng.shuffle(rows)
    r, t, g, lp, rf, s = (list(c) for c in zip(*rows))
    return inp_of(r, t, g, lp, rf, s)


@pytest.mark.parametrize("seed", range(25))
def test_fast_equals_reference_and_advantages_are_minus_the_dpo_gradient(seed):
    rng = random.Random(seed)
    inp = random_case(rng)
    beta = rng.choice([0.01, 0.1, 1.0])
    adv, stats = compute_advantages("online_dpo", inp, beta=beta)
    ref_adv, ref_loss = online_dpo_reference(
        inp.rewards.tolist(),
        inp.traj_index.tolist(),
        inp.group_index.tolist(),
        inp.logp.tolist(),
        inp.ref_logp.tolist(),
        beta=beta,
    )
    assert adv.tolist() == pytest.approx(ref_adv, abs=1e-9)
    assert stats["dpo_loss"] == pytest.approx(ref_loss, abs=1e-9)
    # The DPO loss written out, differentiated by autograd w.r.t. each step's log-prob: the surrogate
    # -sum A_i logp_i has gradient -A, so A must be minus DPO's gradient.
    logp = inp.logp.clone().requires_grad_(True)
    ret, lp, rf, members = {}, {}, {}, {}
    for i in range(inp.rewards.numel()):
        t = int(inp.traj_index[i])
        ret[t] = ret.get(t, 0.0) + float(inp.rewards[i])
        lp[t] = lp.get(t, 0.0) + logp[i]
        rf[t] = rf.get(t, 0.0) + float(inp.ref_logp[i])
        members.setdefault(int(inp.group_index[i]), set()).add(t)
    losses = []
    for ts in members.values():
        best = max(sorted(ts), key=lambda t: ret[t])  # max/min keep the first of equal keys: the lowest id
        worst = min(sorted(ts), key=lambda t: ret[t])
        if ret[best] > ret[worst]:
            losses.append(torch.nn.functional.softplus(-beta * ((lp[best] - rf[best]) - (lp[worst] - rf[worst]))))
    if not losses:
        assert not adv.any() and stats["dpo_pair_count"] == 0
        return
    torch.stack(losses).mean().backward()
    assert (-logp.grad).tolist() == pytest.approx(adv.tolist(), abs=1e-9)


def test_pair_count_gives_the_global_mean():
    # One rank's share has 1 pair, the global batch 4: each advantage is a quarter of the local mean's.
    inp = inp_of([1.0, 0.0], [0, 1], [0, 0], [-2.0, -3.0], [-2.5, -2.5])
    local, _ = online_dpo(inp, beta=0.5)
    global_, _ = online_dpo(inp, beta=0.5, pair_count=4.0)
    assert global_.tolist() == pytest.approx((local / 4).tolist())


def test_policy_objective_with_token_sum_has_the_dpo_gradient():
    # Two steps per trajectory, several tokens each: the learner's loss (PPO-clip at ratio 1, no off-policy
    # weight, token-sum) with online DPO's advantages must have the gradient of the DPO loss itself, whose
    # sequence log-probs are the token sums over each trajectory's steps.
    torch.manual_seed(0)
    beta = 0.3
    rows = [(0, 0, 0, 1.0), (0, 0, 1, 0.0), (1, 0, 0, 0.0), (1, 0, 1, 0.0), (2, 1, 0, 0.0), (3, 1, 0, 2.0)]
    traj, group, steps, rewards = (list(c) for c in zip(*rows))
    b, t = len(rows), 5
    mask = torch.rand(b, t) < 0.8
    mask[:, 0] = True
    logits = torch.randn(b, t, dtype=torch.float64, requires_grad=True)
    logp = torch.nn.functional.logsigmoid(logits)  # [B, T] token log-probs with a gradient
    ref_tok = torch.nn.functional.logsigmoid(torch.randn(b, t, dtype=torch.float64))  # [B, T]
    seq = lambda x: torch.where(mask, x, 0.0).sum(-1)  # noqa: E731  [B]
    inp = inp_of(rewards, traj, group, seq(logp.detach()).tolist(), seq(ref_tok).tolist(), steps)
    adv, _ = online_dpo(inp, beta=beta)
    loss, _ = policy_objective(
        PolicyLossInput(logp=logp, prox_logp=logp.detach(), behav_logp=logp.detach(), advantages=adv, mask=mask),
        off_policy="none",
        agg="token-sum",
    )
    (got,) = torch.autograd.grad(loss, logits, retain_graph=True)
    # DPO by hand: group 0 chosen 0 (return 1) vs rejected 1 (0); group 1 chosen 3 (2) vs rejected 2 (0).
    s = seq(logp)
    r = seq(ref_tok)
    tr = lambda x, j: x[[i for i in range(b) if traj[i] == j]].sum()  # noqa: E731
    z = [beta * ((tr(s, c) - tr(r, c)) - (tr(s, w) - tr(r, w))) for c, w in [(0, 1), (3, 2)]]
    (want,) = torch.autograd.grad(torch.stack([torch.nn.functional.softplus(-x) for x in z]).mean(), logits)
    assert torch.allclose(got, want, atol=1e-9)


def test_an_online_dpo_step_lowers_the_dpo_loss_and_a_refresh_makes_the_reference_the_policy(
    one_rank, tiny_model_dir: Path
):
    # One learner step through train_step on one gloo rank: 3 groups of 2 (make_batch: odd trajectories return 1,
    # even 0, so every group is one pair). The reference is the initial policy, so at the start every z is 0 and
    # the DPO loss is -log sigmoid(0) = log 2 exactly; one AdamW step along DPO's gradient lowers it; refreshing
    # the reference to the policy brings it back to log 2.
    cfg = Config()
    cfg.model.path = str(tiny_model_dir)
    a = cfg.algorithm
    a.advantage, a.reference, a.loss_agg, a.off_policy = "online_dpo", "frozen_copy", "token-sum", "none"
    a.dpo_beta = 0.5
    device = torch.device("cpu")
    model = load_policy(cfg.model.path, "float32", device, 1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    models = make_step_models(cfg.model, a, cfg.learner, device, 1)
    opts = StepOptions.from_config(cfg.learner, a)
    batch = make_batch(0, 0, np.random.default_rng(0), n_groups=3, group_size=2, max_steps=2)

    def dpo_now() -> dict[str, float]:
        seqs = Sequences.from_batch(batch)
        mbs = make_micro_batches(seqs, torch.zeros(seqs.num_transitions), opts.micro_batch_tokens)
        logp, ref_logp = sequence_logprobs(model, mbs, seqs, models)
        return compute_advantages("online_dpo", advantage_input(batch, logp=logp, ref_logp=ref_logp), beta=0.5)[1]

    assert dpo_now()["dpo_loss"] == pytest.approx(math.log(2), abs=1e-6)
    metrics = train_step(model, optimizer, batch, opts, version=0, world_size=1, device=device, models=models)
    assert (metrics["adv_dpo_pair_count"], metrics["adv_dpo_tie_count"]) == (3, 0)
    assert metrics["adv_dpo_loss"] == pytest.approx(math.log(2), abs=1e-6)
    after = dpo_now()
    assert after["dpo_loss"] < math.log(2) - 1e-4 and after["dpo_accuracy"] > 0
    refresh_reference(model, models.reference)
    assert dpo_now()["dpo_loss"] == pytest.approx(math.log(2), abs=1e-6)


def test_two_ranks_spin_pair_every_group_and_keep_the_reference_on_the_policy(tiny_model_dir: Path, tmp_path: Path):
    # Two gloo ranks under the learner's main() (FSDP2-sharded policy and reference), `algorithm=spin` with the
    # reference refreshed every version. make_batch's groups of 2 each hold a return-1 and a return-0 trajectory:
    # rank 0 gets 1 group, a pair; rank 1 gets 2 groups with every reward 0, two ties. The reference equals the
    # policy each step starts from, so every z is 0 and the DPO loss, a mean over the global batch's one pair, is
    # log 2 exactly (not the mean of the ranks' log 2 and 0); the gradient is not 0 (sigmoid(0) = 1/2), and the
    # reference follows every version.
    cfg = Config()
    cfg.run.output_dir = str(tmp_path)
    cfg.model.path = str(tiny_model_dir)
    cfg.learner.world_size, cfg.learner.micro_batch_tokens, cfg.trainer.total_steps = 2, 64, 3
    a = cfg.algorithm
    a.advantage, a.reference, a.loss_agg, a.off_policy = "online_dpo", "frozen_copy", "token-sum", "none"
    a.ref_update_every = 1
    save(cfg, tmp_path / "config.yaml")
    shares = {
        (s, r): make_batch(s, r, np.random.default_rng(10 * s + r), n_groups=1 + r, max_steps=2, learner_version=s)
        for s in range(3)
        for r in (0, 1)
    }
    for s in range(3):
        shares[s, 1] = dataclasses.replace(shares[s, 1], rewards=np.zeros_like(shares[s, 1].rewards))
    argv = ["--config", str(tmp_path / "config.yaml"), "--out", str(tmp_path / "run"), "--engines", "0"]
    with FakeBroker(lambda step, rank: shares[step, rank]) as broker:
        run_ranks(2, argv + ["--broker", broker.address], timeout_s=120)
    updates = [m.metrics for _, m in broker.of_kind("version_update")]
    assert [u["reference_version"] for u in updates] == [1.0, 2.0, 3.0]
    for m in updates:
        assert (m["adv_dpo_pair_count"], m["adv_dpo_tie_count"], m["adv_dpo_lone_count"]) == (1, 2, 0)
        assert m["adv_dpo_loss"] == pytest.approx(math.log(2), abs=1e-6) and m["grad_norm"] > 0
