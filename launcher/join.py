"""Joining a running run: more actors (`role=actors`) or more engines (`role=engines`), on any host.

    python scripts/launch.py role=actors  broker.address=tcp://HOST:PORT actors.count=4
    python scripts/launch.py role=engines broker.address=tcp://HOST:PORT engines.count=1
    python scripts/launch.py role=learner broker.address=tcp://HOST:PORT learner.node_rank=1
    python scripts/launch.py role=gateway broker.address=tcp://HOST:PORT [gateway.port=8100]

The launch says Hello to the broker and gets its Welcome: the run's config (so the joiners play the same env
with the same model and sampling), the engines serving recent weights, the learner's weight address and the
dashboard's URL. From the local command line only `run.*`, `actors.*`, `broker.*`, `gateway.*`, where the engines
run (`engines.count/host/base_port/kv_cache_gib/cpu_*/gpu_memory_utilization/extra_args`) and a `model.path` other
than the default (the same model at another path on this host) are taken.

role=actors: N actor processes named `actor-<host>-<pid>-<i>`; each asks the broker for the engine list
(and follows engines that join later). A dead actor is restarted, as in the main launch. With the run's
judges.count > 0 the launch starts that many LLM judges of its own on this host (the main launch's listen on
its loopback), and its actors use them; so with distill.count > 0 for distillation teachers.
role=engines: N vLLM servers, each with a weight sidecar that registers with the learner's publisher (it
gets the newest weights at the learner's next step) and with the broker, which lets actors use the engine
once it serves recent weights.
role=learner: node learner.node_rank of a learner that spans learner.nnodes hosts (multi-node torchrun): its
world_size/nnodes ranks meet node 0 (the main launch's) at its rendezvous; the learner trains once every node
has joined. Its own fields: learner.node_rank and learner.torch_threads; its `engines.*` are the run's (it starts
none, and its ranks publish version 0 with node 0's when the run's engines are `engines.external_urls`).
role=gateway: one OpenAI-compatible gateway (`gateway-<host>-<pid>-0`, gateway/server.py) on this host, its
`gateway.*` from the local command line; it asks the broker for the engines, reports as an actor, is restarted
like one, and its URL is printed and written to RUN/gateway_url once it answers.

The launch ends when the run finishes (the learner reached trainer.total_steps), when the broker stops
answering (15 s), or
on Ctrl-C / SIGTERM: its processes are stopped (actors first; the broker drops their unfinished groups
under `actor_left`), and `summary.json` in its run folder says how it ended.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import socket
import sys
import time
from pathlib import Path

import aiohttp
from omegaconf import OmegaConf

from agentstream import config as config_mod
from agentstream.config import Config
from agentstream.process import on_stop_signals
from agentstream.wire.addresses import advertised_host, free_port
from agentstream.wire.client import AsyncClient
from agentstream.wire.messages import Hello, Welcome
from launcher.checks import check_config
from launcher.progress import progress_loop, write_summary
from launcher.supervisor import Launcher, RunFailed
from launcher.wiring import Wiring, judge_urls, teacher_urls

log = logging.getLogger("join")

_LOCAL_ENGINE_FIELDS = (
    "count",
    "host",
    "base_port",
    "kv_cache_gib",
    "cpu_executor",
    "cpu_threads",
    "cpu_threads_bind",
    "gpu_memory_utilization",
    "gpus_per_engine",
    "colocate",
    "extra_args",
)
"""Engine fields that describe this host's servers, not the run: taken from the local command line."""


class BrokerLink:
    """This launch's own connection to the broker (as role `launcher`): Welcome on demand, over ZeroMQ, so
    that a host which cannot reach the dashboard (it may listen on the broker host's loopback) can join."""

    def __init__(self, local: Config, name: str):
        b = local.broker
        self.address, self.name = b.address, name
        self.client = AsyncClient(b.address, name=name, curve_keys_dir=b.curve_keys_dir)
        self._started = False

    async def welcome(self, timeout_s: float) -> Welcome:
        """Hello, then the broker's Welcome. RunFailed if none comes in time."""
        if not self._started:
            await self.client.start()
            self._started = True
        await self.client.send(Hello(role="launcher", name=self.name, pid=os.getpid(), want_welcome=True))
        try:
            return await asyncio.wait_for(self.client.welcomes.get(), timeout_s)
        except TimeoutError:
            raise RunFailed(
                f"no answer from a broker at {self.address} within {timeout_s:.0f}s: is the run up, is "
                f"broker.address what its launch printed as `broker:`, and (CURVE) is broker.curve_keys_dir "
                f"a client key folder the broker allows?"
            ) from None

    async def close(self) -> None:
        await self.client.close()


