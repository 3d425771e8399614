"""Weight sync: time from the learner's optimizer step to every engine serving the new version, how long generation
pauses, and the sending process's extra memory, for the streamed path (engines.weight_sync=stream), the file path
and a LoRA adapter, at three model sizes.

    .venv/bin/python -m bench.weights [--updates 3] [--sizes tiny,small,large] [--modes file,stream,lora]
                                              [--engines 2]
    .venv/bin/python -m bench.weights --modes file,stream --engines 1 --model DIR --engine-url URL

Per size: real vLLM servers, a real weight sidecar per server (`python -m engines.sidecar`) and a real broker; here, a
one-rank FSDP2 policy (`learner.model.load_policy`) takes an optimizer step, then the learner's own path runs: file:
gather (`full_state_dict`), serialise and send (`WeightPublisher.publish`); stream: gather parameter by parameter into
buckets broadcast over a gloo group (`WeightPublisher.publish_stream`); then the wait for every sidecar's
acknowledgement. While that happens, 4 request loops keep engine 0 generating; the longest gap between two answers
during an update, less the median gap, is the pause generation saw. Extra MB: this process's peak resident memory
during the update above its memory before it (Linux VmHWM, reset per update; the largest of the updates). MB/s =
weights / (step-to-serving time), next to the loopback bandwidth of one ZeroMQ PUSH/PULL of the same bytes. With
--engines N the stream path also runs to N servers at the last size (one broadcast group). Sizes: tiny = hidden 128 x
2 layers (0.1M parameters); small = hidden 512 x 4 layers (~9M); large = hidden 1024 x 12 layers (107M). The last
line: the stream path's bandwidth as a fraction of loopback at the last size.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Self

import torch

from agentstream.config import REPO_ROOT, Config
from agentstream.wire.addresses import free_port
from bench import harness
from launcher.procs import start, stop

SIZES = {
    "tiny": {"hidden_size": 128, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2},
    "small": {"hidden_size": 512, "num_layers": 4, "num_heads": 8, "num_kv_heads": 4},
    "large": {"hidden_size": 1024, "num_layers": 12, "num_heads": 16, "num_kv_heads": 4},
}  # 107M parameters
LORA_RANK = 8


@dataclass
class SyncResult:
    """Medians over the updates of one (size, mode, engines)."""

    size: str
    mode: str
    engines: int
    params: int
    payload_mb: float
    gather_s: float
    publish_s: float
    total_s: float
    pause_s: float
    extra_mb: float
    loopback_mb_s: float
    bucket_mb: int = 0  # the stream path's bucket size (MiB)

    @property
    def rate(self) -> float:
        return self.payload_mb / self.total_s


def _status_mb(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    return float("nan")


def exact_rss() -> None:
    """Every allocation of 64 KiB or more gets pages of its own and gives them back when freed (glibc mallopt
    M_MMAP_THRESHOLD, which also stops glibc raising the threshold after large frees): otherwise memory freed by one
    update stays resident and hides the next update's peak."""
    import ctypes

    ctypes.CDLL("libc.so.6").mallopt(-3, 64 << 10)  # M_MMAP_THRESHOLD


def reset_peak_memory() -> float:
    """Reset this process's peak resident memory (VmHWM) to its current one (Linux: clear_refs 5); returns it."""
    Path("/proc/self/clear_refs").write_text("5")
    return _status_mb("VmRSS")


def peak_memory() -> float:
    return _status_mb("VmHWM")


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

        body = {
            "model": self.model,
            "prompt": [1, 2, 3, 4, 5, 6, 7, 8],
            "max_tokens": 8,
            "temperature": 1.0,
            "ignore_eos": True,
        }
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
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    dist.init_process_group("gloo")


def optimizer_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """One real AdamW step on a random batch (the weights change, as after a training step)."""
    ids = torch.randint(0, int(model.config.vocab_size), (2, 32))
    loss = model(input_ids=ids, use_cache=False).logits.float().logsumexp(-1).mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


