"""Generation alone: a vLLM server as every engine is started (one compute thread on CPU) against Hugging Face
`generate` in this process (TRL's generation, 2 torch threads), on one model and the same batches; nothing
else runs.

    .venv/bin/python -m bench.generate [--shapes 1x1,2x8,8x8] [--tokens 32] [--prompt-tokens 133]
    .venv/bin/python -m bench.generate --model .cache/small-model

A shape RxN is R distinct prompts of `--prompt-tokens` random token ids, each answered N times (vLLM: R
concurrent requests of n = N, as the actors send a group's first turns; HF: one `generate` of the R prompts with
num_return_sequences = N), `--tokens` sampled tokens per answer (temperature 1, the end-of-sequence token ignored
by both). vLLM also returns each token's log-prob (the actors need them); HF returns the tokens only (TRL
recomputes log-probs in its loss). Every batch has prompts of its own (none is in vLLM's prefix cache), the same
for both. Per shape: the median wall time of `--repeats` batches after one warm-up, the time one sampled token
costs a whole batch (wall / tokens), and last vLLM's time over HF's.

It isolates what `bench.peer`'s synchronous step waits on: on the tiny model one answer from the
engine takes about as long as HF's batch of sixteen (docs/benchmarks.md).
"""

from __future__ import annotations

import asyncio
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from bench import harness


@dataclass(frozen=True)
class Shape:
    """R prompts, each answered N times."""

    prompts: int
    answers: int

    @classmethod
    def parse(cls, text: str) -> "Shape":
        try:
            prompts, answers = (int(part) for part in text.lower().split("x"))
        except ValueError:
            raise SystemExit(f"--shapes: {text!r} is not RxN (R prompts, N answers each), e.g. 2x8") from None
        if prompts < 1 or answers < 1:
            raise SystemExit(f"--shapes: {text!r} needs R >= 1 and N >= 1")
        return cls(prompts, answers)

    def __str__(self) -> str:
        return f"{self.prompts}x{self.answers}"


def prompts_of(shape: Shape, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """`shape.prompts` distinct prompts of `length` token ids drawn from 10 to `vocab` - 1 (the tiny model's
    special tokens are 0, 1 and 2)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    return [rng.integers(10, vocab, size=length).tolist() for _ in range(shape.prompts)]


async def engine_times(
    url: str, model_dir: str, shapes: list[Shape], batches: list[list[list[list[int]]]], tokens: int
) -> list[list[float]]:
    """Wall seconds of each shape's batches on the vLLM server at `url`, the first a warm-up left out: a batch is
    its prompts sent at once, the shape's answers each, through the actors' client (token ids out, decoded here)."""
    import aiohttp
    from transformers import AutoTokenizer

    from agentstream.config import SamplingConfig
    from engines.client import EngineClient, text_decoder

    sampling = SamplingConfig(max_tokens=tokens, temperature=1.0)
    out = []
    async with aiohttp.ClientSession() as session:
        decode = text_decoder(AutoTokenizer.from_pretrained(model_dir))
        engine = EngineClient(url, session, timeout_s=120, decode=decode)

        async def run(prompts: list[list[int]], n: int) -> float:
            t0 = time.perf_counter()
            gens = await asyncio.gather(*(engine.sample(p, sampling, n=n, extra={"ignore_eos": True}) for p in prompts))
            wall = time.perf_counter() - t0
            lengths = {len(g.response_ids) for group in gens for g in group}
            if lengths != {tokens}:
                raise RuntimeError(f"the engine answered {sorted(lengths)} tokens where {tokens} were asked for")
            return wall

        for shape, runs in zip(shapes, batches, strict=True):
            out.append([await run(prompts, shape.answers) for prompts in runs][1:])
    return out


def hf_times(
    model_dir: str, shapes: list[Shape], batches: list[list[list[list[int]]]], tokens: int, threads: int
) -> list[list[float]]:
    """The same batches through Hugging Face `generate` on `threads` torch threads, as TRL samples a step's
    prompts (one call, num_return_sequences answers each; equal-length prompts need no padding)."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    def run(prompts: list[list[int]], n: int) -> float:
        ids = torch.tensor(prompts)
        t0 = time.perf_counter()
        with torch.no_grad():
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                max_new_tokens=tokens,
                min_new_tokens=tokens,
                num_return_sequences=n,
                pad_token_id=model.config.pad_token_id,
            )
        wall = time.perf_counter() - t0
        if out.shape != (len(prompts) * n, ids.shape[1] + tokens):
            raise RuntimeError(f"HF generate gave {tuple(out.shape)} for {len(prompts)} x {n} answers of {tokens}")
        return wall

    return [[run(prompts, shape.answers) for prompts in runs][1:] for shape, runs in zip(shapes, batches, strict=True)]


