"""One optimizer step on one rank's share of a global batch. A collective: every rank calls it each step.

The step, in order: (optional) reference log-probs of the behaviour tokens for a KL penalty in the reward,
(optional) the critic's values; advantages (`learner.advantages`, by name, no branching on it; per token where
the batch has token rewards and the estimator gives returns, `learner.token_rewards`); the policy
forward/backward per micro-batch with `learner.losses.policy_objective` (off-policy correction from
`learner.offpolicy`); gradient clipping and the optimizer step; then the critic's own update. `train_step` reads as
these stages: `score_batch`, `batch_advantages`, `update_policy` (`epochs_of_updates`), `update_critic`.

Several updates per batch (`learner.ppo_epochs` passes, each split into `learner.mini_batches` mini-batches
of whole micro-batches; verl's ppo_epochs / ppo_mini_batch_size, AReaL's ppo_n_minibatches): one no-grad
pass first takes log pi_prox, the policy before this step's updates (PPO's pi_old), for the ratio and the
off-policy correction; then each mini-batch is one optimizer step, its loss normalised over its own tokens
on all ranks. With one update, pi_prox is the policy itself (ratio 1) and that pass is skipped.

Loss normalisation: the policy loss is a mean over the GLOBAL batch (all ranks): over tokens for
`token-mean`, over sequences for `seq-mean-*`. FSDP averages gradients over ranks (divides by W), so each
rank's micro-batch loss is sum(its terms) / (M / W), M = all ranks' tokens (or sequences; 1 for `token-sum`,
the global sum: `learner.losses.loss_denominators`); then the averaged gradient is exactly that of
sum(all terms) / M, whatever each rank's share. Every rank runs max-over-ranks micro-batches; a rank with fewer
pads with zero-weight ones, because each forward/backward (and each no-grad forward of a sharded reference or
critic) is a set of FSDP collectives.

Shapes: N = transitions of this rank's share, R = its response tokens, Q = response tokens of one
micro-batch, S = sequences in it, T = the longest response in it.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor, nn

from agentstream.config import AlgorithmConfig, LearnerConfig, ModelConfig
from agentstream.models import is_vision_language
from agentstream.wire.messages import Batch
from learner.advantages import (
    AdvantageInput,
    advantage_traits,
    compute_advantages,
    count_pairs,
    returns_of,
    whiten_batch,
)
from learner.batching import MicroBatch, Sequences, dummy_micro_batch, make_micro_batches
from learner.losses import PolicyLossInput, kl_estimate, loss_denominators, policy_objective
from learner.model import (
    disabled_adapter,
    is_lora,
    load_policy,
    resharded,
    response_logprobs,
    takes_attention_masks,
    token_logprobs,
    vocab_size,
)
from learner.offpolicy import logprob_mismatch
from learner.preference import GLOBAL_SHARES
from learner.token_rewards import rewards_to_go
from learner.vision import expand_images

if TYPE_CHECKING:
    from learner.critic import Critic

_MEAN_KEYS = (
    "is_ratio_mean",
    "ppo_ratio_mean",
    "ppo_clip_frac",
    "dual_clip_frac",
    "is_clip_frac",
    "is_mask_frac",
    "entropy_mean",
    "kl_mean",
)
_SUM_KEYS = ("tokens", "sequences", "is_masked_tokens", "is_masked_seqs")
_MAX_KEYS = ("is_ratio_max",)
STALENESS_BUCKETS = 4  # staleness_frac_0 .. staleness_frac_3, then staleness_frac_4plus


@dataclass(frozen=True)
class StepOptions:
    """What one step needs from the learner and algorithm configs."""

    algo: AlgorithmConfig
    max_grad_norm: float
    micro_batch_tokens: int
    packing: bool = False
    share_prompts: bool = False  # batching.make_micro_batches' share_prompts (where the model's attention allows)
    logprob_chunk_tokens: int = 0  # learner.model.token_logprobs' chunk_tokens
    ppo_epochs: int = 1  # passes over the batch
    mini_batches: int = 1  # optimizer steps per pass
    skip_zero_advantage: bool = True  # samples whose gradient is 0 skip the update's forward/backward

    @classmethod
    def from_config(cls, learner: LearnerConfig, algorithm: AlgorithmConfig) -> "StepOptions":
        return cls(
            algo=algorithm,
            max_grad_norm=learner.max_grad_norm,
            micro_batch_tokens=learner.micro_batch_tokens,
            packing=learner.packing,
            share_prompts=learner.share_prompts,
            logprob_chunk_tokens=learner.logprob_chunk_tokens,
            ppo_epochs=learner.ppo_epochs,
            mini_batches=learner.mini_batches,
            skip_zero_advantage=learner.skip_zero_advantage,
        )

    @property
    def updates(self) -> int:
        return self.ppo_epochs * self.mini_batches

    def advantage_options(self) -> dict[str, float | bool]:
        a = self.algo
        return {
            "norm_by_std": a.norm_by_std,
            "gamma": a.gamma,
            "lam": a.lam,
            "step_weight": a.step_weight,
            "group_of_one": a.group_of_one,
            "whiten": False,
            "beta": a.dpo_beta,
        }

    def objective_options(self) -> dict[str, float | str]:
        a = self.algo
        return {
            "loss": a.policy_loss,
            "clip_low": a.clip_low,
            "clip_high": a.clip_high,
            "dual_clip": a.dual_clip,
            "off_policy": a.off_policy,
            "is_level": a.is_level,
            "is_cap": a.is_cap,
            "agg": a.loss_agg,
            "norm_length": a.norm_length,
            "entropy_coef": a.entropy_coef,
            "kl_coef": 0.0 if a.kl_in_reward else a.kl_coef,
            "kl_estimator": a.kl_estimator,
        }

    @property
    def kl_in_loss(self) -> bool:
        return self.algo.kl_coef > 0 and not self.algo.kl_in_reward

    @property
    def kl_in_reward(self) -> bool:
        return self.algo.kl_coef > 0 and self.algo.kl_in_reward


@dataclass
class StepModels:
    """Models a step may need besides the policy: a critic (advantage needs values) and a frozen reference."""

    critic: "Critic | None" = None
    reference: nn.Module | None = None
    processor: Any = None
    """A vision-language policy's HF processor: expands a batch's images into the policy's inputs."""


