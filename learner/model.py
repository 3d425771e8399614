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
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from agentstream.models import is_vision_language
from learner.batching import MicroBatch
from learner.vision import image_slots, merge_at_slots, mrope_position_ids

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
    """The repeated blocks to shard one by one, found by the model's own `_no_split_modules` names; in a
    vision-language model only the language model's (its vision tower stays with the root, gathered in every
    forward: a rank whose micro-batch has no image must not skip the tower's collectives)."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    root = model.get_decoder() if is_vision_language_model(model) else model
    layers = [m for m in root.modules() if type(m).__name__ in names]
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

    def peft_config(self, within: list[str] | None = None) -> Any:
        """peft's LoraConfig; `within`: adapt only these modules (full names), those of `target_modules` among
        them (a vision-language model's language model: its vision tower has layers of the same names)."""
        from peft import LoraConfig, TaskType

        targets = (
            list(self.target_modules)
            if within is None
            else [name for name in within if name.rsplit(".", 1)[-1] in self.target_modules]
        )
        return LoraConfig(
            task_type=TaskType.CAUSAL_LM,
            r=self.rank,
            lora_alpha=self.alpha,
            target_modules=targets,
            lora_dropout=self.dropout,
            bias="none",
        )


def lora_spec(
    rank: int, alpha: float, target_modules: list[str], dropout: float, init_seed: int = 0
) -> LoraSpec | None:
    """None when rank == 0 (full fine-tuning)."""
    return LoraSpec(rank, alpha, tuple(target_modules), dropout, init_seed) if rank > 0 else None


def is_vision_language_model(model: nn.Module) -> bool:
    """Whether `model` reads images (its config has a vision tower's)."""
    return getattr(model.config, "vision_config", None) is not None


def language_modules(model: nn.Module) -> list[str]:
    """The full names of a vision-language model's language-model modules (LoRA adapts those only, as vLLM does)."""
    language = {id(m) for m in model.get_decoder().modules()}
    return [name for name, m in model.named_modules() if id(m) in language]


def freeze_vision(model: nn.Module) -> None:
    """Freeze every weight of a vision-language model but its language model's and its output layer's: the vision
    tower and the connector that maps its features into the language model's embeddings."""
    language = {id(p) for m in (model.get_decoder(), model.get_output_embeddings()) for p in m.parameters()}
    for p in model.parameters():
        if id(p) not in language:
            p.requires_grad_(False)


def load_policy(
    path: str,
    dtype: str,
    device: torch.device,
    world_size: int,
    lora: LoraSpec | None = None,
    train_vision: bool = False,
    activation_checkpointing: bool = False,
) -> nn.Module:
    """Load `path` with fp32 master weights, `fully_shard` each decoder layer, then the root.
    dtype=bfloat16 computes in bf16 (MixedPrecisionPolicy) and reduces gradients in fp32. A vision-language
    directory loads as its image-text-to-text model, its vision side frozen unless `train_vision`.

    With `lora`, the model is wrapped by peft's `get_peft_model` BEFORE sharding (FSDP2 must see the adapter
    parameters as part of each layer); only the adapter's parameters then require gradients.

    `activation_checkpointing`: each decoder layer keeps only its input for the backward and recomputes the rest
    there (transformers' gradient checkpointing, non-reentrant: FSDP2's hooks gather the layer's weights again for
    the recompute). A deep model's activations then cost one layer's, not all of them (bench/learner_memory.py)."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # one bar per rank per run is noise in the run's log
    if dtype not in DTYPES:
        raise ValueError(f"model.dtype={dtype!r}: use one of {sorted(DTYPES)}")
    vision = is_vision_language(path)
    model = (AutoModelForImageTextToText if vision else AutoModelForCausalLM).from_pretrained(path, dtype=torch.float32)
    if vision:
        merge_at_slots(model)  # images fill the prompt's slots only: a generated image token stays a token
    if vision and not train_vision:
        freeze_vision(model)
    if activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if lora is not None:
        from peft import get_peft_model

        # A is drawn at random (B = 0): unseeded, every rank would hold shards of a different A, and no
        # two runs would start alike. Drawn on CPU, whatever the device; the global RNG is left as it was.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(lora.init_seed)
            model = get_peft_model(model, lora.peft_config(language_modules(model) if vision else None))
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


def resharded(model: nn.Module) -> nn.Module:
    """`model` with every FSDP2 module back on its shards. The root keeps its weights gathered after a forward, and
    its registered parameters are then the gathered copies: an optimizer built on those, or a copy or read of them,
    would miss the sharded weights that training updates (the embeddings, the final norm, a tied head). Local: no
    collective."""
    for sub in model.modules():
        if isinstance(sub, FSDPModule):
            sub.reshard()
    return model


def trainable_parameters(model: nn.Module) -> list[nn.Parameter]:
    """What the optimizer steps: the adapter with LoRA, every weight without (the sharded ones, `resharded`)."""
    return [p for p in resharded(model).parameters() if p.requires_grad]


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


def takes_attention_masks(model: nn.Module) -> bool:
    """Whether `model`'s attention takes an arbitrary [B, 1, L, L] mask (sdpa, eager; flash attention does not)."""
    return getattr(model.config, "_attn_implementation", None) in ("sdpa", "eager")


def vocab_size(model: nn.Module) -> int:
    return int(model.config.get_text_config().vocab_size)  # a vision-language model's is its language model's


def response_logprobs(model: nn.Module, mb: MicroBatch, chunk_tokens: int = 0) -> Tensor:
    """log pi(target | prefix) for every response token of `mb`: [Q] float32 (`token_logprobs` without the
    entropy)."""
    return token_logprobs(model, mb, chunk_tokens)[0]


def token_logprobs(
    model: nn.Module, mb: MicroBatch, chunk_tokens: int = 0, entropy: bool = False
) -> tuple[Tensor, Tensor | None]:
    """log pi(target | prefix) [Q] float32 for every response token of `mb`, and with `entropy` the entropy
    of pi at each of those positions [Q] (else None); both with gradients when grad mode is on.

    Only the logits at the positions some row needs are computed (`logits_to_keep` = the union of the
    rows' response positions), so the [B, L, V] logits of the prompts never exist. With `chunk_tokens` > 0
    not even the [Q, V] logits do: the model runs with no logits at all, and its last hidden states at the
    Q positions go through the output layer `chunk_tokens` rows at a time, each chunk's logits recomputed in
    backward (activation checkpointing), so at most [chunk_tokens, V] float32 logits are alive
    (bench/memory.py). Same values either way (a test checks it, under FSDP2 too).

    A packed micro-batch (`mb.position_ids` set, no attention mask) relies on transformers reading sequence
    boundaries from the restarting position ids, which it does only without a KV cache: `use_cache=False` is
    load-bearing.
    """
    device = next(model.parameters()).device
    keep, col = torch.unique(mb.logit_pos, sorted=True, return_inverse=True)  # [U], [Q]
    inputs: dict[str, Tensor] = {"input_ids": mb.input_ids.to(device)}
    if mb.attention_mask is not None:
        inputs["attention_mask"] = mb.attention_mask.to(device)
    if mb.position_ids is not None:
        inputs["position_ids"] = mb.position_ids.to(device)
    inputs.update({k: v.to(device) for k, v in (mb.pixels or {}).items()})
    positions = mrope_position_ids(
        model, mb.input_ids, mb.image_slots, (mb.pixels or {}).get("image_grid_thw"), mb.attention_mask, mb.position_ids
    )  # Qwen-VL's [4, B, L]; None: the model's own
    if positions is not None:
        inputs["position_ids"] = positions.to(device)
    targets = mb.targets.to(device)  # [Q]
    if chunk_tokens <= 0:
        with image_slots(model, mb.image_slots):
            out = model(**inputs, use_cache=False, logits_to_keep=keep.to(device))
        logits = out.logits[mb.logit_rows.to(device), col.to(device)]  # [Q, V]
        return _logprob_and_entropy(logits, targets, entropy)
    with image_slots(model, mb.image_slots):
        hidden = _last_hidden_state(model, inputs)  # [B, L, H]
    h = hidden[mb.logit_rows.to(device), mb.logit_pos.to(device)]  # [Q, H]
    head = _output_layer(model)

    def piece(h_c: Tensor, t_c: Tensor) -> tuple[Tensor, Tensor | None]:
        return _logprob_and_entropy(head(h_c), t_c, entropy)

    if torch.is_grad_enabled():  # keep only each chunk's inputs; its logits are recomputed in backward
        from torch.utils.checkpoint import checkpoint

        def run(h_c: Tensor, t_c: Tensor) -> tuple[Tensor, Tensor | None]:
            return checkpoint(piece, h_c, t_c, use_reentrant=False)

    else:  # nothing is kept for a backward
        run = piece
    parts = [run(h[i : i + chunk_tokens], targets[i : i + chunk_tokens]) for i in range(0, h.shape[0], chunk_tokens)]
    if not parts:  # no response token in this micro-batch
        empty = h.new_zeros(0, dtype=torch.float32)
        return empty, empty if entropy else None
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts]) if entropy else None


