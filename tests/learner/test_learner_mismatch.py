"""The train-inference mismatch metric of a learner step (`mismatch_*` in the learner's metrics): measured only on
the transitions sampled entirely at the learner's version, ~0 when the behaviour log-probs are the learner's own,
and the size of the gap when they are not; with one update per batch and with several (the no-grad pass).
Against a real vLLM engine: tests/engines/test_engines_stream.py."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch
from learner_testing import make_batch

from agentstream.config import Config
from learner.batching import Sequences, make_micro_batches
from learner.model import load_policy, token_logprobs
from learner.step import StepOptions, train_step


def own_logprobs(model: torch.nn.Module, batch) -> np.ndarray:
    """The model's log-probs of the batch's response tokens [R], as the behaviour log-probs of an engine on its
    weights."""
    seqs = Sequences.from_batch(batch)
    out = np.zeros(seqs.num_response_tokens, np.float32)
    with torch.no_grad():
        for mb in make_micro_batches(seqs, torch.zeros(seqs.num_transitions), 4096):
            out[mb.token_index[mb.mask].numpy()] = token_logprobs(model, mb)[0][mb.mask].numpy()
    return out


@pytest.mark.parametrize("ppo_epochs", [1, 2])
def test_mismatch_is_zero_on_the_same_weights_and_the_gap_otherwise(
    one_rank, tiny_model_dir: Path, ppo_epochs: int
) -> None:
    cfg = Config()
    cfg.model.path = str(tiny_model_dir)
    cfg.learner.ppo_epochs = ppo_epochs
    opts = StepOptions.from_config(cfg.learner, cfg.algorithm)
    device = torch.device("cpu")
    # learner version 1: each transition was sampled at version 0 or 1 (make_batch: version_hi = version_lo)
    batch = make_batch(
        0, 0, np.random.default_rng(11), n_groups=3, group_size=2, max_steps=2, learner_version=1, vocab=300
    )
    at_one = np.repeat(batch.version_lo == 1, batch.response_lens)  # [R]
    assert 0 < at_one.sum() < at_one.size  # both kinds are there: the count below can fail

    def step(behav: np.ndarray, version: int = 1) -> dict[str, float]:
        torch.manual_seed(0)
        model = load_policy(cfg.model.path, "float32", device, 1)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        return train_step(
            model,
            optimizer,
            dataclasses.replace(batch, logprobs=behav),
            opts,
            version=version,
            world_size=1,
            device=device,
        )

    torch.manual_seed(0)
    own = own_logprobs(load_policy(cfg.model.path, "float32", device, 1), batch)
    same = step(own)
    assert same["mismatch_tokens"] == at_one.sum()
    assert same["mismatch_logp_abs_max"] < 1e-5 and same["mismatch_kl"] < 1e-10
    assert same["mismatch_version"] == 1
    # tokens sampled at version 0 are 3.0 off; they are not the learner's weights and must not count
    assert step(np.where(at_one, own, own - 3.0))["mismatch_logp_abs_max"] < 1e-5
    # the engine 0.5 off on every token of version 1 (log-probs 0.5 higher): |.| = 0.5, k3(-0.5) = e^-0.5 - 0.5
    off = step(np.where(at_one, own + 0.5, own))
    assert off["mismatch_logp_abs_mean"] == pytest.approx(0.5, abs=1e-5)
    assert off["mismatch_logp_abs_max"] == pytest.approx(0.5, abs=1e-5)
    assert off["mismatch_kl"] == pytest.approx(np.exp(-0.5) - 0.5, abs=1e-5)
    # at learner version 2 nothing in the batch was sampled on its weights: a count of 0 and no mean to report
    later = step(own, version=2)
    assert later["mismatch_tokens"] == 0 and "mismatch_logp_abs_mean" not in later


def test_an_optimizer_built_after_a_forward_still_steps_every_weight(one_rank, tiny_model_dir: Path) -> None:
    # FSDP2's root keeps its weights gathered after a forward and registers the gathered copies: an optimizer built
    # on those would never step the root's own weights (the embeddings, the final norm, the tied head), and a read
    # of the weights would see the copies. trainable_parameters and full_parameters take the shards.
    from learner.model import full_parameters, trainable_parameters

    torch.manual_seed(0)
    model = load_policy(str(tiny_model_dir), "float32", torch.device("cpu"), 1)
    ids = torch.randint(3, 200, (2, 12))
    with torch.no_grad():
        model(input_ids=ids)  # e.g. the behaviour log-probs of a first batch
    before = {n: t.clone() for n, t in full_parameters(model)}
    optimizer = torch.optim.AdamW(trainable_parameters(model), lr=1e-3)
    model(input_ids=ids).logits.float().pow(2).mean().backward()
    optimizer.step()
    moved = {n: float((t - before[n]).abs().max()) for n, t in full_parameters(model)}
    assert {"model.embed_tokens.weight", "model.norm.weight"} <= set(moved)
    assert min(moved.values()) == pytest.approx(1e-3, rel=1e-3)  # Adam's first step moves every weight by ~lr
