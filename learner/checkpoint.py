"""Learner checkpoints: model, optimizer, every rank's RNG states, the policy version, with
torch.distributed.checkpoint (each rank writes its own shards; a checkpoint loads at another world size).

    root = checkpoint_root(cfg.checkpoint, run_dir)        # checkpoint.dir, or RUN/checkpoints
    save_checkpoint(root, model, optimizer, version)      # a collective: every rank calls it
    version = load_checkpoint(resolve_resume(cfg.checkpoint.resume_from, root), model, optimizer)

Layout: ROOT/step_XXXXXXXX/ (XXXXXXXX = the version, = optimizer steps consumed) holds the DCP files,
rng-rank{r}.pt per rank, and meta.json, written by rank 0 after every rank finished: a folder without
meta.json is an interrupted save and is never resumed from. A LoRA policy saves and loads only its
trainable (adapter) parameters and their optimizer state; the frozen base comes from model.path again.
Other trained models (a critic) ride along as named `extras`: (model, optimizer) pairs.
"""

from __future__ import annotations

import json
import logging
import os
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from agentstream.config import CheckpointConfig
from learner.model import is_lora

Extras = dict[str, tuple[nn.Module, torch.optim.Optimizer]]

log = logging.getLogger(__name__)

STEP_PREFIX = "step_"
META = "meta.json"


def checkpoint_root(cfg: CheckpointConfig, run_dir: str | os.PathLike[str]) -> Path:
    """checkpoint.dir, or the run folder's checkpoints/."""
    return Path(cfg.dir) if cfg.dir else Path(run_dir) / "checkpoints"


def _options(model: nn.Module) -> StateDictOptions:
    # LoRA: the frozen base is not saved (it is model.path), so loading must not insist on it.
    lora = is_lora(model)
    return StateDictOptions(ignore_frozen_params=lora, strict=not lora)


def rng_state() -> dict[str, Any]:
    """This process's RNG states, as tensors and plain values (loadable with weights_only=True)."""
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": (name, torch.from_numpy(np.asarray(keys, dtype=np.int64)), pos, has_gauss, cached),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _state(model: nn.Module, optimizer: torch.optim.Optimizer, extras: Extras) -> dict[str, Any]:
    """What DCP saves and loads in place: {"model", "optim", "<extra>.model", "<extra>.optim", ...}."""
    model_sd, optim_sd = get_state_dict(model, optimizer, options=_options(model))
    state = {"model": model_sd, "optim": optim_sd}
    for name, (m, opt) in extras.items():
        state[f"{name}.model"], state[f"{name}.optim"] = get_state_dict(m, opt, options=_options(m))
    return state


def save_checkpoint(
    root: Path, model: nn.Module, optimizer: torch.optim.Optimizer, version: int, extras: Extras | None = None
) -> Path:
    """Write ROOT/step_{version}. A collective; returns the folder."""
    folder = Path(root) / f"{STEP_PREFIX}{version:08d}"
    rank, world = dist.get_rank(), dist.get_world_size()
    extras = extras or {}
    dcp.save(_state(model, optimizer, extras), checkpoint_id=folder)
    torch.save(rng_state(), folder / f"rng-rank{rank}.pt")
    dist.barrier()  # every rank's files are in place before the folder is marked complete
    if rank == 0:
        meta = {"version": version, "world_size": world, "lora": is_lora(model), "extras": sorted(extras)}
        tmp = folder / f"{META}.partial"
        tmp.write_text(json.dumps(meta))
        os.replace(tmp, folder / META)
        log.info("checkpoint of version %d saved in %s", version, folder)
    return folder


def complete_checkpoints(root: Path) -> list[Path]:
    """The complete checkpoint folders under `root`, oldest first."""
    if not Path(root).is_dir():
        return []
    found = [p for p in Path(root).glob(f"{STEP_PREFIX}*") if (p / META).is_file()]
    return sorted(found, key=lambda p: int(json.loads((p / META).read_text())["version"]))


def resolve_resume(resume_from: str, root: Path) -> Path | None:
    """The folder `checkpoint.resume_from` names: None if empty, the newest complete one for `latest`."""
    if not resume_from:
        return None
    if resume_from == "latest":
        found = complete_checkpoints(root)
        if not found:
            raise FileNotFoundError(
                f"checkpoint.resume_from=latest, but {root} holds no complete checkpoint "
                f"(a {STEP_PREFIX}* folder with {META}); set checkpoint.dir, or leave "
                f"resume_from empty"
            )
        return found[-1]
    folder = Path(resume_from)
    if not (folder / META).is_file():
        raise FileNotFoundError(
            f"checkpoint.resume_from={resume_from!r} is not a complete checkpoint (no {META}); "
            f"give a {STEP_PREFIX}XXXXXXXX folder written by the learner, or `latest`"
        )
    return folder


def load_checkpoint(
    folder: Path, model: nn.Module, optimizer: torch.optim.Optimizer, extras: Extras | None = None
) -> int:
    """Load model, optimizer, `extras` and this rank's RNG states from `folder`; returns its version.
    An extra the checkpoint lacks (e.g. a critic added on resume) keeps its fresh state, with a warning.
    A collective."""
    meta = json.loads((Path(folder) / META).read_text())
    if bool(meta["lora"]) != is_lora(model):
        raise ValueError(
            f"checkpoint {folder} was saved {'with' if meta['lora'] else 'without'} LoRA, but "
            f"model.lora_rank says otherwise; resume with the model config it was saved with"
        )
    saved = set(meta.get("extras", []))
    extras = extras or {}
    for name in sorted(set(extras) - saved):
        log.warning("checkpoint %s holds no %s: it starts from its initial weights", folder, name)
    extras = {k: v for k, v in extras.items() if k in saved}
    state = _state(model, optimizer, extras)
    dcp.load(state, checkpoint_id=folder)
    set_state_dict(
        model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"], options=_options(model)
    )
    for name, (m, opt) in extras.items():
        set_state_dict(
            m,
            opt,
            model_state_dict=state[f"{name}.model"],
            optim_state_dict=state[f"{name}.optim"],
            options=_options(m),
        )
    rng_file = Path(folder) / f"rng-rank{dist.get_rank()}.pt"
    if rng_file.is_file():
        set_rng_state(torch.load(rng_file, weights_only=True))
    else:  # saved with fewer ranks: the weights reshard, RNG streams cannot
        log.warning(
            "%s has no RNG state for rank %d (saved by %d ranks); this rank's RNG is not restored",
            folder,
            dist.get_rank(),
            meta["world_size"],
        )
    log.info("resumed from %s at version %d", folder, meta["version"])
    return int(meta["version"])
