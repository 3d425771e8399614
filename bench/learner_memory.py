"""The learner on a real model: peak RSS and step time of one rank's `train_step`, per means of saving memory.

    .venv/bin/python -m bench.learner_memory                       # SmolLM2-135M-Instruct (made on first use)
    .venv/bin/python -m bench.learner_memory --model DIR --variants default,all --steps 1

Each variant runs in a fresh process as a learner rank does (one gloo rank under FSDP2, the run's AdamW, the learner's
own `train_step` with its default options): the model loaded, then `--steps` steps on the same batch, the first of
them untimed warm-up when `--steps` > 1. The batch is one micro-batch's worth at `--micro-batch-tokens` (default 4096,
the learner's default): `--groups` groups of 4 single-step trajectories, `--prompt` prompt tokens (shared by a
group) and `--response` response tokens each, random ids, rewards 1, 0, 0, 1 in every group (every sample carries a
gradient). The variants, each adding to the one before:
  default     as the learner ran before: full logits of the response tokens, every activation kept
  chunked     learner.logprob_chunk_tokens=512: log-probs 512 tokens at a time, their logits recomputed in backward
  checkpoint  learner.activation_checkpointing=true: each decoder layer recomputed in backward
  tcmalloc    learner.tcmalloc=true: the rank runs on tcmalloc (LD_PRELOAD) instead of glibc's malloc, whose arenas
              keep what a step frees and hand it out again only in part
  lora        model.lora_rank=16 on every projection: optimizer state and gradients of the adapter only
Peak RSS is the process's high-water mark (VmHWM) over the whole run, load included, as a learner rank's would be,
and over the steps alone (reset after the load through /proc/self/clear_refs). The ratio line is the default's peak
over the last variant's (target: the last variant's peak at most 4 GB).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass

import numpy as np

from bench import harness
from engines.server import cpu_allocator_env

VARIANTS = ("default", "chunked", "checkpoint", "tcmalloc", "lora")
GROUP_SIZE = 4
REWARDS = (1.0, 0.0, 0.0, 1.0)


@dataclass(frozen=True)
class Workload:
    groups: int
    prompt: int
    response: int
    steps: int
    micro_batch_tokens: int


def hwm_bytes() -> int:
    """The process's peak resident set (VmHWM) in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def make_batch(w: Workload, vocab: int) -> object:
    """The learner's columnar batch: `w.groups` groups of GROUP_SIZE single-step trajectories sharing a prompt."""
    from agentstream.wire.messages import Batch

    rng = np.random.default_rng(0)
    n = w.groups * GROUP_SIZE
    prompts = [rng.integers(10, vocab, w.prompt, dtype=np.int32) for _ in range(w.groups)]
    i32 = lambda a: np.asarray(a, dtype=np.int32)  # noqa: E731
    return Batch(
        step=0,
        rank=0,
        learner_version=0,
        group_size=GROUP_SIZE,
        group_index=i32(np.arange(n) // GROUP_SIZE),
        traj_index=i32(np.arange(n)),
        step_index=np.zeros(n, np.int32),
        prompt_lens=i32([w.prompt] * n),
        response_lens=i32([w.response] * n),
        rewards=np.asarray(REWARDS * w.groups, np.float32),
        dones=np.ones(n, bool),
        valid=np.ones(n, bool),
        version_lo=np.zeros(n, np.int32),
        version_hi=np.zeros(n, np.int32),
        prompt_ids=np.concatenate([prompts[i // GROUP_SIZE] for i in range(n)]),
        response_ids=rng.integers(10, vocab, n * w.response, dtype=np.int32),
        logprobs=np.full(n * w.response, -3.0, np.float32),
        anchors=[""] * n,
    )


def one_variant(model_dir: str, variant: str, w: Workload) -> dict[str, float]:
    """Run `variant` in this process (a fresh one): {'load_s', 'step_s', 'peak_gb', 'step_peak_gb', 'loss'}."""
    import torch
    import torch.distributed as dist

    from agentstream.config import AlgorithmConfig, LearnerConfig
    from agentstream.wire.addresses import free_port
    from learner.model import init_distributed, load_policy, lora_spec, trainable_parameters, vocab_size
    from learner.step import StepOptions, train_step

    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "2")))
    upto = VARIANTS.index(variant)
    learner = LearnerConfig(
        micro_batch_tokens=w.micro_batch_tokens,
        logprob_chunk_tokens=512 if upto >= VARIANTS.index("chunked") else 0,
        activation_checkpointing=upto >= VARIANTS.index("checkpoint"),
    )
    lora = (
        lora_spec(16, 32.0, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], 0.0)
        if upto >= VARIANTS.index("lora")
        else None
    )
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    device = init_distributed("gloo")[2]
    try:
        t0 = time.perf_counter()
        model = load_policy(
            model_dir, "float32", device, 1, lora=lora, activation_checkpointing=learner.activation_checkpointing
        )
        optimizer = torch.optim.AdamW(trainable_parameters(model), lr=1e-6)
        load_s = time.perf_counter() - t0
        batch = make_batch(w, vocab_size(model))
        opts = StepOptions.from_config(learner, AlgorithmConfig())
        load_peak = hwm_bytes()
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM restarts from the current RSS: the steps' own peak
        times, metrics = [], {}
        for step in range(w.steps):
            t0 = time.perf_counter()
            metrics = train_step(model, optimizer, batch, opts, version=step, world_size=1, device=device)
            times.append(time.perf_counter() - t0)
        step_peak = hwm_bytes()
    finally:
        dist.destroy_process_group()
    peak = max(load_peak, step_peak)  # the whole process's, load included
    return {
        "load_s": load_s,
        "step_s": times[-1],
        "peak_gb": peak / 2**30,
        "step_peak_gb": step_peak / 2**30,
        "loss": float(metrics.get("loss", float("nan"))),
    }


