"""Every `conf/algorithm/*.yaml` preset composes (`algorithm=NAME`) and validates; bad algorithm values
are refused with what to change."""

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from agentstream import config as C
from launcher.checks import algorithm_errors

CONF = Path(__file__).resolve().parents[2] / "conf"
C.register_schemas()


def compose_algorithm(overrides: list[str]) -> C.Config:
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        cfg = compose(config_name="config", overrides=overrides)
    cfg.run.output_dir = "runs/test"
    return C.to_object(cfg)


@pytest.mark.parametrize("path", sorted((CONF / "algorithm").glob("*.yaml")), ids=lambda p: p.stem)
def test_every_algorithm_preset_composes_and_validates(path: Path) -> None:
    cfg = compose_algorithm([f"algorithm={path.stem}"])
    assert algorithm_errors(cfg.algorithm) == []


def test_presets_reach_their_fields() -> None:
    assert compose_algorithm([]).algorithm.advantage == "grpo"  # the default group entry
    cfg = compose_algorithm(["algorithm=gigpo", "algorithm.step_weight=0.5"])
    assert (cfg.algorithm.advantage, cfg.algorithm.gamma, cfg.algorithm.step_weight) == ("gigpo", 0.95, 0.5)
    assert compose_algorithm(["algorithm=ppo"]).algorithm.advantage == "gae"


@pytest.mark.parametrize("overrides, needle", [
    (["algorithm.advantage=ppo"], "algorithm.advantage='ppo' is unknown; known: gae, gigpo, grpo"),
    (["algorithm.off_policy=vtrace"], "known: decoupled, mis, none, tis"),
    (["algorithm.dual_clip=0.5"], "use a constant > 1"),
    (["algorithm.is_cap=1.0"], "the cap C must be > 1"),
    (["algorithm.loss_agg=sum"], "algorithm.loss_agg='sum' is unknown"),
])
def test_bad_algorithm_values_say_what_to_change(overrides, needle) -> None:
    errors = algorithm_errors(compose_algorithm(overrides).algorithm)
    assert any(needle in e for e in errors), errors
