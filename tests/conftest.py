"""Fixtures of the whole suite: vLLM servers of the tiny model (the end-to-end tests' helpers: tests/e2e_testing.py).
One vLLM server of the tiny model is shared by the session's tests that only generate or bring it to their own
weights (each launcher run through `engines.external_urls` first publishes its version 0): the benchmarks and the
per-env runs. A second one, `spare_engine`, is for the tests that change its weights or stop it for a while. A
server takes ~40 s to start here; the suite's time."""

import asyncio
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest


@dataclass(frozen=True)
class VllmServer:
    model: str  # its model directory (a tiny model of its own)
    url: str
    proc: subprocess.Popen  # the API server, leader of the process group that holds the engine core
    log: Path


def serve_tiny_model(
    tmp_path_factory: pytest.TempPathFactory, max_model_len: int | None = None, tied: bool = True
) -> Iterator[VllmServer]:
    """A vLLM server of a freshly made tiny model (`tied`: its LM head is its embedding): `serve_model`."""
    from launcher.tiny_model import make_tiny_model

    yield from serve_model(
        tmp_path_factory, make_tiny_model(tmp_path_factory.mktemp("model") / "tiny", tied=tied), max_model_len
    )


def serve_model(
    tmp_path_factory: pytest.TempPathFactory, model: Path, max_model_len: int | None = None, lora_rank: int = 0
) -> Iterator[VllmServer]:
    """A vLLM server of the model directory `model`, started as every engine is (with LoRA adapters of up to
    `lora_rank` when > 0), until the generator closes; then its whole process group is stopped and checked gone."""
    from agentstream.config import Config
    from agentstream.wire.addresses import free_port
    from engines.server import server_command, wait_ready
    from launcher.procs import start, stop, wait_gone

    cfg = Config()
    cfg.model.path = str(model)
    cfg.model.lora_rank = lora_rank
    if max_model_len:
        cfg.engines.max_model_len = max_model_len
    port = free_port()
    argv, env = server_command(cfg.model, cfg.engines, port)
    log = tmp_path_factory.mktemp("logs") / "engine.log"
    proc = start(argv, log, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        try:
            asyncio.run(wait_ready(url, 300, proc=proc))
        except Exception as exc:
            pytest.fail(f"{exc}\n--- server log tail ---\n{log.read_text()[-3000:]}")
        yield VllmServer(cfg.model.path, url, proc, log)
    finally:
        stop(proc, 30)
        assert wait_gone([proc.pid], 15) == [], f"vLLM server {url} left processes of its group behind"


@pytest.fixture(scope="session")
def serving(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Iterator[VllmServer]]:
    """`serve_model` for a test's own model directory: `for server in serving(model_dir): ...`."""
    return lambda model, max_model_len=None, lora_rank=0: serve_model(tmp_path_factory, model, max_model_len, lora_rank)


@pytest.fixture(scope="session")
def tiny_engine(tmp_path_factory: pytest.TempPathFactory):
    """(model directory, base URL) of a vLLM server of the tiny model, up for the whole session; tests only
    generate on it or bring it to their own weights."""
    for server in serve_tiny_model(tmp_path_factory):
        yield server.model, server.url


@pytest.fixture(scope="session")
def spare_engine(tmp_path_factory: pytest.TempPathFactory):
    """A second vLLM server (`VllmServer`) of a tiny model of its own (max_model_len 1024), up for the whole
    session, for tests that change its weights or stop it for a while and resume it. tests/engines/test_engines_vllm.py
    expects the model's own weights labelled version 0 as it starts: the tests before it leave the server so
    (tests/actors/test_faults.py only stops it, the partition test in tests/broker/test_faults.py publishes the
    model's own weights and labels them 0 again); the weight benchmark (tests/bench/test_benchmarks.py, which
    tests/bench/conftest.py runs after it) trains them."""
    yield from serve_tiny_model(tmp_path_factory, max_model_len=1024)


@pytest.fixture(scope="module")
def untied_engine(tmp_path_factory: pytest.TempPathFactory):
    """A vLLM server of a tiny model whose LM head is a weight of its own (`VllmServer`), for one test module."""
    yield from serve_tiny_model(tmp_path_factory, tied=False)


@pytest.fixture(scope="module")
def one_rank() -> Iterator[None]:
    """One gloo rank in this process (world size 1): what FSDP2 needs to shard a model here."""
    import os

    import torch
    import torch.distributed as dist

    from agentstream.wire.addresses import free_port

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the server needs the other core
    env = dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    dist.init_process_group("gloo")
    try:
        yield
    finally:
        dist.destroy_process_group()
        for k, v in old.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
        torch.set_num_threads(threads)
