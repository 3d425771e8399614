#!/usr/bin/env bash
# Set everything up (idempotent) and run the test suite; arguments go to pytest.
#   bash scripts/test.sh                 # everything, end-to-end runs included
#   bash scripts/test.sh -m "not e2e"    # skip the runs that start vLLM and torchrun
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/setup.sh"
cd "$ROOT"
exec "$ROOT/.venv/bin/python" -m pytest -ra --durations=30 "$@"
