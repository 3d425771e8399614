"""Make the tiny local model directory (Qwen2 + a BPE tokenizer trained on the envs' text).

    .venv/bin/python scripts/make_tiny_model.py --out .cache/tiny-model
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from agentstream.config import TINY_MODEL_DIR  # noqa: E402
from launcher.tiny_model import make_tiny_model  # noqa: E402

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(TINY_MODEL_DIR), help="output directory")
    parser.add_argument("--seed", type=int, default=0, help="weights and corpus seed")
    args = parser.parse_args()
    print(make_tiny_model(args.out, seed=args.seed))
