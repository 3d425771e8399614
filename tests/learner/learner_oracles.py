"""The slow, obvious references (test oracles) of the learner's fast paths: python loops and floats, written
to be read, not run at scale. Each test beside this module holds a fast function against its reference here on
random inputs (`test_learner_advantages.py`, `_algos`, `_losses`, `_critic`, `_preference`); the equations are in
the fast functions' docstrings.

    from learner_oracles import grpo_reference   # tests/learner is on pytest's `pythonpath` (pyproject.toml)

Shapes: N = transitions (env steps), B = sequences (one response per row), T = tokens per row.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from learner.advantages import _MEAN_EPS, AdvantageInput
from learner.losses import GSPO_LOG_RATIO_MAX, PPO_LOG_RATIO_CLAMP, PolicyLossInput
from learner.offpolicy import _MAX_LOG_RATIO


# --------------------------------------------------------------------------------------- learner.advantages
def whiten_reference(adv: list[float], tokens: list[int], eps: float = 1e-8) -> list[float]:
    """Slow, obvious whitening: every token is one sample of its step's advantage (verl's 1e-8 beside the count)."""
    samples = [a for a, k in zip(adv, tokens) for _ in range(k)]
    n = len(samples)
    if n < 2:
        return list(adv)
    mu = sum(samples) / (n + _MEAN_EPS)
    var = sum((x - mu) ** 2 for x in samples) / (n + _MEAN_EPS) * n / (n - 1)
    return [(a - mu) / math.sqrt(var + eps) for a in adv]


def _trajectories(inp: AdvantageInput) -> dict[int, list[int]]:
    """Reference helper: trajectory id -> its transition indices ordered by step_index."""
    out: dict[int, list[int]] = {}
    for i in range(inp.rewards.numel()):
        out.setdefault(int(inp.traj_index[i]), []).append(i)
    return {t: sorted(ix, key=lambda i: int(inp.step_index[i])) for t, ix in out.items()}


def _discounted_reference(inp: AdvantageInput, gamma: float) -> list[float]:
    g = [0.0] * inp.rewards.numel()
    for ix in _trajectories(inp).values():
        running = 0.0
        for i in reversed(ix):
            running = float(inp.rewards[i]) + gamma * running
            g[i] = running
    return g


def _norm_reference(xs: list[float], norm_by_std: bool, eps: float, group_of_one: str = "zero") -> list[float]:
    """Reference group normalisation: equal values -> 0; one value -> 0 or (group_of_one="score") x / (1 + eps)."""
    if len(xs) == 1 and group_of_one == "score":
        return [xs[0] / (1 + eps) if norm_by_std else xs[0]]
    if min(xs) == max(xs):
        return [0.0] * len(xs)
    mean = sum(xs) / len(xs)
    std = math.sqrt(sum((x - mean) ** 2 for x in xs) / (len(xs) - 1))
    return [(x - mean) / (std + eps) if norm_by_std else x - mean for x in xs]


def grpo_reference(
    inp: AdvantageInput, *, norm_by_std: bool = True, eps: float = 1e-6, group_of_one: str = "zero"
) -> Tensor:
    """Slow, obvious GRPO: dictionaries and loops. Returns advantages [N]."""
    returns: dict[int, float] = {}
    group_of: dict[int, int] = {}
    for i in range(inp.rewards.numel()):
        t = int(inp.traj_index[i])
        returns[t] = returns.get(t, 0.0) + float(inp.rewards[i])
        group_of[t] = int(inp.group_index[i])
    members: dict[int, list[int]] = {}
    for t, g in group_of.items():
        members.setdefault(g, []).append(t)
    adv_of: dict[int, float] = {}
    for trajs in members.values():
        adv_of.update(zip(trajs, _norm_reference([returns[t] for t in trajs], norm_by_std, eps, group_of_one)))
    return torch.tensor([adv_of[int(t)] for t in inp.traj_index], dtype=inp.rewards.dtype)


def gigpo_reference(
    inp: AdvantageInput,
    *,
    gamma: float = 0.95,
    step_weight: float = 1.0,
    norm_by_std: bool = True,
    eps: float = 1e-6,
    group_of_one: str = "zero",
) -> Tensor:
    """Slow, obvious GiGPO: dictionaries and loops. Returns advantages [N]."""
    assert inp.anchors is not None
    n = inp.rewards.numel()
    a_ep = grpo_reference(inp, norm_by_std=norm_by_std, eps=eps, group_of_one=group_of_one).tolist()
    g = _discounted_reference(inp, gamma)
    members: dict[object, list[int]] = {}
    for i in range(n):
        a = inp.anchors[i]
        members.setdefault((int(inp.group_index[i]), a) if a else ("alone", i), []).append(i)
    a_step = [0.0] * n
    for ix in members.values():
        for i, v in zip(ix, _norm_reference([g[i] for i in ix], norm_by_std, eps)):
            a_step[i] = v
    return torch.tensor([a_ep[i] + step_weight * a_step[i] for i in range(n)], dtype=inp.rewards.dtype)


def rloo_reference(inp: AdvantageInput, *, group_of_one: str = "zero") -> Tensor:
    """Slow, obvious RLOO. Returns advantages [N]."""
    returns: dict[int, float] = {}
    group_of: dict[int, int] = {}
    for i in range(inp.rewards.numel()):
        t = int(inp.traj_index[i])
        returns[t] = returns.get(t, 0.0) + float(inp.rewards[i])
        group_of[t] = int(inp.group_index[i])
    adv_of = {}
    for t, g in group_of.items():
        others = [returns[u] for u, h in group_of.items() if h == g and u != t]
        alone = returns[t] if group_of_one == "score" else 0.0
        adv_of[t] = returns[t] - sum(others) / len(others) if others else alone
    return torch.tensor([adv_of[int(t)] for t in inp.traj_index], dtype=inp.rewards.dtype)


def reinforce_pp_reference(
    inp: AdvantageInput, *, gamma: float = 1.0, baseline: bool = False, group_of_one: str = "zero", whiten: bool = True
) -> Tensor:
    """Slow, obvious REINFORCE++ (baseline=True: REINFORCE++-baseline). Returns advantages [N]."""
    g = _discounted_reference(inp, gamma)
    if baseline:
        returns: dict[int, float] = {}
        group_of: dict[int, int] = {}
        for i in range(inp.rewards.numel()):
            t = int(inp.traj_index[i])
            returns[t] = returns.get(t, 0.0) + float(inp.rewards[i])
            group_of[t] = int(inp.group_index[i])
        for i in range(len(g)):
            grp = group_of[int(inp.traj_index[i])]
            rs = [r for t, r in returns.items() if group_of[t] == grp]
            g[i] -= 0.0 if len(rs) == 1 and group_of_one == "score" else sum(rs) / len(rs)
    tokens = [1] * len(g) if inp.tokens is None else [int(k) for k in inp.tokens]
    return torch.tensor(whiten_reference(g, tokens) if whiten else g, dtype=inp.rewards.dtype)


def gae_reference(inp: AdvantageInput, *, gamma: float = 1.0, lam: float = 0.95) -> Tensor:
    """Slow, obvious GAE: a python loop per trajectory. Returns advantages [N]."""
    assert inp.values is not None
    out = [0.0] * inp.rewards.numel()
    for ix in _trajectories(inp).values():
        running, next_v = 0.0, 0.0
        for i in reversed(ix):
            v = float(inp.values[i])
            running = float(inp.rewards[i]) + gamma * next_v - v + gamma * lam * running
            out[i], next_v = running, v
    return torch.tensor(out, dtype=inp.rewards.dtype)


# --------------------------------------------------------------------------------------- learner.token_rewards
def rewards_to_go_reference(adv: list[float], token_rewards: list[float], lens: list[int]) -> list[float]:
    """Slow, obvious `rewards_to_go`: a python loop over each response's tokens."""
    out, r = [], 0
    for a, n in zip(adv, lens):
        placed = 0.0
        for k in range(n):
            out.append(a - placed)
            placed += token_rewards[r + k]
        r += n
    return out


