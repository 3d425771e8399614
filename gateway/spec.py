"""What the gateway needs of the run config, taken from it once (`GatewaySpec.from_config`); a test builds one
without a run folder. The sub-config is copied, so changing the `Config` afterwards changes no spec."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path

from agentstream.config import REPO_ROOT, Config, GatewayConfig
from agentstream.models import base_model_name, served_model_name


@dataclass(frozen=True)
class GatewaySpec:
    """Everything the gateway uses."""

    gateway: GatewayConfig
    model_path: str
    """The policy's directory: its tokenizer and chat template make the prompt ids."""
    model_name: str
    """The model name engine requests ask for (the adapter's when training LoRA)."""
    base_model_name: str | None
    """With LoRA, the name asked for while an engine serves version 0; else None."""
    curve_keys_dir: str
    """Key folder for the broker connection's CURVE ("": plain TCP, loopback only)."""
    request_timeout_s: float
    """How long one engine request may take."""
    group_size: int
    """G: episodes of one task id that make one group."""
    max_model_len: int
    """The engines' context: a prompt plus its max_tokens must fit."""
    default_max_tokens: int
    """max_tokens of a request that sets none (sampling.max_tokens)."""
    log_interval_s: float
    """Seconds between two Stats reports to the broker."""
    max_unacked: int
    """Transitions kept until the broker acknowledges them; at this many, sending waits (back-pressure)."""
    ack_timeout_s: float
    """No acknowledgement this long: resend everything unacknowledged."""
    key: str = ""
    """The run's gateway key (gateway.key_file's first line): opening an episode needs it; "": no key."""

    @classmethod
    def from_config(cls, cfg: Config) -> GatewaySpec:
        return cls(
            copy.deepcopy(cfg.gateway),
            cfg.model.path,
            served_model_name(cfg.model),
            base_model_name(cfg.model),
            cfg.broker.curve_keys_dir,
            cfg.engines.request_timeout_s,
            cfg.env.group_size,
            cfg.engines.max_model_len,
            cfg.sampling.max_tokens,
            cfg.run.log_interval_s,
            cfg.actors.max_unacked,
            cfg.actors.ack_timeout_s,
            read_key(cfg.gateway.key_file),
        )

    def chat_template(self) -> str | None:
        """The override template's text (gateway.chat_template, relative to the repository), or None."""
        path = self.gateway.chat_template
        return (REPO_ROOT / path).read_text() if path else None


def read_key(path: str) -> str:
    """The first line of the key file (stripped); "" for no file (path "")."""
    lines = Path(path).read_text().splitlines() if path else []
    return lines[0].strip() if lines else ""


__all__ = ["GatewaySpec", "read_key"]