def main() -> None:
    parser = harness.arguments(
        __doc__, model=True, default_model="SmolLM2-135M-Instruct (.cache/smollm2-135m-instruct)"
    )
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated, from: " + ", ".join(VARIANTS))
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=96)
    parser.add_argument("--response", type=int, default=104)
    parser.add_argument("--micro-batch-tokens", type=int, default=4096)
    parser.add_argument("--one", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    w = Workload(args.groups, args.prompt, args.response, args.steps, args.micro_batch_tokens)
    if not args.model:
        from launcher.real_model import ensure_smollm2

        args.model = str(ensure_smollm2())
    if args.one:  # a child: one variant, its figures as JSON on the last line
        print(json.dumps(one_variant(args.model, args.one, w)))
        return
    variants = [v for v in args.variants.split(",") if v]
    unknown = set(variants) - set(VARIANTS)
    if unknown:
        raise SystemExit(f"unknown variant(s) {sorted(unknown)}; known: {', '.join(VARIANTS)}")
    tokens = w.groups * GROUP_SIZE * (w.prompt + w.response)
    print(harness.load_line())
    print(
        f"model {args.model}; {w.groups * GROUP_SIZE} samples x ({w.prompt} prompt + {w.response} response) = "
        f"{tokens} tokens (prompts shared within a group), micro_batch_tokens {w.micro_batch_tokens}, "
        f"{w.steps} step(s), {os.environ.get('BENCH_THREADS', '2')} threads"
    )
    print(f"{'variant':<11} {'load s':>7} {'step s':>7} {'peak GB':>8} {'steps GB':>9} {'loss':>9}")
    rows = {}
    for v in variants:
        argv = [
            sys.executable,
            "-m",
            "bench.learner_memory",
            "--model",
            args.model,
            "--one",
            v,
            "--steps",
            str(w.steps),
            "--groups",
            str(w.groups),
            "--prompt",
            str(w.prompt),
            "--response",
            str(w.response),
            "--micro-batch-tokens",
            str(w.micro_batch_tokens),
        ]
        allocator = cpu_allocator_env() if VARIANTS.index(v) >= VARIANTS.index("tcmalloc") else {}
        if VARIANTS.index(v) >= VARIANTS.index("tcmalloc") and not allocator:
            print(f"{v:<11} skipped: tcmalloc is not installed (scripts/setup.sh installs libtcmalloc-minimal4)")
            continue
        out = subprocess.run(argv, capture_output=True, text=True, env={**os.environ, **allocator})
        if out.returncode != 0:
            print(f"{v:<11} failed (exit {out.returncode}): {out.stderr.strip().splitlines()[-1:]}")
            continue
        r = rows[v] = json.loads(out.stdout.strip().splitlines()[-1])
        print(
            f"{v:<11} {r['load_s']:7.1f} {r['step_s']:7.1f} {r['peak_gb']:8.2f} {r['step_peak_gb']:9.2f} "
            f"{r['loss']:9.4f}",
            flush=True,
        )
    if len(rows) >= 2:
        first, last = rows[next(iter(rows))], rows[list(rows)[-1]]
        print(
            harness.ratio_line(
                f"learner peak RSS {next(iter(rows))}/{list(rows)[-1]}",
                first["peak_gb"] * 1024,
                last["peak_gb"] * 1024,
                "MB",
                target=first["peak_gb"] / 4.0,
                note=f"target: {list(rows)[-1]} at most 4096 MB",
            )
        )


if __name__ == "__main__":
    main()
