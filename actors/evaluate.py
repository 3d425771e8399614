"""The evaluator: validates the policy on held-out seeds while it trains, apart from the training data.

    python -m actors.evaluate --config RUN/config.yaml --broker tcp://127.0.0.1:5555 \
        --engine http://127.0.0.1:8000 --out RUN --t0 UNIX_TIME

The launcher starts it when `validation.every > 0`. It watches the engine's policy version and, at version
0, then every `validation.every` versions, and at the final one (`trainer.total_steps`), plays
`validation.episodes` episodes, one per seed `VALIDATION_SEEDS[i]` (the same tasks each time, none ever
trained on), at `validation.temperature` (0: greedy), all at once on one asyncio loop. Nothing it plays
reaches the training buffer: it sends the broker only Stats (role `evaluator`, gauges `val_success_rate`,
`val_return`, `val_invalid_rate`, `val_version`), and appends one row per validation to
`RUN/validation.csv`. It exits after validating the final version.

Updates may land during a validation (the learner does not wait for it); each row records the versions
read before (`version`) and after (`version_end`).
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import logging
import os
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import aiohttp

import envs
import memory
from agentstream import config as config_mod
from agentstream.config import Config
from broker.client import AsyncClient
from broker.protocol import Hello, Stats
from engines.client import EngineClient
from engines.server import base_model_name, served_model_name
from envs.base import VALIDATION_SEEDS

log = logging.getLogger("evaluate")
CSV_NAME = "validation.csv"


@dataclass(frozen=True)
class Episode:
    """How one validation episode ended."""

    success: bool
    env_return: float  # sum of env rewards (without the invalid-action penalty)
    steps: int
    invalid: int  # steps whose answer did not parse


@dataclass(frozen=True)
class Validation:
    """One row of validation.csv."""

    version: int  # engine version read before the first episode
    version_end: int  # read after the last one (> version if an update landed meanwhile)
    wall_s: float  # seconds since the run started (the launcher's t0), at the end of the validation
    trajectories_trained: int  # version * groups_per_step * group_size: training samples behind `version`
    episodes: int
    val_success_rate: float
    val_return: float
    val_invalid_rate: float  # invalid answers / steps
    val_steps: float  # mean episode length


def is_due(version: int, last_done: int | None, every: int, total: int) -> bool:
    """Validate now? Version 0 first, then the first version reached at or past each multiple of `every`,
    and the final version `total` (versions are read by polling, so one may be skipped over)."""
    if last_done is None:
        return True
    if last_done >= total:
        return False
    next_due = min((last_done // every + 1) * every, total)
    return version >= next_due


def summarize(results: list[Episode], version: int, version_end: int, wall_s: float, trajectories: int) -> Validation:
    """Aggregate episode outcomes into one `Validation` row."""
    n, steps = len(results), sum(e.steps for e in results)
    return Validation(
        version=version, version_end=version_end, wall_s=round(wall_s, 2), trajectories_trained=trajectories,
        episodes=n, val_success_rate=sum(e.success for e in results) / n,
        val_return=sum(e.env_return for e in results) / n,
        val_invalid_rate=sum(e.invalid for e in results) / max(1, steps), val_steps=steps / n,
    )


async def play_episode(cfg: Config, engine: EngineClient, tokenizer, seed: int) -> Episode:
    """One episode from `seed`, exactly as an actor plays it (same env, memory, chat template), unsent."""
    env = envs.make(cfg.env.name, max_steps=cfg.env.max_steps, **cfg.env.kwargs)
    m = cfg.memory
    mem = memory.make(m.kind, k=m.k, max_events=m.max_events, tokenizer=tokenizer,
                      max_prompt_tokens=m.max_prompt_tokens or cfg.engines.max_model_len - cfg.sampling.max_tokens)
    sampling = replace(cfg.sampling, temperature=cfg.validation.temperature)
    blocking = bool(getattr(env, "blocking", False))  # Java/subprocess games: their calls go to a thread
    try:
        obs, info = await asyncio.to_thread(env.reset, seed=seed) if blocking else env.reset(seed=seed)
        mem.reset(env.instructions)
        total, steps, invalid = 0.0, 0, 0
        while True:
            gen = await engine.generate(mem.fitter.token_ids(mem.messages(obs)), sampling)
            next_obs, reward, terminated, truncated, info = (
                await asyncio.to_thread(env.step, gen.text) if blocking else env.step(gen.text))
            total, steps = total + float(reward), steps + 1
            invalid += 0 if info.get("valid", True) else 1
            mem.record(obs, gen.text, reward=float(reward), info=info)
            obs = next_obs
            if terminated or truncated:
                return Episode(bool(info.get("success", False)), total, steps, invalid)
    finally:
        env.close()


async def validate_once(cfg: Config, engine: EngineClient, tokenizer, t0: float) -> Validation:
    """Play every validation seed once, concurrently; one `Validation` row."""
    version = await engine.version()
    seeds = [VALIDATION_SEEDS[i] for i in range(cfg.validation.episodes)]
    results = await asyncio.gather(*(play_episode(cfg, engine, tokenizer, s) for s in seeds))
    version_end = await engine.version()
    trajectories = version * cfg.trainer.groups_per_step * cfg.env.group_size
    return summarize(list(results), version, version_end, time.time() - t0, trajectories)


def append_row(path: Path, row: Validation) -> None:
    """Append `row` to the CSV at `path` (header first if the file is new)."""
    new = not path.exists()
    with path.open("a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(asdict(row)))
        if new:
            writer.writeheader()
        writer.writerow(asdict(row))


def read_rows(path: Path) -> list[dict[str, float]]:
    """validation.csv -> rows of floats (empty if the file does not exist)."""
    if not path.exists():
        return []
    with path.open() as f:
        return [{k: float(v) for k, v in r.items()} for r in csv.DictReader(f)]


def stats(name: str, row: Validation | None, count: int, final: bool = False) -> Stats:
    gauges = {} if row is None else {"val_success_rate": row.val_success_rate, "val_return": row.val_return,
                                     "val_invalid_rate": row.val_invalid_rate, "val_version": row.version}
    return Stats(source=name, role="evaluator", counters={"validations": count}, gauges=gauges, final=final)


async def evaluate_loop(cfg: Config, engine: EngineClient, tokenizer, broker: AsyncClient, name: str,
                        out: Path, t0: float) -> None:
    """Validate whenever `is_due`, until the final version is validated."""
    last: int | None = None
    row: Validation | None = None
    count = 0
    total, every = cfg.trainer.total_steps, cfg.validation.every
    while last is None or last < total:
        version = await engine.version()
        if is_due(version, last, every, total):
            row = await validate_once(cfg, engine, tokenizer, t0)
            append_row(out / CSV_NAME, row)
            last, count = row.version, count + 1
            log.info("validation at version %d: success %.3f return %.3f invalid %.3f (%.1fs)", row.version,
                     row.val_success_rate, row.val_return, row.val_invalid_rate, row.wall_s)
        await broker.send(stats(name, row, count))
        await asyncio.sleep(0.5)  # version poll: an HTTP GET, cheap; validations are seconds apart
    await broker.send(stats(name, row, count, final=True))


async def _main(args: argparse.Namespace) -> int:
    from transformers import AutoTokenizer

    cfg = config_mod.load(args.config)
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
    broker = AsyncClient(args.broker, name=args.name, curve_keys_dir=cfg.broker.curve_keys_dir)  # security: CURVE
    await broker.start()
    await broker.send(Hello(role="evaluator", name=args.name, pid=os.getpid()))
    timeout = aiohttp.ClientTimeout(total=cfg.engines.request_timeout_s)
    try:
        async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
            engine = EngineClient(args.engine, session, cfg.engines.request_timeout_s,
                                  model=served_model_name(cfg.model), base_model=base_model_name(cfg.model))
            await evaluate_loop(cfg, engine, tokenizer, broker, args.name, Path(args.out), args.t0)
    finally:
        await broker.close()
    return 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="run config written by the launcher")
    parser.add_argument("--name", default="evaluator", help="name at the broker")
    parser.add_argument("--broker", required=True, help="broker ZeroMQ address")
    parser.add_argument("--engine", required=True, help="engine base URL")
    parser.add_argument("--out", required=True, help="run folder (validation.csv goes there)")
    parser.add_argument("--t0", type=float, default=None, help="run start (unix time); default: now")
    args = parser.parse_args()
    args.t0 = time.time() if args.t0 is None else args.t0
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    raise SystemExit(asyncio.run(_main(args)))


if __name__ == "__main__":
    main()