def make_step_models(
    model_cfg: ModelConfig, algo: AlgorithmConfig, learner: LearnerConfig, device: torch.device, world_size: int
) -> StepModels:
    """Build what `algo` needs: the critic when its advantage estimator needs values, the frozen reference
    copy when KL is on or the estimator compares with a reference (online DPO), and algorithm.reference=frozen_copy.
    A collective (FSDP2 sharding)."""
    from learner.critic import Critic

    critic = reference = None
    traits = advantage_traits(algo.advantage)
    if traits.needs_values:
        critic = Critic.load(
            model_cfg.path,
            model_cfg.dtype,
            device,
            world_size,
            lr=algo.critic_lr,
            weight_decay=learner.weight_decay,
            max_grad_norm=learner.max_grad_norm,
            micro_batch_tokens=learner.micro_batch_tokens,
            value_clip=algo.value_clip,
            value_loss_agg=algo.value_loss_agg,
        )
    if (algo.kl_coef > 0 or traits.needs_logprobs) and algo.reference == "frozen_copy":
        reference = load_frozen_reference(model_cfg.path, model_cfg.dtype, device, world_size)
    processor = None
    if is_vision_language(model_cfg.path):
        from transformers import AutoProcessor

        processor = AutoProcessor.from_pretrained(model_cfg.path)
    return StepModels(critic=critic, reference=reference, processor=processor)


def load_frozen_reference(path: str, dtype: str, device: torch.device, world_size: int) -> nn.Module:
    """A second FSDP2-sharded copy of the initial weights: eval mode, no gradients."""
    ref = load_policy(path, dtype, device, world_size)
    ref.eval()
    ref.requires_grad_(False)
    return ref


def refresh_reference(model: nn.Module, reference: nn.Module) -> None:
    """Copy the policy's weights into the frozen reference (SPIN: the opponent becomes the current model). Both are
    sharded alike (`load_policy` on the same ranks), so each rank copies its own shards; nothing is gathered."""
    with torch.no_grad():
        for (name, ref), (other, new) in zip(
            resharded(reference).named_parameters(), resharded(model).named_parameters(), strict=True
        ):
            if name != other:
                raise RuntimeError(f"the reference's {name} faces the policy's {other}: not the same architecture")
            ref.copy_(new)


def reference_logprobs(
    model: nn.Module, mb: MicroBatch, frozen: nn.Module | None = None, chunk_tokens: int = 0
) -> Tensor:
    """log pi_ref of `mb`'s response tokens [Q], no gradient: the frozen copy when there is one, else the
    LoRA policy with its adapter disabled (its base model). A collective like any forward."""
    with torch.no_grad():
        if frozen is not None:
            return response_logprobs(frozen, mb, chunk_tokens)
        if is_lora(model):
            with disabled_adapter(model):
                return response_logprobs(model, mb, chunk_tokens)
    raise RuntimeError(
        "KL to a reference needs algorithm.reference=frozen_copy or LoRA (model.lora_rank > 0): "
        "without either there is no reference policy; or set algorithm.kl_coef=0"
    )


