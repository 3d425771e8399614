"""Slurm: `sbatch scripts/slurm/agentstream.sbatch` on a one-node Slurm 22.05 cluster started on this machine
(`scripts/slurm/local_slurm.sh`: Debian's slurm-wlm, munge, slurmctld and slurmd on 127.0.0.1), ~40 s.

The job starts a Ray head on its node (127.0.0.2: tests stay on loopback), then the launch with
launcher.backend=ray: a one-step Sokoban run with PPO (a critic), on the session's vLLM server
(`engines.external_urls`, its weight sidecar placed by Ray). This is the suite's end-to-end run of Sokoban and of
the PPO preset (tests/test_e2e_envs.py runs ALFWorld): the summary is checked as there, and nothing of the job
(Ray, the run's processes) may be left once it ended.
"""

import json
import os
import subprocess
import time
from pathlib import Path

import pytest
from e2e_testing import processes_mentioning

from agentstream.wire.addresses import free_port
from launcher.procs import RUN_ENV, marked

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.e2e
IP = "127.0.0.2"  # Ray replaces 127.0.0.1 by the machine's other interface (FACTS.md)


@pytest.fixture(scope="module")
def slurm(tmp_path_factory: pytest.TempPathFactory):
    """SLURM_CONF of a one-node cluster started for this module, stopped after it."""
    folder = tmp_path_factory.mktemp("slurm")
    out = subprocess.run(
        ["bash", "scripts/slurm/local_slurm.sh", "start", str(folder)],
        cwd=ROOT,
        text=True,
        capture_output=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    conf = out.stdout.strip().removeprefix("export SLURM_CONF=")
    try:
        yield conf
    finally:
        subprocess.run(["bash", "scripts/slurm/local_slurm.sh", "stop", str(folder)], cwd=ROOT, timeout=60)


def test_sbatch_runs_a_ppo_run_on_ray_and_leaves_nothing(slurm: str, tiny_engine, tmp_path: Path) -> None:
    model, url = tiny_engine
    run_dir = tmp_path / "run"
    env = {
        **os.environ,
        "SLURM_CONF": slurm,
        "AGENTSTREAM_NODE_IP": IP,
        "RAY_PORT": str(free_port(IP)),
        "RAY_DASHBOARD_PORT": "0",
    }
    cpu = [f"++launcher.resources.{role}.CPU=0.25" for role in ("broker", "engine", "learner", "actor")]  # 2 CPUs
    job = subprocess.run(
        [
            "sbatch",
            "--parsable",
            "-n",
            "1",
            "-c",
            "2",
            "--export=ALL",
            "-o",
            str(tmp_path / "job.out"),
            "scripts/slurm/agentstream.sbatch",
            f"run.output_dir={run_dir}",
            f"model.path={model}",
            f"engines.external_urls=[{url}]",
            "env.name=agentstream/Sokoban-v0",
            "algorithm=ppo",
            "learner.world_size=1",
            "actors.count=1",
            "actors.episodes_per_actor=2",
            "env.group_size=2",
            "trainer.groups_per_step=1",
            "trainer.total_steps=1",
            "env.max_steps=3",
            "sampling.max_tokens=12",
            "broker.dashboard_port=0",
            "run.shutdown_timeout_s=5",
            *cpu,
        ],
        cwd=ROOT,
        env=env,
        text=True,
        capture_output=True,
        timeout=60,
    )
    assert job.returncode == 0, job.stderr
    job_id = job.stdout.strip().split(";")[0]
    deadline = time.time() + 600
    while subprocess.run(["squeue", "-h", "-j", job_id], env=env, capture_output=True, text=True).stdout.strip():
        assert time.time() < deadline, (tmp_path / "job.out").read_text()[-3000:]
        time.sleep(2)
    log = (tmp_path / "job.out").read_text()
    assert (run_dir / "summary.json").exists(), log[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["processes_left"] == [], (summary["reason"], log[-2000:])
    assert summary["learner_version"] == 1 and summary["engine_versions"] == {"engine-0": 1}
    assert summary["transitions_sent_reported"] == summary["transitions_sent"] == summary["transitions_ingested"] > 0
    assert summary["trained_group_shapes"] == {"2/2": 1}
    assert any(k.startswith("critic") for k in summary["learner_metrics"]), summary["learner_metrics"]
    assert f"Ray cluster at {IP}:" in log  # the job's own Ray, on this node
    assert not marked(RUN_ENV, str(run_dir.resolve())) and processes_mentioning(str(run_dir)) == []
    assert processes_mentioning(f"/tmp/ray-{job_id}") == []  # the job's Ray stopped with it
