"""Env speed: steps/s and resets/s of every registered env under a random policy, as a table.

    .venv/bin/python -m bench.envs [--seconds 2] [--env agentstream/Sokoban-v0 ...]

The policy answers `<action>A</action>` with A drawn from `info["admissible_actions"]` (junk text when an
env gives none), resetting with a fresh seed whenever an episode ends. One process, one core.
"""

from __future__ import annotations

import random
import time

import envs
from bench import harness


def bench(name: str, seconds: float) -> tuple[float, float, int]:
    """(steps/s, resets/s, episodes) for `name` over about `seconds` of wall time."""
    env = envs.make(name)
    rng = random.Random(0)
    steps = resets = 0
    reset_time = 0.0
    t0 = time.perf_counter()
    obs, info = env.reset(seed=0)
    reset_time += time.perf_counter() - t0
    resets += 1
    while time.perf_counter() - t0 < seconds:
        actions = info.get("admissible_actions") or ["noop"]
        _, _, term, trunc, info = env.step(f"<action>{rng.choice(actions)}</action>")
        steps += 1
        if term or trunc:
            r0 = time.perf_counter()
            obs, info = env.reset(seed=resets)
            reset_time += time.perf_counter() - r0
            resets += 1
    total = time.perf_counter() - t0
    env.close()
    step_time = total - reset_time
    return steps / max(step_time, 1e-9), resets / max(reset_time, 1e-9), resets


def main() -> None:
    parser = harness.arguments(__doc__)
    parser.add_argument("--seconds", type=float, default=2.0, help="wall time per env")
    parser.add_argument("--env", action="append", help="env id (repeatable); default: every registered env")
    args = parser.parse_args()
    print(f"{'env':<34} {'steps/s':>10} {'resets/s':>10} {'episodes':>9}")
    for name in args.env or [n for n in envs.known_envs() if not envs.traits(n).remote]:  # (no server here)
        try:
            steps_s, resets_s, episodes = bench(name, args.seconds)
        except (ImportError, ModuleNotFoundError) as exc:
            print(f"{name:<34} skipped: {exc}")
            continue
        print(f"{name:<34} {steps_s:>10.0f} {resets_s:>10.0f} {episodes:>9}")


if __name__ == "__main__":
    main()
