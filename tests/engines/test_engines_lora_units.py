"""LoRA on the engine side without vLLM: server flags, the adapter payload, the agent's handling of it, and
which served name the client requests (a fake vLLM server answers HTTP); the frozen copy of a frozen seat: when the
sidecar refreshes it, and the base model its client asks for until then."""

from __future__ import annotations

import json

import aiohttp
import pytest
import torch
from safetensors.torch import load

from agentstream.config import EnginesConfig, ModelConfig, SamplingConfig
from agentstream.models import (
    FROZEN_ADAPTER_NAME,
    LORA_ADAPTER_NAME,
    SERVED_MODEL_NAME,
    base_model_name,
    served_model_name,
)
from agentstream.wire.messages import WeightUpdate
from engines import EngineClient
from engines import server as server_mod
from engines.control import FROZEN_FOLDER, MM_CACHE_RESETS, ApplyError, ServerControl, frozen_due, write_adapter
from engines.sidecar import SidecarSpec, WeightSidecar
from learner.publish import serialize_adapter

ADAPTER = {
    "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.ones(8, 128),
    "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": torch.zeros(128, 8),
}
CONFIG = {"peft_type": "LORA", "r": 8, "lora_alpha": 16.0, "target_modules": ["q_proj"]}


def test_server_command_enables_runtime_lora(monkeypatch):
    monkeypatch.setattr(server_mod, "_on_gpu", lambda: False)
    argv, env = server_mod.server_command(ModelConfig(path="/m", lora_rank=16), EnginesConfig(), port=1)
    assert " --enable-lora --max-lora-rank 16 --max-loras 2" in " ".join(argv)  # the policy, a frozen copy
    assert env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"
    argv, env = server_mod.server_command(ModelConfig(path="/m"), EnginesConfig(), port=1)
    assert "--enable-lora" not in argv and "VLLM_ALLOW_RUNTIME_LORA_UPDATING" not in env
    assert (served_model_name(ModelConfig(lora_rank=8)), base_model_name(ModelConfig(lora_rank=8))) == (
        LORA_ADAPTER_NAME,
        SERVED_MODEL_NAME,
    )
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
    assert sorted(fake_vllm.calls[2:-1]) == sorted(["/update_weight_version", "/reset_prefix_cache", *MM_CACHE_RESETS])
    assert fake_vllm.bodies[1] == {"lora_name": LORA_ADAPTER_NAME, "lora_path": str(tmp_path), "load_inplace": True}
    assert fake_vllm.version == "2"


async def test_agent_refuses_an_unknown_format_before_touching_the_server(fake_vllm, tmp_path):
    agent = WeightSidecar(
        SidecarSpec(name="e", url=fake_vllm.url, learner="tcp://x:1", broker="tcp://x:2", workdir=str(tmp_path))
    )
    async with aiohttp.ClientSession() as session:
        agent._server = ServerControl(fake_vllm.url, session, 5)
        with pytest.raises(ApplyError, match="format 'zip'"):
            await agent._apply(WeightUpdate(version=1, payload=b"x", format="zip"))
    assert fake_vllm.calls == [] and agent.version == 0


async def test_client_asks_for_the_base_model_at_version_0_then_the_adapter(fake_vllm):
    sampling = SamplingConfig(max_tokens=3)
    async with aiohttp.ClientSession() as session:
        client = EngineClient(
            fake_vllm.url, session, timeout_s=5, model=LORA_ADAPTER_NAME, base_model=SERVED_MODEL_NAME
        )
        await client.generate([1, 2], sampling)  # vLLM says "default": version 0, no adapter loaded yet
        fake_vllm.version = "1"
        await client.generate([1, 2], sampling)  # still read 0 before sending: base (sound: version 0's model)
        await client.generate([1, 2], sampling)  # known version 1: the adapter
        plain = EngineClient(fake_vllm.url, session, timeout_s=5)
        await plain.generate([1, 2], sampling)
    models = [b["model"] for b in fake_vllm.bodies if b and "prompt" in b]
    assert models == [SERVED_MODEL_NAME, SERVED_MODEL_NAME, LORA_ADAPTER_NAME, SERVED_MODEL_NAME]


# ---- the frozen copy (a frozen seat, engines.frozen_every) ----------------------------------------------------------


def test_the_frozen_copy_is_due_at_the_first_version_applied_in_each_block() -> None:
    # Every 3: blocks 0-2, 3-5, 6-8. From 0 (the base model): 1 and 2 stay in block 0, 3 opens block 1. From 3: 4 and 5
    # stay, 7 opens block 2 (6 was skipped: a newer update arrived before it was applied).
    assert [frozen_due(v, 0, 3) for v in (1, 2, 3)] == [False, False, True]
    assert [frozen_due(v, 3, 3) for v in (4, 5, 7)] == [False, False, True]
    assert frozen_due(0, -1, 3)  # unknown (a server started elsewhere): the first update refreshes it
    assert frozen_due(5, 7, 3)  # a learner restarted from an older checkpoint: back from block 2 to block 1
    assert not any(frozen_due(v, 0, 0) for v in range(1, 20))  # 0: no frozen copy


