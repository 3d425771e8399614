"""An actor process: K episodes at once on one asyncio loop, G per group, streaming every step.

    python -m actors.actor --config RUN/config.yaml --name actor-0 --incarnation 0 \
        --broker tcp://127.0.0.1:5555 --engine http://127.0.0.1:8000 [--engine ...]

Per step (the data flow env -> memory -> engine -> actor -> broker): the memory module builds the chat
prompt; the chat template turns it into token ids; an engine samples response ids with their log-probs
and the policy-version interval that produced them; the env's parser turns the text into an action (an
unparseable answer is an invalid action: the game does not move and the step gets the configured
penalty); the env steps; the transition goes to the broker. Episodes never wait for one another.
SIGTERM: stop starting steps, send the final stats, exit.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import itertools
import logging
import os
import random
import signal
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp
import numpy as np

import envs
import memory
from agentstream import config as config_mod
from agentstream.config import Config
from broker.client import AsyncClient
from broker.protocol import GroupGrant, Hello, Stats, Transition
from engines.client import EngineClient, EngineError, Generation
from engines.server import base_model_name, served_model_name
from envs.latency import sample_latency

log = logging.getLogger("actor")


@dataclass
class EpisodeResult:
    steps: int
    total_reward: float
    success: bool


class Actor:
    """Runs K episode lanes; each takes the next episode of the groups the broker granted this actor."""

    def __init__(self, cfg: Config, name: str, incarnation: int, broker: AsyncClient, engines: list[EngineClient],
                 tokenizer):
        self.cfg, self.name, self.incarnation = cfg, name, incarnation
        self.broker, self.engines, self.tokenizer = broker, engines, tokenizer
        self.counters: Counter[str] = Counter()
        self.in_flight = 0
        self.requests_in_flight = 0  # dashboard gauges: engine requests awaited now, newest policy version seen
        self.policy_version = -1
        self._engine_rr = itertools.count()  # round robin over self.engines, which may grow (follow_engines)
        self._engine_down: dict[str, float] = {}  # url -> when a request to it last failed
        self._latency_rng = random.Random(f"{cfg.run.seed}/{name}/{incarnation}")  # env.step_latency_*
        # Episodes of granted groups not yet started: (grant, index in the group, the group's engine).
        self._pending: collections.deque[tuple[GroupGrant, int, EngineClient]] = collections.deque()
        self._open: dict[int, int] = {}  # group id -> its episodes not yet finished
        self._deal = asyncio.Condition()
        # At most K/G + 1 groups in play: one group ahead of the K/G that K lanes fill, so a lane whose group's
        # other episodes still run starts the next group instead of idling, while what a paused learner lets
        # pile up in the broker stays bounded (K/G + 1 groups of G episodes per actor).
        self.max_open_groups = cfg.actors.episodes_per_actor // cfg.env.group_size + 1

    async def run(self) -> None:
        """Play groups until cancelled: K = actors.episodes_per_actor lanes, one episode each at a time.

        Episodes of one group end at different steps (a hole at step 1, the goal at step 9); a lane that ends
        its episode takes the next one at once, from the next group if its own has none left to start, so K
        requests stay in flight instead of K minus the episodes that wait for their group's slowest."""
        async with asyncio.TaskGroup() as tg:
            tg.create_task(self._report_loop())
            for _ in range(self.cfg.actors.episodes_per_actor):
                tg.create_task(self._lane())

    async def _lane(self) -> None:
        while True:
            grant, i, engine = await self._next_episode()
            try:
                await self.play(grant, f"{self.name}.{self.incarnation}.g{grant.group_id}.{i}", engine)
            finally:
                async with self._deal:
                    self._open[grant.group_id] -= 1
                    if not self._open[grant.group_id]:
                        del self._open[grant.group_id]
                    self._deal.notify_all()

    async def _next_episode(self) -> tuple[GroupGrant, int, EngineClient]:
        """The next episode to play: an unstarted one of a granted group, else the first of a new group (one
        grant request at a time, made while fewer than max_open_groups are in play)."""
        async with self._deal:
            await self._deal.wait_for(lambda: bool(self._pending) or len(self._open) < self.max_open_groups)
            if not self._pending:
                grant = await self.broker.request_group()  # others wait on the lock: this grant may serve them
                engine = self.engines[next(self._engine_rr) % len(self.engines)]
                self._open[grant.group_id] = self.cfg.env.group_size
                self._pending.extend((grant, i, engine) for i in range(self.cfg.env.group_size))
            return self._pending.popleft()

    async def play(self, grant: GroupGrant, traj_id: str, engine: EngineClient) -> EpisodeResult:
        """One episode from the group's seed to done/truncated; every step goes to the broker."""
        env_cfg = self.cfg.env
        env = envs.make(env_cfg.name, max_steps=env_cfg.max_steps, **env_cfg.kwargs)
        mem_cfg = self.cfg.memory
        budget = mem_cfg.max_prompt_tokens or self.cfg.engines.max_model_len - self.cfg.sampling.max_tokens
        mem = memory.make(mem_cfg.kind, k=mem_cfg.k, max_events=mem_cfg.max_events, tokenizer=self.tokenizer,
                          max_prompt_tokens=budget)
        # Java- or subprocess-backed games block: their calls go to a thread so other episodes keep going.
        blocking = bool(getattr(env, "blocking", False))
        obs, info = await asyncio.to_thread(env.reset, seed=grant.seed) if blocking else env.reset(seed=grant.seed)
        mem.reset(env.instructions)
        self.in_flight += 1
        total, step = 0.0, 0
        try:
            while True:
                # GiGPO's step groups gather the steps taken from the same state: the anchor of `obs`, the state
                # the action is chosen in (not of the state it leads to).
                anchor = str(info.get("anchor", ""))
                prompt_ids = mem.fitter.token_ids(mem.messages(obs))
                self.requests_in_flight += 1
                try:
                    gen, engine = await self._generate(prompt_ids, engine)
                finally:
                    self.requests_in_flight -= 1
                self.policy_version = max(self.policy_version, gen.version_hi)
                outcome = await asyncio.to_thread(env.step, gen.text) if blocking else env.step(gen.text)
                if env_cfg.step_latency_mean_s:  # simulated tool/web latency (benchmarks); never blocks the loop
                    await asyncio.sleep(sample_latency(self._latency_rng, env_cfg.step_latency_mean_s,
                                                       env_cfg.step_latency_sigma))
                next_obs, reward, terminated, truncated, info = outcome
                valid = bool(info.get("valid", True))
                env_reward = float(reward)
                reward = env_reward + (0.0 if valid else self.cfg.trainer.invalid_action_penalty)
                await self.broker.send_transition(Transition(
                    traj_id=traj_id, group_id=grant.group_id, actor=self.name, step=step,
                    prompt_ids=np.asarray(prompt_ids, dtype=np.int32), response_ids=gen.response_ids,
                    logprobs=gen.logprobs, version_lo=max(gen.version_lo, grant.min_version),
                    version_hi=max(gen.version_hi, grant.min_version), reward=reward, done=bool(terminated),
                    truncated=bool(truncated), valid=valid, anchor=anchor,
                    info={"success": bool(info.get("success", False))},
                ))
                self._count_step(len(gen.response_ids), valid)
                total += reward
                mem.record(obs, gen.text, reward=env_reward, info=info)
                obs, step = next_obs, step + 1
                if terminated or truncated:
                    success = bool(info.get("success", False))
                    self.counters.update(episodes=1, successes=int(success))
                    self.counters["episode_return_sum"] += total
                    return EpisodeResult(step, total, success)
        finally:
            self.in_flight -= 1
            self.counters.update(memory_dropped_steps=mem.dropped_steps, memory_truncated_steps=mem.truncated_steps)
            env.close()

    async def _generate(self, prompt_ids: list[int], engine: EngineClient) -> tuple[Generation, EngineClient]:
        """Generate on `engine`; if it fails (dead, unreachable, timed out), move to another engine and retry
        (counted as engine_failovers) until engines.request_timeout_s has passed without any answer.
        Returns the generation and the engine that answered (the episode stays with it)."""
        deadline = time.monotonic() + self.cfg.engines.request_timeout_s
        while True:
            try:
                return await engine.generate(prompt_ids, self.cfg.sampling), engine
            except EngineError as exc:
                self.counters["engine_failovers"] += 1
                self._engine_down[engine.url] = time.monotonic()
                if time.monotonic() > deadline:
                    raise
                up = [e for e in self.engines if time.monotonic() - self._engine_down.get(e.url, -1e9) > 10.0]
                log.warning("%s: %s; moving to %s", self.name, exc, "another engine" if up else "the first to recover")
                if not up:
                    await asyncio.sleep(1.0)
                    up = self.engines
                engine = up[next(self._engine_rr) % len(up)]

    def _count_step(self, n_tokens: int, valid: bool) -> None:
        self.counters.update(env_steps=1, transitions_sent=1, tokens_generated=n_tokens,
                             invalid_actions=0 if valid else 1)

    def stats(self, final: bool = False) -> Stats:
        # This actor plays one env: its outcome counters, again under env/<name>/ (broker.stats.env_outcomes).
        per_env = {f"env/{self.cfg.env.name}/{k}": self.counters[k] for k in
                   ("episodes", "successes", "episode_return_sum", "env_steps", "invalid_actions")}
        delivery = {k: float(v) for k, v in self.broker.counters.items()}  # resends after a broker restart
        return Stats(source=self.name, role="actor", counters={**self.counters, **per_env, **delivery},
                     gauges={"episodes_in_flight": self.in_flight, "incarnation": self.incarnation,
                             "unacked_transitions": self.broker.unacked,
                             "requests_in_flight": self.requests_in_flight, "policy_version": self.policy_version},
                     final=final)

    async def _report_loop(self) -> None:
        while True:
            await self.broker.send(self.stats())
            await asyncio.sleep(self.cfg.run.log_interval_s)


