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
read before (`version`) and after (`version_end`). Episodes are played by the actors' own loop
(`actors.episode.play`); what the evaluator needs of the run config is an `EvaluatorSpec` (actors/spec.py).
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import logging
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import aiohttp

from actors import episode
from actors.demos import warm_start_success
from actors.episode import Turn
from actors.spec import EpisodeSpec, EvaluatorSpec
from agentstream import config as config_mod
from agentstream.process import run_process
from agentstream.wire.client import AsyncClient
from agentstream.wire.messages import Hello, Stats
from engines.client import EngineClient, EngineError, Generation, text_decoder
from envs.base import VALIDATION_SEEDS

log = logging.getLogger("evaluate")
CSV_NAME = "validation.csv"
EPISODE_TRIES = 3  # an episode whose engine request fails is played again on its seed, up to this many times in all


class ValidationFailed(RuntimeError):
    """A validation episode failed EPISODE_TRIES times: that validation is skipped (and counted), the run goes on."""


@dataclass(frozen=True)
class ValidationEpisode:
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


def summarize(
    results: list[ValidationEpisode], version: int, version_end: int, wall_s: float, trajectories: int
) -> Validation:
    """Aggregate episode outcomes into one `Validation` row."""
    n, steps = len(results), sum(e.steps for e in results)
    return Validation(
        version=version,
        version_end=version_end,
        wall_s=round(wall_s, 2),
        trajectories_trained=trajectories,
        episodes=n,
        val_success_rate=sum(e.success for e in results) / n,
        val_return=sum(e.env_return for e in results) / n,
        val_invalid_rate=sum(e.invalid for e in results) / max(1, steps),
        val_steps=steps / n,
    )


async def play_episode(spec: EpisodeSpec, engine: EngineClient, tokenizer: Any, seed: int) -> ValidationEpisode:
    """One episode from `seed` through the actors' own loop (`actors.episode.play`: same env, memory and chat
    template), sampled with `spec.sampling`, sent nowhere."""
    mem = spec.make_memory(tokenizer)
    env = spec.make_env()

    async def generate(turn: Turn) -> Generation:
        return await engine.generate(turn.prompt_ids, spec.sampling, images=turn.images or None)

    try:
        outcome = await episode.play(env, mem, generate, seed=seed)
    finally:
        env.close()
    return ValidationEpisode(outcome.success, outcome.env_return, outcome.steps, outcome.invalid)


async def play_with_retries(spec: EpisodeSpec, engine: EngineClient, tokenizer: Any, seed: int) -> ValidationEpisode:
    """`play_episode`, played again on the same seed when an engine request fails (a timeout on a loaded engine,
    an engine restarting); ValidationFailed after EPISODE_TRIES failures."""
    for attempt in range(1, EPISODE_TRIES + 1):
        try:
            return await play_episode(spec, engine, tokenizer, seed)
        except EngineError as exc:
            log.warning("validation episode on seed %d failed (try %d of %d): %s", seed, attempt, EPISODE_TRIES, exc)
            last = exc
    raise ValidationFailed(f"the episode on seed {seed} failed {EPISODE_TRIES} times; the last error: {last}")


async def validate_once(spec: EvaluatorSpec, engine: EngineClient, tokenizer: Any, t0: float) -> Validation:
    """Play every validation seed once, concurrently; one `Validation` row."""
    version = await engine.version()
    seeds = [VALIDATION_SEEDS[i] for i in range(spec.episodes)]
    results = await asyncio.gather(*(play_with_retries(spec.episode, engine, tokenizer, s) for s in seeds))
    version_end = await engine.version()
    trajectories = version * spec.trajectories_per_version
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


def stats(
    name: str,
    row: Validation | None,
    count: int,
    failed: int = 0,
    final: bool = False,
    reference: dict[str, float] | None = None,
) -> Stats:
    """The evaluator's Stats: the latest validation, and `reference`: what the warm start measured on the same
    held-out lakes (its teacher's and the warm model's success, `actors.demos.warm_start_success`), beside it on the
    dashboard's validation chart."""
    gauges = (
        {}
        if row is None
        else {
            "val_success_rate": row.val_success_rate,
            "val_return": row.val_return,
            "val_invalid_rate": row.val_invalid_rate,
            "val_version": row.version,
        }
    )
    gauges.update({f"val_{k}_success": v for k, v in (reference or {}).items()})
    counters = {"validations": count, "validations_failed": failed}
    return Stats(source=name, role="evaluator", counters=counters, gauges=gauges, final=final)


async def evaluate_loop(
    spec: EvaluatorSpec, engine: EngineClient, tokenizer: Any, broker: AsyncClient, name: str, out: Path, t0: float
) -> None:
    """Validate whenever `is_due`, until the final version is validated. A validation whose episodes keep failing
    (ValidationFailed) is skipped and counted (`validations_failed`): the held-out curve misses a point, the run
    goes on."""
    last: int | None = None
    row: Validation | None = None
    count = failed = 0
    reference = warm_start_success(spec.client.model_path)
    total, every = spec.total_steps, spec.every
    while last is None or last < total:
        version = await engine.version()
        if is_due(version, last, every, total):
            try:
                row = await validate_once(spec, engine, tokenizer, t0)
            except ValidationFailed as exc:
                failed += 1
                last = version
                log.error("validation at version %d skipped: %s", version, exc)
                continue
            append_row(out / CSV_NAME, row)
            last, count = row.version, count + 1
            log.info(
                "validation at version %d: success %.3f return %.3f invalid %.3f (%.1fs)",
                row.version,
                row.val_success_rate,
                row.val_return,
                row.val_invalid_rate,
                row.wall_s,
            )
        await broker.send(stats(name, row, count, failed, reference=reference))
        await asyncio.sleep(0.5)  # version poll: an HTTP GET, cheap; validations are seconds apart
    await broker.send(stats(name, row, count, failed, final=True, reference=reference))


async def _main(spec: EvaluatorSpec, name: str, broker_address: str, engine_url: str, out: Path, t0: float) -> int:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(spec.client.model_path)
    broker = AsyncClient(broker_address, name=name, curve_keys_dir=spec.client.curve_keys_dir)
    await broker.start()
    await broker.send(Hello(role="evaluator", name=name, pid=os.getpid()))
    timeout = aiohttp.ClientTimeout(total=spec.client.request_timeout_s)
    try:
        async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
            engine = EngineClient(
                engine_url,
                session,
                spec.client.request_timeout_s,
                model=spec.client.model_name,
                base_model=spec.client.base_model_name,
                decode=text_decoder(tokenizer),
            )
            await evaluate_loop(spec, engine, tokenizer, broker, name, out, t0)
    finally:
        await broker.close()
    return 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="run config written by the launcher")
    parser.add_argument("--name", default="evaluator", help="name at the broker")
    parser.add_argument(
        "--broker", required=True, help="broker ZeroMQ address, or its record (RUN/broker.json: followed)"
    )
    parser.add_argument("--engine", required=True, help="engine base URL")
    parser.add_argument("--out", required=True, help="run folder (validation.csv goes there)")
    parser.add_argument("--t0", type=float, default=None, help="run start (unix time); default: now")
    args = parser.parse_args()
    t0 = time.time() if args.t0 is None else args.t0
    run_process(
        args.name,
        log,
        lambda: _main(
            EvaluatorSpec.from_config(config_mod.load(args.config)),
            args.name,
            args.broker,
            args.engine,
            Path(args.out),
            t0,
        ),
    )


if __name__ == "__main__":
    main()
