"""Engines: vLLM OpenAI-compatible servers for the policy, the weight sidecar beside each, and the actors' client.

    server.py      server_command(model, engines, port) -> (argv, env); wait_ready(url, timeout_s, proc)
    worker_ext.py  the vLLM worker extension that reloads weights in a running server (tied heads fixed)
    sidecar.py       python -m engines.sidecar --name engine-0 --url http://127.0.0.1:8000 \\
                       --learner tcp://127.0.0.1:5600 --broker tcp://127.0.0.1:5555
    control.py     how the sidecar drives its server (ServerControl: pause, load, label, reset, resume) and the
                   weight folders it writes (write_weights, write_adapter)
    client.py      EngineClient.generate: token ids in; token ids, log-probs, version interval out
    user.py        what the processes that generate on the engines share (an actor, the gateway): start-up and
                   end, EnginePool.pick (which engine next), the engines the broker lists and those joining later

Weight flow: learner rank 0 `learner.publish.WeightPublisher.publish_stream` -> buckets over a gloo/NCCL group
(`agentstream.weights`: the bucket format both ends share) to the server's workers, driven by the sidecar through
vLLM's weight-transfer routes: pause(keep) -> load -> label version -> reset prefix cache -> resume -> sidecar
reports `EngineStatus` (engines.weight_sync=file: `publish` -> ZeroMQ -> the sidecar writes safetensors -> reload).
The names the policy is served under, and the adapter payload's metadata key, are `agentstream.models`.

    .venv/bin/python -m pytest tests/engines     # starts one real vLLM server (~1 min on 2 CPU cores)
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# Exported lazily: an actor importing engines.client should not pay for the server's launch code, and
# vLLM's worker imports engines.worker_ext, which needs none of the rest.
_EXPORTS = {
    "EngineClient": "engines.client",
    "EngineError": "engines.client",
    "Generation": "engines.client",
    "ServerNotReady": "engines.server",
    "server_command": "engines.server",
    "wait_ready": "engines.server",
}
__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:  # for type checkers only; at run time __getattr__ imports them
    from engines.client import EngineClient, EngineError, Generation  # noqa: F401  # re-exported (__all__, lazily)
    from engines.server import ServerNotReady, server_command, wait_ready  # noqa: F401  # re-exported (__all__, lazily)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'engines' has no attribute {name!r}; it exports {', '.join(__all__)}")
    return getattr(importlib.import_module(module), name)
