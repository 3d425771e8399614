"""From a broker `Batch` to padded micro-batches: each transition is one sequence prompt+response.

Sequences are right-padded into rows [B, L] with an attention mask, B * L <= the token budget, grouped
longest-first so that padding stays small. Padding, not packing into one long row, because attention cost
grows with the square of the row length: on CPU, one packed 4096-token row (16 sequences of 256) took
2.2 s forward+backward for the tiny model, 16 padded rows of 256 took 0.2 s (see the closing note of
the spine issue). Loss is only on response tokens: the logits at position p predict the token at p+1,
so a response starting at row position s is predicted by the logits at s-1 (inside the same sequence,
because every prompt has at least one token).

Packing (`learner.packing`) is the other option: sequences are laid end to end into one row per
micro-batch (at most the token budget, first-fit longest-first), with `position_ids` restarting at 0 for
each sequence and no attention mask; the model then keeps attention inside each sequence (only with
use_cache=False, see `learner.model.response_logprobs`). Both paths give the same `MicroBatch`.

Shapes: N = transitions, S = sum of prompt lengths, R = sum of response lengths of the batch,
B = rows (sequences) of a micro-batch, L = its longest sequence, Q = response tokens in it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from agentstream.wire.messages import Batch
from learner.vision import join_images


@dataclass(frozen=True)
class Sequences:
    """A batch's token arrays, checked and split per transition."""

    prompt_ids: Tensor  # [S] long
    response_ids: Tensor  # [R] long
    behav_logp: Tensor  # [R] float32
    prompt_lens: Tensor  # [N] long
    response_lens: Tensor  # [N] long
    pixels: tuple[dict[str, Tensor], ...] = ()
    """Per transition, its images as the model's inputs (`learner.vision.expand_images`: e.g. pixel_values
    [1, n, 3, H, W]; empty without images); () when the batch has no images. Its prompt ids are then expanded."""
    image_slots: Tensor | None = None
    """[S] bool: the prompt positions the images' features fill (None: no images). An image token elsewhere (one the
    model generated, in a response or quoted in a later prompt) stays a token, as in the engine."""

    @classmethod
    def from_batch(
        cls, batch: Batch, expand: "Callable[[np.ndarray, Sequence[np.ndarray]], dict[str, Tensor]] | None" = None
    ) -> "Sequences":
        """Check that the columnar arrays agree with each other; raise ValueError saying what does not.

        A batch with images needs `expand` (a vision-language policy's `learner.vision.expand_images`): each such
        prompt's image placeholders become the model's image tokens, and its pixels the model's inputs."""
        n = len(batch.prompt_lens)
        if len(batch.response_lens) != n:
            raise ValueError(f"batch {batch.step}: {n} prompt_lens but {len(batch.response_lens)} response_lens")
        for name, lens, arr in [
            ("prompt_ids", batch.prompt_lens, batch.prompt_ids),
            ("response_ids", batch.response_lens, batch.response_ids),
            ("logprobs", batch.response_lens, batch.logprobs),
        ]:
            if int(np.sum(lens, dtype=np.int64)) != len(arr):
                raise ValueError(
                    f"batch {batch.step}: {name} holds {len(arr)} values, its lengths sum to {int(np.sum(lens))}"
                )
        if n and int(np.min(batch.prompt_lens)) < 1:
            raise ValueError(f"batch {batch.step}: a transition has an empty prompt; every prompt needs >= 1 token")
        if n and int(np.min(batch.response_lens)) < 0:
            raise ValueError(f"batch {batch.step}: negative response length")
        seqs = cls(
            prompt_ids=torch.from_numpy(np.asarray(batch.prompt_ids, dtype=np.int64)),
            response_ids=torch.from_numpy(np.asarray(batch.response_ids, dtype=np.int64)),
            behav_logp=torch.from_numpy(np.array(batch.logprobs, dtype=np.float32)),
            prompt_lens=torch.from_numpy(np.asarray(batch.prompt_lens, dtype=np.int64)),
            response_lens=torch.from_numpy(np.asarray(batch.response_lens, dtype=np.int64)),
        )
        if not batch.image_data.size:
            return seqs
        if expand is None:
            raise ValueError(
                f"batch {batch.step} holds images but the policy is not a vision-language model "
                f"(model.path has no vision_config): train a VL model, or run with memory.images=none"
            )
        return seqs.with_images(batch, expand)

    def with_images(
        self, batch: Batch, expand: Callable[[np.ndarray, Sequence[np.ndarray]], dict[str, Tensor]]
    ) -> "Sequences":
        """These sequences with each prompt's images expanded (`from_batch`)."""
        ends = torch.cumsum(self.prompt_lens, 0).tolist()
        prompts, slots, pixels = [], [], []
        for i, (start, end) in enumerate(zip([0] + ends[:-1], ends)):
            ids, images = self.prompt_ids[start:end].numpy(), batch.images_of(i)
            inputs = expand(ids, list(images)) if len(images) else {"input_ids": torch.from_numpy(ids)[None]}
            prompts.append(inputs.pop("input_ids")[0])
            slots.append(inputs.pop("image_slots", torch.zeros_like(prompts[-1], dtype=torch.bool)[None])[0])
            pixels.append(inputs)  # this prompt's images, in the model's layout
        return Sequences(
            torch.cat(prompts),
            self.response_ids,
            self.behav_logp,
            torch.tensor([len(p) for p in prompts], dtype=torch.long),
            self.response_lens,
            tuple(pixels),
            torch.cat(slots),
        )

    @property
    def num_transitions(self) -> int:
        return int(self.prompt_lens.numel())

    @property
    def num_response_tokens(self) -> int:
        return int(self.response_ids.numel())


