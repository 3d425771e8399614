"""Micro-batches: every response token exactly once; padded log-probs == a plain per-sequence forward."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from learner_testing import make_batch

from learner.batching import Sequences, dummy_micro_batch, make_micro_batches, plan_micro_batches
from learner.model import response_logprobs


def test_plan_respects_the_budget_and_places_everything_once():
    # longest first, budget 12 padded tokens (rows x longest): 12 -> [12]; 9: 2 x 12 > 12 -> [9];
    #   6: 2 x 9 > 12 -> [6]; 4: 2 x 6 = 12 -> [6, 4]; 3: 3 x 6 > 12 -> [3]; 2: 2 x 3 <= 12 -> [3, 2]
    #   so bins {12}, {9}, {6, 4}, {3, 2} (indices 2, 1, (4, 3), (0, 5))
    lengths = [3, 9, 12, 4, 6, 2]
    plan = plan_micro_batches(lengths, token_budget=12)
    assert sorted(map(tuple, plan)) == sorted([(2,), (1,), (3, 4), (0, 5)])


def test_micro_batches_cover_every_response_token_once():
    rng = np.random.default_rng(0)
    batch = make_batch(0, 0, rng, n_groups=3, group_size=3, max_steps=3)
    seqs = Sequences.from_batch(batch)
    adv = torch.arange(seqs.num_transitions, dtype=torch.float32)
    mbs = make_micro_batches(seqs, adv, token_budget=40)
    assert len(mbs) > 1
    covered = torch.cat([mb.token_index for mb in mbs])
    assert sorted(covered.tolist()) == list(range(seqs.num_response_tokens))
    resp = torch.from_numpy(batch.response_ids.astype(np.int64))
    owner = torch.repeat_interleave(torch.arange(seqs.num_transitions), seqs.response_lens)  # [R]
    for mb in mbs:
        rows, width = mb.input_ids.shape
        assert rows * width <= 40 or rows == 1  # the padded budget, or one over-long sequence alone
        assert torch.equal(mb.targets, resp[mb.token_index])
        assert torch.equal(mb.input_ids[mb.logit_rows, mb.logit_pos + 1], mb.targets)  # logits at p predict p+1
        assert bool(mb.attention_mask[mb.logit_rows, mb.logit_pos + 1].all())
        assert torch.equal(mb.advantages, adv[owner[mb.token_index]])
        assert torch.equal(mb.behav_logp, torch.from_numpy(batch.logprobs)[mb.token_index])


def test_empty_responses_are_skipped_and_bad_lengths_rejected():
    rng = np.random.default_rng(1)
    batch = make_batch(0, 0, rng)
    lens = batch.response_lens.copy()
    with pytest.raises(ValueError, match="response_ids holds"):
        Sequences.from_batch(type(batch)(**{**batch.__dict__, "response_lens": lens + 1}))
    dummy = dummy_micro_batch()
    assert dummy.num_tokens == 0 and dummy.input_ids.shape == (1, 2)


def test_padded_logprobs_equal_a_plain_forward(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    rng = np.random.default_rng(2)
    batch = make_batch(0, 0, rng, n_groups=2, group_size=3, vocab=model.config.vocab_size)
    seqs = Sequences.from_batch(batch)
    mbs = make_micro_batches(seqs, torch.zeros(seqs.num_transitions), token_budget=64)
    assert any(mb.input_ids.shape[0] > 1 and not bool(mb.attention_mask.all()) for mb in mbs)  # padding happened
    padded = torch.empty(seqs.num_response_tokens)
    with torch.no_grad():
        for mb in mbs:
            padded[mb.token_index] = response_logprobs(model, mb)
        expected = []
        p_off = r_off = 0
        for p, r in zip(batch.prompt_lens.tolist(), batch.response_lens.tolist()):
            ids = torch.cat(
                [
                    torch.from_numpy(batch.prompt_ids[p_off : p_off + p]),
                    torch.from_numpy(batch.response_ids[r_off : r_off + r]),
                ]
            ).long()
            logits = model(ids[None]).logits[0].float()  # [P+T, V], one sequence alone
            logp = torch.log_softmax(logits[p - 1 : p + r - 1], -1)  # [T, V]
            expected.append(logp.gather(-1, ids[p:, None])[:, 0])
            p_off, r_off = p_off + p, r_off + r
    torch.testing.assert_close(padded, torch.cat(expected), rtol=1e-5, atol=1e-5)
