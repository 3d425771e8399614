#!/usr/bin/env bash
# Set everything up (idempotent) and run the test suite; arguments go to pytest.
#   bash scripts/test.sh                 # everything, end-to-end runs included
#   bash scripts/test.sh -m "not e2e"    # skip the runs that start vLLM and torchrun
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/setup.sh" full
cd "$ROOT"
# The formatter, the linter and the ground layer's type check (pyproject.toml: [tool.ruff], [tool.mypy]) first.
"$ROOT/.venv/bin/ruff" format --check --quiet . || { echo "[test] run: .venv/bin/ruff format ." >&2; exit 1; }
"$ROOT/.venv/bin/ruff" check --quiet . || { echo "[test] ruff check failed; .venv/bin/ruff check --fix . mends some" >&2; exit 1; }
"$ROOT/.venv/bin/mypy" || { echo "[test] mypy failed on the ground layer (agentstream/)" >&2; exit 1; }
exec "$ROOT/.venv/bin/python" -m pytest -ra --durations=30 "$@"
