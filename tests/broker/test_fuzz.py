"""Fuzz: 100,000 random and mutated frames at a real broker process while a healthy actor and learner use it.

The broker (`python -m broker.server`, real tcp ROUTER) gets, from 4 DEALERs, frames made by mutating valid
messages (flipped bytes, cut frames, missing or extra frames, wrong dtypes, huge declared shapes, nan
log-probs, out-of-vocabulary ids, hostile headers, oversized messages, images of a wrong shape, dtype, size
or channel count) and plain random bytes. Every one is
checked first by the same decode + check_limits the broker runs (the oracle), and only frames it refuses are
sent, so each must come back as a Reject and be counted under its code. Meanwhile an actor, an engine and a
learner run 20 groups through the broker. Asserts: the broker process stays up, answers every bad frame,
counts each under the oracle's code (per code, exactly), and the healthy actor's 40 transitions are all
ingested and trained. Prints frames/s and the broker's peak RSS.

    .venv/bin/python -m pytest tests/broker/test_fuzz.py -s

Cost: ~5 s of CPU to make the frames, ~14 s of broker CPU (~140 us a frame) and about as much in this
process to send them: ~35-45 s on 2 idle cores (much more when other jobs share them).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import json
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import aiohttp
import msgpack
import numpy as np
import psutil
import zmq
import zmq.asyncio
from e2e_testing import dealer

from agentstream import config as config_mod
from agentstream.config import Config
from agentstream.wire import messages as P
from agentstream.wire.addresses import free_port
from agentstream.wire.limits import Limits, check_limits, limits_for

REPO = Path(__file__).resolve().parents[2]
N_FRAMES = 100_000
VOCAB, MAX_TOKENS, MAX_BYTES, MAX_IMAGE_BYTES = 512, 256, 64 * 1024, 4096
SENDERS, WINDOW = 4, 256  # outstanding bad frames per sender: keeps every Reject within the queues' room
GROUPS = 20


# ------------------------------------------------------------------------------------------ valid messages
def valid_transition(rng: random.Random, n_prompt: int | None = None) -> P.Transition:
    g = np.random.default_rng(rng.getrandbits(32))  # arrays from numpy: fast enough for big prompts
    n_p, n_r = n_prompt or rng.randint(1, 40), rng.randint(1, 20)
    lo = rng.randint(0, 5)
    return P.Transition(
        traj_id=f"fz.{rng.randint(0, 99)}",
        group_id=rng.randint(0, 10**6),
        actor="fuzz",
        step=rng.randint(0, 9),
        prompt_ids=g.integers(0, VOCAB, n_p, dtype=np.int32),
        response_ids=g.integers(0, VOCAB, n_r, dtype=np.int32),
        logprobs=(-10 * g.random(n_r)).astype(np.float32),
        version_lo=lo,
        version_hi=lo + rng.randint(0, 2),
        reward=rng.uniform(-1, 1),
        done=rng.random() < 0.5,
        truncated=False,
        valid=True,
        anchor="grid",
        info={"success": False},
    )


def imaged_transition(rng: random.Random) -> P.Transition:
    """A valid transition with 1-3 small images (at most 3 x 12 x 12 x 4 = 1,728 bytes, under MAX_IMAGE_BYTES)."""
    shape = (rng.randint(1, 3), rng.randint(1, 12), rng.randint(1, 12), rng.choice([1, 3, 4]))
    images = np.random.default_rng(rng.getrandbits(32)).integers(0, 256, shape, dtype=np.uint8)
    return dataclasses.replace(valid_transition(rng), images=images)


def valid_message(rng: random.Random) -> P.Message:
    return rng.choice(
        [
            lambda: valid_transition(rng),
            lambda: imaged_transition(rng),
            lambda: P.Transitions.of([imaged_transition(rng) for _ in range(rng.randint(2, 4))]),
            lambda: P.Transitions.of([valid_transition(rng) for _ in range(rng.randint(2, 4))]),
            lambda: P.Hello(role="actor", name=f"x{rng.randint(0, 9)}", incarnation=rng.randint(0, 3)),
            lambda: P.Stats(source="x", role="actor", counters={"env_steps": rng.randint(0, 99)}, gauges={"g": 1.5}),
            lambda: P.BatchRequest(step=rng.randint(0, 50), rank=0, world_size=1),
            lambda: P.VersionUpdate(version=rng.randint(0, 50), metrics={"loss": 0.1}),
            lambda: P.GroupRequest(actor="x"),
            lambda: P.EngineStatus(engine="e", url="http://h:1", version=rng.randint(-1, 9)),
        ]
    )()


def frames_of(msg: P.Message) -> list[bytes]:
    return [bytes(f) for f in P.encode(msg)]


def edit_header(frames: list[bytes], edit) -> list[bytes]:
    header = msgpack.unpackb(frames[0])
    edit(header)
    return [msgpack.packb(header), *frames[1:]]


# ------------------------------------------------------------------------------------------ mutations
# Each takes the pools of encoded valid messages and returns (frames, the code it must get, or None when
# only the oracle knows). Mutating pooled bytes keeps generation cheap (building messages is not).
class Pools:
    def __init__(self, rng: random.Random, size: int = 400):
        self.messages = [frames_of(valid_message(rng)) for _ in range(size)]
        self.transitions = [frames_of(valid_transition(rng)) for _ in range(size)]
        self.imaged = [frames_of(imaged_transition(rng)) for _ in range(size // 4)]
        self.imaged_bundles = [
            frames_of(P.Transitions.of([imaged_transition(rng) for _ in range(rng.randint(2, 4))]))
            for _ in range(size // 4)
        ]


def m_random(rng: random.Random, pools: Pools):
    return [rng.randbytes(rng.randint(0, 200)) for _ in range(rng.randint(1, 3))], None


def m_flip(rng: random.Random, pools: Pools):
    frames = [bytearray(f) for f in rng.choice(pools.messages)]
    for _ in range(rng.randint(1, 4)):
        f = frames[rng.randrange(len(frames))]
        if f:
            f[rng.randrange(len(f))] ^= 1 << rng.randrange(8)
    return [bytes(f) for f in frames], None


def m_cut(rng: random.Random, pools: Pools):
    frames = list(rng.choice(pools.messages))
    i = rng.randrange(len(frames))
    frames[i] = frames[i][: rng.randrange(len(frames[i]) + 1)]
    return frames, None


def m_frame_count(rng: random.Random, pools: Pools):
    frames = rng.choice(pools.transitions)
    return (frames[:-1] if rng.random() < 0.5 else [*frames, rng.randbytes(8)]), "bad_frames"


def m_dtype(rng: random.Random, pools: Pools):
    def edit(h: dict) -> None:
        i = rng.randrange(3)  # prompt_ids, response_ids (int32) or logprobs (float32), each 4-byte items
        h["_arrays"][i][1] = {0: "float32", 1: "float32", 2: "int32"}[i] if rng.random() < 0.5 else "uint8"

    return edit_header(rng.choice(pools.transitions), edit), "bad_dtype"


def m_shape(rng: random.Random, pools: Pools):
    def edit(h: dict) -> None:
        h["_arrays"][rng.randrange(3)][2] = rng.choice([[2**40], [2**62], [2**32, 2**32], [7, 1_000_000], []])

    return edit_header(rng.choice(pools.transitions), edit), "bad_array"


def m_nan(rng: random.Random, pools: Pools):
    frames = list(rng.choice(pools.transitions))
    logprobs = np.frombuffer(frames[3], np.float32).copy()
    logprobs[rng.randrange(logprobs.size)] = rng.choice([np.nan, np.inf, -np.inf])
    frames[3] = logprobs.tobytes()
    return frames, "non_finite"


def m_vocab(rng: random.Random, pools: Pools):
    frames = list(rng.choice(pools.transitions))
    i = rng.choice([1, 2])  # prompt_ids or response_ids
    ids = np.frombuffer(frames[i], np.int32).copy()
    ids[rng.randrange(ids.size)] = rng.choice([VOCAB, VOCAB + 1, 2**31 - 1, -1, -(2**31)])
    frames[i] = ids.tobytes()
    return frames, "out_of_vocab"


def m_image(rng: random.Random, pools: Pools):
    """A lone transition's image frame [n, H, W, C] (its last) or a bundle's image_shapes (its last but one) made
    wrong."""
    if rng.random() < 0.2:  # one more image in a bundle's first item than its bytes hold
        frames = list(rng.choice(pools.imaged_bundles))
        shapes = np.frombuffer(frames[-2], np.int32).copy()
        shapes[0] += 1
        return [*frames[:-2], shapes.tobytes(), frames[-1]], "inconsistent"
    frames = list(rng.choice(pools.imaged))
    header = msgpack.unpackb(frames[0])
    spec = header["_arrays"][-1]  # ["images", "uint8", [n, H, W, C]]
    n, h, w, c = spec[2]
    case = rng.randrange(5)
    if case == 0:  # 2 channels: neither grey, RGB nor RGBA
        spec[2], frames[-1], want = [n, h, w, 2], bytes(n * h * w * 2), "out_of_range"
    elif case == 1:
        spec[1], want = "int32", "bad_dtype"
    elif case == 2:  # 3-D: [n*H, W, C]
        spec[2], want = [n * h, w, c], "bad_array"
    elif case == 3:  # one byte more than the shape holds
        frames[-1], want = frames[-1] + b"\x00", "bad_array"
    else:  # 40 x 40 x 3 = 4,800 bytes > MAX_IMAGE_BYTES 4,096
        spec[2], frames[-1], want = [1, 40, 40, 3], bytes(4800), "too_long"
    return [msgpack.packb(header), *frames[1:]], want


HOSTILE_HEADER_VALUES = [
    ("step", 2**63),
    ("group_id", -(2**63)),
    ("reward", "x"),
    ("traj_id", "t" * 300),
    ("kind", "nope"),
    ("v", 2),
    ("extra", 1),
    ("info", {"k": [1]}),
    ("info", {str(i): 0 for i in range(1100)}),
    ("anchor", msgpack.ExtType(3, b"\x00" * 4)),
    ("done", None),
    ("_arrays", "x"),
    ("version_lo", -5),
]


def m_header(rng: random.Random, pools: Pools):
    name, value = rng.choice(HOSTILE_HEADER_VALUES)
    return edit_header(rng.choice(pools.transitions), lambda h: h.__setitem__(name, value)), None


def m_deep(rng: random.Random, pools: Pools):
    return [b"\x91" * rng.randint(200, 5000) + b"\x00"], None  # nested arrays past msgpack's stack


def m_oversized(rng: random.Random):
    return frames_of(valid_transition(rng, n_prompt=MAX_BYTES // 4 + 100)), "oversized"


MUTATIONS = [
    (m_random, 15),
    (m_flip, 25),
    (m_cut, 10),
    (m_frame_count, 8),
    (m_dtype, 8),
    (m_shape, 8),
    (m_nan, 8),
    (m_vocab, 8),
    (m_header, 7),
    (m_deep, 2),
    (m_image, 8),
]


def oracle(frames: list[bytes], limits: Limits) -> str:
    """The broker's verdict, computed here: the reject code, or "" for a message it would accept."""
    try:
        check_limits(P.decode(frames, max_bytes=MAX_BYTES), limits)
    except P.ProtocolError as exc:
        return exc.code
    return ""