@dataclass(frozen=True)
class MicroBatch:
    """Right-padded sequences (or packed rows), and what the loss needs per response token."""

    input_ids: Tensor  # [B, L] long (padding: 0)
    attention_mask: Tensor | None  # [B, L] long, 1 on real tokens; None for packed rows; [B, 1, L, L] bool for
    # rows of shared prompts (`_share`: True where a query position may see a key position)
    logit_rows: Tensor  # [Q] long, row of each response token
    logit_pos: Tensor  # [Q] long, position in its row whose logits predict the response token
    targets: Tensor  # [Q] long, the response tokens
    behav_logp: Tensor  # [Q] float32, behaviour log-probs
    advantages: Tensor  # [Q] float32
    mask: Tensor  # [Q] bool, False only in a zero-weight micro-batch
    token_index: Tensor  # [Q] long, index of each token in the batch's response arrays
    position_ids: Tensor | None = None  # [B, L] long, restarting at 0 per sequence; packed and shared rows only
    pixels: dict[str, Tensor] | None = None  # the rows' images in row order (`join_images`: e.g. [1, N, 3, H, W]);
    # the model fills the image slots with them in the order the slots come, row after row
    image_slots: Tensor | None = None  # [B, L] bool, the prompt positions the images fill; None without images

    @property
    def num_tokens(self) -> int:
        """Response tokens that count in the loss."""
        return int(self.mask.sum())


def plan_micro_batches(lengths: list[int], token_budget: int) -> list[list[int]]:
    """Longest first: sequence indices per micro-batch, rows x longest <= `token_budget` padded tokens.
    A sequence longer than the budget gets a micro-batch of its own."""
    bins: list[list[int]] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        if bins and (len(bins[-1]) + 1) * lengths[bins[-1][0]] <= token_budget:
            bins[-1].append(i)  # the bin's first member is its longest: it sets the padded length
        else:
            bins.append([i])
    return [sorted(b) for b in bins]


def plan_packed_rows(lengths: list[int], token_budget: int) -> list[list[int]]:
    """First-fit, longest first: sequence indices per packed row, sum of lengths <= `token_budget`.
    A sequence longer than the budget gets a row of its own."""
    bins: list[list[int]] = []
    used: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        for b in range(len(bins)):
            if used[b] + lengths[i] <= token_budget:
                bins[b].append(i)
                used[b] += lengths[i]
                break
        else:
            bins.append([i])
            used.append(lengths[i])
    return [sorted(b) for b in bins]


