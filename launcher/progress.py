"""What a launch prints and writes while a run goes: a console line every few seconds (learner step, rates,
ETA), read from the dashboard's /api/state, and the summary.json it leaves."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import aiohttp

from actors.evaluate import read_rows

log = logging.getLogger("launch")


def write_summary(path: Path, summary: dict) -> None:
    path.write_text(json.dumps(summary, indent=2, sort_keys=True))


async def get_json(session: aiohttp.ClientSession, url: str) -> dict:
    async with session.get(url) as resp:
        resp.raise_for_status()
        return await resp.json()


def eta_s(samples: list[tuple[float, int]], total_steps: int) -> float | None:
    """Seconds left at the learner's recent pace: (time, version) samples, oldest first, measured from the
    first sample (so the start-up time does not inflate it). None until the version has moved."""
    if len(samples) < 2 or samples[-1][1] <= samples[0][1]:
        return None
    (t0, v0), (t1, v1) = samples[0], samples[-1]
    return (t1 - t0) / (v1 - v0) * max(0, total_steps - v1)


def held_out_line(rows: list[dict[str, float]], reference: Mapping[str, float] | None = None) -> str:
    """Validation on held-out seeds (validation.csv's rows), first and latest: what the run has learnt; and the warm
    start's teacher on the same seeds, where it had one (`reference`: `actors.demos.warm_start_success`)."""
    if not rows:
        return ""
    first, last = rows[0], rows[-1]
    line = f"held-out success {first['val_success_rate']:.2f} at v{first['version']:.0f}"
    line += f" -> {last['val_success_rate']:.2f} at v{last['version']:.0f}" if len(rows) > 1 else ""
    return line + (f" (teacher {reference['teacher']:.2f})" if reference else "")


def held_out_summary(
    rows: list[dict[str, float]], reference: Mapping[str, float] | None = None
) -> dict[str, dict[str, float]]:
    """summary.json's `held_out_success`: the first and the last validation ({} without validation), and what the
    warm start measured on the same seeds (`warm_start`: its teacher's and the warm model's success), where it did."""
    pick = lambda r: {"version": r["version"], "success_rate": r["val_success_rate"]}  # noqa: E731
    if not rows:
        return {}
    return {"start": pick(rows[0]), "end": pick(rows[-1])} | ({"warm_start": dict(reference)} if reference else {})


def format_progress(
    state: dict,
    total_steps: int,
    eta: float | None,
    validation: list[dict[str, float]] = (),
    reference: Mapping[str, float] | None = None,
) -> str:
    """One console line from the dashboard's /api/state (schema in broker/dashboard.py), and validation's rows."""
    v, r, g = state["learner"]["version"], state["rates"], state["gauges"]
    engines = ",".join(str(e["version"]) for e in state["engines"])
    left = "?" if eta is None else f"{eta:.0f}s"
    held_out = held_out_line(list(validation), reference)
    return (
        f"[agentstream] step {v}/{total_steps} | engines v[{engines}] | {r['env_steps_per_s']:.1f} env steps/s | "
        f"{r['tokens_per_s']:.0f} tok/s | {r['transitions_per_s']:.1f} transitions/s | "
        f"buffered {g['buffered_transitions']:.0f} | success {g['success_rate']:.2f} | "
        f"actors {g['actors_alive']:.0f} | ETA {left}" + (f" | {held_out}" if held_out else "")
    )


async def progress_loop(
    session: aiohttp.ClientSession,
    dashboard: Callable[[], str],
    total_steps: int,
    every_s: float = 5.0,
    validation_csv: Path | None = None,
    reference: Mapping[str, float] | None = None,
) -> None:
    """One console line every few seconds: learner step out of total, rates, ETA, and held-out success so far
    (`validation_csv`: the evaluator's validation.csv; `reference`: the warm start's figures on the same seeds);
    `dashboard()`: its URL now (a broker may move)."""
    samples: list[tuple[float, int]] = []
    while True:
        await asyncio.sleep(every_s)
        try:
            st = await get_json(session, f"{dashboard()}/api/state")
            rows = read_rows(validation_csv) if validation_csv is not None else []
            line = format_progress(st, total_steps, eta_s(samples, total_steps), rows, reference)
        except (aiohttp.ClientError, TimeoutError, KeyError) as exc:
            log.debug("no progress line: %r", exc)
            continue
        samples = (samples + [(time.time(), int(st["learner"]["version"]))])[-12:]  # the last minute's pace
        print(line, flush=True)