def advantage_input(
    batch: Batch,
    rewards: Tensor | None = None,
    values: Tensor | None = None,
    logp: Tensor | None = None,
    ref_logp: Tensor | None = None,
) -> AdvantageInput:
    """The batch's per-transition columns as an estimator's input (`rewards` replaces the batch's)."""
    return AdvantageInput(
        rewards=torch.from_numpy(np.array(batch.rewards, dtype=np.float32)) if rewards is None else rewards,
        traj_index=torch.from_numpy(np.array(batch.traj_index, dtype=np.int64)),
        group_index=torch.from_numpy(np.array(batch.group_index, dtype=np.int64)),
        step_index=torch.from_numpy(np.array(batch.step_index, dtype=np.int64)),
        dones=torch.from_numpy(np.array(batch.dones, dtype=np.bool_)),
        tokens=torch.from_numpy(np.array(batch.response_lens, dtype=np.int64)),
        anchors=[str(a) for a in batch.anchors] if len(batch.anchors) == len(batch.rewards) else None,
        values=values,
        logp=logp,
        ref_logp=ref_logp,
    )


def all_reduce_dict(values: dict[str, float], op: dist.ReduceOp, device: torch.device) -> dict[str, float]:
    """All-reduce a dict of floats (same keys on every rank) in one collective."""
    keys = sorted(values)
    t = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=op)
    return dict(zip(keys, t.tolist()))


def whiten_global(adv: Tensor, tokens: Tensor, device: torch.device) -> Tensor:
    """`learner.advantages.whiten_batch` of `adv` (each value weighted by `tokens`, the response tokens it stands
    for: [N] steps, or [R] tokens of weight 1) over the global batch's response tokens (verl's masked_whiten): each
    pass's sums over every rank (exact with a large mean). Two collectives."""

    def total(sums: tuple[float, float, float]) -> tuple[float, float, float]:
        out = all_reduce_dict(dict(zip(("n", "s", "ss"), sums)), dist.ReduceOp.SUM, device)
        return out["n"], out["s"], out["ss"]

    return whiten_batch(adv, tokens, total)


def checked_sequences(batch: Batch, vocab: int, processor: Any = None) -> Sequences:
    seqs = Sequences.from_batch(batch, None if processor is None else functools.partial(expand_images, processor))
    for name, ids in (("prompt_ids", seqs.prompt_ids), ("response_ids", seqs.response_ids)):
        if ids.numel() and (int(ids.max()) >= vocab or int(ids.min()) < 0):
            raise ValueError(f"batch {batch.step}: {name} holds token ids outside the model's vocabulary [0, {vocab})")
    return seqs


def transition_of_tokens(seqs: Sequences) -> Tensor:
    """The transition [R] each response token belongs to."""
    return torch.repeat_interleave(torch.arange(seqs.num_transitions), seqs.response_lens)


@dataclass(frozen=True)
class RowLayout:
    """Scatter a micro-batch's [Q] tokens into [S, T] rows, one sequence (transition) per row, whatever
    the micro-batch's own layout (padded or packed). A zero-weight micro-batch is one row of its tokens."""

    row: Tensor  # [Q] long
    col: Tensor  # [Q] long
    shape: tuple[int, int]

    @classmethod
    def of(cls, mb: MicroBatch, tok_seq: Tensor, r_off: Tensor) -> "RowLayout":
        q = mb.token_index.numel()
        if not bool(mb.mask.any()):
            return cls(torch.zeros(q, dtype=torch.long), torch.arange(q), (1, q))
        seq = tok_seq[mb.token_index]  # [Q]
        uniq, row = torch.unique(seq, return_inverse=True)
        col = mb.token_index - r_off[seq]  # [Q]
        return cls(row, col, (int(uniq.numel()), int(col.max()) + 1))

    def __call__(self, x: Tensor) -> Tensor:
        out = x.new_zeros(self.shape)  # [S, T]
        return out.index_put((self.row.to(x.device), self.col.to(x.device)), x)


def proximal_logprobs(model: nn.Module, mbs: list[MicroBatch], chunk_tokens: int = 0) -> list[Tensor]:
    """log pi_prox [Q] of each micro-batch's response tokens, no gradient: the policy before this step's
    updates. A collective like any forward."""
    with torch.no_grad():
        return [token_logprobs(model, mb, chunk_tokens)[0] for mb in mbs]


def per_transition(seqs: Sequences, mbs: list[MicroBatch], per_token: list[Tensor]) -> Tensor:
    """Sum each micro-batch's per-token values [Q] over the response tokens of each transition -> [N] float64."""
    tok_seq = transition_of_tokens(seqs)  # [R]
    out = torch.zeros(seqs.num_transitions, dtype=torch.float64)  # [N]
    for mb, x in zip(mbs, per_token):
        if bool(mb.mask.any()):
            out.index_add_(0, tok_seq[mb.token_index], torch.where(mb.mask, x.cpu(), 0.0).double())
    return out


