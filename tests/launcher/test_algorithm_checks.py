"""Every `conf/algorithm/*.yaml` preset composes (`algorithm=NAME`) and validates; bad algorithm values
are refused with what to change."""

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from agentstream import config as C
from launcher.checks import algorithm_errors, reference_errors

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
    assert algorithm_errors(cfg.algorithm) == [] and reference_errors(cfg) == []


def test_presets_reach_their_fields() -> None:
    assert compose_algorithm([]).algorithm.advantage == "grpo"  # the default group entry
    cfg = compose_algorithm(["algorithm=gigpo", "algorithm.step_weight=0.5"])
    assert (cfg.algorithm.advantage, cfg.algorithm.gamma, cfg.algorithm.step_weight) == ("gigpo", 0.95, 0.5)
    assert compose_algorithm(["algorithm=ppo"]).algorithm.advantage == "gae"
    spin = compose_algorithm(["algorithm=spin"]).algorithm  # online_dpo's fields, then its own
    assert (spin.advantage, spin.loss_agg, spin.reference, spin.ref_update_every) == (
        "online_dpo",
        "token-sum",
        "frozen_copy",
        4,
    )


@pytest.mark.parametrize(
    "overrides, needle",
    [
        (["algorithm=online_dpo", "algorithm.reference=none"], "set algorithm.reference=frozen_copy (or train LoRA"),
        (
            ["algorithm=online_dpo", "algorithm.loss_agg=token-mean"],
            "set algorithm.loss_agg=token-sum (got 'token-mean'",
        ),
        (["algorithm=online_dpo", "algorithm.dpo_beta=0"], "algorithm.dpo_beta=0.0: must be > 0"),
        (["algorithm=spin", "algorithm.reference=none", "model.lora_rank=8"], "refreshes a frozen copy"),
        (["algorithm.ref_update_every=-1"], "algorithm.ref_update_every=-1: must be >= 0"),
    ],
)
def test_online_dpo_needs_a_reference_and_a_token_sum(overrides, needle) -> None:
    errors = reference_errors(compose_algorithm(overrides))
    assert any(needle in e for e in errors), errors


@pytest.mark.parametrize(
    "overrides, needle",
    [
        (["algorithm.advantage=ppo"], "algorithm.advantage='ppo' is unknown; known: gae, gigpo, grpo"),
        (["algorithm.off_policy=vtrace"], "known: decoupled, mis, none, tis"),
        (["algorithm.dual_clip=0.5"], "use a constant > 1"),
        (["algorithm.is_cap=1.0"], "the cap C must be > 1"),
        (["algorithm.loss_agg=sum"], "algorithm.loss_agg='sum' is unknown"),
    ],
)
def test_bad_algorithm_values_say_what_to_change(overrides, needle) -> None:
    errors = algorithm_errors(compose_algorithm(overrides).algorithm)
    assert any(needle in e for e in errors), errors
