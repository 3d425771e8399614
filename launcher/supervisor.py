"""The supervisor: starts the children of a run (broker, engines and their weight sidecars, LLM judges, distillation
teachers, learner, actors, evaluator), each in a process group of its own, and decides what a death means. What each
child runs (its command line) is `launcher.commands`'s.

If the broker, an engine, a weight sidecar, a judge, a teacher or the learner dies, it is restarted within its role's
budget (`*.max_restarts`), else everything stops with the reason and the tail of that process's log; a dead actor is
restarted under a new incarnation (counted, up to `actors.max_restarts`). Before any restart, whatever the dead
incarnation left is ended: its process group, and every descendant that carries its marker (`launcher.procs`).
A judge (judge-<i>) or a teacher (teacher-<i>) is a vLLM server of a fixed model, started with the engines' command on
its own model, but without a weight sidecar: nothing ever changes its weights. The run ends when the learner exits
after its last step (by then every engine serves the final version): actors are stopped, the broker's summary is
written to `summary.json`, and every process group is stopped; then any process of any incarnation still carrying
this launch's marker is ended and named in `processes_left`. Ctrl-C does the same, early.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import re
import signal
import time
from collections import Counter
from collections.abc import Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import aiohttp

from agentstream.config import Config
from agentstream.wire.addresses import BROKER_RECORD, LEARNER_RECORD, read_record, write_record
from launcher.commands import Command, Commands
from launcher.procs import CHILD_ENV, child_marker, end_marked, wait_gone
from launcher.wiring import Wiring, wire

log = logging.getLogger("launch")


class RunFailed(RuntimeError):
    """A process the run cannot live without died, or did not start."""


@dataclass
class Child:
    name: str
    role: str  # broker | engine | sidecar | judge | teacher | learner | actor | gateway | evaluator
    argv: list[str]
    env: dict[str, str]
    log_path: Path
    proc: asyncio.subprocess.Process | None = None
    incarnation: int = 0
    marker: str = ""  # CHILD_ENV of the started process: every descendant inherits it
    local: ClassVar[bool] = True  # its process runs on this host (launcher.ray_backend's may not)

    async def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.marker = child_marker(self.name)
        with open(self.log_path, "ab") as out:
            self.proc = await asyncio.create_subprocess_exec(
                *self.argv,
                stdout=out,
                stderr=asyncio.subprocess.STDOUT,
                stdin=asyncio.subprocess.DEVNULL,
                env={**os.environ, **self.env, CHILD_ENV: self.marker},
                start_new_session=True,
            )

    def signal(self, sig: int) -> None:
        if self.proc is not None:
            try:
                os.killpg(self.proc.pid, sig)  # the whole group: vLLM and torchrun have children
            except (ProcessLookupError, PermissionError):
                pass

    async def stop(self, timeout_s: float) -> int | None:
        if self.proc is None:
            return None
        if self.proc.returncode is None:
            self.signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(self.proc.wait(), timeout_s)
            except TimeoutError:
                log.warning("%s did not exit within %.0fs of SIGTERM; killing it", self.name, timeout_s)
        return await self.end_leftovers()

    async def end_leftovers(self) -> int | None:
        """SIGKILL the group (stragglers: vLLM's EngineCore outlives a killed API server in it) and every process
        with this incarnation's marker (torchrun's ranks, in sessions of their own; anything reparented).
        Returns the leader's exit code."""
        if self.proc is None:
            return None
        self.signal(signal.SIGKILL)
        code = await self.proc.wait()
        # The group's members got that SIGKILL; the others (another group or session) get their own here. Then
        # wait (zombies count as dead) until none of it runs: the next incarnation starts only after that.
        ended, _ = await asyncio.to_thread(end_marked, CHILD_ENV, self.marker, other_than_group=self.proc.pid)
        _, alive = await asyncio.to_thread(end_marked, CHILD_ENV, self.marker)
        if ended:
            log.warning("%s left %d process(es) behind; ended: %s", self.name, len(ended), "; ".join(ended))
        if alive:
            log.error("%s: %d process(es) survived SIGKILL: %s", self.name, len(alive), "; ".join(alive))
        return code

    def log_tail(self, lines: int = 12) -> str:
        """The log's last lines, preceded by its first error lines: the root cause usually comes first
        (torchrun's own report buries the rank's message above a long traceback)."""
        try:
            text = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        tail = text[-lines:]
        errors = [ln for ln in text[:-lines] if _ERROR_LINE.search(ln)][:3]
        return "\n".join(errors + (["..."] if errors else []) + tail)


