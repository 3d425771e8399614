"""launcher.backend=ray: the same run, every process placed on a node of a Ray cluster.

    python scripts/launch.py launcher.backend=ray launcher.ray_address=HEAD:6379 ++launcher.resources.engine.GPU=1
    python scripts/launch.py launcher.backend=ray launcher.ray_address=HEAD:6379 role=actors \
        broker.address=tcp://HOST:PORT actors.count=8                       # more actors for a running run

Ray does placement, process lifetime and node-failure detection; the supervisor (`launcher.supervisor`) keeps
its own rules for what restarts and how, exactly as on one host. Each child process of the run is started by a
`ProcessHost`, a small Ray actor that asks for the child's resources (`launcher.resources`, per role) and runs the
child's command on its node, in a session of its own, with every descendant marked. The learner's hosts share one
placement group (one bundle per learner node: gang-scheduled; node 0 holds torchrun's rendezvous). A weight
sidecar goes to its engine's node. Ports are picked on the node that binds them, and every address names that
node's IP (`launcher.wiring.wire_placed`).

A node that dies takes its processes with it: their hosts' calls fail with Ray's ActorDiedError, which the
supervisor sees as that child's death (`RemoteProcess.lost` says why) and handles as a kill -9: an actor is
restarted wherever Ray finds room (its groups are dropped under `actor_left`), an engine too (a new URL if it lands
on another node; actors learn it from the broker), the broker too (from its log in the run folder; its clients
follow the record it writes there, RUN/broker.json), a one-node learner too (from its checkpoint, in its placement
group's bundle Ray reserves again elsewhere; the sidecars follow RUN/learner.json), while the gateway may only come
back on its own node (agent code holds its address), else the run stops with the reason.

What every node needs: the same Python environment at the same path as this host (Ray's usual assumption), and the
run folder and the model on storage that every node sees at the same path (docs/deployment.md).
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import math
import os
import signal
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agentstream.config import Config, LauncherConfig
from agentstream.wire.addresses import LEARNER_RECORD, write_record
from agentstream.wire.curve import is_loopback
from launcher.checks import gateway_errors, network_errors
from launcher.commands import Command, Commands
from launcher.procs import CHILD_ENV, child_marker
from launcher.ray_host import ProcessHost
from launcher.supervisor import Child, Launcher, RunFailed, learner_node_rank
from launcher.wiring import Places, Wiring, wire_placed

log = logging.getLogger("launch")

NODE_ENV = "AGENTSTREAM_RAY_NODE"
"""In every child's environment under Ray: the id of the Ray node it runs on (tests stop a node's processes by it)."""
FORWARDED_ENV = ("AGENTSTREAM", "VLLM_", "HF_", "TRANSFORMERS_", "TOKENIZERS_", "WANDB_", "MLFLOW_", "NCCL_", "TORCH")
"""Variables of the launching shell that reach every child on every node (the rest is the node's own)."""
LOCAL_RAY_IP = "127.0.0.2"
"""The address a Ray instance started for the run advertises, unless launcher.ray_node_ip says otherwise: loopback,
so the run's sockets stay on this host. Ray replaces 127.0.0.1 by the host's other interface; 127.0.0.2 it keeps."""
SAME_NODE_ROLES = ("broker", "learner", "gateway")
"""Roles whose address the whole run holds: restarted on the node they ran on (the broker and a one-node learner
elsewhere if that node is gone: their clients follow their records)."""
RESOURCE_ROLE = {
    "broker": "broker",
    "engine": "engine",
    "judge": "engine",
    "teacher": "engine",
    "learner": "learner",
    "actor": "actor",
    "gateway": "actor",
    "evaluator": "actor",
}
"""Which entry of launcher.resources a child of each role asks for (a sidecar goes beside its engine instead)."""


def ray_options(resources: dict[str, float]) -> dict[str, Any]:
    """`resources` (as in launcher.resources) as Ray's actor options: CPU and GPU have keywords of their own."""
    custom = {k: float(v) for k, v in resources.items() if k not in ("CPU", "GPU")}
    return {"num_cpus": float(resources.get("CPU", 0)), "num_gpus": float(resources.get("GPU", 0)), "resources": custom}


@dataclass(frozen=True)
class Node:
    ip: str
    id: str


@dataclass
class Placed:
    """A ProcessHost and the node Ray put it on."""

    host: Any  # ray.actor.ActorHandle
    node: Node


class RemoteProcess:
    """The supervisor's view of a child that a ProcessHost runs: `pid`, `returncode`, `wait()`, as asyncio's."""

    def __init__(self, placed: Placed, pid: int):
        self.placed, self.pid = placed, pid
        self.returncode: int | None = None
        self.lost = ""  # why it ended without an exit code: its node died

    async def wait(self) -> int:
        from ray.exceptions import ActorUnavailableError, RayActorError

        while self.returncode is None:
            try:
                code = await self.placed.host.wait.remote()
            except ActorUnavailableError:  # its node stopped answering; Ray declares it dead (or back) shortly
                await asyncio.sleep(1.0)
                continue
            except RayActorError as exc:  # ActorDiedError: the node died, and every process on it
                if self.returncode is not None:  # another wait had the exit code before the host was released
                    break
                node = self.placed.node
                self.lost = f"its Ray node {node.ip} ({node.id[:12]}) died: {exc.__class__.__name__}"
                code = -int(signal.SIGKILL)
            self.returncode = code
        return self.returncode


@dataclass
class RayChild(Child):
    """A child of the run whose process a ProcessHost runs on a Ray node."""

    launcher: RayLauncher | None = None
    placed: Placed | None = None
    local = False  # its pid is on another node, maybe
    released = False

    async def start(self) -> None:
        assert self.launcher is not None
        self.marker = child_marker(self.name)
        self.placed = await self.launcher.host_for(self)
        forwarded = {k: v for k, v in os.environ.items() if k.startswith(FORWARDED_ENV)}
        env = {**forwarded, **self.env, CHILD_ENV: self.marker, NODE_ENV: self.placed.node.id}
        pid = await self.placed.host.start.remote(self.argv, env, str(self.log_path.resolve()), os.getcwd())
        self.proc = RemoteProcess(self.placed, pid)  # type: ignore[assignment]

    def signal(self, sig: int) -> None:
        if self.placed is not None and self.proc is not None and self.proc.returncode is None:
            self.placed.host.signal.remote(sig)  # fire and forget, as os.killpg

    async def end_leftovers(self) -> int | None:
        """End what the incarnation left on its node, then free its host (and the resources it holds)."""
        from ray.exceptions import RayActorError

        if self.proc is None or self.placed is None:
            return None
        if self.released:
            return await self.proc.wait()
        self.released = True
        try:
            ended, alive = await self.placed.host.end.remote(self.marker)
        except RayActorError:  # its node is gone, and its processes with it
            ended, alive = [], []
        code = await self.proc.wait()
        if ended:
            log.warning("%s left %d process(es) behind; ended: %s", self.name, len(ended), "; ".join(ended))
        if alive:
            log.error("%s: %d process(es) survived SIGKILL: %s", self.name, len(alive), "; ".join(alive))
        assert self.launcher is not None
        self.launcher.release(self)
        return code


@dataclass
class RayBackend:
    """This launch's connection to the Ray cluster: places ProcessHosts, owns the learner's placement group."""

    cfg: LauncherConfig
    timeout_s: float
    started_ray: bool = False
    groups: list[Any] = field(default_factory=list)  # placement groups of this launch
    _serial: Iterator[int] = field(default_factory=itertools.count)

    def connect(self, cpus_asked: float = 0.0) -> None:
        """Join the cluster at launcher.ray_address, or start a Ray instance on this host, with room for the run's
        `cpus_asked` (Ray's CPUs are for placement only: a small host would otherwise fit fewer processes)."""
        import ray

        if not ray.is_initialized():
            local = {} if self.cfg.ray_address else {"num_cpus": max(os.cpu_count() or 1, math.ceil(cpus_asked))}
            node_ip = self.cfg.ray_node_ip or (None if self.cfg.ray_address else LOCAL_RAY_IP)
            # "local": a new instance even when another runs on this host (None would join that one)
            ray.init(
                address=self.cfg.ray_address or "local",
                _node_ip_address=node_ip,
                log_to_driver=False,
                configure_logging=False,
                **local,
            )
            self.started_ray = not self.cfg.ray_address

    def place(self, role: str, name: str, node: Node | None = None, bundle: tuple[Any, int] | None = None) -> Placed:
        """A ProcessHost for `name` with its role's resources: anywhere Ray finds them (spread over the nodes), on
        `node` only, or in a placement group's bundle. RunFailed if Ray cannot place it within run.startup_timeout_s."""
        return self.place_many([(role, name, node, bundle)])[0]

    def place_many(self, asks: list[tuple[str, str, Node | None, tuple[Any, int] | None]]) -> list[Placed]:
        """`place` for each (role, name, node, bundle) of `asks`, all at once: Ray starts their workers in parallel."""
        import ray

        hosts = [self._host(*ask) for ask in asks]
        refs = [host.where.remote() for host in hosts]
        ray.wait(refs, num_returns=len(refs), timeout=self.timeout_s)
        out = []
        for (role, name, node, _), host, ref in zip(asks, hosts, refs):
            try:
                ip, node_id = ray.get(ref, timeout=0)
            except (ray.exceptions.GetTimeoutError, ray.exceptions.RayActorError) as exc:
                for h in hosts:
                    ray.kill(h)
                where = f"on node {node.ip} ({node.id[:12]})" if node else "on any node"
                key = RESOURCE_ROLE.get(role, "actor")
                asked = self._resources(role, None) or "nothing"
                raise RunFailed(
                    f"Ray could not place {name} ({role}, asking {asked}) {where} within "
                    f"{self.timeout_s:.0f}s ({exc.__class__.__name__}); the cluster has "
                    f"{ray.cluster_resources()} in all, {ray.available_resources()} free. Give the nodes "
                    f"these resources, or change launcher.resources.{key}"
                ) from None
            out.append(Placed(host, Node(ip, node_id)))
        return out

    def _resources(self, role: str, bundle: tuple[Any, int] | None) -> dict[str, float]:
        if bundle is not None:
            return dict(bundle[0].bundle_specs[bundle[1]])
        if role == "sidecar":  # beside its engine, on the engine's resources
            return {}
        return dict(self.cfg.resources.get(RESOURCE_ROLE.get(role, "actor"), {}))

    def _host(self, role: str, name: str, node: Node | None, bundle: tuple[Any, int] | None) -> Any:
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

        if bundle is not None:
            strategy: Any = PlacementGroupSchedulingStrategy(bundle[0], placement_group_bundle_index=bundle[1])
        elif node is not None:
            strategy = NodeAffinitySchedulingStrategy(node.id, soft=False)
        else:
            strategy = "SPREAD"
        # Named `<launcher pid>/<child>/<serial>` (as CHILD_ENV): Ray's state API tells which node runs what.
        return (
            ray.remote(ProcessHost)
            .options(
                name=f"{os.getpid()}/{name}/{next(self._serial)}",
                scheduling_strategy=strategy,
                max_concurrency=16,
                **ray_options(self._resources(role, bundle)),
            )
            .remote()
        )

    def learner_group(self, nnodes: int, ranks_per_node: int) -> Any:
        """One placement group for the learner: a bundle per learner node (its ranks' resources together), on
        distinct nodes when there are several; Ray reserves all of them or none (gang scheduling)."""
        import ray
        from ray.util.placement_group import placement_group

        per_rank = self.cfg.resources.get("learner", {})
        bundle = {k: float(v) * ranks_per_node for k, v in per_rank.items() if float(v) > 0} or {"CPU": 0.001}
        pg = placement_group([dict(bundle) for _ in range(nnodes)], strategy="STRICT_SPREAD" if nnodes > 1 else "PACK")
        try:
            ray.get(pg.ready(), timeout=self.timeout_s)
        except ray.exceptions.GetTimeoutError:
            ray.util.remove_placement_group(pg)
            raise RunFailed(
                f"Ray could not reserve the learner's {nnodes} bundle(s) of {bundle} within "
                f"{self.timeout_s:.0f}s; the cluster has {ray.cluster_resources()} in all, "
                f"{ray.available_resources()} free (launcher.resources.learner is per rank)"
            ) from None
        self.groups.append(pg)
        return pg

    def release(self, placed: Placed) -> None:
        import ray

        ray.kill(placed.host, no_restart=True)

    def close(self) -> None:
        import ray

        for pg in self.groups:
            ray.util.remove_placement_group(pg)
        if self.started_ray:
            ray.shutdown()


class RayCommands(Commands):
    """The children's commands when Ray places them: each engine binds its node's IP, Ray gives each process the
    GPUs it asked for, and the main launch starts every node of the learner."""

    def engine_host(self, i: int) -> str:
        return self.wiring.engines[i].split("//", 1)[1].rsplit(":", 1)[0]  # the node's IP (each engine its own)

    def gpus_of_engine(self, i: int) -> dict[str, str]:
        return {}  # Ray gives each placed process the GPUs it asked for (launcher.resources)

    def gpus_of_learner(self) -> dict[str, str]:
        return {}

    def engine_on_gpu(self) -> bool:
        return float(self.cfg.launcher.resources.get("engine", {}).get("GPU", 0)) > 0

    def learner_nodes(self) -> list[Command]:
        """Every node of the learner: Ray places them all (one bundle each of the learner's placement group)."""
        return [self.learner(node_rank=k) for k in range(self.cfg.learner.nnodes)]


class RayLauncher(Launcher):
    """The supervisor of `launcher.supervisor`, its children placed on a Ray cluster."""

    commands_type = RayCommands

    def __init__(
        self,
        cfg: Config,
        run_dir: Path,
        backend: RayBackend,
        wiring: Wiring,
        placed: dict[str, Placed],
        learner_group: Any = None,
        prefix: str = "",
    ):
        super().__init__(cfg, run_dir, wiring, prefix)
        self.backend, self.learner_group = backend, learner_group
        self._placed = placed  # hosts placed before the start (they chose the ports in `wiring`), by child name
        self._nodes: dict[str, Node] = {n: p.node for n, p in placed.items()}  # child name -> its last node

    def child_of(self, command: Command) -> Child:
        return RayChild(
            command.name,
            command.role,
            command.argv,
            command.env,
            command.log_path,
            incarnation=command.incarnation,
            launcher=self,
        )

    async def host_for(self, child: RayChild) -> Placed:
        """The host `child` starts on: the one placed with its ports, beside its engine (a sidecar), back on its
        node (broker, gateway, learner: the run holds their addresses), in its learner bundle, or anywhere."""
        if child.name in self._placed:
            return self._placed.pop(child.name)
        node = self._nodes.get(child.name)
        if child.role == "sidecar":  # beside its engine; anywhere for a server started elsewhere (external_urls)
            node = self._nodes.get(child.name.replace("sidecar-", "engine-", 1))
        elif child.role in SAME_NODE_ROLES and node is not None and not await asyncio.to_thread(_alive, node):
            raise RunFailed(
                f"{child.name} cannot come back: its Ray node {node.ip} ({node.id[:12]}) is gone, and "
                f"the run's processes hold its address"
            )
        bundle = None
        if child.role == "learner":
            bundle = (self.learner_group, learner_node_rank(child.name))
            node = None
        elif child.role not in SAME_NODE_ROLES + ("sidecar",):
            node = None  # anywhere
        placed = await asyncio.to_thread(self.backend.place, child.role, child.name, node, bundle)
        self._nodes[child.name] = placed.node
        return placed

    async def _reseat_broker(self) -> None:
        """Before the broker restarts: back on its node while that lives; when it is gone, on any node Ray finds
        room on, binding that node's address. It recovers from its log in the run folder (shared storage), writes
        its new addresses to its record there, and every client follows (`agentstream.wire.client.RecordLink`)."""
        node = self._nodes.get("broker")
        if node is None or await asyncio.to_thread(_alive, node):
            return
        placed = await asyncio.to_thread(self.backend.place, "broker", "broker")
        self._placed["broker"], self._nodes["broker"] = placed, placed.node
        self.commands.broker_host = placed.node.ip
        log.warning("the broker's Ray node %s is gone: starting it again on node %s", node.ip, placed.node.ip)

    async def _reseat_learner(self, node_rank: int) -> None:
        """Before a learner node restarts: back in its bundle while its node lives; when the node is gone, in the bundle
        Ray reserves again on a node left (the learner's placement group), with new ports picked there, which the run's
        wiring and the learner's record (RUN/learner.json) name: the sidecars follow it. (A learner of several nodes
        restarts as a whole or not at all: `learner.max_restarts` applies to one node.)"""
        import ray

        name = "learner" if self.cfg.learner.nnodes == 1 else f"learner-node{node_rank}"
        node = self._nodes.get(name)
        if node is None or await asyncio.to_thread(_alive, node):
            return
        placed = await asyncio.to_thread(self.backend.place, "learner", name, None, (self.learner_group, node_rank))
        ip = placed.node.ip
        weight_port, rdzv_port = await asyncio.to_thread(ray.get, placed.host.free_ports.remote(ip, 2))
        self._placed[name], self._nodes[name] = placed, placed.node
        self.wiring = dataclasses.replace(
            self.wiring,
            weights=f"tcp://{ip}:{weight_port}",
            weights_bind=f"tcp://{ip}:{weight_port}",
            rdzv=f"{ip}:{rdzv_port}",
        )
        write_record(self.run_dir / LEARNER_RECORD, weights=self.wiring.weights)
        log.warning(
            "the learner's Ray node %s is gone: starting it again on node %s, weights at %s",
            node.ip,
            ip,
            self.wiring.weights,
        )

    async def _reseat_engine(self, i: int) -> None:
        """Before engine i restarts: a new host, on any node (the old one may be gone), binding the same port there;
        the run's wiring then names that node (its new sidecar, and the broker, tell the actors)."""
        name = f"engine-{self.prefix}{i}"
        port = int(self.wiring.engines[i].rsplit(":", 1)[1])
        placed = await asyncio.to_thread(self.backend.place, "engine", name)
        self._placed[name], self._nodes[name] = placed, placed.node
        self.wiring.engines[i] = f"http://{placed.node.ip}:{port}"

    def release(self, child: RayChild) -> None:
        assert child.placed is not None and child.proc is not None
        lost = getattr(child.proc, "lost", "")
        if lost:
            self.lost.append({"process": child.name, "why": lost})
            log.error("%s ended: %s", child.name, lost)
        self.backend.release(child.placed)

    def death_reason(self, child: Child) -> str:
        return getattr(child.proc, "lost", "")

    async def stop_all(self) -> list[str]:
        left = await super().stop_all()
        for placed in self._placed.values():  # placed, never started (a start that failed early)
            self.backend.release(placed)
        await asyncio.to_thread(self.backend.close)
        return left


def _alive(node: Node) -> bool:
    import ray

    return any(n["NodeID"] == node.id and n["Alive"] for n in ray.nodes())


def _network_errors(cfg: Config, engine_ips: list[str]) -> list[str]:
    """The config's network checks again, on the addresses Ray gave (the engines by the first off loopback)."""
    host = next((ip for ip in engine_ips if not is_loopback(ip)), cfg.engines.host)
    return network_errors(dataclasses.replace(cfg, engines=dataclasses.replace(cfg.engines, host=host)))


def place_run(cfg: Config, run_dir: Path) -> RayLauncher:
    """Connect to the cluster, place the processes that bind ports (broker, engines, learner nodes, gateway), pick
    their ports on their nodes, and wire the run on those addresses. Blocking (Ray's calls)."""
    backend = RayBackend(cfg.launcher, cfg.run.startup_timeout_s)
    cpus = {role: float(r.get("CPU", 0)) for role, r in cfg.launcher.resources.items()}
    backend.connect(
        cpus.get("broker", 0)
        + cpus.get("engine", 0) * cfg.engines.count
        + cpus.get("learner", 0) * cfg.learner.world_size
        + cpus.get("actor", 0) * (cfg.actors.count + cfg.gateway.enabled + (cfg.validation.every > 0))
    )
    placed: dict[str, Placed] = {}
    try:
        return _place(cfg, run_dir, backend, placed)
    except BaseException:
        for p in placed.values():
            backend.release(p)
        backend.close()
        raise


def _place(cfg: Config, run_dir: Path, backend: RayBackend, placed: dict[str, Placed]) -> RayLauncher:
    """Every process of the run placed at once (then the sidecars, beside their engines); ports picked there."""
    import ray

    c = cfg.learner
    group = backend.learner_group(c.nnodes, c.world_size // c.nnodes)
    engines = [f"engine-{i}" for i in range(cfg.engines.count if not cfg.engines.external_urls else 0)]
    learners = ["learner"] if c.nnodes == 1 else [f"learner-node{k}" for k in range(c.nnodes)]
    asks = [
        ("broker", "broker", None, None),
        *(("engine", e, None, None) for e in engines),
        *(("learner", n, None, (group, k)) for k, n in enumerate(learners)),
        *(("actor", f"actor-{i}", None, None) for i in range(cfg.actors.count)),
        *([("gateway", "gateway-0", None, None)] if cfg.gateway.enabled else []),
        *([("evaluator", "evaluator", None, None)] if cfg.validation.every > 0 else []),
    ]
    placed.update(zip([name for _, name, _, _ in asks], backend.place_many(asks)))
    sidecars = [("sidecar", e.replace("engine-", "sidecar-"), placed[e].node, None) for e in engines]
    placed.update(zip([name for _, name, _, _ in sidecars], backend.place_many(sidecars)))
    b, lead = placed["broker"], placed[learners[0]]
    picks = [(b, 2), *((placed[e], 1) for e in engines), (lead, 2)]
    picks += [(placed["gateway-0"], 1)] if cfg.gateway.enabled else []
    picked = ray.get([p.host.free_ports.remote(p.node.ip, n) for p, n in picks])  # configured ports win over these
    broker_port, dashboard_port = cfg.broker.port or picked[0][0], cfg.broker.dashboard_port or picked[0][1]
    base = cfg.engines.base_port
    engine_ports = [(placed[e].node.ip, base + 2 * i if base else picked[1 + i][0]) for i, e in enumerate(engines)]
    weight_port, rdzv_port = c.weight_port or picked[1 + len(engines)][0], c.rdzv_port or picked[1 + len(engines)][1]
    gateway: tuple[str, int] | None = None
    if cfg.gateway.enabled:
        gateway = (placed["gateway-0"].node.ip, cfg.gateway.port or picked[-1][0])
    places = Places(
        broker=(b.node.ip, broker_port, dashboard_port),
        engines=engine_ports,
        learner=(lead.node.ip, weight_port, rdzv_port),
        gateway=gateway,
    )
    placed_cfg = dataclasses.replace(
        cfg,
        broker=dataclasses.replace(cfg.broker, host=b.node.ip, dashboard_host=b.node.ip),
        learner=dataclasses.replace(cfg.learner, weight_host=lead.node.ip),
        gateway=dataclasses.replace(cfg.gateway, host=gateway[0]) if gateway else cfg.gateway,
    )
    # The checks of the config again, on the addresses Ray gave: off loopback, CURVE keys (or an explicit opt-in).
    errors = _network_errors(placed_cfg, [ip for ip, _ in engine_ports]) + gateway_errors(placed_cfg)
    if errors:
        raise RunFailed(
            "the run's processes landed on Ray nodes that other hosts reach, and:\n  - " + "\n  - ".join(errors)
        )
    log.info("placed on Ray: %s", {n: p.node.ip for n, p in placed.items()})
    return RayLauncher(placed_cfg, run_dir, backend, wire_placed(placed_cfg, places), placed, group)


def place_join(cfg: Config, run_dir: Path, wiring: Wiring, prefix: str) -> RayLauncher:
    """A joining launch on Ray: more actors (placed as they start), or more engines, placed here with their sidecars
    beside them and their ports picked on their nodes (`wiring` gets their URLs). Blocking (Ray's calls)."""
    import ray

    backend = RayBackend(cfg.launcher, cfg.run.startup_timeout_s)
    backend.connect()
    placed: dict[str, Placed] = {}
    if cfg.run.role == "engines":
        names = [f"engine-{prefix}{i}" for i in range(cfg.engines.count)]
        placed.update(zip(names, backend.place_many([("engine", n, None, None) for n in names])))
        sidecars = [("sidecar", n.replace("engine-", "sidecar-", 1), placed[n].node, None) for n in names]
        placed.update(zip([s[1] for s in sidecars], backend.place_many(sidecars)))
        picked = ray.get([placed[n].host.free_ports.remote(placed[n].node.ip, 1) for n in names])
        base = cfg.engines.base_port
        wiring = dataclasses.replace(
            wiring,
            engines=[
                f"http://{placed[n].node.ip}:{base + 2 * i if base else picked[i][0]}" for i, n in enumerate(names)
            ],
        )
        errors = _network_errors(cfg, [p.node.ip for p in placed.values()])
        if errors:
            for p in placed.values():
                backend.release(p)
            raise RunFailed(
                "the new engines landed on Ray nodes that other hosts reach, and:\n  - " + "\n  - ".join(errors)
            )
    return RayLauncher(cfg, run_dir, backend, wiring, placed, prefix=prefix)


__all__ = [
    "NODE_ENV",
    "RayBackend",
    "RayChild",
    "RayCommands",
    "RayLauncher",
    "RemoteProcess",
    "place_join",
    "place_run",
]
