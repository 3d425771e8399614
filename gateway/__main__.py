"""The gateway process: `python -m gateway`, as the launcher starts it (gateway.enabled=true, or role=gateway).

    python -m gateway --config RUN/config.yaml --name gateway-0 --incarnation 0 \
        --broker tcp://127.0.0.1:5555 [--engine http://127.0.0.1:8000 ...] [--port 8100]

Without --engine it asks the broker for the engines (and follows those that join later). SIGTERM: stop serving,
wait for the broker's acknowledgements, send the final stats, exit 0.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import signal
import time
from collections.abc import Awaitable

import aiohttp

from agentstream import config as config_mod
from agentstream.wire.client import AsyncClient
from agentstream.wire.messages import Hello
from engines.client import EngineClient, engines_from_broker, follow_engines
from gateway.server import Gateway
from gateway.spec import GatewaySpec

log = logging.getLogger("gateway")


async def serve(spec: GatewaySpec, name: str, incarnation: int, broker_address: str, engine_urls: list[str],
                shutdown_timeout_s: float) -> int:
    """The gateway process until SIGTERM/SIGINT: then it stops serving, waits (bounded) for the broker's
    acknowledgements, sends its final stats and returns 0. 3: it could not serve (its port taken, ...)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(spec.model_path)
    broker = AsyncClient(broker_address, name=name, curve_keys_dir=spec.curve_keys_dir)
    await broker.start(incarnation, spec.max_unacked, spec.ack_timeout_s)
    await broker.send(Hello(role="actor", name=name, incarnation=incarnation, pid=os.getpid(),
                            want_welcome=True))  # the broker's Welcome lists the engines (and later joiners)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    timeout = aiohttp.ClientTimeout(total=spec.request_timeout_s)
    code, gw, follower = 0, None, None
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        def client(url: str) -> EngineClient:
            return EngineClient(url, session, spec.request_timeout_s, model=spec.model_name,
                                base_model=spec.base_model_name)

        try:
            urls = engine_urls or await _until(stop, engines_from_broker(broker))
            if urls:
                gw = Gateway(spec, broker, [client(u) for u in urls], tokenizer, name, incarnation)
                follower = asyncio.create_task(follow_engines(broker, gw, client))
                log.info("%s: serving on %s (engines: %s)", name, await gw.start(hello=False), ", ".join(urls))
                await stop.wait()
                log.info("%s: stopping (signal)", name)
        except OSError as exc:  # the port is taken, say
            log.error("%s: cannot serve: %r", name, exc)
            code = 3
        finally:
            if follower is not None:
                follower.cancel()
            if gw is not None:
                await gw.close(shutdown_timeout_s / 2)
            await broker.close()
    return code


async def _until(stop: asyncio.Event, coro: Awaitable[list[str]]) -> list[str]:
    """`coro`'s result, or [] if `stop` is set first."""
    task, stopped = asyncio.ensure_future(coro), asyncio.ensure_future(stop.wait())
    await asyncio.wait({task, stopped}, return_when=asyncio.FIRST_COMPLETED)
    for t in (task, stopped):
        t.cancel()
    return task.result() if task.done() and not task.cancelled() else []


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="run config written by the launcher")
    parser.add_argument("--name", default="gateway-0", help="its identity at the broker (an actor's name)")
    parser.add_argument("--incarnation", type=int, default=0, help="how many times it was restarted")
    parser.add_argument("--broker", required=True, help="broker ZeroMQ address")
    parser.add_argument("--engine", action="append", default=[],
                        help="engine base URL (repeatable); none: learn them from the broker")
    parser.add_argument("--port", type=int, default=None, help="HTTP port (default: gateway.port; 0 picks one)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    cfg = config_mod.load(args.config)
    spec = GatewaySpec.from_config(cfg)
    if args.port is not None:
        spec = dataclasses.replace(spec, gateway=dataclasses.replace(spec.gateway, port=args.port))
    started = time.time()
    code = asyncio.run(serve(spec, args.name, args.incarnation, args.broker, args.engine, cfg.run.shutdown_timeout_s))
    log.info("%s: exit %d after %.1fs", args.name, code, time.time() - started)
    raise SystemExit(code)


if __name__ == "__main__":
    main()