# --------------------------------------------------------------------------------------- learner.preference
def online_dpo_reference(
    rewards: list[float],
    traj: list[int],
    groups: list[int],
    logp: list[float],
    ref_logp: list[float],
    *,
    beta: float = 0.1,
) -> tuple[list[float], float]:
    """Slow, obvious online DPO from per-step lists [N]: dictionaries and loops. Returns (advantages [N], the mean
    DPO loss)."""
    ret: dict[int, float] = {}
    lp: dict[int, float] = {}
    rf: dict[int, float] = {}
    group_of: dict[int, int] = {}
    for i, t in enumerate(traj):
        ret[t] = ret.get(t, 0.0) + rewards[i]
        lp[t] = lp.get(t, 0.0) + logp[i]
        rf[t] = rf.get(t, 0.0) + ref_logp[i]
        group_of[t] = groups[i]
    pairs = []
    for g in sorted(set(group_of.values())):
        members = sorted(t for t in group_of if group_of[t] == g)
        best = max(members, key=lambda t: (ret[t], -t))
        worst = min(members, key=lambda t: (ret[t], t))
        if ret[best] > ret[worst]:
            pairs.append((best, worst))
    adv_of = {t: 0.0 for t in group_of}
    loss = 0.0
    for c, r in pairs:
        z = beta * ((lp[c] - rf[c]) - (lp[r] - rf[r]))
        loss += math.log1p(math.exp(-z)) / len(pairs)
        adv_of[c] += beta / (1 + math.exp(z)) / len(pairs)
        adv_of[r] -= beta / (1 + math.exp(z)) / len(pairs)
    return [adv_of[t] for t in traj], loss


