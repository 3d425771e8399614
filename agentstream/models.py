"""What the learner, the engines and the agents' clients agree on about the served policy: the names it is served
under, the metadata key of a LoRA adapter's payload, and whether a model directory holds a vision-language model.

    client = EngineClient(url, session, model=served_model_name(cfg.model), base_model=base_model_name(cfg.model))
    if is_vision_language(cfg.model.path): ...   # the learner expands images, the server takes them

Imports nothing of the project but the config schema, and no torch: every process links it.
"""

from __future__ import annotations

import json
from pathlib import Path

from agentstream.config import ModelConfig

SERVED_MODEL_NAME = "policy"
"""Name the server serves the policy under; requests say `"model": "policy"` whatever the model dir."""
LORA_ADAPTER_NAME = "policy-lora"
"""Name of the trained LoRA adapter (model.lora_rank > 0): the weight sidecar loads each new adapter under it
(in place), and actors request it once the engine serves version >= 1."""
FROZEN_ADAPTER_NAME = "policy-frozen"
"""Name of the frozen copy of an earlier policy (a TextArena seat played by it, `env.kwargs.opponent=frozen`; LoRA
only): the weight sidecar loads the current adapter under it too every `engines.frozen_every` versions; a frozen seat's
turns request it, and the base model (version 0) while the engine has not loaded it yet."""
ADAPTER_CONFIG_KEY = "adapter_config"
"""safetensors metadata key holding a peft adapter's adapter_config.json text in a "peft_adapter" update."""


def served_model_name(model: ModelConfig) -> str:
    """The `"model"` actors request: the adapter's name when training LoRA, else the policy's.

    With LoRA no adapter is loaded before the learner publishes its first one (version 1); version 0 is the
    base model itself (peft initialises B = 0), served as SERVED_MODEL_NAME (`EngineClient(base_model=...)`)."""
    return LORA_ADAPTER_NAME if model.lora_rank > 0 else SERVED_MODEL_NAME


def base_model_name(model: ModelConfig) -> str | None:
    """With LoRA, the name actors request while an engine serves version 0 (no adapter loaded yet): the
    base model. None without LoRA. Pass it as `EngineClient(base_model=...)`."""
    return SERVED_MODEL_NAME if model.lora_rank > 0 else None


def is_vision_language(model_path: str | Path) -> bool:
    """Whether the model directory holds a vision-language model (its config.json has a `vision_config`, as
    Idefics3/SmolVLM, LLaVA and Qwen2-VL configs do). False for a hub name with no local directory."""
    config = Path(model_path) / "config.json"
    return config.is_file() and "vision_config" in json.loads(config.read_text())
