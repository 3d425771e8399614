"""Fast tests of engines/ without vLLM: command line, client, agent logic (the learner's publisher at the other end)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import numpy as np
import pytest
import torch
import zmq

from agentstream.config import REPO_ROOT, EnginesConfig, ModelConfig, SamplingConfig
from agentstream.wire.addresses import free_port
from agentstream.wire.messages import Stats, WeightUpdate, decode
from engines import EngineClient, EngineError, ServerNotReady
from engines import server as server_mod
from engines.control import MM_CACHE_RESETS, ServerControl, prune_weight_dirs, write_weights
from engines.sidecar import SidecarSpec, WeightSidecar, learner_lost
from launcher import procs
from learner.publish import WeightPublisher


# ------------------------------------------------------------------------------------ server_command
def test_server_command_cpu(monkeypatch):
    monkeypatch.setattr(server_mod, "_on_gpu", lambda: False)
    engines = EnginesConfig(host="127.0.0.2", kv_cache_gib=3, max_model_len=512, extra_args=["--seed", "7"])
    argv, env = server_mod.server_command(ModelConfig(path="/m", dtype="bfloat16"), engines, port=8123)
    assert argv[:3] == [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
    assert argv[-2:] == ["--seed", "7"]  # extra args come last, so they can override
    assert "--enforce-eager" in argv and "--gpu-memory-utilization" not in argv and "--enable-scale-out" in argv
    joined = " ".join(argv)
    for part in [
        "--model /m",
        "--served-model-name policy",
        "--host 127.0.0.2",
        "--port 8123",
        "--dtype bfloat16",
        "--max-model-len 512",
        "--worker-extension-cls engines.worker_ext.WeightReloadExtension",
    ]:
        assert part in joined
    assert env["VLLM_SERVER_DEV_MODE"] == "1"
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "3" and env["VLLM_CPU_CI_ENV"] == "1"
    assert str(REPO_ROOT) in env["PYTHONPATH"].split(":")


def test_a_cpu_server_preloads_tcmalloc_when_installed(monkeypatch):
    monkeypatch.setattr(server_mod, "_on_gpu", lambda: False)
    monkeypatch.setenv("LD_PRELOAD", "libmine.so")
    monkeypatch.setattr(
        server_mod.ctypes.util,
        "find_library",
        lambda name: "libtcmalloc_minimal.so.4" if name == "tcmalloc_minimal" else None,
    )
    _, env = server_mod.server_command(ModelConfig(path="/m"), EnginesConfig(), port=1)
    assert env["LD_PRELOAD"] == "libtcmalloc_minimal.so.4:libmine.so"  # first, the caller's own kept
    monkeypatch.setattr(server_mod.ctypes.util, "find_library", lambda name: None)
    assert "LD_PRELOAD" not in server_mod.server_command(ModelConfig(path="/m"), EnginesConfig(), port=1)[1]
    monkeypatch.setattr(server_mod, "_on_gpu", lambda: True)  # GPU servers: vLLM's own allocator setup
    monkeypatch.setattr(server_mod.ctypes.util, "find_library", lambda name: "libtcmalloc_minimal.so.4")
    assert "LD_PRELOAD" not in server_mod.server_command(ModelConfig(path="/m"), EnginesConfig(), port=1)[1]


def test_server_command_gpu(monkeypatch):
    monkeypatch.setattr(server_mod, "_on_gpu", lambda: True)
    argv, env = server_mod.server_command(ModelConfig(path="/m"), EnginesConfig(gpu_memory_utilization=0.3), 1)
    assert argv[argv.index("--gpu-memory-utilization") + 1] == "0.3"
    assert "VLLM_CPU_KVCACHE_SPACE" not in env and env["VLLM_SERVER_DEV_MODE"] == "1"


async def test_wait_ready_reports_dead_process_and_timeout():
    proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    proc.wait()
    with pytest.raises(ServerNotReady, match="exited with code 3"):
        await server_mod.wait_ready(f"http://127.0.0.1:{free_port()}", 5, proc)
    with pytest.raises(ServerNotReady, match="not ready after"):
        await server_mod.wait_ready(f"http://127.0.0.1:{free_port()}", 0.6)


async def test_wait_ready_returns_on_health(fake_vllm):
    await server_mod.wait_ready(fake_vllm.url, 5)
    assert fake_vllm.calls == ["/health"]


# ------------------------------------------------------------------------------------ client
async def test_client_generate_brackets_versions(fake_vllm):
    fake_vllm.version = "3"
    fake_vllm.bump_on_completion = True  # version 3 -> 4 while the completion is served
    async with aiohttp.ClientSession() as session:
        client = EngineClient(fake_vllm.url, session, timeout_s=5, extra_body={"ignore_eos": True, "model": "x"})
        gen = await client.generate(np.array([1, 2, 3], dtype=np.int32), SamplingConfig(max_tokens=3), seed=9)
        # Nothing cached: lo is read before sending (3); hi is read after the answer (4).
        assert (gen.version_lo, gen.version_hi) == (3, 4)
        assert gen.response_ids.dtype == np.int32 and gen.response_ids.tolist() == [5, 6, 2]
        assert gen.logprobs.dtype == np.float32 and gen.logprobs.tolist() == [-0.5, -1.25, -0.125]
        assert (gen.text, gen.finish_reason) == ("ab", "stop")
        body = fake_vllm.bodies[fake_vllm.calls.index("/v1/completions")]
        assert body["prompt"] == [1, 2, 3] and body["model"] == "policy"  # extra_body cannot override it
        assert body["logprobs"] == 0 and body["return_token_ids"] is True and body["seed"] == 9
        assert body["ignore_eos"] is True and "skip_special_tokens" not in body
        gen = await client.generate([1], SamplingConfig())  # cached lo = the last read (4); hi = 5
        assert (gen.version_lo, gen.version_hi) == (4, 5)
        assert fake_vllm.calls.count("/weight_info") == 3  # one before the first call, one after each


async def test_on_the_token_route_versions_come_from_the_answer_without_reads(fake_vllm):
    """/inference/v1/generate (engines started with --enable-scale-out) says which weight version sampled each
    token: the interval is its spans' (no /weight_info read), and the body asks what /v1/completions would."""
    fake_vllm.token_route, fake_vllm.version = True, "3"
    async with aiohttp.ClientSession() as session:
        client = EngineClient(fake_vllm.url, session, timeout_s=5, extra_body={"ignore_eos": True, "model": "x"})
        gen = await client.generate(np.array([1, 2, 3], dtype=np.int32), SamplingConfig(max_tokens=3), seed=9)
        assert (gen.version_lo, gen.version_hi) == (3, 3) and client.token_route is True
        assert gen.response_ids.tolist() == [5, 6, 2] and gen.logprobs.tolist() == [-0.5, -1.25, -0.125]
        assert gen.logprobs.dtype == np.float32 and (gen.text, gen.finish_reason) == ("ab", "stop")
        body = fake_vllm.bodies[fake_vllm.calls.index("/inference/v1/generate")]
        assert body["token_ids"] == [1, 2, 3] and body["model"] == "policy" and body["output_mode"] == "text"
        params = body["sampling_params"]
        assert params["logprobs"] == 0 and params["seed"] == 9 and params["ignore_eos"] is True
        assert params["max_tokens"] == 3 and "prompt" not in params and "model" not in params
        # An update landed mid-response: tokens 0-1 of version 3, token 2 of version 4.
        fake_vllm.spans = [{"version": "3", "start": 0, "end": 2}, {"version": "4", "start": 2, "end": 3}]
        gen = await client.generate([1], SamplingConfig())
        assert (gen.version_lo, gen.version_hi) == (3, 4)
        fake_vllm.spans = None
        fake_vllm.version = "default"  # never labelled (a fresh or restarted server): version 0
        gen = await client.generate([1], SamplingConfig())
        assert (gen.version_lo, gen.version_hi) == (0, 0)
        assert fake_vllm.calls.count("/weight_info") == 0 and fake_vllm.calls.count("/v1/completions") == 0
        fake_vllm.spans = [{"version": "three", "start": 0, "end": 3}]
        with pytest.raises(EngineError, match="not an integer"):
            await client.generate([1], SamplingConfig())


