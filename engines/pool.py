"""The engines a process generates on, and its links to them and to the broker, for a process that streams what
it makes to the broker as an actor (an actor process, the gateway): which engine gets its next request
(`EnginePool`), the engines it learns from the broker, its command line, its connections, its stats reports and its
end. Its start-up and exit are every process's (`agentstream.process.run_process`).

    def main() -> None:
        args = process_arguments(__doc__, name_help="...", engine_help="...").parse_args()
        run_process(args.name, log, lambda: serve(Spec.from_config(config.load(args.config)), args.name, ...))

    async def serve(spec, name, incarnation, broker_address, engine_urls) -> int:
        async with connect(name, incarnation, broker_address, spec.client, spec.max_unacked,
                           spec.ack_timeout_s) as links:
            engines = [links.engine(url) for url in engine_urls or await engines_from_broker(links.broker)]
            pool = EnginePool(engines)   # pool.pick(): the engine of the next episode
            ...                          # follow_engines(links.broker, process, links.engine): later joiners
            await goodbye(links.broker, lambda: process.stats(final=True), drain_timeout_s)
        return 0
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Protocol

import aiohttp

from agentstream.wire.client import AsyncClient
from agentstream.wire.messages import Hello, Stats
from engines.client import EngineClient

log = logging.getLogger("engines")


# ---------------------------------------------------------------------------------------------- command line and end
def process_arguments(
    doc: str | None, name_help: str, engine_help: str, name_default: str | None = None
) -> argparse.ArgumentParser:
    """The command line every such process takes (`--config`, `--name`, `--incarnation`, `--broker`, `--engine`);
    the caller adds its own. `name_default` None: `--name` is required."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="run config written by the launcher")
    if name_default is None:
        parser.add_argument("--name", required=True, help=name_help)
    else:
        parser.add_argument("--name", default=name_default, help=name_help)
    parser.add_argument("--incarnation", type=int, default=0, help="how many times it was restarted")
    parser.add_argument(
        "--broker", required=True, help="broker ZeroMQ address, or its record (RUN/broker.json: followed)"
    )
    parser.add_argument("--engine", action="append", default=[], help=engine_help)
    return parser


class Reach(Protocol):
    """How a process reaches the broker and the engines: what `connect` reads of its spec (an actor's
    `ClientSpec`, the `GatewaySpec`)."""

    @property
    def curve_keys_dir(self) -> str: ...

    @property
    def request_timeout_s(self) -> float: ...

    @property
    def model_name(self) -> str: ...

    @property
    def base_model_name(self) -> str | None: ...


@dataclass
class Links:
    """A started process's connections: to the broker, and the HTTP session its engine clients share."""

    broker: AsyncClient
    session: aiohttp.ClientSession
    reach: Reach
    decode: Callable[[list[int]], str] | None = None

    def engine(self, url: str) -> EngineClient:
        """A client of the policy engine at `url` (the process's model names, timeout and decode)."""
        return EngineClient(
            url,
            self.session,
            self.reach.request_timeout_s,
            model=self.reach.model_name,
            base_model=self.reach.base_model_name,
            decode=self.decode,
        )


@contextlib.asynccontextmanager
async def connect(
    name: str,
    incarnation: int,
    broker_address: str,
    reach: Reach,
    max_unacked: int,
    ack_timeout_s: float,
    decode: Callable[[list[int]], str] | None = None,
) -> AsyncIterator[Links]:
    """Start the broker connection and say hello as an actor (asking for the broker's Welcome, which lists the
    engines and later joiners), open the engines' HTTP session; on leaving, close them in reverse order.
    `decode`: the engine clients' (`engines.client.text_decoder`), or None."""
    broker = AsyncClient(broker_address, name=name, curve_keys_dir=reach.curve_keys_dir)
    await broker.start(incarnation, max_unacked, ack_timeout_s)
    await broker.send(Hello(role="actor", name=name, incarnation=incarnation, pid=os.getpid(), want_welcome=True))
    timeout = aiohttp.ClientTimeout(total=reach.request_timeout_s)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        try:
            yield Links(broker, session, reach, decode)
        finally:
            await broker.close()


async def report_stats(broker: AsyncClient, stats: Callable[[], Stats], interval_s: float) -> None:
    """Send `stats()` to the broker every `interval_s` seconds, until cancelled."""
    while True:
        await broker.send(stats())
        await asyncio.sleep(interval_s)


async def goodbye(broker: AsyncClient, final_stats: Callable[[], Stats], drain_timeout_s: float) -> None:
    """A stopping process's last words: wait (bounded) until the broker acknowledged what was sent, then send the
    final stats (made after the wait: they count what was acknowledged). A broker gone meanwhile is no error."""
    with contextlib.suppress(Exception):
        await broker.drain(drain_timeout_s)
        await broker.send(final_stats())


# ---------------------------------------------------------------------------------------------- engines of a run
class EngineUser(Protocol):
    """A process that generates on the run's engines (an actor, the gateway): its name and its engine list."""

    name: str
    engines: list[EngineClient]


class EnginePool:
    """Which engine gets a process's next request: round robin over `engines` (the process's own list, which may
    grow: `follow_engines`), skipping those that failed in the last `down_s` seconds (all of them if every one
    did), so that a stalled or dead engine rejoins once that time has passed."""

    def __init__(self, engines: list[EngineClient], down_s: float = 0.0):
        self.engines, self.down_s = engines, down_s
        self.picks = 0
        """Engines picked so far: the next pick's turn in the round."""
        self._failed_at: dict[str, float] = {}  # url -> when a request to it last failed

    def failed(self, engine: EngineClient) -> None:
        """A request to `engine` failed or stalled: it gets no new request for `down_s` seconds."""
        self._failed_at[engine.url] = time.monotonic()

    def is_down(self, engine: EngineClient, now: float | None = None) -> bool:
        """Whether `engine` failed a request in the last `down_s` seconds."""
        now = time.monotonic() if now is None else now
        return now - self._failed_at.get(engine.url, -1e9) <= self.down_s

    def pick(self, leaving: EngineClient | None = None) -> EngineClient:
        """The next engine in the round among those up (all of them if none is). `leaving`: the engine a request
        moves off, never picked while there is another."""
        now = time.monotonic()
        up = [e for e in self.engines if not self.is_down(e, now)] or self.engines
        if leaving is not None:
            up = [e for e in up if e is not leaving] or up
        engine = up[self.picks % len(up)]
        self.picks += 1
        return engine


async def engines_from_broker(broker: AsyncClient) -> list[str]:
    """The engine URLs of the broker's first Welcome that lists any (a process joining a running run)."""
    while True:
        welcome = await broker.welcomes.get()
        if welcome.engines:
            return list(welcome.engines)
        log.info("the broker knows no usable engine yet; waiting for one to register")


async def follow_engines(broker: AsyncClient, user: EngineUser, client: Callable[[str], EngineClient]) -> None:
    """Engines that join later (launch.py role=engines): the broker sends a new Welcome once one serves recent
    weights; `user` gets a client of each new one (its new episodes go to them too). Engines are never removed."""
    while True:
        welcome = await broker.welcomes.get()
        known = {e.url for e in user.engines}
        for url in welcome.engines:
            if url.rstrip("/") not in known:
                user.engines.append(client(url))
                log.info("%s: engine %s joined; now using %d engines", user.name, url, len(user.engines))


__all__ = [
    "EnginePool",
    "EngineUser",
    "Links",
    "Reach",
    "connect",
    "engines_from_broker",
    "follow_engines",
    "goodbye",
    "process_arguments",
    "report_stats",
]
