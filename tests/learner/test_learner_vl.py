"""The learner's policy for a vision-language model (the tiny Idefics3 of launcher/tiny_vl_model.py, and a tiny
Qwen2.5-VL: multimodal RoPE, flat patches) under FSDP2: it loads as an image-text-to-text model with its vision
side frozen (or trained, on request), shards only the language model's layers, and its log-probs of a batch's
responses given their images are the plain HF model's, a response that holds the image token included (vLLM
embeds it as a token; HF alone would take it for a slot)."""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import pytest
import torch
from qwen_vl_testing import make_tiny_qwen_vl
from torch.distributed.fsdp import FSDPModule

from agentstream.wire.messages import Batch, Transition, image_columns
from learner.batching import Sequences, make_micro_batches
from learner.model import load_policy, token_logprobs, trainable_parameters, vocab_size
from learner.vision import expand_images, vl_response_logprobs

TEXTS = [f"<|im_start|>user\nstep {i}: go left or right?<|im_end|>\n<action>left</action>" for i in range(30)]


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from launcher.tiny_vl_model import make_tiny_vl_model

    return make_tiny_vl_model(tmp_path_factory.mktemp("vl") / "tiny-vl", texts=TEXTS)


@pytest.fixture(scope="module")
def qwen_vl(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, object]:
    return make_tiny_qwen_vl(tmp_path_factory.mktemp("qwen-vl") / "tiny-qwen-vl", texts=TEXTS)


@pytest.fixture(params=["idefics3", "qwen2.5-vl"])
def family(request: pytest.FixtureRequest) -> tuple[Path, object]:
    """A tiny VL model directory and its processor, of each family the learner takes."""
    if request.param == "idefics3":
        from transformers import AutoProcessor

        vl_dir = request.getfixturevalue("vl_dir")
        return vl_dir, AutoProcessor.from_pretrained(vl_dir)
    return request.getfixturevalue("qwen_vl")


@pytest.mark.parametrize("train_vision", [False, True])
def test_the_vision_side_is_frozen_unless_asked_and_only_language_layers_are_sharded(
    vl_dir, one_rank, train_vision
) -> None:
    model = load_policy(str(vl_dir), "float32", torch.device("cpu"), 1, train_vision=train_vision)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    vision = {n for n, _ in model.named_parameters() if n.startswith(("model.vision_model.", "model.connector."))}
    assert vision and not vision & trainable if not train_vision else vision <= trainable
    assert trainable | vision == {n for n, _ in model.named_parameters()}  # the language model always trains
    assert len(trainable_parameters(model)) == len(trainable)
    sharded = [type(m).__name__ for m in model.modules() if isinstance(m, FSDPModule) and m is not model]
    assert sharded == ["FSDPLlamaDecoderLayer"] * 2  # one by one: the language model's layers, no vision block
    assert vocab_size(model) == model.get_output_embeddings().weight.shape[0] == model.config.text_config.vocab_size


Case = tuple[list[int], np.ndarray, list[int]]  # prompt ids, its pictures [n, H, W, 3], response ids


def batch_of(cases: list[Case]) -> Batch:
    """A broker batch of one transition per case, its pictures on the wire's image columns."""
    ts = [
        Transition(
            traj_id="t",
            group_id=0,
            actor="a",
            step=0,
            prompt_ids=np.array(p, np.int32),
            response_ids=np.array(r, np.int32),
            logprobs=np.zeros(len(r), np.float32),
            version_lo=0,
            version_hi=0,
            reward=0.0,
            done=True,
            truncated=False,
            valid=True,
            images=im,
        )
        for p, im, r in cases
    ]
    shapes, data = image_columns(ts)
    n = len(ts)
    return Batch(
        step=0,
        rank=0,
        learner_version=0,
        group_size=n,
        group_index=np.zeros(n, np.int32),
        traj_index=np.arange(n, dtype=np.int32),
        step_index=np.zeros(n, np.int32),
        prompt_lens=np.array([len(p) for p, _, _ in cases], np.int32),
        response_lens=np.array([len(r) for _, _, r in cases], np.int32),
        rewards=np.zeros(n, np.float32),
        dones=np.ones(n, bool),
        valid=np.ones(n, bool),
        version_lo=np.zeros(n, np.int32),
        version_hi=np.zeros(n, np.int32),
        prompt_ids=np.concatenate([p for p, _, _ in cases]).astype(np.int32),
        response_ids=np.concatenate([r for _, _, r in cases]).astype(np.int32),
        logprobs=np.zeros(sum(len(r) for _, _, r in cases), np.float32),
        image_shapes=shapes,
        image_data=data,
    )