async def watch_run(link: BrokerLink, total_steps: float, every_s: float = 2.0, answer_s: float = 15.0) -> str:
    """Return why the run is over: the learner reached its last step, or the broker stopped answering."""
    while True:
        await asyncio.sleep(every_s)
        try:
            welcome = await link.welcome(answer_s)
        except RunFailed:
            return (
                f"the broker at {link.address} stopped answering for {answer_s:.0f}s (the run ended, or is unreachable)"
            )
        if welcome.learner_version >= total_steps:
            return "the run finished"


def joined_config(local: Config, welcome: Welcome) -> Config:
    """The run's config (from the broker) with this launch's own fields (see the module docstring)."""
    run_cfg = config_mod.to_object(OmegaConf.create(welcome.config))
    engines = dataclasses.replace(
        run_cfg.engines, external_urls=[], **{f: getattr(local.engines, f) for f in _LOCAL_ENGINE_FIELDS}
    )
    if local.run.role == "learner":
        # A learner node starts no engine, and its ranks must do what node 0's do about the run's: whether the
        # initial weights go out as version 0 first (engines.external_urls) is a gather that every rank joins.
        engines = run_cfg.engines
    model = run_cfg.model
    if Path(local.model.path).resolve() != config_mod.TINY_MODEL_DIR.resolve():
        model = dataclasses.replace(model, path=local.model.path)
    learner = dataclasses.replace(
        run_cfg.learner, node_rank=local.learner.node_rank, torch_threads=local.learner.torch_threads
    )
    # broker.*: this host's own (address to join, its CURVE key folder, socket limits), not the broker's.
    return dataclasses.replace(
        run_cfg,
        run=local.run,
        actors=local.actors,
        engines=engines,
        model=model,
        broker=local.broker,
        learner=learner,
        gateway=local.gateway,
        launcher=local.launcher,
    )


def joining(cfg: Config) -> str:
    """What this launch adds to the run, in words."""
    if cfg.run.role == "learner":
        return (
            f"learner node {cfg.learner.node_rank} of {cfg.learner.nnodes} "
            f"({cfg.learner.world_size // cfg.learner.nnodes} ranks)"
        )
    if cfg.run.role == "gateway":
        return "a gateway"
    return f"{cfg.actors.count if cfg.run.role == 'actors' else cfg.engines.count} {cfg.run.role}"


def join_wiring(cfg: Config, welcome: Welcome) -> Wiring:
    """Addresses of the running run, plus (role=engines) this host's new servers (one line per edge)."""
    urls: list[str] = []
    if cfg.run.role == "engines":
        host, base = advertised_host(cfg.engines.host), cfg.engines.base_port
        urls = [
            f"http://{host}:{base + 2 * i if base else free_port(cfg.engines.host)}" for i in range(cfg.engines.count)
        ]
    learner_host = welcome.weights.split("//", 1)[-1].rsplit(":", 1)[0]  # node 0's host (rank 0 publishes there)
    gw_port = (cfg.gateway.port or free_port(cfg.gateway.host)) if cfg.run.role == "gateway" else 0
    return Wiring(
        broker=cfg.broker.address,
        broker_port=0,  # actors, weight sidecars, learner ranks -> the run's broker
        dashboard=welcome.dashboard.rstrip("/"),
        dashboard_port=0,  # this launch -> the run's state
        judges=judge_urls(cfg) if cfg.run.role == "actors" else [],  # new actors -> this host's own new judges
        teachers=teacher_urls(cfg) if cfg.run.role == "actors" else [],  # new actors -> this host's own new teachers
        weights=welcome.weights,  # new weight sidecars -> the learner's publisher
        engines=urls,  # new weight sidecars -> new servers; empty for actors: they ask the broker
        # learner ranks of this node -> node 0's rendezvous; `weights_bind` only tells them that rank 0 (on
        # node 0, which binds it) publishes, so that they join its collective gathers of the weights
        rdzv=f"{learner_host}:{cfg.learner.rdzv_port}" if cfg.run.role == "learner" else "",
        weights_bind=welcome.weights if cfg.run.role == "learner" else "",
        # agent code -> this host's new gateway (HTTP); it asks the broker for the engines
        gateway=f"http://{advertised_host(cfg.gateway.host)}:{gw_port}" if gw_port else "",
        gateway_port=gw_port,
    )


async def _start(launcher: Launcher, session: aiohttp.ClientSession) -> None:
    """Start this launch's processes: engines (and, once each is ready, its weight sidecar), actors or a gateway."""
    if launcher.cfg.run.role == "gateway":
        await launcher.start_gateway(session)
        print(
            f"[agentstream] gateway:    {launcher.wiring.gateway}   (URL in {launcher.run_dir / 'gateway_url'})",
            flush=True,
        )
    elif launcher.cfg.run.role == "learner":
        await launcher.spawn(launcher.commands.learner())
    elif launcher.cfg.run.role == "engines":
        if not launcher.wiring.weights:
            raise RunFailed(
                "the broker does not know the learner's weight address (was the run started with an "
                "older launcher?); engines cannot join it"
            )
        engines = [await launcher.spawn(c) for c in launcher.commands.engines()]
        for child, url in zip(engines, launcher.wiring.engines):
            await launcher.wait_server(child, url)
        for i in range(len(engines)):
            await launcher.spawn(launcher.commands.sidecar(i))
    else:
        fixed = launcher.commands.judges() + launcher.commands.teachers()
        await launcher.wait_fixed([await launcher.spawn(c) for c in fixed])
        for i in range(launcher.cfg.actors.count):
            await launcher.spawn(launcher.commands.actor(i))


