"""Learning-curve comparisons: several real runs of the launcher, one PNG per x-axis and one CSV per comparison.

    .venv/bin/python -m bench.compare preset        # the learn_frozenlake preset alone: its learning curve
    .venv/bin/python -m bench.compare preset --preset smollm2 --seeds 3   # the real model's preset, 3 seeds
    .venv/bin/python -m bench.compare staleness     # sync (staleness 0) vs async 2 / 4 with TIS vs async 4 uncorrected
    .venv/bin/python -m bench.compare algorithm     # GRPO vs GiGPO, same env and budget
    .venv/bin/python -m bench.compare memory        # last-k vs full history on long FrozenLake episodes
    .venv/bin/python -m bench.compare staleness --steps 40 --out runs/compare-staleness -- learner.lr=5e-4
    .venv/bin/python -m bench.compare algorithm --seeds 3   # each arm with run.seed=0, 1, 2: mean and spread

Every arm is `scripts/launch.py preset=learn_frozenlake` (or `--preset`) plus the arm's overrides (and any after `--`),
run one after another so that they do not compete for the CPU. The evaluator validates each run on the
same held-out seeds (VALIDATION_SEEDS) every `--every` learner steps. Into the output folder go each
arm's run folder and its launcher's output (`launch-<arm>.log`), `curves.csv` (one row per validation of every
arm), `key_figures.csv` (start, end, best, time and samples to reach `--target`), `success_vs_samples.png` and
`success_vs_time.png`. With `--seeds N` every arm runs N times (`run.seed=0..N-1`, folders `<arm>/seed<k>`): the
plots draw each seed thin and the arms' mean at each validation thick, `key_figures.csv` has a row per seed and one
per arm (the mean, with the seeds' spread). Each row also has the mean over the run of the learner's
`adv_step_in_shared_group_frac`: the share of steps whose GiGPO step group holds more than one step (only GiGPO logs
it). An arm that already has a finished run folder there is not run again (`--rerun` to redo
it).
"""

from __future__ import annotations

import csv
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from actors.evaluate import CSV_NAME, read_rows
from agentstream.config import REPO_ROOT
from bench import harness


@dataclass(frozen=True)
class Arm:
    """One configuration of a comparison."""

    label: str
    overrides: tuple[str, ...]


COMPARISONS: dict[str, tuple[Arm, ...]] = {
    "preset": (Arm("learn_frozenlake", ()),),  # the preset alone: its learning curve
    "staleness": (
        Arm("sync (staleness 0)", ("trainer.max_staleness=0",)),
        Arm("async 2, TIS", ("trainer.max_staleness=2", "algorithm.off_policy=tis")),
        Arm("async 4, TIS", ("trainer.max_staleness=4", "algorithm.off_policy=tis")),
        Arm("async 4, no correction", ("trainer.max_staleness=4", "algorithm.off_policy=none")),
    ),
    "algorithm": (Arm("GRPO", ("algorithm=grpo",)), Arm("GiGPO", ("algorithm=gigpo",))),
    "memory": (  # long episodes: a 6x6 lake, 30 steps; `full` repeats every step so far in each prompt
        Arm("last-k (k=2)", ("memory.kind=last_k", "memory.k=2", "env.kwargs.map_size=6", "env.max_steps=30")),
        Arm("full history", ("memory.kind=full", "env.kwargs.map_size=6", "env.max_steps=30")),
    ),
}
FIELDS = (
    "arm",
    "seed",
    "version",
    "trajectories_trained",
    "wall_s",
    "val_success_rate",
    "val_return",
    "val_invalid_rate",
)


def slug(label: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in label.lower()).strip("-").replace("--", "-")


def first_reaching(rows: list[dict[str, float]], target: float, key: str) -> float | None:
    """`key` of the first validation whose success rate is >= target (None if none is)."""
    return next((r[key] for r in rows if r["val_success_rate"] >= target), None)


