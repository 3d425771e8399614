"""Supervised warm start: a new model directory that writes parseable actions (and, for FrozenLake, reads the lake).

    .venv/bin/python -m launcher.warm_start                 # .cache/tiny-model -> .cache/tiny-model-warm
    .venv/bin/python -m launcher.warm_start --map-size 5 --frozen-prob 0.9 --max-steps 16 --steps 150
    .venv/bin/python -m launcher.warm_start --env agentstream/Sokoban-v0 --max-steps 15 \
        --env-kwargs '{"dim_room": [6, 6], "num_boxes": 1, "search_depth": 30}' --out .cache/tiny-model-warm-sokoban
    .venv/bin/python -m launcher.warm_start --env agentstream/Reasoning-v0 --dataset basic_arithmetic \
        --dataset-kwargs '{"max_terms": 2, "max_digits": 1}' --out .cache/tiny-model-warm-arithmetic

What it teaches (actors/demos.py makes the demonstrations, learner/sft.py fits them): prompts are real
observations played through the actors' episode loop, built by the real memory module and the model's chat
template.
- FrozenLake: every answer is a deliberately imperfect teacher's move (`frozenlake_teacher`): with probability
  `--teacher-p` the scripted safe policy's (right or down, never into a hole or off the lake: 0.96 of held-out 5x5
  lakes), otherwise a uniformly random move. The default p makes the teacher win about 0.55 of the held-out lakes,
  so the model's states must depend on the lake to fit it, and RL has room above it. It prints (and records in
  the stamp) the teacher's and the warm model's success on the same held-out lakes (`VALIDATION_SEEDS[:64]`, the
  run's validation lakes), the warm model sampled at temperature 1 as the run validates.
  `--teacher-p 0` is the old format-only warm start (uniform moves whatever the lake).
- Sokoban: every answer is `<action>A</action>` with A drawn uniformly from the four moves, whatever the
  observation. Reasoning: every answer is `<answer>A</answer>` with A the answer of another item of the same
  generator (held-apart seeds), or an integer drawn uniformly from `--answer-range`, whatever the question. So the
  model learns to write one valid answer and stop; it learns nothing about the task (the best fit to answers
  drawn apart from the prompt is the answers' overall distribution).

Idempotent: the output folder records a hash of every input (these arguments, the base model's files, the
code of learner/sft.py, actors/demos.py, actors/episode.py, envs/ and memory/); a second call with the same
inputs does nothing. `--force` redoes it.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import hashlib
import json
import os
import random
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from actors.demos import WARM_STAMP
from agentstream.config import REPO_ROOT, TINY_MODEL_DIR, TINY_WARM_MODEL_DIR, EnvConfig, MemoryConfig

if TYPE_CHECKING:
    from actors.demos import FormatSpec
    from actors.episode import Answer, Turn

DEFAULT_OUT = TINY_WARM_MODEL_DIR
STAMP = WARM_STAMP
TEACHER_P = 0.58
"""FrozenLake's default teacher: the scripted safe move with this probability, a random one otherwise; chosen so that
the teacher wins about 0.55 of the held-out 5x5 lakes (frozen_prob 0.9, 16 steps; measured: tests/launcher/
test_warm_teacher.py)."""
HELD_OUT = 64
"""Held-out lakes the teacher and the warm model are measured on: VALIDATION_SEEDS[:64], the run's own validation."""
MOVES = ("left", "down", "right", "up")
OFFSETS = dict(zip(MOVES, ((0, -1), (1, 0), (0, 1), (-1, 0))))  # (row, column) change of each move


