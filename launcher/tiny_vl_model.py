"""Make a tiny vision-language model directory locally, in seconds: no download.

An Idefics3ForConditionalGeneration (SmolVLM's architecture, the one VL model vLLM-CPU serves without torchvision;
FACTS.md): the text part is the tiny text model's shape (`launcher.tiny_model`: hidden 128, 2 layers, head_dim 32,
its BPE tokenizer) as a Llama (vLLM's Idefics3 builds a LlamaModel whatever the text config says), untied LM head;
a SigLIP-style vision tower on 64x64 images in 8x8 patches (64 patches, hidden 64, 2 heads of 32); pixel shuffle
by 2, so one image is `IMAGE_TOKENS` (16) `<image>` tokens in the model's input. No image splitting: every image is
resized to 64x64 and is one tile. The processor uses transformers' PIL image backend (no torchvision).

    python scripts/make_tiny_model.py --vl --out .cache/tiny-vl-model

The chat template takes the HF multimodal message format: `content` a string or a list of parts
{"type": "text", "text": ...} / {"type": "image"}; each image part renders as one unexpanded `<image>` token (the
engine and `learner.vision.expand_images` expand it), in the tiny text model's ChatML shape.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Iterable
from pathlib import Path

from launcher.tiny_model import make_tiny_model, save_tiny

IMAGE_SIZE = 64  # pixels per side of the one tile an image becomes
PATCH_SIZE = 8
SCALE_FACTOR = 2  # pixel shuffle: SCALE_FACTOR**2 patches -> one token
IMAGE_TOKENS = (IMAGE_SIZE // PATCH_SIZE) ** 2 // SCALE_FACTOR**2
IMAGE_TOKEN = "<image>"
# Idefics3Processor's own tokens (it adds the first three to any tokenizer it is given: saved here, so that the
# vocabulary is the same however the directory is loaded) and the global-image tag of an unsplit image.
VL_TOKENS = ["<fake_token_around_image>", IMAGE_TOKEN, "<end_of_utterance>", "<global-img>"]

VL_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ '<image>' }}{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def make_tiny_vl_model(out: str | Path, seed: int = 0, texts: Iterable[str] | None = None) -> Path:
    """Write a tiny random Idefics3 model, its tokenizer and processor into `out` (created; overwritten if present);
    `texts`: what the tokenizer is trained on (default: the envs' own text, as `make_tiny_model`)."""
    import torch
    from transformers import (
        AutoTokenizer,
        Idefics3Config,
        Idefics3ForConditionalGeneration,
        Idefics3ImageProcessorPil,
        Idefics3Processor,
        Qwen2Config,
    )

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:  # the text model's tokenizer and shape, made as it makes them
        text_dir = make_tiny_model(Path(tmp) / "text", texts=texts, seed=seed)
        tokenizer = AutoTokenizer.from_pretrained(text_dir)
        text = Qwen2Config.from_pretrained(text_dir)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", *VL_TOKENS]})
    tokenizer.chat_template = VL_CHAT_TEMPLATE
    image_processor = Idefics3ImageProcessorPil(
        do_image_splitting=False, size={"longest_edge": IMAGE_SIZE}, max_image_size={"longest_edge": IMAGE_SIZE}
    )
    processor = Idefics3Processor(
        image_processor, tokenizer, image_seq_len=IMAGE_TOKENS, chat_template=VL_CHAT_TEMPLATE
    )
    processor.save_pretrained(out)  # the tokenizer too

    n_vocab = len(tokenizer)
    pad_id, eos_id = tokenizer.pad_token_id, tokenizer.eos_token_id
    text_config = dict(
        model_type="llama",
        vocab_size=(n_vocab + 63) // 64 * 64,
        hidden_size=text.hidden_size,
        intermediate_size=text.intermediate_size,
        num_hidden_layers=text.num_hidden_layers,
        num_attention_heads=text.num_attention_heads,
        num_key_value_heads=text.num_key_value_heads,
        head_dim=text.hidden_size // text.num_attention_heads,
        max_position_embeddings=text.max_position_embeddings,
        rms_norm_eps=text.rms_norm_eps,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        bos_token_id=pad_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
    )
    vision_config = dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=IMAGE_SIZE,
        patch_size=PATCH_SIZE,
    )
    config = Idefics3Config(
        text_config=text_config,
        vision_config=vision_config,
        scale_factor=SCALE_FACTOR,
        image_token_id=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN),
        pad_token_id=pad_id,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    return save_tiny(Idefics3ForConditionalGeneration(config), out, eos_id, pad_id, __name__, seed)


def image_tokens(model_dir: str | Path) -> int:
    """`<image>` tokens one image becomes in `model_dir`'s input (unsplit: one tile), from its processor's config."""
    config = json.loads((Path(model_dir) / "processor_config.json").read_text())
    return int(config["image_seq_len"])
