"""LoRA under FSDP2 (one gloo rank in this process): the adapter-disabled model is the base model exactly,
only the adapter trains, and the published adapter, loaded by plain peft, computes what the learner does."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from learner_testing import make_batch

from learner.batching import Sequences, make_micro_batches
from learner.model import (
    LoraSpec,
    adapter_config,
    adapter_state_dict,
    disabled_adapter,
    load_policy,
    response_logprobs,
    trainable_parameters,
)

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def full(p: torch.Tensor) -> torch.Tensor:
    """A parameter's whole value (FSDP2 leaves the root's parameters unsharded after a forward)."""
    return (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()


def micro_batches(vocab: int, seed: int = 0):
    batch = make_batch(0, 0, np.random.default_rng(seed), n_groups=2, group_size=2, vocab=vocab)
    seqs = Sequences.from_batch(batch)
    return seqs, make_micro_batches(seqs, torch.ones(seqs.num_transitions), token_budget=256)


def all_logprobs(model, seqs, mbs, chunk_tokens: int = 0) -> torch.Tensor:
    out = torch.empty(seqs.num_response_tokens)  # [R]
    with torch.no_grad():
        for mb in mbs:
            out[mb.token_index] = response_logprobs(model, mb, chunk_tokens)
    return out


def train_adapter(model, seqs, mbs, steps: int = 2, lr: float = 2e-2) -> None:
    """A few steps of maximising the batch's log-likelihood: enough to move the adapter far from B = 0."""
    opt = torch.optim.AdamW(trainable_parameters(model), lr=lr)
    for _ in range(steps):
        for mb in mbs:
            (-response_logprobs(model, mb).sum() / seqs.num_response_tokens).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def test_disabled_adapter_is_the_base_model_exactly(one_rank, tiny_model_dir: Path):
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    model = load_policy(str(tiny_model_dir), "float32", torch.device("cpu"), 1, lora=LoraSpec(8, 16.0, TARGETS))
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    assert names and all("lora_" in n for n in names)
    assert len(trainable_parameters(model)) == len(names) == 2 * len(TARGETS) * base.config.num_hidden_layers
    seqs, mbs = micro_batches(base.config.vocab_size)
    frozen_before = {n: full(p) for n, p in model.named_parameters() if not p.requires_grad}
    train_adapter(model, seqs, mbs)
    model.eval()
    expected = all_logprobs(base, seqs, mbs)
    with disabled_adapter(model):
        got = all_logprobs(model, seqs, mbs)
    assert torch.equal(got, expected)  # bitwise: the adapter is bypassed, not multiplied by zero
    # The check can fail: with the adapter on, the trained model is elsewhere.
    adapted = all_logprobs(model, seqs, mbs)
    assert float((adapted - expected).abs().max()) > 1e-2
    # learner.logprob_chunk_tokens through peft and FSDP2: the output layer found under the adapter, same values
    torch.testing.assert_close(all_logprobs(model, seqs, mbs, chunk_tokens=3), adapted, atol=1e-5, rtol=0)
    with disabled_adapter(model):
        torch.testing.assert_close(all_logprobs(model, seqs, mbs, chunk_tokens=3), expected, atol=1e-5, rtol=0)
    for n, p in model.named_parameters():
        if not p.requires_grad:
            assert torch.equal(full(p), frozen_before[n]), f"frozen {n} moved"


def test_published_adapter_loads_in_peft_and_matches(one_rank, tiny_model_dir: Path, tmp_path: Path):
    from peft import PeftModel
    from safetensors.torch import load
    from transformers import AutoModelForCausalLM

    from engines.control import write_adapter
    from learner.publish import serialize_adapter

    model = load_policy(str(tiny_model_dir), "float32", torch.device("cpu"), 1, lora=LoraSpec(8, 16.0, TARGETS))
    seqs, mbs = micro_batches(model.config.vocab_size, seed=1)
    train_adapter(model, seqs, mbs)
    model.eval()
    state = adapter_state_dict(model)
    # lora_ only: no tied lm_head.weight, no base weight, no peft adapter name ("default") in the keys
    assert state and all("lora_" in k and ".default." not in k for k in state)
    assert len(state) == 2 * len(TARGETS) * model.config.num_hidden_layers
    payload = serialize_adapter(state, adapter_config(model))
    folder = write_adapter(tmp_path, 1, payload)  # what the weight sidecar does with it
    assert sorted(p.name for p in folder.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    assert json.loads((folder / "adapter_config.json").read_text())["r"] == 8
    assert set(load((folder / "adapter_model.safetensors").read_bytes())) == set(state)

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    plain = PeftModel.from_pretrained(base, folder).eval()
    torch.testing.assert_close(all_logprobs(plain, seqs, mbs), all_logprobs(model, seqs, mbs), rtol=0, atol=1e-5)
    # ... and merged into plain weights (what an engine computes with the adapter applied)
    merged = plain.merge_and_unload()
    torch.testing.assert_close(all_logprobs(merged, seqs, mbs), all_logprobs(model, seqs, mbs), rtol=0, atol=1e-5)