def input_key(args: argparse.Namespace, base: Path) -> str:
    """sha256 over the arguments that shape the result, the base model's files, the SFT code, the code that
    plays the demonstrations, and the code of the envs and memory (which make the prompts)."""
    h = hashlib.sha256()
    # Paths are not inputs (the base model's bytes are): the same model under another checkout hashes the same.
    shaping = {k: v for k, v in sorted(vars(args).items()) if k not in ("out", "force", "base")}
    h.update(json.dumps(shaping, sort_keys=True, default=str).encode())
    for f in sorted(base.iterdir()):
        if f.is_file():
            h.update(f.name.encode())
            h.update(f.read_bytes())
    for code in ("learner/sft.py", "actors/demos.py", "actors/episode.py"):
        h.update((REPO_ROOT / code).read_bytes())
    for src in sorted([*(REPO_ROOT / "envs").rglob("*.py"), *(REPO_ROOT / "memory").rglob("*.py")]):
        h.update(src.read_bytes())  # the prompts are the envs' observations, built by the memory module
    h.update(Path(__file__).read_bytes())
    return h.hexdigest()


def parser(env: str, kwargs: Mapping[str, Any] | None = None) -> Callable[[str], object]:
    """The env's own answer parser, as its traits declare it (`EnvTraits.parser`, with every move of its games where
    the parser takes the legal ones: the sample check does not know each prompt's state)."""
    from envs.registry import traits

    parse = traits(env, kwargs).answer_parser()
    if parse is None:
        raise ValueError(
            f"{env} declares no answer parser that reads an answer without the game's state, so the warm "
            f"start cannot check its sampled answers: give its EnvTraits a parser in envs/registry.py"
        )
    return parse


def lake_cells(observation: str) -> dict[str, str]:
    """What each move reaches in a FrozenLake observation (either view), read as the model reads it: "ice", "hole",
    "goal" or "off" (the lake's edge)."""
    if observation.startswith("left "):  # the local view: "left ice, down hole, right off, up ice."
        return dict(part.split(" ", 1) for part in observation.rstrip(".").split(", "))
    grid = [ln.split() for ln in observation.splitlines() if ln and not ln.startswith(("You are", "Safe moves"))]
    row = next(r for r, cells in enumerate(grid) if "P" in cells)
    col, names = grid[row].index("P"), {"F": "ice", "H": "hole", "G": "goal"}
    out = {}
    for move, (dr, dc) in OFFSETS.items():
        r, c = row + dr, col + dc
        out[move] = names[grid[r][c]] if 0 <= r < len(grid) and 0 <= c < len(grid[r]) else "off"
    return out


def safe_forward_move(cells: dict[str, str], rng: random.Random) -> str:
    """The scripted policy that wins 0.96 of the held-out 5x5 lakes (docs/experiments.md): right or down at random,
    never into a hole or off the lake; where neither is safe, any safe move; where none is, any move."""
    safe = [m for m in MOVES if cells[m] in ("ice", "goal")]
    return rng.choice([m for m in ("right", "down") if m in safe] or safe or list(MOVES))


def frozenlake_teacher(p: float) -> Callable[[Turn, random.Random], str]:
    """FrozenLake's imperfect teacher: `safe_forward_move` with probability p, a uniformly random move otherwise."""

    def choose(turn: Turn, rng: random.Random) -> str:
        return safe_forward_move(lake_cells(turn.observation), rng) if rng.random() < p else rng.choice(MOVES)

    return choose


def teacher_success(spec: FormatSpec, seeds: Sequence[int], seed: int = 0) -> float:
    """The share of `seeds` the spec's teacher wins (its own RNG, seeded: the same figure every time)."""
    from actors.demos import success_rate
    from actors.episode import Answer

    assert spec.teacher is not None
    teach, rng = spec.teacher, random.Random(seed)
    return success_rate(spec, lambda turn: Answer(spec.template.format(teach(turn, rng))), seeds)


