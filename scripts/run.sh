#!/usr/bin/env bash
# Set everything up (idempotent) and run a job; arguments are Hydra overrides.
#   bash scripts/run.sh                          # the main job: the tiny local model learns FrozenLake (CPU, minutes)
#   bash scripts/run.sh trainer.total_steps=20
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/setup.sh"
cd "$ROOT"
# The main job is preset=cpu_learn (the tiny model learns FrozenLake); a preset on the command line replaces it.
PRESET="preset=cpu_learn"
for arg in "$@"; do [[ "$arg" == preset=* ]] && PRESET=""; done
exec "$ROOT/.venv/bin/python" scripts/launch.py ${PRESET:+"$PRESET"} "$@"