# --------------------------------------------------------------------------------------- learner.offpolicy
def off_policy_reference(
    name: str, prox_logp: Tensor, behav_logp: Tensor, mask: Tensor, *, level: str, cap: float
) -> tuple[list[list[float]], list[list[bool]]]:
    """Slow, obvious weights and keep-flags, python floats per token."""
    weights, keeps = [], []
    for b in range(mask.shape[0]):
        toks = [t for t in range(mask.shape[1]) if bool(mask[b, t])]
        seq_log = sum(float(prox_logp[b, t]) - float(behav_logp[b, t]) for t in toks)
        w_row, k_row = [], []
        for t in range(mask.shape[1]):
            if t not in toks:
                w_row.append(0.0), k_row.append(False)
                continue
            lr = seq_log if level == "sequence" else float(prox_logp[b, t]) - float(behav_logp[b, t])
            r = math.exp(min(lr, _MAX_LOG_RATIO))
            if name == "tis":
                w, k = min(r, cap), True
            elif name == "mis":
                k = 1 / cap <= r <= cap
                w = r if k else 0.0
            elif name == "decoupled":
                w, k = r, True
            else:
                w, k = 1.0, True
            w_row.append(w), k_row.append(k)
        weights.append(w_row), keeps.append(k_row)
    return weights, keeps