def key_figures(label: str, rows: list[dict[str, float]], target: float, wall_s: float) -> dict[str, object]:
    """Start, end and best validation success, and when (seconds, trajectories) the target was first reached."""
    rates = [r["val_success_rate"] for r in rows]
    return {
        "arm": label,
        "start": rates[0] if rates else None,
        "end": rates[-1] if rates else None,
        "best": max(rates) if rates else None,
        "target": target,
        "time_to_target_s": first_reaching(rows, target, "wall_s"),
        "trajectories_to_target": first_reaching(rows, target, "trajectories_trained"),
        "final_version": rows[-1]["version"] if rows else None,
        "run_wall_s": round(wall_s, 1),
    }


def shared_step_frac(run_dir: Path) -> float | None:
    """Mean over the run's learner steps of GiGPO's share of steps in a step group of more than one (None: not
    logged)."""
    path = run_dir / "learner_metrics.jsonl"
    values = (
        [
            row["adv_step_in_shared_group_frac"]
            for row in map(json.loads, path.read_text().splitlines())
            if "adv_step_in_shared_group_frac" in row
        ]
        if path.is_file()
        else []
    )
    return round(sum(values) / len(values), 3) if values else None


def mean_curve(runs: list[list[dict[str, float]]], keys: Sequence[str] = FIELDS[2:]) -> list[dict[str, float]]:
    """The seeds' mean of `keys` at each validation (position k of every run), as far as the shortest run goes."""
    n = min(map(len, runs))
    return [{key: sum(run[k][key] for run in runs) / len(runs) for key in keys} for k in range(n)]


def mean_figures(label: str, per_seed: list[dict[str, object]]) -> dict[str, object]:
    """One row for an arm: the mean of its seeds' figures, and the seeds' sample standard deviation as `<key>_sd`."""
    row: dict[str, object] = {"arm": label, "seed": "mean"}
    for key in ("start", "end", "best", "shared_step_frac", "run_wall_s"):
        values = [float(f[key]) for f in per_seed if f[key] is not None]
        row[key] = round(sum(values) / len(values), 3) if values else None
        if len(values) > 1 and key != "shared_step_frac":
            mu = sum(values) / len(values)
            row[f"{key}_sd"] = round((sum((v - mu) ** 2 for v in values) / (len(values) - 1)) ** 0.5, 3)
    reached = [f for f in per_seed if f["time_to_target_s"] is not None]
    row["seeds_reaching_target"] = f"{len(reached)}/{len(per_seed)}"
    return row


def run_arm(arm: Arm, run_dir: Path, preset: str, steps: int, every: int, extra: list[str]) -> float:
    """One launcher run; returns its wall time. Raises if the launcher fails (its output tail in the message)."""
    overrides = [
        f"preset={preset}",
        f"trainer.total_steps={steps}",
        f"validation.every={every}",
        "broker.dashboard_port=0",
        *arm.overrides,
        *extra,
    ]
    print(f"[compare] {arm.label}: run.output_dir={run_dir} {' '.join(overrides)}", flush=True)
    return harness.run_launcher(run_dir, overrides, f"of {arm.label}").wall_s


