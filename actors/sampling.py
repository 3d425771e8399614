"""An actor's engine calls: which engine answers, failover when one fails or stalls, a group's shared first turn,
and the frozen seat's copy of the policy. The actor (actors/actor.py) holds one `Sampler`; each episode asks it
through an `EpisodeSampler`, the `generate` function of `actors.episode.play`/`play_match`.

    sampler = Sampler(engines, spec.client, spec.episode.sampling, spec.group_size, counters, name)
    generate = sampler.episode(engine, share_with=grant.group_id, frozen_seat=lambda seat: False)
    gen = await generate(turn)              # the episode stays with the engine that last answered it

Faults (docs/reliability.md): a request its engine leaves unanswered for engines.stall_timeout_s while a probe goes
unanswered too moves to another engine (engine_stalls); any engine failure moves the request (engine_failovers) until
engines.request_timeout_s has passed without an answer, and then raises EngineError for the actor to retry the episode.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from actors.episode import Turn
from actors.spec import ClientSpec
from agentstream.config import SamplingConfig
from agentstream.models import FROZEN_ADAPTER_NAME
from engines.client import EngineClient, EngineError, EngineStalled, Generation
from engines.pool import EnginePool

log = logging.getLogger("actor")


@dataclass
class _SharedTurn:
    """A group's first turn, sampled once for all its episodes (actors.share_first_turn): the answers of one request
    of n = group size, handed out in the order the episodes ask."""

    prompt_ids: list[int]
    answers: asyncio.Task[list[Generation]]
    taken: int = 0


class Sampler:
    """One actor's engine calls, shared by its episodes: the engines (the actor's list, which may grow), the pool
    that picks among them, the groups' shared first turns and the engines' frozen-copy clients."""

    def __init__(
        self,
        engines: list[EngineClient],
        client: ClientSpec,
        sampling: SamplingConfig,
        group_size: int,
        counters: Counter[str],
        name: str,
    ):
        self.engines, self.client, self.sampling, self.group_size = engines, client, sampling, group_size
        self.counters = counters  # the actor's: engine_failovers, engine_stalls
        self.name = name
        self.requests_in_flight = 0  # reported as gauges: engine requests awaited now, newest policy version seen
        self.policy_version = -1
        # An engine that failed or stalled gets no new request for 2 x stall_timeout_s; then it rejoins (if still
        # stalled, each request sent to it costs 2 x stall_timeout_s again, so this bounds that waste to about half
        # the time).
        self.pool = EnginePool(self.engines, down_s=2 * client.stall_timeout_s)
        self._first_turns: dict[int, _SharedTurn] = {}  # group id -> its shared first turn, while in play
        self._frozen_clients: dict[str, EngineClient] = {}  # engine url -> its client of the frozen copy (`_frozen`)

    def pick_engine(self) -> EngineClient:
        """The engine of a new group, or of a request moving off a failed one (`EnginePool.pick`)."""
        return self.pool.pick()

    def episode(
        self, engine: EngineClient, share_with: int | None, frozen_seat: Callable[[int], bool]
    ) -> EpisodeSampler:
        """The `generate` function of one episode that starts on `engine`. `share_with`: the group whose shared
        first turn answers the episode's first turn (None: it asks on its own); `frozen_seat(seat)`: whether that
        seat's turns are the frozen copy's."""
        return EpisodeSampler(self, engine, share_with, frozen_seat)

    async def generate(
        self,
        prompt_ids: list[int],
        engine: EngineClient,
        images: Sequence[np.ndarray] = (),
        group_id: int | None = None,
        frozen: bool = False,
    ) -> tuple[Generation, EngineClient]:
        """Generate on `engine`; if it fails (dead, unreachable, timed out) or stalls (`_answer`), move to another
        engine and retry (counted as engine_failovers; stalls also as engine_stalls) until engines.request_timeout_s
        has passed without any answer. A retry is a new sample of the same prompt, never a continuation of what the
        failed request may have produced. `group_id`: a first turn, answered from the group's shared request
        (`_shared_answer`) unless that fails (then each of its episodes retries on its own). `frozen`: a frozen seat's
        turn, sampled from the engine's frozen copy (`_frozen`). Returns the generation and the engine that answered
        (the episode stays with it)."""
        deadline = time.monotonic() + self.client.request_timeout_s
        while True:
            try:
                client = self._frozen(engine) if frozen else engine
                gen = None if group_id is None else await self._shared_answer(group_id, prompt_ids, client)
                return gen or (await self._answer(prompt_ids, client, images))[0], engine
            except EngineError as exc:
                group_id = None
                self.counters["engine_failovers"] += 1
                self.pool.failed(engine)
                if time.monotonic() > deadline:
                    raise
                engine = self.pick_engine()
                log.warning("%s: %s; moving to %s", self.name, exc, engine.url)
                if self.pool.is_down(engine):
                    await asyncio.sleep(1.0)  # every engine failed lately: wait for the first to recover

    def close_first_turn(self, group_id: int) -> None:
        """The group is over: its shared request, if still running, is cancelled (no episode waits for it)."""
        shared = self._first_turns.pop(group_id, None)
        if shared is not None:
            if not shared.answers.done():
                shared.answers.cancel()
            elif not shared.answers.cancelled():
                shared.answers.exception()  # (its failure reached every episode that asked: retrieved)

    async def _shared_answer(self, group_id: int, prompt_ids: list[int], engine: EngineClient) -> Generation | None:
        """This episode's answer among its group's first turns: the group's first episode to ask sends one request
        of n = group size, the others await its answers. None where this prompt is not the group's (an env whose
        first observation depends on more than the seed) or every answer is taken: the episode asks on its own."""
        shared = self._first_turns.get(group_id)
        if shared is None:
            request = asyncio.ensure_future(self._answer(prompt_ids, engine, n=self.group_size))
            shared = self._first_turns[group_id] = _SharedTurn(list(prompt_ids), request)
        elif shared.taken >= self.group_size or shared.prompt_ids != list(prompt_ids):
            return None
        i, shared.taken = shared.taken, shared.taken + 1
        return (await asyncio.shield(shared.answers))[i]  # (an episode cancelled leaves the others' request be)

    def _frozen(self, engine: EngineClient) -> EngineClient:
        """`engine`'s client of the frozen copy (FROZEN_ADAPTER_NAME), made once per engine; until the engine has loaded
        that adapter (its first engines.frozen_every versions) it asks for the base model: version 0."""
        client = self._frozen_clients.get(engine.url)
        if client is None:
            client = self._frozen_clients[engine.url] = engine.with_model(FROZEN_ADAPTER_NAME, base_while_absent=True)
        return client

    async def _answer(
        self, prompt_ids: list[int], engine: EngineClient, images: Sequence[np.ndarray] = (), n: int = 1
    ) -> list[Generation]:
        """`engine.sample` of `n` answers, watched: a request unanswered for engines.stall_timeout_s has the engine
        probed (`EngineClient.alive`, shared by all its waiting requests); a probe unanswered as long as well raises
        EngineStalled, and the request is cancelled. A busy engine answers the probe: its requests wait on (up to
        engines.request_timeout_s, the HTTP client's limit). With one engine there is nowhere to move a request: it
        waits on, as a cancelled one would only be sent to the same engine again."""
        stall = self.client.stall_timeout_s
        if len(self.engines) < 2:
            return await engine.sample(prompt_ids, self.sampling, n, images=images or None)
        request = asyncio.ensure_future(engine.sample(prompt_ids, self.sampling, n, images=images or None))
        try:
            while True:
                done, _ = await asyncio.wait({request}, timeout=stall)
                if done:
                    return request.result()
                probe = engine.alive(stall)
                done, _ = await asyncio.wait({request, probe}, return_when=asyncio.FIRST_COMPLETED)
                if request in done:
                    return request.result()
                if not probe.result():
                    self.counters["engine_stalls"] += 1
                    raise EngineStalled(
                        f"{engine.url}: no answer within engines.stall_timeout_s={stall} s, nor to "
                        f"a probe: the engine is stalled"
                    )
        finally:
            if not request.done():
                request.cancel()
                with contextlib.suppress(asyncio.CancelledError, EngineError):
                    await request


class EpisodeSampler:
    """One episode's `generate`: it stays with the engine that last answered it, takes its first turn from its group's
    shared request (the policy's turns only: never a frozen seat's, nor one with images), and asks the frozen copy
    for a frozen seat's turns."""

    def __init__(
        self, sampler: Sampler, engine: EngineClient, share_with: int | None, frozen_seat: Callable[[int], bool]
    ):
        self.sampler, self.engine, self.share_with, self.frozen_seat = sampler, engine, share_with, frozen_seat

    async def __call__(self, turn: Turn) -> Generation:
        s = self.sampler
        frozen_turn = self.frozen_seat(int(turn.info.get("seat", 0)))
        s.requests_in_flight += 1
        try:  # (the group's shared first answers are the policy's: never a frozen turn's)
            share = self.share_with is not None and not frozen_turn and not turn.images and s.group_size > 1
            group_id, self.share_with = (self.share_with if share else None), None
            gen, self.engine = await s.generate(turn.prompt_ids, self.engine, turn.images, group_id, frozen=frozen_turn)
        finally:
            s.requests_in_flight -= 1
        s.policy_version = max(s.policy_version, gen.version_hi)
        return gen


__all__ = ["EpisodeSampler", "Sampler"]