_ERROR_LINE = re.compile(r"(error|failed|cannot|exception|traceback)", re.IGNORECASE)


class Launcher:
    """Owns the children of one run: starts them (their command lines: `launcher.commands`), restarts them within
    their roles' budgets, and stops them."""

    commands_type: ClassVar[type[Commands]] = Commands
    """Where this launch's children run decides parts of their commands (`launcher.ray_backend.RayCommands`)."""

    def __init__(self, cfg: Config, run_dir: Path, wiring: Wiring | None = None, prefix: str = ""):
        """`wiring`: addresses of a running run (a joining launch, launcher.join); None: wire a new one.
        `prefix` goes into every actor's and engine's name, unique per launch when several join one run."""
        self.cfg, self.run_dir = cfg, run_dir
        self.prefix = prefix
        self.config_path = run_dir / "config.yaml"
        self.children: list[Child] = []
        self.actor_restarts = 0
        self.restarts: Counter[str] = Counter()  # broker, engine, learner restarts (supervise)
        self._restarting: set[asyncio.Task[None]] = set()  # restarts in flight (`_background`)
        self._failed: RunFailed | None = None  # a background restart that failed
        self._stopping = False  # set by the first stop: from then on an exit is no death to handle
        self.lost: list[dict[str, str]] = []  # children whose node died (Ray): summary.json's lost_with_node
        self.started = time.time()
        self.commands = self.commands_type(cfg, run_dir, wiring or wire(cfg), prefix, self.started)
        self._exits: asyncio.Queue[Child] = asyncio.Queue()
        self._watchers: list[asyncio.Task[None]] = []

    @property
    def wiring(self) -> Wiring:
        """The run's addresses now (the commands read them: a restarted child gets a moved broker's, say)."""
        return self.commands.wiring

    @wiring.setter
    def wiring(self, wiring: Wiring) -> None:
        self.commands.wiring = wiring

    def child_of(self, command: Command) -> Child:
        """The child that runs `command` (on this host; `RayLauncher`'s: on a node of the cluster)."""
        return Child(
            command.name, command.role, command.argv, command.env, command.log_path, incarnation=command.incarnation
        )

    async def wait_fixed(self, children: list[Child]) -> None:
        """Until each server of a fixed model (judge-<i>, teacher-<i>: `Commands.fixed_servers`) answers."""
        for child in children:
            await self.wait_server(child, self.commands.fixed_urls(child.role)[fixed_index(child.name)])

    async def wait_server(self, child: Child, url: str) -> None:
        """Until the vLLM server `child` answers at `url` (run.startup_timeout_s); RunFailed at once, with the
        reason, if any child exits meanwhile."""
        from engines.server import wait_ready

        await self._guarded(wait_ready(url, self.cfg.run.startup_timeout_s, proc=None), child)

    async def start_gateway(self, session: aiohttp.ClientSession) -> None:
        """Start the gateway, wait until it answers, then write its URL to RUN/gateway_url (agent code reads it)."""
        await self.spawn(self.commands.gateway())
        await self._wait_http(session, f"{self.wiring.gateway}/health", "gateway")
        (self.run_dir / "gateway_url").write_text(self.wiring.gateway + "\n")

    async def wait_evaluator(self) -> None:
        """After the learner's last step: give the evaluator validation.final_timeout_s to validate the final
        version (it exits by itself once it has)."""
        for child in (c for c in self.children if c.role == "evaluator" and c.proc is not None):
            try:
                await asyncio.wait_for(child.proc.wait(), self.cfg.validation.final_timeout_s)
            except TimeoutError:
                log.warning(
                    "the evaluator did not validate the final version within validation.final_timeout_s=%.0fs",
                    self.cfg.validation.final_timeout_s,
                )

    # ------------------------------------------------------------------ lifecycle
    async def spawn(self, command: Command) -> Child:
        """Start `command`'s child and watch it: its exit goes to `supervise`."""
        child = self.child_of(command)
        await child.start()
        self.children.append(child)
        self._watchers.append(asyncio.create_task(self._watch(child), name=f"watch-{child.name}"))
        log.info("started %s (pid %s), log: %s", child.name, child.proc.pid if child.proc else "?", child.log_path)
        return child

    async def _watch(self, child: Child) -> None:
        assert child.proc is not None
        await child.proc.wait()
        await self._exits.put(child)

    async def start_all(self, session: aiohttp.ClientSession) -> None:
        await self.spawn(self.commands.broker())
        await self._wait_http(session, f"{self.wiring.dashboard}/api/state", "broker")
        # the env's own server (OpenEnv's app), started while the engines start
        env_server = await self.spawn(self.commands.env_server()) if self.wiring.env_server else None
        engines = [await self.spawn(c) for c in self.commands.engines()]
        fixed = [await self.spawn(c) for c in self.commands.judges() + self.commands.teachers()]
        write_record(self.run_dir / LEARNER_RECORD, weights=self.wiring.weights)  # where the sidecars find it
        for command in self.commands.learner_nodes():  # loads and shards the model while the engines start
            await self.spawn(command)
        for child, url in zip(engines, self.wiring.engines):
            await self.wait_server(child, url)
        await self.wait_fixed(fixed)
        for i in range(len(self.wiring.engines)):
            await self.spawn(self.commands.sidecar(i))
        if env_server is not None:  # the actors' first episodes open their sessions on it
            await self._wait_http(session, f"{self.wiring.env_server}/health", env_server.name)
        for i in range(self.cfg.actors.count):
            await self.spawn(self.commands.actor(i))
        if self.cfg.gateway.enabled:
            await self.start_gateway(session)
        if self.cfg.validation.every > 0:
            await self.spawn(self.commands.evaluator())

    async def _guarded(self, coro, child: Child) -> None:
        """Await `coro`, but fail at once (with the reason) if any child exits meanwhile."""
        task = asyncio.ensure_future(coro)
        exit_wait = asyncio.ensure_future(self._exits.get())
        done, _ = await asyncio.wait({task, exit_wait}, return_when=asyncio.FIRST_COMPLETED)
        if exit_wait in done:
            task.cancel()
            dead = exit_wait.result()
            raise RunFailed(
                f"{dead.name} exited with code {dead.proc.returncode if dead.proc else '?'} while "
                f"waiting for {child.name} to start; its log ends with:\n{dead.log_tail()}"
            )
        exit_wait.cancel()
        try:
            task.result()
        except Exception as exc:
            raise RunFailed(
                f"{child.name} did not become ready: {exc}\nits log ends with:\n{child.log_tail()}"
            ) from exc

    async def _wait_http(self, session: aiohttp.ClientSession, url: str, what: str) -> None:
        deadline = time.monotonic() + self.cfg.run.startup_timeout_s
        while time.monotonic() < deadline:
            if not self._exits.empty():
                dead = self._exits.get_nowait()
                raise RunFailed(f"{dead.name} exited during start-up; its log ends with:\n{dead.log_tail()}")
            try:
                async with session.get(url) as resp:
                    if resp.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.2)
        raise RunFailed(f"{what} did not answer on {url} within {self.cfg.run.startup_timeout_s:.0f}s")

    async def supervise(self) -> None:
        """Until the learner finishes: restart dead actors, fail on any other death."""
        while True:
            child = await self._exits.get()
            if self._failed is not None:
                raise self._failed
            code = child.proc.returncode if child.proc else None
            if child.role == "learner" and code == 0:
                log.info("learner finished its %d steps", self.cfg.trainer.total_steps)
                return
            if child in self.children and not self._stopping:
                await child.end_leftovers()  # before any next incarnation: nothing of this one may go on
            if child.role in ("actor", "gateway", "env_server") and child in self.children and not self._stopping:
                await self._restart_actor(child, code)
                continue
            if child.role == "evaluator" and code == 0:  # it validated the final version
                continue
            if child in self.children and not self._stopping and await self._recover(child, code):
                continue
            if child in self.children and not self._stopping:
                why = self.death_reason(child)
                raise RunFailed(
                    f"{child.name} died (exit code {code}{'; ' + why if why else ''}); the run cannot "
                    f"continue without it. "
                    f"Its log ({child.log_path}) ends with:\n{child.log_tail()}"
                )

    async def _restart_actor(self, child: Child, code: int | None) -> None:
        if self.actor_restarts >= self.cfg.actors.max_restarts:
            raise RunFailed(
                f"{child.name} died (exit code {code}) and actors.max_restarts="
                f"{self.cfg.actors.max_restarts} restarts are used up. "
                f"Its log ends with:\n{child.log_tail()}"
            )
        self.actor_restarts += 1
        self.children.remove(child)
        if child.role == "env_server":  # as the gateway: on its port; the episodes it dropped are played again
            log.warning(
                "%s died (exit code %s); restarting it as incarnation %d", child.name, code, child.incarnation + 1
            )
            await self.spawn(self.commands.env_server(child.incarnation + 1))
            return
        if child.role == "gateway":  # counted as an actor's restart, as the broker counts it as an actor
            log.warning(
                "%s died (exit code %s); restarting it as incarnation %d", child.name, code, child.incarnation + 1
            )
            await self.spawn(self.commands.gateway(child.incarnation + 1))
            return
        i = int(child.name.rsplit("-", 1)[1])
        log.warning("%s died (exit code %s); restarting it as incarnation %d", child.name, code, child.incarnation + 1)
        await self.spawn(self.commands.actor(i, child.incarnation + 1))

    async def _recover(self, child: Child, code: int | None) -> bool:
        """Restart a dead broker (same ports; it recovers its state from its write-ahead log), engine or
        weight sidecar (both of the pair; the sidecar brings the new server to the current weights), or learner
        (from its latest checkpoint), within each role's restart budget. False: not restartable."""
        key = "engine" if child.role == "sidecar" else child.role
        budget = {
            "broker": self.cfg.broker.max_restarts,
            "engine": self.cfg.engines.max_restarts,
            "judge": self.cfg.judges.max_restarts,
            "teacher": self.cfg.distill.max_restarts,
            # a learner on several hosts restarts as a whole or not at all: not by one host's launch
            "learner": self.cfg.learner.max_restarts
            if self.cfg.checkpoint.every_steps > 0 and self.cfg.learner.nnodes == 1
            else 0,
        }.get(key, 0)
        if self.restarts[key] >= budget:
            return False
        self.restarts[key] += 1
        self.children.remove(child)
        log.warning(
            "%s died (exit code %s); restarting it (%s restart %d of %d)",
            child.name,
            code,
            key,
            self.restarts[key],
            budget,
        )
        if key == "broker":
            before = read_record(self.run_dir / BROKER_RECORD)
            await self._reseat_broker()
            await self.spawn(self.commands.broker(restart=True))
            self._background(self._follow_broker(before), "follow-broker")
        elif key == "learner":  # the dead torchrun's ranks were ended with it (supervise: end_leftovers)
            await self._reseat_learner(learner_node_rank(child.name))
            await self.spawn(self.commands.learner(resume=True, node_rank=learner_node_rank(child.name)))
        else:  # in the background: a vLLM server takes a while to start, other deaths need handling meanwhile
            self._background(self._restart_engine_guarded(child), f"restart-{child.name}")
        return True

    def _background(self, work: Coroutine[Any, Any, None], name: str) -> None:
        """Run `work` beside the supervision (restarts in flight, awaited or cancelled at the stop)."""
        task = asyncio.create_task(work, name=name)
        self._restarting.add(task)
        task.add_done_callback(self._restarting.discard)

    async def _reseat_broker(self) -> None:
        """Before the broker restarts: where (on one host, where it was; `RayLauncher` moves it off a dead node)."""

    async def _reseat_learner(self, node_rank: int) -> None:
        """Before a learner node restarts: where (on one host, where it was; `RayLauncher` moves it off a dead node
        and rewrites its record, which the sidecars follow)."""

    async def _follow_broker(self, before: dict[str, Any] | None) -> None:
        """Once the restarted broker wrote its record (another one than `before`): this launch's wiring names its
        addresses (the progress line and the final summary read its dashboard; the children read the record)."""
        deadline = time.monotonic() + self.cfg.run.startup_timeout_s
        while time.monotonic() < deadline:
            now = read_record(self.run_dir / BROKER_RECORD)
            if now is not None and now != before:
                self.wiring = dataclasses.replace(
                    self.wiring,
                    broker=now["address"],
                    dashboard=now["dashboard"],
                    broker_port=int(now["address"].rsplit(":", 1)[1]),
                )
                log.warning("the broker is back on %s (dashboard %s/)", now["address"], now["dashboard"])
                return
            await asyncio.sleep(0.5)
        log.error("the restarted broker wrote no record within %.0f s", self.cfg.run.startup_timeout_s)

    async def _restart_engine_guarded(self, child: Child) -> None:
        try:
            fixed = child.role in ("judge", "teacher")
            await (self._restart_fixed(child) if fixed else self._restart_engine(child))
        except Exception as exc:  # noqa: BLE001 (any failure ends the run, with its reason)
            self._failed = exc if isinstance(exc, RunFailed) else RunFailed(f"restarting {child.name} failed: {exc!r}")
            await self._exits.put(child)  # wakes supervise(), which raises it

    async def _restart_engine(self, child: Child) -> None:
        from engines.server import wait_ready

        i = next(
            i
            for i in range(len(self.wiring.engines))
            if child.name in (f"engine-{self.prefix}{i}", f"sidecar-{self.prefix}{i}")
        )
        pair = (f"engine-{self.prefix}{i}", f"sidecar-{self.prefix}{i}")
        for partner in [c for c in self.children if c.name in pair]:
            self.children.remove(partner)  # its exit is then not a death to handle
            await partner.stop(self.cfg.run.shutdown_timeout_s)
        if not self.cfg.engines.external_urls:
            await self._reseat_engine(i)
            engine = await self.spawn(self.commands.engines()[i])
            try:
                await wait_ready(self.wiring.engines[i], self.cfg.run.startup_timeout_s, proc=None)
            except Exception as exc:
                raise RunFailed(
                    f"{engine.name} did not come back: {exc}\nits log ends with:\n{engine.log_tail()}"
                ) from exc
        await self.spawn(self.commands.sidecar(i))

    async def _reseat_engine(self, i: int) -> None:
        """Before engine i restarts: where it goes (here: where it was; on Ray, wherever Ray finds room)."""

    def death_reason(self, child: Child) -> str:
        """Why `child` ended, when its exit code does not say (on Ray: its node died)."""
        return ""

    async def _restart_fixed(self, child: Child) -> None:
        """A judge or a teacher comes back on its port with its own weights; meanwhile actors' requests to it fail
        (a judge's: judge_errors, default_score; a teacher's: asked again, then the group dropped) or go to another."""
        from engines.server import wait_ready

        i = fixed_index(child.name)
        server = await self.spawn(self.commands.fixed_servers(child.role)[i])
        try:
            await wait_ready(self.commands.fixed_urls(child.role)[i], self.cfg.run.startup_timeout_s, proc=None)
        except Exception as exc:
            raise RunFailed(f"{server.name} did not come back: {exc}\nits log ends with:\n{server.log_tail()}") from exc

    async def stop_roles(self, roles: tuple[str, ...]) -> None:
        """The run is stopping: from now on no exit is a death to handle (nothing is restarted, `supervise` fails
        on none); stop every child of these roles concurrently, each with a bounded wait."""
        self._stopping = True
        targets = [c for c in self.children if c.role in roles]
        await asyncio.gather(*(c.stop(self.cfg.run.shutdown_timeout_s) for c in targets))

    async def stop_all(self) -> list[str]:
        """Stop in dependency order (actors first, broker last). Returns what was left: names of groups still
        alive, then every process of any incarnation of this launch's children that the orderly stops missed
        (ended now, or named as still running)."""
        self._stopping = True
        for task in self._restarting:  # first: a restart in flight must not start a server after its role stopped
            task.cancel()
        await asyncio.gather(*self._restarting, return_exceptions=True)
        for roles in (
            ("actor", "gateway", "evaluator"),
            ("env_server",),
            ("learner",),
            ("sidecar",),
            ("engine", "judge", "teacher"),
            ("broker",),
        ):
            await self.stop_roles(roles)
        for task in self._watchers:
            task.cancel()
        await asyncio.gather(*self._watchers, return_exceptions=True)
        groups = {c.proc.pid: c.name for c in self.children if c.proc is not None and c.local}
        # SIGKILLed grandchildren (vLLM's EngineCore and Worker) take a moment to be reaped.
        left = await asyncio.to_thread(wait_gone, list(groups), 15.0)
        # Any incarnation, current or long replaced, in any group or session, reparented or not.
        strays, alive = await asyncio.to_thread(end_marked, CHILD_ENV, f"{os.getpid()}/", True)
        if strays:
            log.error("%d process(es) of this launch outlived the orderly stops: %s", len(strays), "; ".join(strays))
        return [groups[pid] for pid in left] + [
            f"{d}: {'still running' if d in alive else 'ended at the end'}" for d in strays
        ]


def fixed_index(name: str) -> int:
    """The index of a server of a fixed model from its name (`judge-<prefix><i>`, `teacher-<prefix><i>`)."""
    return int(re.search(r"(\d+)$", name).group(1))  # type: ignore[union-attr]  (the names end in their index)


def learner_node_rank(name: str) -> int:
    """The learner node of a learner child's name (`learner` is node 0 of 1, `learner-node<K>` node K)."""
    return int(name.rsplit("node", 1)[1]) if "-node" in name else 0


__all__ = ["Child", "Launcher", "RunFailed"]