async def engines_from_broker(broker: AsyncClient) -> list[str]:
    """The engine URLs of the broker's first Welcome that lists any (an actor joining a running run)."""
    while True:
        welcome = await broker.welcomes.get()
        if welcome.engines:
            return list(welcome.engines)
        log.info("the broker knows no usable engine yet; waiting for one to register")


async def follow_engines(broker: AsyncClient, actor: Actor, client: Callable[[str], EngineClient]) -> None:
    """Engines that join later (launch.py role=engines): the broker sends a new Welcome once one serves recent
    weights; new episodes' groups go to it too (round robin). Engines are never removed from the list."""
    while True:
        welcome = await broker.welcomes.get()
        known = {e.url for e in actor.engines}
        for url in welcome.engines:
            if url.rstrip("/") not in known:
                actor.engines.append(client(url))
                log.info("%s: engine %s joined; now using %d engines", actor.name, url, len(actor.engines))


async def _main(args: argparse.Namespace) -> int:
    from transformers import AutoTokenizer

    cfg = config_mod.load(args.config)
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
    broker = AsyncClient(args.broker, name=args.name, curve_keys_dir=cfg.broker.curve_keys_dir)  # security: CURVE
    await broker.start(args.incarnation, cfg.actors.max_unacked, cfg.actors.ack_timeout_s)
    await broker.send(Hello(role="actor", name=args.name, incarnation=args.incarnation, pid=os.getpid(),
                            want_welcome=True))  # the broker's Welcome lists the engines (and later joiners)
    timeout = aiohttp.ClientTimeout(total=cfg.engines.request_timeout_s)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        names = {"model": served_model_name(cfg.model), "base_model": base_model_name(cfg.model)}  # LoRA: the adapter
        def client(url: str) -> EngineClient:
            return EngineClient(url, session, cfg.engines.request_timeout_s, **names)

        engines = [client(url) for url in args.engine or await engines_from_broker(broker)]
        actor = Actor(cfg, args.name, args.incarnation, broker, engines, tokenizer)
        follower = asyncio.create_task(follow_engines(broker, actor, client))  # engines that join later
        task = asyncio.current_task()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, task.cancel)  # type: ignore[union-attr]
        code = 0
        try:
            await actor.run()
        except asyncio.CancelledError:
            log.info("%s: stopping (signal)", args.name)
        except ExceptionGroup as group:  # an episode failed: say which error, exit non-zero (restarted)
            log.error("%s: episode failed: %r", args.name, group.exceptions[0])
            code = 3
        finally:
            follower.cancel()
            with contextlib.suppress(Exception):
                await broker.drain(cfg.run.shutdown_timeout_s / 2)  # what was sent is acknowledged, or counted
                await broker.send(actor.stats(final=True))
            await broker.close()
    return code


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="run config written by the launcher")
    parser.add_argument("--name", required=True, help="actor name (its identity at the broker)")
    parser.add_argument("--incarnation", type=int, default=0, help="how many times this actor was restarted")
    parser.add_argument("--broker", required=True, help="broker ZeroMQ address")
    parser.add_argument("--engine", action="append", default=[],
                        help="engine base URL (repeatable); none: learn them from the broker. Engines that join "
                             "later (role=engines) are used too")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    started = time.time()
    code = asyncio.run(_main(args))
    log.info("%s: exit %d after %.1fs", args.name, code, time.time() - started)
    raise SystemExit(code)


if __name__ == "__main__":
    main()
