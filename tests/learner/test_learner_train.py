"""The learner loop: two gloo ranks against a stand-in broker, and a rank that fails on a bad batch.

The two-rank run is checked against a plain single-process computation of its first step: the same loss,
the same gradient norm and the same weights afterwards, although the ranks hold different token counts
and one of them runs zero-weight micro-batches. That is what the global token normalisation must give.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from learner_testing import FakeBroker, FilePublisher, make_batch, ppo_clip_tis, prepare, run_ranks
from safetensors.torch import load_file

from agentstream.config import Config, save
from agentstream.wire.addresses import free_port
from agentstream.wire.messages import Batch
from learner.model import response_logprobs
from learner.step import StepOptions

STEPS = 3


def write_config(tmp_path: Path, model_dir: Path, world_size: int, **learner: int) -> Config:
    cfg = Config()
    cfg.run.output_dir = str(tmp_path)
    cfg.model.path = str(model_dir)
    cfg.learner.world_size = world_size
    cfg.learner.micro_batch_tokens = 48  # several micro-batches per rank, different counts per rank
    # The ranks compute log-probs 5 tokens at a time (several chunks per micro-batch, logits recomputed in
    # backward); the single-process reference below all at once: the chunked path under FSDP2 must agree.
    cfg.learner.logprob_chunk_tokens = 5
    cfg.learner.lr = 1e-3
    for name, value in learner.items():
        setattr(cfg.learner, name, value)
    cfg.trainer.total_steps = STEPS
    cfg.engines.count = 1
    save(cfg, tmp_path / "config.yaml")
    return cfg


def batches(vocab: int) -> dict[tuple[int, int], Batch]:
    """Rank 0 gets one group, rank 1 three: different token and micro-batch counts."""
    out = {}
    for step in range(STEPS):
        for rank, n_groups in ((0, 1), (1, 3)):
            rng = np.random.default_rng(100 * step + rank)
            out[step, rank] = make_batch(step, rank, rng, n_groups=n_groups, vocab=vocab, learner_version=step)
    return out


def reference_first_step(cfg: Config, model_dir: Path, shares: list[Batch]) -> tuple[float, float, dict]:
    """Step 0 without FSDP: one model, both ranks' shares, loss = sum of all token terms / all tokens; log-probs
    computed all at once (no chunks)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    opts = StepOptions.from_config(cfg.learner, cfg.algorithm)
    a = opts.algo  # the default algorithm: PPO-clip + token-level TIS, token mean = ppo_clip_tis
    mbs = [mb for share in shares for mb in prepare(share, opts, model.config.vocab_size)[0]]
    total = sum(mb.num_tokens for mb in mbs)
    loss_sum = 0.0
    for mb in mbs:
        logp = response_logprobs(model, mb, chunk_tokens=0)[None]
        loss, _ = ppo_clip_tis(
            logp,
            logp.detach(),
            mb.behav_logp[None],
            mb.advantages[None],
            mb.mask[None],
            clip_low=a.clip_low,
            clip_high=a.clip_high,
            tis_cap=a.is_cap,
            denom=total,
        )
        loss.backward()
        loss_sum += float(loss.detach())
    grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), opts.max_grad_norm))
    torch.optim.AdamW(model.parameters(), lr=cfg.learner.lr, weight_decay=cfg.learner.weight_decay).step()
    return loss_sum, grad_norm, {k: v.detach().clone() for k, v in model.state_dict().items()}


