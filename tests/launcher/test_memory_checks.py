"""MemoryConfig values that cannot work are refused before a run starts, saying what to change."""

import pytest

from agentstream import config as C
from launcher.checks import check_config


def test_default_budget_is_what_the_engine_accepts() -> None:
    check_config(C.Config())  # max_prompt_tokens=0: engines.max_model_len - sampling.max_tokens


@pytest.mark.parametrize(
    "field, value, needle",
    [
        (
            "max_prompt_tokens",
            1001,
            "memory.max_prompt_tokens=1001 + sampling.max_tokens=24 must fit engines.max_model_len=1024",
        ),
        ("k", -1, "must all be >= 0"),
        ("max_events", -2, "must all be >= 0"),
    ],
)
def test_memory_values_that_cannot_work(field: str, value: int, needle: str) -> None:
    cfg = C.Config()
    setattr(cfg.memory, field, value)
    with pytest.raises(C.ConfigError, match=needle.replace(".", r"\.").replace("+", r"\+")):
        check_config(cfg)
    setattr(cfg.memory, field, 1000 if field == "max_prompt_tokens" else 0)
    check_config(cfg)  # 1000 + 24 = 1024 fits exactly


def _refusal(cfg: C.Config) -> str:
    with pytest.raises(C.ConfigError) as refused:
        check_config(cfg)
    return str(refused.value)


def test_images_need_a_known_mode_a_vision_language_model_and_room_in_the_engine(tmp_path) -> None:
    cfg = C.Config()
    cfg.memory.images = "all"
    assert "memory.images='all', memory.image_tokens=0: use one of none, current" in _refusal(cfg)
    cfg.memory.images = "current"  # the default model (the tiny text one) has no vision tower
    assert "tiny-vl-model, made on first use" in _refusal(cfg)
    (tmp_path / "config.json").write_text('{"vision_config": {}}')
    for model in (C.TINY_VL_MODEL_DIR, tmp_path):  # the tiny one need not exist yet; any dir with a vision_config
        cfg.model.path = str(model)
        check_config(cfg)
    cfg.memory.images, cfg.memory.k, cfg.engines.max_images_per_prompt = "last_k", 2, 3
    check_config(cfg)  # the last 2 steps' pictures and the current one: 3
    cfg.engines.max_images_per_prompt = 2
    assert "up to 3 pictures per prompt, more than engines.max_images_per_prompt=2" in _refusal(cfg)
    cfg.memory.kind = "full"
    assert "memory.kind=full: that memory may show any number" in _refusal(cfg)
    cfg.memory.kind, cfg.memory.images, cfg.model.lora_rank = "last_k", "current", 8
    check_config(cfg)  # LoRA on the language model
    cfg.model.train_vision = True
    assert "LoRA adapts the language model only" in _refusal(cfg)
    cfg.model.lora_rank, cfg.algorithm.advantage = 0, "gae"
    assert "algorithm.advantage=gae needs one" in _refusal(cfg)
