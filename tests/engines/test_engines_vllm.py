"""End to end against one real vLLM server (the session's `spare_engine`, tests/conftest.py: its weights are ours).

The tests run in order and share the server: (a) version 0 generates, (b) version 1 arrives through
WeightPublisher -> agent process -> server, (c) version 2 lands while requests are in flight,
(d) the weight sidecar stops cleanly and leaves the server serving (the session stops the server last and checks
that its whole process group is gone).

Correctness is checked against Hugging Face transformers under the same weights, in fp32:
vLLM's sampled-token log-probs match HF's to ~1e-6 in fp32 on CPU; a stale LM head is off by ~1.
"""

from __future__ import annotations

import asyncio
import copy
import itertools
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import numpy as np
import pytest
import torch
import zmq
from e2e_testing import vllm_metric, vllm_metrics, wait_until_all_decode

from agentstream.config import REPO_ROOT, SamplingConfig
from agentstream.wire.messages import EngineStatus, Hello, Message, Stats, decode
from engines import EngineClient
from engines.client import text_decoder
from engines.control import ServerControl
from launcher import procs
from learner.publish import WeightPublisher

pytestmark = pytest.mark.e2e

TOL = 1e-4  # fp32 log-prob agreement vLLM vs HF
PROMPT = [1, 40, 41, 42, 43, 44, 45, 46]  # any ids < vocab; 1 = <|im_start|>


@dataclass
class Server:
    url: str
    proc: subprocess.Popen
    log: Path


@dataclass
class Stack:
    """Learner end (publisher), a stand-in broker (a ROUTER that only receives), and the agent process."""

    publisher: WeightPublisher
    broker: zmq.Socket
    agent: subprocess.Popen
    log: Path
    received: list[Message] = field(default_factory=list)

    def broker_messages(self, until, timeout_s: float = 10.0) -> list[Message]:
        """Everything the agent sent the broker so far, waiting until `until(messages)` holds."""
        deadline = time.monotonic() + timeout_s
        while not until(self.received) and time.monotonic() < deadline:
            if self.broker.poll(100):
                frames = self.broker.recv_multipart()
                assert frames[0] == b"engine-0"  # the agent's identity is its name
                self.received.append(decode(frames[1:]))
        return self.received


# ------------------------------------------------------------------------------------ fixtures
@pytest.fixture(scope="module")
def model_dir(spare_engine) -> Path:
    return Path(spare_engine.model)


@pytest.fixture(scope="module")
def hf(model_dir) -> Iterator[dict[int, torch.nn.Module]]:
    """HF models of policy versions 0, 1, 2 (each a perturbation of the previous; embeddings included,
    which also moves the tied LM head)."""
    from transformers import AutoModelForCausalLM

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the server needs the other core
    models = {0: AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()}
    for version in (1, 2):
        model = copy.deepcopy(models[version - 1])
        gen = torch.Generator().manual_seed(version)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=gen))
        assert model.lm_head.weight is model.model.embed_tokens.weight  # still tied
        models[version] = model
    yield models
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def server(spare_engine) -> Server:
    return Server(spare_engine.url, spare_engine.proc, spare_engine.log)


@pytest.fixture(scope="module")
def stack(server, tmp_path_factory):
    publisher = WeightPublisher("tcp://127.0.0.1:*")
    broker = zmq.Context.instance().socket(zmq.ROUTER)
    broker_port = broker.bind_to_random_port("tcp://127.0.0.1")
    logs = tmp_path_factory.mktemp("agent")
    argv = [
        sys.executable,
        "-m",
        "engines.sidecar",
        "--name",
        "engine-0",
        "--url",
        server.url,
        "--learner",
        publisher.address,
        "--broker",
        f"tcp://127.0.0.1:{broker_port}",
        "--workdir",
        str(logs / "weights"),
        "--stats-interval",
        "0.5",
    ]
    agent = procs.start(argv, logs / "sidecar.log", env={"PYTHONPATH": str(REPO_ROOT)}, cwd=REPO_ROOT)
    try:
        try:
            publisher.wait_for(0, 1, 60)  # the agent registered at version 0
        except TimeoutError as exc:
            pytest.fail(f"{exc}\n--- agent log ---\n{(logs / 'agent.log').read_text()[-3000:]}")
        yield Stack(publisher, broker, agent, logs / "sidecar.log")
    finally:
        procs.stop(agent)
        publisher.close()
        broker.close(0)


# ------------------------------------------------------------------------------------ helpers
def hf_logprobs(model: torch.nn.Module, prompt: list[int], responses: list[np.ndarray]) -> list[np.ndarray]:
    """Log-prob of each response token given prompt + the tokens before it: [T] per response."""
    out = []
    for resp in responses:
        ids = torch.tensor([prompt + resp.tolist()])  # [1, P+T]
        with torch.no_grad():
            logits = model(ids, use_cache=False).logits[0, len(prompt) - 1 : -1]  # [T, V]
        lp = torch.log_softmax(logits.float(), dim=-1)
        out.append(lp.gather(1, torch.from_numpy(resp).long()[:, None])[:, 0].numpy())  # [T]
    return out


