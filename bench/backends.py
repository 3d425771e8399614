"""What Ray costs: the same run with launcher.backend=local and launcher.backend=ray, side by side on this host.

    .venv/bin/python -m bench.backends [--steps 10] [--ray-node-ip IP] [-- OVERRIDES...]

Both runs are the real launcher (`scripts/launch.py`: broker, vLLM engine + weight sidecar, torchrun learner, actors)
with the same overrides; the Ray run starts a Ray instance of its own on this host (`launcher.ray_address` empty),
so its start-up includes Ray's. Per run: start-up = launch to the broker's first ingested transition (its
metrics.jsonl); steady env steps/s = the mean of the broker's env_steps_per_s from the learner's first step to the
last; the launcher's wall time. The last line is the ratio ray/local of the steady rate (1.0: Ray adds nothing
once placed).
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from bench import harness


def run(backend: str, steps: int, node_ip: str, overrides: list[str], out: Path) -> dict[str, float]:
    run_dir = out / backend
    sets = [
        f"trainer.total_steps={steps}",
        f"launcher.backend={backend}",
        "broker.dashboard_port=0",
        *overrides,
    ]  # 0: never the fixed default's clash
    if backend == "ray" and node_ip:
        sets.append(f"launcher.ray_node_ip={node_ip}")
    t0, wall, _ = harness.run_launcher(run_dir, sets, f"with launcher.backend={backend}", timeout_s=1800)
    points = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    first = next(p["t"] for p in points if p["transitions_per_s"] > 0)
    steady = [p["env_steps_per_s"] for p in points if p["learner_version"] >= 1]
    return {"startup_s": first - t0, "env_steps_per_s": sum(steady) / max(len(steady), 1), "wall_s": wall}


def main() -> None:
    p = harness.arguments(__doc__)
    p.add_argument("--steps", type=int, default=10, help="learner steps per run")
    p.add_argument(
        "--ray-node-ip",
        default="",
        help="this host's IP for Ray (empty: the launcher's 127.0.0.2, which keeps the run on loopback)",
    )
    p.add_argument("overrides", nargs="*", help="config overrides for both runs (after --)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-backends-") as tmp:
        rows = {b: run(b, args.steps, args.ray_node_ip, args.overrides, Path(tmp)) for b in ("local", "ray")}
    print(f"{'backend':8} {'start-up s':>11} {'env steps/s':>12} {'wall s':>8}")
    for backend, r in rows.items():
        print(f"{backend:8} {r['startup_s']:11.1f} {r['env_steps_per_s']:12.1f} {r['wall_s']:8.1f}")
    print(f"start-up ray - local: {rows['ray']['startup_s'] - rows['local']['startup_s']:+.1f} s")
    print(f"steady env steps/s ray/local: {rows['ray']['env_steps_per_s'] / rows['local']['env_steps_per_s']:.2f}")


if __name__ == "__main__":
    main()
