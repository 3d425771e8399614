"""pytest runs with --import-mode=importlib: let end-to-end tests import their helpers (tests/e2e_testing.py)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
