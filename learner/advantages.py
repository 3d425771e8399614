"""Advantage estimators: pure functions on per-transition tensors, one registry, one signature.

    adv, stats = compute_advantages("gigpo", AdvantageInput(...), gamma=0.95, step_weight=1.0, norm_by_std=True)

Every estimator takes the same `AdvantageInput` and keyword options and returns `(advantages [N], stats)`;
the caller passes all options, each estimator takes the ones it declares. Where an estimator defines
returns (the critic's target), `returns_of(name, inp, adv)` gives them. Every fast estimator has a slow,
obvious `*_reference` beside it (python loops); tests check that they agree on random inputs.

Shapes: N = transitions (env steps) of a batch, J = trajectories, K = groups (or step groups),
L = the longest trajectory (steps).
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass
from typing import Callable, Protocol

import torch
from torch import Tensor


@dataclass(frozen=True)
class AdvantageInput:
    """One row per transition (env step). The steps of a trajectory share `traj_index`; the G
    trajectories of a group share `group_index`. Indices need not be contiguous or sorted."""

    rewards: Tensor  # [N] float, the step's reward
    traj_index: Tensor  # [N] int, trajectory of the step
    group_index: Tensor  # [N] int, group of the step's trajectory
    step_index: Tensor  # [N] int, position of the step in its trajectory (0 = first)
    dones: Tensor  # [N] bool, last step of its trajectory (done or truncated)
    anchors: list[str] | None = None  # [N] the env's anchor observation of the step (GiGPO); "" = none
    values: Tensor | None = None  # [N] float, the critic's value of the step's state (GAE)

    def __post_init__(self) -> None:
        n = self.rewards.shape
        for name in ("traj_index", "group_index", "step_index", "dones", "values"):
            t = getattr(self, name)
            if t is not None and (len(n) != 1 or t.shape != n):
                raise ValueError(
                    f"AdvantageInput.{name} has shape {tuple(t.shape)}; every field must be [N] = {tuple(n)}"
                )
        if self.anchors is not None and len(self.anchors) != n[0]:
            raise ValueError(f"AdvantageInput.anchors has {len(self.anchors)} entries; expected N = {n[0]}")


class AdvantageFn(Protocol):
    """Every estimator: `(inp, **options) -> (advantages [N], stats)`; options are keyword-only."""

    def __call__(self, inp: AdvantageInput, **options: float | bool) -> tuple[Tensor, dict[str, float]]: ...


ADVANTAGES: dict[str, AdvantageFn] = {}
# estimators whose input needs `values` (a critic), and those that need `anchors`
NEEDS_VALUES: set[str] = set()
NEEDS_ANCHORS: set[str] = set()


def register_advantage(
    name: str, *, needs_values: bool = False, needs_anchors: bool = False
) -> Callable[[AdvantageFn], AdvantageFn]:
    """Decorator: register an estimator under `name`. Its options are keyword-only arguments."""

    def wrap(fn: AdvantageFn) -> AdvantageFn:
        if name in ADVANTAGES:
            raise ValueError(f"advantage estimator {name!r} is registered twice")
        ADVANTAGES[name] = fn
        if needs_values:
            NEEDS_VALUES.add(name)
        if needs_anchors:
            NEEDS_ANCHORS.add(name)
        return fn

    return wrap


def get_advantage(name: str) -> AdvantageFn:
    """The estimator registered under `name`; an unknown name lists the known ones."""
    try:
        return ADVANTAGES[name]
    except KeyError:
        raise KeyError(f"unknown advantage estimator {name!r}; known: {', '.join(sorted(ADVANTAGES))}") from None


def _options_of(fn: Callable[..., object]) -> set[str]:
    params = inspect.signature(fn).parameters.values()
    return {p.name for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY}


def compute_advantages(name: str, inp: AdvantageInput, **options: float | bool) -> tuple[Tensor, dict[str, float]]:
    """Run estimator `name`. The caller passes the same options whatever the estimator: each estimator
    takes the ones it declares; an option that no registered estimator declares is a typo and raises."""
    fn = get_advantage(name)
    known = set().union(*(_options_of(f) for f in ADVANTAGES.values()))
    unknown = set(options) - known
    if unknown:
        raise TypeError(f"unknown advantage option(s) {sorted(unknown)}; known: {sorted(known)}")
    if name in NEEDS_VALUES and inp.values is None:
        raise ValueError(f"advantage estimator {name!r} needs per-step values (a critic); AdvantageInput.values is None")
    if name in NEEDS_ANCHORS and inp.anchors is None:
        raise ValueError(f"advantage estimator {name!r} needs per-step anchor observations; AdvantageInput.anchors is None")
    mine = _options_of(fn)
    return fn(inp, **{k: v for k, v in options.items() if k in mine})


def returns_of(name: str, inp: AdvantageInput, advantages: Tensor, *, gamma: float = 1.0) -> Tensor:
    """Per-step returns [N] where the estimator defines them: GAE's lambda-return A + V (the critic's
    target); otherwise the discounted return G_t of the step."""
    if name in NEEDS_VALUES:
        assert inp.values is not None
        return advantages + inp.values.to(advantages.dtype)
    return discounted_returns(inp, gamma).to(advantages.dtype)


# --------------------------------------------------------------------------------------- whitening
def whitening_sums(adv: Tensor, weights: Tensor) -> tuple[float, float, float]:
    """(sum w, sum w A, sum w A^2) of advantages [N] weighted by `weights` [N] (each step's response tokens):
    what `whiten` needs, summed over every learner rank first (a global batch is spread over the ranks)."""
    w, a = weights.double(), adv.double()
    return float(w.sum()), float((w * a).sum()), float((w * a * a).sum())


def whiten(adv: Tensor, n: float, total: float, total_sq: float, eps: float = 1e-8) -> Tensor:
    """Whitened advantages [N] (verl's `masked_whiten` over response tokens, as its PPO applies to GAE):

        mu = sum w A / sum w        var = (sum w A^2 / sum w - mu^2) * n / (n - 1)     (unbiased)
        A' = (A - mu) / sqrt(var + eps)

    n, total, total_sq: `whitening_sums` over the whole batch. Fewer than two tokens: returned unchanged."""
    if n < 2:
        return adv
    mu = total / n
    var = max(total_sq / n - mu * mu, 0.0) * n / (n - 1)
    return ((adv.double() - mu) / math.sqrt(var + eps)).to(adv.dtype)


def whiten_reference(adv: list[float], tokens: list[int], eps: float = 1e-8) -> list[float]:
    """Slow, obvious whitening: every token is one sample of its step's advantage."""
    samples = [a for a, k in zip(adv, tokens) for _ in range(k)]
    if len(samples) < 2:
        return list(adv)
    mu = sum(samples) / len(samples)
    var = sum((x - mu) ** 2 for x in samples) / (len(samples) - 1)
    return [(a - mu) / math.sqrt(var + eps) for a in adv]


# --------------------------------------------------------------------------------------- shared pieces
def _compact(index: Tensor) -> tuple[Tensor, int]:
    """Arbitrary int ids [N] -> (dense ids 0..M-1 [N], M)."""
    uniq, inverse = torch.unique(index, return_inverse=True)
    return inverse, int(uniq.numel())


def _traj_groups(inp: AdvantageInput) -> tuple[Tensor, int, Tensor, int]:
    """(trajectory of each step [N], J, group of each trajectory [J], K), all dense ids."""
    traj, n_traj = _compact(inp.traj_index)  # [N]
    group_of_step, _ = _compact(inp.group_index)  # [N]
    empty = torch.zeros(n_traj, dtype=torch.long)
    traj_group = empty.scatter_reduce(0, traj, group_of_step, "amin", include_self=False)  # [J]
    if not torch.equal(traj_group, empty.scatter_reduce(0, traj, group_of_step, "amax", include_self=False)):
        raise ValueError("a trajectory's steps carry different group_index values; each trajectory is in one group")
    group, n_groups = _compact(traj_group)  # [J]
    return traj, n_traj, group, n_groups


def normalise_in_groups(x: Tensor, group: Tensor, n_groups: int, *, norm_by_std: bool, eps: float) -> tuple[Tensor, Tensor]:
    """(x - mean_g(x)) [/ (std_g(x) + eps)] for x [M] float64 in dense groups [M] -> (normalised [M], std [K]).

    std is unbiased (as torch.std). A group whose values are all equal (a group of one included) gives
    no comparison: exactly 0, not rounding noise of the mean divided by a tiny std.
    """
    count = torch.bincount(group, minlength=n_groups).to(torch.float64)  # [K]
    mean = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, group, x) / count.clamp(min=1)  # [K]
    lo = torch.zeros(n_groups, dtype=torch.float64).scatter_reduce_(0, group, x, "amin", include_self=False)
    hi = torch.zeros(n_groups, dtype=torch.float64).scatter_reduce_(0, group, x, "amax", include_self=False)
    centred = torch.where((lo == hi)[group], 0.0, x - mean[group])  # [M]
    var = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, group, centred**2) / (count - 1).clamp(min=1)
    std = var.sqrt()  # [K]
    out = centred / (std[group] + eps) if norm_by_std else centred  # [M]
    return torch.where(centred == 0, 0.0, out), std  # 0 / (0 + eps=0) would be nan


