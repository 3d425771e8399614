"""Faults injected into a real broker process (`python -m broker.server`), driven by real actor-side clients
(agentstream/wire/client.py: keyed transitions, acknowledgements, back-pressure under max_unacked) and a
stand-in learner process that asks for batches and reports versions as learner ranks do (a SyncClient; no
model, so that each test takes seconds rather than a launcher run's minutes):

- a learner stalled by SIGSTOP: admission stops at broker.max_buffered_transitions, the actors idle waiting
  for groups, and the broker's buffer and resident memory stay bounded;
- the broker's disk fills (its write-ahead log on a small tmpfs, a ballast file taking the rest): the broker
  stops acknowledging and says why (dashboard, /metrics, log), the actors back off under their
  unacknowledged limit, the run goes on once the ballast is deleted, and a kill -9 right after loses nothing
  that was acknowledged;
- a network partition (network namespaces and veth pairs the test makes, packets dropped with tc) cuts an actor
  and a real weight sidecar (on the session's spare vLLM server) off the broker and the learner for longer than
  the heartbeat timeout: both are declared gone, and both come back once it heals (the learner here also
  publishes weights, with the real WeightPublisher).

Each ends with the chaos test's accounting: acknowledged = ingested + rejected, ingested = trained + buffered +
dropped, and, per delivery key (broker.track_keys), nothing settled twice.

    .venv/bin/python -m pytest tests/broker/test_faults.py -q
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import numpy as np
import psutil
import pytest
from e2e_testing import check_accounting

from agentstream import config as config_mod
from agentstream.config import Config
from agentstream.wire.addresses import free_port
from agentstream.wire.client import AsyncClient
from agentstream.wire.messages import Stats, Transition
from launcher import procs

ROOT = Path(__file__).resolve().parents[2]
G = 2  # group size
ACTORS, PARALLEL = 2, 3  # actor clients, groups each plays at a time
MAX_UNACKED = 8
PROMPT = np.arange(64, dtype=np.int32) % 200  # ~0.5 kB a transition on the wire and in the log

LEARNER = r"""
import sys, time
from agentstream.wire.client import SyncClient
from agentstream.wire.messages import Batch, BatchRequest, VersionUpdate
client, step, publisher = SyncClient(sys.argv[1], "learner-0"), 0, None
if len(sys.argv) > 3:  # weights for the engines' sidecars, sent as rank 0 sends them (the model's own, each step)
    from safetensors.torch import load_file
    from learner.publish import WeightPublisher
    publisher, weights = WeightPublisher(sys.argv[3]), load_file(sys.argv[4])
while True:  # a learner rank: batch `step`, a "training step", the next version
    batch = client.request(BatchRequest(step=step, rank=0, world_size=1), resend_every_s=2.0,
                           accept=lambda m: getattr(m, "step", step) == step,  # not a repeat of an older answer
                           on_wait=publisher.service if publisher else None)
    assert isinstance(batch, Batch), batch
    time.sleep(float(sys.argv[2]))
    step += 1
    if publisher:
        publisher.publish(step, weights)
    client.send(VersionUpdate(version=step))
