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


@pytest.mark.parametrize("packing", [False, True])
def test_a_batch_with_images_gives_each_response_its_own_images_log_probs(vl_dir, one_rank, packing) -> None:
    """Three transitions (two pictures, none, one) through Sequences.from_batch and the micro-batches, padded or
    packed: every response token's log-prob is the one `vl_response_logprobs` gives that transition alone."""
    import functools

    from transformers import AutoProcessor

    from agentstream.wire.messages import Batch, Transition, image_columns
    from learner.batching import Sequences, make_micro_batches
    from learner.model import token_logprobs
    from learner.vision import expand_images

    processor = AutoProcessor.from_pretrained(vl_dir)
    policy = load_policy(str(vl_dir), "float32", torch.device("cpu"), 1)
    tok = processor.tokenizer
    rng = np.random.default_rng(1)

    def prompt(n_images: int, text: str) -> list[int]:
        content = [{"type": "image"}] * n_images + [{"type": "text", "text": text}]
        return tok.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                       tokenize=True, return_dict=False)

    cases = [(prompt(2, "left?"), rng.integers(0, 256, (2, 32, 48, 3), dtype=np.uint8)),
             (prompt(0, "no picture here"), np.zeros((0, 0, 0, 0), np.uint8)),
             (prompt(1, "right?"), rng.integers(0, 256, (1, 64, 64, 3), dtype=np.uint8))]
    responses = [tok(r, add_special_tokens=False)["input_ids"] for r in ("<action>left</action>", "go", "right")]
    ts = [Transition(traj_id="t", group_id=0, actor="a", step=0, prompt_ids=np.array(p, np.int32),
                     response_ids=np.array(r, np.int32), logprobs=np.zeros(len(r), np.float32), version_lo=0,
                     version_hi=0, reward=0.0, done=True, truncated=False, valid=True, images=im)
          for (p, im), r in zip(cases, responses)]
    shapes, data = image_columns(ts)
    n = len(ts)
    batch = Batch(step=0, rank=0, learner_version=0, group_size=n, group_index=np.zeros(n, np.int32),
                  traj_index=np.arange(n, dtype=np.int32), step_index=np.zeros(n, np.int32),
                  prompt_lens=np.array([len(p) for p, _ in cases], np.int32),
                  response_lens=np.array([len(r) for r in responses], np.int32), rewards=np.zeros(n, np.float32),
                  dones=np.ones(n, bool), valid=np.ones(n, bool), version_lo=np.zeros(n, np.int32),
                  version_hi=np.zeros(n, np.int32), prompt_ids=np.concatenate([p for p, _ in cases]).astype(np.int32),
                  response_ids=np.concatenate(responses).astype(np.int32),
                  logprobs=np.zeros(sum(map(len, responses)), np.float32), image_shapes=shapes, image_data=data)
    with pytest.raises(ValueError, match="holds images but the policy is not a vision-language model"):
        Sequences.from_batch(batch)
    seqs = Sequences.from_batch(batch, functools.partial(expand_images, processor))
    mbs = make_micro_batches(seqs, torch.zeros(n), 4096, packing=packing)
    assert len(mbs) == 1 and mbs[0].pixels["pixel_values"].shape[:2] == (1, 3)  # 2 + 0 + 1 pictures, one forward
    with torch.no_grad():
        got = torch.zeros(seqs.num_response_tokens)
        got[mbs[0].token_index] = token_logprobs(policy, mbs[0])[0]
        want = torch.cat([vl_response_logprobs(policy, processor, p, r, list(im)) for (p, im), r in zip(cases, responses)])
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
