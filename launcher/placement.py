"""Which GPUs each engine and each learner rank gets: one pure function of the hosts' GPUs and the config.

    p = plan([8, 8], engines=6, gpus_per_engine=2, learner_ranks=4, colocate=False)
    p.learner   == ((0, 1, 2, 3), ())                   # per host: its learner ranks' GPUs, in rank order
    p.engines   == ((0, (4, 5)), (0, (6, 7)), (1, (0, 1)), (1, (2, 3)), (1, (4, 5)), (1, (6, 7)))  # (host, GPUs)

The learner's ranks take the first GPUs of the first hosts, the same number on each host it uses (torchrun starts
as many ranks on every node). Each engine takes `gpus_per_engine` GPUs of one host (its tensor-parallel group
stays inside a node), from the GPUs the learner left (`colocate=False`) or from all of them (`colocate=True`:
engines share the learner's GPUs, as in one-GPU runs, each with its engines.gpu_memory_utilization of memory).
No GPU ever holds two engines. What cannot be placed is refused with a `PlacementError` that says what to change.
Hosts without GPUs (CPU runs) place nothing: every tuple is empty.

The launcher applies it on its own host (`host_plan`; `CUDA_VISIBLE_DEVICES` per engine and for torchrun's ranks,
`--tensor-parallel-size` per engine); on Ray the cluster assigns GPUs from its per-role requests.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from agentstream.config import Config


class PlacementError(ValueError):
    """The GPUs cannot hold what the config asks for; the message says what to change."""


@dataclass(frozen=True)
class GpuPlan:
    learner: tuple[tuple[int, ...], ...]  # per host: the GPUs of the learner ranks it runs, in rank order
    engines: tuple[tuple[int, tuple[int, ...]], ...]  # per engine: (its host's index, its GPUs)


def visible(gpus: tuple[int, ...], names: Sequence[str]) -> dict[str, str]:
    """The environment that gives a process exactly `gpus` (indices into the host's GPU `names`); none without GPUs."""
    return {"CUDA_VISIBLE_DEVICES": ",".join(names[g] for g in gpus)} if gpus else {}


def plan(host_gpus: Sequence[int], engines: int, gpus_per_engine: int, learner_ranks: int, colocate: bool) -> GpuPlan:
    """Place `learner_ranks` learner ranks (one GPU each) and `engines` engines (`gpus_per_engine` GPUs of one host
    each) on hosts with `host_gpus[h]` GPUs."""
    if gpus_per_engine < 1:
        raise PlacementError(
            f"engines.gpus_per_engine={gpus_per_engine}: must be at least 1 (its tensor-parallel size)."
        )
    if not any(host_gpus):  # CPU: nothing to place
        return GpuPlan(tuple(() for _ in host_gpus), tuple((0, ()) for _ in range(engines)))
    learner = _learner_gpus(host_gpus, learner_ranks)
    free = [list(range(n)) if colocate else list(range(len(learner[h]), n)) for h, n in enumerate(host_gpus)]
    placed: list[tuple[int, tuple[int, ...]]] = []
    for h, gpus in enumerate(free):
        while len(placed) < engines and len(gpus) >= gpus_per_engine:
            placed.append((h, tuple(gpus[:gpus_per_engine])))
            del gpus[:gpus_per_engine]
    if len(placed) < engines:
        left = ", ".join(
            f"host {h}: {len(range(n)) - (0 if colocate else len(learner[h]))}" for h, n in enumerate(host_gpus)
        )
        share = "" if colocate else ", or let the engines share the learner's GPUs (engines.colocate=true)"
        raise PlacementError(
            f"engines.count={engines} with engines.gpus_per_engine={gpus_per_engine} needs {engines} groups of "
            f"{gpus_per_engine} GPUs on one host each; only {len(placed)} fit in the GPUs left for engines ({left}). "
            f"Lower engines.count or engines.gpus_per_engine, give the learner fewer GPUs{share}."
        )
    return GpuPlan(learner, tuple(placed))


def _learner_gpus(host_gpus: Sequence[int], ranks: int) -> tuple[tuple[int, ...], ...]:
    if ranks > sum(host_gpus):
        raise PlacementError(
            f"the learner's {ranks} ranks need one GPU each; the hosts have {sum(host_gpus)} "
            f"({list(host_gpus)}). Lower learner.world_size."
        )
    out: list[tuple[int, ...]] = []
    left = ranks
    for n in host_gpus:
        take = min(left, n)
        out.append(tuple(range(take)))
        left -= take
    used = [len(g) for g in out if g]
    if len(set(used)) > 1:
        raise PlacementError(
            f"the learner's {ranks} ranks fall unevenly on the hosts ({used} GPUs); torchrun starts "
            f"the same number on every node: make learner.world_size a multiple of the GPUs per host."
        )
    return tuple(out)


def host_gpus() -> list[str]:
    """This host's GPUs as CUDA names them for a child: CUDA_VISIBLE_DEVICES's entries when it is set, else one per
    GPU the NVIDIA driver lists (no torch import: the launcher does not need it)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return [g.strip() for g in visible.split(",") if g.strip() and g.strip() != "-1"]
    driver = Path("/proc/driver/nvidia/gpus")
    return [str(i) for i in range(len(list(driver.iterdir())))] if driver.is_dir() else []


def host_plan(cfg: Config, gpus: int) -> GpuPlan:
    """The plan of the processes this launch starts on its own host of `gpus` GPUs: its engines, and its node's
    learner ranks when it starts the learner. Raises PlacementError."""
    role = cfg.run.role
    engines = cfg.engines.count if role in ("all", "engines") and not cfg.engines.external_urls else 0
    ranks = cfg.learner.world_size // cfg.learner.nnodes if role in ("all", "learner") else 0
    return plan([gpus], engines, cfg.engines.gpus_per_engine, ranks, cfg.engines.colocate)