def learner_logprobs(policy, processor, cases: list[Case], packing: bool) -> torch.Tensor:
    """The learner's log-probs of every response token of `cases` [R], in one micro-batch: Sequences.from_batch
    expands the images, make_micro_batches pads (or packs) them, token_logprobs runs the sharded policy."""
    seqs = Sequences.from_batch(batch_of(cases), functools.partial(expand_images, processor))
    mbs = make_micro_batches(seqs, torch.zeros(len(cases)), 4096, packing=packing)
    pixels = mbs[0].pixels
    n_images = len(pixels["image_grid_thw"]) if "image_grid_thw" in pixels else pixels["pixel_values"].shape[1]
    assert len(mbs) == 1 and n_images == sum(len(im) for _, im, _ in cases)
    got = torch.zeros(seqs.num_response_tokens)
    with torch.no_grad():
        got[mbs[0].token_index] = token_logprobs(policy, mbs[0])[0]
    return got


def reference(plain, processor, cases: list[Case]) -> torch.Tensor:
    with torch.no_grad():
        return torch.cat([vl_response_logprobs(plain, processor, p, r, list(im)) for p, im, r in cases])


def prompt_of(tok, n_images: int, text: str) -> list[int]:
    content = [{"type": "image"}] * n_images + [{"type": "text", "text": text}]
    return tok.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=True, return_dict=False
    )


def test_sharded_log_probs_with_two_images_are_the_hf_models(vl_dir, one_rank) -> None:
    from transformers import AutoModelForImageTextToText, AutoProcessor

    processor = AutoProcessor.from_pretrained(vl_dir)
    plain = AutoModelForImageTextToText.from_pretrained(vl_dir, dtype=torch.float32).eval()
    policy = load_policy(str(vl_dir), "float32", torch.device("cpu"), 1)
    rng = np.random.default_rng(0)
    images = np.stack([rng.integers(0, 256, (64, 64, 3), dtype=np.uint8) for _ in range(2)])
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "image"},
                {"type": "text", "text": "then "},
                {"type": "image"},
                {"type": "text", "text": "go?"},
            ],
        }
    ]
    prompt = processor.tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    response = processor.tokenizer("<action>left</action>", add_special_tokens=False)["input_ids"]
    want = reference(plain, processor, [(prompt, images, response)])
    got = learner_logprobs(policy, processor, [(prompt, images, response)], packing=False)
    swapped = learner_logprobs(policy, processor, [(prompt, images[::-1].copy(), response)], packing=False)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    assert (swapped - want).abs().max() > 1e-4  # the images' order reaches the sharded model


@pytest.mark.parametrize("packing", [False, True])
def test_a_batch_with_images_gives_each_response_its_own_images_log_probs(family, one_rank, packing) -> None:
    """Three transitions (two pictures, none, one) through Sequences.from_batch and the micro-batches, padded or
    packed: every response token's log-prob is the one the plain HF model gives that transition alone."""
    from transformers import AutoModelForImageTextToText

    vl_dir, processor = family
    plain = AutoModelForImageTextToText.from_pretrained(vl_dir, dtype=torch.float32).eval()
    policy = load_policy(str(vl_dir), "float32", torch.device("cpu"), 1)
    tok = processor.tokenizer
    rng = np.random.default_rng(1)
    responses = [tok(r, add_special_tokens=False)["input_ids"] for r in ("<action>left</action>", "go", "right")]
    cases = [
        (prompt_of(tok, 2, "left?"), rng.integers(0, 256, (2, 32, 48, 3), dtype=np.uint8), responses[0]),
        (prompt_of(tok, 0, "no picture here"), np.zeros((0, 0, 0, 0), np.uint8), responses[1]),
        (prompt_of(tok, 1, "right?"), rng.integers(0, 256, (1, 64, 64, 3), dtype=np.uint8), responses[2]),
    ]
    with pytest.raises(ValueError, match="holds images but the policy is not a vision-language model"):
        Sequences.from_batch(batch_of(cases))
    torch.testing.assert_close(
        learner_logprobs(policy, processor, cases, packing), reference(plain, processor, cases), atol=1e-5, rtol=0
    )