def _logprob_and_entropy(logits: Tensor, targets: Tensor, entropy: bool) -> tuple[Tensor, Tensor | None]:
    """logits [C, V] (any float dtype), targets [C] -> log-softmax at the targets [C] and, with `entropy`,
    -sum_v p_v log p_v [C]; computed in float32."""
    logits = logits.float()
    logz = torch.logsumexp(logits, dim=-1)  # [C]
    logp = logits.gather(-1, targets[:, None])[:, 0] - logz  # [C]
    if not entropy:
        return logp, None
    logp_all = logits - logz[:, None]  # [C, V]
    return logp, -(logp_all.exp() * logp_all).sum(-1)


def _last_hidden_state(model: nn.Module, inputs: dict[str, Tensor]) -> Tensor:
    """The decoder's final hidden states [B, L, H] (after its last norm: what the output layer reads), from a
    forward of the whole model, so that FSDP2's root hooks gather the root's weights (embeddings, norm,
    output layer) as in any forward. No logits are computed (`logits_to_keep` selects no position)."""
    got: list[Tensor] = []

    def grab(_module: nn.Module, _args: Any, output: Any) -> None:
        got.append(output[0] if isinstance(output, tuple) else output.last_hidden_state)

    handle = model.get_decoder().register_forward_hook(grab)
    try:
        none = torch.zeros(0, dtype=torch.long, device=inputs["input_ids"].device)
        model(**inputs, use_cache=False, logits_to_keep=none)
    finally:
        handle.remove()
    return got[-1]