# --------------------------------------------------------------------------------------- learner.losses
def policy_objective_reference(inp: PolicyLossInput, **kw: float | str | None) -> float:
    """Slow, obvious `policy_objective`: python floats, a loop per sequence and token. Returns the loss."""
    o = (
        dict(
            loss="ppo_clip",
            clip_low=0.2,
            clip_high=0.28,
            dual_clip=0.0,
            off_policy="tis",
            is_level="token",
            is_cap=2.0,
            agg="token-mean",
            norm_length=1,
            entropy_coef=0.0,
            kl_coef=0.0,
            kl_estimator="k3",
            token_denom=None,
            seq_denom=None,
        )
        | kw
    )
    weights, keeps = off_policy_reference(
        str(o["off_policy"]), inp.prox_logp, inp.behav_logp, inp.mask, level=str(o["is_level"]), cap=float(o["is_cap"])
    )  # type: ignore[arg-type]
    adv = inp.token_advantages()
    seq_values, all_terms, n_seqs = [], [], 0
    for b in range(inp.mask.shape[0]):
        toks = [t for t in range(inp.mask.shape[1]) if bool(inp.mask[b, t])]
        if not toks:
            continue
        n_seqs += 1
        mean_log = sum(float(inp.logp[b, t]) - float(inp.prox_logp[b, t]) for t in toks) / len(toks)
        terms = []
        for t in toks:
            a = float(adv[b, t])
            log_r = float(inp.logp[b, t]) - float(inp.prox_logp[b, t])
            r = math.exp(
                min(mean_log, GSPO_LOG_RATIO_MAX)
                if o["loss"] == "gspo"
                else min(max(log_r, -PPO_LOG_RATIO_CLAMP), PPO_LOG_RATIO_CLAMP)
            )
            l_t = max(-a * r, -a * min(max(r, 1 - o["clip_low"]), 1 + o["clip_high"]))  # type: ignore[operator]
            if o["dual_clip"] and a < 0:
                l_t = min(l_t, -a * o["dual_clip"])  # type: ignore[operator]
            l_t *= weights[b][t]
            if o["entropy_coef"]:
                l_t -= o["entropy_coef"] * float(inp.entropy[b, t])  # type: ignore[index,operator]
            if o["kl_coef"]:
                x = float(inp.ref_logp[b, t]) - float(inp.logp[b, t])  # type: ignore[index]
                k = _kl_value_reference(str(o["kl_estimator"]), x)
                l_t += o["kl_coef"] * k  # type: ignore[operator]
            terms.append(l_t if keeps[b][t] else 0.0)
        all_terms += terms
        seq_values.append(
            {
                "seq-mean-token-sum": sum(terms),
                "seq-mean-token-mean": sum(terms) / len(terms),
                "seq-mean-token-sum-norm": sum(terms) / o["norm_length"],  # type: ignore[operator]
                "token-mean": 0.0,
                "token-sum": 0.0,
            }[str(o["agg"])]
        )
    if o["agg"] == "token-mean":
        return sum(all_terms) / float(o["token_denom"] or max(len(all_terms), 1))  # type: ignore[arg-type]
    if o["agg"] == "token-sum":
        return sum(all_terms) / float(1.0 if o["token_denom"] is None else o["token_denom"])  # type: ignore[arg-type]
    return sum(seq_values) / float(o["seq_denom"] or max(n_seqs, 1))  # type: ignore[arg-type]


def _kl_value_reference(name: str, log_r: float) -> float:
    """One token's KL estimate (its value: a `+` variant's is its base's) with python floats."""
    base = {"kl": "k1", "mse": "k2", "low_var_kl": "k3"}.get(name.removesuffix("+"), name.removesuffix("+"))
    if base == "k3":
        x = min(max(log_r, -20.0), 20.0)
        return min(max(math.exp(x) - 1 - x, -10.0), 10.0)
    return {"k1": -log_r, "abs": abs(log_r), "k2": 0.5 * log_r * log_r}[base]


# --------------------------------------------------------------------------------------- learner.critic
def clipped_value_loss_reference(
    values: list[float],
    old: list[float],
    returns: list[float],
    value_clip: float,
    tokens: list[int] | None = None,
    agg: str = "token-mean",
) -> float:
    """Slow, obvious clipped value loss: every entry counts, step i as tokens[i] tokens (None: one each)."""
    tokens = [1] * len(values) if tokens is None else tokens
    total = count = 0.0
    for v, o, r, n in zip(values, old, returns, tokens):
        vc = min(max(v, o - value_clip), o + value_clip)
        loss = 0.5 * max((v - r) ** 2, (vc - r) ** 2)
        weight, part = {"token-mean": (n, n), "seq-mean-token-sum": (n, n > 0), "seq-mean-token-mean": (n > 0, n > 0)}[
            agg
        ]
        total += weight * loss
        count += part
    return total / max(count, 1)
