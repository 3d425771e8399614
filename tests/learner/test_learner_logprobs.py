"""Chunked log-probs (`learner.logprob_chunk_tokens`): the same values, entropies and gradients as computing
every response position's logits at once. Under FSDP2 on two ranks: tests/learner/test_learner_train.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from learner_testing import make_batch

from learner.batching import Sequences, make_micro_batches
from learner.model import token_logprobs


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("packing", [False, True])
def test_chunked_logprobs_entropy_and_gradients_equal_the_full_computation(tiny_model_dir, packing):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    batch = make_batch(0, 0, np.random.default_rng(7), n_groups=2, group_size=3, vocab=model.config.vocab_size)
    seqs = Sequences.from_batch(batch)
    mbs = make_micro_batches(seqs, torch.zeros(seqs.num_transitions), token_budget=96, packing=packing)
    weights = torch.randn(seqs.num_response_tokens, generator=torch.Generator().manual_seed(0))
    for mb in mbs:
        q = int(mb.targets.numel())
        results = {}
        # 1: every row its own chunk; 3: chunks that do not divide Q; q + 10: one chunk; 0: no chunking
        for chunk in (0, 1, 3, q + 10):
            model.zero_grad()
            logp, ent = token_logprobs(model, mb, chunk, entropy=True)
            assert logp.shape == ent.shape == (q,)
            w = weights[mb.token_index]
            ((logp * w).sum() + 0.5 * (ent * w).sum()).backward()  # weighted: every position's gradient counts
            results[chunk] = logp.detach(), ent.detach(), _grads(model)
        full_logp, full_ent, full_grads = results[0]
        assert bool((full_logp < 0).all()) and bool((full_ent > 0).all())
        for chunk in (1, 3, q + 10):
            logp, ent, grads = results[chunk]
            torch.testing.assert_close(logp, full_logp, atol=1e-5, rtol=0)
            torch.testing.assert_close(ent, full_ent, atol=1e-5, rtol=0)
            assert grads.keys() == full_grads.keys()
            for name, g in grads.items():
                torch.testing.assert_close(g, full_grads[name], atol=1e-5, rtol=1e-4, msg=name)
        with torch.no_grad():  # the reference/no-grad path (no recomputation) gives the same values
            logp, ent = token_logprobs(model, mb, 3)
        assert ent is None
        torch.testing.assert_close(logp, full_logp, atol=1e-5, rtol=0)


def test_chunked_logprobs_refuse_a_model_that_transforms_its_logits(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    batch = make_batch(0, 0, np.random.default_rng(8), n_groups=1, vocab=model.config.vocab_size)
    seqs = Sequences.from_batch(batch)
    (mb,) = make_micro_batches(seqs, torch.zeros(seqs.num_transitions), token_budget=10**6)
    model.config.final_logit_softcapping = 30.0  # as Gemma 2 has: the output layer alone is not the logits
    with pytest.raises(ValueError, match="logprob_chunk_tokens=0"):
        token_logprobs(model, mb, 4)
    token_logprobs(model, mb, 0)  # the unchunked path runs the model's own forward, softcapping included
