"""Faults outside the model, injected for real into an actor (actors/actor.py, the class the actor process runs)
playing against a broker on real ZeroMQ sockets (broker.server.Broker in this test's event loop, as in
tests/broker/test_server.py) and real vLLM servers (the session's `tiny_engine`, tests/conftest.py):

- a stalled engine: the session's second vLLM server (`spare_engine`, shared with tests/engines/test_engines_vllm.py)
  is stopped with SIGSTOP (its whole process group: API server and engine core) and resumed with SIGCONT: the
  actor's requests leave it within engines.stall_timeout_s plus a probe, go to the other engine (`tiny_engine`,
  never stopped), and the server serves new requests again once resumed.
- a hung or failing env step (a sandboxed tool env in the shape of SkyRL-Gym's: blocking, run in a thread): a step
  that never returns (it blocks on an event the test sets only at its end) fails its episode after
  env.step_timeout_s, and the episode is played again on the same seed; a step that raises on every attempt has its
  group dropped whole after actors.episode_retries; both counted by cause on the dashboard and in /metrics.

Each ends with the chaos test's accounting (acknowledged = ingested + rejected, ingested = trained + buffered +
dropped by reason, per delivery key nothing settled twice) and checks that no process it started is left.

    .venv/bin/python -m pytest tests/actors/test_faults.py -q
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import re
import signal
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import pytest
from e2e_testing import broker_and_client, check_accounting

from actors.actor import Actor
from actors.episode import EnvCalls, TooManyHungSteps
from actors.spec import ActorSpec, EpisodeSpec
from agentstream.config import Config
from agentstream.wire.addresses import free_port
from broker.server import Broker
from engines.client import EngineClient
from envs.base import Action, ParseResult, StepResult, TextGame

RELEASE = threading.Event()  # what a hung env step waits for: set when the test ends, so no thread outlives it
HUNG_SEEDS: set[int] = set()  # seeds whose step already hung once (class-independent: each attempt is a new env)


class Sandbox(TextGame):
    """A tool env: every answer "runs" in a sandbox (blocking, as SkyRL-Gym's sandboxes are); `max_steps` steps,
    never ended early. At its second step, a seed in `hang` blocks the first time it is played (a call that never
    returns), a seed in `fail` raises every time (an unreachable sandbox)."""

    metadata = {"render_modes": []}
    blocking = True
    instructions = "Write a shell command; it runs in a sandbox."

    def __init__(self, max_steps: int = 3, hang: tuple[int, ...] = (), fail: tuple[int, ...] = ()):
        self.max_steps, self.hang, self.fail = max_steps, hang, fail
        self._seed: int | None = None
        self._steps = 0

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[str, dict[str, Any]]:
        self._seed, self._steps = seed, 0
        return "$ ", self._info()

    def _started(self) -> bool:
        return self._seed is not None

    def _parse(self, action: str) -> ParseResult:
        return Action(action)

    def _invalid(self) -> tuple[str, dict[str, Any]]:
        return "$ ", {**self._info(), "valid": False}

    def _step(self, value: Any) -> StepResult:
        if self._steps == 2:  # (counted before _step: the second step)
            if self._seed in self.fail:
                raise ConnectionError(f"sandbox for seed {self._seed} unreachable")
            if self._seed in self.hang and self._seed not in HUNG_SEEDS:
                HUNG_SEEDS.add(self._seed)
                RELEASE.wait(600)
        return f"ran step {self._steps}\n$ ", float(self._steps), False, False, self._info()

    def _info(self) -> dict[str, Any]:
        return {"valid": True, "success": False, "anchor": f"step {self._steps}"}

    def close(self) -> None:
        self._seed = None


@dataclasses.dataclass(frozen=True)
class SandboxEpisodes(EpisodeSpec):
    hang: tuple[int, ...] = ()
    fail: tuple[int, ...] = ()

    def make_env(self) -> Sandbox:
        return Sandbox(self.env.max_steps, self.hang, self.fail)


def config(**over: Any) -> Config:
    cfg = Config()
    cfg.env.group_size, cfg.actors.episodes_per_actor = 2, 4
    cfg.trainer.groups_per_step, cfg.trainer.max_staleness = 1, 10_000  # no learner here: admission never waits
    cfg.learner.world_size = 1
    cfg.broker.track_keys = True
    cfg.broker.logger = []
    cfg.run.log_interval_s = 0.2
    cfg.sampling.max_tokens = 8
    for key, value in over.items():
        section, name = key.split("__")
        setattr(getattr(cfg, section), name, value)
    return cfg


@dataclasses.dataclass
class Run:
    actor: Actor
    broker: Broker
    task: asyncio.Task
    http: aiohttp.ClientSession
    dashboard: int

    async def until(self, predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while not predicate():
            if self.task.done():
                self.task.result()  # the actor failed: say why
                raise AssertionError(f"the actor stopped while waiting for {what}")
            assert time.monotonic() < deadline, (
                f"timed out after {timeout_s}s waiting for {what}: {dict(self.actor.counters)}"
            )
            await asyncio.sleep(0.2)

    async def metrics(self) -> str:
        async with self.http.get(f"http://127.0.0.1:{self.dashboard}/metrics") as resp:
            assert resp.status == 200
            return await resp.text()


@contextlib.asynccontextmanager
async def actor_run(cfg: Config, spec: ActorSpec, engine_urls: list[str]) -> AsyncIterator[Run]:
    """A broker (this loop) and one actor (this loop) playing on `engine_urls`; stopped on exit (the actor sends its
    final stats, as a stopping actor process does)."""
    from transformers import AutoTokenizer

    dashboard = free_port()
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
    async with (
        broker_and_client(cfg, dashboard) as (broker, client),
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=cfg.engines.request_timeout_s)) as session,
    ):
        engines = [EngineClient(url, session, cfg.engines.request_timeout_s) for url in engine_urls]
        actor = Actor(spec, "actor-0", 0, client, engines, tokenizer)
        task = asyncio.create_task(actor.run())
        try:
            yield Run(actor, broker, task, session, dashboard)
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            await client.drain(5)
            await client.send(actor.stats(final=True))
            await asyncio.sleep(0.3)  # (the broker takes the final stats: the actor's open groups are settled)


def metric(text: str, name: str) -> float:
    match = re.search(rf"^agentstream_{name} (\S+)$", text, re.M)
    assert match, f"{name} not in /metrics"
    return float(match.group(1))


HANG_SEED, FAIL_SEED = 0, 1  # groups 0 and 1 (the broker's seeds are run.seed * 1_000_003 + group id; run.seed = 0)


async def test_a_hung_or_failing_env_step_retries_the_episode_then_drops_its_group(tiny_engine) -> None:
    model, url = tiny_engine
    retries = 2
    cfg = config(env__max_steps=3, env__step_timeout_s=1.0, actors__episode_retries=retries)
    cfg.model.path = model
    base = ActorSpec.from_config(cfg)
    episodes = SandboxEpisodes(**vars(base.episode), hang=(HANG_SEED,), fail=(FAIL_SEED,))
    spec = dataclasses.replace(base, episode=episodes)
    RELEASE.clear()
    HUNG_SEEDS.clear()
    try:
        async with actor_run(cfg, spec, [url]) as run:
            b = run.broker.buffer
            await run.until(
                lambda: (
                    b.counts["groups_completed"] >= 4
                    and b.counts["groups_dropped_infra_raised"] == 1
                    and run.actor.counters["infra_failures_timeout"] == 1
                    and any(g.group_id == 0 for g in b.ready)
                ),  # its retry, the last to end, ended too
                60,
                "4 groups and group 0 complete, group 1 dropped",
            )
            c = run.actor.counters
            # Group 0: the episode whose second step hung was played again (.r1) and the group is whole: G
            # trajectories of 3 steps, the retry in the hung attempt's place, nothing of the hung attempt.
            group0 = next(g for g in b.ready if g.group_id == 0)
            assert len(group0.trajectories) == 2 and sum(t.endswith(".r1") for t in group0.trajectories) == 1
            assert all(sorted(s.step for s in steps) == [0, 1, 2] for steps in group0.trajectories.values())
            assert b.counts["transitions_dropped_infra_timeout"] == 2  # its 1 sent step + its abandon marker
            assert run.actor.env_calls.hung == 1 and run.actor.stats().gauges["env_steps_hung"] == 1  # still stuck
            # Group 1: every attempt raised at step 2; after `retries` retries the group was dropped whole.
            assert 1 not in b.open and all(g.group_id != 1 for g in b.ready)
            assert retries + 1 <= c["infra_failures_raised"] <= 2 * (retries + 1)
            assert c["infra_failures"] == c["infra_failures_raised"] + c["infra_failures_timeout"]
            assert c["episode_retries"] >= retries + 1 and c["infra_failures_engine"] == 0
            # Both counters: the raised ones end before the timed-out retry does, so a report can hold all of them
            # and none of that one.
            await run.until(
                lambda: all(
                    run.broker.snapshot()["counters"].get(k, 0) == run.actor.counters[k]
                    for k in ("infra_failures_raised", "infra_failures_timeout")
                ),
                10,
                "the actor's stats at the broker",
            )
            text = await run.metrics()
            assert metric(text, "infra_failures_timeout_total") == 1
            assert metric(text, "infra_failures_raised_total") == c["infra_failures_raised"]
            assert metric(text, "transitions_dropped_infra_timeout_total") == 2
            assert metric(text, "groups_dropped_infra_raised_total") == 1
            RELEASE.set()  # the hung call returns at last: its thread ends, its answer is thrown away
            await run.until(lambda: run.actor.env_calls.hung == 0, 10, "the hung thread to end")
        s = run.broker.summary()
    finally:
        RELEASE.set()
    check_accounting(s)
    assert s["reliability"]["transitions_rejected"] == {}
    # More calls stuck than actors.max_hung_steps allows: the actor must exit (its restart ends the threads).
    stuck = threading.Event()
    calls = EnvCalls(timeout_s=0.05, max_hung=0)
    try:
        with pytest.raises(TooManyHungSteps):
            await calls.call(True, stuck.wait, 600)
    finally:
        stuck.set()


async def vllm_answered(http: aiohttp.ClientSession, url: str) -> float:
    """Requests the vLLM server finished with a stop or length (its own /metrics; aborted ones are not counted)."""
    async with http.get(f"{url}/metrics") as resp:
        text = await resp.text()
    return sum(
        float(m.group(2))
        for m in re.finditer(r"^vllm:request_success_total\{([^}]*)\} (\S+)$", text, re.M)
        if re.search(r'finished_reason="(stop|length)"', m.group(1))
    )


STALL_S = 8.0  # the SIGSTOP lasts 60 s; nothing in the mechanism depends on it beyond stall_timeout_s


async def test_a_stalled_engine_loses_its_requests_to_another_and_rejoins(tiny_engine, spare_engine) -> None:
    # engine B, the one stopped, is the session's spare server (tests/conftest.py), resumed before the test ends;
    # its own tiny model (the same architecture and tokenizer) answers as any other engine here
    model, url_a = tiny_engine
    cfg = config(env__max_steps=3, engines__stall_timeout_s=3.0, engines__request_timeout_s=60.0)
    cfg.env.name = "agentstream/FrozenLake-v0"
    cfg.model.path = model
    server, url_b = spare_engine.proc, spare_engine.url
    try:
        async with actor_run(cfg, ActorSpec.from_config(cfg), [url_b, url_a]) as run:
            c = run.actor.counters
            await run.until(lambda: c["episodes"] >= 4, 60, "episodes before the stall")
            # Engine B served its share. A loaded machine may take its first answers for stalls (harmless: they
            # moved to A, and B's aborted requests do not count), so this waits for one B finished.
            deadline = time.monotonic() + 60
            while await vllm_answered(run.http, url_b) == 0:
                assert time.monotonic() < deadline, f"engine B finished no request in 60 s: {dict(c)}"
                await asyncio.sleep(0.5)
            stalls = c["engine_stalls"]
            os.killpg(server.pid, signal.SIGSTOP)
            stopped = time.monotonic()
            try:
                episodes = c["episodes"]
                await run.until(lambda: c["engine_stalls"] > stalls, 30, "a stall detected")
                moved_s = time.monotonic() - stopped
                await run.until(lambda: c["episodes"] >= episodes + 4, 30, "episodes on engine A during the stall")
                # Well before the 60 s request timeout (the only limit before stall detection): 2 x 3 s plus slack.
                assert moved_s < cfg.engines.request_timeout_s / 2, moved_s
                await asyncio.sleep(max(0.0, STALL_S - (time.monotonic() - stopped)))
                assert run.actor.requests_in_flight <= cfg.actors.episodes_per_actor
            finally:
                os.killpg(server.pid, signal.SIGCONT)
            print(
                f"stalled engine: moved after {moved_s:.1f}s; {c['engine_stalls'] - stalls} stalls, "
                f"{c['engine_failovers']} failovers in all, {STALL_S:.0f}s stopped"
            )
            before = await vllm_answered(run.http, url_b)
            deadline = time.monotonic() + 30
            while await vllm_answered(run.http, url_b) <= before:  # B rejoins: it answers new requests
                assert time.monotonic() < deadline, "engine B was not used again after SIGCONT"
                await asyncio.sleep(0.5)
            # Every stalled request was retried on A: no episode failed, none was dropped.
            assert c["infra_failures"] == 0 and c["engine_failovers"] >= c["engine_stalls"] >= 1
            await run.until(
                lambda: run.broker.snapshot()["counters"].get("engine_stalls", 0) == c["engine_stalls"],
                10,
                "the actor's stats at the broker",
            )
            text = await run.metrics()
            assert metric(text, "engine_stalls_total") == c["engine_stalls"]
        s = run.broker.summary()
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.pid, signal.SIGCONT)
    check_accounting(s)
    assert s["reliability"]["transitions_rejected"] == {} and s["transitions_ingested"] > 0