async def test_n_answers_to_one_prompt_come_in_one_request_each_with_its_versions(fake_vllm):
    """`sample(n)` (a group's first turn): one request asking vLLM for n; each answer's interval is its own spans';
    an answer with another number of choices is an error that says so; without the token route, n goes to
    /v1/completions and every answer shares the bracketing reads."""
    fake_vllm.token_route = True
    fake_vllm.choice_spans = [
        [{"version": "3", "start": 0, "end": 3}],
        [{"version": "3", "start": 0, "end": 1}, {"version": "4", "start": 1, "end": 3}],
        [{"version": "4", "start": 0, "end": 3}],
    ]
    async with aiohttp.ClientSession() as session:
        client = EngineClient(fake_vllm.url, session, timeout_s=5)
        gens = await client.sample([1, 2], SamplingConfig(max_tokens=3), 3)
        assert [(g.version_lo, g.version_hi) for g in gens] == [(3, 3), (3, 4), (4, 4)]
        assert all(g.response_ids.tolist() == [5, 6, 2] and g.text == "ab" for g in gens)
        assert fake_vllm.bodies[-1]["sampling_params"]["n"] == 3 and fake_vllm.calls == ["/inference/v1/generate"]
        assert client._known_version == 4  # the newest any answer saw
        fake_vllm.choice_spans = None
        assert "n" not in client._generate_body([1], SamplingConfig(), None, "m")["sampling_params"]  # n = 1: vLLM's
        fake_vllm.choices = 2
        with pytest.raises(EngineError, match="answered 2 choices where 3 were asked for"):
            await client.sample([1, 2], SamplingConfig(), 3)

        fake_vllm.token_route, fake_vllm.choices, fake_vllm.version = False, None, "5"
        client = EngineClient(fake_vllm.url, session, timeout_s=5)
        gens = await client.sample([1, 2], SamplingConfig(), 4)
        assert [(g.version_lo, g.version_hi) for g in gens] == [(5, 5)] * 4
        assert fake_vllm.bodies[fake_vllm.calls.index("/v1/completions")]["n"] == 4