async def _launcher(cfg: Config, run_dir: Path, wiring: Wiring, prefix: str) -> Launcher:
    """This launch's supervisor: its processes on this host, or (launcher.backend=ray, role=actors|engines) on the
    nodes of the Ray cluster at launcher.ray_address."""
    if cfg.launcher.backend != "ray":
        return Launcher(cfg, run_dir, wiring, prefix=prefix)
    from launcher.ray_backend import place_join

    return await asyncio.to_thread(place_join, cfg, run_dir, wiring, prefix)


async def _supervise_until_over(launcher: Launcher, link: BrokerLink) -> str:
    """Restart dead actors (fail on any other death) until the run is over; returns why it is."""
    # A learner node ends with its ranks (torchrun's exit barrier waits for every node's), not at the last step.
    last = launcher.cfg.trainer.total_steps if launcher.cfg.run.role != "learner" else float("inf")
    over = asyncio.create_task(watch_run(link, last))
    supervise = asyncio.create_task(launcher.supervise())
    try:
        done, _ = await asyncio.wait({over, supervise}, return_when=asyncio.FIRST_COMPLETED)
        return over.result() if over in done else "the learner finished its steps"  # (supervise's only return)
    finally:
        for task in (over, supervise):
            task.cancel()
        await asyncio.gather(over, supervise, return_exceptions=True)
        if supervise.done() and not supervise.cancelled() and supervise.exception() is not None:
            raise supervise.exception()  # type: ignore[misc]


async def run_join(local: Config, run_dir: Path) -> int:
    """Join the run at `local.broker.address` with more actors or engines. Returns the exit code."""
    name = f"{socket.gethostname().split('.')[0]}-{os.getpid()}-"
    main_task = asyncio.current_task()
    on_stop_signals(main_task.cancel)  # type: ignore[union-attr]
    status, reason, code, launcher = "finished", "", 0, None
    link = BrokerLink(local, f"launcher-{name}{local.run.role}")
    try:
        welcome = await link.welcome(local.run.startup_timeout_s)
        cfg = joined_config(local, welcome)
        if cfg.run.role == "learner" and cfg.learner.nnodes == 1:
            raise config_mod.ConfigError(
                "role=learner: the run's learner runs on one host (learner.nnodes=1); "
                "start the run with learner.nnodes=N to spread it over N hosts"
            )
        check_config(cfg)
        launcher = await _launcher(cfg, run_dir, join_wiring(cfg, welcome), name)
        config_mod.save(cfg, launcher.config_path)
        print(
            f"[agentstream] joined the run at {cfg.broker.address} (learner at version {welcome.learner_version}) "
            f"with {joining(cfg)}",
            flush=True,
        )
        print(f"[agentstream] dashboard:  {launcher.wiring.dashboard}/   run folder: {run_dir}", flush=True)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
            progress = asyncio.create_task(
                progress_loop(session, lambda: launcher.wiring.dashboard, cfg.trainer.total_steps)
            )
            try:
                await _start(launcher, session)
                reason = await _supervise_until_over(launcher, link)
            finally:
                progress.cancel()
    except config_mod.ConfigError as exc:
        status, reason, code = "failed", f"the run's config does not work here: {exc}", 2
    except RunFailed as exc:
        status, reason, code = "failed", str(exc), 1
    except asyncio.CancelledError:
        status, reason, code = "interrupted", "stopped by a signal (Ctrl-C)", 130
    on_stop_signals(lambda: log.warning("already stopping"))  # a second Ctrl-C must not cut the shutdown short
    left = await launcher.stop_all() if launcher is not None else []
    await link.close()
    summary = {
        "status": status,
        "reason": reason,
        "role": local.run.role,
        "broker": local.broker.address,
        "processes": sorted(c.name for c in launcher.children) if launcher else [],
        "actor_restarts": launcher.actor_restarts if launcher else 0,
        "processes_left": left,
        "run_dir": str(run_dir),
        "launcher_wall_s": time.time() - launcher.started if launcher else 0.0,
    }
    write_summary(run_dir / "summary.json", summary)
    print(
        f"[agentstream] {local.run.role} launch {status}: {reason}", file=sys.stderr if code else sys.stdout, flush=True
    )
    if left:
        print(f"[agentstream] WARNING: process groups still alive: {left}", file=sys.stderr, flush=True)
    return code


__all__ = ["BrokerLink", "join_wiring", "joined_config", "run_join", "watch_run"]