def table(shapes: list[Shape], engine: list[list[float]], hf: list[list[float]], tokens: int) -> list[str]:
    """One row per shape (medians in ms; per token = the batch's wall over `tokens`), then vLLM/HF last."""
    rows = [f"{'shape':>6} {'answers':>7} {'vLLM ms':>8} {'HF ms':>8} {'vLLM ms/token':>13} {'HF ms/token':>11}"]
    ratios = []
    for shape, e, h in zip(shapes, engine, hf, strict=True):
        e_ms, h_ms = statistics.median(e) * 1000, statistics.median(h) * 1000
        rows.append(
            f"{str(shape):>6} {shape.prompts * shape.answers:>7} {e_ms:>8.0f} {h_ms:>8.0f} "
            f"{e_ms / tokens:>13.2f} {h_ms / tokens:>11.2f}"
        )
        ratios.append(f"{shape}: {e_ms / h_ms:.2f}x")
    rows.append("vLLM's time over HF generate's (above 1: the engine is slower): " + ", ".join(ratios))
    return rows


def main() -> None:
    parser = harness.arguments(__doc__, model=True, engine_url=True)
    parser.add_argument("--shapes", default="1x1,2x8,8x8", help="RxN: R prompts, N answers each (comma-separated)")
    parser.add_argument("--tokens", type=int, default=32, help="sampled tokens per answer")
    parser.add_argument("--prompt-tokens", type=int, default=133, help="prompt length (bench.peer's prompts: 133)")
    parser.add_argument("--repeats", type=int, default=8, help="timed batches per shape (after one warm-up)")
    parser.add_argument("--hf-threads", type=int, default=2, help="torch threads for HF generate (TRL's: 2 here)")
    args = parser.parse_args()
    shapes = [Shape.parse(s) for s in args.shapes.split(",")]
    if args.tokens < 1 or args.repeats < 1 or args.prompt_tokens < 1:
        raise SystemExit("--tokens, --repeats and --prompt-tokens must be at least 1")

    from transformers import AutoConfig

    model = harness.model_dir(args.model)
    vocab = AutoConfig.from_pretrained(model).vocab_size
    # new prompts for every batch, the same for both (vLLM's prefix cache never holds a prompt it is timed on)
    batches = [
        [prompts_of(s, args.prompt_tokens, vocab, seed=i * 1000 + k) for k in range(args.repeats + 1)]
        for i, s in enumerate(shapes)
    ]
    print(harness.load_line(), flush=True)
    engine = f"at {args.engine_url}" if args.engine_url else "as the launcher starts it (1 compute thread on CPU)"
    print(
        f"# {Path(model).name}: {args.prompt_tokens}-token prompts, {args.tokens} tokens per answer, "
        f"temperature 1.0; vLLM {engine}, HF generate on {args.hf_threads} threads; medians of {args.repeats}",
        flush=True,
    )
    with (
        tempfile.TemporaryDirectory(prefix="bench-generate-") as folder,
        harness.vllm_server(model, Path(folder), args.engine_url) as url,
    ):
        times = asyncio.run(engine_times(url, model, shapes, batches, args.tokens))
    hf = hf_times(model, shapes, batches, args.tokens, args.hf_threads)  # with the server gone
    print("\n".join(table(shapes, times, hf, args.tokens)), flush=True)


if __name__ == "__main__":
    main()
