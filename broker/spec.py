"""What the broker process takes of the run's config: built once in its main(), the only thing below it."""

from __future__ import annotations

from dataclasses import dataclass

from omegaconf import OmegaConf

from agentstream.config import BrokerConfig, Config, TrainerConfig
from agentstream.wire.addresses import advertised_host
from agentstream.wire.limits import Limits, limits_for


@dataclass(frozen=True)
class BrokerSpec:
    """What the broker takes of the run's config, once, in `main()` (`broker_spec`)."""

    broker: BrokerConfig
    trainer: TrainerConfig
    group_size: int
    """G: trajectories per group."""
    world_size: int
    """Learner ranks: each step's batch is split into this many shares."""
    seed_base: int
    """Group g starts from env seed seed_base + g."""
    dynamic_sampling: bool
    """Drop groups whose returns are all equal (DAPO)."""
    retain_formed: bool
    """Keep served batches until the learner checkpoints past them (it can resume and ask again)."""
    limits: Limits
    """What every message's content is checked against."""
    weights: str
    """The learner's weight address as the run starts, for processes that join it ("" before it is known); a learner
    placed again elsewhere tells the broker its new one (`VersionUpdate.weights`)."""
    run_config: str
    """The whole run's config as YAML, for processes that join the run."""


def broker_spec(cfg: Config) -> BrokerSpec:
    """The broker's part of `cfg`."""
    weights = (
        f"tcp://{advertised_host(cfg.learner.weight_host)}:{cfg.learner.weight_port}" if cfg.learner.weight_port else ""
    )
    return BrokerSpec(
        broker=cfg.broker,
        trainer=cfg.trainer,
        group_size=cfg.env.group_size,
        world_size=cfg.learner.world_size,
        seed_base=cfg.run.seed * 1_000_003,
        dynamic_sampling=cfg.algorithm.dynamic_sampling,
        retain_formed=cfg.checkpoint.every_steps > 0,
        limits=limits_for(cfg.model, cfg.engines, cfg.broker),
        weights=weights,
        run_config=OmegaConf.to_yaml(OmegaConf.structured(cfg)),
    )
