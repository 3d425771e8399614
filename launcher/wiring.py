"""Every address of a run, decided in one function: which process talks to which, one line per edge.

Sockets bind to the configured interfaces; the addresses handed out name this machine when an interface is a
wildcard (0.0.0.0). A launch that joins a running run gets its wiring from the broker instead (launcher.join).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

from agentstream.config import Config
from agentstream.wire.addresses import advertised_host, free_port


@dataclass(frozen=True)
class Wiring:
    """Every address of the run, decided in one place."""

    broker: str  # actors, learner ranks, weight sidecars, joining launches -> broker (ZeroMQ ROUTER)
    broker_port: int
    dashboard: str  # browser, launcher -> broker (HTTP: dashboard, /metrics, /api/summary)
    dashboard_port: int
    weights: str  # weight sidecars -> learner rank 0 (ZeroMQ ROUTER; rank 0 pushes weights down it)
    engines: list[str] = field(default_factory=list)  # actors, weight sidecars -> vLLM servers (HTTP)
    weights_bind: str = ""  # what rank 0 binds for `weights` (a wildcard interface is reached by host name)
    rdzv: str = ""  # learner nodes 1.. -> node 0's torchrun rendezvous (host:port); only with learner.nnodes > 1
    judges: list[str] = field(default_factory=list)  # actors -> LLM judge vLLM servers (HTTP); no sidecar, no weights
    teachers: list[str] = field(default_factory=list)  # actors -> distillation teacher vLLM servers (HTTP); as judges
    gateway: str = ""  # agent code -> the OpenAI-compatible gateway (HTTP); only with gateway.enabled / role=gateway
    gateway_port: int = 0
    env_server: str = ""  # actors, evaluator -> the env's own server (EnvTraits.serve: OpenEnv's app), on 127.0.0.1


def wire(cfg: Config) -> Wiring:
    """Which process talks to which, on which address (one line per edge). Sockets bind to the configured
    interfaces; the addresses handed out name this machine when an interface is a wildcard (0.0.0.0)."""
    host, wh = cfg.broker.host, cfg.learner.weight_host
    broker_port = cfg.broker.port or free_port(host)
    dash_port = cfg.broker.dashboard_port or free_port(cfg.broker.dashboard_host)
    weight_port = cfg.learner.weight_port or free_port(wh)
    base = cfg.engines.base_port
    engine_ports = [base + 2 * i if base else free_port(cfg.engines.host) for i in range(cfg.engines.count)]
    engine_host = advertised_host(cfg.engines.host)
    engine_urls = list(cfg.engines.external_urls) or [f"http://{engine_host}:{p}" for p in engine_ports]
    rdzv = f"{advertised_host(wh)}:{cfg.learner.rdzv_port or free_port(wh)}" if cfg.learner.nnodes > 1 else ""
    gw_port = (cfg.gateway.port or free_port(cfg.gateway.host)) if cfg.gateway.enabled else 0  # a restart keeps it
    return Wiring(
        broker=f"tcp://{advertised_host(host)}:{broker_port}",
        broker_port=broker_port,
        dashboard=f"http://{advertised_host(cfg.broker.dashboard_host)}:{dash_port}",
        dashboard_port=dash_port,
        weights=f"tcp://{advertised_host(wh)}:{weight_port}",
        weights_bind=f"tcp://{wh}:{weight_port}",
        engines=engine_urls,
        rdzv=rdzv,
        judges=judge_urls(cfg),
        teachers=teacher_urls(cfg),
        gateway=f"http://{advertised_host(cfg.gateway.host)}:{gw_port}" if gw_port else "",
        gateway_port=gw_port,
        env_server=env_server_url(cfg),
    )


@dataclass(frozen=True)
class Places:
    """Where Ray put the processes that bind (launcher.ray_backend): (node IP, ports picked on that node)."""

    broker: tuple[str, int, int]  # IP, broker port, dashboard port
    engines: list[tuple[str, int]]  # IP, port: one per engine
    learner: tuple[str, int, int]  # learner node 0: IP, weight port, torchrun rendezvous port
    gateway: tuple[str, int] | None = None  # IP, port


def wire_placed(cfg: Config, p: Places) -> Wiring:
    """`wire` for a run placed on Ray: every socket binds its node's IP (on a port picked there), and is reached
    by that IP (one line per edge)."""
    ip, broker_port, dash_port = p.broker
    lip, weight_port, rdzv_port = p.learner
    return Wiring(
        broker=f"tcp://{ip}:{broker_port}",
        broker_port=broker_port,  # actors, learner ranks, sidecars -> broker
        dashboard=f"http://{ip}:{dash_port}",
        dashboard_port=dash_port,  # browser, launcher -> broker (HTTP)
        weights=f"tcp://{lip}:{weight_port}",
        weights_bind=f"tcp://{lip}:{weight_port}",  # sidecars -> learner rank 0
        engines=list(cfg.engines.external_urls) or [f"http://{h}:{port}" for h, port in p.engines],  # actors, sidecars
        rdzv=f"{lip}:{rdzv_port}",  # learner ranks -> torchrun's rendezvous on learner node 0 (any nnodes: its IP)
        judges=[],  # (judges are not placed on Ray: launcher.checks)
        teachers=[],  # (nor teachers)
        gateway=f"http://{p.gateway[0]}:{p.gateway[1]}" if p.gateway else "",  # agent code -> gateway (HTTP)
        gateway_port=p.gateway[1] if p.gateway else 0,
    )


def env_server_url(cfg: Config) -> str:
    """The env's own server, when its traits name an app to serve (`EnvTraits.serve`: OpenEnv's env.kwargs.app): on
    127.0.0.1 (only this host's actors and evaluator play on it) at a free port; "" when there is none."""
    from envs.registry import traits as env_traits

    if not env_traits(cfg.env.name, cfg.env.kwargs).serve:
        return ""
    return f"http://127.0.0.1:{free_port('127.0.0.1')}"


def judge_urls(cfg: Config) -> list[str]:
    """The LLM judges' servers on this host (judges.count): on engines.host, at engines.base_port + 2 *
    engines.count + i after the engines' pairs, or free ports. Only actors talk to them."""
    return _fixed_urls(cfg, 0, cfg.judges.count)


def teacher_urls(cfg: Config) -> list[str]:
    """The distillation teachers' servers on this host (distill.count): as the judges', after them. Only actors talk
    to them."""
    return _fixed_urls(cfg, cfg.judges.count, cfg.distill.count)


def _fixed_urls(cfg: Config, after: int, count: int) -> list[str]:
    """`count` servers of a fixed model on engines.host: at engines.base_port + 2 * engines.count + after + i (after
    the engines' pairs and `after` other such servers), or on free ports."""
    base, n = cfg.engines.base_port, cfg.engines.count
    ports = [base + 2 * n + after + i if base else free_port(cfg.engines.host) for i in range(count)]
    return [f"http://{advertised_host(cfg.engines.host)}:{p}" for p in ports]


def resolved(cfg: Config, w: Wiring) -> Config:
    """`cfg` with the ports `wire` picked, so that every process (and a launch joining later, through the
    broker's Welcome) sees the addresses actually in use."""
    out = copy.deepcopy(cfg)
    out.broker.port, out.broker.dashboard_port, out.learner.weight_port = (
        w.broker_port,
        w.dashboard_port,
        int(w.weights.rsplit(":", 1)[1]),
    )
    if w.rdzv:
        out.learner.rdzv_port = int(w.rdzv.rsplit(":", 1)[1])
    if w.gateway_port:
        out.gateway.port = w.gateway_port
    if w.env_server:  # the actors and the evaluator play on the server this launch serves
        out.env.kwargs = {**out.env.kwargs, "base_url": w.env_server}
    return out


__all__ = ["Places", "Wiring", "judge_urls", "resolved", "teacher_urls", "wire", "wire_placed"]