class Servers:
    """The vLLM servers of one model (started here, or `urls` already up), a broker, and one sidecar per server for
    the mode being measured (`sidecars`)."""

    def __init__(self, model_dir: Path, folder: Path, count: int, lora: bool, urls: list[str]):
        from agentstream import config as config_mod
        from engines.server import wait_ready

        folder.mkdir(parents=True, exist_ok=True)
        self.cfg = Config()
        self.cfg.run.output_dir, self.cfg.model.path = str(folder), str(model_dir)
        self.cfg.model.lora_rank = LORA_RANK if lora else 0
        self.folder, self.procs, self.sidecar_procs = folder, [], []
        self.urls = list(urls)
        for i in range(count - len(self.urls)):
            proc, url = harness.start_vllm(self.cfg, folder / f"engine-{i}.log")
            self.procs.append(proc)
            self.urls.append(url)
        config_mod.save(self.cfg, folder / "config.yaml")
        self.broker_port = free_port()
        self.procs.append(
            start(harness.broker_argv(folder / "config.yaml", self.broker_port), folder / "broker.log", cwd=REPO_ROOT)
        )
        given = set(urls)
        for url in self.urls:
            # One started here loads for minutes on a busy machine; one given as up answers at once (or it is down,
            # which must fail this benchmark now, not after ten minutes).
            asyncio.run(wait_ready(url, 60 if url in given else 600))

    def sidecars(self, publisher, n: int, stream: bool) -> None:
        """Sidecars for the first `n` servers, registered with `publisher` (those of an earlier mode stopped)."""
        for p in self.sidecar_procs:
            stop(p, 15)
        self.sidecar_procs = [
            start(
                [
                    sys.executable,
                    "-m",
                    "engines.sidecar",
                    "--name",
                    f"engine-{i}",
                    "--url",
                    url,
                    "--learner",
                    publisher.address,
                    "--broker",
                    f"tcp://127.0.0.1:{self.broker_port}",
                    "--stream-workers",
                    "1" if stream else "0",
                    "--workdir",
                    str(self.folder / "weights" / f"engine-{i}"),
                ],
                self.folder / f"sidecar-{i}-{'stream' if stream else 'file'}.log",
                cwd=REPO_ROOT,
            )
            for i, url in enumerate(self.urls[:n])
        ]
        publisher.wait_for(0, n, 120)  # registered

    def close(self) -> None:
        for p in reversed(self.sidecar_procs + self.procs):
            stop(p, 15)


def bench_case(size: str, mode: str, servers: Servers, engines: int, updates: int, bucket_mb: int) -> SyncResult:
    """`updates` optimizer steps of a one-rank FSDP2 policy, each published the `mode` way to `engines` servers."""
    from agentstream.models import LORA_ADAPTER_NAME, SERVED_MODEL_NAME
    from agentstream.weights import StreamLayout, StreamSource
    from learner.model import (
        adapter_config,
        adapter_state_dict,
        full_parameters,
        full_state_dict,
        load_policy,
        lora_spec,
        parameter_shapes,
        trainable_parameters,
    )
    from learner.publish import WeightPublisher, serialize_adapter, serialize_state_dict

    cfg = servers.cfg
    lora = lora_spec(cfg.model.lora_rank, cfg.model.lora_alpha, cfg.model.lora_target_modules, 0.0)
    model = load_policy(cfg.model.path, "float32", torch.device("cpu"), 1, lora=lora)
    optimizer = torch.optim.AdamW(trainable_parameters(model), lr=1e-3)
    params = sum(p.numel() for p in model.parameters())
    publisher = WeightPublisher("tcp://127.0.0.1:*")
    layout = StreamLayout.of(parameter_shapes(model), bucket_mb << 20, dtype=cfg.model.dtype)
    source = StreamSource(layout, lambda: full_parameters(model), torch.device("cpu"), solo=True)
    try:
        servers.sidecars(publisher, engines, stream=mode == "stream")
        rows = []
        with Traffic(servers.urls[0], SERVED_MODEL_NAME) as traffic:
            time.sleep(2.0)
            for version in range(1, updates + 1):
                optimizer_step(model, optimizer)
                state, before = None, reset_peak_memory()
                t0 = time.time()
                if mode == "lora":
                    state = adapter_state_dict(model)
                    t1 = time.time()
                    publisher.publish_adapter(version, state, adapter_config(model))
                    payload = len(serialize_adapter(state, adapter_config(model)))
                elif mode == "file":
                    state = full_state_dict(model)
                    t1 = time.time()
                    publisher.publish(version, state)
                    payload = len(serialize_state_dict(state))
                else:  # gathered parameter by parameter inside the send
                    t1 = time.time()
                    publisher.publish_stream(version, source)
                    payload = layout.total_bytes()
                t2 = time.time()
                publisher.wait_for(version, engines, 600)
                t3 = time.time()
                extra = peak_memory() - before
                state = None  # the gathered copy goes before the next update's baseline
                if mode == "lora" and traffic.model != LORA_ADAPTER_NAME:
                    traffic.model = LORA_ADAPTER_NAME  # from now on the adapter serves
                time.sleep(1.0)  # answers after the update close the gap
                rows.append((t1 - t0, t2 - t1, t3 - t0, traffic.pause_s(t0, t3), extra, payload))

        def med(i: int) -> float:
            return statistics.median(r[i] for r in rows)

        payload = rows[-1][5]
        return SyncResult(
            size,
            mode,
            engines,
            params,
            payload / 1e6,
            med(0),
            med(1),
            med(2),
            med(3),
            max(r[4] for r in rows),
            loopback_mb_s(payload),
            bucket_mb if mode == "stream" else 0,
        )
    finally:
        publisher.close()


