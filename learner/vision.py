"""Images on the learner's side: the engine's prompt (one unexpanded image placeholder per image) made into the
inputs of a Hugging Face vision-language model (Idefics3/SmolVLM), and the log-probs of a response under it.

    processor = AutoProcessor.from_pretrained(model_dir)
    inputs = expand_images(processor, prompt_ids, images)        # input_ids, pixel_values, pixel_attention_mask
    logp = vl_response_logprobs(model, processor, prompt_ids, response_ids, images)   # [T]

The engine (vLLM) expands each placeholder with the model's own HF processor; here each one becomes exactly the
ids that processor gives for its image alone (`processor(text=<image>, images=[image])`), so the learner's
sequence is token for token the one the engine ran on. Pure functions: no state beyond their arguments.

Shapes: P = prompt ids (unexpanded), L = expanded prompt ids, N = image tiles of the prompt (one per image
without image splitting), H, W = a tile's pixels, T = response ids, V = vocabulary.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from learner.model import _logprob_and_entropy


def expand_images(processor: Any, prompt_ids: Sequence[int] | np.ndarray,
                  images: Sequence[np.ndarray]) -> dict[str, Tensor]:
    """The HF forward's inputs for `prompt_ids` [P] holding one `processor.image_token` id per image of `images`
    ([H0, W0, 3] uint8 each, in order): input_ids [1, L] int64 with each placeholder replaced by the processor's
    ids for its image, and (with images) pixel_values [1, N, 3, H, W] float32 and pixel_attention_mask [1, N, H, W].
    Raises ValueError when the placeholders and the images do not pair up."""
    ids = np.asarray(prompt_ids, dtype=np.int64)  # [P]
    slots = np.flatnonzero(ids == processor.image_token_id)
    if len(slots) != len(images):
        raise ValueError(f"the prompt holds {len(slots)} image placeholders ({processor.image_token!r}, id "
                         f"{processor.image_token_id}) but {len(images)} images came with it; each image needs "
                         f"exactly one unexpanded placeholder where it goes")
    pieces, pixels, masks = [], [], []
    start = 0
    for slot, image in zip(slots, images):
        # add_special_tokens=False: the image's own ids, without the BOS a tokenizer may put before any text
        enc = processor(text=processor.image_token, images=[np.asarray(image)], add_special_tokens=False,
                        return_tensors="pt")
        pieces += [torch.from_numpy(ids[start:slot]), enc["input_ids"][0]]
        pixels.append(enc["pixel_values"][0])  # [n, 3, H, W]: this image's tiles
        masks.append(enc["pixel_attention_mask"][0])  # [n, H, W]
        start = slot + 1
    pieces.append(torch.from_numpy(ids[start:]))
    out = {"input_ids": torch.cat(pieces)[None]}  # [1, L]
    if images:
        out["pixel_values"] = torch.cat(pixels)[None]  # [1, N, 3, H, W]
        out["pixel_attention_mask"] = torch.cat(masks)[None]  # [1, N, H, W]
    return out


def vl_response_logprobs(model: nn.Module, processor: Any, prompt_ids: Sequence[int] | np.ndarray,
                         response_ids: Sequence[int] | np.ndarray, images: Sequence[np.ndarray]) -> Tensor:
    """log pi(response_ids[t] | prompt, images, response_ids[:t]) for every t: [T] float32, from one forward of the
    HF model (e.g. Idefics3ForConditionalGeneration) on the expanded prompt followed by the response. The
    reference for the learner's batched path, and what an engine's log-probs of the same tokens must equal."""
    inputs = expand_images(processor, prompt_ids, images)
    device = next(model.parameters()).device
    response = torch.as_tensor(np.asarray(response_ids, dtype=np.int64), device=device)  # [T]
    ids = torch.cat([inputs.pop("input_ids").to(device), response[None]], dim=1)  # [1, L + T]
    n = response.shape[0]
    # The last T + 1 positions: the logits at position i predict token i + 1, so the last one predicts nothing.
    out = model(input_ids=ids, **{k: v.to(device) for k, v in inputs.items()}, use_cache=False,
                logits_to_keep=n + 1)
    logits = out.logits[0, :-1]  # [T, V]
    return _logprob_and_entropy(logits, response, entropy=False)[0]