"""


def config(max_buffered: int, max_staleness: int) -> Config:
    cfg = Config()
    cfg.env.group_size = G
    cfg.trainer.groups_per_step = 2
    cfg.trainer.max_staleness = max_staleness
    cfg.trainer.total_steps = 10_000  # never "finished" here
    cfg.learner.world_size = 1
    cfg.broker.max_buffered_transitions = max_buffered
    cfg.broker.track_keys = True
    cfg.broker.logger = []
    return cfg


@dataclass
class Run:
    """A broker process, a stand-in learner process, and ACTORS actor clients in this test's event loop (each
    reporting Stats every half second, as actors do: the broker's heartbeat). With `netns`, the broker and
    the learner run in that network namespace, bound to all of its interfaces, and actor i reaches the broker
    at `hosts[i]`."""

    run_dir: Path
    steps: int  # per trajectory
    netns: str = ""
    hosts: tuple[str, ...] = ("127.0.0.1",) * ACTORS
    weights: tuple[str, str] = ("", "")  # (bind address, safetensors file): the learner publishes weights
    port: int = field(default_factory=free_port)
    dashboard: int = field(default_factory=free_port)
    broker: subprocess.Popen | None = None
    learner: subprocess.Popen | None = None
    clients: list[AsyncClient] = field(default_factory=list)
    tasks: list[asyncio.Task] = field(default_factory=list)
    sent: int = 0  # transitions the actors handed to their clients (each waits while MAX_UNACKED are unacked)
    http: aiohttp.ClientSession | None = None

    @property
    def marker(self) -> dict[str, str]:
        """In the environment of every process the test starts (and so of their descendants): none may outlive it."""
        return {procs.RUN_ENV: str(self.run_dir)}

    @property
    def address(self) -> str:
        return f"tcp://127.0.0.1:{self.port}"  # (from inside the namespace too, with `netns`)

    def _inside(self, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.netns, *argv] if self.netns else argv

    async def start_broker(self) -> None:
        argv = [
            sys.executable,
            "-m",
            "broker.server",
            "--config",
            str(self.run_dir / "config.yaml"),
            "--port",
            str(self.port),
            "--dashboard-port",
            str(self.dashboard),
        ]
        self.broker = procs.start(self._inside(argv), self.run_dir / "broker.log", env=self.marker, cwd=ROOT)
        await self.until(lambda st: st["run"]["status"] == "running", 30, "the broker up")

    async def start(self, step_s: float) -> None:
        await self.start_broker()
        argv = [sys.executable, "-c", LEARNER, self.address, str(step_s), *(w for w in self.weights if w)]
        self.learner = procs.start(self._inside(argv), self.run_dir / "learner.log", env=self.marker, cwd=ROOT)
        for i, host in enumerate(self.hosts):
            client = AsyncClient(f"tcp://{host}:{self.port}", f"actor-{i}")
            await client.start(max_unacked=MAX_UNACKED, ack_timeout_s=2.0)
            self.clients.append(client)
            self.tasks += [asyncio.create_task(self._play(client)) for _ in range(PARALLEL)]
            self.tasks.append(asyncio.create_task(self._report(client)))

    async def _play(self, client: AsyncClient) -> None:
        """One episode loop of an actor: a group at a time, its G trajectories of T steps each."""
        while True:
            grant = await client.request_group()
            for traj in range(G):
                for step in range(self.steps):
                    await asyncio.sleep(0.005)  # the env and the engine
                    await client.send_transition(
                        Transition(
                            traj_id=f"{client.name}/{grant.group_id}/{traj}",
                            group_id=grant.group_id,
                            actor=client.name,
                            step=step,
                            prompt_ids=PROMPT,
                            response_ids=np.array([7] * 16, np.int32),
                            logprobs=np.full(16, -0.5, np.float32),
                            version_lo=grant.min_version,
                            version_hi=grant.min_version,
                            reward=float(traj),
                            done=step == self.steps - 1,
                            truncated=False,
                            valid=True,
                        )
                    )
                    self.sent += 1

    async def _report(self, client: AsyncClient) -> None:
        while True:
            await client.send(Stats(source=client.name, role="actor", counters=dict(client.counters)))
            await asyncio.sleep(0.5)

    def acked_by_clients(self) -> int:
        """Transitions the broker told the clients it took (keys below the oldest unacknowledged one)."""
        return self.sent - sum(c.unacked for c in self.clients)

    async def state(self) -> dict | None:
        assert self.http is not None
        try:
            async with self.http.get(f"http://{self.hosts[-1]}:{self.dashboard}/api/state") as resp:
                return await resp.json() if resp.status == 200 else None
        except aiohttp.ClientError:
            return None

    async def get(self, path: str) -> str:
        assert self.http is not None
        async with self.http.get(f"http://{self.hosts[-1]}:{self.dashboard}{path}") as resp:
            assert resp.status == 200, path
            return await resp.text()

    async def until(self, predicate: Callable[[dict], bool], timeout_s: float, what: str) -> dict:
        st: dict | None = None
        for _ in range(int(timeout_s / 0.25)):
            st = await self.state()
            if st is not None and predicate(st):
                return st
            await asyncio.sleep(0.25)
        log = (self.run_dir / "broker.log").read_text()[-2000:] if (self.run_dir / "broker.log").exists() else ""
        raise AssertionError(f"timed out after {timeout_s}s waiting for {what}; state {st}\nbroker log:\n{log}")

    async def stop_actors(self) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        for client in self.clients:
            await client.close()

    def kill(self) -> None:
        for proc in (self.learner, self.broker):
            if proc is not None:
                procs.stop(proc, 5)
        assert procs.marked(procs.RUN_ENV, str(self.run_dir)) == {}, "a process of the test outlived it"


@contextlib.asynccontextmanager
async def running(run_dir: Path, cfg: Config, step_s: float, steps: int, **where: object) -> AsyncIterator[Run]:
    """Broker, learner (a step every `step_s`) and actors (trajectories of `steps` steps), stopped on exit;
    `where`: Run's netns, hosts and weights."""
    run_dir.mkdir(parents=True, exist_ok=True)
    cfg.run.output_dir = str(run_dir)  # (the default names a new folder after the time)
    config_mod.save(cfg, run_dir / "config.yaml")
    run = Run(run_dir, steps, **where)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as run.http:
        try:
            await run.start(step_s)
            yield run
        finally:
            await run.stop_actors()
            run.kill()


