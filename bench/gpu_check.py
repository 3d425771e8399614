"""GPU check of the learner: its FSDP2 training step (`learner.step.train_step`) on a randomly initialised
Qwen2-architecture model of about 0.5B parameters (Qwen2.5-0.5B's shape), bf16 on CUDA with NCCL.

    bash scripts/gpu_check.sh              # on a GPU machine: torchrun, one rank per GPU (default 1)
    bash scripts/gpu_check.sh --dry-run    # anywhere: a tiny model, float32, gloo on CPU, seconds

(`scripts/gpu_check.sh` checks the Python it is given, then runs this module, `python -m bench.gpu_check`, under
torchrun from the repository: a GPU machine's own PyTorch need not have the project installed.)

Prints tokens/s of the training step, model FLOPs utilisation against the matmul ceiling measured here
(bf16 8192^3 matmuls on CUDA; float32 on CPU), peak memory, and the time to gather the full weights for
the engines (`learner.model.full_state_dict`, the learner's own broadcast path). Selection: CUDA, NCCL and
bf16 whenever `torch.cuda.is_available()` and not --dry-run; else CPU, gloo, float32 and tiny sizes.
The model is written once to a temporary folder so that `learner.model.load_policy` loads it as it would
any Hugging Face directory.
"""

from __future__ import annotations

import os
import resource
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from bench import harness

# Qwen2.5-0.5B's shape (494M parameters with its tied 151,936-token embedding); tiny for the dry run.
QWEN2_05B = {
    "vocab_size": 151936,
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "tie_word_embeddings": True,
}
TINY = {
    "vocab_size": 512,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "tie_word_embeddings": True,
}


