"""Test helpers for the learner: hand-built batches, a stand-in broker, a file-writing weight publisher.

The stand-in broker is a ZeroMQ ROUTER in a thread of the test process: it answers every BatchRequest
with `batch_for(step, rank)` and records everything else it receives. It is a logic test of the learner,
not of the real broker.
"""

from __future__ import annotations

import math
import threading
import time
from pathlib import Path
from typing import Callable

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp
import zmq
from torch import Tensor

from agentstream.weights import StreamSource
from agentstream.wire.addresses import free_port
from agentstream.wire.messages import Batch, BatchRequest, Message, decode, encode
from learner.advantages import compute_advantages
from learner.batching import MicroBatch, make_micro_batches
from learner.losses import PolicyLossInput, policy_objective
from learner.step import StepOptions, advantage_input, checked_sequences


def make_batch(
    step: int,
    rank: int,
    rng: np.random.Generator,
    n_groups: int = 2,
    group_size: int = 2,
    vocab: int = 256,
    max_steps: int = 2,
    learner_version: int = 0,
) -> Batch:
    """Random whole groups: each trajectory 1..max_steps transitions, prompts 4-20 tokens, responses 1-12.
    Odd trajectories end with reward 1, even ones with 0: with G=2, every group has a learning signal."""
    cols: dict[str, list] = {
        k: []
        for k in (
            "group_index",
            "traj_index",
            "step_index",
            "prompt_lens",
            "response_lens",
            "rewards",
            "dones",
            "valid",
            "version_lo",
        )
    }
    prompts, responses, logprobs = [], [], []
    traj = 0
    for g in range(n_groups):
        for _ in range(group_size):
            n_steps = int(rng.integers(1, max_steps + 1))
            for s in range(n_steps):
                p, r = int(rng.integers(4, 21)), int(rng.integers(1, 13))
                prompts.append(rng.integers(3, vocab, p))
                responses.append(rng.integers(3, vocab, r))
                logprobs.append(-rng.uniform(4.0, 7.0, r))  # near log(1/vocab): a fresh tiny model's range
                for key, value in [
                    ("group_index", g),
                    ("traj_index", traj),
                    ("step_index", s),
                    ("prompt_lens", p),
                    ("response_lens", r),
                    ("rewards", float(s == n_steps - 1 and traj % 2)),
                    ("dones", s == n_steps - 1),
                    ("valid", bool(rng.integers(0, 2))),
                    ("version_lo", max(0, learner_version - int(rng.integers(0, 2)))),
                ]:
                    cols[key].append(value)
            traj += 1
    i32 = lambda k: np.asarray(cols[k], dtype=np.int32)  # noqa: E731
    return Batch(
        step=step,
        rank=rank,
        learner_version=learner_version,
        group_size=group_size,
        group_index=i32("group_index"),
        traj_index=i32("traj_index"),
        step_index=i32("step_index"),
        prompt_lens=i32("prompt_lens"),
        response_lens=i32("response_lens"),
        rewards=np.asarray(cols["rewards"], dtype=np.float32),
        dones=np.asarray(cols["dones"], dtype=bool),
        valid=np.asarray(cols["valid"], dtype=bool),
        version_lo=i32("version_lo"),
        version_hi=i32("version_lo"),
        prompt_ids=np.concatenate(prompts).astype(np.int32),
        response_ids=np.concatenate(responses).astype(np.int32),
        logprobs=np.concatenate(logprobs).astype(np.float32),
        anchors=[""] * len(cols["rewards"]),
    )


class FakeBroker:
    """ROUTER on a free loopback port, answering BatchRequests from `batch_for(step, rank)`."""

    def __init__(self, batch_for: Callable[[int, int], Message]):
        self._batch_for = batch_for
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.ROUTER)
        port = self._sock.bind_to_random_port("tcp://127.0.0.1")
        self.address = f"tcp://127.0.0.1:{port}"
        self.received: list[tuple[str, Message]] = []  # (sender identity, message), in arrival order
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="fake-broker", daemon=True)

    def __enter__(self) -> "FakeBroker":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._sock.close(linger=0)

    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self._sock.poll(100):  # a blocking poll with a timeout, so that __exit__ is noticed
                continue
            ident, *frames = self._sock.recv_multipart()
            msg = decode(frames)
            self.received.append((ident.decode(), msg))
            if isinstance(msg, BatchRequest):
                self._sock.send_multipart([ident, *encode(self._batch_for(msg.step, msg.rank))])

    def of_kind(self, kind: str) -> list[tuple[str, Message]]:
        return [(who, m) for who, m in self.received if m.kind == kind]


