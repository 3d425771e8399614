"""The learner's policy for a vision-language model (the tiny Idefics3 of launcher/tiny_vl_model.py) under FSDP2:
it loads as an image-text-to-text model with its vision side frozen (or trained, on request), shards only the
language model's layers, and its log-probs of a response given an image are the plain HF model's."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from torch.distributed.fsdp import FSDPModule

from learner.model import load_policy, trainable_parameters, vocab_size
from learner.vision import vl_response_logprobs

TEXTS = [f"<|im_start|>user\nstep {i}: go left or right?<|im_end|>\n<action>left</action>" for i in range(30)]


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from launcher.tiny_vl_model import make_tiny_vl_model

    return make_tiny_vl_model(tmp_path_factory.mktemp("vl") / "tiny-vl", texts=TEXTS)


@pytest.mark.parametrize("train_vision", [False, True])
def test_the_vision_side_is_frozen_unless_asked_and_only_language_layers_are_sharded(vl_dir, one_rank,
                                                                                     train_vision) -> None:
    model = load_policy(str(vl_dir), "float32", torch.device("cpu"), 1, train_vision=train_vision)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    vision = {n for n, _ in model.named_parameters() if n.startswith(("model.vision_model.", "model.connector."))}
    assert vision and not vision & trainable if not train_vision else vision <= trainable
    assert trainable | vision == {n for n, _ in model.named_parameters()}  # the language model always trains
    assert len(trainable_parameters(model)) == len(trainable)
    sharded = [type(m).__name__ for m in model.modules() if isinstance(m, FSDPModule) and m is not model]
    assert sharded == ["FSDPLlamaDecoderLayer"] * 2  # one by one: the language model's layers, no vision block
    assert vocab_size(model) == model.get_output_embeddings().weight.shape[0] == model.config.text_config.vocab_size


def test_sharded_log_probs_with_an_image_are_the_hf_models(vl_dir, one_rank) -> None:
    from transformers import AutoModelForImageTextToText, AutoProcessor

    processor = AutoProcessor.from_pretrained(vl_dir)
    plain = AutoModelForImageTextToText.from_pretrained(vl_dir, dtype=torch.float32).eval()
    policy = load_policy(str(vl_dir), "float32", torch.device("cpu"), 1)
    rng = np.random.default_rng(0)
    images = [rng.integers(0, 256, (40, 56, 3), dtype=np.uint8), rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)]
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "then "},
                                             {"type": "image"}, {"type": "text", "text": "go?"}]}]
    prompt = processor.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                     return_dict=False)
    response = processor.tokenizer("<action>left</action>", add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        want = vl_response_logprobs(plain, processor, prompt, response, images)
        got = vl_response_logprobs(policy, processor, prompt, response, images)
        swapped = vl_response_logprobs(policy, processor, prompt, response, images[::-1])
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    assert (swapped - want).abs().max() > 1e-4  # the images' order reaches the sharded model
