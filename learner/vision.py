"""Images on the learner's side: the engine's prompt (one unexpanded image placeholder per image) made into the
inputs of a Hugging Face vision-language model (Idefics3/SmolVLM), and the log-probs of a response under it.

    processor = AutoProcessor.from_pretrained(model_dir)
    inputs = expand_images(processor, prompt_ids, images)   # input_ids, image_slots, pixel_values, pixel_attention_mask
    logp = vl_response_logprobs(model, processor, prompt_ids, response_ids, images)   # [T]

    merge_at_slots(policy)                                       # once, at load
    with image_slots(policy, slots):                             # around a forward given pixels
        out = policy(input_ids=ids, pixel_values=..., ...)

The engine (vLLM) expands each placeholder with the model's own HF processor; here each one becomes exactly the
ids that processor gives for its image alone (`processor(text=<image>, images=[image])`), so the learner's
sequence is token for token the one the engine ran on.

The image slots: vLLM fills with image features exactly the positions its processor expanded from a prompt's
placeholders, and embeds an image token the model itself generated as a plain token. HF's Idefics3 fills every
image token id of `input_ids`, a response's included (its forward then fails: fewer features than slots). So the
learner tells its model the slots (`merge_at_slots`, `image_slots`), and the reference here scatters the features
at the slots itself.

Shapes: P = prompt ids (unexpanded), L = expanded prompt ids, N = image tiles of the prompt (one per image
without image splitting), H, W = a tile's pixels, T = response ids, V = vocabulary.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

# What a processor returns beside the pixels: the text's ids and masks, which expand_images makes itself.
TEXT_KEYS = {"input_ids", "attention_mask", "mm_token_type_ids", "token_type_ids"}


def expand_images(
    processor: Any, prompt_ids: Sequence[int] | np.ndarray, images: Sequence[np.ndarray]
) -> dict[str, Tensor]:
    """The HF forward's inputs for `prompt_ids` [P] holding one `processor.image_token` id per image of `images`
    ([H0, W0, 3] uint8 each, in order): input_ids [1, L] int64 with each placeholder replaced by the processor's
    ids for its image, image_slots [1, L] bool (the positions the images' features fill: the image token ids the
    expansion put there, never one the prompt held beside them), and (with images) the images' inputs in the
    model's own layout (`join_images`): pixel_values [1, N, 3, H, W] float32 and pixel_attention_mask [1, N, H, W]
    for Idefics3; pixel_values [patches, D] and image_grid_thw [n, 3] for Qwen-VL. Raises ValueError when the
    placeholders and the images do not pair up."""
    ids = np.asarray(prompt_ids, dtype=np.int64)  # [P]
    slots = np.flatnonzero(ids == processor.image_token_id)
    if len(slots) != len(images):
        raise ValueError(
            f"the prompt holds {len(slots)} image placeholders ({processor.image_token!r}, id "
            f"{processor.image_token_id}) but {len(images)} images came with it; each image needs "
            f"exactly one unexpanded placeholder where it goes"
        )
    pieces, fills, per_image = [], [], []
    start = 0
    for slot, image in zip(slots, images):
        # add_special_tokens=False: the image's own ids, without the BOS a tokenizer may put before any text
        enc = processor(
            text=processor.image_token, images=[np.asarray(image)], add_special_tokens=False, return_tensors="pt"
        )
        text, expanded = torch.from_numpy(ids[start:slot]), enc["input_ids"][0]
        pieces += [text, expanded]
        fills += [torch.zeros(len(text), dtype=torch.bool), expanded == processor.image_token_id]
        per_image.append({k: v for k, v in enc.items() if k not in TEXT_KEYS})  # this image's pixels (and grid)
        start = slot + 1
    pieces.append(torch.from_numpy(ids[start:]))
    fills.append(torch.zeros(len(ids) - start, dtype=torch.bool))
    out = {"input_ids": torch.cat(pieces)[None], "image_slots": torch.cat(fills)[None]}  # [1, L] each
    return out | join_images(per_image) if per_image else out


def join_images(parts: Sequence[dict[str, Tensor]]) -> dict[str, Tensor]:
    """Image inputs given in order (`expand_images`' per prompt, or its processor's per image) as one forward's:
    a grid model's (Qwen-VL: pixel_values [patches, D], image_grid_thw [n, 3]) joined along their first axis, a
    tiled model's (Idefics3: pixel_values [1, n, 3, H, W], pixel_attention_mask [1, n, H, W]) along the tiles'."""
    axis = 0 if "image_grid_thw" in parts[0] else 1
    return {k: torch.cat([p[k] for p in parts], dim=axis) for k in parts[0]}


def vl_response_logprobs(
    model: nn.Module,
    processor: Any,
    prompt_ids: Sequence[int] | np.ndarray,
    response_ids: Sequence[int] | np.ndarray,
    images: Sequence[np.ndarray],
) -> Tensor:
    """log pi(response_ids[t] | prompt, images, response_ids[:t]) for every t: [T] float32, from one forward of the
    plain HF model (e.g. Idefics3ForConditionalGeneration) on the expanded prompt followed by the response, the
    images' features put at the prompt's image slots only, as vLLM does (an image token in the response stays a
    token). The reference for the learner's batched path, and what an engine's log-probs of the same tokens must
    equal."""
    inputs = expand_images(processor, prompt_ids, images)
    device = next(model.parameters()).device
    response = torch.as_tensor(np.asarray(response_ids, dtype=np.int64), device=device)  # [T]
    ids = torch.cat([inputs.pop("input_ids").to(device), response[None]], dim=1)  # [1, L + T]
    slots = torch.cat(
        [inputs.pop("image_slots").to(device), torch.zeros_like(response, dtype=torch.bool)[None]], dim=1
    )  # [1, L + T]
    embeds = model.get_input_embeddings()(ids)  # [1, L + T, H]
    pixels = {k: v.to(device) for k, v in inputs.items()}
    if images:
        features = model.get_image_features(**pixels).pooler_output  # per image (Qwen-VL) or [N, tokens, H]
        features = torch.cat(list(features)) if isinstance(features, (tuple, list)) else features
        embeds = embeds.masked_scatter(slots[..., None], features.to(embeds.dtype))  # in order
    rope = _rope_module(model)
    positions = (
        None
        if rope is None
        else rope.get_rope_index(  # M-RoPE: [3, 1, L + T], the model's own
            ids, mm_token_type_ids=slots.int(), image_grid_thw=pixels.get("image_grid_thw")
        )[0]
    )
    n = response.shape[0]
    # The last T + 1 positions: the logits at position i predict token i + 1, so the last one predicts nothing.
    out = model(inputs_embeds=embeds, position_ids=positions, use_cache=False, logits_to_keep=n + 1)
    logits = out.logits[0, :-1].float()  # [T, V]
    return torch.log_softmax(logits, dim=-1).gather(-1, response[:, None])[:, 0]


def merge_at_slots(model: nn.Module) -> None:
    """Make `model`'s forward put the images' features at the positions `image_slots` names, and nowhere else
    (see the module docstring); without `image_slots` it merges as before. For the models that merge with an
    `inputs_merger` method (Idefics3, SmolVLM) or find the slots with `get_placeholder_mask` (Qwen-VL and most
    others in transformers); raises ValueError for any other. Call before sharding."""
    if (inner := _module_with(model, "inputs_merger")) is not None:
        plain_merger = inner.inputs_merger

        def merger(input_ids: Tensor, inputs_embeds: Tensor, image_hidden_states: Tensor) -> Tensor:
            if inner.image_slots is None:
                return plain_merger(
                    input_ids=input_ids, inputs_embeds=inputs_embeds, image_hidden_states=image_hidden_states
                )
            slots = inner.image_slots.to(inputs_embeds.device)[..., None]  # [B, L, 1]
            return inputs_embeds.masked_scatter(slots, image_hidden_states.to(inputs_embeds.dtype))

        inner.inputs_merger = merger
    elif (inner := _module_with(model, "get_placeholder_mask")) is not None:
        plain_mask = inner.get_placeholder_mask

        def placeholder_mask(
            input_ids: Tensor | None,
            inputs_embeds: Tensor,
            image_features: Tensor | None = None,
            video_features: Tensor | None = None,
        ) -> tuple[Tensor, Tensor]:
            if inner.image_slots is None or image_features is None:
                return plain_mask(
                    input_ids, inputs_embeds=inputs_embeds, image_features=image_features, video_features=video_features
                )
            image_mask, video_mask = plain_mask(input_ids, inputs_embeds=inputs_embeds, video_features=video_features)
            slots = inner.image_slots.to(image_mask.device)  # [B, L]
            if int(slots.sum()) * inputs_embeds.shape[-1] != image_features.numel():
                raise ValueError(
                    f"{int(slots.sum())} image slots for image features of shape "
                    f"{tuple(image_features.shape)}: the expanded prompt and its pixels disagree"
                )
            return slots.reshape(*slots.shape, *[1] * (image_mask.dim() - 2)).expand_as(image_mask), video_mask

        inner.get_placeholder_mask = placeholder_mask
    else:
        raise ValueError(
            f"{type(model).__name__}: the learner takes the vision-language models that merge images "
            f"with an inputs_merger (Idefics3, SmolVLM) or a get_placeholder_mask (Qwen-VL); this "
            f"one's merge is not supported yet"
        )
    inner.image_slots = None  # [B, L] bool while `image_slots` holds


@contextlib.contextmanager
def image_slots(model: nn.Module, slots: Tensor | None) -> Iterator[None]:
    """Inside the block, forwards of `model` (made by `merge_at_slots`) fill the positions `slots` [B, L] bool
    marks with the images' features, in order; None: as the model merges on its own."""
    inner = None if slots is None else next((m for m in model.modules() if hasattr(m, "image_slots")), None)
    if inner is None:  # a text micro-batch looks for nothing
        yield
        return
    inner.image_slots = slots
    try:
        yield
    finally:
        inner.image_slots = None


