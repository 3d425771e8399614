"""Weight sync: time from the learner's optimizer step to the engine serving the new version, and how long
generation pauses, for full weights and for a LoRA adapter, at two model sizes.

    .venv/bin/python scripts/bench_weights.py [--updates 3] [--sizes tiny,small] [--modes full,lora]
    .venv/bin/python scripts/bench_weights.py --modes full --model DIR --engine-url URL   # a server already up

Per (size, mode): a real vLLM server (LoRA enabled for `lora`), its real weight sidecar (`python -m
engines.sidecar`) and a real broker; here, a one-rank FSDP2 policy (`learner.model.load_policy`) takes an
optimizer step, then the learner's own path runs: gather (`full_state_dict` / `adapter_state_dict`),
serialise and send (`engines.weights.WeightPublisher`), and wait for the agent's acknowledgement. While
that happens, 4 request loops keep the engine generating; the longest gap between two answers during an
update, less the median gap, is the pause generation saw. MB/s = payload / (step-to-serving time), next to
the loopback bandwidth of one ZeroMQ PUSH/PULL of the same bytes. Sizes: tiny = hidden 128 x 2 layers;
small = hidden 512 x 4 layers. The last line is the step-to-serving time of each case.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import signal
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Self

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch

from agentstream.config import Config
from agentstream.wire.addresses import free_port
from launcher.procs import start, stop

SIZES = {"tiny": {"hidden_size": 128, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2},
         "small": {"hidden_size": 512, "num_layers": 4, "num_heads": 8, "num_kv_heads": 4}}
LORA_RANK = 8


@dataclass
class SyncResult:
    """Medians over the updates of one (size, mode)."""

    size: str
    mode: str
    params: int
    payload_mb: float
    gather_s: float
    publish_s: float
    total_s: float
    pause_s: float
    loopback_mb_s: float


def loopback_mb_s(n_bytes: int, repeats: int = 5) -> float:
    """MB/s of one ZeroMQ PUSH -> PULL of `n_bytes` over tcp loopback (zero-copy send), best of `repeats`."""
    import zmq

    ctx = zmq.Context.instance()
    pull = ctx.socket(zmq.PULL)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    push = ctx.socket(zmq.PUSH)
    push.connect(f"tcp://127.0.0.1:{port}")
    payload = os.urandom(n_bytes)
    best = 0.0
    for _ in range(repeats):
        t0 = time.perf_counter()
        push.send(payload, copy=False)
        pull.recv(copy=False)
        best = max(best, n_bytes / (time.perf_counter() - t0) / 1e6)
    push.close(0)
    pull.close(0)
    return best


class Traffic:
    """`n` request loops on the engine; records when each answer came (a thread with its own loop)."""

    def __init__(self, url: str, model: str, n: int = 4):
        self.url, self.model, self.n = url, model, n
        self.done: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)

    async def _run(self) -> None:
        import aiohttp

        body = {"model": self.model, "prompt": [1, 2, 3, 4, 5, 6, 7, 8], "max_tokens": 8, "temperature": 1.0,
                "ignore_eos": True}
        async with aiohttp.ClientSession() as session:
            async def loop() -> None:
                while not self._stop.is_set():
                    try:
                        async with session.post(f"{self.url}/v1/completions", json=body) as resp:
                            await resp.read()
                            if resp.status == 200:
                                self.done.append(time.time())
                    except aiohttp.ClientError:
                        await asyncio.sleep(0.05)
            await asyncio.gather(*(loop() for _ in range(self.n)))

    def pause_s(self, t0: float, t1: float) -> float:
        """Longest gap between answers that overlaps [t0, t1], less the median gap (what the update added)."""
        times = sorted(self.done)
        gaps = [(b - a, a, b) for a, b in itertools.pairwise(times)]
        if not gaps:
            return float("nan")
        typical = statistics.median(g for g, _, _ in gaps)
        during = [g for g, a, b in gaps if b >= t0 and a <= t1 + 0.5]
        return max(0.0, max(during, default=typical) - typical)


def init_one_rank() -> None:
    """A one-process gloo group, as torchrun would set it up (FSDP2 needs one)."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1",
                      LOCAL_RANK="0")
    dist.init_process_group("gloo")


