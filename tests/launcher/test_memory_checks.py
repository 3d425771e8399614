"""MemoryConfig values that cannot work are refused before a run starts, saying what to change."""

import pytest

from agentstream import config as C
from launcher.checks import check_config


def test_default_budget_is_what_the_engine_accepts() -> None:
    check_config(C.Config())  # max_prompt_tokens=0: engines.max_model_len - sampling.max_tokens


@pytest.mark.parametrize("field, value, needle", [
    ("max_prompt_tokens", 1001,
     "memory.max_prompt_tokens=1001 + sampling.max_tokens=24 must fit engines.max_model_len=1024"),
    ("k", -1, "must all be >= 0"),
    ("max_events", -2, "must all be >= 0"),
])
def test_memory_values_that_cannot_work(field: str, value: int, needle: str) -> None:
    cfg = C.Config()
    setattr(cfg.memory, field, value)
    with pytest.raises(C.ConfigError, match=needle.replace(".", r"\.").replace("+", r"\+")):
        check_config(cfg)
    setattr(cfg.memory, field, 1000 if field == "max_prompt_tokens" else 0)
    check_config(cfg)  # 1000 + 24 = 1024 fits exactly


def test_images_need_a_known_mode_a_vision_language_model_and_for_now_say_the_learner_lacks_them(tmp_path) -> None:
    cfg = C.Config()
    cfg.memory.images = "all"
    with pytest.raises(C.ConfigError, match=r"memory\.images='all', memory\.image_tokens=0: use one of none, current"):
        check_config(cfg)
    cfg.memory.images = "current"  # the default model (the tiny text one) has no vision tower
    with pytest.raises(C.ConfigError, match=r"needs a vision-language model .*make_tiny_model\.py --vl"):
        check_config(cfg)
    (tmp_path / "config.json").write_text('{"vision_config": {}}')
    cfg.model.path = str(tmp_path)
    with pytest.raises(C.ConfigError) as refused:
        check_config(cfg)
    assert "needs a vision-language model" not in str(refused.value)
    assert "the learner does not train on images yet" in str(refused.value)