def make_bad_frames(n: int, limits: Limits, seed: int = 0) -> tuple[list[list[bytes]], collections.Counter]:
    """`n` frame lists the broker must refuse, and how many of each code."""
    rng = random.Random(seed)
    pools = Pools(rng)
    funcs, weights = zip(*MUTATIONS)
    out: list[list[bytes]] = []
    codes: collections.Counter = collections.Counter()
    for _ in range(200):  # oversized: a few, they are 64 kB each
        frames, want = m_oversized(rng)
        assert oracle(frames, limits) == want
        out.append(frames)
        codes[want] += 1
    while len(out) < n:
        frames, want = rng.choices(funcs, weights)[0](rng, pools)
        got = oracle(frames, limits)
        if not got:
            continue  # a mutation that is still a valid message: not a bad frame
        assert want is None or got == want, (want, got)  # the mutation is refused for the reason it targets
        out.append(frames)
        codes[got] += 1
    rng.shuffle(out)
    return out, codes


# ------------------------------------------------------------------------------------------ clients


async def recv(sock: zmq.asyncio.Socket, timeout_s: float = 60) -> P.Message:
    return P.decode(await asyncio.wait_for(sock.recv_multipart(), timeout_s))


def fuzz_senders(address: str, batches: list[list[list[bytes]]], timeout_s: float = 240) -> list[int]:
    """Send each batch from its own DEALER, at most WINDOW unanswered per DEALER; returns the Rejects each
    got back. One thread, one poller: cheaper than an event loop per frame."""
    ctx = zmq.Context.instance()
    socks = []
    for k in range(len(batches)):
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, f"fuzz-{k}".encode())
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(address)
        socks.append(sock)
    poller = zmq.Poller()
    for sock in socks:
        poller.register(sock, zmq.POLLIN)
    sent, replies = [0] * len(socks), [0] * len(socks)
    deadline = time.monotonic() + timeout_s
    try:
        while any(r < len(b) for r, b in zip(replies, batches)):
            assert time.monotonic() < deadline, f"only {sum(replies)} Rejects came back in {timeout_s} s"
            for k, sock in enumerate(socks):
                while sent[k] < len(batches[k]) and sent[k] - replies[k] < WINDOW:
                    sock.send_multipart(batches[k][sent[k]])
                    sent[k] += 1
            ready = dict(poller.poll(1000))
            for k, sock in enumerate(socks):
                while sock in ready:
                    try:
                        reply = P.decode(sock.recv_multipart(zmq.NOBLOCK))
                    except zmq.Again:
                        break
                    assert isinstance(reply, P.Reject), reply
                    replies[k] += 1
    finally:
        for sock in socks:
            sock.close()
    return replies