def main() -> None:
    parser = harness.arguments(__doc__)
    parser.add_argument("--updates", type=int, default=3, help="weight updates per case (median reported)")
    parser.add_argument("--sizes", default="tiny,small,large", help=f"comma-separated: {', '.join(SIZES)}")
    parser.add_argument("--modes", default="file,stream", help="comma-separated: file, stream, lora")
    parser.add_argument(
        "--engines",
        type=int,
        default=2,
        help="also stream to this many engines at the last size (a broadcast: compare with 1)",
    )
    parser.add_argument(
        "--bucket-mb",
        type=int,
        default=Config().engines.weight_bucket_mb,
        help="the stream path's bucket size (engines.weight_bucket_mb)",
    )
    parser.add_argument("--model", default="", help="a model directory instead of --sizes' tiny models")
    parser.add_argument("--engine-url", default="", help="a vLLM server of --model already up (not with lora)")
    args = parser.parse_args()
    modes = args.modes.split(",")
    if args.engine_url and (not args.model or "lora" in modes):
        parser.error(
            "--engine-url needs --model (the server's model), and no lora mode (LoRA needs a server started "
            "with LoRA enabled: leave --engine-url out and the benchmark starts one)"
        )
    harness.stop_on_sigterm()
    torch.set_num_threads(1)
    exact_rss()
    init_one_rank()
    from launcher.tiny_model import make_tiny_model

    folder = Path(tempfile.mkdtemp(prefix="bench-weights-"))
    print(harness.load_line(), flush=True)
    print(
        f"{'size':<6} {'mode':<6} {'eng':>3} {'params':>8} {'MB':>7} {'gather s':>8} {'send s':>7} "
        f"{'step->serve s':>13} {'pause s':>8} {'extra MB':>8} {'MB/s':>8} {'loopback MB/s':>13}",
        flush=True,
    )
    results = []
    models = (
        {"given": Path(args.model)}
        if args.model
        else {size: make_tiny_model(folder / f"model-{size}", **SIZES[size]) for size in args.sizes.split(",")}
    )
    for k, (size, model_dir) in enumerate(models.items()):
        cases = [(mode, 1) for mode in modes if mode != "lora"]
        if k == len(models) - 1 and args.engines > 1 and "stream" in modes:
            cases.append(("stream", args.engines))
        groups = [(False, cases)] + ([(True, [("lora", 1)])] if "lora" in modes else [])
        for lora, group in groups:
            if not group:
                continue
            servers = Servers(
                model_dir,
                folder / f"{size}{'-lora' if lora else ''}",
                max(n for _, n in group),
                lora,
                [args.engine_url] if args.engine_url else [],
            )
            try:
                for mode, n in group:
                    r = bench_case(size, mode, servers, n, args.updates, args.bucket_mb)
                    results.append(r)
                    print(
                        f"{r.size:<6} {r.mode:<6} {r.engines:>3} {r.params / 1e6:>7.2f}M {r.payload_mb:>7.2f} "
                        f"{r.gather_s:>8.3f} {r.publish_s:>7.3f} {r.total_s:>13.3f} {r.pause_s:>8.3f} "
                        f"{r.extra_mb:>8.1f} {r.rate:>8.1f} {r.loopback_mb_s:>13.0f}",
                        flush=True,
                    )
            finally:
                servers.close()
    report(results)


def report(results: list[SyncResult]) -> None:
    """The ratios the stream path is judged by, each against a baseline measured in this run, ratios last."""
    by = {(r.size, r.mode, r.engines): r for r in results}
    print(
        "step->serving: "
        + ", ".join(f"{r.size}/{r.mode}x{r.engines} {r.total_s:.2f}s (pause {r.pause_s:.2f}s)" for r in results)
    )
    for r in results:
        if r.mode == "stream" and r.engines == 1:
            file = by.get((r.size, "file", 1))
            vs_file = f", file path {file.rate / file.loopback_mb_s:.2f} of loopback" if file else ""
            print(
                f"{r.size}: stream {r.rate:.0f} MB/s = {r.rate / r.loopback_mb_s:.2f} of loopback{vs_file}; sender's "
                f"extra memory {r.extra_mb:.0f} MiB = {r.extra_mb / r.payload_mb * 1.048576:.2f} x the weights"
                f"{f' = {r.extra_mb / r.bucket_mb:.2f} buckets' if r.bucket_mb else ''}"
            )
    many = [r for r in results if r.mode == "stream" and r.engines > 1]
    for r in many:
        one = by[(r.size, "stream", 1)]
        print(
            f"{r.size}: stream to {r.engines} engines takes {r.total_s:.2f}s, 1 engine {one.total_s:.2f}s: "
            f"{r.total_s / one.total_s:.2f}x"
        )
    last = [r for r in results if r.mode == "stream" and r.engines == 1][-1:]
    if last:
        print(f"stream/loopback at {last[0].size}: {last[0].rate / last[0].loopback_mb_s:.2f}")


if __name__ == "__main__":
    main()
