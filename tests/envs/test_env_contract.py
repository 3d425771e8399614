"""The contract every registered env keeps (runs over `envs.known_envs()`, so new envs are covered too).

- gymnasium's own `check_env` passes, with its warnings turned into errors;
- a seed fixes everything: the same seed gives the same first observation and the same transitions
  under the same answers, G copies reset to one seed start identical, and neither the global RNGs nor
  other envs stepping in between change that (episodes share one process);
- `step` never raises on arbitrary text, and unparseable text is an invalid, non-moving step;
- `info` carries valid/success/anchor (and admissible actions that parse, when given);
- training and validation seed ranges are disjoint;
- `blocking` is declared (a bool), True exactly for the envs whose calls block.
An env whose package is not installed fails: scripts/setup.sh installs every env's package.
"""

from __future__ import annotations

import random
import string
import warnings

import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env

import envs
from envs.base import TRAIN_SEEDS, VALIDATION_SEEDS, TextEnv, seed_split

# An env played on a server (OpenEnv's) is built only with one: tests/envs/test_openenv.py holds it to this contract
# against a real server.
ALL = [name for name in envs.known_envs() if not envs.traits(name).remote]
# Envs backed by a JVM, a C planner, SQLite or subprocesses: the actor runs their reset/step in a thread.
BLOCKING = {
    "agentstream/ALFWorld-v0",
    "agentstream/SkyRL-v0",
    "agentstream/TWX-CookingWorld-v0",
    "agentstream/TWX-TWC-v0",
}


def make(name: str, **kwargs):
    # No skip for a missing package: scripts/setup.sh installs every env's package, so an ImportError here
    # is a broken set-up and must fail.
    return envs.make(name, **kwargs)


def answers(info: dict, rng: random.Random, n: int) -> list[str]:
    """A fixed mix of admissible answers and junk, drawn from `rng` (the same list for the same rng)."""
    out = []
    for _ in range(n):
        actions = info.get("admissible_actions") or []
        if actions and rng.random() < 0.8:
            out.append(f"<action>{rng.choice(actions)}</action>")
        else:
            out.append(rng.choice(["", "hello", "<action>", "<action>zzz</action>", "up up"]))
    return out


def rollout(env, seed: int, n: int = 12) -> list[tuple]:
    """(obs, reward, terminated, truncated, valid, anchor) per step, answers derived from the seed."""
    rng = random.Random(seed)
    obs, info = env.reset(seed=seed)
    trace = [(obs, info["anchor"])]
    for text in answers(info, rng, n):
        obs, reward, term, trunc, info = env.step(text)
        trace.append((obs, float(reward), bool(term), bool(trunc), info["valid"], info["anchor"]))
        if term or trunc:
            obs, info = env.reset()
            trace.append((obs, info["anchor"]))
    return trace


@pytest.mark.parametrize("name", ALL)
def test_gymnasium_check_env(name: str) -> None:
    env = make(name)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # gymnasium reports most problems as warnings: none allowed
        check_env(env)


@pytest.mark.parametrize("name", ALL)
def test_same_seed_same_episode(name: str) -> None:
    first = rollout(make(name), seed=5)
    random.seed(0)
    np.random.seed(0)  # the global RNGs must not matter
    assert rollout(make(name), seed=5) == first
    env = make(name)
    rollout(env, seed=6)  # an env re-seeded after other episodes replays the same episode
    assert rollout(env, seed=5) == first


@pytest.mark.parametrize("name", ALL)
def test_each_env_samples_its_spaces_with_its_own_generator(name: str) -> None:
    first, second = make(name), make(name)
    assert first.action_space is not second.action_space
    first.action_space.seed(7)
    expected = first.action_space.sample()
    first.action_space.seed(7)
    second.action_space.seed(8)
    second.action_space.sample()  # the other env's draws do not move this one's
    assert first.action_space.sample() == expected


@pytest.mark.parametrize("name", ALL)
def test_group_copies_start_identical_and_interleaving_is_harmless(name: str) -> None:
    group = [make(name) for _ in range(4)]
    starts = [env.reset(seed=123) for env in group]
    assert all(obs == starts[0][0] and info["anchor"] == starts[0][1]["anchor"] for obs, info in starts)
    # step copies in lock-step, interleaved with an unrelated env: the traces match a lone run
    other = make(name)
    other.reset(seed=999)
    rng = random.Random(1)
    texts = answers(starts[0][1], rng, 6)
    traces: list[list] = [[] for _ in group]
    for text in texts:
        for env, trace in zip(group, traces):
            other.step(text)
            trace.append(env.step(text)[:4])
    assert all(t == traces[0] for t in traces)


@pytest.mark.parametrize("name", ALL)
def test_step_never_raises_on_random_text(name: str) -> None:
    env = make(name, max_steps=10**6)
    obs, info = env.reset(seed=0)
    rng = random.Random(0)
    pieces = ["<action>", "</action>", "<", ">", "/", "action", "\n", "ü", "\x00", "√", "{", '"action":']
    for _ in range(300):
        text = "".join(
            rng.choice(pieces) if rng.random() < 0.3 else rng.choice(string.printable)
            for _ in range(rng.randint(0, 60))
        )
        obs, reward, term, trunc, info = env.step(text)
        assert isinstance(obs, str) and isinstance(info["valid"], bool)
        if not info["valid"]:
            assert reward == env.invalid_reward and not term and info.get("parse_error")
        if term or trunc:
            obs, info = env.reset()


@pytest.mark.parametrize("name", ALL)
def test_info_keys_and_admissible_actions_parse(name: str) -> None:
    env = make(name)
    obs, info = env.reset(seed=3)
    for key in ("valid", "success", "anchor"):
        assert key in info, f"{name}: reset info lacks {key!r}"
    assert isinstance(info["anchor"], str) and info["anchor"]
    admissible = info.get("admissible_actions") or []
    for action in random.Random(0).sample(admissible, min(4, len(admissible))):  # a few: resets can be slow
        env.reset(seed=3)
        _, _, _, _, step_info = env.step(f"<action>{action}</action>")
        assert step_info["valid"], f"{name}: admissible action {action!r} did not parse"
        for key in ("valid", "success", "anchor"):
            assert key in step_info


@pytest.mark.parametrize("name", ALL)
def test_every_env_resets_on_the_edges_of_the_seed_ranges(name: str) -> None:
    env = make(name)
    for seed in (TRAIN_SEEDS[0], TRAIN_SEEDS[-1], VALIDATION_SEEDS[0], VALIDATION_SEEDS[-1]):
        obs, _ = env.reset(seed=seed)
        assert obs


@pytest.mark.parametrize("name", ALL)
def test_blocking_is_declared(name: str) -> None:
    """Callers read `env.blocking` (no default) to choose between a direct call and a thread."""
    env = make(name)
    try:
        assert isinstance(env, TextEnv)
        assert env.blocking is (name in BLOCKING), f"{name}: blocking={env.blocking!r}"
    finally:
        env.close()


def test_seed_ranges_are_disjoint() -> None:
    assert TRAIN_SEEDS.stop <= VALIDATION_SEEDS.start  # ranges with step 1: disjoint iff they do not overlap
    assert VALIDATION_SEEDS.stop <= 2**32  # numpy seeds must fit 32 bits (FrozenLake seeds its map with it)
    assert seed_split(0) == "train" and seed_split(10**9) == "validation"
    with pytest.raises(ValueError, match="outside"):
        seed_split(-1)
