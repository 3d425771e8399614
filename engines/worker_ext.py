"""vLLM worker extension: reload the policy's weights from a directory, in a running server.

vLLM mixes this class into its worker class when the server starts with
`--worker-extension-cls engines.worker_ext.WeightReloadExtension` (see `engines.server`); its methods are
then callable over HTTP through the dev endpoint:

    POST /collective_rpc {"method": "agentstream_reload_weights", "kwargs": {"weights_path": DIR}}

Why not `reload_weights` alone: with tied embeddings (Qwen2.5 0.5B/1.5B, the tiny test model) and a
checkpoint without `lm_head.weight` (what `save_pretrained` writes, and what `WeightPublisher` sends for
an HF state dict), vLLM-CPU reloads `embed_tokens` but keeps the LM head it packed for its CPU GEMM at
start-up (log: `ParallelLMHead: Failed to load weights`), so log-probs come from the old output layer
(off by ~1 nat on the tiny model). We re-tie the head to the embedding and re-run the head's
`process_weights_after_loading`, which re-packs it (a no-op for unquantized heads on GPU). When the file
does hold `lm_head.weight`, the re-tie is harmless.

Method names carry an `agentstream_` prefix because vLLM refuses an extension whose attribute names clash
with the worker's own (it has `reload_weights`).

Streamed weights (`engines.weight_sync=stream`): importing this module (vLLM imports the extension in every
worker before it loads the model) registers `StreamTransfer` with vLLM's weight-transfer factory as backend
"agentstream"; the server starts with `--weight-transfer-config '{"backend": "agentstream"}'` and the sidecar
drives vLLM's own routes: /init_weight_transfer_engine (join the learner's group, `agentstream.weights`),
/start_weight_update, /update_weights (receive the buckets and load them), /finish_weight_update.
vLLM's own "nccl" backend needs vLLM's communicator on the learner too, which has no vLLM; this backend uses
torch's process groups on both ends (gloo on CPU, NCCL on GPUs) and re-ties the LM head as above.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import WeightTransferEngine, WeightTransferInitInfo, WeightTransferUpdateInfo
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

from agentstream.weights import StreamLayout, open_group, receive_buckets
from engines.server import STREAM_BACKEND


def _input_embedding(model: torch.nn.Module) -> torch.nn.Module | None:
    """The model's token-embedding module (vLLM's VocabParallelEmbedding), however the model names it."""
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

    inner = getattr(model, "model", None)
    embed = getattr(inner, "embed_tokens", None)
    if isinstance(embed, VocabParallelEmbedding):
        return embed
    for module in model.modules():
        if isinstance(module, VocabParallelEmbedding) and not isinstance(module, ParallelLMHead):
            return module
    return None


def is_tied(model_config: Any) -> bool:
    return bool(getattr(model_config.hf_text_config, "tie_word_embeddings", False))


def retie_lm_head(model: torch.nn.Module, tied: bool) -> bool:
    """Point the LM head at the (reloaded) embedding and re-process it. Returns whether it did."""
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

    head = getattr(model, "lm_head", None)
    embed = _input_embedding(model)
    if not tied or not isinstance(head, ParallelLMHead) or embed is None:
        return False
    # The reload may have replaced embed_tokens.weight with a new Parameter: share it again.
    head.weight = embed.weight
    # On CPU this re-packs the weight for the oneDNN/AMX GEMM the head actually runs.
    head.quant_method.process_weights_after_loading(head)
    return True


class WeightReloadExtension:
    """Mixed into vLLM's Worker (so `self` is the worker: `self.model_runner`, `self.model_config`)."""

    def agentstream_reload_weights(self, weights_path: str) -> dict[str, Any]:
        """Reload every weight from the safetensors files in `weights_path`, then fix a tied LM head.

        Returns a small JSON-able report (what /collective_rpc sends back): seconds taken and whether the
        head was re-tied.
        """
        t0 = time.perf_counter()
        self.reload_weights(weights_path=str(weights_path))  # type: ignore[attr-defined]
        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        retied = retie_lm_head(model, is_tied(self.model_config))  # type: ignore[attr-defined]
        return {"seconds": time.perf_counter() - t0, "retied": retied, "weights_path": str(weights_path)}


# ------------------------------------------------------------------------------------ streamed weights
@dataclass
class StreamInit(WeightTransferInitInfo):
    """/init_weight_transfer_engine's init_info: the learner's group (sent by
    `learner.publish.WeightPublisher._join`)."""

    host: str
    port: int
    rank_offset: int  # this engine's first worker's rank in the group (the learner's sender is rank 0)
    world_size: int
    backend: str  # gloo | nccl
    timeout_s: float = 600.0


@dataclass
class StreamUpdate(WeightTransferUpdateInfo):
    """/update_weights's update_info: an `agentstream.weights.StreamLayout` as a dict."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    bucket_bytes: int


class StreamTransfer(WeightTransferEngine[StreamInit, StreamUpdate]):
    """vLLM's weight-transfer engine for the learner's streamed buckets (see the module docstring)."""

    init_info_cls = StreamInit
    update_info_cls = StreamUpdate
    supports_draft_weight_update = False

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.group: torch.distributed.ProcessGroup | None = None

    def init_transfer_engine(self, init_info: StreamInit) -> None:
        self.shutdown()  # a new group replaces the old one (the learner re-forms it when its engines change)
        parallel = self.parallel_config
        rank = init_info.rank_offset + parallel.data_parallel_index * parallel.world_size + parallel.rank
        self.group = open_group(
            init_info.host, init_info.port, rank, init_info.world_size, init_info.backend, init_info.timeout_s
        )

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # The base class also synchronises an accelerator, which a CPU server lacks; NCCL work is waited for
        # on the current stream by the broadcast itself.
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: StreamUpdate) -> None:
        if self.group is None:
            raise RuntimeError("no weight group: POST /init_weight_transfer_engine first (the sidecar does)")
        layout = StreamLayout(update_info.names, update_info.dtype_names, update_info.shapes, update_info.bucket_bytes)
        for pairs in receive_buckets(self.group, layout, self.device):
            self.model.load_weights(pairs)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)
        retie_lm_head(self.model, is_tied(self.model_config))

    def shutdown(self) -> None:
        self.group = None  # torch frees the group (its sockets) with the last reference


if STREAM_BACKEND not in WeightTransferEngineFactory._registry:  # imported once per worker, maybe twice in tests
    WeightTransferEngineFactory.register_engine(STREAM_BACKEND, StreamTransfer)