def stale_head(model: torch.nn.Module, old: torch.nn.Module) -> torch.nn.Module:
    """`model` with the LM head of `old`: what an engine that kept its old tied head would compute."""
    m = copy.deepcopy(model)
    m.lm_head.weight = torch.nn.Parameter(old.model.embed_tokens.weight.detach().clone())
    return m


# ------------------------------------------------------------------------------------ tests
async def test_a_generate_matches_hf(server, hf):
    sampling = SamplingConfig(max_tokens=16, temperature=1.0, top_p=1.0)
    async with aiohttp.ClientSession() as session:
        client = EngineClient(server.url, session, timeout_s=60)
        gen = await client.generate(PROMPT, sampling, seed=123)
        again = await client.generate(PROMPT, sampling, seed=123)
    t = gen.response_ids.shape[0]
    assert 1 <= t <= 16 and gen.logprobs.shape == (t,)
    assert gen.response_ids.dtype == np.int32 and gen.logprobs.dtype == np.float32
    assert gen.finish_reason in ("stop", "length") and (gen.finish_reason == "stop" or t == 16)
    assert (gen.version_lo, gen.version_hi) == (0, 0)  # no agent yet: vLLM says "default"
    assert np.array_equal(again.response_ids, gen.response_ids)  # same seed, same sample
    assert "<|im_end|>" not in gen.text  # special tokens stay out of the text the parser sees
    (expected,) = hf_logprobs(hf[0], PROMPT, [gen.response_ids])
    np.testing.assert_allclose(gen.logprobs, expected, atol=TOL, rtol=0)
    assert np.all(gen.logprobs < 0)


async def test_a_sample_of_n_answers_matches_hf_answer_by_answer(server, hf):
    """One request of n = 4 (a group's first turn, actors.share_first_turn): four samples of their own, each with
    HF's log-probs."""
    async with aiohttp.ClientSession() as session:
        gens = await EngineClient(server.url, session, timeout_s=60).sample(PROMPT, SamplingConfig(max_tokens=16), 4)
    assert len(gens) == 4 and len({g.response_ids.tobytes() for g in gens}) > 1
    assert all((g.version_lo, g.version_hi) == (0, 0) for g in gens)
    for gen, expected in zip(gens, hf_logprobs(hf[0], PROMPT, [g.response_ids for g in gens])):
        np.testing.assert_allclose(gen.logprobs, expected, atol=TOL, rtol=0)