def reference_updates(cfg: Config, model_dir: Path, shares: list[Batch]) -> dict:
    """Step 0 with learner.ppo_epochs x learner.mini_batches updates, without FSDP: log pi_prox of every
    micro-batch from the initial model; each rank's micro-batches (padded to the larger count, and to at least
    mini_batches) cut into mini_batches contiguous parts; part j of both ranks together is one update, its loss
    a mean over its own tokens; one AdamW for all updates. Returns the weights after the step."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    opts = StepOptions.from_config(cfg.learner, cfg.algorithm)
    a, k = opts.algo, cfg.learner.mini_batches
    per_rank = [prepare(share, opts, model.config.vocab_size)[0] for share in shares]
    padded = max(k, *(len(mbs) for mbs in per_rank))
    with torch.no_grad():
        prox = [[response_logprobs(model, mb, chunk_tokens=0) for mb in mbs] for mbs in per_rank]
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.learner.lr, weight_decay=cfg.learner.weight_decay)
    for _ in range(cfg.learner.ppo_epochs):
        for part in np.array_split(np.arange(padded), k):
            members = [(r, i) for r, mbs in enumerate(per_rank) for i in part if i < len(mbs)]
            total = sum(per_rank[r][i].num_tokens for r, i in members)
            for r, i in members:
                mb = per_rank[r][i]
                logp = response_logprobs(model, mb, chunk_tokens=0)[None]
                loss, _ = ppo_clip_tis(
                    logp,
                    prox[r][i][None],
                    mb.behav_logp[None],
                    mb.advantages[None],
                    mb.mask[None],
                    clip_low=a.clip_low,
                    clip_high=a.clip_high,
                    tis_cap=a.is_cap,
                    denom=total,
                )
                loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), opts.max_grad_norm)
            optimizer.step()
            optimizer.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_two_ranks_train_publish_and_report(tiny_model_dir: Path, tmp_path: Path):
    cfg = write_config(tmp_path, tiny_model_dir, world_size=2)
    vocab = 320  # the tiny tokenizer's ~260 tokens, padded to a multiple of 64
    shares = batches(vocab)
    weights_dir, out_dir = tmp_path / "published", tmp_path / "run"
    argv = ["--config", str(tmp_path / "config.yaml"), "--weights-bind", str(weights_dir), "--out", str(out_dir)]
    with FakeBroker(lambda step, rank: shares[step, rank]) as broker:
        run_ranks(2, argv + ["--broker", broker.address])
        time.sleep(0.3)  # the last Stats may still be in flight to the stand-in broker

    # both ranks said hello, asked for steps 0..STEPS-1 in order, and reported the same number of steps
    assert sorted(who for who, _ in broker.of_kind("hello")) == ["learner-0", "learner-1"]
    for rank in (0, 1):
        asked = [m.step for who, m in broker.of_kind("batch_request") if who == f"learner-{rank}"]
        assert asked == list(range(STEPS))
    finals = {m.source: m for _, m in broker.of_kind("stats") if m.final}
    assert set(finals) == {"learner-0", "learner-1"}
    assert finals["learner-0"].counters["steps"] == finals["learner-1"].counters["steps"] == STEPS
    assert finals["learner-0"].counters["micro_batches"] == finals["learner-1"].counters["micro_batches"]
    assert finals["learner-0"].counters["zero_weight_micro_batches"] > 0  # rank 0 had fewer micro-batches

    updates = [m for who, m in broker.of_kind("version_update")]
    assert [u.version for u in updates] == list(range(1, STEPS + 1))
    assert {who for who, _ in broker.of_kind("version_update")} == {"learner-0"}
    for step, u in enumerate(updates):
        assert math.isfinite(u.metrics["loss"]) and math.isfinite(u.metrics["grad_norm"])
        assert u.metrics["tokens"] == sum(int(shares[step, r].response_lens.sum()) for r in (0, 1))
        assert 0 <= u.metrics["staleness_mean"] <= u.metrics["staleness_max"] <= 1
    assert len((out_dir / "learner_metrics.jsonl").read_text().splitlines()) == STEPS
    assert (weights_dir / "waited").read_text() == f"{STEPS} 1" and (weights_dir / "closed").exists()

    # step 0 equals the single-process reference; the weights moved at every step
    ref_loss, ref_norm, ref_weights = reference_first_step(cfg, tiny_model_dir, [shares[0, 0], shares[0, 1]])
    assert updates[0].metrics["loss"] == pytest.approx(ref_loss, rel=1e-4, abs=1e-6)
    assert updates[0].metrics["grad_norm"] == pytest.approx(ref_norm, rel=1e-4)
    published = {v: torch.load(weights_dir / f"v{v}.pt") for v in range(1, STEPS + 1)}
    # Streamed (the default), a tied weight goes once: the head is the embedding (the engines re-tie it).
    assert set(ref_weights) - set(published[1]) == {"lm_head.weight"}
    for name, w in ref_weights.items():
        torch.testing.assert_close(
            published[1].get(name, published[1]["model.embed_tokens.weight"]), w, atol=2e-5, rtol=0, msg=name
        )
    initial = load_file(tiny_model_dir / "model.safetensors")
    for v in range(1, STEPS + 1):
        before = initial if v == 1 else published[v - 1]
        moved = max(float((published[v][k] - before[k]).abs().max()) for k in initial)
        assert moved > 1e-4, f"version {v} did not change the weights"


def test_rank_0_tells_the_broker_where_it_publishes() -> None:
    """What goes in VersionUpdate.weights: the address sidecars reach rank 0's publisher at, from the launcher's
    --weights-bind (a wildcard interface by this host's name); "" when there is no TCP address to tell."""
    import socket

    from learner.train import parse_args, train_spec

    def told(*bind: str) -> str:
        args = parse_args(["--config", "config.yaml", "--broker", "tcp://127.0.0.1:5555", *bind])
        return train_spec(Config(), args).weights

    assert told("--weights-bind", "tcp://10.0.0.9:41000") == "tcp://10.0.0.9:41000"
    assert told("--weights-bind", "tcp://0.0.0.0:5556") == f"tcp://{socket.getfqdn()}:5556"
    assert told("--weights-bind", "/tmp/published") == "" and told() == ""  # a folder (FilePublisher), or none


def test_a_bad_batch_fails_the_rank_with_a_clear_message(tiny_model_dir: Path, tmp_path: Path, capfd):
    """One rank in this process: a token id outside the vocabulary must end the learner with status 1."""
    from learner.train import main

    write_config(tmp_path, tiny_model_dir, world_size=1)
    bad = make_batch(0, 0, np.random.default_rng(0), vocab=10_000)
    with FakeBroker(lambda step, rank: bad) as broker, pytest.MonkeyPatch.context() as mpatch:
        for k, v in dict(
            RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port())
        ).items():
            mpatch.setenv(k, v)
        rc = main(
            ["--config", str(tmp_path / "config.yaml"), "--broker", broker.address, "--engines", "0"],
            publisher_factory=FilePublisher,
        )
    assert rc == 1
    assert "outside the model's vocabulary" in capfd.readouterr().err


