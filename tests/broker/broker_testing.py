"""Helpers shared by the broker's tests: an in-process broker on free ports, and a reply read with a timeout."""

import asyncio
from pathlib import Path

import zmq.asyncio

from agentstream.config import Config
from agentstream.wire import messages as P
from agentstream.wire.addresses import free_port
from broker.server import Broker
from broker.spec import broker_spec


async def start_broker(cfg: Config, run_dir: Path | None = None) -> tuple[Broker, asyncio.Task, str]:
    """A running broker (its write-ahead log in `run_dir`, if given), the task serving it, and its address."""
    port = free_port()
    broker = Broker(broker_spec(cfg), port, free_port(), run_dir=run_dir)
    task = asyncio.create_task(broker.serve())
    while broker.status != "running":
        await asyncio.sleep(0.01)
    return broker, task, f"tcp://127.0.0.1:{port}"


async def recv(sock: zmq.asyncio.Socket) -> P.Message:
    return P.decode(await asyncio.wait_for(sock.recv_multipart(), 5))