async def test_a_token_ids_only_answers_match_vllms_text_answers(server, model_dir):
    """With `decode` the engine answers token ids only and the client decodes the text: the same samples,
    log-probs and text as vLLM's own text answers (the tiny model's random tokens hold special tokens and pieces
    of words, what a decoder gets wrong first)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    sampling = SamplingConfig(max_tokens=24, temperature=1.0, top_p=1.0)
    async with aiohttp.ClientSession() as session:
        text_mode = EngineClient(server.url, session, timeout_s=60)
        tokens_mode = EngineClient(server.url, session, timeout_s=60, decode=text_decoder(tokenizer))
        assert tokens_mode._generate_body(PROMPT, sampling, None, "m")["output_mode"] == "tokens"
        for seed in range(24):
            want, got = [await c.generate(PROMPT, sampling, seed=seed) for c in (text_mode, tokens_mode)]
            assert np.array_equal(got.response_ids, want.response_ids), seed
            np.testing.assert_array_equal(got.logprobs, want.logprobs)
            assert got.text == want.text and got.finish_reason == want.finish_reason, (seed, got.text, want.text)
        # stop strings need vLLM's text: such a request still asks for it
        stopped = await tokens_mode.generate(PROMPT, sampling, seed=0, extra={"stop": [want.text[:1] or "a"]})
        assert tokens_mode._generate_body(PROMPT, sampling, None, "m", {"stop": ["a"]})["output_mode"] == "text"
        assert stopped.response_ids.size >= 1


async def test_b_update_through_agent_matches_hf(server, stack, hf):
    # HF's own state dict: lm_head.weight is the embedding tensor itself (tied), so it is not sent and the
    # engine must re-tie its head (engines.worker_ext).
    stack.publisher.publish(1, hf[1].state_dict())
    assert stack.publisher.wait_for(1, 1, 60) == {"engine-0": 1}
    async with aiohttp.ClientSession() as session:
        async with session.get(server.url + "/weight_info") as resp:
            assert (await resp.json())["weight_version"] == "1"
        client = EngineClient(server.url, session, timeout_s=60)
        gens = [await client.generate(PROMPT, SamplingConfig(max_tokens=16), seed=s) for s in range(3)]
    responses = [g.response_ids for g in gens]
    assert all((g.version_lo, g.version_hi) == (1, 1) for g in gens)
    got = np.concatenate([g.logprobs for g in gens])
    new, old, stale = (
        np.concatenate(hf_logprobs(m, PROMPT, responses)) for m in (hf[1], hf[0], stale_head(hf[1], hf[0]))
    )
    np.testing.assert_allclose(got, new, atol=TOL, rtol=0)
    # The check can fail: the old weights, and the new ones behind the old (un-re-tied) head, are far off.
    assert np.abs(got - old).max() > 0.05 and np.abs(got - stale).max() > 0.05

    msgs = stack.broker_messages(until=lambda ms: any(isinstance(m, Stats) and m.gauges["version"] == 1 for m in ms))
    assert Hello(role="engine", name="engine-0", pid=stack.agent.pid, address=server.url) in msgs
    versions = [m.version for m in msgs if isinstance(m, EngineStatus)]
    # 0 (maybe repeated by the agent's periodic status on a slow host), then 1
    assert [v for v, _ in itertools.groupby(versions)][:2] == [0, 1]
    stats = [m for m in msgs if isinstance(m, Stats)]
    assert stats and stats[-1].gauges["version"] == 1 and stats[-1].counters["weight_updates"] == 1
    assert 0 < stats[-1].gauges["weight_sync_s"] < 30
    assert sorted(p.name for p in (stack.log.parent / "weights").iterdir()) == ["v1"]


async def test_c_update_while_requests_are_in_flight(server, stack, hf):
    n, max_tokens = 32, 800  # ~26k tokens: seconds of work, so they are surely mid-way when we pause
    sampling = SamplingConfig(max_tokens=max_tokens)
    async with aiohttp.ClientSession() as session:
        client = EngineClient(server.url, session, timeout_s=300, extra_body={"ignore_eos": True})
        assert await client.version() == 1
        before = vllm_metric(await vllm_metrics(session, server.url), "generation_tokens_total")
        # No per-request seed: after the update's cache reset the 32 resume by recomputing ~10k tokens, more than one
        # step's 2048, and vLLM 0.32's CPU runner crashes on a seeded request whose prefill is split
        # (gpu_model_runner._bookkeeping_sync: "CPU Generator does not use offset"); unseeded, none has a generator.
        tasks = [asyncio.create_task(client.generate(PROMPT, sampling)) for _ in range(n)]
        await wait_until_all_decode(session, server.url, tasks, before)
        # Freeze the requests mid-way with the sidecar's own pause, so that the update surely lands while they are
        # in flight however slowly the sidecar is scheduled on a busy machine. That pause leaves their KV in place:
        # only the update's cache reset makes them recompute it on the new weights, which the check below needs.
        await ServerControl(server.url, session, 60).pause()
        assert not any(t.done() for t in tasks)
        # Copies this time (as a gathered FSDP state dict may hold them): lm_head.weight travels too.
        stack.publisher.publish(2, {k: v.clone() for k, v in hf[2].state_dict().items()})
        assert (await asyncio.to_thread(stack.publisher.wait_for, 2, 1, 60)) == {"engine-0": 2}
        gens = await asyncio.gather(*tasks)
        after = await client.generate(PROMPT, SamplingConfig(max_tokens=8))
    assert (after.version_lo, after.version_hi) == (2, 2)
    (after_expected,) = hf_logprobs(hf[2], PROMPT, [after.response_ids])
    np.testing.assert_allclose(after.logprobs, after_expected, atol=TOL, rtol=0)

    responses = [g.response_ids for g in gens]
    old, new = hf_logprobs(hf[1], PROMPT, responses), hf_logprobs(hf[2], PROMPT, responses)
    switches = []
    for g, lp_old, lp_new in zip(gens, old, new):
        assert g.response_ids.shape == (max_tokens,) and g.version_lo == 1
        # Each token came from version 1 up to some point k, and from version 2 from k on.
        is_old = np.abs(g.logprobs - lp_old) < TOL  # [T]
        k = max_tokens if is_old.all() else int(np.argmin(is_old))
        np.testing.assert_allclose(g.logprobs[k:], lp_new[k:], atol=TOL, rtol=0, err_msg=f"from token {k} on")
        # The engine says which version sampled each token (engines.client): hi = 2 exactly when one of them was.
        assert g.version_hi == (2 if k < max_tokens else 1), (k, g.version_hi)
        switches.append(k)
    # The update landed mid-response: tokens of both versions in one response, bracketed (1, 2).
    mid = [g for g, k in zip(gens, switches) if 0 < k < max_tokens]
    assert mid and all((g.version_lo, g.version_hi) == (1, 2) for g in mid), switches
    print(f"switch points of {n} in-flight responses: {sorted(switches)}")


def test_d_stop_leaves_no_process(server, stack):
    assert procs.stop(stack.agent, 20) == 0, stack.log.read_text()[-2000:]  # SIGTERM: clean exit
    msgs = stack.broker_messages(until=lambda ms: any(isinstance(m, Stats) and m.final for m in ms))
    final = [m for m in msgs if isinstance(m, Stats) and m.final]
    assert len(final) == 1 and final[0].counters["weight_updates"] == 2 and final[0].gauges["version"] == 2
    assert procs.wait_gone([stack.agent.pid], 10) == []
    # the server (leader of its process group: API server, EngineCore, worker) serves on without its sidecar; the
    # session stops it last and checks that its whole group is gone (tests/conftest.py)
    assert procs.group_alive(server.proc.pid)
