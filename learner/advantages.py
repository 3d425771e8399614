"""Advantage estimators: pure functions on per-transition tensors, one registry, one signature.

    adv, stats = compute_advantages("gigpo", AdvantageInput(...), gamma=0.95, step_weight=1.0, norm_by_std=True)

Every estimator takes the same `AdvantageInput` and keyword options and returns `(advantages [N], stats)`;
the caller passes all options, each estimator takes the ones it declares. Where an estimator defines
returns (the critic's target), `returns_of(name, inp, adv)` gives them. Every fast estimator has a slow,
obvious `*_reference` (python loops) in tests/learner/learner_oracles.py; tests check that they agree on random
inputs, and tests/learner/test_learner_advantages.py holds each against verl's `core_algos.py` formula
(docs/algorithms.md, "The same numbers as verl").

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

from agentstream.registry import Registry
from learner.preference import dpo_advantages, preference_pairs


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
    tokens: Tensor | None = None  # [N] int, response tokens of the step (token-weighted whitening); None = 1 each
    logp: Tensor | None = None  # [N] float, log pi of the step's response (its tokens' sum; online DPO)
    ref_logp: Tensor | None = None  # [N] float, log pi_ref of the step's response (online DPO)

    def __post_init__(self) -> None:
        n = self.rewards.shape
        for name in ("traj_index", "group_index", "step_index", "dones", "values", "tokens", "logp", "ref_logp"):
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


@dataclass(frozen=True)
class AdvantageTraits:
    """What an estimator needs and does, declared where it registers: callers ask these, never its name."""

    needs_values: bool = False  # its input needs `values` (a critic)
    needs_anchors: bool = False  # its input needs `anchors` (GiGPO's step groups)
    whitens: bool = False
    """It whitens its output over the batch's tokens (option `whiten`): a learner spread over ranks passes
    whiten=False and whitens over the global batch itself (`whitening_sums` summed over ranks, `whiten`)."""
    needs_logprobs: bool = False  # its input needs the policy's and a reference's log-probs of each step (online DPO)
    to_go: bool = False
    """Its advantage is a return (reward to go): with rewards on response tokens, a token's advantage leaves out
    the token rewards placed before it in its response (`learner.token_rewards.rewards_to_go`)."""


ADVANTAGES: Registry[AdvantageFn] = Registry("advantage estimator")
"""Every estimator, registered with its `AdvantageTraits`: `@ADVANTAGES.register(name, AdvantageTraits(...))`."""
GROUP_OF_ONE = ("zero", "score")
"""Option `group_of_one`: what a group of one trajectory (nothing to compare with) gets. zero: advantage 0;
score: verl's (its group mean is 0 and std 1, so it keeps its score: GRPO s/(1+eps) or s, RLOO s)."""


def advantage_traits(name: str) -> AdvantageTraits:
    """The traits estimator `name` registered with; an unknown name lists the known ones."""
    traits = ADVANTAGES.traits(name)
    assert isinstance(traits, AdvantageTraits), f"advantage estimator {name!r} registered without AdvantageTraits"
    return traits


def _options_of(fn: Callable[..., object]) -> set[str]:
    params = inspect.signature(fn).parameters.values()
    return {p.name for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY}


def compute_advantages(name: str, inp: AdvantageInput, **options: float | bool) -> tuple[Tensor, dict[str, float]]:
    """Run estimator `name`. The caller passes the same options whatever the estimator: each estimator
    takes the ones it declares; an option that no registered estimator declares is a typo and raises."""
    fn, traits = ADVANTAGES.get(name), advantage_traits(name)
    known = set().union(*(_options_of(f) for f in ADVANTAGES.values()))
    unknown = set(options) - known
    if unknown:
        raise TypeError(f"unknown advantage option(s) {sorted(unknown)}; known: {sorted(known)}")
    if traits.needs_values and inp.values is None:
        raise ValueError(
            f"advantage estimator {name!r} needs per-step values (a critic); AdvantageInput.values is None"
        )
    if traits.needs_anchors and inp.anchors is None:
        raise ValueError(
            f"advantage estimator {name!r} needs per-step anchor observations; AdvantageInput.anchors is None"
        )
    if traits.needs_logprobs and (inp.logp is None or inp.ref_logp is None):
        raise ValueError(
            f"advantage estimator {name!r} needs each step's log-probs under the policy and a reference; "
            f"AdvantageInput.logp or ref_logp is None"
        )
    mine = _options_of(fn)
    return fn(inp, **{k: v for k, v in options.items() if k in mine})


