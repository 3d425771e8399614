"""Shared prompts (`learner.share_prompts`): the transitions of one prompt in one row, the prompt once, an attention
mask keeping the answers apart. Same tokens, same log-probs and same gradients as padding every sequence alone."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from learner.batching import Sequences, make_micro_batches
from learner.model import response_logprobs


def sequences(prompts: list[list[int]], responses: list[list[int]]) -> Sequences:
    return Sequences(
        prompt_ids=torch.tensor(sum(prompts, []), dtype=torch.long),
        response_ids=torch.tensor(sum(responses, []), dtype=torch.long),
        behav_logp=torch.zeros(sum(len(r) for r in responses)),
        prompt_lens=torch.tensor([len(p) for p in prompts]),
        response_lens=torch.tensor([len(r) for r in responses]),
    )


def test_one_prompt_two_answers_by_hand() -> None:
    # prompt [5, 6], answers [7, 8] and [9]; one row: 5 6 7 8 9 at positions 0 1 2 3 2 (each answer goes on from
    # the prompt's end). The mask, query (row) x key (column), True = may see:
    #        5 6 7 8 9
    #   5    1 . . . .
    #   6    1 1 . . .
    #   7    1 1 1 . .
    #   8    1 1 1 1 .
    #   9    1 1 . . 1     (the second answer sees the prompt and itself, not the first answer)
    # Targets: 7 is predicted by position 1 (the prompt's last), 8 by 2 (the 7), 9 by 1 again.
    seqs = sequences([[5, 6], [5, 6]], [[7, 8], [9]])
    (mb,) = make_micro_batches(seqs, torch.tensor([1.0, -1.0]), token_budget=64, share_prompts=True)
    assert mb.input_ids.tolist() == [[5, 6, 7, 8, 9]] and mb.position_ids.tolist() == [[0, 1, 2, 3, 2]]
    want = [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 1, 0, 0, 1]]
    assert mb.attention_mask.shape == (1, 1, 5, 5) and mb.attention_mask[0, 0].int().tolist() == want
    assert mb.logit_pos.tolist() == [1, 2, 1] and mb.targets.tolist() == [7, 8, 9]
    assert mb.token_index.tolist() == [0, 1, 2] and mb.advantages.tolist() == [1.0, 1.0, -1.0]


def random_groups(rng: np.random.Generator, vocab: int) -> Sequences:
    """Groups of 1-4 transitions with one prompt each (3-30 tokens), answers of 0-12 tokens, shuffled together."""
    prompts, responses = [], []
    for _ in range(int(rng.integers(2, 6))):
        prompt = rng.integers(3, vocab, int(rng.integers(3, 31))).tolist()
        for _ in range(int(rng.integers(1, 5))):
            prompts.append(prompt)
            responses.append(rng.integers(3, vocab, int(rng.integers(0, 13))).tolist())
    order = rng.permutation(len(prompts))
    return sequences([prompts[i] for i in order], [responses[i] for i in order])


@pytest.mark.parametrize("seed", range(4))
def test_shared_rows_give_every_answer_its_own_log_probs_and_gradients(tiny_model_dir, seed) -> None:
    """Random groups, a small token budget (so units split and rows pad): padded alone, shared and padded, shared
    and packed give the same log-probs for every response token (each exactly once) and the same gradients of a
    weighted sum of them."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    rng = np.random.default_rng(seed)
    seqs = random_groups(rng, model.config.vocab_size)
    weights = torch.from_numpy(rng.normal(size=seqs.num_response_tokens).astype(np.float32))  # [R]
    got = {}
    for layout in [dict(), dict(share_prompts=True), dict(share_prompts=True, packing=True)]:
        model.zero_grad()
        logp = torch.full((seqs.num_response_tokens,), float("nan"))
        for mb in make_micro_batches(seqs, torch.zeros(seqs.num_transitions), token_budget=48, **layout):
            out = response_logprobs(model, mb)
            (out * weights[mb.token_index]).sum().backward()
            assert bool(logp[mb.token_index].isnan().all())  # no token twice
            logp[mb.token_index] = out.detach()
        got[str(layout)] = (logp, [p.grad.clone() for p in model.parameters()])
    base_logp, base_grads = got.pop("{}")
    assert not bool(base_logp.isnan().any())
    for logp, grads in got.values():
        torch.testing.assert_close(logp, base_logp, atol=1e-5, rtol=0)
        for g, b in zip(grads, base_grads):
            torch.testing.assert_close(g, b, atol=1e-5, rtol=1e-4)


def test_the_mask_keeps_answers_apart(tiny_model_dir) -> None:
    """The check above can fail: the same shared row with a plain causal mask lets the second answer see the first,
    and its log-probs move far past the tolerance."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    rng = np.random.default_rng(7)
    prompt = rng.integers(3, model.config.vocab_size, 12).tolist()
    answers = [rng.integers(3, model.config.vocab_size, 10).tolist() for _ in range(2)]
    seqs = sequences([prompt, prompt], answers)
    (mb,) = make_micro_batches(seqs, torch.zeros(2), token_budget=64, share_prompts=True)
    (alone,) = make_micro_batches(seqs, torch.zeros(2), token_budget=64)
    causal = torch.ones_like(mb.attention_mask).tril()
    leaky = type(mb)(**{**mb.__dict__, "attention_mask": causal})
    with torch.no_grad():
        want = response_logprobs(model, alone)
        torch.testing.assert_close(response_logprobs(model, mb), want, atol=1e-5, rtol=0)
        assert float((response_logprobs(model, leaky) - want)[10:].abs().max()) > 1e-3
