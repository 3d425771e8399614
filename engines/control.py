"""How a weight sidecar (engines/sidecar.py) drives its vLLM server and lays out the weights it gives it.

`ServerControl` is the server's dev-mode HTTP endpoints an update uses: pause (keep) -> load (a folder of full
weights through our worker extension, or a LoRA adapter in place) -> label the version -> reset the prefix cache
(and the encoder and multimodal caches) -> resume; also the streamed path's join and update routes and /health.
The folders: WORKDIR/v<N>/ one per full-weight update (older ones pruned once the server has read them),
WORKDIR/adapter/ the trained adapter and WORKDIR/frozen/ the frozen copy's (each rewritten in place: vLLM may read
an adapter's folder again while it serves that name).
"""

from __future__ import annotations

import asyncio
import json as jsonlib  # `json` is call()'s keyword, as in aiohttp
import os
import re
import shutil
from pathlib import Path
from typing import Any

import aiohttp

from agentstream.models import ADAPTER_CONFIG_KEY, FROZEN_ADAPTER_NAME, LORA_ADAPTER_NAME

RELOAD_METHOD = "agentstream_reload_weights"  # engines.worker_ext.WeightReloadExtension
# Reset after every update: the encoder cache holds the old weights' image embeddings. Only that one: the multimodal
# processor cache holds preprocessed pixels, which no weight update changes. A server without the route (404) has
# no such cache.
MM_CACHE_RESETS = ("/reset_encoder_cache",)
ADAPTER_FOLDER, FROZEN_FOLDER = "adapter", "frozen"  # WORKDIR/<folder>: the trained adapter's, the frozen copy's


class ApplyError(RuntimeError):
    """A step of a weight update failed on the server."""


class ServerDied(RuntimeError):
    """The server stopped answering /health."""


class ServerControl:
    """The dev-mode HTTP endpoints of one vLLM server that a weight update uses.

    Pausing is vLLM's /sleep at level 0 with mode keep: the scheduler stops (running requests are frozen, not
    dropped; new ones queue) exactly as /pause does, without /pause's own 20 ms sleep and cache clearing (the
    caches are reset after the load, before resuming); /wake_up with the tag "scheduling" resumes it. Measured
    here: pause + label + resume 29-30 ms -> 7-8 ms."""

    def __init__(self, url: str, session: aiohttp.ClientSession, apply_timeout_s: float):
        self.url = url.rstrip("/")
        self._session = session
        self._timeout = aiohttp.ClientTimeout(total=apply_timeout_s)

    async def call(
        self,
        path: str,
        json: dict[str, Any] | None = None,
        params: dict[str, str] | None = None,
        absent_ok: bool = False,
    ) -> Any:
        """POST `path`; returns the JSON answer (None if empty; also if the server lacks the route and `absent_ok`).
        Raises ApplyError naming the step."""
        try:
            async with self._session.post(self.url + path, json=json, params=params, timeout=self._timeout) as resp:
                text = await resp.text()
                if resp.status == 404 and absent_ok:
                    return None
                if resp.status != 200:
                    raise ApplyError(f"POST {self.url}{path} failed: HTTP {resp.status}: {text[:500]}")
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            raise ApplyError(f"POST {self.url}{path} failed: {exc.__class__.__name__}: {exc}") from None
        try:
            return jsonlib.loads(text) if text.strip() else None
        except ValueError:
            return text  # /v1/load_lora_adapter answers plain text

    async def pause(self) -> None:
        await self.call("/sleep", params={"level": "0", "mode": "keep"})

    async def set_version(self, version: int) -> None:
        await self.call("/update_weight_version", json={"new_version": str(version)})

    async def apply(
        self, weights_dir: Path, version: int, lora: bool = False, frozen_dir: Path | None = None
    ) -> list[Any]:
        """Swap in the weights of `weights_dir` (an adapter directory if `lora`) as `version`; returns the
        workers' reload reports (the server's answer for an adapter). `frozen_dir`: an adapter directory to load
        under FROZEN_ADAPTER_NAME too (a refresh of the frozen copy), in the same pause."""
        # keep: running requests are frozen and new ones queue; none is dropped (the prefix-cache reset before
        # resuming preempts the frozen ones, so they recompute their KV on the new weights).
        await self.pause()
        if lora:
            answer = {"results": [await self._load_adapter(LORA_ADAPTER_NAME, weights_dir)]}
            if frozen_dir is not None:
                answer["results"].append(await self._load_adapter(FROZEN_ADAPTER_NAME, frozen_dir))
        else:
            answer = await self.call(
                "/collective_rpc", json={"method": RELOAD_METHOD, "kwargs": {"weights_path": str(weights_dir)}}
            )
        await self._label_and_resume(version)
        return list((answer or {}).get("results", []))

    async def _load_adapter(self, name: str, folder: Path) -> Any:
        # In place: the adapter keeps its name and id, so requests naming it take the new weights (the first load of
        # a name adds it).
        return await self.call(
            "/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(folder), "load_inplace": True}
        )

    async def join(self, init_info: dict[str, Any]) -> None:
        """Have the server's workers join the learner's weight group (blocks until every member has)."""
        await self.call("/init_weight_transfer_engine", json={"init_info": init_info})

    async def stream(self, layout: dict[str, Any], version: int) -> None:
        """Take `version` from the group's broadcast: the streamed twin of `apply` (same pause, label, reset)."""
        await self.pause()
        await self.call("/start_weight_update")
        await self.call("/update_weights", json={"update_info": layout})  # returns once every bucket is loaded
        await self.call("/finish_weight_update")  # layer-wise reload finished, LM head re-tied (worker_ext)
        await self._label_and_resume(version)

    async def _label_and_resume(self, version: int) -> None:
        # Label before resuming: no token of the new weights can be generated under the old label, which
        # is what makes a client's after-the-answer read an upper bound (engines.client).
        # Cached prefixes hold keys/values of the old weights, and so do the frozen requests: reset_running_requests
        # preempts them too (they recompute their KV at resume).
        # The label and the resets are independent and all precede the resume: sent together, the update waits for
        # the slowest of them rather than their sum (4 calls of ~2-4 ms each here).
        _, reset, *_ = await asyncio.gather(
            self.set_version(version),
            self.call("/reset_prefix_cache", params={"reset_running_requests": "true"}),
            *(self.call(path, absent_ok=True) for path in MM_CACHE_RESETS),
        )
        if isinstance(reset, dict) and reset.get("success") is False:
            raise ApplyError(f"{self.url}/reset_prefix_cache refused (blocks still held); stale KV would be reused")
        await self.call("/wake_up", params={"tags": "scheduling"})

    async def requests_in_flight(self) -> int:
        """Requests the server is running or queueing, from its Prometheus /metrics (for the dashboard);
        -1 when it does not say (metrics off, or not answering)."""
        try:
            async with self._session.get(self.url + "/metrics", timeout=aiohttp.ClientTimeout(total=2)) as resp:
                text = await resp.text() if resp.status == 200 else ""
        except (aiohttp.ClientError, TimeoutError):
            return -1
        found = re.findall(r"^vllm:num_requests_(?:running|waiting)(?:\{[^}]*\})? (\S+)$", text, re.MULTILINE)
        return int(sum(float(v) for v in found)) if found else -1

    async def healthy(self) -> bool:
        try:
            async with self._session.get(self.url + "/health", timeout=aiohttp.ClientTimeout(total=5)) as resp:
                return resp.status == 200
        except (aiohttp.ClientError, asyncio.TimeoutError):
            return False