@pytest.mark.parametrize("packing", [False, True])
def test_an_image_token_in_a_response_stays_a_token(family, one_rank, packing) -> None:
    """The random policy samples its own image token now and then. The engine embeds it as a token; the learner
    must too: only the prompt's slots take the pictures' features. Plain HF, given the pixels, takes every image
    token for a slot and fails; the learner's log-probs equal the reference, which scatters at the slots."""
    from transformers import AutoModelForImageTextToText

    vl_dir, processor = family
    plain = AutoModelForImageTextToText.from_pretrained(vl_dir, dtype=torch.float32).eval()
    policy = load_policy(str(vl_dir), "float32", torch.device("cpu"), 1)
    tok, image_id = processor.tokenizer, processor.image_token_id
    rng = np.random.default_rng(2)
    action = tok("<action>up</action>", add_special_tokens=False)["input_ids"]
    cases = [
        (
            prompt_of(tok, 1, "where?"),
            rng.integers(0, 256, (1, 64, 64, 3), dtype=np.uint8),
            [image_id] + action + [image_id, image_id],
        ),
        (prompt_of(tok, 2, "and now?"), rng.integers(0, 256, (2, 40, 40, 3), dtype=np.uint8), action),
    ]
    inputs = expand_images(processor, cases[0][0], list(cases[0][1]))
    ids = torch.cat([inputs.pop("input_ids"), torch.tensor([cases[0][2]])], dim=1)
    mm_types = torch.cat([inputs.pop("image_slots"), torch.zeros(1, len(cases[0][2]), dtype=torch.bool)], 1).int()
    extra = {"mm_token_type_ids": mm_types} if "image_grid_thw" in inputs else {}  # Qwen-VL's M-RoPE reads it
    # the plain merge: more slots than features (Idefics3: a failed masked_scatter; Qwen-VL: its own count check)
    with pytest.raises((RuntimeError, ValueError), match="source|do not match"), torch.no_grad():
        plain(input_ids=ids, **inputs, **extra, use_cache=False)
    want = reference(plain, processor, cases)
    got = learner_logprobs(policy, processor, cases, packing)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_the_reference_is_the_hf_models_own_forward(family) -> None:
    """Without an image token in the response, the reference (features scattered at the slots, Qwen-VL's positions
    from its get_rope_index) equals the plain HF forward given input_ids and pixels, which merges and positions on
    its own (Qwen-VL from mm_token_type_ids); and the pictures' order reaches it."""
    from transformers import AutoModelForImageTextToText

    vl_dir, processor = family
    plain = AutoModelForImageTextToText.from_pretrained(vl_dir, dtype=torch.float32).eval()
    tok = processor.tokenizer
    rng = np.random.default_rng(3)
    images = [rng.integers(0, 256, (56, 84, 3), dtype=np.uint8), rng.integers(0, 256, (40, 30, 3), dtype=np.uint8)]
    prompt = prompt_of(tok, 2, "which way?")
    response = tok("<action>down</action>", add_special_tokens=False)["input_ids"]
    inputs = expand_images(processor, prompt, images)
    ids = torch.cat([inputs.pop("input_ids"), torch.tensor([response])], dim=1)  # [1, L + T]
    mm_types = torch.cat([inputs.pop("image_slots"), torch.zeros(1, len(response), dtype=torch.bool)], 1).int()
    extra = {"mm_token_type_ids": mm_types} if "image_grid_thw" in inputs else {}
    with torch.no_grad():
        logits = plain(input_ids=ids, **inputs, **extra, use_cache=False).logits[0, -len(response) - 1 : -1]  # [T, V]
        want = torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(response)[:, None])[:, 0]
        got = vl_response_logprobs(plain, processor, prompt, response, images)
        swapped = vl_response_logprobs(plain, processor, prompt, response, images[::-1])
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    assert (swapped - want).abs().max() > 1e-4


def test_lora_adapts_the_language_model_only(family, one_rank) -> None:
    """Both towers have layers named like the language model's (Idefics3's q_proj..; Qwen2.5-VL's gate_proj..);
    the adapter goes on the language model's alone, the engine's LoRA covers no more. Training the adapter moves
    the log-probs given a picture; the vision side's weights stay as loaded."""
    from learner.model import LoraSpec

    vl_dir, processor = family
    targets = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    policy = load_policy(str(vl_dir), "float32", torch.device("cpu"), 1, lora=LoraSpec(8, 16.0, targets))
    trainable = [n for n, p in policy.named_parameters() if p.requires_grad]
    layers = policy.config.get_text_config().num_hidden_layers
    assert len(trainable) == 2 * 7 * layers and all("lora_" in n for n in trainable)
    assert all(".language_model." in n or ".text_model." in n for n in trainable), trainable
    rng = np.random.default_rng(4)
    tok = processor.tokenizer
    cases = [
        (
            prompt_of(tok, 1, "where?"),
            rng.integers(0, 256, (1, 56, 56, 3), dtype=np.uint8),
            tok("<action>up</action>", add_special_tokens=False)["input_ids"],
        )
    ]
    before = learner_logprobs(policy, processor, cases, packing=False)
    tower = {n: p.detach().clone() for n, p in policy.named_parameters() if "visual" in n or "vision_model" in n}
    opt = torch.optim.AdamW(trainable_parameters(policy), lr=1e-2)
    seqs = Sequences.from_batch(batch_of(cases), functools.partial(expand_images, processor))
    mb = make_micro_batches(seqs, torch.zeros(1), 4096, packing=False)[0]
    (-token_logprobs(policy, mb)[0].mean()).backward()
    opt.step()
    assert (learner_logprobs(policy, processor, cases, packing=False) - before).abs().max() > 1e-3
    assert tower and all(torch.equal(p.detach(), tower[n]) for n, p in policy.named_parameters() if n in tower)