def test_two_ranks_with_epochs_and_mini_batches_match_a_plain_loop(tiny_model_dir: Path, tmp_path: Path):
    """learner.ppo_epochs=2, learner.mini_batches=3: six optimizer steps per batch, each mini-batch's loss over
    its own tokens on both ranks, the ratio taken to the policy before the step (not to the current one): the
    published weights after step 0 equal the plain single-process loop's."""
    cfg = write_config(tmp_path, tiny_model_dir, world_size=2, ppo_epochs=2, mini_batches=3)
    shares = batches(320)
    weights_dir, out_dir = tmp_path / "published", tmp_path / "run"
    argv = ["--config", str(tmp_path / "config.yaml"), "--weights-bind", str(weights_dir), "--out", str(out_dir)]
    with FakeBroker(lambda step, rank: shares[step, rank]) as broker:
        run_ranks(2, argv + ["--broker", broker.address])
    updates = [m for _, m in broker.of_kind("version_update")]
    assert [u.version for u in updates] == list(range(1, STEPS + 1))
    for step, u in enumerate(updates):
        assert u.metrics["updates"] == 6
        assert u.metrics["tokens"] == sum(int(shares[step, r].response_lens.sum()) for r in (0, 1))  # per pass
        assert math.isfinite(u.metrics["loss"]) and math.isfinite(u.metrics["grad_norm"])
        # updates 2..6 see a policy that moved since pi_prox: the ratio is not 1 everywhere
        assert abs(u.metrics["ppo_ratio_mean"] - 1.0) > 1e-6
    expected = reference_updates(cfg, tiny_model_dir, [shares[0, 0], shares[0, 1]])
    published = torch.load(weights_dir / "v1.pt")
    for name, w in expected.items():  # a tied head is streamed as the embedding
        torch.testing.assert_close(
            published.get(name, published["model.embed_tokens.weight"]), w, atol=5e-5, rtol=0, msg=name
        )
