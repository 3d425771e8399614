"""`judges.*` values that cannot work stop the launch with what to change (launcher/checks.py `judges_errors`),
and the judges' addresses (launcher/wiring.py) and commands (launcher/supervisor.py). <1 s.

    .venv/bin/python -m pytest tests/launcher/test_judges_checks.py -q -p no:cacheprovider
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from agentstream.config import Config, ConfigError
from launcher.checks import check_config, judges_errors
from launcher.supervisor import Launcher
from launcher.wiring import wire


def judged(**values: object) -> Config:
    cfg = Config()
    cfg.run.output_dir = "runs/test"
    cfg.judges.count = 1
    for key, value in values.items():
        setattr(cfg.judges, key, value)
    return cfg


def test_the_defaults_pass_with_and_without_judges() -> None:
    assert judges_errors(Config()) == [] and judges_errors(judged()) == []
    # Off, nothing else of judges.* is looked at.
    off = judged(combine="max")
    off.judges.count = 0
    assert judges_errors(off) == []


@pytest.mark.parametrize(
    "values, needle",
    [
        ({"count": -1}, "judges.count=-1: must be >= 0"),
        ({"score_pattern": "Score: ("}, "judges.score_pattern='Score: (' is not a regular expression"),
        ({"score_pattern": r"\d+"}, "has no group: put the score in parentheses"),
        (
            {"template": "{task} {answer}"},
            "judges.template names {answer}, which is not a placeholder; the placeholders are {task}, {transcript}, "
            "{final_observation}, {env_return}, {steps}, {success}",
        ),
        ({"template": "{"}, "judges.template does not parse"),
        ({"combine": "max"}, "judges.combine='max' is unknown; use one of add, replace, multiply"),
        ({"model": "/nonexistent/judge"}, "judges.model='/nonexistent/judge' is not a Hugging Face model directory"),
        ({"default_score": float("nan")}, "both must be finite numbers"),
        ({"weight": float("inf")}, "both must be finite numbers"),
        ({"max_tokens": 0}, "judges.max_tokens=0: must be at least 1"),
        ({"max_tokens": 1024}, "leave room for the prompt within engines.max_model_len=1024"),
        ({"timeout_s": 0.0}, "judges.timeout_s=0.0 (> 0)"),
        ({"temperature": -1.0}, "judges.temperature=-1.0 (>= 0; 0 = greedy)"),
        ({"max_restarts": -1}, "judges.max_restarts=-1 (>= 0)"),
    ],
)
def test_judge_values_that_cannot_work_say_what_to_change(values: dict, needle: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(needle)):
        check_config(judged(**values))


def test_judges_get_ports_of_their_own_after_the_engines_and_a_server_without_a_sidecar(tmp_path: Path) -> None:
    cfg = judged(model="")
    cfg.judges.count, cfg.engines.count, cfg.engines.base_port = 2, 2, 9000
    cfg.model.lora_rank = 8  # the policy trains LoRA; the judge serves its model as it is
    w = wire(cfg)
    # Engine i at 9000 + 2i, its sidecar at + 1: 9000..9003; judges after them.
    assert w.engines == ["http://127.0.0.1:9000", "http://127.0.0.1:9002"]
    assert w.judges == ["http://127.0.0.1:9004", "http://127.0.0.1:9005"]
    launcher = Launcher(cfg, tmp_path, w)
    judges = launcher.commands.judges()
    assert [(c.name, c.role) for c in judges] == [("judge-0", "judge"), ("judge-1", "judge")]
    argv = judges[1].argv
    assert argv[argv.index("--model") + 1] == cfg.model.path  # judges.model empty: the run's initial weights
    assert argv[argv.index("--port") + 1] == "9005" and "--enable-lora" not in argv
    actor = launcher.commands.actor(0).argv
    assert [actor[i + 1] for i, a in enumerate(actor) if a == "--judge"] == w.judges
    assert not any(c.name.startswith("sidecar-judge") for c in launcher.commands.engines())
    assert all(
        launcher.commands.sidecar(i).argv[launcher.commands.sidecar(i).argv.index("--url") + 1] in w.engines
        for i in range(2)
    )  # every weight sidecar serves an engine, none a judge


def test_a_joining_actors_launch_starts_judges_of_its_own_for_the_runs_judges(tmp_path: Path) -> None:
    from omegaconf import OmegaConf

    from agentstream.wire.messages import Welcome
    from launcher.join import join_wiring, joined_config

    run = judged(combine="replace")
    run.run.output_dir = "runs/main"
    local = Config()
    local.run.output_dir, local.run.role, local.broker.address = "runs/join", "actors", "tcp://10.0.0.5:5555"
    welcome = Welcome(
        engines=["http://e:1"], weights="tcp://10.0.0.5:5556", config=OmegaConf.to_yaml(OmegaConf.structured(run))
    )
    cfg = joined_config(local, welcome)
    assert (cfg.judges.count, cfg.judges.combine) == (1, "replace")  # the run's judging, so rewards stay comparable
    wiring = join_wiring(cfg, welcome)
    assert len(wiring.judges) == 1 and wiring.judges[0].startswith("http://127.0.0.1:")  # this host's own judge
    launcher = Launcher(cfg, tmp_path, wiring, prefix="h-1-")
    assert [c.name for c in launcher.commands.judges()] == ["judge-h-1-0"]
    assert launcher.commands.actor(0).argv[-2:] == ["--judge", wiring.judges[0]]