def plot(
    curves: dict[str, list[list[dict[str, float]]]],
    x: str,
    xlabel: str,
    title: str,
    path: Path,
    y: str = "val_success_rate",
    ylabel: str = "validation success rate",
    ylim: tuple[float, float] | None = (-0.02, 1.02),
) -> None:
    """One line per arm, `y` against `x` of its rows; with several seeds each seed thin and the arm's mean (at each
    row) thick. `ylim` None: matplotlib's own (bench.peer's rewards reach the invalid penalty, below 0)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.6), dpi=100)
    for label, runs in curves.items():
        rows = mean_curve(runs, (x, y)) if len(runs) > 1 else runs[0]
        (line,) = ax.plot(
            [r[x] for r in rows],
            [r[y] for r in rows],
            marker="o",
            markersize=3,
            label=f"{label} (mean of {len(runs)} seeds)" if len(runs) > 1 else label,
        )
        for run in runs if len(runs) > 1 else ():
            ax.plot([r[x] for r in run], [r[y] for r in run], color=line.get_color(), alpha=0.3, linewidth=0.8)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if ylim is not None:
        ax.set_ylim(*ylim)
    ax.grid(alpha=0.3)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def write_csv(path: Path, rows: list[dict[str, object]], fields: list[str]) -> None:
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)


def main() -> int:
    p = harness.arguments(__doc__)
    p.add_argument("comparison", choices=sorted(COMPARISONS))
    p.add_argument("--preset", default="learn_frozenlake", help="every arm's preset (preset=smollm2: the real model)")
    p.add_argument("--steps", type=int, default=60, help="learner steps per arm")
    p.add_argument("--every", type=int, default=6, help="validate every this many learner steps")
    p.add_argument("--target", type=float, default=0.5, help="validation success rate whose first crossing is timed")
    p.add_argument("--out", default=None, help="output folder (default runs/compare-<comparison>)")
    p.add_argument("--rerun", action="store_true", help="run arms again even if their run folder is finished")
    p.add_argument("--seeds", type=int, default=1, help="runs per arm, run.seed=0..N-1")
    p.add_argument("extra", nargs="*", help="overrides for every arm, after --")
    args = p.parse_intermixed_args()  # `-- overrides` after the options too (parse_args would refuse them)
    out = Path(args.out or REPO_ROOT / "runs" / f"compare-{args.comparison}")
    out.mkdir(parents=True, exist_ok=True)
    curves: dict[str, list[list[dict[str, float]]]] = {}
    rows_out, figures = [], []
    arms = COMPARISONS[args.comparison]
    if args.comparison == "preset":
        arms = (Arm(args.preset, ()),)
    for arm in arms:
        per_seed = []
        for seed in range(args.seeds):
            run_dir = out / slug(arm.label) / (f"seed{seed}" if args.seeds > 1 else "")
            seeded = Arm(arm.label, (*arm.overrides, f"run.seed={seed}") if args.seeds > 1 else arm.overrides)
            summary_path = run_dir / "summary.json"
            done = summary_path.is_file() and json.loads(summary_path.read_text()).get("status") == "finished"
            if args.rerun or not done:
                run_arm(seeded, run_dir, args.preset, args.steps, args.every, args.extra)
            summary = json.loads(summary_path.read_text())
            rows = read_rows(run_dir / CSV_NAME)
            curves.setdefault(arm.label, []).append(rows)
            rows_out += [{"arm": arm.label, "seed": seed, **r} for r in rows]
            per_seed.append(
                {
                    **key_figures(arm.label, rows, args.target, float(summary.get("launcher_wall_s", 0.0))),
                    "seed": seed,
                    "shared_step_frac": shared_step_frac(run_dir),
                }
            )
            print(f"[compare] {json.dumps(per_seed[-1])}", flush=True)
        figures += per_seed
        if args.seeds > 1:
            figures.append(mean_figures(arm.label, per_seed))
            print(f"[compare] {json.dumps(figures[-1])}", flush=True)
    write_csv(out / "curves.csv", rows_out, list(FIELDS))
    write_csv(out / "key_figures.csv", figures, list(dict.fromkeys(k for f in figures for k in f)))
    title = (
        f"{args.comparison}: FrozenLake 5x5, tiny model, CPU"
        if args.comparison != "memory"
        else "memory: FrozenLake 6x6, 30 steps, tiny model, CPU"
    )
    if args.preset != "learn_frozenlake":
        title = f"preset={args.preset}, CPU"
    plot(curves, "trajectories_trained", "trajectories trained", title, out / "success_vs_samples.png")
    plot(curves, "wall_s", "wall-clock seconds since launch", title, out / "success_vs_time.png")
    print(f"[compare] wrote {out}/curves.csv, key_figures.csv, success_vs_samples.png, success_vs_time.png", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