async def test_without_the_token_route_the_client_brackets_with_reads_from_then_on(fake_vllm):
    """A server without --enable-scale-out answers FastAPI's bare 404: /v1/completions and version reads, and
    the route is not asked for again."""
    fake_vllm.version = "2"
    async with aiohttp.ClientSession() as session:
        client = EngineClient(fake_vllm.url, session, timeout_s=5)
        for _ in range(3):
            gen = await client.generate([1], SamplingConfig())
            assert (gen.version_lo, gen.version_hi) == (2, 2)
        assert client.token_route is False and fake_vllm.calls.count("/inference/v1/generate") == 1
        assert fake_vllm.calls.count("/v1/completions") == 3 and fake_vllm.calls.count("/weight_info") >= 2


async def test_an_unversioned_client_never_reads_versions(fake_vllm):
    """A server whose weights never change (an LLM judge, actors/judge.py): completions only, version 0."""
    fake_vllm.version = "3"
    async with aiohttp.ClientSession() as session:
        client = EngineClient(fake_vllm.url, session, timeout_s=5, versioned=False)
        gen = await client.generate([1, 2], SamplingConfig(max_tokens=3, temperature=0.0))
        assert (gen.version_lo, gen.version_hi, gen.text) == (0, 0, "ab")
        assert fake_vllm.calls == ["/v1/completions"] and fake_vllm.bodies[0]["temperature"] == 0.0


async def test_answers_that_arrive_together_share_one_fresh_version_read(fake_vllm):
    fake_vllm.version = "2"
    async with aiohttp.ClientSession() as session:
        client = EngineClient(fake_vllm.url, session, timeout_s=5)
        assert await client.version() == 2  # lo is known: no read before sending
        fake_vllm.calls.clear()
        gens = await asyncio.gather(*(client.generate([1], SamplingConfig()) for _ in range(8)))
        assert all((g.version_lo, g.version_hi) == (2, 2) for g in gens)
        reads = fake_vllm.calls.count("/weight_info")
        assert fake_vllm.calls.count("/v1/completions") == 8 and 1 <= reads < 8  # shared, not one each
        # Each read started after the answers it serves: an update that lands meanwhile is seen by them all.
        fake_vllm.bump_on_completion = True
        gens = await asyncio.gather(*(client.generate([1], SamplingConfig()) for _ in range(4)))
        # 2 -> 6 by 4 answers: each answer's read sees at least its own bump, the last one's sees all four.
        assert fake_vllm.version == "6" and min(g.version_hi for g in gens) >= 3
        assert max(g.version_hi for g in gens) == 6


