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


def expand_images(processor: Any, prompt_ids: Sequence[int] | np.ndarray,
                  images: Sequence[np.ndarray]) -> dict[str, Tensor]:
    """The HF forward's inputs for `prompt_ids` [P] holding one `processor.image_token` id per image of `images`
    ([H0, W0, 3] uint8 each, in order): input_ids [1, L] int64 with each placeholder replaced by the processor's
    ids for its image, image_slots [1, L] bool (the positions the images' features fill: the image token ids the
    expansion put there, never one the prompt held beside them), and (with images) pixel_values [1, N, 3, H, W]
    float32 and pixel_attention_mask [1, N, H, W]. Raises ValueError when the placeholders and the images do not
    pair up."""
    ids = np.asarray(prompt_ids, dtype=np.int64)  # [P]
    slots = np.flatnonzero(ids == processor.image_token_id)
    if len(slots) != len(images):
        raise ValueError(f"the prompt holds {len(slots)} image placeholders ({processor.image_token!r}, id "
                         f"{processor.image_token_id}) but {len(images)} images came with it; each image needs "
                         f"exactly one unexpanded placeholder where it goes")
    pieces, fills, pixels, masks = [], [], [], []
    start = 0
    for slot, image in zip(slots, images):
        # add_special_tokens=False: the image's own ids, without the BOS a tokenizer may put before any text
        enc = processor(text=processor.image_token, images=[np.asarray(image)], add_special_tokens=False,
                        return_tensors="pt")
        text, expanded = torch.from_numpy(ids[start:slot]), enc["input_ids"][0]
        pieces += [text, expanded]
        fills += [torch.zeros(len(text), dtype=torch.bool), expanded == processor.image_token_id]
        pixels.append(enc["pixel_values"][0])  # [n, 3, H, W]: this image's tiles
        masks.append(enc["pixel_attention_mask"][0])  # [n, H, W]
        start = slot + 1
    pieces.append(torch.from_numpy(ids[start:]))
    fills.append(torch.zeros(len(ids) - start, dtype=torch.bool))
    out = {"input_ids": torch.cat(pieces)[None], "image_slots": torch.cat(fills)[None]}  # [1, L] each
    if images:
        out["pixel_values"] = torch.cat(pixels)[None]  # [1, N, 3, H, W]
        out["pixel_attention_mask"] = torch.cat(masks)[None]  # [1, N, H, W]
    return out


def vl_response_logprobs(model: nn.Module, processor: Any, prompt_ids: Sequence[int] | np.ndarray,
                         response_ids: Sequence[int] | np.ndarray, images: Sequence[np.ndarray]) -> Tensor:
    """log pi(response_ids[t] | prompt, images, response_ids[:t]) for every t: [T] float32, from one forward of the
    plain HF model (e.g. Idefics3ForConditionalGeneration) on the expanded prompt followed by the response, the
    images' features put at the prompt's image slots only, as vLLM does (an image token in the response stays a
    token). The reference for the learner's batched path, and what an engine's log-probs of the same tokens must
    equal."""
    inputs = expand_images(processor, prompt_ids, images)
    device = next(model.parameters()).device
    response = torch.as_tensor(np.asarray(response_ids, dtype=np.int64), device=device)  # [T]
    ids = torch.cat([inputs.pop("input_ids").to(device), response[None]], dim=1)  # [1, L + T]
    slots = torch.cat([inputs.pop("image_slots").to(device), torch.zeros_like(response, dtype=torch.bool)[None]],
                      dim=1)  # [1, L + T]
    embeds = model.get_input_embeddings()(ids)  # [1, L + T, H]
    if images:
        features = model.get_image_features(**{k: v.to(device) for k, v in inputs.items()}).pooler_output
        embeds = embeds.masked_scatter(slots[..., None], features.to(embeds.dtype))  # [N, tokens, H] in order
    n = response.shape[0]
    # The last T + 1 positions: the logits at position i predict token i + 1, so the last one predicts nothing.
    logits = model(inputs_embeds=embeds, use_cache=False, logits_to_keep=n + 1).logits[0, :-1].float()  # [T, V]
    return torch.log_softmax(logits, dim=-1).gather(-1, response[:, None])[:, 0]


def merge_at_slots(model: nn.Module) -> None:
    """Make `model`'s forward put the images' features at the positions `image_slots` names, and nowhere else
    (see the module docstring); without `image_slots` it merges as before. For the models that merge with an
    `inputs_merger` method (Idefics3, SmolVLM); raises ValueError for any other. Call before sharding."""
    inner = next((m for m in model.modules() if hasattr(type(m), "inputs_merger")), None)
    if inner is None:
        raise ValueError(f"{type(model).__name__}: the learner takes the vision-language models that merge images "
                         f"with an inputs_merger (Idefics3, SmolVLM); this one's merge is not supported yet")
    plain = inner.inputs_merger
    inner.image_slots = None  # [B, L] bool while `image_slots` holds

    def merger(input_ids: Tensor, inputs_embeds: Tensor, image_hidden_states: Tensor) -> Tensor:
        if inner.image_slots is None:
            return plain(input_ids=input_ids, inputs_embeds=inputs_embeds, image_hidden_states=image_hidden_states)
        slots = inner.image_slots.to(inputs_embeds.device)[..., None]  # [B, L, 1]
        return inputs_embeds.masked_scatter(slots, image_hidden_states.to(inputs_embeds.dtype))

    inner.inputs_merger = merger


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