def optimizer_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """One real AdamW step on a random batch (the weights change, as after a training step)."""
    ids = torch.randint(0, int(model.config.vocab_size), (2, 32))
    loss = model(input_ids=ids, use_cache=False).logits.float().logsumexp(-1).mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def bench_case(size: str, mode: str, model_dir: Path, updates: int, folder: Path, engine_url: str = "") -> SyncResult:
    """One (size, mode); `engine_url`: a vLLM server of `model_dir` that is already up (full weights only) instead of
    one started here. It is left running, serving the benchmark's last weights."""
    from engines.server import (
        LORA_ADAPTER_NAME,
        SERVED_MODEL_NAME,
        server_command,
        wait_ready,
    )
    from engines.weights import WeightPublisher, serialize_adapter, serialize_state_dict
    from learner.model import (
        adapter_config,
        adapter_state_dict,
        full_state_dict,
        load_policy,
        lora_spec,
        trainable_parameters,
    )

    folder.mkdir(parents=True, exist_ok=True)
    cfg = Config()
    cfg.run.output_dir = str(folder)
    cfg.model.path = str(model_dir)
    cfg.model.lora_rank = LORA_RANK if mode == "lora" else 0
    lora = lora_spec(cfg.model.lora_rank, cfg.model.lora_alpha, cfg.model.lora_target_modules, 0.0)
    model = load_policy(str(model_dir), "float32", torch.device("cpu"), 1, lora=lora)
    optimizer = torch.optim.AdamW(trainable_parameters(model), lr=1e-3)
    params = sum(p.numel() for p in model.parameters())
    eport, bport = free_port(), free_port()
    argv, env = server_command(cfg.model, cfg.engines, eport)
    url = engine_url or f"http://127.0.0.1:{eport}"
    procs = [] if engine_url else [start(argv, folder / "engine.log", env=env)]
    publisher = WeightPublisher("tcp://127.0.0.1:*")
    try:
        from agentstream import config as config_mod

        config_mod.save(cfg, folder / "config.yaml")
        procs.append(start([sys.executable, "-m", "broker.server", "--config", str(folder / "config.yaml"), "--port",
                            str(bport), "--dashboard-port", str(free_port())], folder / "broker.log", cwd=ROOT))
        asyncio.run(wait_ready(url, 400, proc=procs[0] if procs else None))
        procs.append(start([sys.executable, "-m", "engines.sidecar", "--name", "engine-0", "--url", url, "--learner",
                            publisher.address, "--broker", f"tcp://127.0.0.1:{bport}", "--workdir",
                            str(folder / "weights")], folder / "sidecar.log", cwd=ROOT))
        publisher.wait_for(0, 1, 120)  # the agent registered
        rows = []
        served = SERVED_MODEL_NAME
        with Traffic(url, served) as traffic:
            time.sleep(2.0)
            for version in range(1, updates + 1):
                optimizer_step(model, optimizer)
                t0 = time.time()
                if mode == "lora":
                    state = adapter_state_dict(model)
                    t1 = time.time()
                    publisher.publish_adapter(version, state, adapter_config(model))
                else:
                    state = full_state_dict(model)
                    t1 = time.time()
                    publisher.publish(version, state)
                t2 = time.time()
                publisher.wait_for(version, 1, 300)
                t3 = time.time()
                if mode == "lora" and traffic.model != LORA_ADAPTER_NAME:
                    traffic.model = LORA_ADAPTER_NAME  # from now on the adapter serves
                time.sleep(1.0)  # answers after the update close the gap
                payload = len(serialize_adapter(state, adapter_config(model)) if mode == "lora" else serialize_state_dict(state))
                rows.append((t1 - t0, t2 - t1, t3 - t0, traffic.pause_s(t0, t3), payload))
        med = lambda i: statistics.median(r[i] for r in rows)
        payload = rows[-1][4]
        return SyncResult(size, mode, params, payload / 1e6, med(0), med(1), med(2), med(3), loopback_mb_s(payload))
    finally:
        publisher.close()
        for p in reversed(procs):
            stop(p, 15)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--updates", type=int, default=3, help="weight updates per case (median reported)")
    parser.add_argument("--sizes", default="tiny,small", help=f"comma-separated: {', '.join(SIZES)}")
    parser.add_argument("--modes", default="full,lora", help="comma-separated: full, lora")
    parser.add_argument("--model", default="", help="a model directory instead of --sizes' tiny models")
    parser.add_argument("--engine-url", default="", help="a vLLM server of --model already up (--modes full only)")
    args = parser.parse_args()
    if args.engine_url and (not args.model or args.modes != "full"):
        parser.error("--engine-url needs --model (the server's model) and --modes full (LoRA needs a server started "
                     "with LoRA enabled: leave --engine-url out and the benchmark starts one)")
    # SIGTERM (e.g. `timeout`) unwinds like Ctrl-C, so the servers this script started are stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    torch.set_num_threads(1)
    init_one_rank()
    from launcher.tiny_model import make_tiny_model

    folder = Path(tempfile.mkdtemp(prefix="bench-weights-"))
    print(f"# load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores (other work on the machine slows every path; compare ratios within one run)", flush=True)
    print(f"{'size':<6} {'mode':<5} {'params':>8} {'MB':>7} {'gather s':>8} {'send s':>7} {'step->serve s':>13} "
          f"{'pause s':>8} {'MB/s':>8} {'loopback MB/s':>13}", flush=True)
    results = []
    models = {"given": Path(args.model)} if args.model else {
        size: make_tiny_model(folder / f"model-{size}", **SIZES[size]) for size in args.sizes.split(",")}
    for size, model_dir in models.items():
        for mode in args.modes.split(","):
            r = bench_case(size, mode, model_dir, args.updates, folder / f"{size}-{mode}", args.engine_url)
            results.append(r)
            print(f"{r.size:<6} {r.mode:<5} {r.params / 1e6:>7.2f}M {r.payload_mb:>7.2f} {r.gather_s:>8.3f} "
                  f"{r.publish_s:>7.3f} {r.total_s:>13.3f} {r.pause_s:>8.3f} {r.payload_mb / r.total_s:>8.1f} "
                  f"{r.loopback_mb_s:>13.0f}", flush=True)
    print("step->serving: " + ", ".join(f"{r.size}/{r.mode} {r.total_s:.2f}s (pause {r.pause_s:.2f}s)"
                                         for r in results))


if __name__ == "__main__":
    main()