async def test_client_retries_once_on_a_dropped_connection(fake_vllm):
    fake_vllm.version = "1"
    async with aiohttp.ClientSession() as session:
        client = EngineClient(fake_vllm.url, session, timeout_s=5)
        fake_vllm.drop_connections = 1
        gen = await client.generate([1], SamplingConfig())  # the first request is dropped, then answered
        assert gen.response_ids.tolist() == [5, 6, 2]
        assert fake_vllm.calls.count("/v1/completions") == 1  # answered once
        fake_vllm.calls.clear()
        fake_vllm.drop_connections = 1
        await client.generate([1], SamplingConfig())  # version cached: this drop hits the POST
        assert fake_vllm.calls == ["/v1/completions", "/v1/completions", "/weight_info"]
        fake_vllm.drop_connections = 2  # twice in a row is not a keep-alive race: give up
        with pytest.raises(EngineError, match="cannot reach the engine"):
            await client.generate([1], SamplingConfig())


async def test_client_version_default_and_errors(fake_vllm):
    async with aiohttp.ClientSession() as session:
        client = EngineClient(fake_vllm.url, session, timeout_s=5)
        assert await client.version() == 0  # vLLM says "default" before any agent labelled it
        fake_vllm.fail["/v1/completions"] = 500
        with pytest.raises(EngineError, match=r"/v1/completions failed: HTTP 500: injected failure"):
            await client.generate([1], SamplingConfig())
        fake_vllm.version = "v7"
        with pytest.raises(EngineError, match="not an integer"):
            print(await client.version(), fake_vllm.calls)
        dead = EngineClient(f"http://127.0.0.1:{free_port()}", session, timeout_s=5)
        with pytest.raises(EngineError, match="cannot reach the engine"):
            await dead.version()


# ------------------------------------------------------------------------------------ agent
async def test_server_control_apply_order(fake_vllm, tmp_path):
    async with aiohttp.ClientSession() as session:
        reports = await ServerControl(fake_vllm.url, session, 5).apply(tmp_path, 7)
    assert reports == [{"retied": True}]
    assert fake_vllm.calls[:2] == ["/sleep", "/collective_rpc"] and fake_vllm.calls[-1] == "/wake_up"
    # the label and the cache resets are sent together, all before /wake_up
    assert sorted(fake_vllm.calls[2:-1]) == sorted(["/update_weight_version", "/reset_prefix_cache", *MM_CACHE_RESETS])
    assert fake_vllm.version == "7"
    rpc = fake_vllm.bodies[1]
    assert rpc == {"method": "agentstream_reload_weights", "kwargs": {"weights_path": str(tmp_path)}}


def test_agent_keeps_only_the_newest_update(tmp_path):
    agent = WeightSidecar(
        SidecarSpec(name="e", url="http://x", learner="tcp://x:1", broker="tcp://x:2", workdir=str(tmp_path))
    )
    for v in (2, 3, 1, 3):
        agent.offer(WeightUpdate(version=v, payload=b""))
    assert agent._pending is not None and agent._pending.version == 3
    assert agent.skipped == 1  # 2 was superseded by 3; 1 and the second 3 were not newer: ignored
    a = write_weights(tmp_path, 4, b"x")
    b = write_weights(tmp_path, 5, b"yy")
    prune_weight_dirs(tmp_path, keep=b)
    assert not a.exists() and (b / "model.safetensors").read_bytes() == b"yy"
    assert [p.name for p in b.iterdir()] == ["model.safetensors"]


def _start_agent(url: str, learner: str, broker: str, log: Path, *extra: str) -> subprocess.Popen:
    argv = [
        sys.executable,
        "-m",
        "engines.sidecar",
        "--name",
        "engine-t",
        "--url",
        url,
        "--learner",
        learner,
        "--broker",
        broker,
        "--stats-interval",
        "0.2",
        "--dead-after",
        "0.5",
        *extra,
    ]
    return procs.start(argv, log, env={"PYTHONPATH": str(REPO_ROOT)}, cwd=REPO_ROOT)


async def _until(done, what: str, timeout_s: float = 20.0) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, f"no {what} within {timeout_s:.0f} s"
        await asyncio.sleep(0.05)