class BatchedSampler:
    """A Hugging Face model as the answerer of many episodes at once: once every live episode waits for its turn,
    one left-padded `generate` answers them all, sampled at `temperature` (top-k and top-p off, as the engines
    sample)."""

    def __init__(self, model: Any, tokenizer: Any, live: int, max_tokens: int, temperature: float = 1.0):
        self.model, self.tokenizer, self.live = model, tokenizer, live
        self.max_tokens, self.temperature = max_tokens, temperature
        self.pending: list[tuple[list[int], asyncio.Future[Answer]]] = []

    async def __call__(self, turn: Turn) -> Answer:
        assert turn.prompt_ids is not None  # the memory has the tokenizer
        fut: asyncio.Future[Answer] = asyncio.get_running_loop().create_future()
        self.pending.append((turn.prompt_ids, fut))
        self._flush()
        return await fut

    def finished(self) -> None:
        self.live -= 1
        self._flush()

    def _flush(self) -> None:
        import torch

        from actors.episode import Answer

        if not self.pending or len(self.pending) < self.live:
            return
        batch, self.pending = self.pending, []
        width, pad, eos = max(len(ids) for ids, _ in batch), self.tokenizer.pad_token_id, self.tokenizer.eos_token_id
        prompts = torch.tensor([[pad] * (width - len(ids)) + ids for ids, _ in batch])  # [B, width], left-padded
        mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids, _ in batch])  # [B, width]
        with torch.no_grad():
            out = self.model.generate(
                prompts,
                attention_mask=mask,
                do_sample=True,
                temperature=self.temperature,
                top_k=0,
                top_p=1.0,
                max_new_tokens=self.max_tokens,
                eos_token_id=eos,
                pad_token_id=pad,
            )
        for row, (_, fut) in enumerate(batch):
            ids = out[row, width:].tolist()
            ids = ids[: ids.index(eos) + 1] if eos in ids else ids
            fut.set_result(Answer(self.tokenizer.decode(ids, skip_special_tokens=True), ids))


def model_success(
    model: Any, tokenizer: Any, spec: FormatSpec, seeds: Sequence[int], max_tokens: int, seed: int = 0
) -> float:
    """The share of `seeds` the model wins, sampled at temperature 1 (as the run validates its version 0)."""
    import torch

    from actors.demos import success_rate

    torch.manual_seed(seed)
    sampler = BatchedSampler(model, tokenizer, len(seeds), max_tokens)
    return success_rate(spec, sampler, seeds, tokenizer=tokenizer, finished=sampler.finished)


def format_spec(args: argparse.Namespace) -> FormatSpec:
    """Which env, memory and answers the demonstrations come from."""
    from actors.demos import FormatSpec

    if "Reasoning" in args.env:
        from envs.base import VALIDATION_SEEDS
        from envs.reasoning import load_item

        kwargs = {"dataset": args.dataset, "max_attempts": 1, "dataset_kwargs": json.loads(args.dataset_kwargs)}
        if args.answer_range:
            lo, hi = map(int, args.answer_range.split(","))
            answers = tuple(str(n) for n in range(lo, hi + 1))
        else:
            answers = tuple(
                str(load_item(args.dataset, seed, kwargs["dataset_kwargs"])[1]["answer"])
                for seed in VALIDATION_SEEDS[-args.answers :]
            )  # items no run trains on
        return FormatSpec(args.env, kwargs, 1, args.memory, args.k, template="<answer>{}</answer>", answers=answers)
    kwargs = (
        {
            "map_size": args.map_size,
            "frozen_prob": args.frozen_prob,
            "show_safe_moves": args.show_safe_moves,
            "view": args.view,
            **json.loads(args.env_kwargs),
        }
        if "FrozenLake" in args.env
        else json.loads(args.env_kwargs)
    )
    p = TEACHER_P if args.teacher_p is None else args.teacher_p
    teacher = frozenlake_teacher(p) if "FrozenLake" in args.env and p > 0 else None
    return FormatSpec(args.env, kwargs, args.max_steps, args.memory, args.k, teacher=teacher)


def sample_check(
    model, tokenizer, demos, parse: Callable[[str], object], n: int = 64, seed: int = 1
) -> dict[str, float]:
    """Sample answers (temperature 1) to `n` held-out prompts: fraction that parse, and the shares of the four
    most common answers."""
    import torch

    from envs.base import Action

    torch.manual_seed(seed)
    answers: collections.Counter[str] = collections.Counter()
    valid = 0
    for d in demos[:n]:
        ids = torch.tensor([d.prompt_ids])
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=True,
            temperature=1.0,
            top_k=0,
            max_new_tokens=24,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
        text = tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
        parsed = parse(text)
        if isinstance(parsed, Action):
            valid += 1
            answers[str(parsed.value)] += 1
    shares = {f"answer_{k}": v / max(1, valid) for k, v in answers.most_common(4)}
    return {"valid_fraction": valid / len(demos[:n]), **shares}