def returns_of(name: str, inp: AdvantageInput, advantages: Tensor, *, gamma: float = 1.0) -> Tensor:
    """Per-step returns [N] where the estimator defines them: GAE's lambda-return A + V (the critic's
    target); otherwise the discounted return G_t of the step."""
    if advantage_traits(name).needs_values:
        assert inp.values is not None
        return advantages + inp.values.to(advantages.dtype)
    return discounted_returns(inp, gamma).to(advantages.dtype)


# --------------------------------------------------------------------------------------- whitening
def whitening_sums(adv: Tensor, weights: Tensor, centre: float = 0.0) -> tuple[float, float, float]:
    """(sum w, sum w (A - c), sum w (A - c)^2) of advantages [N] weighted by `weights` [N] (each step's response
    tokens), c = `centre`: what `whiten` needs, summed over every learner rank first (a global batch is spread
    over the ranks). Sums around the batch's mean (a first pass's sum w A / sum w) keep the variance exact when
    the mean is large; around 0 it cancels (|mean| 1e6, spread 1: the variance would be off by ~1e-4)."""
    w, a = weights.double(), adv.double() - centre
    return float(w.sum()), float((w * a).sum()), float((w * a * a).sum())


_MEAN_EPS = 1e-8  # verl's masked_mean divides by (count + 1e-8)


def whiten(adv: Tensor, n: float, total: float, total_sq: float, eps: float = 1e-8, centre: float = 0.0) -> Tensor:
    """Whitened advantages [N] (verl's `masked_whiten` over response tokens, as its PPO applies to GAE and
    REINFORCE++ to its returns; verl/utils/torch_functional.py), n = sum w:

        mu = sum w A / (n + 1e-8)        var = sum w (A - mu)^2 / (n + 1e-8) * n / (n - 1)      (unbiased)
        A' = (A - mu) / sqrt(var + eps)                                                     eps = 1e-8 as verl

    (the 1e-8 beside n is verl's masked_mean's: it moves mu by mu 1e-8 / n, which shows with a large mean).
    n, total, total_sq: `whitening_sums` over the whole batch, taken around `centre` (the same c): with
    d = mu - c, sum w (A - mu)^2 = sum w (A-c)^2 - 2 d sum w (A-c) + n d^2. Fewer than two tokens: returned
    unchanged (verl raises)."""
    if n < 2:
        return adv
    d = (total - _MEAN_EPS * centre) / (n + _MEAN_EPS)  # mu - c
    var = max(total_sq - 2 * d * total + n * d * d, 0.0) / (n + _MEAN_EPS) * n / (n - 1)
    return ((adv.double() - centre - d) / math.sqrt(var + eps)).to(adv.dtype)


Sums = tuple[float, float, float]


def whiten_batch(
    adv: Tensor, tokens: Tensor | None = None, total: Callable[[Sums], Sums] = lambda sums: sums
) -> Tensor:
    """`whiten` over the batch [N]: every step counts once per response token (`tokens` [N]; None = one each).
    Two passes: the mean, then the sums around it. `total`: each pass's `whitening_sums` over the whole batch
    (a learner spread over ranks sums them over every rank: `learner.step.whiten_global`); default: this input's."""
    w = torch.ones_like(adv, dtype=torch.float64) if tokens is None else tokens
    n, first, _ = total(whitening_sums(adv, w))
    centre = first / n if n > 0 else 0.0
    return whiten(adv, *total(whitening_sums(adv, w, centre)), centre=centre)


# --------------------------------------------------------------------------------------- shared pieces
def _compact(index: Tensor) -> tuple[Tensor, int]:
    """Arbitrary int ids [N] -> (dense ids 0..M-1 [N], M)."""
    uniq, inverse = torch.unique(index, return_inverse=True)
    return inverse, int(uniq.numel())