def make_micro_batches(
    seqs: Sequences,
    advantages: Tensor,
    token_budget: int,
    packing: bool = False,
    per_token: bool = False,
    share_prompts: bool = False,
    trained: Tensor | None = None,
) -> list[MicroBatch]:
    """Pad (or, with `packing`, pack) every transition with a non-empty response into micro-batches (of those that
    `trained` [N] bool marks, when given: the others' tokens are in none);
    `advantages` is [N] (one value per transition, shared by its response tokens), or with `per_token` [R]
    (one per response token, in the batch's order). Every response token appears exactly once.
    `share_prompts`: the transitions of one prompt share one copy of it (`_share`; not with images)."""
    want = seqs.num_response_tokens if per_token else seqs.num_transitions
    if advantages.shape != (want,):
        raise ValueError(
            f"advantages have shape {tuple(advantages.shape)}, expected [{want}]"
            f"{' (one per response token)' if per_token else ' (one per transition)'}"
        )
    if not per_token:
        advantages = advantages.repeat_interleave(seqs.response_lens)  # [R]
    p_off = torch.cumsum(seqs.prompt_lens, 0) - seqs.prompt_lens  # [N]
    r_off = torch.cumsum(seqs.response_lens, 0) - seqs.response_lens  # [N]
    keep = [
        i
        for i in range(seqs.num_transitions)
        if int(seqs.response_lens[i]) > 0 and (trained is None or bool(trained[i]))
    ]
    plan = plan_packed_rows if packing else plan_micro_batches
    if share_prompts and seqs.image_slots is None:
        units = prompt_units(seqs, keep, p_off, token_budget)
        lengths = [int(seqs.prompt_lens[u[0]] + sum(int(seqs.response_lens[i]) for i in u)) for u in units]

        def rows_of(m: list[int]) -> list[list[list[int]]]:  # packed: a bin's units in one row; padded: a row each
            return [[units[j] for j in m]] if packing else [[units[j]] for j in m]

        return [_share(rows_of(m), seqs, advantages, p_off, r_off) for m in plan(lengths, token_budget)]
    lengths = [int(seqs.prompt_lens[i] + seqs.response_lens[i]) for i in keep]
    build = _pack if packing else _pad
    return [build([keep[j] for j in m], seqs, advantages, p_off, r_off) for m in plan(lengths, token_budget)]


def prompt_units(seqs: Sequences, keep: list[int], p_off: Tensor, token_budget: int) -> list[list[int]]:
    """The transitions of `keep` grouped by their prompt ids (a group's first step: every member's prompt is the
    same), first seen first; a unit whose prompt and responses pass `token_budget` is split into several that do
    not (each with a copy of the prompt; one member alone may still pass it)."""
    by_prompt: dict[bytes, list[int]] = {}
    for i in keep:
        po, p = int(p_off[i]), int(seqs.prompt_lens[i])
        by_prompt.setdefault(seqs.prompt_ids[po : po + p].numpy().tobytes(), []).append(i)
    units: list[list[int]] = []
    for members in by_prompt.values():
        prompt = int(seqs.prompt_lens[members[0]])
        units.append([])
        used = prompt
        for i in members:
            r = int(seqs.response_lens[i])
            if units[-1] and used + r > token_budget:
                units.append([])
                used = prompt
            units[-1].append(i)
            used += r
    return units


