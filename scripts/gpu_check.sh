#!/usr/bin/env bash
# GPU check of the learner's FSDP2 training step (bench/gpu_check.py says what it prints).
#
#   bash scripts/gpu_check.sh              # CUDA + NCCL + bf16, ~0.5B random Qwen2; NPROC=8 for 8 GPUs
#   bash scripts/gpu_check.sh --dry-run    # CPU + gloo + float32, a tiny model (works anywhere, ~30 s)
#
# Python: $PYTHON, else .venv/bin/python when it exists, else python3 (a GPU machine's own PyTorch). It must
# have torch, transformers, numpy, msgpack, safetensors and omegaconf; the check below says what is missing.
# The whole check stops after GPU_CHECK_TIMEOUT_S seconds (default 480: it must fit in 8 minutes).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-}"
if [ -z "$PY" ]; then
    if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
"$PY" - <<'PYEOF'
import importlib.util
import sys

missing = [m for m in ("torch", "transformers", "numpy", "msgpack", "safetensors", "omegaconf")
           if importlib.util.find_spec(m) is None]
if missing:
    sys.exit(f"gpu_check: {sys.executable} cannot import {missing}; install them into it, or point PYTHON= at a "
             f"Python that has them (pip install {' '.join(missing)})")
PYEOF
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
exec timeout "${GPU_CHECK_TIMEOUT_S:-480}" "$PY" -m torch.distributed.run --standalone \
    --nproc-per-node "${NPROC:-1}" -m bench.gpu_check "$@"
