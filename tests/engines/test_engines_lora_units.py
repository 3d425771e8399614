"""LoRA on the engine side without vLLM: server flags, the adapter payload, the agent's handling of it, and
which served name the client requests (a fake vLLM server answers HTTP)."""

from __future__ import annotations

import json

import aiohttp
import pytest
import torch
from safetensors.torch import load

from agentstream.config import EnginesConfig, ModelConfig, SamplingConfig
from agentstream.models import LORA_ADAPTER_NAME, SERVED_MODEL_NAME, base_model_name, served_model_name
from agentstream.wire.messages import WeightUpdate
from engines import EngineClient
from engines import server as server_mod
from engines.sidecar import MM_CACHE_RESETS, ApplyError, ServerControl, SidecarSpec, WeightSidecar, write_adapter
from learner.publish import serialize_adapter

ADAPTER = {
    "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.ones(8, 128),
    "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": torch.zeros(128, 8),
}
CONFIG = {"peft_type": "LORA", "r": 8, "lora_alpha": 16.0, "target_modules": ["q_proj"]}


def test_server_command_enables_runtime_lora(monkeypatch):
    monkeypatch.setattr(server_mod, "_on_gpu", lambda: False)
    argv, env = server_mod.server_command(ModelConfig(path="/m", lora_rank=16), EnginesConfig(), port=1)
    assert " --enable-lora --max-lora-rank 16 --max-loras 1" in " ".join(argv)
    assert env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"
    argv, env = server_mod.server_command(ModelConfig(path="/m"), EnginesConfig(), port=1)
    assert "--enable-lora" not in argv and "VLLM_ALLOW_RUNTIME_LORA_UPDATING" not in env
    assert (served_model_name(ModelConfig(lora_rank=8)), base_model_name(ModelConfig(lora_rank=8))) == (
        LORA_ADAPTER_NAME, SERVED_MODEL_NAME)
    assert (served_model_name(ModelConfig()), base_model_name(ModelConfig())) == (SERVED_MODEL_NAME, None)


def test_adapter_payload_unfolds_into_a_peft_directory(tmp_path):
    payload = serialize_adapter(ADAPTER, CONFIG)
    folder = write_adapter(tmp_path, 3, payload)
    assert folder == tmp_path / "adapter"  # one folder for every version: vLLM may re-read it at any time
    assert write_adapter(tmp_path, 4, payload) == folder
    assert json.loads((folder / "adapter_config.json").read_text()) == CONFIG
    tensors = load((folder / "adapter_model.safetensors").read_bytes())
    assert set(tensors) == set(ADAPTER) and torch.equal(tensors[next(iter(ADAPTER))], torch.ones(8, 128))
    with pytest.raises(ValueError, match="only lora_"):
        serialize_adapter({"lm_head.weight": torch.zeros(2, 2)}, CONFIG)  # a tied head must not slip through
    with pytest.raises(ApplyError, match="adapter config"):
        write_adapter(tmp_path, 4, b"\x02\x00\x00\x00\x00\x00\x00\x00{}")  # safetensors without the metadata


async def test_lora_apply_loads_the_adapter_in_place(fake_vllm, tmp_path):
    async with aiohttp.ClientSession() as session:
        await ServerControl(fake_vllm.url, session, 5).apply(tmp_path, 2, lora=True)
    assert fake_vllm.calls[:2] == ["/sleep", "/v1/load_lora_adapter"] and fake_vllm.calls[-1] == "/wake_up"
    # the label and the cache resets are sent together, all before /wake_up
    assert sorted(fake_vllm.calls[2:-1]) == sorted(["/update_weight_version", "/reset_prefix_cache",
                                                    *MM_CACHE_RESETS])
    assert fake_vllm.bodies[1] == {"lora_name": LORA_ADAPTER_NAME, "lora_path": str(tmp_path), "load_inplace": True}
    assert fake_vllm.version == "2"


async def test_agent_refuses_an_unknown_format_before_touching_the_server(fake_vllm, tmp_path):
    agent = WeightSidecar(SidecarSpec(name="e", url=fake_vllm.url, learner="tcp://x:1", broker="tcp://x:2",
                                  workdir=str(tmp_path)))
    async with aiohttp.ClientSession() as session:
        agent._server = ServerControl(fake_vllm.url, session, 5)
        with pytest.raises(ApplyError, match="format 'zip'"):
            await agent._apply(WeightUpdate(version=1, payload=b"x", format="zip"))
    assert fake_vllm.calls == [] and agent.version == 0


async def test_client_asks_for_the_base_model_at_version_0_then_the_adapter(fake_vllm):
    sampling = SamplingConfig(max_tokens=3)
    async with aiohttp.ClientSession() as session:
        client = EngineClient(fake_vllm.url, session, timeout_s=5, model=LORA_ADAPTER_NAME,
                              base_model=SERVED_MODEL_NAME)
        await client.generate([1, 2], sampling)  # vLLM says "default": version 0, no adapter loaded yet
        fake_vllm.version = "1"
        await client.generate([1, 2], sampling)  # still read 0 before sending: base (sound: version 0's model)
        await client.generate([1, 2], sampling)  # known version 1: the adapter
        plain = EngineClient(fake_vllm.url, session, timeout_s=5)
        await plain.generate([1, 2], sampling)
    models = [b["model"] for b in fake_vllm.bodies if b and "prompt" in b]
    assert models == [SERVED_MODEL_NAME, SERVED_MODEL_NAME, LORA_ADAPTER_NAME, SERVED_MODEL_NAME]
