"""The policy under FSDP2: pick the backend, load a Hugging Face causal LM (optionally wrapped in a peft
LoRA adapter), shard it, compute the log-probs of response tokens, gather the weights for the engines
(full weights, or only the adapter with LoRA).

Every function here that touches a sharded model is a collective: all ranks call it, in the same order.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from learner.batching import MicroBatch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def pick_backend(backend: str) -> str:
    """`auto` -> nccl when CUDA is available, else gloo."""
    if backend == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl" and not torch.cuda.is_available():
        raise RuntimeError("learner.backend=nccl but CUDA is not available here; use gloo or auto")
    return backend


def init_distributed(backend: str) -> tuple[int, int, torch.device]:
    """Join the process group torchrun described in the environment; returns (rank, world, device)."""
    backend = pick_backend(backend)
    if backend == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    # NCCL: naming the rank's GPU binds the communicator to it (unnamed, NCCL guesses it from the rank and warns).
    dist.init_process_group(backend=backend, device_id=device if backend == "nccl" else None)
    return dist.get_rank(), dist.get_world_size(), device


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks to shard one by one, found by the model's own `_no_split_modules` names."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise RuntimeError(
            f"found no decoder layers in {type(model).__name__} (its _no_split_modules={sorted(names)}); "
            f"FSDP2 sharding needs the per-layer module class"
        )
    return layers


@dataclass(frozen=True)
class LoraSpec:
    """A peft LoRA adapter's shape (from ModelConfig's lora_* fields)."""

    rank: int
    alpha: float
    target_modules: tuple[str, ...]
    dropout: float = 0.0
    init_seed: int = 0  # peft draws A at random: the same seed on every rank and every run

    def peft_config(self) -> Any:
        from peft import LoraConfig, TaskType

        return LoraConfig(task_type=TaskType.CAUSAL_LM, r=self.rank, lora_alpha=self.alpha,
                          target_modules=list(self.target_modules), lora_dropout=self.dropout, bias="none")


def lora_spec(
    rank: int, alpha: float, target_modules: list[str], dropout: float, init_seed: int = 0
) -> LoraSpec | None:
    """None when rank == 0 (full fine-tuning)."""
    return LoraSpec(rank, alpha, tuple(target_modules), dropout, init_seed) if rank > 0 else None


def load_policy(
    path: str, dtype: str, device: torch.device, world_size: int, lora: LoraSpec | None = None
) -> nn.Module:
    """Load `path` with fp32 master weights, `fully_shard` each decoder layer, then the root.
    dtype=bfloat16 computes in bf16 (MixedPrecisionPolicy) and reduces gradients in fp32.

    With `lora`, the model is wrapped by peft's `get_peft_model` BEFORE sharding (FSDP2 must see the adapter
    parameters as part of each layer); only the adapter's parameters then require gradients."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # one bar per rank per run is noise in the run's log
    if dtype not in DTYPES:
        raise ValueError(f"model.dtype={dtype!r}: use one of {sorted(DTYPES)}")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    if lora is not None:
        from peft import get_peft_model

        # A is drawn at random (B = 0): unseeded, every rank would hold shards of a different A, and no
        # two runs would start alike. Drawn on CPU, whatever the device; the global RNG is left as it was.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(lora.init_seed)
            model = get_peft_model(model, lora.peft_config())
        model.peft_config["default"].base_model_name_or_path = str(path)
    model = model.to(device)
    mesh: DeviceMesh = init_device_mesh(device.type, (world_size,))
    mp = MixedPrecisionPolicy(param_dtype=DTYPES[dtype], reduce_dtype=torch.float32)
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    model.train()
    return model


def is_lora(model: nn.Module) -> bool:
    """Whether `model` is a peft model (trains only its adapter)."""
    return hasattr(model, "peft_config") and hasattr(model, "disable_adapter")


def trainable_parameters(model: nn.Module) -> list[nn.Parameter]:
    """What the optimizer steps: the adapter with LoRA, every weight without."""
    return [p for p in model.parameters() if p.requires_grad]


@contextlib.contextmanager
def disabled_adapter(model: nn.Module) -> Iterator[nn.Module]:
    """Inside the block `model` computes as its base model (the adapter is bypassed): the reference policy
    for a KL term, at no extra memory. A no-op for a model without an adapter (it IS its base model).
    Every rank must enter it around the same forward calls (they are collectives under FSDP2)."""
    if not is_lora(model):
        yield model
        return
    with model.disable_adapter():
        yield model


def vocab_size(model: nn.Module) -> int:
    return int(model.config.vocab_size)


def response_logprobs(model: nn.Module, mb: MicroBatch) -> Tensor:
    """log pi(target | prefix) for every response token of `mb`: [Q] float32.

    Only the logits at the positions some row needs are computed (`logits_to_keep` = the union of the
    rows' response positions), so the [B, L, vocab] logits of the prompts never exist. A packed micro-batch
    (`mb.position_ids` set, no attention mask) relies on transformers reading sequence boundaries from the
    restarting position ids, which it does only without a KV cache: `use_cache=False` is load-bearing.
    """
    device = next(model.parameters()).device
    keep, col = torch.unique(mb.logit_pos, sorted=True, return_inverse=True)  # [U], [Q]
    inputs: dict[str, Tensor] = {"input_ids": mb.input_ids.to(device)}
    if mb.attention_mask is not None:
        inputs["attention_mask"] = mb.attention_mask.to(device)
    if mb.position_ids is not None:
        inputs["position_ids"] = mb.position_ids.to(device)
    out = model(**inputs, use_cache=False, logits_to_keep=keep.to(device))
    logits = out.logits[mb.logit_rows.to(device), col.to(device)].float()  # [Q, V]
    targets = mb.targets.to(device)  # [Q]
    return logits.gather(-1, targets[:, None])[:, 0] - torch.logsumexp(logits, dim=-1)  # [Q]


def full_state_dict(model: nn.Module) -> dict[str, Tensor]:
    """Full (unsharded) weights on CPU, HF key names. A collective: every rank calls it; only rank 0's dict
    is filled. Not for a LoRA policy (its engines load the adapter: `adapter_state_dict`)."""
    if is_lora(model):
        raise ValueError("full_state_dict of a LoRA policy: publish adapter_state_dict instead (engines load a LoRA)")
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def adapter_state_dict(model: nn.Module) -> dict[str, Tensor]:
    """The LoRA adapter only, full tensors on CPU, keyed as peft's adapter_model.safetensors
    (`base_model.model.<module>.lora_A.weight`). A collective; only rank 0's dict is filled.

    Frozen parameters are skipped while gathering; the `lora_` filter also drops what comes through anyway
    (a tied lm_head.weight does, FACTS.md)."""
    from peft.utils import get_peft_model_state_dict

    opts = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=True)
    state = get_model_state_dict(model, options=opts)
    if not state:
        return {}
    state = {k: v for k, v in state.items() if "lora_" in k}
    return {k: v for k, v in get_peft_model_state_dict(model, state_dict=state).items() if "lora_" in k}


def adapter_config(model: nn.Module) -> dict[str, Any]:
    """The adapter's adapter_config.json content (peft's own serialisation of its LoraConfig)."""
    import json

    cfg = model.peft_config["default"]
    return json.loads(json.dumps(cfg.to_dict(), default=lambda o: sorted(o) if isinstance(o, set) else str(o)))