def reward_kl(
    model: nn.Module, mbs: list[MicroBatch], seqs: Sequences, models: StepModels, estimator: str, chunk_tokens: int = 0
) -> Tensor:
    """KL(behaviour || reference) of each transition [N]: the sum over its response tokens of the
    per-token estimate at the sampled tokens (log pi_behav vs log pi_ref). One no-grad pass; a collective."""
    refs = [reference_logprobs(model, mb, models.reference, chunk_tokens).cpu() for mb in mbs]  # [Q] each
    return per_transition(seqs, mbs, [kl_estimate(estimator, mb.behav_logp, ref) for mb, ref in zip(mbs, refs)]).float()


def sequence_logprobs(
    model: nn.Module, mbs: list[MicroBatch], seqs: Sequences, models: StepModels, chunk_tokens: int = 0
) -> tuple[Tensor, Tensor]:
    """(log pi, log pi_ref) of each transition's response [N]: sums over its tokens, no gradient (online DPO's
    sequence log-probs). One no-grad pass of the policy and one of the reference; a collective."""
    policy = proximal_logprobs(model, mbs, chunk_tokens)
    refs = [reference_logprobs(model, mb, models.reference, chunk_tokens) for mb in mbs]
    return per_transition(seqs, mbs, policy).float(), per_transition(seqs, mbs, refs).float()


def run_micro_batches(
    model: nn.Module,
    mbs: list[MicroBatch],
    seqs: Sequences,
    opts: StepOptions,
    models: StepModels,
    token_denom: float,
    seq_denom: float,
    prox: list[Tensor] | None = None,
    same_weights: Tensor | None = None,
) -> dict[str, float]:
    """Forward/backward every micro-batch; gradients sync only on the last. `prox`: each micro-batch's
    log pi_prox (None: the policy itself, detached). `same_weights` [R]: the response tokens sampled on the
    weights the model holds now, whose log-probs measure the train-inference mismatch (None: not measured
    here). Returns local stat sums."""
    tok_seq = transition_of_tokens(seqs)  # [R]
    r_off = torch.cumsum(seqs.response_lens, 0) - seqs.response_lens  # [N]
    sums = {"loss": 0.0, **{k: 0.0 for k in _SUM_KEYS + _MEAN_KEYS}}
    maxes = {k: 0.0 for k in _MAX_KEYS}
    objective = opts.objective_options()
    for i, mb in enumerate(mbs):
        model.set_requires_gradient_sync(i == len(mbs) - 1)
        logp, entropy = token_logprobs(model, mb, opts.logprob_chunk_tokens, entropy=opts.algo.entropy_coef > 0)  # [Q]
        ref = (
            reference_logprobs(model, mb, models.reference, opts.logprob_chunk_tokens) if opts.kl_in_loss else None
        )  # [Q]
        rows = RowLayout.of(mb, tok_seq, r_off)
        device = logp.device
        inp = PolicyLossInput(
            logp=rows(logp),
            prox_logp=rows(logp.detach() if prox is None else prox[i].to(device)),
            behav_logp=rows(mb.behav_logp.to(device)),
            advantages=rows(mb.advantages.to(device)),
            mask=rows(mb.mask.to(device)),
            ref_logp=None if ref is None else rows(ref),
            entropy=None if entropy is None else rows(entropy),
        )  # [S, T] each
        loss, stats = policy_objective(inp, **objective, token_denom=token_denom, seq_denom=seq_denom)
        if same_weights is not None:
            add_stats(
                sums, logprob_mismatch(logp, mb.behav_logp.to(device), same_weights_mask(mb, same_weights, device))
            )
        loss.backward()
        sums["loss"] += float(loss.detach())
        for k in _SUM_KEYS:
            sums[k] += stats.get(k, 0.0)
        for k in _MEAN_KEYS:
            sums[k] += stats.get(k, 0.0) * stats["tokens"]
        for k in _MAX_KEYS:
            maxes[k] = max(maxes[k], stats[k])
    return {**sums, **{f"max:{k}": v for k, v in maxes.items()}}


def add_stats(into: dict[str, float], stats: dict[str, float]) -> None:
    """Accumulate local stats: `max:` keys keep the largest value, the others add up."""
    for k, v in stats.items():
        into[k] = max(into.get(k, v), v) if k.startswith("max:") else into.get(k, 0.0) + v


def same_weights_mask(mb: MicroBatch, same_weights: Tensor, device: torch.device) -> Tensor:
    """[Q] the micro-batch's loss tokens that the engine sampled on the weights the learner holds now."""
    return (mb.mask & same_weights[mb.token_index]).to(device)


def same_weights_tokens(batch: Batch, tok_seq: Tensor, version: int) -> Tensor:
    """[R] bool: the response tokens (`tok_seq` [R]: each one's transition) of transitions sampled entirely at
    `version` (version interval [version, version]), i.e. on the very weights the learner holds before this step's
    update."""
    lo, hi = np.asarray(batch.version_lo), np.asarray(batch.version_hi)  # [N]
    return torch.from_numpy((lo == version) & (hi == version))[tok_seq]


