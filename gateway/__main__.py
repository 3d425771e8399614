"""The gateway process: `python -m gateway`, as the launcher starts it (gateway.enabled=true, or role=gateway).

    python -m gateway --config RUN/config.yaml --name gateway-0 --incarnation 0 \
        --broker tcp://127.0.0.1:5555 [--engine http://127.0.0.1:8000 ...] [--port 8100]

Without --engine it asks the broker for the engines (and follows those that join later). SIGTERM: stop serving,
wait for the broker's acknowledgements, send the final stats, exit 0.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Awaitable, Coroutine
from typing import Any

from agentstream import config as config_mod
from agentstream.process import on_stop_signals, run_process
from engines.pool import connect, engines_from_broker, follow_engines, process_arguments
from gateway.server import Gateway
from gateway.spec import GatewaySpec

log = logging.getLogger("gateway")


async def serve(
    spec: GatewaySpec,
    name: str,
    incarnation: int,
    broker_address: str,
    engine_urls: list[str],
    shutdown_timeout_s: float,
) -> int:
    """The gateway process until SIGTERM/SIGINT: then it stops serving, waits (bounded) for the broker's
    acknowledgements, sends its final stats and returns 0. 3: it could not serve (its port taken, ...)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(spec.model_path)
    async with connect(name, incarnation, broker_address, spec, spec.max_unacked, spec.ack_timeout_s) as links:
        stop = asyncio.Event()
        on_stop_signals(stop.set)
        code, gw, follower = 0, None, None
        try:
            urls = engine_urls or await _until(stop, engines_from_broker(links.broker))
            if urls:
                gw = Gateway(spec, links.broker, [links.engine(u) for u in urls], tokenizer, name, incarnation)
                follower = asyncio.create_task(follow_engines(links.broker, gw, links.engine))
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
    return code


async def _until(stop: asyncio.Event, coro: Awaitable[list[str]]) -> list[str]:
    """`coro`'s result, or [] if `stop` is set first."""
    task, stopped = asyncio.ensure_future(coro), asyncio.ensure_future(stop.wait())
    await asyncio.wait({task, stopped}, return_when=asyncio.FIRST_COMPLETED)
    for t in (task, stopped):
        t.cancel()
    return task.result() if task.done() and not task.cancelled() else []


def main() -> None:
    parser = process_arguments(
        __doc__,
        name_default="gateway-0",
        name_help="its identity at the broker (an actor's name)",
        engine_help="engine base URL (repeatable); none: learn them from the broker",
    )
    parser.add_argument("--port", type=int, default=None, help="HTTP port (default: gateway.port; 0 picks one)")
    args = parser.parse_args()

    def start() -> Coroutine[Any, Any, int]:
        cfg = config_mod.load(args.config)
        spec = GatewaySpec.from_config(cfg)
        if args.port is not None:
            spec = dataclasses.replace(spec, gateway=dataclasses.replace(spec.gateway, port=args.port))
        return serve(spec, args.name, args.incarnation, args.broker, args.engine, cfg.run.shutdown_timeout_s)

    run_process(args.name, log, start)


if __name__ == "__main__":
    main()
