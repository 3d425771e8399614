"""The learner's published weights in a real vLLM engine: a LoRA adapter (peft format, loaded in place at
run time) and full weights, each checked against the learner's own log-probs for the engine's samples; and the
frozen copy of a frozen seat (TextArena's opponent=frozen) beside the trained adapter, played through the actor.

One vLLM server with LoRA enabled for the whole module (~30 s to start on 2 CPU cores), one weight sidecar
process (refreshing the frozen copy every 2 versions: `--frozen-every 2`), and an FSDP2 learner (one gloo rank) in
this process. The tests run in order:
(a) version 0: no adapter loaded yet; the client asks for the base model, which is the learner's policy;
(b) version 1: a trained adapter through WeightPublisher -> agent -> /v1/load_lora_adapter; the frozen copy is not
    loaded yet: its client gets the base model (version 0);
(c) version 2: a further-trained adapter replaces it in place, and is loaded as the frozen copy too;
(d) version 3: the policy moves on, the frozen copy stays at version 2; Kuhn Poker matches through the actor with
    one seat trained (its transitions: version 3's log-probs) and the other's turns asked of the frozen copy;
(e) version 4: full weights of a (non-LoRA) learner through the same agent, requested as the base model.
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

from agentstream.config import REPO_ROOT, Config, EnginesConfig, ModelConfig, SamplingConfig
from agentstream.models import FROZEN_ADAPTER_NAME, LORA_ADAPTER_NAME, SERVED_MODEL_NAME, served_model_name
from agentstream.wire.addresses import free_port
from engines import EngineClient, EngineError, server_command, wait_ready
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
MAX_MODEL_LEN = 2048  # a Kuhn Poker prompt: ~1000 tokens of this model's tokenizer


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    texts = [f"<|im_start|>user\nstep {i}: go left or right?<|im_end|>\n<action>left</action>" for i in range(50)]
    return make_tiny_model(tmp_path_factory.mktemp("model") / "tiny", texts=texts, vocab_size=300)


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    port = free_port()
    argv, env = server_command(
        ModelConfig(path=str(model_dir), lora_rank=RANK), EnginesConfig(max_model_len=MAX_MODEL_LEN), port
    )
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
    argv = [
        sys.executable,
        "-m",
        "engines.sidecar",
        "--name",
        "engine-0",
        "--url",
        url,
        "--learner",
        pub.address,
        "--broker",
        f"tcp://127.0.0.1:{broker_port}",
        "--workdir",
        str(logs / "weights"),
        "--frozen-every",
        "2",
    ]
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
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        logit_rows=torch.zeros(t, dtype=torch.long),
        logit_pos=torch.arange(len(prompt) - 1, len(prompt) + t - 1),
        targets=torch.from_numpy(response).long(),
        behav_logp=torch.zeros(t),
        advantages=torch.zeros(t),
        mask=torch.ones(t, dtype=torch.bool),
        token_index=torch.arange(t),
    )


def learner_logprobs(
    model: torch.nn.Module, responses: list[np.ndarray], prompts: list[list[int]] | None = None
) -> np.ndarray:
    model.eval()
    with torch.no_grad():
        out = np.concatenate(
            [
                response_logprobs(model, one_sequence(prompt, r)).numpy()
                for prompt, r in zip(prompts or [PROMPT] * len(responses), responses, strict=True)
            ]
        )
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


async def sample(
    url: str, model: str, base_model: str | None, version: int, n: int = 3, base_while_absent: bool = False
) -> list:
    async with aiohttp.ClientSession() as session:
        client = EngineClient(
            url, session, timeout_s=60, model=model, base_model=base_model, base_while_absent=base_while_absent
        )
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
    # No frozen copy yet (the sidecar loads it at version 2): vLLM answers 404 for its name, and its client falls back
    # on the base model, the frozen seat's version 0.
    frozen = await sample(url, FROZEN_ADAPTER_NAME, SERVED_MODEL_NAME, version=1, base_while_absent=True)
    assert np.array_equal(np.concatenate([g.logprobs for g in frozen]), np.concatenate([g.logprobs for g in base_gens]))
    with pytest.raises(EngineError, match="HTTP 404"):  # (without base_while_absent that 404 is an error)
        await sample(url, FROZEN_ADAPTER_NAME, SERVED_MODEL_NAME, version=1)


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
    # Version 2 opens the second block of 2: the sidecar loaded it as the frozen copy too.
    check(await sample(url, FROZEN_ADAPTER_NAME, SERVED_MODEL_NAME, version=2, base_while_absent=True), policy)
    assert "the frozen copy (policy-frozen) is now version 2" in publisher.agent_log.read_text()


async def test_d_a_frozen_seat_plays_version_2_while_the_trained_seat_plays_version_3(
    server, publisher, policy, model_dir, monkeypatch
):
    """Kuhn Poker with opponent=frozen through the actor (`actors.actor.Actor`: env, a memory per seat, the chat
    template, this engine, transitions over ZeroMQ to a real broker in this loop). One grant opens one group (G = 2
    matches, groups_per_step 1 at bound 0, no learner); each match sends the trained seat's steps only, whose
    log-probs are version 3's (the learner's), while every turn of the other seat asks for the frozen copy, which
    still is version 2."""
    from e2e_testing import broker_and_client, check_accounting, play_until_ready
    from transformers import AutoTokenizer

    from actors.actor import Actor
    from actors.spec import ActorSpec
    from engines.client import text_decoder

    url, _ = server
    frozen_v2 = await sample(url, FROZEN_ADAPTER_NAME, SERVED_MODEL_NAME, version=2, base_while_absent=True)
    train(policy, lr=3e-2)
    publisher.publish_adapter(3, adapter_state_dict(policy), adapter_config(policy))
    assert publisher.wait_for(3, 1, 60) == {"engine-0": 3}, publisher.agent_log.read_text()[-2000:]
    still = await sample(url, FROZEN_ADAPTER_NAME, SERVED_MODEL_NAME, version=3, base_while_absent=True)
    assert [g.response_ids.tolist() for g in still] == [g.response_ids.tolist() for g in frozen_v2]
    assert (
        np.abs(np.concatenate([g.logprobs for g in still]) - np.concatenate([g.logprobs for g in frozen_v2])).max()
        < TOL
    )  # the frozen copy did not move with the policy (3 is in 2's block)

    cfg = Config()
    cfg.model.path, cfg.model.lora_rank, cfg.engines.max_model_len = str(model_dir), RANK, MAX_MODEL_LEN
    cfg.env.name, cfg.env.max_steps, cfg.sampling.max_tokens = "agentstream/TextArena-v0", 9, 12
    cfg.env.kwargs = {"game": "KuhnPoker-v0", "opponent": "frozen"}
    cfg.env.group_size, cfg.actors.episodes_per_actor = 2, 2
    cfg.trainer.groups_per_step, cfg.trainer.max_staleness, cfg.learner.world_size = 1, 0, 1
    cfg.broker.track_keys, cfg.broker.logger = True, []
    asked: list[str] = []  # the name of every generation request, as sent
    post = EngineClient._post

    async def noting(self: EngineClient, path: str, name: str, body):  # type: ignore[no-untyped-def]
        asked.append(name)
        return await post(self, path, name, body)

    monkeypatch.setattr(EngineClient, "_post", noting)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    async with aiohttp.ClientSession() as session:
        engine = EngineClient(
            url, session, 120, model=LORA_ADAPTER_NAME, base_model=SERVED_MODEL_NAME, decode=text_decoder(tokenizer)
        )
        async with broker_and_client(cfg) as (broker, client):
            actor = Actor(ActorSpec.from_config(cfg), "actor-0", 0, client, [engine], tokenizer)
            await play_until_ready(actor, broker, 1)
    b = broker.buffer
    assert b.counts["groups_admitted"] == 1 and [g.group_id for g in b.ready] == [0]
    (group,) = b.ready
    assert sorted(group.trajectories) == ["actor-0.0.g0.0", "actor-0.0.g0.1"]
    steps = [t for traj in group.trajectories.values() for t in sorted(traj, key=lambda t: t.step)]
    assert len({t.anchor[:6] for t in steps}) == 1  # one seat trained, the seat drawn from the group's seed
    for traj in group.trajectories.values():  # each match played to its end by the game's rules
        assert traj[-1].done and not any(t.done or t.truncated for t in traj[:-1])
        outcome = sum(t.reward for t in traj) - (-0.2 + cfg.trainer.invalid_action_penalty) * sum(
            not t.valid for t in traj
        )
        assert min(abs(outcome - o) for o in (-1.0, 0.0, 1.0)) < 1e-6
    assert all((t.version_lo, t.version_hi) == (3, 3) for t in steps)
    np.testing.assert_allclose(
        np.concatenate([t.logprobs for t in steps]),
        learner_logprobs(policy, [t.response_ids for t in steps], [t.prompt_ids.tolist() for t in steps]),
        atol=TOL,
        rtol=0,
    )
    frozen_turns = actor.counters["frozen_steps"]
    assert frozen_turns >= 2 and asked.count(FROZEN_ADAPTER_NAME) == frozen_turns
    assert set(asked) == {LORA_ADAPTER_NAME, FROZEN_ADAPTER_NAME}  # (engine at version 3: no base model request)
    check_accounting(broker.summary())


async def test_e_full_weights_from_the_learner(server, publisher, model_dir, one_rank):
    url, _ = server
    full = load_policy(str(model_dir), "float32", torch.device("cpu"), 1)
    train(full, lr=1e-2)
    publisher.publish(4, full_state_dict(full))
    assert publisher.wait_for(4, 1, 60) == {"engine-0": 4}, publisher.agent_log.read_text()[-2000:]
    check(await sample(url, SERVED_MODEL_NAME, None, version=4), full)