def write_weights(workdir: Path, version: int, payload: bytes) -> Path:
    """WORKDIR/v{version}/model.safetensors, written under a temporary name and renamed into place."""
    folder = workdir / f"v{version}"
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / "model.safetensors.partial"  # not *.safetensors: a loader never picks it up
    tmp.write_bytes(payload)
    os.replace(tmp, folder / "model.safetensors")
    return folder


def write_adapter(workdir: Path, version: int, payload: bytes, folder_name: str = ADAPTER_FOLDER) -> Path:
    """WORKDIR/`folder_name`/ as a peft adapter directory: adapter_model.safetensors (the payload as it came)
    and adapter_config.json (from the payload's metadata, see `learner.publish.serialize_adapter`).

    One folder for every version, each file replaced atomically: vLLM may read an adapter's folder again
    whenever it re-activates it for a request (seen: a request admitted under v1 re-read v1's folder after
    v2 had arrived and v1's folder was gone, and the worker died), so the path must stay valid, and it
    always holds the newest adapter served under its name (the frozen copy's: FROZEN_FOLDER). `version` only
    names the update in errors. Raises ApplyError if the payload carries no adapter config."""
    config = _adapter_config_text(payload)
    folder = workdir / folder_name
    folder.mkdir(parents=True, exist_ok=True)
    for name, data in (("adapter_config.json", config.encode()), ("adapter_model.safetensors", payload)):
        tmp = folder / f"{name}.partial"
        tmp.write_bytes(data)
        os.replace(tmp, folder / name)
    return folder


def _adapter_config_text(payload: bytes) -> str:
    """The adapter_config.json text in a safetensors file's metadata (header: u64 length, then JSON)."""
    try:
        n = int.from_bytes(payload[:8], "little")
        header = jsonlib.loads(payload[8 : 8 + n])
        text = header["__metadata__"][ADAPTER_CONFIG_KEY]
        jsonlib.loads(text)
    except (ValueError, KeyError, TypeError) as exc:
        raise ApplyError(f"a peft_adapter update without a readable adapter config in its metadata ({exc!r})") from None
    return text


def frozen_due(version: int, frozen_version: int, every: int) -> bool:
    """Whether applying `version` refreshes the frozen copy, which holds `frozen_version` (-1: unknown): when `version`
    lies in another block of `every` versions (0..every-1, every..2*every-1, ...) than it. So the first version applied
    in each block refreshes it, also when the block's first versions were skipped (a newer update arrived first), and
    engines stay on one schedule; a learner that went back (restarted from a checkpoint) refreshes it too.
    `every` 0: never."""
    return every > 0 and version // every != frozen_version // every


def prune_weight_dirs(workdir: Path, keep: Path) -> None:
    """Delete every v* folder but `keep` (vLLM has already read its weights into memory)."""
    for folder in workdir.glob("v*"):
        if folder.is_dir() and folder != keep:
            shutil.rmtree(folder, ignore_errors=True)
