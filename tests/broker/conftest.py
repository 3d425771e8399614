"""The broker's tests: pytest runs with --import-mode=importlib, so their helper module (broker_testing) is put on
the path here."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