async def healthy_run(address: str, fuzz_done: asyncio.Event) -> dict[str, int]:
    """An actor plays GROUPS groups of 2 one-step trajectories; a learner trains each as one step."""
    actor, engine, learner = dealer(address, "actor-0"), dealer(address, "engine-0"), dealer(address, "learner-0")
    served_during_fuzz = 0
    try:
        await actor.send_multipart(P.encode(P.Hello(role="actor", name="actor-0")))
        await engine.send_multipart(P.encode(P.EngineStatus(engine="engine-0", url="http://e", version=0)))
        rng = random.Random(1)
        for step in range(GROUPS):
            await actor.send_multipart(P.encode(P.GroupRequest(actor="actor-0")))
            grant = await recv(actor)
            assert isinstance(grant, P.GroupGrant), grant
            for traj in range(2):
                t = valid_transition(rng)
                await actor.send_multipart(
                    P.encode(
                        P.Transition(
                            traj_id=f"actor-0.{grant.group_id}.{traj}",
                            group_id=grant.group_id,
                            actor="actor-0",
                            step=0,
                            prompt_ids=t.prompt_ids,
                            response_ids=t.response_ids,
                            logprobs=t.logprobs,
                            version_lo=grant.min_version,
                            version_hi=grant.min_version,
                            reward=float(traj),
                            done=True,
                            truncated=False,
                            valid=True,
                        )
                    )
                )
            await learner.send_multipart(P.encode(P.BatchRequest(step=step, rank=0, world_size=1)))
            batch = await recv(learner)
            assert isinstance(batch, P.Batch) and batch.step == step and batch.traj_index.size == 2, batch
            await learner.send_multipart(P.encode(P.VersionUpdate(version=step + 1)))
            await engine.send_multipart(P.encode(P.EngineStatus(engine="engine-0", url="http://e", version=step + 1)))
            served_during_fuzz += not fuzz_done.is_set()
    finally:
        for sock in (actor, engine, learner):
            sock.close()
    return {"groups": GROUPS, "served_during_fuzz": served_during_fuzz}