def trajectory_groups(inp: AdvantageInput) -> tuple[Tensor, int, Tensor, int]:
    """(trajectory of each step [N], J, group of each trajectory [J], K), all dense ids."""
    traj, n_traj = _compact(inp.traj_index)  # [N]
    group_of_step, _ = _compact(inp.group_index)  # [N]
    empty = torch.zeros(n_traj, dtype=torch.long)
    traj_group = empty.scatter_reduce(0, traj, group_of_step, "amin", include_self=False)  # [J]
    if not torch.equal(traj_group, empty.scatter_reduce(0, traj, group_of_step, "amax", include_self=False)):
        raise ValueError("a trajectory's steps carry different group_index values; each trajectory is in one group")
    group, n_groups = _compact(traj_group)  # [J]
    return traj, n_traj, group, n_groups


def check_group_of_one(value: str) -> None:
    if value not in GROUP_OF_ONE:
        raise ValueError(f"group_of_one={value!r} is unknown; use one of {', '.join(GROUP_OF_ONE)}")


def normalise_in_groups(
    x: Tensor, group: Tensor, n_groups: int, *, norm_by_std: bool, eps: float, group_of_one: str = "zero"
) -> tuple[Tensor, Tensor]:
    """(x - mean_g(x)) [/ (std_g(x) + eps)] for x [M] float64 in dense groups [M] -> (normalised [M], std [K]).

    std is unbiased (as torch.std). A group whose values are all equal gives no comparison: exactly 0, not
    rounding noise of the mean divided by a tiny std. A group of one gives 0 (group_of_one="zero"), or with
    "score" verl's mean 0 and std 1: x / (1 + eps), x without norm_by_std. The std returned is the group's own.
    """
    check_group_of_one(group_of_one)
    count = torch.bincount(group, minlength=n_groups).to(torch.float64)  # [K]
    mean = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, group, x) / count.clamp(min=1)  # [K]
    lo = torch.zeros(n_groups, dtype=torch.float64).scatter_reduce_(0, group, x, "amin", include_self=False)
    hi = torch.zeros(n_groups, dtype=torch.float64).scatter_reduce_(0, group, x, "amax", include_self=False)
    centred = torch.where((lo == hi)[group], 0.0, x - mean[group])  # [M]
    var = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, group, centred**2) / (count - 1).clamp(min=1)
    std = scale = var.sqrt()  # [K]
    if group_of_one == "score":
        alone = count == 1  # [K]
        centred = torch.where(alone[group], x, centred)
        scale = torch.where(alone, 1.0, std)
    out = centred / (scale[group] + eps) if norm_by_std else centred  # [M]
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


def _stats(adv: Tensor, **extra: float) -> dict[str, float]:
    return {"advantage_abs_mean": float(adv.abs().double().mean()) if adv.numel() else 0.0, **extra}


# --------------------------------------------------------------------------------------- GRPO
@ADVANTAGES.register("grpo", AdvantageTraits())
def grpo(
    inp: AdvantageInput, *, norm_by_std: bool = True, eps: float = 1e-6, group_of_one: str = "zero"
) -> tuple[Tensor, dict[str, float]]:
    """GRPO outcome advantage (Shao et al. 2024, DeepSeekMath, eq. 3), multi-turn as in verl-agent.

    R_j = sum of trajectory j's step rewards; within its group g (G trajectories):
        A_j = (R_j - mean_g(R)) / (std_g(R) + eps)     norm_by_std=True  (std: unbiased, as torch.std)
        A_j =  R_j - mean_g(R)                         norm_by_std=False (Dr. GRPO, Liu et al. 2025, sec. 3.1)
    Every step of trajectory j gets A_j. A group whose returns are all equal gives no comparison: A = 0
    exactly. A group of one: A = 0, or with group_of_one="score" verl's R_j / (1 + eps) (R_j without norm_by_std).
    """
    traj, n_traj, group, n_groups = trajectory_groups(inp)
    returns = torch.zeros(n_traj, dtype=torch.float64).index_add_(0, traj, inp.rewards.to(torch.float64))  # [J]
    adv_traj, std = normalise_in_groups(
        returns, group, n_groups, norm_by_std=norm_by_std, eps=eps, group_of_one=group_of_one
    )  # [J], [K]
    adv = adv_traj[traj].to(inp.rewards.dtype)  # [N]
    return adv, _stats(
        adv,
        return_mean=float(returns.mean()) if n_traj else 0.0,
        return_std_in_group=float(std.mean()) if n_groups else 0.0,
        zero_std_group_frac=float((std == 0).double().mean()) if n_groups else 0.0,
    )


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