def adapter_of(version: int) -> bytes:
    """An adapter payload whose every weight is `version` (which version a folder holds can be read back)."""
    return serialize_adapter({k: torch.full_like(t, float(version)) for k, t in ADAPTER.items()}, CONFIG)


def folder_version(folder) -> float | None:
    path = folder / "adapter_model.safetensors"
    return float(next(iter(load(path.read_bytes()).values())).flatten()[0]) if path.exists() else None


async def test_the_sidecar_refreshes_the_frozen_copy_every_n_versions_and_keeps_its_folder(fake_vllm, tmp_path):
    fake_vllm.models = {SERVED_MODEL_NAME}
    agent = WeightSidecar(
        SidecarSpec(
            name="e", url=fake_vllm.url, learner="tcp://x:1", broker="tcp://x:2", workdir=str(tmp_path), frozen_every=3
        )
    )

    async def no_status() -> None:  # (no learner or broker here)
        pass

    agent._send_status = no_status  # type: ignore[method-assign]
    seen = {}
    async with aiohttp.ClientSession() as session:
        agent._server = ServerControl(fake_vllm.url, session, 5)
        for version in (1, 2, 4, 5, 7):  # 3 and 6 skipped (superseded before they were applied)
            first = len(fake_vllm.calls)
            await agent._apply(WeightUpdate(version=version, payload=adapter_of(version), format="peft_adapter"))
            calls = fake_vllm.calls[first:]
            bodies = [fake_vllm.bodies[first + i] for i, c in enumerate(calls) if c == "/v1/load_lora_adapter"]
            assert (
                calls[0] == "/sleep"
                and calls[-1] == "/wake_up"
                and calls[1 : 1 + len(bodies)] == ["/v1/load_lora_adapter"] * len(bodies)
            )  # both loads in one pause, before the label and resets
            folders = {LORA_ADAPTER_NAME: tmp_path / "adapter", FROZEN_ADAPTER_NAME: tmp_path / FROZEN_FOLDER}
            assert all(b["lora_path"] == str(folders[b["lora_name"]]) and b["load_inplace"] for b in bodies)
            loads = [b["lora_name"] for b in bodies]
            seen[version] = (loads, agent.frozen_version, folder_version(tmp_path / FROZEN_FOLDER))
            assert folder_version(tmp_path / "adapter") == version
    # Blocks of 3 from version 0 (the base model: no frozen adapter, no folder): 1 and 2 load the policy only; 4 is the
    # first applied in block 1: the frozen copy becomes version 4 and its folder keeps 4's weights through 5; 7 opens
    # block 2.
    lora, frozen = LORA_ADAPTER_NAME, FROZEN_ADAPTER_NAME
    assert seen == {
        1: ([lora], 0, None),
        2: ([lora], 0, None),
        4: ([lora, frozen], 4, 4.0),
        5: ([lora], 4, 4.0),
        7: ([lora, frozen], 7, 7.0),
    }
    assert fake_vllm.models == {SERVED_MODEL_NAME, lora, frozen}


async def test_a_frozen_copy_client_asks_for_the_base_model_until_the_engine_has_loaded_it(fake_vllm):
    """`base_while_absent`: at version 0 the base model; past it, the frozen name, and on its 404 the base model, which
    it asks for directly until the engine serves another version (one 404 per version at most)."""
    fake_vllm.token_route, fake_vllm.models = True, {SERVED_MODEL_NAME, LORA_ADAPTER_NAME}
    sampling = SamplingConfig(max_tokens=3)
    async with aiohttp.ClientSession() as session:
        policy = EngineClient(
            fake_vllm.url, session, timeout_s=5, model=LORA_ADAPTER_NAME, base_model=SERVED_MODEL_NAME
        )
        client = policy.with_model(FROZEN_ADAPTER_NAME, base_while_absent=True)
        assert (client.url, client.base_model, policy.base_while_absent) == (policy.url, SERVED_MODEL_NAME, False)
        await client.generate([1, 2], sampling)  # version 0: the base model
        for version in ("1", "2", "3"):
            fake_vllm.version = version
            if version == "3":  # the sidecar's refresh: the frozen adapter is loaded
                async with session.post(
                    f"{fake_vllm.url}/v1/load_lora_adapter", json={"lora_name": FROZEN_ADAPTER_NAME}
                ) as resp:
                    assert resp.status == 200
            for _ in range(3):
                await client.generate([1, 2], sampling)
    asked = [b["model"] for b in fake_vllm.bodies if b and "token_ids" in b]
    base, frozen = SERVED_MODEL_NAME, FROZEN_ADAPTER_NAME
    # v0: base. v1: the first still knows 0 (base, labelled 1), the second asks for the copy (404) then base, the third
    # goes to base directly. v2: the same. v3: the first knows 2, where the copy was absent (base), then the copy.
    assert asked == [base, base, frozen, base, base, base, frozen, base, base, base, frozen, frozen]
