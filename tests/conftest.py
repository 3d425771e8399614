"""pytest runs with --import-mode=importlib: let end-to-end tests import their helpers (tests/e2e_testing.py).
One vLLM server of the tiny model is shared by the session's tests that only generate or bring it to their own
weights (each launcher run through `engines.external_urls` first publishes its version 0): the benchmarks and the
per-env runs. A server takes ~40 s to start here; the suite's time."""

import asyncio
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))


@pytest.fixture(scope="session")
def tiny_engine(tmp_path_factory: pytest.TempPathFactory):
    """(model directory, base URL) of a vLLM server of a freshly made tiny model, up for the whole session."""
    from agentstream.config import Config
    from agentstream.wire.addresses import free_port
    from engines.server import server_command, wait_ready
    from launcher.procs import start, stop
    from launcher.tiny_model import make_tiny_model

    cfg = Config()
    cfg.model.path = str(make_tiny_model(tmp_path_factory.mktemp("model") / "tiny"))
    port = free_port()
    argv, env = server_command(cfg.model, cfg.engines, port)
    proc = start(argv, tmp_path_factory.mktemp("logs") / "engine.log", env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        asyncio.run(wait_ready(url, 300, proc=proc))
        yield cfg.model.path, url
    finally:
        stop(proc, 20)