@ADVANTAGES.register("gigpo", AdvantageTraits(needs_anchors=True))
def gigpo(
    inp: AdvantageInput,
    *,
    gamma: float = 0.95,
    step_weight: float = 1.0,
    norm_by_std: bool = True,
    eps: float = 1e-6,
    group_of_one: str = "zero",
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
    An episode group of one: as GRPO's `group_of_one` (verl-agent normalises it as verl's GRPO: "score");
    a step group of one always gets 0 (verl-agent: its mean is its own value).
    """
    traj, n_traj, group, n_groups = trajectory_groups(inp)
    returns = torch.zeros(n_traj, dtype=torch.float64).index_add_(0, traj, inp.rewards.to(torch.float64))  # [J]
    a_ep, ep_std = normalise_in_groups(
        returns, group, n_groups, norm_by_std=norm_by_std, eps=eps, group_of_one=group_of_one
    )  # [J]
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


# --------------------------------------------------------------------------------------- RLOO
@ADVANTAGES.register("rloo", AdvantageTraits())
def rloo(inp: AdvantageInput, *, group_of_one: str = "zero") -> tuple[Tensor, dict[str, float]]:
    """REINFORCE leave-one-out (Kool et al. 2019; Ahmadian et al. 2024, "Back to Basics", eq. 5):

        A_j = R_j - 1/(G-1) sum_{i != j} R_i = G/(G-1) (R_j - mean_g(R))

    R_j = trajectory j's summed reward, G its group's size; every step of j gets A_j. A group of one gets 0
    (as verl's `rloo_vectorized`), or R_j with group_of_one="score" (as verl's `rloo`).
    """
    check_group_of_one(group_of_one)
    traj, n_traj, group, n_groups = trajectory_groups(inp)
    returns = torch.zeros(n_traj, dtype=torch.float64).index_add_(0, traj, inp.rewards.to(torch.float64))  # [J]
    count = torch.bincount(group, minlength=n_groups).to(torch.float64)  # [K]
    total = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, group, returns)  # [K]
    others = (total[group] - returns) / (count[group] - 1).clamp(min=1)  # [J]
    adv_traj = torch.where(count[group] > 1, returns - others, returns if group_of_one == "score" else 0.0)  # [J]
    adv = adv_traj[traj].to(inp.rewards.dtype)  # [N]
    return adv, _stats(adv, return_mean=float(returns.mean()) if n_traj else 0.0)


# --------------------------------------------------------------------------------------- REINFORCE++
@ADVANTAGES.register("reinforce_pp", AdvantageTraits(whitens=True, to_go=True))
def reinforce_pp(inp: AdvantageInput, *, gamma: float = 1.0, whiten: bool = True) -> tuple[Tensor, dict[str, float]]:
    """REINFORCE++ (Hu et al. 2025, arXiv 2501.03262, sec. 3): per-step discounted return, whitened over the
    batch's response tokens as verl's `compute_reinforce_plus_plus_outcome_advantage` (`masked_whiten`):

        G_t = sum_{k >= t} gamma^(k - t) r_k           over a trajectory's env steps; a step's tokens share G_t
        A_t = (G_t - mu) / sqrt(var + 1e-8)            mu, var: mean and unbiased variance over tokens

    Every step counts once per response token (`inp.tokens`; None: once). whiten=False returns G_t: a learner
    spread over ranks whitens over the global batch itself (see `AdvantageTraits.whitens`), so that each rank's
    share alone does not set the mean.
    """
    g = discounted_returns(inp, gamma)  # [N]
    adv = (whiten_batch(g, inp.tokens) if whiten else g).to(inp.rewards.dtype)  # [N]
    return adv, _stats(adv, return_mean=float(g.mean()) if g.numel() else 0.0)


@ADVANTAGES.register("reinforce_pp_baseline", AdvantageTraits(whitens=True))
def reinforce_pp_baseline(
    inp: AdvantageInput, *, gamma: float = 1.0, group_of_one: str = "zero", whiten: bool = True
) -> tuple[Tensor, dict[str, float]]:
    """REINFORCE++ with a group baseline (Hu et al. 2025, "REINFORCE++-baseline"; OpenRLHF; verl's
    `compute_reinforce_plus_plus_baseline_outcome_advantage`):

        A'_{j,t} = G_{j,t} - mean_{i in group of j}(R_i)      R_i = sum of trajectory i's rewards
        A_{j,t}  = (A'_{j,t} - mu) / sqrt(var + 1e-8)         over the batch's response tokens, as `reinforce_pp`

    A group of one: its mean is its own return (group_of_one="zero": A' = G - R_j, 0 for a one-step trajectory
    at gamma = 1), or verl's 0 ("score": A' = G). whiten=False returns A' (see `reinforce_pp`).
    """
    check_group_of_one(group_of_one)
    traj, n_traj, group, n_groups = trajectory_groups(inp)
    returns = torch.zeros(n_traj, dtype=torch.float64).index_add_(0, traj, inp.rewards.to(torch.float64))  # [J]
    count = torch.bincount(group, minlength=n_groups).to(torch.float64)  # [K]
    mean = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, group, returns) / count  # [K]
    if group_of_one == "score":
        mean = torch.where(count == 1, 0.0, mean)
    centred = discounted_returns(inp, gamma) - mean[group][traj]  # [N]
    adv = (whiten_batch(centred, inp.tokens) if whiten else centred).to(inp.rewards.dtype)  # [N]
    return adv, _stats(adv, return_mean=float(returns.mean()) if n_traj else 0.0)


# --------------------------------------------------------------------------------------- GAE
@ADVANTAGES.register("gae", AdvantageTraits(needs_values=True, to_go=True))
def gae(inp: AdvantageInput, *, gamma: float = 1.0, lam: float = 0.95) -> tuple[Tensor, dict[str, float]]:
    """Generalised advantage estimation (Schulman et al. 2016, arXiv 1506.02438, eq. 16), per env step:

        delta_t = r_t + gamma V_{t+1} - V_t          V_{t+1} = 0 after a trajectory's last step
        A_t = delta_t + gamma lam A_{t+1}            returns_t = A_t + V_t (the critic's target)

    Steps ordered by step_index within each trajectory; values [N] from `inp.values`. A truncated
    trajectory is not bootstrapped (its last step is treated as terminal). verl's `compute_gae_advantage_return`
    runs the same recursion over a row's unmasked positions (here: a trajectory's steps; gaps in step_index are
    its masked holes) and then whitens A over the batch's tokens: here `algorithm.whiten_advantages` does that,
    over the global batch (the `ppo` preset sets it).
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


