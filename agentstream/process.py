"""How a process of the run starts and ends: its log lines set up first (reading its config may log already), then
its main coroutine, run to an exit code, which is logged with the seconds it took and exited with; an error that
escapes it is logged with its traceback and exits 1. A process that drains on SIGTERM (the supervisor's stop) or
Ctrl-C installs that with `on_stop_signals`; one that does not is ended by the signal.

    def main() -> None:
        args = parser.parse_args()
        run_process(args.name, log, lambda: serve(config.load(args.config), args.name))

    async def serve(cfg, name) -> int:
        stop = asyncio.Event()
        on_stop_signals(stop.set)   # SIGTERM, Ctrl-C: drain, then return
        ...
        return 0

A learner rank (`learner/train.py`, synchronous under torchrun, and called in-process by tests) sets up only its
log lines here (`setup_logging`) and returns its exit code itself. Imports nothing of the project: every process
links it.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from collections.abc import Callable, Coroutine
from typing import Any, NoReturn

LOG_FORMAT = "%(asctime)s %(name)s %(levelname)s %(message)s"
"""A process's log line unless it names itself in each (a sidecar its engine, a learner rank its rank)."""
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
"""The supervisor stops a child with SIGTERM; Ctrl-C in a terminal sends SIGINT to its whole foreground group."""


def setup_logging(log_format: str = LOG_FORMAT) -> None:
    """INFO and above to stderr (the launcher sends a child's stderr to its log, RUN/logs/<name>.log)."""
    logging.basicConfig(level=logging.INFO, format=log_format)


def on_stop_signals(stop: Callable[[], None]) -> None:
    """Call `stop` (set an event, cancel the main task) on SIGTERM or SIGINT instead of dying at once, so that the
    process drains first: a stopped process still says goodbye to the broker. In the running event loop only."""
    loop = asyncio.get_running_loop()
    for sig in STOP_SIGNALS:
        loop.add_signal_handler(sig, stop)


def run_process(
    name: str, log: logging.Logger, start: Callable[[], Coroutine[Any, Any, int | None]], log_format: str = LOG_FORMAT
) -> NoReturn:
    """The process from its parsed command line to its exit: logging set up (`log_format`) before `start()` (the
    caller reads its config there and returns its main coroutine), then that coroutine, run to its exit code
    (None: 0); an exception that escapes either is logged with its traceback, as exit code 1. The code is logged
    on `log` with `name` and the seconds the coroutine took, and exited with."""
    setup_logging(log_format)
    started = time.time()
    try:
        main = start()
        started = time.time()
        code = asyncio.run(main) or 0
    except Exception:  # noqa: BLE001 (whatever it was: its traceback in the log, and the exit code Python gives)
        log.exception("%s: failed", name)
        code = 1
    log.info("%s: exit %d after %.1fs", name, code, time.time() - started)
    raise SystemExit(code)


__all__ = ["LOG_FORMAT", "STOP_SIGNALS", "on_stop_signals", "run_process", "setup_logging"]