def _share(
    rows: list[list[list[int]]], seqs: Sequences, advantages: Tensor, p_off: Tensor, r_off: Tensor
) -> MicroBatch:
    """Rows [B, L] of units (transitions with one prompt, `prompt_units`): each unit is its prompt once, then each
    member's response, with a [B, 1, L, L] attention mask (a prompt token sees the prompt up to itself, a response
    token the prompt and its own response up to itself, nothing of another unit) and position ids that go on from
    the prompt's end in every response, so each response's log-probs are the ones it has alone after its prompt.
    The first token of every response is predicted by the prompt's last position; padding sees only itself."""
    width = max(
        sum(int(seqs.prompt_lens[u[0]]) + sum(int(seqs.response_lens[i]) for i in u) for u in row) for row in rows
    )
    input_ids = torch.zeros(len(rows), width, dtype=torch.long)  # [B, L]
    positions = torch.zeros(len(rows), width, dtype=torch.long)  # [B, L]
    unit = torch.full((len(rows), width), -1, dtype=torch.long)  # [B, L] unit of each position (-1: padding)
    span = torch.full((len(rows), width), -1, dtype=torch.long)  # [B, L] response of each position (-1: a prompt)
    logit_rows, logit_pos, tok_index, adv = [], [], [], []
    for b, row in enumerate(rows):
        start = 0
        for k, members in enumerate(row):
            p, po = int(seqs.prompt_lens[members[0]]), int(p_off[members[0]])
            input_ids[b, start : start + p] = seqs.prompt_ids[po : po + p]
            positions[b, start : start + p] = torch.arange(p)
            unit[b, start : start + p] = k
            last_prompt, start = start + p - 1, start + p
            for i in members:
                r, ro = int(seqs.response_lens[i]), int(r_off[i])
                input_ids[b, start : start + r] = seqs.response_ids[ro : ro + r]
                positions[b, start : start + r] = torch.arange(p, p + r)
                unit[b, start : start + r], span[b, start : start + r] = k, i
                logit_rows.append(torch.full((r,), b, dtype=torch.long))
                logit_pos.append(torch.cat([torch.tensor([last_prompt]), torch.arange(start, start + r - 1)]))
                tok_index.append(torch.arange(ro, ro + r))
                adv.append(advantages[ro : ro + r])
                start += r
    q, k = unit[:, :, None], unit[:, None, :]  # [B, L, 1], [B, 1, L]
    causal = torch.ones(width, width, dtype=torch.bool).tril()  # [L, L]
    sees = (q == k) & (q >= 0) & causal & ((span[:, None, :] == -1) | (span[:, :, None] == span[:, None, :]))
    sees |= torch.eye(width, dtype=torch.bool)  # padding attends to itself: a row of no keys would give NaN
    return _micro_batch(
        seqs,
        input_ids,
        sees[:, None],
        logit_rows,
        logit_pos,
        tok_index,
        adv,  # mask [B, 1, L, L]
        position_ids=positions,
    )


def _pack(seq_ids: list[int], seqs: Sequences, advantages: Tensor, p_off: Tensor, r_off: Tensor) -> MicroBatch:
    """One row [1, L]: the sequences end to end, position ids restarting at each (`advantages` [R])."""
    ids, pos, logit_rows, logit_pos, tok_index, adv = [], [], [], [], [], []
    start = 0
    for i in seq_ids:
        p, r = int(seqs.prompt_lens[i]), int(seqs.response_lens[i])
        po, ro = int(p_off[i]), int(r_off[i])
        ids += [seqs.prompt_ids[po : po + p], seqs.response_ids[ro : ro + r]]
        pos.append(torch.arange(p + r))
        logit_rows.append(torch.zeros(r, dtype=torch.long))
        logit_pos.append(torch.arange(start + p - 1, start + p + r - 1))
        tok_index.append(torch.arange(ro, ro + r))
        adv.append(advantages[ro : ro + r])
        start += p + r
    return _micro_batch(
        seqs,
        torch.cat(ids)[None],
        None,
        logit_rows,
        logit_pos,
        tok_index,
        adv,  # one row [1, L], no mask
        position_ids=torch.cat(pos)[None],  # [1, L]
        pixels=_pixels(seqs, seq_ids),
        image_slots=None
        if seqs.image_slots is None
        else torch.cat(
            [
                torch.cat(
                    [
                        seqs.image_slots[int(p_off[i]) : int(p_off[i] + seqs.prompt_lens[i])],
                        torch.zeros(int(seqs.response_lens[i]), dtype=torch.bool),
                    ]
                )
                for i in seq_ids
            ]
        )[None],
    )