def batch_stats(batch: Batch, version: int) -> dict[str, float]:
    """Local sums/maxes: staleness = learner version - the oldest version that produced a response (mean,
    max, and the fraction at each lag), rewards, invalid actions, prompt images."""
    lag = version - np.asarray(batch.version_lo, dtype=np.int64)  # [N]
    buckets = {f"staleness_n_{k}": float(np.count_nonzero(lag == k)) for k in range(STALENESS_BUCKETS)}
    buckets[f"staleness_n_{STALENESS_BUCKETS}plus"] = float(np.count_nonzero(lag >= STALENESS_BUCKETS))
    return {
        "staleness_sum": float(lag.sum()),
        "max:staleness_max": float(lag.max()) if lag.size else 0.0,
        "transitions": float(lag.size),
        "max:batch_version_lag": float(version - batch.learner_version),
        "reward_sum": float(np.sum(batch.rewards, dtype=np.float64)),
        "invalid": float(np.size(batch.valid) - np.count_nonzero(batch.valid)),
        **buckets,
        "images": float(batch.image_shapes[:, 0].sum()) if batch.image_shapes.size else 0.0,
    }


def _pad_to_max(mbs: list[MicroBatch], device: torch.device, at_least: int = 0) -> tuple[list[MicroBatch], int]:
    n = max(at_least, int(all_reduce_dict({"n": len(mbs)}, dist.ReduceOp.MAX, device)["n"]))
    return mbs + [dummy_micro_batch() for _ in range(n - len(mbs))], n - len(mbs)


def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: Batch,
    opts: StepOptions,
    version: int,
    world_size: int,
    device: torch.device,
    models: StepModels | None = None,
) -> dict[str, float]:
    """Train on `batch` (this rank's share) at policy `version`; returns global (all-rank) metrics. The stages:
    score the batch, its advantages, the policy's update, the critic's update; then the metrics over all ranks."""
    t0 = time.perf_counter()
    models = models or StepModels()
    seqs = checked_sequences(batch, vocab_size(model), models.processor)
    share = opts.share_prompts and takes_attention_masks(model)
    inp, local = score_batch(model, batch, seqs, opts, models, device, share)
    adv = batch_advantages(batch, seqs, inp, opts, device)
    skipped = zero_gradient_samples(seqs, adv.policy, adv.per_token, opts)  # the critic and the stats keep them
    update = update_policy(
        model,
        optimizer,
        batch,
        seqs,
        adv.policy,
        adv.per_token,
        opts,
        models,
        version,
        world_size,
        device,
        share,
        skipped,
    )
    local.update(update.stats)
    local.update(update_critic(seqs, inp, adv.per_step, opts, models, world_size, device))
    local.update(batch_stats(batch, version))
    local.update(
        {f"adv_{k}": v for k, v in adv.stats.items()},
        zero_weight_micro_batches=float(update.padding),
        skipped_samples=float(skipped.samples),
        skipped_tokens=float(skipped.tokens),
    )
    return _global_metrics(local, world_size, device, version) | {
        "grad_norm": sum(update.grad_norms) / len(update.grad_norms),
        "updates": float(len(update.grad_norms)),
        "micro_batches": float(update.micro_batches),
        "compute_s": time.perf_counter() - t0,
        "local_tokens": float(update.local_tokens),
        "local_zero_weight_micro_batches": float(update.padding),
    }


def score_batch(
    model: nn.Module,
    batch: Batch,
    seqs: Sequences,
    opts: StepOptions,
    models: StepModels,
    device: torch.device,
    share: bool,
) -> tuple[AdvantageInput, dict[str, float]]:
    """The estimator's input: the batch's rewards (less kl_coef times each transition's KL to the reference, with
    the KL in the reward), the critic's values [N] and online DPO's sequence log-probs [N] where the estimator needs
    them; each a no-grad pass, a collective. Returns it and the local stat sums (reward_kl_sum)."""
    name = opts.algo.advantage
    traits = advantage_traits(name)
    stats: dict[str, float] = {}
    rewards = values = logp = ref_logp = None
    if opts.kl_in_reward or traits.needs_logprobs:  # no-grad passes before the advantages
        zero = make_micro_batches(
            seqs, torch.zeros(seqs.num_transitions), opts.micro_batch_tokens, packing=opts.packing, share_prompts=share
        )
        zero = _pad_to_max(zero, device)[0]
    if opts.kl_in_reward:
        kl = reward_kl(model, zero, seqs, models, opts.algo.kl_estimator, opts.logprob_chunk_tokens)  # [N]
        rewards = torch.from_numpy(np.array(batch.rewards, dtype=np.float32)) - opts.algo.kl_coef * kl
        stats["reward_kl_sum"] = float(kl.double().sum())
    if traits.needs_values:
        if models.critic is None:
            raise RuntimeError(f"algorithm.advantage={name} needs a critic; build it with make_step_models")
        values = models.critic.values(seqs, device)  # [N]
    if traits.needs_logprobs:  # online DPO: sequence log-probs of the policy and the reference
        logp, ref_logp = sequence_logprobs(model, zero, seqs, models, opts.logprob_chunk_tokens)  # [N] each
    return advantage_input(batch, rewards, values, logp, ref_logp), stats