class FilePublisher:
    """Stands in for learner.publish.WeightPublisher: `bind_address` is a folder; each version's full
    state dict is saved there as v{version}.pt."""

    def __init__(self, bind_address: str):
        self.dir = Path(bind_address)
        self.dir.mkdir(parents=True, exist_ok=True)

    def publish(self, version: int, state_dict: dict[str, torch.Tensor]) -> None:
        torch.save({k: v.clone() for k, v in state_dict.items()}, self.dir / f"v{version}.pt")

    def publish_stream(self, version: int, source: StreamSource) -> None:
        """A streamed update (engines.weight_sync=stream, the default): the parameters of one pass, saved alike."""
        torch.save({name: t.detach().cpu().clone() for name, t in source.tensors()}, self.dir / f"v{version}.pt")

    def stream_pending(self) -> bool:
        return False  # no engine (re)joins a folder

    def stream_again(self, version: int, source: StreamSource) -> None:
        raise AssertionError("nothing was pending")

    def wait_for(self, version: int, n_engines: int, timeout_s: float) -> bool:
        (self.dir / "waited").write_text(f"{version} {n_engines}")
        return True

    def service(self) -> None:
        pass  # no agents to serve

    def close(self) -> None:
        (self.dir / "closed").write_text("1")


def run_ranks(world: int, argv: list[str], timeout_s: float = 90.0) -> None:
    """Run the learner's main() on `world` spawned ranks (see spawn_rank); fail the test past `timeout_s`."""
    ctx = mp.start_processes(
        spawn_rank, args=(world, free_port(), argv), nprocs=world, join=False, start_method="spawn"
    )
    deadline = time.monotonic() + timeout_s
    while not ctx.join(timeout=1.0):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail(f"learner ranks still running after {timeout_s}s")


def spawn_rank(rank: int, world: int, master_port: int, argv: list[str]) -> None:
    """torch.multiprocessing entry point: what torchrun would set up, then the learner's own main()."""
    import os
    import sys

    from learner.train import main

    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(master_port),
    )
    rc = main(argv, publisher_factory=FilePublisher)
    if rc:
        sys.exit(rc)


# The first learner's default objective under its own signature: the tests hold policy_objective's
# defaults (PPO-clip + token-level TIS, token mean) against it and against hand-worked values.
def ppo_clip_tis(
    logp: Tensor,
    old_logp: Tensor,
    behav_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_low: float,
    clip_high: float,
    tis_cap: float,
    denom: Tensor | float | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """PPO-clip + token-level TIS, token mean: `policy_objective` with its defaults (the learner's
    default objective), under the signature the first learner had. Stats as before (`tis_clip_frac`)."""
    inp = PolicyLossInput(logp=logp, prox_logp=old_logp, behav_logp=behav_logp, advantages=advantages, mask=mask)
    loss, stats = policy_objective(inp, clip_low=clip_low, clip_high=clip_high, is_cap=tis_cap, token_denom=denom)
    return loss, {
        k: stats[k] for k in ("tokens", "is_ratio_mean", "is_ratio_max", "ppo_ratio_mean", "ppo_clip_frac")
    } | {"tis_clip_frac": stats["is_clip_frac"]}


def ppo_clip_tis_reference(
    logp: Tensor,
    old_logp: Tensor,
    behav_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_low: float,
    clip_high: float,
    tis_cap: float,
    denom: float | None = None,
) -> tuple[float, dict[str, float]]:
    """Slow, obvious `ppo_clip_tis`: a loop over tokens with python floats. Returns (loss, stats)."""
    total, n, ratios, ppo_clipped, tis_clipped = 0.0, 0, [], 0, 0
    for b in range(logp.shape[0]):
        for t in range(logp.shape[1]):
            if not bool(mask[b, t]):
                continue
            a = float(advantages[b] if advantages.dim() == 1 else advantages[b, t])
            r = math.exp(float(logp[b, t]) - float(old_logp[b, t]))
            r_clip = min(max(r, 1.0 - clip_low), 1.0 + clip_high)
            is_ratio = math.exp(float(old_logp[b, t]) - float(behav_logp[b, t]))
            total += min(is_ratio, tis_cap) * max(-a * r, -a * r_clip)
            n += 1
            ratios.append(is_ratio)
            ppo_clipped += int(-a * r_clip > -a * r)
            tis_clipped += int(is_ratio > tis_cap)
    loss = total / (denom if denom is not None else max(n, 1))
    stats = {
        "tokens": float(n),
        "is_ratio_mean": sum(ratios) / max(n, 1),
        "is_ratio_max": max(ratios, default=0.0),
        "ppo_clip_frac": ppo_clipped / max(n, 1),
        "tis_clip_frac": tis_clipped / max(n, 1),
    }
    return loss, stats


def prepare(
    batch: Batch, opts: StepOptions, vocab: int, rewards: Tensor | None = None, values: Tensor | None = None
) -> tuple[list[MicroBatch], dict[str, float]]:
    """Advantages and micro-batches of this rank's share, and its advantage stats (what train_step computes
    first, without its reference/critic parts)."""
    seqs = checked_sequences(batch, vocab)
    adv, adv_stats = compute_advantages(
        opts.algo.advantage, advantage_input(batch, rewards, values), **opts.advantage_options()
    )
    return make_micro_batches(seqs, adv, opts.micro_batch_tokens, packing=opts.packing), adv_stats