def argv_for(env: EnvConfig, memory: MemoryConfig, out: Path) -> list[str]:
    """The warm start's arguments for a run of `env` with `memory`: its demonstrations' prompts are the run's
    (FrozenLake's size, holes, step limit and view; the memory's kind and k). Other envs: ValueError."""
    if "FrozenLake" not in env.name:
        raise ValueError(
            f"model.path={out} is the warm-started tiny model, which the launcher makes for FrozenLake runs; "
            f"for env.name={env.name} make one with `python -m launcher.warm_start --env {env.name} "
            f"--out DIR` (see its --help) and set model.path=DIR"
        )
    kw = env.kwargs
    argv = [
        "--out",
        str(out),
        "--env",
        env.name,
        "--map-size",
        str(kw.get("map_size", 4)),
        "--frozen-prob",
        str(kw.get("frozen_prob", 0.8)),
        "--max-steps",
        str(env.max_steps),
        "--view",
        str(kw.get("view", "grid")),
        "--memory",
        memory.kind,
        "--k",
        str(memory.k),
    ]
    rest = {k: v for k, v in kw.items() if k == "instructions"}  # others are flags above or do not shape prompts
    return (
        argv
        + (["--show-safe-moves"] if kw.get("show_safe_moves") else [])
        + (["--env-kwargs", json.dumps(rest)] if rest else [])
    )


def ensure_warm_model(env: EnvConfig, memory: MemoryConfig, out: Path) -> None:
    """Make (or find up to date) the warm-started tiny model at `out` for this run's env and memory: a child
    process (torch and the SFT stay out of the launcher); a few seconds when nothing changed."""
    argv = [sys.executable, "-m", "launcher.warm_start", *argv_for(env, memory, out)]
    if subprocess.run(argv, check=False).returncode != 0:
        raise RuntimeError(f"the warm start failed (its messages are above): {' '.join(argv)}")