def _output_layer(model: nn.Module) -> nn.Module:
    """The LM head, its weights gathered. FSDP2 keeps the root's weights gathered from its forward until its
    backward (the root does not reshard after forward); `unshard()` makes sure of it (a no-op when so)."""
    cfg = model.config
    for name in ("final_logit_softcapping", "logit_scale"):
        if getattr(cfg, name, None) not in (None, 1.0):
            raise ValueError(
                f"learner.logprob_chunk_tokens: {type(model).__name__} transforms its logits "
                f"({name}={getattr(cfg, name)}) after the output layer, which the chunked path does "
                f"not repeat; set learner.logprob_chunk_tokens=0 for this model"
            )
    if isinstance(model, FSDPModule):
        model.unshard()
    return model.get_output_embeddings()


def full_state_dict(model: nn.Module) -> dict[str, Tensor]:
    """Full (unsharded) weights on CPU, HF key names. A collective: every rank calls it; only rank 0's dict
    is filled. Not for a LoRA policy (its engines load the adapter: `adapter_state_dict`)."""
    if is_lora(model):
        raise ValueError("full_state_dict of a LoRA policy: publish adapter_state_dict instead (engines load a LoRA)")
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def parameter_shapes(model: nn.Module) -> list[tuple[str, torch.Size, torch.dtype]]:
    """(HF name, full shape, dtype) of every weight `full_parameters` yields, in its order; no gather."""
    return [(name, p.shape, p.dtype) for name, p in model.named_parameters()]


def full_parameters(model: nn.Module) -> Iterator[tuple[str, Tensor]]:
    """Each weight whole, one at a time on its rank's device, HF names (a tied weight once: named_parameters
    skips the alias, and the engines re-tie their head). A collective per parameter: every rank iterates it to
    the end, in step, so that no rank ever holds more than one gathered parameter (the streamed weight sync)."""
    if is_lora(model):
        raise ValueError("full_parameters of a LoRA policy: publish adapter_state_dict instead (engines load a LoRA)")
    for name, p in resharded(model).named_parameters():
        t = p.detach()
        yield name, t.full_tensor() if isinstance(t, DTensor) else t


def adapter_state_dict(model: nn.Module) -> dict[str, Tensor]:
    """The LoRA adapter only, full tensors on CPU, keyed as peft's adapter_model.safetensors
    (`base_model.model.<module>.lora_A.weight`). A collective; only rank 0's dict is filled.

    Frozen parameters are skipped while gathering; the `lora_` filter also drops what comes through anyway
    (a tied lm_head.weight does)."""
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
