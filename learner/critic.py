"""The critic for PPO/GAE: the policy's Hugging Face backbone (`AutoModel`, initialised from model.path)
plus a linear scalar head, FSDP2-sharded like the policy, with its own AdamW.

The value of an env step is the head's output at the step's last prompt token (the state the action
was sampled in; causal attention means the response never influences it), so the critic runs on
prompts only. `Critic.values` is a no-grad pass before the advantages; `Critic.update` trains the clipped
value loss on the returns after the policy's step. Both are collectives: every rank runs the same number
of forwards (a rank with fewer prompt batches runs zero-weight ones).

Shapes: N = transitions of this rank's share, B = prompts in a batch, L = the longest of them, H = hidden.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from learner.batching import Sequences
from learner.losses import value_loss_weights
from learner.model import DTYPES, decoder_layers


def clipped_value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    mask: Tensor,
    *,
    value_clip: float,
    tokens: Tensor | None = None,
    agg: str = "token-mean",
    denom: Tensor | float | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """PPO's clipped value loss (Schulman et al. 2017 / OpenAI baselines ppo2), as verl's `compute_value_loss`:

        V_clip = clip(V, V_old - value_clip, V_old + value_clip)          (verl's clip_by_value: V itself inside)
        l_i = max((V_i - R_i)^2, (V_clip_i - R_i)^2)
        loss = 0.5 sum_i mask_i w_i l_i / denom                            denom = sum_i mask_i d_i unless given

    (w_i, d_i) from step i's response tokens n_i by `agg` (`learner.losses.VALUE_LOSS_AGGREGATIONS`): token-mean
    (n_i, n_i), seq-mean-token-sum (n_i, 1), seq-mean-token-mean (1, 1); a step without tokens counts in neither.
    One value per step stands for each of its tokens, so token-mean is verl's loss over those tokens.
    values, old_values, returns, mask, tokens: [B] (tokens None: one each). Stats over masked tokens, as
    verl's: value_clip_frac counts a token where the clipped loss is strictly larger.
    """
    m = mask.bool()
    n_tok = torch.ones_like(values, dtype=torch.float64) if tokens is None else tokens.to(values.device).double()
    weight, part = value_loss_weights(agg, torch.where(m, n_tok, 0.0))  # [B] each
    v_clip = torch.clamp(values, old_values - value_clip, old_values + value_clip)  # [B]
    unclipped, clipped = (values - returns) ** 2, (v_clip - returns) ** 2  # [B]
    per = torch.maximum(unclipped, clipped)  # [B]
    d = part.sum().clamp(min=1).to(per.dtype) if denom is None else denom
    loss = 0.5 * (weight.to(per.dtype) * torch.where(m, per, 0.0)).sum() / d
    with torch.no_grad():
        w = torch.where(m, n_tok, 0.0)  # [B] tokens of the masked steps
        nf = w.sum().clamp(min=1)
        stats = {
            "values": float(m.sum()),
            "value_tokens": float(w.sum()),
            "value_clip_frac": float((w * (clipped > unclipped).double()).sum() / nf),
            "value_mean": float((w * torch.where(m, values.detach(), 0.0).double()).sum() / nf),
            "return_mean": float((w * torch.where(m, returns, 0.0).double()).sum() / nf),
        }
    return loss, stats


class ValueModel(nn.Module):
    """backbone (a Hugging Face base model, no LM head) + Linear(H, 1)."""

    def __init__(self, backbone: nn.Module, hidden: int):
        super().__init__()
        self.backbone = backbone
        self.head = nn.Linear(hidden, 1)
        nn.init.zeros_(self.head.weight)  # start at V = 0: no random values scaled into the first advantages
        nn.init.zeros_(self.head.bias)

    def forward(self, input_ids: Tensor, attention_mask: Tensor, last: Tensor) -> Tensor:
        """Values [B] at positions `last` [B] of right-padded rows input_ids [B, L]."""
        h = self.backbone(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
        picked = h[torch.arange(h.shape[0], device=h.device), last]  # [B, H]
        return self.head(picked)[:, 0].float().clone()  # [B]; a fresh tensor, not a view (FSDP2 hooks)


@dataclass(frozen=True)
class PromptBatch:
    """Right-padded prompts of some transitions."""

    input_ids: Tensor  # [B, L] long
    attention_mask: Tensor  # [B, L] long
    last: Tensor  # [B] long, position of each prompt's last token
    index: Tensor  # [B] long, transition of each row; -1 in a zero-weight batch


def prompt_batches(seqs: Sequences, token_budget: int) -> list[PromptBatch]:
    """Every transition's prompt, longest first, B x L <= token_budget (a longer prompt gets its own batch)."""
    lens = seqs.prompt_lens.tolist()
    offs = (torch.cumsum(seqs.prompt_lens, 0) - seqs.prompt_lens).tolist()
    bins: list[list[int]] = []
    for i in sorted(range(len(lens)), key=lambda i: (-lens[i], i)):
        if bins and (len(bins[-1]) + 1) * lens[bins[-1][0]] <= token_budget:
            bins[-1].append(i)
        else:
            bins.append([i])
    out = []
    for members in bins:
        width = lens[members[0]]
        ids = torch.zeros(len(members), width, dtype=torch.long)  # [B, L]
        att = torch.zeros(len(members), width, dtype=torch.long)  # [B, L]
        for b, i in enumerate(members):
            ids[b, : lens[i]] = seqs.prompt_ids[offs[i] : offs[i] + lens[i]]
            att[b, : lens[i]] = 1
        out.append(PromptBatch(ids, att, torch.tensor([lens[i] - 1 for i in members]), torch.tensor(members)))
    return out


def dummy_prompt_batch() -> PromptBatch:
    one = torch.zeros(1, 1, dtype=torch.long)
    return PromptBatch(one, torch.ones_like(one), torch.zeros(1, dtype=torch.long), torch.full((1,), -1))


def _pad_count(batches: list[PromptBatch], device: torch.device) -> list[PromptBatch]:
    n = torch.tensor([len(batches)], dtype=torch.float64, device=device)
    dist.all_reduce(n, op=dist.ReduceOp.MAX)
    return batches + [dummy_prompt_batch() for _ in range(int(n.item()) - len(batches))]


@dataclass
class Critic:
    """A sharded value model, its optimizer, and how it trains."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    micro_batch_tokens: int
    max_grad_norm: float
    value_clip: float
    value_loss_agg: str = "token-mean"  # learner.losses.VALUE_LOSS_AGGREGATIONS

    @classmethod
    def load(
        cls,
        path: str,
        dtype: str,
        device: torch.device,
        world_size: int,
        *,
        lr: float,
        weight_decay: float,
        max_grad_norm: float,
        micro_batch_tokens: int,
        value_clip: float,
        value_loss_agg: str = "token-mean",
    ) -> "Critic":
        """Backbone from `path` (fp32 master weights), each decoder layer then the root `fully_shard`-ed."""
        from transformers import AutoModel
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        backbone = AutoModel.from_pretrained(path, dtype=torch.float32)
        model = ValueModel(backbone, int(backbone.config.hidden_size)).to(device)
        mesh = init_device_mesh(device.type, (world_size,))
        mp = MixedPrecisionPolicy(param_dtype=DTYPES[dtype], reduce_dtype=torch.float32)
        for layer in decoder_layers(backbone):
            fully_shard(layer, mesh=mesh, mp_policy=mp)
        fully_shard(model, mesh=mesh, mp_policy=mp)
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
        return cls(model, opt, micro_batch_tokens, max_grad_norm, value_clip, value_loss_agg)

    def _forward(self, pb: PromptBatch, device: torch.device) -> Tensor:
        return self.model(pb.input_ids.to(device), pb.attention_mask.to(device), pb.last.to(device))  # [B]

    def values(self, seqs: Sequences, device: torch.device) -> Tensor:
        """V(s) of every transition [N] (float32, CPU), no gradient. A collective."""
        out = torch.zeros(seqs.num_transitions)  # [N]
        with torch.no_grad():
            for pb in _pad_count(prompt_batches(seqs, self.micro_batch_tokens), device):
                v = self._forward(pb, device).cpu()  # [B]
                real = pb.index >= 0
                out[pb.index[real]] = v[real]
        return out

    def update(
        self, seqs: Sequences, returns: Tensor, old_values: Tensor, device: torch.device, world_size: int
    ) -> dict[str, float]:
        """One optimizer step of the clipped value loss, aggregated by `value_loss_agg` over all ranks'
        transitions (token-mean: each weighted by its response tokens). Returns this rank's stats (loss already
        divided by W, as the policy's)."""
        tokens = seqs.response_lens.to(torch.float64)  # [N]
        _, part = value_loss_weights(self.value_loss_agg, tokens)  # [N]
        d_global = torch.tensor([float(part.sum())], dtype=torch.float64, device=device)
        dist.all_reduce(d_global)
        denom = max(float(d_global.item()), 1.0) / world_size  # FSDP's average over ranks gives the global mean
        batches = _pad_count(prompt_batches(seqs, self.micro_batch_tokens), device)
        total, sums = 0.0, {"value_tokens": 0.0, "value_clip_frac": 0.0}
        for i, pb in enumerate(batches):
            self.model.set_requires_gradient_sync(i == len(batches) - 1)
            v = self._forward(pb, device)  # [B]
            real = pb.index >= 0
            idx = pb.index.clamp(min=0)
            loss, stats = clipped_value_loss(
                v,
                old_values[idx].to(device),
                returns[idx].to(device).float(),
                real.to(device),
                value_clip=self.value_clip,
                tokens=tokens[idx],
                agg=self.value_loss_agg,
                denom=denom,
            )
            loss.backward()
            total += float(loss.detach()) / world_size
            sums["value_tokens"] += stats["value_tokens"]
            sums["value_clip_frac"] += stats["value_clip_frac"] * stats["value_tokens"]
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_grad_norm)
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        n = max(sums["value_tokens"], 1.0)
        return {
            "value_loss": total * world_size,
            "value_clip_frac": sums["value_clip_frac"] / n,
            "grad_norm": float(norm),
            "value_mean": float(old_values.double().mean()) if old_values.numel() else 0.0,
        }
