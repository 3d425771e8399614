"""Make the tiny local model directory (Qwen2 + a BPE tokenizer trained on the envs' text), or with --vl the tiny
vision-language one (Idefics3, SmolVLM's architecture, with the same tokenizer: launcher/tiny_vl_model.py).

    .venv/bin/python scripts/make_tiny_model.py --out .cache/tiny-model
    .venv/bin/python scripts/make_tiny_model.py --out .cache/small-model --hidden-size 512 --layers 4 --heads 8 \
        --kv-heads 4    # 4x wider, 2x deeper (python -m bench.peer --model .cache/small-model; docs/benchmarks.md)
    .venv/bin/python scripts/make_tiny_model.py --vl --out .cache/tiny-vl-model
    .venv/bin/python scripts/make_tiny_model.py --tokenizer-from .cache/smollm2-135m-instruct \
        --out .cache/tiny-smollm2-student    # a student with its teacher's tokenizer (docs/distillation.md)
"""

import argparse

from agentstream.config import TINY_MODEL_DIR, TINY_VL_MODEL_DIR
from launcher.tiny_model import make_tiny_model
from launcher.tiny_vl_model import make_tiny_vl_model

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--out", default=None, help=f"output directory (default {TINY_MODEL_DIR}, with --vl {TINY_VL_MODEL_DIR})"
    )
    parser.add_argument("--seed", type=int, default=0, help="weights and corpus seed")
    parser.add_argument("--vl", action="store_true", help="the tiny vision-language model (Idefics3)")
    parser.add_argument("--hidden-size", type=int, default=128, help="Qwen2 model: hidden size")
    parser.add_argument("--layers", type=int, default=2, help="Qwen2 model: decoder layers")
    parser.add_argument("--heads", type=int, default=4, help="Qwen2 model: attention heads")
    parser.add_argument("--kv-heads", type=int, default=2, help="Qwen2 model: key/value heads")
    parser.add_argument(
        "--vocab-size",
        type=int,
        default=512,
        help="Qwen2 model: BPE tokens to learn from the envs' text (2048: whole move words)",
    )
    parser.add_argument(
        "--tokenizer-from",
        default=None,
        help="Qwen2 model: take the tokenizer (and chat template) of this model directory instead of training one "
        "(a distillation student that shares its teacher's tokenizer)",
    )
    args = parser.parse_args()
    if args.vl:
        print(make_tiny_vl_model(args.out or TINY_VL_MODEL_DIR, seed=args.seed))
    else:
        print(
            make_tiny_model(
                args.out or TINY_MODEL_DIR,
                seed=args.seed,
                hidden_size=args.hidden_size,
                num_layers=args.layers,
                num_heads=args.heads,
                num_kv_heads=args.kv_heads,
                vocab_size=args.vocab_size,
                tokenizer_from=args.tokenizer_from,
            )
        )