@pytest.mark.parametrize(
    "up, since, asked_at, expected",
    [
        # lost_s = 5, silent_s = 60, now = 100 throughout; the wait runs from the later of `since` and `asked_at`.
        (False, 96.0, -1e9, False),  # down for 4 s < 5
        (False, 95.0, -1e9, True),  # down for 5 s: ask
        (False, 50.0, 97.0, False),  # down long, but asked 3 s ago: the next ask at 102
        (False, 50.0, 95.0, True),  # ... asked 5 s ago: ask again
        (True, 41.0, -1e9, False),  # connected, the learner's last word 59 s ago < 60
        (True, 40.0, -1e9, True),  # ... 60 s ago: ask
        (True, 10.0, 45.0, False),  # silent long, asked 55 s ago
    ],
)
def test_a_sidecar_asks_where_the_learner_is_once_lost_or_silent_long_enough(up, since, asked_at, expected):
    assert learner_lost(100.0, up, since, asked_at, lost_s=5.0, silent_s=60.0) is expected


async def test_a_sidecar_given_the_learners_address_follows_it_where_the_broker_says(fake_vllm, tmp_path):
    """A launch that joined the run gave its sidecar the learner's address, not its record. The learner's node dies
    and the learner starts again elsewhere: the sidecar, cut off, asks the broker (a real one, in this process) again
    and again; the broker names the old address until the new learner reports from its new one (VersionUpdate with
    `weights`, as rank 0 sends it); then the sidecar connects there, takes the new learner's weights, and counts it."""
    from broker_testing import start_broker

    from agentstream.config import Config
    from agentstream.wire.messages import VersionUpdate, encode

    old_port = free_port()
    cfg = Config()
    cfg.run.output_dir, cfg.learner.weight_port = str(tmp_path), old_port  # the Welcome's address at the start
    broker, serving, broker_address = await start_broker(cfg)
    welcomes = []
    welcome = broker.welcome
    broker.welcome = lambda: welcomes.append(welcome()) or welcomes[-1]  # type: ignore[method-assign]
    learner = zmq.Context.instance().socket(zmq.DEALER)  # learner rank 0's link to the broker
    learner.setsockopt(zmq.IDENTITY, b"learner-0")
    learner.connect(broker_address)
    old, new = WeightPublisher(f"tcp://127.0.0.1:{old_port}"), None
    agent = _start_agent(
        fake_vllm.url, old.address, broker_address, tmp_path / "sidecar.log", "--learner-lost-s", "0.5"
    )

    def moves() -> float:
        return broker.stats.by_source("learner_moves_followed", "engine").get("engine-t", 0.0)

    try:
        assert (await asyncio.to_thread(old.wait_for, 0, 1, 30)) == {"engine-t": 0}
        old.publish(1, {"w": torch.ones(2)})
        await _until(lambda: fake_vllm.version == "1", "version 1 from the first learner")
        old.close()  # its node died
        new = WeightPublisher("tcp://127.0.0.1:*")  # started again elsewhere (here: another port)
        await _until(lambda: len(welcomes) >= 2, "second question to the broker")
        assert {w.weights for w in welcomes} == {old.address} and moves() == 0  # told the old one: stays
        learner.send_multipart(encode(VersionUpdate(version=1, resumed=True, checkpointed=1, weights=new.address)))
        assert (await asyncio.to_thread(new.wait_for, 1, 1, 30)) == {"engine-t": 1}  # connected, at version 1
        new.publish(2, {"w": torch.zeros(2)})
        await _until(lambda: fake_vllm.version == "2", "version 2 from the learner at its new address")
        await _until(lambda: moves() == 1, "learner_moves_followed in the sidecar's stats")
        assert welcomes[-1].weights == new.address
    finally:
        procs.stop(agent, 5)
        for sock in (old, new):
            if sock is not None:
                sock.close()
        learner.close(0)
        broker.stop()
        await serving
    log = (tmp_path / "sidecar.log").read_text()
    assert f"{old.address} moved to {new.address} (said by the broker)" in log, log