def _pad(rows: list[int], seqs: Sequences, advantages: Tensor, p_off: Tensor, r_off: Tensor) -> MicroBatch:
    width = max(int(seqs.prompt_lens[i] + seqs.response_lens[i]) for i in rows)
    input_ids = torch.zeros(len(rows), width, dtype=torch.long)  # [B, L]
    attention_mask = torch.zeros(len(rows), width, dtype=torch.long)  # [B, L]
    slots = None if seqs.image_slots is None else torch.zeros(len(rows), width, dtype=torch.bool)  # [B, L]
    logit_rows, logit_pos, tok_index, adv = [], [], [], []
    for b, i in enumerate(rows):
        p, r = int(seqs.prompt_lens[i]), int(seqs.response_lens[i])
        po, ro = int(p_off[i]), int(r_off[i])
        input_ids[b, :p] = seqs.prompt_ids[po : po + p]
        input_ids[b, p : p + r] = seqs.response_ids[ro : ro + r]
        attention_mask[b, : p + r] = 1
        if slots is not None:
            slots[b, :p] = seqs.image_slots[po : po + p]
        logit_rows.append(torch.full((r,), b, dtype=torch.long))
        logit_pos.append(torch.arange(p - 1, p + r - 1))
        tok_index.append(torch.arange(ro, ro + r))
        adv.append(advantages[ro : ro + r])
    return _micro_batch(
        seqs,
        input_ids,
        attention_mask,
        logit_rows,
        logit_pos,
        tok_index,
        adv,
        pixels=_pixels(seqs, rows),
        image_slots=slots,
    )


def _micro_batch(
    seqs: Sequences,
    input_ids: Tensor,
    attention_mask: Tensor | None,
    logit_rows: list[Tensor],
    logit_pos: list[Tensor],
    tok_index: list[Tensor],
    adv: list[Tensor],
    **layout: Any,
) -> MicroBatch:
    """A MicroBatch of rows `input_ids` from the per-sequence pieces every layout collects (each response's rows,
    logit positions, token indices and advantages, in the same order); `layout`: its position ids and images."""
    token_index = torch.cat(tok_index)  # [Q]
    return MicroBatch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        logit_rows=torch.cat(logit_rows),
        logit_pos=torch.cat(logit_pos),
        targets=seqs.response_ids[token_index],
        behav_logp=seqs.behav_logp[token_index],
        advantages=torch.cat(adv).to(torch.float32),
        mask=torch.ones(token_index.numel(), dtype=torch.bool),
        token_index=token_index,
        **layout,
    )


def _pixels(seqs: Sequences, seq_ids: list[int]) -> dict[str, Tensor] | None:
    """The images of sequences `seq_ids`, in that order, as one forward's inputs; None: no image."""
    parts = [seqs.pixels[i] for i in seq_ids if seqs.pixels and seqs.pixels[i]]
    return join_images(parts) if parts else None


def dummy_micro_batch(pad_id: int = 0) -> MicroBatch:
    """A two-token micro-batch whose one loss token is masked out: a rank with fewer micro-batches runs
    these so that every rank makes the same number of forward/backward calls (FSDP collectives)."""
    one = torch.zeros(1, dtype=torch.long)
    return MicroBatch(
        input_ids=torch.full((1, 2), pad_id, dtype=torch.long),
        attention_mask=torch.ones(1, 2, dtype=torch.long),
        logit_rows=one.clone(),
        logit_pos=one.clone(),
        targets=torch.full((1,), pad_id, dtype=torch.long),
        behav_logp=torch.zeros(1),
        advantages=torch.zeros(1),
        mask=torch.zeros(1, dtype=torch.bool),
        token_index=torch.full((1,), -1, dtype=torch.long),
    )
