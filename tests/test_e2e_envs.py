"""A launcher run completes on every environment, and with the GiGPO and PPO presets (on two of the envs).

One real vLLM server (the tiny model) serves every run through `engines.external_urls`: the launcher
starts broker, weight sidecar, learner (1 rank) and an actor for each run, and the learner first brings
the server to its own initial weights (version 0) before any group is admitted.
"""

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import envs
from agentstream.config import Config
from agentstream.wire.addresses import free_port
from launcher.procs import start, stop
from launcher.tiny_model import make_tiny_model

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    import asyncio

    from engines.server import server_command, wait_ready

    model = make_tiny_model(tmp_path_factory.mktemp("model") / "tiny")
    cfg = Config()
    cfg.model.path = str(model)
    port = free_port()
    argv, env = server_command(cfg.model, cfg.engines, port)
    proc = start(argv, tmp_path_factory.mktemp("logs") / "engine.log", env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        asyncio.run(wait_ready(url, 240))
        yield str(model), url
    finally:
        stop(proc, 20)


def launch(tmp_path: Path, model: str, url: str, *overrides: str) -> dict:
    run_dir = tmp_path / "run"
    argv = [sys.executable, "scripts/launch.py", f"run.output_dir={run_dir}", f"model.path={model}",
            "engines.count=1", f"engines.external_urls=[{url}]", "learner.world_size=1", "actors.count=1",
            "actors.episodes_per_actor=2", "env.group_size=2", "trainer.groups_per_step=1",
            "trainer.total_steps=1", "env.max_steps=3", "sampling.max_tokens=12",
            f"broker.dashboard_port={free_port()}", "run.shutdown_timeout_s=5", *overrides]
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGINT)  # the launcher stops its children; then report what it printed
        out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, f"{out[-2000:]}\n{err[-3000:]}"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["processes_left"] == []
    assert summary["learner_version"] == 1 and summary["engine_versions"] == {"engine-0": 1}
    assert summary["transitions_sent"] == summary["transitions_ingested"] > 0
    assert summary["trained_group_shapes"] == {"2/2": 1}
    return summary


# Two of the env runs also cover a non-default algorithm preset (one run each instead of two: the suite's time).
ALGORITHM_FOR = {"agentstream/FrozenLake-v0": "gigpo", "agentstream/Sokoban-v0": "ppo"}


@pytest.mark.parametrize("name", envs.known_envs())
def test_a_run_completes_on_every_env(server, tmp_path: Path, name: str) -> None:
    model, url = server
    algorithm = ALGORITHM_FOR.get(name)
    summary = launch(tmp_path, model, url, f"env.name={name}", *([f"algorithm={algorithm}"] if algorithm else []))
    if algorithm == "ppo":  # the critic trained beside the policy
        assert any(k.startswith("critic") for k in summary["learner_metrics"]), summary["learner_metrics"]


def test_each_algorithm_preset_has_an_env_run() -> None:
    assert set(ALGORITHM_FOR.values()) == {"gigpo", "ppo"}
    assert set(ALGORITHM_FOR) <= set(envs.known_envs())
