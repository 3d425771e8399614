"""The learner's published weights in a real vLLM engine: a LoRA adapter (peft format, loaded in place at
run time) and full weights, each checked against the learner's own log-probs for the engine's samples.

One vLLM server with LoRA enabled for the whole module (~30 s to start on 2 CPU cores), one weight sidecar
process, and an FSDP2 learner (one gloo rank) in this process. The tests run in order:
(a) version 0: no adapter loaded yet; the client asks for the base model, which is the learner's policy;
(b) version 1: a trained adapter through WeightPublisher -> agent -> /v1/load_lora_adapter;
(c) version 2: a further-trained adapter replaces it in place;
(d) version 3: full weights of a (non-LoRA) learner through the same agent, requested as the base model.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import numpy as np
import pytest
import torch
import zmq

from agentstream.config import REPO_ROOT, EnginesConfig, ModelConfig, SamplingConfig
from agentstream.models import LORA_ADAPTER_NAME, SERVED_MODEL_NAME, served_model_name
from agentstream.wire.addresses import free_port
from engines import EngineClient, server_command, wait_ready
from launcher import procs
from launcher.tiny_model import make_tiny_model
from learner.batching import MicroBatch
from learner.model import (
    LoraSpec,
    adapter_config,
    adapter_state_dict,
    full_state_dict,
    load_policy,
    response_logprobs,
    trainable_parameters,
)
from learner.publish import WeightPublisher

pytestmark = pytest.mark.e2e

TOL = 1e-4  # fp32 log-prob agreement vLLM vs the learner (fp32 vLLM-CPU vs HF transformers: ~5e-7)
PROMPT = [1, 40, 41, 42, 43, 44, 45, 46]
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
RANK = 8


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    texts = [f"<|im_start|>user\nstep {i}: go left or right?<|im_end|>\n<action>left</action>" for i in range(50)]
    return make_tiny_model(tmp_path_factory.mktemp("model") / "tiny", texts=texts, vocab_size=300)


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    port = free_port()
    argv, env = server_command(ModelConfig(path=str(model_dir), lora_rank=RANK), EnginesConfig(max_model_len=512), port)
    assert "--enable-lora" in argv and env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"
    log = tmp_path_factory.mktemp("logs") / "vllm.log"
    proc = procs.start(argv, log, env=env)
    try:
        try:
            asyncio.run(wait_ready(f"http://127.0.0.1:{port}", 240, proc))
        except Exception as exc:
            pytest.fail(f"{exc}\n--- server log tail ---\n{log.read_text()[-3000:]}")
        yield f"http://127.0.0.1:{port}", log
    finally:
        procs.stop(proc)


@pytest.fixture(scope="module")
def publisher(server, tmp_path_factory) -> Iterator[WeightPublisher]:
    url, _ = server
    pub = WeightPublisher("tcp://127.0.0.1:*")
    broker = zmq.Context.instance().socket(zmq.ROUTER)  # the agent's broker: receives, never answers
    broker_port = broker.bind_to_random_port("tcp://127.0.0.1")
    logs = tmp_path_factory.mktemp("agent")
    argv = [sys.executable, "-m", "engines.sidecar", "--name", "engine-0", "--url", url, "--learner", pub.address,
            "--broker", f"tcp://127.0.0.1:{broker_port}", "--workdir", str(logs / "weights")]
    agent = procs.start(argv, logs / "sidecar.log", env={"PYTHONPATH": str(REPO_ROOT)}, cwd=REPO_ROOT)
    try:
        try:
            pub.wait_for(0, 1, 60)
        except TimeoutError as exc:
            pytest.fail(f"{exc}\n--- agent log ---\n{(logs / 'agent.log').read_text()[-3000:]}")
        pub.agent_log = logs / "sidecar.log"  # type: ignore[attr-defined]
        yield pub
    finally:
        assert procs.stop(agent, 20) == 0, (logs / "sidecar.log").read_text()[-2000:]
        pub.close()
        broker.close(0)


@pytest.fixture(scope="module")
def policy(one_rank, model_dir) -> torch.nn.Module:
    return load_policy(str(model_dir), "float32", torch.device("cpu"), 1, lora=LoraSpec(RANK, 16.0, TARGETS))


# ------------------------------------------------------------------------------------ helpers
def one_sequence(prompt: list[int], response: np.ndarray) -> MicroBatch:
    """prompt + response as a one-row micro-batch whose loss tokens are the response."""
    ids = torch.tensor(prompt + response.tolist())[None]  # [1, P+T]
    t = len(response)
    return MicroBatch(
        input_ids=ids, attention_mask=torch.ones_like(ids), logit_rows=torch.zeros(t, dtype=torch.long),
        logit_pos=torch.arange(len(prompt) - 1, len(prompt) + t - 1), targets=torch.from_numpy(response).long(),
        behav_logp=torch.zeros(t), advantages=torch.zeros(t), mask=torch.ones(t, dtype=torch.bool),
        token_index=torch.arange(t),
    )


def learner_logprobs(model: torch.nn.Module, responses: list[np.ndarray]) -> np.ndarray:
    model.eval()
    with torch.no_grad():
        out = np.concatenate([response_logprobs(model, one_sequence(PROMPT, r)).numpy() for r in responses])
    model.train()
    return out


def train(model: torch.nn.Module, lr: float, steps: int = 2) -> None:
    """Push the policy towards a fixed token sequence: enough to move it well past the tolerance."""
    opt = torch.optim.AdamW(trainable_parameters(model), lr=lr)
    mb = one_sequence(PROMPT, np.array([50, 51, 52, 53, 54, 55]))
    for _ in range(steps):
        (-response_logprobs(model, mb).mean()).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


async def sample(url: str, model: str, base_model: str | None, version: int, n: int = 3) -> list:
    async with aiohttp.ClientSession() as session:
        client = EngineClient(url, session, timeout_s=60, model=model, base_model=base_model)
        gens = [await client.generate(PROMPT, SamplingConfig(max_tokens=12), seed=s) for s in range(n)]
    assert all((g.version_lo, g.version_hi) == (version, version) for g in gens)
    return gens


def check(gens: list, model: torch.nn.Module) -> np.ndarray:
    """Engine log-probs == the learner's on the engine's own samples; returns them."""
    got = np.concatenate([g.logprobs for g in gens])
    np.testing.assert_allclose(got, learner_logprobs(model, [g.response_ids for g in gens]), atol=TOL, rtol=0)
    return got


# ------------------------------------------------------------------------------------ tests
def test_served_names():
    assert served_model_name(ModelConfig(lora_rank=0)) == SERVED_MODEL_NAME
    assert served_model_name(ModelConfig(lora_rank=RANK)) == LORA_ADAPTER_NAME


async def test_a_version_0_is_the_base_model(server, publisher, policy):
    url, _ = server
    gens = await sample(url, LORA_ADAPTER_NAME, SERVED_MODEL_NAME, version=0)
    check(gens, policy)  # B = 0: the untrained adapter changes nothing


async def test_b_published_adapter_matches_the_learner(server, publisher, policy):
    url, _ = server
    train(policy, lr=3e-2)
    base_gens = await sample(url, SERVED_MODEL_NAME, None, version=0)
    publisher.publish_adapter(1, adapter_state_dict(policy), adapter_config(policy))
    assert publisher.wait_for(1, 1, 60) == {"engine-0": 1}, publisher.agent_log.read_text()[-2000:]
    gens = await sample(url, LORA_ADAPTER_NAME, SERVED_MODEL_NAME, version=1)
    check(gens, policy)
    # The check can fail: the base model (still served as SERVED_MODEL_NAME) gives other log-probs.
    base = [g.response_ids for g in base_gens]
    again = await sample(url, SERVED_MODEL_NAME, None, version=1)
    assert np.array_equal(np.concatenate([g.logprobs for g in again]), np.concatenate([g.logprobs for g in base_gens]))
    assert np.abs(learner_logprobs(policy, base) - np.concatenate([g.logprobs for g in base_gens])).max() > 0.05


async def test_c_a_newer_adapter_replaces_it_in_place(server, publisher, policy):
    url, _ = server
    before = await sample(url, LORA_ADAPTER_NAME, SERVED_MODEL_NAME, version=1)
    train(policy, lr=3e-2)
    publisher.publish_adapter(2, adapter_state_dict(policy), adapter_config(policy))
    assert publisher.wait_for(2, 1, 60) == {"engine-0": 2}, publisher.agent_log.read_text()[-2000:]
    check(await sample(url, LORA_ADAPTER_NAME, SERVED_MODEL_NAME, version=2), policy)
    old = np.concatenate([g.logprobs for g in before])
    new = learner_logprobs(policy, [g.response_ids for g in before])
    assert np.abs(old - new).max() > 0.05  # version 2 is not version 1


async def test_d_full_weights_from_the_learner(server, publisher, model_dir, one_rank):
    url, _ = server
    full = load_policy(str(model_dir), "float32", torch.device("cpu"), 1)
    train(full, lr=1e-2)
    publisher.publish(3, full_state_dict(full))
    assert publisher.wait_for(3, 1, 60) == {"engine-0": 3}, publisher.agent_log.read_text()[-2000:]
    check(await sample(url, SERVED_MODEL_NAME, None, version=3), full)