MAX_BUFFERED, T = 48, 4


async def test_a_stalled_learner_stops_admission_and_the_broker_stays_bounded(tmp_path: Path) -> None:
    """SIGSTOP the learner: the groups already admitted finish, then no more are admitted (the memory bound,
    broker.max_buffered_transitions; the staleness bound is set out of reach), the actors wait for groups, and
    the broker holds at most the bound plus what was in play; SIGCONT and the run goes on."""
    async with running(tmp_path / "run", config(MAX_BUFFERED, max_staleness=1000), step_s=0.05, steps=T) as run:
        st = await run.until(lambda st: st["learner"]["version"] >= 3, 30, "three learner steps")
        broker = psutil.Process(run.broker.pid)
        rss_before = broker.memory_info().rss
        os.kill(run.learner.pid, signal.SIGSTOP)
        samples: list[tuple[float, int, int, float, float]] = []
        try:
            for _ in range(60):  # 8 s at least, until the actors sent nothing for 4 s (at most 30 s)
                await asyncio.sleep(0.5)
                st = await run.state()
                assert st is not None
                g = st["gauges"]
                samples.append(
                    (
                        g["buffered_transitions"],
                        run.sent,
                        broker.memory_info().rss,
                        g["group_waiters"],
                        st["learner"]["version"],
                    )
                )
                if len(samples) >= 16 and len({s[1] for s in samples[-8:]}) == 1:
                    break
            paused_version = st["learner"]["version"]
        finally:
            os.kill(run.learner.pid, signal.SIGCONT)
        buffered, sent, rss, waiters, versions = (list(x) for x in zip(*samples))
        print(
            f"stalled learner: {len(samples) / 2:.1f}s paused, buffered max {max(buffered):.0f}, broker RSS "
            f"{rss_before / 2**20:.1f} MiB before, {max(rss) / 2**20:.1f} MiB peak, {rss[-1] / 2**20:.1f} MiB after"
        )
        assert len(set(sent[-8:])) == 1, f"the actors kept sending while the learner was stopped: {sent}"
        assert len(set(versions)) == 1, versions  # the learner really was stopped
        # Admission stops once MAX_BUFFERED are held; each group in play may still add G x T.
        assert max(buffered) <= MAX_BUFFERED + ACTORS * PARALLEL * G * T, buffered
        assert waiters[-1] == ACTORS * PARALLEL  # every episode loop idles, waiting for a group
        assert max(rss) - rss_before < 16 * 2**20, (rss_before, rss)
        await run.until(lambda st: st["learner"]["version"] >= paused_version + 3, 30, "learner steps after SIGCONT")
        await run.stop_actors()
        summary = await run.get("/api/summary")
    s = json.loads(summary)
    check_accounting(s)
    assert s["transitions_trained"] > 0 and s["transitions_sent"] >= run.acked_by_clients() > 0


def mount_tmpfs(folder: Path, size: str) -> None:
    folder.mkdir(parents=True)
    res = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)], capture_output=True, text=True
    )
    if res.returncode != 0:
        pytest.skip(
            f"cannot mount a tmpfs here ({res.stderr.strip() or res.returncode}): the full-disk test needs "
            "root (or CAP_SYS_ADMIN)"
        )


ROOM = 48 * 1024  # what the ballast leaves free on the log's tmpfs


