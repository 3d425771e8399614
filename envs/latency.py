"""Simulated env step latency: how long a tool call or a web page takes, drawn from a log-normal.

Agent workloads wait on slow tools far more than on the game itself; benchmarks (bench/overlap.py)
set `env.step_latency_mean_s` so that an episode's wall time looks like theirs. The actor awaits the delay
with `asyncio.sleep`, so other episodes keep running meanwhile.

    rng = random.Random(0)
    delay = sample_latency(rng, mean_s=0.05, sigma=0.5)   # seconds, mean 0.05 over many draws
"""

from __future__ import annotations

import math
import random


def lognormal_mu(mean_s: float, sigma: float) -> float:
    """mu of a log-normal whose mean is `mean_s`: E[X] = exp(mu + sigma^2 / 2)  =>  mu = ln(mean) - sigma^2 / 2."""
    if mean_s <= 0:
        raise ValueError(f"a log-normal latency needs mean_s > 0, got {mean_s}")
    return math.log(mean_s) - sigma * sigma / 2


def sample_latency(rng: random.Random, mean_s: float, sigma: float) -> float:
    """One delay in seconds: 0 when mean_s == 0 (no latency), else log-normal with mean `mean_s` and shape
    `sigma` (the std of the underlying normal; 0 gives exactly mean_s every time)."""
    if mean_s == 0:
        return 0.0
    if mean_s < 0 or sigma < 0:
        raise ValueError(f"env.step_latency_mean_s={mean_s} and env.step_latency_sigma={sigma} must be >= 0")
    return rng.lognormvariate(lognormal_mu(mean_s, sigma), sigma)