def make_model_dir(shape: dict, folder: Path) -> Path:
    """A randomly initialised Qwen2ForCausalLM saved as a Hugging Face directory (rank 0 writes it)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(max_position_embeddings=4096, torch_dtype="float32", **shape))
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def make_batch(rank: int, n_seqs: int, prompt: int, response: int, vocab: int, group_size: int = 4):
    """One rank's share: n_seqs single-step trajectories in groups of `group_size`, random tokens and rewards."""
    from agentstream.wire.messages import Batch

    rng = np.random.default_rng(rank)

    def i32(x):
        return np.asarray(x, dtype=np.int32)

    n = n_seqs
    return Batch(
        step=0,
        rank=rank,
        learner_version=0,
        group_size=group_size,
        group_index=i32(np.arange(n) // group_size),
        traj_index=i32(np.arange(n)),
        step_index=i32([0] * n),
        prompt_lens=i32([prompt] * n),
        response_lens=i32([response] * n),
        rewards=rng.random(n, dtype=np.float32),
        dones=np.ones(n, bool),
        valid=np.ones(n, bool),
        version_lo=i32([0] * n),
        version_hi=i32([0] * n),
        prompt_ids=i32(rng.integers(0, vocab, n * prompt)),
        response_ids=i32(rng.integers(0, vocab, n * response)),
        logprobs=-rng.uniform(10, 12, n * response).astype(np.float32),
        anchors=[""] * n,
    )


def matmul_ceiling(device: torch.device, dtype: torch.dtype, size: int, repeats: int) -> float:
    """Measured FLOP/s of square matmuls (the peak this device reaches on the step's main operation)."""
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    for _ in range(2):
        a @ b
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(repeats):
        a @ b
    _sync(device)
    return 2 * size**3 * repeats / (time.perf_counter() - t0)


def step_flops(n_params: int, n_layers: int, hidden: int, tokens: int, seq_len: int) -> float:
    """Training FLOPs of one step: 6 N per token (forward + backward of the weights) plus attention scores,
    12 L H T per token (Kaplan et al. 2020 / PaLM appendix B; no causal halving, as MFU usually counts)."""
    return tokens * (6 * n_params + 12 * n_layers * hidden * seq_len)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_memory_gib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 2**30  # the process's peak RSS


def main() -> None:
    parser = harness.arguments(__doc__)
    parser.add_argument("--dry-run", action="store_true", help="CPU, gloo, float32, a tiny model")
    parser.add_argument("--steps", type=int, default=5, help="timed training steps (after 2 warm-up steps)")
    parser.add_argument("--seqs", type=int, default=0, help="sequences per rank per step (default 32; dry run 8)")
    parser.add_argument("--prompt", type=int, default=0, help="prompt tokens (default 512; dry run 32)")
    parser.add_argument("--response", type=int, default=0, help="response tokens (default 512; dry run 32)")
    parser.add_argument("--micro-batch-tokens", type=int, default=16384, help="learner.micro_batch_tokens")
    parser.add_argument("--logprob-chunk-tokens", type=int, default=0, help="learner.logprob_chunk_tokens (0: none)")
    args = parser.parse_args()
    from agentstream.config import AlgorithmConfig, LearnerConfig
    from learner.model import full_state_dict, init_distributed, load_policy, trainable_parameters
    from learner.step import StepOptions, train_step

    gpu = torch.cuda.is_available() and not args.dry_run
    torch.set_num_threads(1 if not gpu else torch.get_num_threads())
    rank, world, device = init_distributed("nccl" if gpu else "gloo")
    shape, dtype = (QWEN2_05B, "bfloat16") if gpu else (TINY, "float32")
    seqs, prompt, response = (
        args.seqs or (32 if gpu else 8),
        args.prompt or (512 if gpu else 32),
        args.response or (512 if gpu else 32),
    )
    log = (lambda *a: print(*a, flush=True)) if rank == 0 else (lambda *a: None)
    log(
        f"device {torch.cuda.get_device_name(device) if gpu else 'cpu (dry run)'}, world {world}, {dtype}, "
        f"torch {torch.__version__}"
    )
    # One folder every rank reads (kept for a rerun: writing 2 GB again costs time).
    folder = Path(
        os.environ.get("GPU_CHECK_MODEL_DIR")
        or Path(tempfile.gettempdir()) / f"agentstream-gpu-check-{'qwen2-0.5b' if gpu else 'tiny'}"
    )
    t0 = time.perf_counter()
    if rank == 0 and not (folder / "model.safetensors").exists():
        make_model_dir(shape, folder)
    dist.barrier()
    model = load_policy(str(folder), dtype, device, world)
    n_params = sum(p.numel() for p in model.parameters())  # sharded DTensors report the full count
    log(f"model: {n_params / 1e6:.1f}M parameters, made and sharded in {time.perf_counter() - t0:.1f}s")
    opts = StepOptions.from_config(
        LearnerConfig(micro_batch_tokens=args.micro_batch_tokens, logprob_chunk_tokens=args.logprob_chunk_tokens),
        AlgorithmConfig(),
    )
    optimizer = torch.optim.AdamW(trainable_parameters(model), lr=1e-6)
    batch = make_batch(rank, seqs, prompt, response, shape["vocab_size"])
    if gpu:
        torch.cuda.reset_peak_memory_stats(device)
    for k in range(2):  # warm-up: allocator, kernels, NCCL communicators
        train_step(model, optimizer, batch, opts, version=k, world_size=world, device=device)
    _sync(device)
    t0 = time.perf_counter()
    for k in range(args.steps):
        metrics = train_step(model, optimizer, batch, opts, version=2 + k, world_size=world, device=device)
    _sync(device)
    step_s = (time.perf_counter() - t0) / args.steps
    tokens = seqs * (prompt + response) * world  # every token goes through forward and backward
    achieved = (
        step_flops(n_params, shape["num_hidden_layers"], shape["hidden_size"], tokens, prompt + response) / step_s
    )
    ceiling = matmul_ceiling(device, torch.bfloat16 if gpu else torch.float32, 8192 if gpu else 512, 20 if gpu else 5)
    peak = peak_memory_gib(device)
    dist.barrier()
    t0 = time.perf_counter()
    state = full_state_dict(model)
    gather_s = time.perf_counter() - t0
    gathered = sum(v.numel() * v.element_size() for v in state.values()) if rank == 0 else 0
    log(
        f"train step: {step_s:.3f}s for {tokens} tokens ({world} ranks x {seqs} x ({prompt}+{response})), "
        f"log-prob chunks {args.logprob_chunk_tokens or 'none'}, "
        f"{metrics['micro_batches']:.0f} micro-batches/rank, loss {metrics['loss']:.4f}"
    )
    log(f"tokens/s: {tokens / step_s:,.0f}")
    log(
        f"MFU: {achieved / (ceiling * world):.1%} (model {achieved / 1e12:.2f} TFLOP/s; measured matmul ceiling "
        f"{ceiling / 1e12:.2f} TFLOP/s per device)"
    )
    log(f"peak memory: {peak:.2f} GiB ({'torch.cuda.max_memory_allocated' if gpu else 'peak RSS'}, rank 0)")
    log(f"gather full weights: {gather_s:.3f}s for {gathered / 1e6:.0f} MB ({gathered / gather_s / 1e9:.2f} GB/s)")
    del state
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