def _steps_matrix(inp: AdvantageInput, x: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Lay per-step x [N] out as [J, L] by (trajectory, rank of step_index within it).
    Returns (matrix [J, L] float64, valid [J, L] bool, row [N], col [N])."""
    traj, n_traj = _compact(inp.traj_index)  # [N]
    step = inp.step_index.to(torch.long)
    span = int(step.max()) - int(step.min()) + 1 if step.numel() else 1
    order = torch.argsort(traj * span + (step - (int(step.min()) if step.numel() else 0)), stable=True)  # [N]
    counts = torch.bincount(traj, minlength=n_traj)  # [J]
    starts = torch.cumsum(counts, 0) - counts  # [J]
    col = torch.empty_like(traj)
    col[order] = torch.arange(traj.numel()) - starts[traj[order]]  # [N]
    width = int(counts.max()) if traj.numel() else 0
    mat = torch.zeros(n_traj, width, dtype=torch.float64)  # [J, L]
    valid = torch.zeros(n_traj, width, dtype=torch.bool)  # [J, L]
    mat[traj, col] = x.to(torch.float64)
    valid[traj, col] = True
    return mat, valid, traj, col


def discounted_returns(inp: AdvantageInput, gamma: float) -> Tensor:
    """G_t = sum_{k >= t} gamma^(k - t) r_k along each trajectory (steps ordered by step_index). [N] float64."""
    r, valid, row, col = _steps_matrix(inp, inp.rewards)  # [J, L]
    g = torch.zeros_like(r)  # [J, L]
    running = torch.zeros(r.shape[0], dtype=torch.float64)  # [J]
    for t in range(r.shape[1] - 1, -1, -1):  # vectorised over trajectories, a loop over <= L steps
        running = torch.where(valid[:, t], r[:, t] + gamma * running, running)
        g[:, t] = running
    return g[row, col]  # [N]


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


def _norm_reference(xs: list[float], norm_by_std: bool, eps: float) -> list[float]:
    """Reference group normalisation: equal values (one value included) -> 0."""
    if min(xs) == max(xs):
        return [0.0] * len(xs)
    mean = sum(xs) / len(xs)
    std = math.sqrt(sum((x - mean) ** 2 for x in xs) / (len(xs) - 1))
    return [(x - mean) / (std + eps) if norm_by_std else x - mean for x in xs]


def _stats(adv: Tensor, **extra: float) -> dict[str, float]:
    return {"advantage_abs_mean": float(adv.abs().double().mean()) if adv.numel() else 0.0, **extra}


# --------------------------------------------------------------------------------------- GRPO
@register_advantage("grpo")
def grpo(inp: AdvantageInput, *, norm_by_std: bool = True, eps: float = 1e-6) -> tuple[Tensor, dict[str, float]]:
    """GRPO outcome advantage (Shao et al. 2024, DeepSeekMath, eq. 3), multi-turn as in verl-agent.

    R_j = sum of trajectory j's step rewards; within its group g (G trajectories):
        A_j = (R_j - mean_g(R)) / (std_g(R) + eps)     norm_by_std=True  (std: unbiased, as torch.std)
        A_j =  R_j - mean_g(R)                         norm_by_std=False (Dr. GRPO, Liu et al. 2025, sec. 3.1)
    Every step of trajectory j gets A_j. A group whose returns are all equal (a group of one included)
    gives no comparison: A = 0 exactly.
    """
    traj, n_traj, group, n_groups = _traj_groups(inp)
    returns = torch.zeros(n_traj, dtype=torch.float64).index_add_(0, traj, inp.rewards.to(torch.float64))  # [J]
    adv_traj, std = normalise_in_groups(returns, group, n_groups, norm_by_std=norm_by_std, eps=eps)  # [J], [K]
    adv = adv_traj[traj].to(inp.rewards.dtype)  # [N]
    return adv, _stats(
        adv,
        return_mean=float(returns.mean()) if n_traj else 0.0,
        return_std_in_group=float(std.mean()) if n_groups else 0.0,
        zero_std_group_frac=float((std == 0).double().mean()) if n_groups else 0.0,
    )


def grpo_reference(inp: AdvantageInput, *, norm_by_std: bool = True, eps: float = 1e-6) -> Tensor:
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
        adv_of.update(zip(trajs, _norm_reference([returns[t] for t in trajs], norm_by_std, eps)))
    return torch.tensor([adv_of[int(t)] for t in inp.traj_index], dtype=inp.rewards.dtype)


# --------------------------------------------------------------------------------------- GiGPO
def _step_groups(inp: AdvantageInput, group_of_step: Tensor) -> tuple[Tensor, int]:
    """Dense step-group id [N]: steps of the same episode group with the identical anchor observation.
    An empty anchor means "no anchor": the step is a step group of its own."""
    assert inp.anchors is not None
    keys: dict[tuple[int, str], int] = {}
    ids = []
    for i, (g, a) in enumerate(zip(group_of_step.tolist(), inp.anchors)):
        key = (g, a) if a else (-1, str(i))
        ids.append(keys.setdefault(key, len(keys)))
    return torch.tensor(ids, dtype=torch.long), len(keys)


@register_advantage("gigpo", needs_anchors=True)
def gigpo(
    inp: AdvantageInput, *, gamma: float = 0.95, step_weight: float = 1.0, norm_by_std: bool = True, eps: float = 1e-6,
) -> tuple[Tensor, dict[str, float]]:
    """GiGPO (Feng et al. 2025, "Group-in-Group Policy Optimization for LLM Agent Training",
    arXiv 2505.10978, sec. 4; verl-agent `core_gigpo.py`):

        episode level:  R_j = sum_t r_{j,t};   A^E_j = norm_{group of j}(R_j)
        step level:     G_{j,t} = sum_{k>=t} gamma^(k-t) r_{j,k};
                        step group = steps of the same episode group whose anchor observation is identical;
                        A^S_{j,t} = norm_{step group}(G_{j,t})   (a step group of one gets 0)
        A_{j,t} = A^E_j + step_weight * A^S_{j,t}

    norm(x) = (x - mean) / (std + eps) with norm_by_std (`mean_std_norm`), x - mean without (`mean_norm`);
    std unbiased; equal values give exactly 0. Anchors [N] come from `inp.anchors` ("" = no anchor).
    """
    traj, n_traj, group, n_groups = _traj_groups(inp)
    returns = torch.zeros(n_traj, dtype=torch.float64).index_add_(0, traj, inp.rewards.to(torch.float64))  # [J]
    a_ep, ep_std = normalise_in_groups(returns, group, n_groups, norm_by_std=norm_by_std, eps=eps)  # [J]
    sgroup, n_sg = _step_groups(inp, group[traj])  # [N]
    g = discounted_returns(inp, gamma)  # [N]
    a_step, _ = normalise_in_groups(g, sgroup, n_sg, norm_by_std=norm_by_std, eps=eps)  # [N]
    adv = (a_ep[traj] + step_weight * a_step).to(inp.rewards.dtype)  # [N]
    sizes = torch.bincount(sgroup, minlength=n_sg)  # [K_step]
    return adv, _stats(
        adv,
        return_mean=float(returns.mean()) if n_traj else 0.0,
        zero_std_group_frac=float((ep_std == 0).double().mean()) if n_groups else 0.0,
        step_groups=float(n_sg),
        step_group_size_mean=float(sizes.double().mean()) if n_sg else 0.0,
        step_in_shared_group_frac=float((sizes[sgroup] > 1).double().mean()) if sgroup.numel() else 0.0,
        step_advantage_abs_mean=float(a_step.abs().mean()) if a_step.numel() else 0.0,
    )


def gigpo_reference(
    inp: AdvantageInput, *, gamma: float = 0.95, step_weight: float = 1.0, norm_by_std: bool = True, eps: float = 1e-6,
) -> Tensor:
    """Slow, obvious GiGPO: dictionaries and loops. Returns advantages [N]."""
    assert inp.anchors is not None
    n = inp.rewards.numel()
    a_ep = grpo_reference(inp, norm_by_std=norm_by_std, eps=eps).tolist()
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


# --------------------------------------------------------------------------------------- RLOO
@register_advantage("rloo")
def rloo(inp: AdvantageInput) -> tuple[Tensor, dict[str, float]]:
    """REINFORCE leave-one-out (Kool et al. 2019; Ahmadian et al. 2024, "Back to Basics", eq. 5):

        A_j = R_j - 1/(G-1) sum_{i != j} R_i = G/(G-1) (R_j - mean_g(R))

    R_j = trajectory j's summed reward, G its group's size; every step of j gets A_j; a group of one gets 0.
    """
    traj, n_traj, group, n_groups = _traj_groups(inp)
    returns = torch.zeros(n_traj, dtype=torch.float64).index_add_(0, traj, inp.rewards.to(torch.float64))  # [J]
    count = torch.bincount(group, minlength=n_groups).to(torch.float64)  # [K]
    total = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, group, returns)  # [K]
    others = (total[group] - returns) / (count[group] - 1).clamp(min=1)  # [J]
    adv_traj = torch.where(count[group] > 1, returns - others, 0.0)  # [J]
    adv = adv_traj[traj].to(inp.rewards.dtype)  # [N]
    return adv, _stats(adv, return_mean=float(returns.mean()) if n_traj else 0.0)


def rloo_reference(inp: AdvantageInput) -> Tensor:
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
        adv_of[t] = returns[t] - sum(others) / len(others) if others else 0.0
    return torch.tensor([adv_of[int(t)] for t in inp.traj_index], dtype=inp.rewards.dtype)


# --------------------------------------------------------------------------------------- REINFORCE++
def _batch_norm(x: Tensor, eps: float) -> Tensor:
    """(x - mean) / (std + eps) over the whole batch [N] (std unbiased); fewer than 2 values or equal
    values -> 0."""
    if x.numel() < 2 or bool((x == x[0]).all()):
        return torch.zeros_like(x)
    return (x - x.mean()) / (x.std() + eps)


@register_advantage("reinforce_pp")
def reinforce_pp(inp: AdvantageInput, *, gamma: float = 1.0, eps: float = 1e-6) -> tuple[Tensor, dict[str, float]]:
    """REINFORCE++ (Hu et al. 2025, arXiv 2501.03262, sec. 3): per-step discounted return, normalised
    over the batch (here: this rank's share):

        G_t = sum_{k >= t} gamma^(k - t) r_k;   A_t = (G_t - mean_batch(G)) / (std_batch(G) + eps)
    """
    g = discounted_returns(inp, gamma)  # [N]
    adv = _batch_norm(g, eps).to(inp.rewards.dtype)  # [N]
    return adv, _stats(adv, return_mean=float(g.mean()) if g.numel() else 0.0)


@register_advantage("reinforce_pp_baseline")
def reinforce_pp_baseline(
    inp: AdvantageInput, *, gamma: float = 1.0, eps: float = 1e-6,
) -> tuple[Tensor, dict[str, float]]:
    """REINFORCE++ with a group baseline (Hu et al. 2025, "REINFORCE++-baseline"; OpenRLHF):

        A'_{j,t} = G_{j,t} - mean_{i in group of j}(R_i)      R_i = sum of trajectory i's rewards
        A_{j,t}  = (A'_{j,t} - mean_batch(A')) / (std_batch(A') + eps)
    """
    traj, n_traj, group, n_groups = _traj_groups(inp)
    returns = torch.zeros(n_traj, dtype=torch.float64).index_add_(0, traj, inp.rewards.to(torch.float64))  # [J]
    count = torch.bincount(group, minlength=n_groups).to(torch.float64)  # [K]
    mean = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, group, returns) / count  # [K]
    centred = discounted_returns(inp, gamma) - mean[group][traj]  # [N]
    adv = _batch_norm(centred, eps).to(inp.rewards.dtype)  # [N]
    return adv, _stats(adv, return_mean=float(returns.mean()) if n_traj else 0.0)


def _batch_norm_reference(xs: list[float], eps: float) -> list[float]:
    if len(xs) < 2 or min(xs) == max(xs):
        return [0.0] * len(xs)
    mean = sum(xs) / len(xs)
    std = math.sqrt(sum((x - mean) ** 2 for x in xs) / (len(xs) - 1))
    return [(x - mean) / (std + eps) for x in xs]


def reinforce_pp_reference(inp: AdvantageInput, *, gamma: float = 1.0, eps: float = 1e-6, baseline: bool = False) -> Tensor:
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
            g[i] -= sum(rs) / len(rs)
    return torch.tensor(_batch_norm_reference(g, eps), dtype=inp.rewards.dtype)


# --------------------------------------------------------------------------------------- GAE
@register_advantage("gae", needs_values=True)
def gae(inp: AdvantageInput, *, gamma: float = 1.0, lam: float = 0.95) -> tuple[Tensor, dict[str, float]]:
    """Generalised advantage estimation (Schulman et al. 2016, arXiv 1506.02438, eq. 16), per env step:

        delta_t = r_t + gamma V_{t+1} - V_t          V_{t+1} = 0 after a trajectory's last step
        A_t = delta_t + gamma lam A_{t+1}            returns_t = A_t + V_t (the critic's target)

    Steps ordered by step_index within each trajectory; values [N] from `inp.values`. A truncated
    trajectory is not bootstrapped (its last step is treated as terminal).
    """
    assert inp.values is not None
    r, valid, row, col = _steps_matrix(inp, inp.rewards)  # [J, L]
    v, _, _, _ = _steps_matrix(inp, inp.values)  # [J, L]
    adv = torch.zeros_like(r)  # [J, L]
    next_v = torch.zeros(r.shape[0], dtype=torch.float64)  # [J]
    running = torch.zeros(r.shape[0], dtype=torch.float64)  # [J]
    for t in range(r.shape[1] - 1, -1, -1):  # vectorised over trajectories, a loop over <= L steps
        delta = r[:, t] + gamma * next_v - v[:, t]
        running = torch.where(valid[:, t], delta + gamma * lam * running, running)
        next_v = torch.where(valid[:, t], v[:, t], next_v)
        adv[:, t] = running
    out = adv[row, col].to(inp.rewards.dtype)  # [N]
    return out, _stats(out, value_mean=float(inp.values.double().mean()) if out.numel() else 0.0)


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