@dataclass(frozen=True)
class Skipped:
    """This rank's samples whose forward and backward the policy's update skips, and what they hold."""

    trained: Tensor | None  # [N] bool, the samples the update runs; None: every sample
    samples: int = 0
    tokens: int = 0  # their response tokens: the loss's denominators still count them


def zero_gradient_samples(seqs: Sequences, advantages: Tensor, per_token: bool, opts: StepOptions) -> Skipped:
    """The samples that carry no gradient: every advantage of theirs is 0 (`advantages` [R] with `per_token`, else
    [N]) and no loss term but the advantage's reads their tokens (no KL in the loss, no entropy bonus). Both policy
    losses weigh each token's term by its advantage (ppo_clip: max(-A r, -A clip(r)); gspo: the sequence's ratio
    times A), so the gradient of such a sample is exactly 0 whatever its ratio or off-policy weight: skipping its
    forward and backward changes nothing but the time, as long as the loss's denominators still count its tokens
    and sequences (`optimizer_update`'s `uncounted`). In a group whose G rewards are equal (GRPO: every advantage 0)
    the whole group is skipped. With several mini-batches, which one a skipped sample would have been in is not
    kept, so nothing is skipped there; nor with `learner.skip_zero_advantage=false`."""
    a = opts.algo
    if not opts.skip_zero_advantage or opts.kl_in_loss or a.entropy_coef > 0 or opts.mini_batches > 1:
        return Skipped(None)
    n = seqs.num_transitions
    if per_token:
        nonzero = torch.zeros(n).index_add_(0, transition_of_tokens(seqs), (advantages != 0).float()) > 0  # [N]
    else:
        nonzero = advantages != 0  # [N]
    skip = ~nonzero & (seqs.response_lens > 0)  # [N] (a sample without a response token is never in a micro-batch)
    return Skipped(~skip, int(skip.sum()), int(seqs.response_lens[skip].sum()))


@dataclass(frozen=True)
class StepAdvantages:
    """A batch's advantages: per transition, and as the policy's update weighs its tokens."""

    per_step: Tensor  # [N] the estimator's (the critic's returns start from them)
    stats: dict[str, float]  # the estimator's
    policy: Tensor  # [R] with per_token, else [N]: rewards to go and whitening applied
    per_token: bool  # the batch has token rewards and the estimator's advantage is a return: one per token


def batch_advantages(
    batch: Batch, seqs: Sequences, inp: AdvantageInput, opts: StepOptions, device: torch.device
) -> StepAdvantages:
    """`opts.algo.advantage` of the scored batch `inp`, then per token where the batch has token rewards and the
    estimator gives returns (each token's reward to go, `learner.token_rewards`), whitened over the global batch's
    response tokens where asked or where the estimator whitens (it ran with whiten=False). Collectives: online
    DPO's pair count, the whitening's two."""
    name, options = opts.algo.advantage, opts.advantage_options()
    traits = advantage_traits(name)
    if inp.logp is not None:  # DPO's loss is a mean over the global batch's pairs
        options["pair_count"] = all_reduce_dict({"p": count_pairs(inp)}, dist.ReduceOp.SUM, device)["p"]
    adv, adv_stats = compute_advantages(name, inp, **options)  # [N]
    per_token = traits.to_go and batch.token_rewards.size > 0  # rewards on tokens: each token's reward to go
    policy_adv = (
        rewards_to_go(adv, torch.from_numpy(np.array(batch.token_rewards, dtype=np.float32)), seqs.response_lens)
        if per_token
        else adv
    )  # [R] or [N]
    if opts.algo.whiten_advantages or traits.whitens:  # estimators that whiten got whiten=False
        weights = torch.ones_like(policy_adv) if per_token else seqs.response_lens  # each token once
        policy_adv = whiten_global(policy_adv, weights, device)
    return StepAdvantages(per_step=adv, stats=adv_stats, policy=policy_adv, per_token=per_token)


@dataclass(frozen=True)
class PolicyUpdate:
    """What the policy's update did on this rank."""

    stats: dict[str, float]  # local stat sums (`max:` keys: maxes), per pass over the batch
    grad_norms: list[float]  # one per optimizer step
    micro_batches: int  # run per pass, zero-weight padding included
    local_tokens: int  # response tokens this rank's micro-batches hold
    padding: int  # zero-weight micro-batches: as many micro-batches as the rank with the most