# --------------------------------------------------------------------------------------- online DPO
@ADVANTAGES.register("online_dpo", AdvantageTraits(needs_logprobs=True))
def online_dpo(inp: AdvantageInput, *, beta: float = 0.1, pair_count: float = 0.0) -> tuple[Tensor, dict[str, float]]:
    """Online DPO / SPIN (`learner.preference`): in each group the highest- and lowest-return trajectories are a
    (chosen, rejected) pair; each trajectory's log-probs are its steps' sums (`inp.logp`, `inp.ref_logp`); every
    step of pair p's chosen (rejected) trajectory gets +(-) beta sigmoid(-z_p) / P, the gradient of DPO's mean
    loss through the policy-gradient surrogate. `pair_count`: P of the global batch (0: this input's pairs)."""
    assert inp.logp is not None and inp.ref_logp is not None
    traj, n_traj, group, n_groups = trajectory_groups(inp)
    per_traj = lambda x: torch.zeros(n_traj, dtype=torch.float64).index_add_(0, traj, x.to(torch.float64))  # noqa: E731
    adv_traj, stats = dpo_advantages(
        per_traj(inp.rewards),
        per_traj(inp.logp),
        per_traj(inp.ref_logp),
        group,
        n_groups,
        beta=beta,
        pair_count=pair_count,
    )  # [J]
    adv = adv_traj[traj].to(inp.rewards.dtype)  # [N]
    return adv, _stats(adv, **stats)


def count_pairs(inp: AdvantageInput) -> int:
    """How many (chosen, rejected) pairs online DPO forms from `inp`: groups of two or more whose returns differ."""
    traj, n_traj, group, n_groups = trajectory_groups(inp)
    returns = torch.zeros(n_traj, dtype=torch.float64).index_add_(0, traj, inp.rewards.to(torch.float64))  # [J]
    return int(preference_pairs(returns, group, n_groups).chosen.numel())
