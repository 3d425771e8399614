"""The benchmarks' smoke tests run after every other folder of tests/ (before the end-to-end runs at the top): the
weight benchmark trains the session's spare vLLM server, and tests/engines/test_engines_vllm.py needs its model's
own weights when it starts (tests/conftest.py, `spare_engine`)."""

from __future__ import annotations

from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    ours = [item for item in items if HERE in item.path.parents]
    rest = [item for item in items if HERE not in item.path.parents]
    in_folders = [k for k, item in enumerate(rest) if item.path.parent != HERE.parent]
    at = in_folders[-1] + 1 if in_folders else 0
    items[:] = [*rest[:at], *ours, *rest[at:]]
