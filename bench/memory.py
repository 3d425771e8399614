"""Memory: the broker's bytes per buffered transition, and the learner's peak memory per token with and
without a chunked log-prob computation.

    .venv/bin/python -m bench.memory [--transitions 4000] [--vocab 32768] [--tokens 1024]

Broker: transitions are encoded and decoded exactly as they reach the broker (`agentstream.wire.messages`), then
held by the broker's `ReplayBuffer` in open groups; tracemalloc (numpy reports its buffers to it) gives
the bytes held per transition, next to the bytes of its token ids and log-probs.

Learner: one micro-batch (`learner.batching.make_micro_batches`) of 4 sequences with `--tokens` response
tokens in all, through a Qwen2 with a `--vocab` vocabulary (hidden 128, 2 layers, random weights); peak
RSS growth of forward + backward, each variant in a fresh process: the learner's `response_logprobs`
(`learner.model.token_logprobs`) as it runs by default (full [Q, V] logits, log-softmax) and with
`learner.logprob_chunk_tokens=--chunk` (lm_head + logsumexp over `--chunk` tokens at a time, each chunk
recomputed in backward under activation checkpointing). Both give the same log-probs (checked).
The last line is the learner's ratio without/with chunking.
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import tracemalloc

import numpy as np
import torch

from agentstream.config import REPO_ROOT
from bench import harness


# ------------------------------------------------------------------------------------ broker
def broker_bytes_per_transition(prompt: int, response: int, n: int) -> tuple[float, float]:
    """(bytes held per buffered transition, bytes of its arrays)."""
    from agentstream.wire.messages import Transition, decode, encode
    from broker.buffer import ReplayBuffer

    rng = np.random.default_rng(0)
    group_size = 4
    buf = ReplayBuffer(
        group_size=group_size, groups_per_step=1, world_size=1, max_staleness=10**6, max_buffered_transitions=10**9
    )
    for _ in range(n // 64 + 1):
        buf.admit("actor-0")
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for i in range(n):  # trajectories never end: every transition stays in an open group
        t = Transition(
            traj_id=f"actor-0.0.g{i // 64}.{i % group_size}",
            group_id=i // 64,
            actor="actor-0",
            step=(i % 64) // group_size,
            prompt_ids=rng.integers(0, 400, prompt, dtype=np.int32),
            response_ids=rng.integers(0, 400, response, dtype=np.int32),
            logprobs=-rng.random(response, dtype=np.float32),
            version_lo=0,
            version_hi=0,
            reward=0.0,
            done=False,
            truncated=False,
            valid=True,
            anchor="",
            info={"success": False},
        )
        frames = [bytes(f) for f in encode(t)]  # what arrives from the socket
        buf.add(decode(frames))  # the broker keeps the decoded message (its arrays view the frames)
        del t, frames
    held = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    return held / n, float((prompt + response) * 4 + response * 4)


# ------------------------------------------------------------------------------------ learner
def _micro_batch(tokens: int, vocab: int):
    from agentstream.wire.messages import Batch
    from learner.batching import Sequences, make_micro_batches

    rng = np.random.default_rng(0)
    n, r = 4, tokens // 4

    def i32(x):
        return np.asarray(x, dtype=np.int32)

    batch = Batch(
        step=0,
        rank=0,
        learner_version=0,
        group_size=4,
        group_index=i32([0] * n),
        traj_index=i32(range(n)),
        step_index=i32([0] * n),
        prompt_lens=i32([r] * n),
        response_lens=i32([r] * n),
        rewards=np.zeros(n, np.float32),
        dones=np.ones(n, bool),
        valid=np.ones(n, bool),
        version_lo=i32([0] * n),
        version_hi=i32([0] * n),
        prompt_ids=i32(rng.integers(0, vocab, n * r)),
        response_ids=i32(rng.integers(0, vocab, n * r)),
        logprobs=np.zeros(n * r, np.float32),
        anchors=[""] * n,
    )
    (mb,) = make_micro_batches(Sequences.from_batch(batch), torch.zeros(n), token_budget=10**9)
    return mb


def learner_child(variant: str, tokens: int, vocab: int, chunk: int) -> dict:
    """Runs in a fresh process: peak RSS growth (bytes) of one forward + backward of `variant`."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from learner.model import response_logprobs

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(
        Qwen2Config(
            vocab_size=vocab,
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=True,
        )
    )
    mb = _micro_batch(tokens, vocab)
    with torch.no_grad():  # a small warm-up: allocator and kernels, not counted
        response_logprobs(model, _micro_batch(64, vocab))
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    logp = response_logprobs(model, mb, chunk_tokens=0 if variant == "full" else chunk)
    logp.sum().backward()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"peak_growth": peak - base, "tokens": int(mb.targets.numel()), "logp_sum": float(logp.detach().sum())}


def learner_peak(variant: str, tokens: int, vocab: int, chunk: int) -> dict:
    code = (
        f"import json; from bench import memory as b; "
        f"print(json.dumps(b.learner_child({variant!r}, {tokens}, {vocab}, {chunk})))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"the {variant} learner measurement failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = harness.arguments(__doc__)
    parser.add_argument("--transitions", type=int, default=4000, help="transitions buffered per size")
    parser.add_argument("--vocab", type=int, default=32768, help="vocabulary of the learner's test model")
    parser.add_argument("--tokens", type=int, default=1024, help="response tokens in the learner's micro-batch")
    parser.add_argument("--chunk", type=int, default=128, help="tokens per chunk of the chunked log-probs")
    args = parser.parse_args()
    print(f"{'broker: transition':<26} {'array bytes':>11} {'held bytes':>11} {'overhead':>9}")
    for name, prompt, response in [("small (48+16 tokens)", 48, 16), ("large (1536+512 tokens)", 1536, 512)]:
        n = args.transitions if response < 100 else max(args.transitions // 8, 64)
        held, arrays = broker_bytes_per_transition(prompt, response, n)
        print(f"{name:<26} {arrays:>11.0f} {held:>11.0f} {held / arrays:>8.2f}x", flush=True)
    print(f"{'learner: log-probs':<26} {'tokens':>11} {'peak MB':>11} {'bytes/token':>11}   (vocab {args.vocab})")
    rows = {}
    for variant in ("full", "chunked"):
        r = rows[variant] = learner_peak(variant, args.tokens, args.vocab, args.chunk)
        label = (
            "learner response_logprobs" if variant == "full" else f"chunked ({args.chunk} tokens)"
        )  # tests read these
        print(
            f"{label:<26} {r['tokens']:>11} {r['peak_growth'] / 1e6:>11.1f} {r['peak_growth'] / r['tokens']:>11.0f}",
            flush=True,
        )
    same = abs(rows["full"]["logp_sum"] - rows["chunked"]["logp_sum"]) <= 1e-3 * abs(rows["full"]["logp_sum"])
    print(
        "learner peak without/with chunking: "
        f"{rows['full']['peak_growth'] / max(rows['chunked']['peak_growth'], 1):.2f}x (same log-probs: {same})"
    )


if __name__ == "__main__":
    main()
