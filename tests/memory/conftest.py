"""Fixtures of the memory tests: the tiny model's tokenizer, and 50-step FrozenLake 8x8 episodes."""

from __future__ import annotations

import random
from typing import Callable

import pytest

import envs
import memory

MOVES = {"left": (0, -1), "down": (1, 0), "right": (0, 1), "up": (-1, 0)}


def frozenlake_texts() -> list[str]:
    """FrozenLake prompts (instructions, 4x4 and 8x8 lakes, answers) to train the tiny tokenizer on."""
    env = envs.make("agentstream/FrozenLake-v0", map_size=8)
    texts = [env.instructions]
    for seed in range(20):
        for size in (4, 8):
            env.map_size = size
            obs, _ = env.reset(seed=seed)
            texts.append(
                f"<|im_start|>user\nNow (step {seed + 1}):\n{obs}<|im_end|>\n"
                f"<|im_start|>assistant\n<action>{list(MOVES)[seed % 4]}</action><|im_end|>"
            )
    return texts


@pytest.fixture(scope="session")
def tokenizer(tmp_path_factory: pytest.TempPathFactory):
    """The tiny model's tokenizer, trained on FrozenLake text as the real one is on every env's; ~3 s."""
    from transformers import AutoTokenizer

    from launcher.tiny_model import make_tiny_model

    path = make_tiny_model(tmp_path_factory.mktemp("tiny-model"), texts=frozenlake_texts())
    return AutoTokenizer.from_pretrained(path)


@pytest.fixture(scope="session")
def count(tokenizer) -> Callable[[list[dict[str, str]]], int]:
    """Prompt tokens, counted as the actor counts them (not through the memory's own code)."""
    return lambda msgs: len(
        tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False)
    )


def scripted_answer(obs: str, rng: random.Random) -> str:
    """A random move that never enters a hole or the goal (so the episode lasts), or now and then garbage."""
    if rng.random() < 0.2:
        return rng.choice(["I would go left", "<action>jump</action>"])
    grid = [line.split() for line in obs.splitlines()[:-1]]
    row, col = next((r, c) for r, line in enumerate(grid) for c, ch in enumerate(line) if ch == "P")
    size = len(grid)
    safe = [
        name
        for name, (dr, dc) in MOVES.items()
        if grid[min(max(row + dr, 0), size - 1)][min(max(col + dc, 0), size - 1)] in "FP"
    ]
    return f"<action>{rng.choice(safe)}</action>"


@pytest.fixture
def play() -> Callable[..., list[tuple[list[dict[str, str]], str]]]:
    """play(mem, seed) -> [(messages, observation)] for every step of a 50-step FrozenLake 8x8 episode."""

    def run(mem: memory.Memory, seed: int = 0) -> list[tuple[list[dict[str, str]], str]]:
        env = envs.make("agentstream/FrozenLake-v0", map_size=8, max_steps=50)
        rng = random.Random(seed)
        obs, info = env.reset(seed=seed)
        mem.reset(env.instructions)
        seen = []
        while True:
            msgs = mem.messages(obs)
            seen.append((msgs, obs))
            answer = scripted_answer(obs, rng)
            next_obs, reward, terminated, truncated, info = env.step(answer)
            mem.record(obs, answer, reward=reward, info=info)
            obs = next_obs
            if terminated or truncated:
                env.close()
                assert len(seen) == 50 and truncated, "the scripted policy must last the 50 steps"
                return seen

    return run