def update_policy(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: Batch,
    seqs: Sequences,
    advantages: Tensor,
    per_token: bool,
    opts: StepOptions,
    models: StepModels,
    version: int,
    world_size: int,
    device: torch.device,
    share: bool,
    skipped: Skipped = Skipped(None),
) -> PolicyUpdate:
    """The policy's `opts.updates` optimizer steps on the batch, weighing its tokens by `advantages` ([R] with
    `per_token`, else [N]). With several, a no-grad pass first takes log pi_prox and measures the train-inference
    mismatch on it; with one, the update's own forward measures it (see the module docstring). The `skipped` samples
    are in no micro-batch (`zero_gradient_samples`)."""
    mbs = make_micro_batches(
        seqs,
        advantages,
        opts.micro_batch_tokens,
        packing=opts.packing,
        per_token=per_token,
        share_prompts=share,
        trained=skipped.trained,
    )
    local_tokens = sum(mb.num_tokens for mb in mbs)
    mbs, padding = _pad_to_max(mbs, device, at_least=opts.mini_batches)
    prox = proximal_logprobs(model, mbs, opts.logprob_chunk_tokens) if opts.updates > 1 else None
    tok_seq = transition_of_tokens(seqs)  # [R]
    same = same_weights_tokens(batch, tok_seq, version)  # [R] sampled on the weights held now: the mismatch's tokens
    stats: dict[str, float] = {}
    for mb, px in zip(mbs, prox or []):  # several updates: measured on the no-grad pass before them
        add_stats(stats, logprob_mismatch(px, mb.behav_logp.to(px.device), same_weights_mask(mb, same, px.device)))
    seq_counts = [int(tok_seq[mb.token_index[mb.mask]].unique().numel()) for mb in mbs]  # with a response token
    passes, grad_norms = epochs_of_updates(
        model,
        optimizer,
        mbs,
        seq_counts,
        seqs,
        opts,
        models,
        world_size,
        device,
        prox,
        same,
        uncounted=(skipped.tokens, skipped.samples),
    )
    stats.update(passes)
    return PolicyUpdate(
        stats=stats, grad_norms=grad_norms, micro_batches=len(mbs), local_tokens=local_tokens, padding=padding
    )


def epochs_of_updates(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    mbs: list[MicroBatch],
    seq_counts: list[int],
    seqs: Sequences,
    opts: StepOptions,
    models: StepModels,
    world_size: int,
    device: torch.device,
    prox: list[Tensor] | None,
    same: Tensor,
    uncounted: tuple[int, int] = (0, 0),
) -> tuple[dict[str, float], list[float]]:
    """`opts.ppo_epochs` passes over `mbs` (`seq_counts`: the sequences of each), each split into `opts.mini_batches`
    optimizer steps (`optimizer_update`; `uncounted`: the skipped samples' tokens and sequences, one mini-batch
    only). Returns the local stat sums per pass and each step's grad norm."""
    parts = [idx.tolist() for idx in np.array_split(np.arange(len(mbs)), opts.mini_batches)]  # same on every rank
    passes: dict[str, float] = {}  # over every update: sums add up, maxes keep the largest
    grad_norms = []
    for _ in range(opts.ppo_epochs):
        for part in parts:
            sums = optimizer_update(
                model,
                optimizer,
                [mbs[i] for i in part],
                sum(seq_counts[i] for i in part),
                seqs,
                opts,
                models,
                world_size,
                device,
                None if prox is None else [prox[i] for i in part],
                same_weights=same if prox is None else None,
                uncounted=uncounted,
            )
            grad_norms.append(sums.pop("grad_norm"))
            add_stats(passes, sums)
    for k in passes:
        if not k.startswith("max:"):
            passes[k] /= opts.ppo_epochs  # each pass covers the batch once: per-pass sums (token-weighted means alike)
    passes["loss"] /= opts.mini_batches  # each mini-batch's loss is a mean over its own tokens
    return passes, grad_norms


def update_critic(
    seqs: Sequences,
    inp: AdvantageInput,
    advantages: Tensor,
    opts: StepOptions,
    models: StepModels,
    world_size: int,
    device: torch.device,
) -> dict[str, float]:
    """The critic's update towards the estimator's returns (`learner.advantages.returns_of` of `advantages` [N]):
    its stats, prefixed critic_; nothing without a critic."""
    if models.critic is None:
        return {}
    returns = returns_of(opts.algo.advantage, inp, advantages, gamma=opts.algo.gamma)  # [N]
    return {f"critic_{k}": v for k, v in models.critic.update(seqs, returns, inp.values, device, world_size).items()}


