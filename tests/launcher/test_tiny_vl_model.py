"""The tiny vision-language model directory (launcher/tiny_vl_model.py) loads in transformers, its processor expands an
image into the advertised number of tokens, and its chat template renders an image part as one `<image>`."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from launcher.tiny_vl_model import IMAGE_TOKEN, image_tokens, make_tiny_vl_model

TEXTS = ["<|im_start|>user\nwhat do you see?<|im_end|>\n<|im_start|>assistant\n<action>left</action><|im_end|>\n"] * 20


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_vl_model(tmp_path_factory.mktemp("vl") / "tiny-vl", texts=TEXTS)


def test_loads_in_transformers_and_runs_an_image(vl_dir: Path) -> None:
    from transformers import AutoModelForImageTextToText, AutoProcessor

    processor = AutoProcessor.from_pretrained(vl_dir)
    model = AutoModelForImageTextToText.from_pretrained(vl_dir)
    assert type(model).__name__ == "Idefics3ForConditionalGeneration" and model.dtype == torch.float32
    # The PIL image backend: the torchvision one cannot load on this machine (FACTS.md).
    assert type(processor.image_processor).__name__ == "Idefics3ImageProcessorPil"
    image = np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8)
    enc = processor(text=f"look: {IMAGE_TOKEN}", images=[image], return_tensors="pt")
    logits = model(**enc).logits  # [1, L, V]
    assert logits.shape[:2] == enc["input_ids"].shape and torch.isfinite(logits).all()


def test_processor_expands_one_image_into_image_tokens(vl_dir: Path) -> None:
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(vl_dir)
    tok = processor.tokenizer
    # (64 px / 8 px patches)^2 = 64 patches, pixel shuffle by 2 -> 64 / 4 = 16 image tokens.
    assert image_tokens(vl_dir) == 16
    image = np.full((40, 90, 3), 200, dtype=np.uint8)  # any size: resized to the one 64x64 tile
    ids = processor(text=IMAGE_TOKEN, images=[image], add_special_tokens=False)["input_ids"][0]
    around, glob, img = (
        tok.convert_tokens_to_ids(t) for t in ("<fake_token_around_image>", "<global-img>", IMAGE_TOKEN)
    )
    # Unsplit image: <fake_token_around_image> <global-img> <image> x 16 <fake_token_around_image>.
    assert ids == [around, glob] + [img] * 16 + [around]
    assert len(set(ids) | {tok.eos_token_id, tok.pad_token_id}) == 5  # each is a token of its own, none is eos/pad


def test_chat_template_renders_an_image_part_as_one_placeholder(vl_dir: Path) -> None:
    from transformers import AutoProcessor

    tok = AutoProcessor.from_pretrained(vl_dir).tokenizer
    messages = [
        {"role": "system", "content": "play"},
        {
            "role": "user",
            "content": [{"type": "text", "text": "board:"}, {"type": "image"}, {"type": "text", "text": "go"}],
        },
    ]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nplay<|im_end|>\n<|im_start|>user\nboard:<image>go<|im_end|>\n<|im_start|>assistant\n"
    )
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert ids.count(tok.convert_tokens_to_ids(IMAGE_TOKEN)) == 1