async def test_a_full_disk_stops_acknowledgements_loses_nothing_and_recovers(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    wal = run_dir / "broker-wal"
    mount_tmpfs(wal, "2m")
    try:
        ballast = wal / "ballast"
        free = os.statvfs(wal).f_bavail * os.statvfs(wal).f_frsize
        ballast.write_bytes(bytes(free - ROOM))
        async with running(run_dir, config(10_000, max_staleness=2), step_s=0.05, steps=16) as run:
            st = await run.until(lambda st: st["run"]["status"] == "stalled", 30, "the broker stalled on the full disk")
            assert "No space left on device" in st["run"]["reason"], st["run"]
            metrics = await run.get("/metrics")
            assert "agentstream_wal_failing 1.0" in metrics and "agentstream_wal_write_errors_total" in metrics
            # The actors back off: they fill their unacknowledged windows (an episode loop between groups waits
            # for a grant instead), then wait; nothing more is acknowledged, nothing more is sent.
            for _ in range(40):
                if any(c.unacked == MAX_UNACKED for c in run.clients):
                    break
                await asyncio.sleep(0.25)
            acked, sent, version = run.acked_by_clients(), run.sent, st["learner"]["version"]
            await asyncio.sleep(3)
            st = await run.until(lambda st: True, 5, "the dashboard")
            assert (run.acked_by_clients(), run.sent) == (acked, sent)
            assert max(c.unacked for c in run.clients) == MAX_UNACKED, [c.unacked for c in run.clients]
            assert st["run"]["status"] == "stalled" and st["learner"]["version"] == version
            assert "cannot be written" in (run_dir / "broker.log").read_text()

            ballast.unlink()  # space returns
            await run.until(
                lambda st: st["run"]["status"] == "running" and st["learner"]["version"] >= version + 3,
                30,
                "the run going on once the disk had room",
            )
            assert run.acked_by_clients() > acked
            assert "agentstream_wal_failing 0.0" in await run.get("/metrics")
            await run.stop_actors()
            procs.stop(run.learner, 5)  # nothing changes the state from here on
            run.learner = None
            before = json.loads(await run.get("/api/summary"))
            check_accounting(before)
            assert before["reliability"]["wal_write_errors"] > 0
            # A kill -9 now: the log holds everything acknowledged, and nothing the failed writes left behind.
            run.broker.send_signal(signal.SIGKILL)
            run.broker.wait()
            await run.start_broker()
            after = json.loads(await run.get("/api/summary"))
        rel = after["reliability"]
        print(
            f"full disk: {before['reliability']['wal_write_errors']} failed writes; acknowledged "
            f"{before['reliability']['transitions_acked']} before the kill, {rel['transitions_acked']} recovered"
        )
        assert rel["wal_torn_bytes"] == 0 and rel["wal_events_recovered"] > 0
        assert rel["transitions_acked"] == before["reliability"]["transitions_acked"] >= run.acked_by_clients()
        fields = ("transitions_ingested", "transitions_trained", "transitions_buffered", "transitions_dropped")
        assert {k: after[k] for k in fields} == {k: before[k] for k in fields}
        check_accounting(after)
    finally:
        subprocess.run(["umount", "-l", str(wal)], capture_output=True)


@dataclass(frozen=True)
class Namespace:
    """A network namespace this test made, joined to this one by two veth pairs: `cut_ip` (the far end of the
    pair that `cut` partitions) and `kept_ip` (the other's, which stays up). Traffic only ever crosses these
    pairs or a loopback device."""

    name: str
    near: str  # this namespace's end of the pair that is cut
    cut_ip: str
    kept_ip: str

    def cut(self) -> None:
        """Drop every packet either end of the pair sends: a pfifo queue of 0 packets (tc) on both ends (this
        kernel has no netem and iptables is not installed; the effect is the same, the link stays up)."""
        drop_all = ["root", "pfifo", "limit", "0"]
        for argv in (
            ["tc", "qdisc", "add", "dev", self.near, *drop_all],
            ["ip", "netns", "exec", self.name, "tc", "qdisc", "add", "dev", "far0", *drop_all],
        ):
            subprocess.run(argv, check=True, capture_output=True)

    def heal(self) -> None:
        for argv in (
            ["tc", "qdisc", "del", "dev", self.near, "root"],
            ["ip", "netns", "exec", self.name, "tc", "qdisc", "del", "dev", "far0", "root"],
        ):
            subprocess.run(argv, check=True, capture_output=True)


@contextlib.contextmanager
def namespace() -> Iterator[Namespace]:
    name, tag, octet = f"agentstream-{os.getpid()}", f"as{os.getpid() % 10**6}", 1 + os.getpid() % 250
    made = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
    if made.returncode != 0:
        pytest.skip(
            f"cannot make a network namespace here ({made.stderr.strip() or made.returncode}): the "
            "partition test needs root (CAP_SYS_ADMIN and CAP_NET_ADMIN)"
        )
    inside = ["ip", "netns", "exec", name]
    try:
        for i in (0, 1):  # 10.213.<octet>.0/30 (cut) and .4/30 (kept): addresses of these pairs only
            near, base = f"{tag}n{i}", 4 * i
            for argv in (
                ["ip", "link", "add", near, "type", "veth", "peer", "name", f"far{i}", "netns", name],
                ["ip", "addr", "add", f"10.213.{octet}.{base + 1}/30", "dev", near],
                ["ip", "link", "set", near, "up"],
                [*inside, "ip", "addr", "add", f"10.213.{octet}.{base + 2}/30", "dev", f"far{i}"],
                [*inside, "ip", "link", "set", f"far{i}", "up"],
            ):
                subprocess.run(argv, check=True, capture_output=True)
        subprocess.run([*inside, "ip", "link", "set", "lo", "up"], check=True, capture_output=True)
        yield Namespace(name, f"{tag}n0", f"10.213.{octet}.2", f"10.213.{octet}.6")
    finally:
        for i in (0, 1):
            subprocess.run(["ip", "link", "del", f"{tag}n{i}"], capture_output=True)  # (and its far end)
        subprocess.run(["ip", "netns", "del", name], capture_output=True)


def actor_row(st: dict, name: str) -> dict:
    return next(a for a in st["actors"] if a["name"] == name)


def engine_row(st: dict, name: str) -> dict | None:
    return next((e for e in st["engines"] if e["name"] == name), None)


HEARTBEAT_S, PARTITION_S = 3.0, 8.0


@pytest.mark.e2e
async def test_a_partitioned_host_is_declared_gone_then_rejoins_and_nothing_is_trained_twice(
    tmp_path: Path, spare_engine
) -> None:
    """The broker and the learner in a network namespace; in this one, actor-0 and an engine's weight sidecar
    (the session's spare vLLM server) reach them over the link that is cut, actor-1 over the one that stays up.
    For PARTITION_S (> broker.heartbeat_timeout_s) every packet on the cut link is dropped: the run goes on with
    actor-1, the broker declares actor-0 and the engine gone (actor-0's open groups dropped as `actor_silent`),
    and the learner's new weights wait. Once it heals, actor-0's resent transitions of the dropped groups are
    acknowledged and rejected (counted), it plays new groups, and the engine catches up to the learner's
    weights; the accounting holds and no key is settled twice."""
    cfg = config(10_000, max_staleness=1000)  # admission never waits for the cut engine: only heartbeats decide
    cfg.broker.heartbeat_timeout_s, cfg.broker.host, cfg.broker.dashboard_host = HEARTBEAT_S, "0.0.0.0", "0.0.0.0"
    cfg.broker.allow_insecure_bind = True  # (bound in the test's own namespace: its loopback and the two pairs)
    weights = free_port()
    with namespace() as ns:
        where = dict(
            netns=ns.name,
            hosts=(ns.cut_ip, ns.kept_ip),
            weights=(f"tcp://*:{weights}", str(Path(spare_engine.model) / "model.safetensors")),
        )
        async with running(tmp_path / "run", cfg, step_s=0.3, steps=T, **where) as run:
            sidecar = procs.start(
                [
                    sys.executable,
                    "-m",
                    "engines.sidecar",
                    "--name",
                    "engine-p",
                    "--url",
                    spare_engine.url,
                    "--learner",
                    f"tcp://{ns.cut_ip}:{weights}",
                    "--broker",
                    f"tcp://{ns.cut_ip}:{run.port}",
                    "--stats-interval",
                    "0.5",
                    "--workdir",
                    str(tmp_path / "sidecar"),
                ],
                tmp_path / "sidecar.log",
                env=run.marker,
                cwd=ROOT,
            )
            try:
                st = await run.until(
                    lambda st: (
                        st["learner"]["version"] >= 3
                        and (e := engine_row(st, "engine-p")) is not None
                        and e["version"] >= 1
                    ),
                    90,
                    "the engine serving the learner's weights",
                )
                before = {c.name: c.counters["transitions_resent"] for c in run.clients}
                ns.cut()
                cut_at, cut_version = asyncio.get_running_loop().time(), st["learner"]["version"]
                try:
                    st = await run.until(
                        lambda st: (
                            not actor_row(st, "actor-0")["alive"]
                            and not engine_row(st, "engine-p")["alive"]
                            and st["learner"]["version"] >= cut_version + 3
                        ),
                        PARTITION_S + 20,
                        "actor-0 and the engine declared gone while the run goes on with actor-1",
                    )
                    acks_cut = run.clients[0].counters["acks"]  # (seconds after the cut: any ack in flight is in)
                    await asyncio.sleep(max(0.0, cut_at + PARTITION_S - asyncio.get_running_loop().time()))
                    st = await run.until(lambda st: True, 5, "the dashboard, over the link that stays up")
                    healed_version, acks = st["learner"]["version"], run.clients[0].counters["acks"]
                    # actor-0 sent until its window filled or each of its PARALLEL groups was sent (its next grant
                    # is cut off too), and nothing came back: how many are unacknowledged depends on where the cut
                    # fell in its groups.
                    assert acks == acks_cut and 0 < run.clients[0].unacked <= MAX_UNACKED
                    assert st["learner"]["version"] >= cut_version + 5, (cut_version, st["learner"])
                    assert engine_row(st, "engine-p")["version"] <= cut_version  # its new weights are cut off
                finally:
                    ns.heal()
                st = await run.until(
                    lambda st: (
                        actor_row(st, "actor-0")["alive"]
                        and (e := engine_row(st, "engine-p")) is not None
                        and e["version"] >= healed_version
                    ),
                    60,
                    "actor-0 back and the engine at the weights published during the partition",
                )
                c0 = run.clients[0]  # its resent transitions (go-back-N, every ack_timeout_s) acknowledged at last:
                await run.until(
                    lambda st: (
                        c0.counters["acks"] > acks
                        and c0.unacked < MAX_UNACKED
                        and st["learner"]["version"] >= healed_version + 3
                    ),
                    30,
                    "actor-0's sends acknowledged",
                )
                await run.stop_actors()
                resent = {c.name: c.counters["transitions_resent"] - before[c.name] for c in run.clients}
                summary = json.loads(await run.get("/api/summary"))
            finally:
                procs.stop(sidecar, 10)
                # The shared server as the next test expects it: the model's own weights (all this test published),
                # labelled version 0 as a server no sidecar touched (tests/engines/test_engines_vllm.py).
                async with run.http.post(spare_engine.url + "/update_weight_version", json={"new_version": "0"}) as r:
                    assert r.status == 200, await r.text()
    print(
        f"partition: resent {resent}; dropped {summary['transitions_dropped']}; rejected "
        f"{summary['reliability']['transitions_rejected']}"
    )
    check_accounting(summary)
    assert resent["actor-0"] > 0 and resent["actor-1"] == 0
    # actor-0's groups open at the broker when it was declared silent are dropped, and its resent transitions of them
    # refused as unknown_group. Whether any was open then depends on timing (a clean-clone run had none): only
    # silence may drop anything here, and a drop implies the refusals.
    assert set(summary["transitions_dropped"]) <= {"actor_silent"}, summary["transitions_dropped"]
    if summary["transitions_dropped"].get("actor_silent", 0):
        assert summary["reliability"]["transitions_rejected"].get("unknown_group", 0) > 0
    assert "actor-0 silent" in (tmp_path / "run" / "broker.log").read_text()
    # The sidecar's connection to the learner either ended in the partition and was made again (the sidecar then asks
    # for the newest weights), or came through the 8 s cut whole (TCP retransmits; the ZMTP heartbeat timeout is 30 s;
    # one clean-clone run saw this): either way the engine reached the weights published meanwhile (checked above).
    reconnected = "connected to the learner again" in (tmp_path / "sidecar.log").read_text()
    print(f"partition: the sidecar's connection to the learner was {'made again' if reconnected else 'kept'}")