class PeakRss:
    """Samples a process's RSS (psutil) every 50 ms in a thread; `peak` is the largest seen."""

    def __init__(self, pid: int):
        self.proc, self.peak, self._stop = psutil.Process(pid), 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            try:
                self.peak = max(self.peak, self.proc.memory_info().rss)
            except psutil.Error:
                return

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


# ------------------------------------------------------------------------------------------ the test
def fuzz_config(tmp_path: Path) -> Path:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"vocab_size": VOCAB}))
    cfg = Config()
    cfg.run.output_dir = str(tmp_path)
    cfg.model.path, cfg.engines.max_model_len = str(model), MAX_TOKENS
    cfg.env.group_size, cfg.trainer.groups_per_step, cfg.learner.world_size = 2, 1, 1
    cfg.trainer.max_staleness, cfg.trainer.total_steps = 1000, 10**6
    cfg.broker.max_message_bytes, cfg.broker.heartbeat_timeout_s = MAX_BYTES, 600.0
    cfg.broker.max_image_bytes = MAX_IMAGE_BYTES
    cfg.broker.logger = []
    path = tmp_path / "config.yaml"
    config_mod.save(cfg, path)
    return path


async def test_broker_survives_100k_bad_frames_and_keeps_serving(tmp_path) -> None:
    config_path = fuzz_config(tmp_path)
    cfg = config_mod.load(config_path)
    limits = limits_for(cfg.model, cfg.engines, cfg.broker)
    assert limits == Limits(vocab_size=VOCAB, max_tokens=MAX_TOKENS, max_image_bytes=MAX_IMAGE_BYTES)
    t0 = time.perf_counter()
    bad, expected = make_bad_frames(N_FRAMES, limits)
    gen_s = time.perf_counter() - t0
    port, dashboard_port, summary_path = free_port(), free_port(), tmp_path / "summary.json"
    proc = start_broker(config_path, port, dashboard_port, summary_path)
    try:
        await wait_listening(dashboard_port, proc)
        broker_ps = psutil.Process(proc.pid)
        rss_start, cpu_start = broker_ps.memory_info().rss, sum(broker_ps.cpu_times()[:2])
        sampler = PeakRss(proc.pid)
        address, fuzz_done = f"tcp://127.0.0.1:{port}", asyncio.Event()
        t0 = time.perf_counter()
        healthy = asyncio.create_task(healthy_run(address, fuzz_done))
        replies = await asyncio.to_thread(fuzz_senders, address, [bad[k::SENDERS] for k in range(SENDERS)])
        fuzz_s = time.perf_counter() - t0
        fuzz_done.set()
        run = await asyncio.wait_for(healthy, 120)
        assert proc.poll() is None, "the broker died"
        peak_rss, broker_cpu = sampler.stop(), sum(broker_ps.cpu_times()[:2]) - cpu_start
        rss_end = broker_ps.memory_info().rss
        hwm_kb = vm_hwm_kib(proc.pid)
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=30)
    assert code == 0, (tmp_path / "broker.log").read_text()[-3000:]
    summary = json.loads(summary_path.read_text())
    counted = {
        k.removeprefix("protocol_"): v for k, v in summary["messages_rejected"].items() if k.startswith("protocol_")
    }
    print(
        f"\nfuzz: {N_FRAMES} bad frames (generated in {gen_s:.1f} s) sent in {fuzz_s:.1f} s "
        f"({N_FRAMES / fuzz_s:.0f}/s; broker CPU {broker_cpu:.1f} s = {broker_cpu / N_FRAMES * 1e6:.0f} us/frame) "
        f"from {SENDERS} DEALERs; Rejects received {sum(replies)}; "
        f"broker counted {sum(counted.values())}: {dict(sorted(counted.items()))}; broker RSS start "
        f"{rss_start / 2**20:.0f} MiB, peak {peak_rss / 2**20:.0f} MiB (psutil, 50 ms samples), end "
        f"{rss_end / 2**20:.0f} MiB, VmHWM "
        f"{hwm_kb / 1024:.0f} MiB; healthy actor: {run['groups']} groups, {run['served_during_fuzz']} during "
        f"the flood; transitions ingested {summary['transitions_ingested']}"
    )
    assert sum(replies) == N_FRAMES  # every bad frame was answered
    assert counted == dict(expected)  # and counted under the reason the oracle gives, code by code
    assert summary["messages_rejected"]["malformed"] == N_FRAMES  # nothing else was refused
    assert summary["transitions_ingested"] == summary["transitions_trained"] == 2 * GROUPS
    assert summary["groups_trained"] == GROUPS and run["served_during_fuzz"] >= 1
    assert peak_rss < 1 << 30  # garbage does not pile up in the broker


def start_broker(config_path: Path, port: int, dashboard_port: int, summary_path: Path) -> subprocess.Popen:
    with open(config_path.parent / "broker.log", "wb") as log_file:
        return subprocess.Popen(
            [
                sys.executable,
                "-m",
                "broker.server",
                "--config",
                str(config_path),
                "--port",
                str(port),
                "--dashboard-port",
                str(dashboard_port),
                "--summary",
                str(summary_path),
            ],
            cwd=REPO,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def vm_hwm_kib(pid: int) -> int:
    """The kernel's peak resident set size of `pid` (Linux /proc), in KiB."""
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(ln.split()[1] for ln in status.splitlines() if ln.startswith("VmHWM")))


async def wait_listening(dashboard_port: int, proc: subprocess.Popen, timeout_s: float = 60) -> None:
    """Until the broker's dashboard answers (its ROUTER is bound before); no message is sent to it."""
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            assert proc.poll() is None, "the broker exited at start-up"
            try:
                async with session.get(f"http://127.0.0.1:{dashboard_port}/api/state") as resp:
                    if resp.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.2)
    raise TimeoutError(f"the broker's dashboard did not answer on port {dashboard_port} within {timeout_s} s")
