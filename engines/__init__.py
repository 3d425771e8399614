"""Engines: vLLM OpenAI-compatible servers for the policy, the weight sidecar beside each, and both ends'
client code.

    server.py      server_command(model, engines, port) -> (argv, env); wait_ready(url, timeout_s, proc)
    worker_ext.py  the vLLM worker extension that reloads weights in a running server (tied heads fixed)
    sidecar.py       python -m engines.sidecar --name engine-0 --url http://127.0.0.1:8000 \\
                       --learner tcp://127.0.0.1:5600 --broker tcp://127.0.0.1:5555
    weights.py     WeightPublisher: learner rank 0 streams full weights (or sends a file, or a LoRA adapter) to every sidecar
    stream.py      both ends of the streamed buckets: StreamLayout, open_group, send_buckets, receive_buckets
    client.py      EngineClient.generate: token ids in; token ids, log-probs, version interval out

Weight flow: learner rank 0 `WeightPublisher.publish_stream` -> buckets over a gloo/NCCL group (stream.py) to the
server's workers, driven by the sidecar through vLLM's weight-transfer routes: pause(keep) -> load -> label version
-> reset prefix cache -> resume -> sidecar reports `EngineStatus` (engines.weight_sync=file: `publish` -> ZeroMQ ->
the sidecar writes safetensors -> reload).

    .venv/bin/python -m pytest tests/engines     # starts one real vLLM server (~1 min on 2 CPU cores)
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# Exported lazily: an actor importing engines.client should not pay for torch (engines.weights), and
# vLLM's worker imports engines.worker_ext, which needs none of the rest.
_EXPORTS = {
    "EngineClient": "engines.client",
    "EngineError": "engines.client",
    "Generation": "engines.client",
    "SERVED_MODEL_NAME": "engines.server",
    "LORA_ADAPTER_NAME": "engines.server",
    "served_model_name": "engines.server",
    "base_model_name": "engines.server",
    "ServerNotReady": "engines.server",
    "server_command": "engines.server",
    "wait_ready": "engines.server",
    "WeightPublisher": "engines.weights",
    "serialize_state_dict": "engines.weights",
    "serialize_adapter": "engines.weights",
}
__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from engines.client import EngineClient, EngineError, Generation
    from engines.server import (
        LORA_ADAPTER_NAME,
        SERVED_MODEL_NAME,
        ServerNotReady,
        base_model_name,
        served_model_name,
        server_command,
        wait_ready,
    )
    from engines.weights import WeightPublisher, serialize_adapter, serialize_state_dict


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'engines' has no attribute {name!r}; it exports {', '.join(__all__)}")
    return getattr(importlib.import_module(module), name)