def print_success(stamp: Mapping[str, Any]) -> None:
    """The teacher's and the warm model's held-out success, where the warm start measured them."""
    if "teacher_success" in stamp:
        print(
            f"[warm-start] held-out success ({stamp['held_out_episodes']} lakes the run validates on): teacher "
            f"{stamp['teacher_success']:.2f}, warm model {stamp['warm_success']:.2f} (sampled)",
            flush=True,
        )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", default=str(TINY_MODEL_DIR), help="model to start from (the tiny model is made if absent)")
    p.add_argument("--out", default=str(DEFAULT_OUT), help="new model directory")
    p.add_argument("--env", default="agentstream/FrozenLake-v0")
    p.add_argument("--map-size", type=int, default=5)
    p.add_argument("--frozen-prob", type=float, default=0.9)
    p.add_argument("--max-steps", type=int, default=16)
    p.add_argument(
        "--show-safe-moves",
        action="store_true",
        help="FrozenLake observations say which moves are safe (the env's show_safe_moves)",
    )
    p.add_argument(
        "--view",
        default="grid",
        choices=["grid", "local"],
        help="FrozenLake's view: the whole lake, or only the four cells one move away (the env's view)",
    )
    p.add_argument(
        "--env-kwargs",
        default="{}",
        help="other envs (e.g. Sokoban): the env's arguments, a JSON object, as the run's env.kwargs",
    )
    p.add_argument("--dataset", default="basic_arithmetic", help="Reasoning: the reasoning-gym generator")
    p.add_argument("--dataset-kwargs", default="{}", help="Reasoning: the generator's arguments, a JSON object")
    p.add_argument("--answers", type=int, default=500, help="Reasoning: how many other items' answers to draw from")
    p.add_argument("--answer-range", default="", help="Reasoning: draw integers from LO,HI instead (uniformly)")
    p.add_argument("--memory", default="last_k")
    p.add_argument("--k", type=int, default=0)  # FrozenLake is Markov: the main job and learn_frozenlake use k=0
    p.add_argument("--episodes", type=int, default=400, help="random-play episodes the prompts come from")
    p.add_argument(
        "--teacher-p",
        type=float,
        default=None,
        help=f"FrozenLake: the teacher's share of scripted safe moves (default {TEACHER_P}; 0: uniform moves, the "
        "format only)",
    )
    p.add_argument("--max-tokens", type=int, default=12, help="answer length when the warm model is measured")
    p.add_argument(
        "--steps",
        type=int,
        default=None,
        help="SFT steps (default 300 with a teacher: it must read the state; else 150)",
    )
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--force", action="store_true", help="redo even if the output matches the inputs")
    args = p.parse_args()

    from launcher.tiny_model import ensure_tiny_model

    base, out = Path(args.base), Path(args.out)
    if base.resolve() == TINY_MODEL_DIR.resolve():
        ensure_tiny_model(base)
    if not (base / "config.json").is_file():
        print(f"[warm-start] --base {base} is not a model directory (no config.json)", file=sys.stderr)
        return 2
    key = input_key(args, base)
    stamp = out / STAMP
    if not args.force and stamp.is_file() and json.loads(stamp.read_text()).get("key") == key:
        print(f"[warm-start] {out} is up to date (inputs unchanged); nothing to do", flush=True)
        print_success(json.loads(stamp.read_text()))
        return 0
    print(f"[warm-start] fitting the demonstrations into {out} (once; a minute or two on 2 cores)", flush=True)

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from actors.demos import format_demos
    from envs.base import VALIDATION_SEEDS
    from learner.sft import SftOptions, train_sft

    started = time.time()
    torch.manual_seed(args.seed)
    torch.set_num_threads(min(4, os.cpu_count() or 1))  # it runs alone (the suite is serial): 2 cores ~1.5x faster
    tokenizer = AutoTokenizer.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    spec = format_spec(args)
    steps = args.steps or (300 if spec.teacher is not None else 150)
    parse = parser(args.env, spec.env_kwargs)  # (before the fit: an env without a parser stops here)
    demos = format_demos(spec, tokenizer, args.episodes, seed=args.seed)
    held_out = format_demos(spec, tokenizer, 64, seed=args.seed + 10_000)
    print(
        f"[warm-start] {len(demos)} demonstrations from {args.episodes} {'teacher' if spec.teacher else 'random'}"
        f"-play episodes of {args.env} "
        f"{spec.env_kwargs}",
        flush=True,
    )
    history = train_sft(
        model, demos, SftOptions(steps, args.batch_size, args.lr, seed=args.seed), pad_id=tokenizer.pad_token_id
    )
    check = sample_check(model, tokenizer, held_out, parse)
    print(f"[warm-start] held-out sampled answers: {check}", flush=True)
    success = {}
    if spec.teacher is not None:  # the same held-out lakes as the run's validation
        print(
            f"[warm-start] fitted in {time.time() - started:.0f}s; measuring on {HELD_OUT} held-out lakes", flush=True
        )
        seeds = [VALIDATION_SEEDS[i] for i in range(HELD_OUT)]
        success = {
            "teacher_success": teacher_success(spec, seeds, seed=args.seed),
            "warm_success": model_success(model, tokenizer, spec, seeds, args.max_tokens, seed=args.seed),
            "held_out_episodes": HELD_OUT,
        }
        print_success(success)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    if (base / "generation_config.json").is_file():
        (out / "generation_config.json").write_bytes((base / "generation_config.json").read_bytes())
    stamp.write_text(
        json.dumps(
            {
                "key": key,
                "args": vars(args),
                "demos": len(demos),
                "final": history[-1],
                "check": check,
                **success,
                "seconds": time.time() - started,
            },
            indent=2,
            default=str,
        )
    )
    print(f"[warm-start] wrote {out} in {time.time() - started:.0f}s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