def mrope_position_ids(
    model: nn.Module,
    input_ids: Tensor,
    slots: Tensor | None,
    image_grid_thw: Tensor | None,
    attention_mask: Tensor | None,
    position_ids: Tensor | None,
) -> Tensor | None:
    """A micro-batch's position ids [4, B, L] for a model with multimodal RoPE (Qwen-VL: text positions, then the
    temporal, height and width ones), or None for any other model (it counts positions itself).

    Each sequence's M-RoPE positions are the model's own `get_rope_index` of that sequence alone, given its image
    slots and its images' grids; a packed row (`position_ids` [B, L] restarting at 0) holds several sequences, and
    the text positions in row 0 let transformers mask each one off from the others. Right-padded rows
    (`attention_mask`) count from 0 with padding at 0. A text-only sequence's positions are its text positions.
    `slots` [B, L] bool and `image_grid_thw` [N, 3] (the images in slot order) are None without images."""
    rope = None if getattr(model.config, "vision_config", None) is None else _rope_module(model)  # text: no scan
    if rope is None:
        return None
    text = position_ids if position_ids is not None else (attention_mask.cumsum(-1) - 1).clamp(min=0)  # [B, L]
    out = text[None].repeat(4, 1, 1)  # [4, B, L]
    if slots is None or image_grid_thw is None:
        return out
    grids = iter(image_grid_thw)
    for b in range(input_ids.shape[0]):
        starts = torch.nonzero(text[b] == 0).flatten().tolist() if position_ids is not None else [0]
        ends = starts[1:] + [int(attention_mask[b].sum()) if position_ids is None else input_ids.shape[1]]
        for s, e in zip(starts, ends):
            seg = slots[b, s:e]
            n_images = int((seg[1:] & ~seg[:-1]).sum()) + int(seg[:1].sum())  # runs of slots: one image each
            if n_images:
                grid = torch.stack([next(grids) for _ in range(n_images)])  # [n, 3]
                out[1:, b, s:e] = rope.get_rope_index(
                    input_ids[b : b + 1, s:e], mm_token_type_ids=seg[None].int(), image_grid_thw=grid
                )[0][:, 0]
    return out


def _module_with(model: nn.Module, method: str) -> nn.Module | None:
    """The first module of `model` whose class has `method`."""
    return next((m for m in model.modules() if hasattr(type(m), method)), None)


def _rope_module(model: nn.Module) -> nn.Module | None:
    """The module of a multimodal-RoPE model (Qwen-VL) that computes its position ids, or None."""
    return _module_with(model, "get_rope_index")
