"""Distillation against RL alone, from two finished runs' folders: per policy version, the student's reverse KL per
token to the teacher on its own training samples, the task reward of those samples, and held-out validation success.

    .venv/bin/python scripts/plot_distill.py --run distill=runs/distill-fig-kd --run rl=runs/distill-fig-rl \
        --teacher .cache/smollm2-135m-instruct --out docs/plots/distill

A run with a teacher logged each step's KL (`info.teacher_kl`, actors/teacher.py); the steps of a run without one are
scored here by a vLLM server of `--teacher` (started for the purpose, the engines' own command), with the same
request and formula (`actors.teacher.Teacher`), so both curves are the same measurement. The task reward of a step is
its logged reward less its token rewards (the teacher's signal). Writes OUT_curves.csv and OUT.png.
"""

from __future__ import annotations

import argparse
import asyncio
import csv
from collections import defaultdict
from pathlib import Path

import numpy as np

from actors.evaluate import CSV_NAME, read_rows
from broker.state import logged_transitions


def steps_of(run: Path) -> list:
    """The run's logged steps (abandon markers left out)."""
    return [t for t in logged_transitions(run / "broker-wal") if "abandon" not in t.info]


async def teacher_kl(steps: list, teacher_dir: str) -> list[float]:
    """Each step's mean reverse KL per token, asked of a vLLM server of `teacher_dir` started here."""
    import aiohttp

    from actors.spec import TeacherSpec
    from actors.teacher import Teacher
    from agentstream.config import Config
    from agentstream.wire.addresses import free_port
    from engines.client import EngineClient
    from engines.server import server_command, wait_ready
    from launcher.procs import start, stop

    cfg = Config()
    cfg.model.path = teacher_dir
    port = free_port()
    argv, env = server_command(cfg.model, cfg.engines, port)
    proc = start(argv, Path("/tmp") / f"plot-distill-teacher-{port}.log", env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        await wait_ready(url, 600, proc=proc)
        async with aiohttp.ClientSession() as session:
            teacher = Teacher(TeacherSpec(1.0, False, 120.0, 2), [EngineClient(url, session, 120.0, versioned=False)])
            limit = asyncio.Semaphore(16)

            async def one(t) -> float:
                async with limit:
                    return (await teacher.signal(t.prompt_ids, t.response_ids, t.logprobs)).kl

            return list(await asyncio.gather(*(one(t) for t in steps)))
    finally:
        stop(proc, 30)


def curves(run: Path, teacher_dir: str) -> dict[int, dict[str, float]]:
    """version -> {kl (token-weighted), task_reward, success, samples} of the steps sampled at that version."""
    steps = steps_of(run)
    if all("teacher_kl" in t.info for t in steps):
        kls = [float(t.info["teacher_kl"]) for t in steps]
    else:
        kls = asyncio.run(teacher_kl(steps, teacher_dir))
    acc: dict[int, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for t, kl in zip(steps, kls, strict=True):
        row = acc[int(t.version_lo)]
        n = int(t.response_ids.size)
        row["kl_sum"] += kl * n
        row["tokens"] += n
        row["task_reward_sum"] += t.reward - float(np.asarray(t.token_rewards, np.float64).sum())
        row["success_sum"] += float(bool(t.info.get("success", False)))
        row["samples"] += 1
    return {
        v: {
            "kl": r["kl_sum"] / r["tokens"],
            "task_reward": r["task_reward_sum"] / r["samples"],
            "success": r["success_sum"] / r["samples"],
            "samples": r["samples"],
        }
        for v, r in sorted(acc.items())
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", action="append", required=True, help="LABEL=RUN_FOLDER (repeatable)")
    parser.add_argument("--teacher", required=True, help="the teacher's model directory")
    parser.add_argument("--teacher-success", type=float, default=None, help="the teacher's held-out success, drawn")
    parser.add_argument("--out", required=True, help="output prefix: PREFIX_curves.csv, PREFIX.png")
    args = parser.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    rows = []
    for spec in args.run:
        label, folder = spec.split("=", 1)
        run = Path(folder)
        c = curves(run, args.teacher)
        versions = list(c)
        axes[0].plot(versions, [c[v]["kl"] for v in versions], marker="o", label=label)
        axes[1].plot(versions, [c[v]["task_reward"] for v in versions], marker="o", label=label)
        val = read_rows(run / CSV_NAME)
        axes[2].plot([r["version"] for r in val], [r["val_success_rate"] for r in val], marker="o", label=label)
        for v in versions:
            rows.append({"run": label, "version": v, **c[v]})
        for r in val:
            rows.append({"run": label, "version": int(r["version"]), "val_success_rate": r["val_success_rate"]})
    if args.teacher_success is not None:
        axes[2].axhline(args.teacher_success, color="grey", linestyle="--", label="teacher")
    titles = (
        "reverse KL per token to the teacher (own samples)",
        "task reward per training sample",
        "held-out success (greedy)",
    )
    for ax, title in zip(axes, titles, strict=True):
        ax.set_title(title)
        ax.set_xlabel("policy version (learner steps)")
        ax.legend()
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=90)
    keys = ["run", "version", "kl", "task_reward", "success", "samples", "val_success_rate"]
    with open(f"{out}_curves.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=keys)
        writer.writeheader()
        writer.writerows(rows)
    print(f"wrote {out.with_suffix('.png')} and {out}_curves.csv")


if __name__ == "__main__":
    main()