async def test_agent_exits_nonzero_when_an_update_fails(fake_vllm, tmp_path):
    fake_vllm.fail["/collective_rpc"] = 500
    broker = zmq.Context.instance().socket(zmq.ROUTER)
    port = broker.bind_to_random_port("tcp://127.0.0.1")
    with WeightPublisher("tcp://127.0.0.1:*") as pub:
        agent = _start_agent(fake_vllm.url, pub.address, f"tcp://127.0.0.1:{port}", tmp_path / "sidecar.log")
        try:
            assert (await asyncio.to_thread(pub.wait_for, 0, 1, 30)) == {"engine-t": 0}
            pub.publish(1, {"w": torch.ones(2)})
            rc = await asyncio.to_thread(agent.wait, 30)
        finally:
            procs.stop(agent, 5)
    log = (tmp_path / "sidecar.log").read_text()
    assert rc == 1, log
    assert "update to version 1 failed" in log and "HTTP 500" in log and "/collective_rpc" in log
    assert "/wake_up" not in fake_vllm.calls[fake_vllm.calls.index("/collective_rpc") :]  # left paused
    kinds = []
    while broker.poll(200):
        kinds.append(decode(broker.recv_multipart()[1:]))
    broker.close(0)
    assert any(isinstance(m, Stats) and m.final for m in kinds)


async def test_agent_exits_nonzero_when_the_server_dies(fake_vllm, tmp_path):
    broker = zmq.Context.instance().socket(zmq.ROUTER)
    port = broker.bind_to_random_port("tcp://127.0.0.1")
    with WeightPublisher("tcp://127.0.0.1:*") as pub:
        agent = _start_agent(fake_vllm.url, pub.address, f"tcp://127.0.0.1:{port}", tmp_path / "sidecar.log")
        try:
            await asyncio.to_thread(pub.wait_for, 0, 1, 30)
            fake_vllm.fail["/health"] = 503  # the server stops answering
            rc = await asyncio.to_thread(agent.wait, 30)
        finally:
            procs.stop(agent, 5)
    broker.close(0)
    log = (tmp_path / "sidecar.log").read_text()
    assert rc == 1 and "has not answered /health" in log, log


def test_server_command_runs_the_cpu_model_in_the_engine_process_unless_mp_is_asked(monkeypatch):
    monkeypatch.setattr(server_mod, "_on_gpu", lambda: False)
    argv, env = server_mod.server_command(ModelConfig(path="/m"), EnginesConfig(), port=1)
    # vLLM-CPU silently turns `uni` back into `mp` while its V1 multiprocessing flag is on: both are needed.
    assert argv[argv.index("--distributed-executor-backend") + 1] == "uni"
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0" and env["OMP_NUM_THREADS"] == "1"
    _, env = server_mod.server_command(ModelConfig(path="/m"), EnginesConfig(cpu_threads=0), port=1)
    assert "OMP_NUM_THREADS" not in env  # torch's default
    argv, env = server_mod.server_command(ModelConfig(path="/m"), EnginesConfig(cpu_executor="mp"), port=1)
    assert "--distributed-executor-backend" not in argv and "VLLM_ENABLE_V1_MULTIPROCESSING" not in env
    assert "OMP_NUM_THREADS" not in env  # the mp worker binds and sizes its own threads
    monkeypatch.setattr(server_mod, "_on_gpu", lambda: True)  # vLLM's GPU default for one device is uni already
    argv, env = server_mod.server_command(ModelConfig(path="/m"), EnginesConfig(), port=1)
    assert "--distributed-executor-backend" not in argv and "VLLM_ENABLE_V1_MULTIPROCESSING" not in env


def test_server_command_pins_cpu_compute_threads_only_when_asked(monkeypatch):
    monkeypatch.setattr(server_mod, "_on_gpu", lambda: False)
    _, env = server_mod.server_command(
        ModelConfig(path="/m"), EnginesConfig(cpu_threads_bind="0", cpu_executor="mp"), port=1
    )
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0"
    _, env = server_mod.server_command(ModelConfig(path="/m"), EnginesConfig(), port=1)
    assert "VLLM_CPU_OMP_THREADS_BIND" not in env  # vLLM's own choice
    monkeypatch.setattr(server_mod, "_on_gpu", lambda: True)
    _, env = server_mod.server_command(ModelConfig(path="/m"), EnginesConfig(cpu_threads_bind="0"), port=1)
    assert "VLLM_CPU_OMP_THREADS_BIND" not in env  # a CPU-only setting