def optimizer_update(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    mbs: list[MicroBatch],
    n_seqs: int,
    seqs: Sequences,
    opts: StepOptions,
    models: StepModels,
    world_size: int,
    device: torch.device,
    prox: list[Tensor] | None,
    same_weights: Tensor | None = None,
    uncounted: tuple[int, int] = (0, 0),
) -> dict[str, float]:
    """One optimizer step on `mbs` (this rank's part of a mini-batch, holding `n_seqs` sequences; every rank
    passes as many micro-batches): the loss is a mean over the mini-batch's tokens or sequences on all ranks
    (token-sum: their sum), those of skipped samples included (`uncounted`: their tokens and sequences), so that
    skipping them leaves the update as it was. Returns local stat sums and the grad norm."""
    totals = all_reduce_dict(
        {"tokens": sum(mb.num_tokens for mb in mbs) + uncounted[0], "sequences": n_seqs + uncounted[1]},
        dist.ReduceOp.SUM,
        device,
    )
    token_denom, seq_denom = loss_denominators(opts.algo.loss_agg, totals["tokens"], totals["sequences"], world_size)
    sums = run_micro_batches(
        model,
        mbs,
        seqs,
        opts,
        models,
        token_denom=token_denom,
        seq_denom=seq_denom,
        prox=prox,
        same_weights=same_weights,
    )
    sums["loss"] /= world_size  # each rank's loss was scaled by W (see module docstring)
    grad_norm = torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], opts.max_grad_norm)
    grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return {**sums, "grad_norm": float(grad_norm)}


def mismatch_metrics(sums: dict[str, float], maxes: dict[str, float], version: int) -> dict[str, float]:
    """The train-inference mismatch over the global batch's tokens sampled on the learner's current weights
    (`learner.offpolicy.logprob_mismatch`): their count, and, when there are any, the mean and max absolute
    log-prob difference and the mean KL(engine || learner) per token."""
    n = sums.get("mismatch_tokens", 0.0)
    if n == 0:
        return {"mismatch_tokens": 0.0}
    return {
        "mismatch_tokens": n,
        "mismatch_logp_abs_mean": sums["mismatch_abs_sum"] / n,
        "mismatch_logp_abs_max": maxes["max:mismatch_abs_max"],
        "mismatch_kl": sums["mismatch_kl_sum"] / n,
        "mismatch_version": float(version),
    }


def _global_metrics(local: dict[str, float], world_size: int, device: torch.device, version: int) -> dict[str, float]:
    """Sum / max over ranks, then turn sums into means."""
    maxes = all_reduce_dict({k: v for k, v in local.items() if k.startswith("max:")}, dist.ReduceOp.MAX, device)
    sums = all_reduce_dict({k: v for k, v in local.items() if not k.startswith("max:")}, dist.ReduceOp.SUM, device)
    tokens, n = max(sums["tokens"], 1.0), max(sums["transitions"], 1.0)
    out = {k: sums[k] for k in ("loss", "transitions") + _SUM_KEYS}
    out.update({k: sums[k] / tokens for k in _MEAN_KEYS})  # over the tokens the update ran on
    # tokens and sequences: the batch's, those of skipped samples (`zero_gradient_samples`) included; trained_*: the
    # update's forward and backward ran on these
    out.update(trained_tokens=sums["tokens"], trained_sequences=sums["sequences"])
    out["tokens"] += sums["skipped_tokens"]
    out["sequences"] += sums["skipped_samples"]
    out.update({k.removeprefix("max:"): v for k, v in maxes.items() if not k.startswith("max:mismatch_")})
    out.update(
        staleness_mean=sums["staleness_sum"] / n,
        reward_mean=sums["reward_sum"] / n,
        invalid_frac=sums["invalid"] / n,
        valid_action_ratio=1.0 - sums["invalid"] / n,
        images_per_transition=sums["images"] / n,
        zero_weight_micro_batches=sums["zero_weight_micro_batches"],
        skipped_samples=sums["skipped_samples"],
        skipped_tokens=sums["skipped_tokens"],
    )
    out.update(
        {k.replace("staleness_n_", "staleness_frac_"): v / n for k, v in sums.items() if k.startswith("staleness_n_")}
    )
    if "reward_kl_sum" in sums:
        out["reward_kl_mean"] = sums["reward_kl_sum"] / n
    out.update(mismatch_metrics(sums, maxes, version))
    # advantage and critic stats: the mean over ranks of each rank's value; counts (`*_count`) and each rank's share
    # of a global mean (`learner.preference.GLOBAL_SHARES`): their sum
    summed = lambda k: k.endswith("_count") or k.removeprefix("adv_") in GLOBAL_SHARES  # noqa: E731
    out.update({k: v if summed(k) else v / world_size for k, v in sums.items() if k.startswith(("adv_", "critic_"))})
    return out
