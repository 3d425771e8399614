"""`distill.*` values that cannot work stop the launch with what to change (launcher/checks.py `distill_errors`); a
teacher whose tokenizer is not the student's is refused at launch (`tokenizer_errors`, called by launcher/run.py once
both directories exist) and one that shares it is accepted; the teachers' addresses and commands (launcher/wiring.py,
launcher/commands.py). ~15 s (two tiny models, one refused launch).

    .venv/bin/python -m pytest tests/launcher/test_distill_checks.py -q -p no:cacheprovider
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from agentstream.config import Config
from launcher.checks import distill_errors, tokenizer_errors
from launcher.commands import Commands
from launcher.wiring import wire

ROOT = Path(__file__).resolve().parents[2]
TEXTS = ["<action>left</action> the lake is frozen", "go up, then right; <action>down</action>"] * 20


def distilled(**values: object) -> Config:
    cfg = Config()
    cfg.distill.count, cfg.distill.model = 1, "/nonexistent/teacher"
    for key, value in values.items():
        setattr(cfg.distill, key, value)
    return cfg


@pytest.mark.parametrize(
    "values, needle",
    [
        ({"count": -1}, "distill.count=-1: must be >= 0"),
        ({"model": ""}, "distill.count > 0 needs distill.model"),
        ({}, "distill.model='/nonexistent/teacher' is not a Hugging Face model directory"),
        ({"task_reward": "both"}, "distill.task_reward='both' is unknown; use keep"),
        ({"coef": 0.0}, "distill.coef=0.0: must be a finite number > 0"),
        ({"coef": float("nan")}, "distill.coef=nan"),
        ({"timeout_s": 0.0}, "distill.timeout_s=0.0 (> 0)"),
        ({"retries": -1}, "distill.retries=-1 (>= 0)"),
        ({"max_restarts": -1}, "distill.max_restarts=-1 (>= 0)"),
    ],
)
def test_distill_values_that_cannot_work_say_what_to_change(values: dict, needle: str) -> None:
    errors = distill_errors(distilled(**values))
    assert any(needle in e for e in errors), errors


def test_the_gateway_is_refused_its_episodes_would_get_no_teacher_signal() -> None:
    cfg = distilled()
    cfg.gateway.enabled = True
    assert any("the gateway's episodes would be trained without a teacher's signal" in e for e in distill_errors(cfg))


def test_off_nothing_is_looked_at() -> None:
    assert distill_errors(Config()) == [] and distill_errors(distilled(count=0, task_reward="both")) == []


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    """(a tiny student with a BPE tokenizer of its own, a teacher with that tokenizer and other weights, a model whose
    tokenizer was trained to another vocabulary size)."""
    from launcher.tiny_model import make_tiny_model

    base = tmp_path_factory.mktemp("distill-models")
    student = make_tiny_model(base / "student", texts=TEXTS, vocab_size=300)
    teacher = make_tiny_model(base / "teacher", tokenizer_from=student, seed=1, hidden_size=64, num_heads=2)
    other = make_tiny_model(base / "other", texts=TEXTS, vocab_size=280)
    return student, teacher, other


def test_a_teacher_with_the_students_tokenizer_is_accepted_and_another_is_refused(models) -> None:
    from transformers import AutoTokenizer

    student, teacher, other = models
    # make_tiny_model(tokenizer_from=) gives the teacher the student's tokens and chat template
    s, t = AutoTokenizer.from_pretrained(student), AutoTokenizer.from_pretrained(teacher)
    assert s.get_vocab() == t.get_vocab() and s.chat_template == t.chat_template
    assert tokenizer_errors(str(student), str(teacher)) == []
    assert tokenizer_errors(str(student), str(student)) == []
    (error,) = tokenizer_errors(str(student), str(other))
    assert f"distill.model={str(other)!r} does not share the student's tokenizer" in error
    assert "vocabularies of" in error and f"--tokenizer-from {other}" in error


def test_the_launch_refuses_a_teacher_of_another_tokenizer_before_starting_anything(models, tmp_path: Path) -> None:
    student, _, other = models
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [
            sys.executable,
            "scripts/launch.py",
            f"run.output_dir={run_dir}",
            f"model.path={student}",
            "distill.count=1",
            f"distill.model={other}",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "does not share the student's tokenizer" in proc.stderr and "--tokenizer-from" in proc.stderr
    assert not (run_dir / "logs").exists() and not (run_dir / "config.yaml").exists()  # nothing was started


def test_teachers_get_ports_after_the_judges_and_the_engines_command_without_a_sidecar() -> None:
    cfg = Config()
    cfg.engines.count, cfg.engines.base_port = 2, 9000
    cfg.judges.count, cfg.distill.count, cfg.distill.model = 1, 2, "/models/teacher"
    w = wire(cfg)
    # engines 9000/9001 and 9002/9003 (each with its sidecar's port), the judge 9004, the teachers 9005 and 9006
    assert [u.rsplit(":", 1)[1] for u in w.judges + w.teachers] == ["9004", "9005", "9006"]
    commands = Commands(cfg, Path("runs/test"), w)
    teachers = commands.teachers()
    assert [(c.name, c.role) for c in teachers] == [("teacher-0", "teacher"), ("teacher-1", "teacher")]
    argv = teachers[1].argv
    assert argv[argv.index("--model") + 1] == "/models/teacher" and argv[argv.index("--port") + 1] == "9006"
    actor = commands.actor(0).argv
    assert [actor[i + 1] for i, a in enumerate(actor) if a == "--teacher"] == w.teachers
