"""The TRL side of `bench/peer.py`: Hugging Face TRL's `GRPOTrainer` (one process, HF `generate`,
synchronous) on prompts that agentstream's actors would send, one JSON line of timings per step.

    .cache/peer-venv/bin/python -m bench.peer_trl --prompts prompts.jsonl --model .cache/tiny-model \
        --batch 16 --steps 8 --out /tmp/trl-run

It runs in the peer venv (torch, trl, transformers, reasoning_gym; `bench.peer` makes it), from the repository
(`bench/__init__.py` imports nothing), and imports nothing of the project, so that TRL's own pins decide what it
runs. Each line of `--prompts` holds one group's prompt as already templated text (`prompt`), its token ids as
agentstream's engine gets them (`prompt_ids`, checked against this tokenizer at start), and the reasoning-gym item
it asks about (`dataset`, `seed`, the generator's arguments `kwargs`): the reward is the generator's own
`score_answer` on the last `<answer>...</answer>` (`--answer-format last_number`: else on the last number in the
completion), and `--invalid-penalty` for a completion without one, as agentstream's env and actor score it.

`--lora-rank R` (with `--lora-alpha`, `--lora-targets`, `--lora-dropout`) trains a peft LoRA adapter, passed to
`GRPOTrainer` as its `peft_config`; `--gradient-checkpointing` recomputes each decoder layer in backward (TRL turns it
off while generating), as agentstream's `learner.activation_checkpointing` does.

Printed, one JSON object a line: {"event": "ready", "t"} once the trainer is built; then per optimizer step
{"event": "step", "step", "t_begin", "t_generated", "t"}: the wall clock at the step's start, when its
completions reached the reward function (generation done) and at its end; then {"event": "log", "step",
"reward_mean"} (TRL's mean reward of the step).

`bench.peer_step` uses two more options: `--completions FILE` (one JSON line per prompt: `prompt_ids` and its G
completions' token ids, `completions`) makes TRL train on those completions instead of generating (its
`_generate_single_turn` replaced; everything after it is TRL's own), and `--dump FILE` saves, with `torch.save`,
each parameter's gradient as the optimizer step gets it (after clipping), the weights after the last step and
TRL's logged grad norm and loss.
"""

from __future__ import annotations

import argparse
import functools
import json
import re
import time
from pathlib import Path
from typing import Any

_ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL | re.IGNORECASE)  # as envs/reasoning.py
_NUMBER_RE = re.compile(r"-?\d+(?:\.\d+)?")  # as envs/reasoning.py
ANSWER_FORMATS = ("tag", "last_number")


def emit(**fields: Any) -> None:
    print(json.dumps(fields), flush=True)


@functools.lru_cache(maxsize=4096)
def item(dataset: str, seed: int, kwargs_json: str) -> tuple[Any, dict[str, Any]]:
    """The reasoning-gym item agentstream's env resets to at `seed`: (dataset, entry)."""
    import reasoning_gym

    data = reasoning_gym.create_dataset(dataset, seed=seed, size=1, **json.loads(kwargs_json))
    return data, data[0]


def parse(text: str, answer_format: str = "tag") -> str:
    """The answer agentstream's env reads (envs/reasoning.py's `parse_answer` / `parse_last_number`): the last
    non-empty `<answer>` tag; with "last_number" and no such tag, the last number in `text`; "" when none."""
    matches = _ANSWER_RE.findall(text)
    answer = matches[-1].strip() if matches else ""
    if answer or answer_format == "tag":
        return answer
    numbers = _NUMBER_RE.findall(text)
    return numbers[-1] if numbers else ""


def score(
    text: str, dataset: str, seed: int, kwargs_json: str, invalid_penalty: float, answer_format: str = "tag"
) -> float:
    """The answer (`parse`) scored by the generator's verifier; no answer: the invalid penalty."""
    answer = parse(text, answer_format)
    if not answer:
        return invalid_penalty
    data, entry = item(dataset, seed, kwargs_json)
    try:
        return float(data.score_answer(answer, entry))
    except Exception:  # noqa: BLE001 - as envs/reasoning.py: a verifier that crashes on an odd answer scores 0
        return 0.0


def load_prompts(path: Path, tokenizer: Any) -> list[dict[str, Any]]:
    """The groups' rows; fails if this tokenizer does not turn a prompt's text into agentstream's token ids
    (TRL tokenizes string prompts itself, so the two sides would then train on different prompts)."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line]
    for row in rows:
        ids = tokenizer(text=row["prompt"])["input_ids"]
        if ids != row["prompt_ids"]:
            raise SystemExit(
                f"seed {row['seed']}: the tokenizer gives {len(ids)} ids for the prompt text, "
                f"agentstream's engine gets {len(row['prompt_ids'])} different ones"
            )
    return rows


def arguments() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=Path, required=True, help="JSONL from bench.peer, one group a line")
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", type=Path, required=True, help="TRL's output_dir (nothing is saved there)")
    parser.add_argument("--batch", type=int, default=16, help="completions per optimizer step")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    parser.add_argument("--invalid-penalty", type=float, default=-0.1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--answer-format", choices=ANSWER_FORMATS, default="tag", help="as the env's answer_format")
    parser.add_argument("--lora-rank", type=int, default=0, help="> 0: train a LoRA adapter of this rank")
    parser.add_argument("--lora-alpha", type=float, default=16.0)
    parser.add_argument("--lora-targets", default="", help="the adapted linear layers' names, a comma list")
    parser.add_argument("--lora-dropout", type=float, default=0.0)
    parser.add_argument("--gradient-checkpointing", action="store_true", help="recompute each layer in backward")
    parser.add_argument("--completions", type=Path, help="train on these completions instead of generating")
    parser.add_argument(
        "--dump",
        type=Path,
        help="save the clipped gradients, the weights after the last step and TRL's logged grad norm and loss here",
    )
    return parser


def grpo_settings(args: argparse.Namespace) -> dict[str, Any]:
    """`GRPOConfig`'s arguments (without `output_dir`): agentstream's GRPO on one process. Its loss: PPO-clip with
    clip-higher (agentstream's algorithm.clip_low/clip_high), no KL (beta 0), token-mean over the batch (TRL's
    default loss_type "dapo"), advantages normalised by the group's std (TRL's default scale_rewards "group");
    AdamW at a constant lr, no weight decay, gradients clipped at norm 1 (agentstream's learner defaults); one
    optimizer step per generated batch, so every completion is trained on by the weights that sampled it."""
    return {
        "use_cpu": True,
        "bf16": False,
        "fp16": False,
        "seed": args.seed,
        "max_steps": args.steps,
        "per_device_train_batch_size": args.batch,
        "gradient_accumulation_steps": 1,
        "num_generations": args.group_size,
        "max_completion_length": args.max_tokens,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "learning_rate": args.lr,
        "lr_scheduler_type": "constant",
        "warmup_steps": 0,
        "weight_decay": 0.0,
        "max_grad_norm": 1.0,
        "beta": 0.0,
        "epsilon": 0.2,
        "epsilon_high": 0.28,  # agentstream's algorithm.clip_low/clip_high
        "use_vllm": False,  # HF generate in this process: vLLM would need a server or a GPU-colocated engine
        "gradient_checkpointing": args.gradient_checkpointing,
        **({"gradient_checkpointing_kwargs": {"use_reentrant": False}} if args.gradient_checkpointing else {}),
        "shuffle_dataset": False,
        "report_to": "none",
        "logging_steps": 1,
        "save_strategy": "no",
        "eval_strategy": "no",
        "disable_tqdm": True,
        "dataloader_num_workers": 0,
    }


def lora_config(args: argparse.Namespace) -> Any:
    """peft's LoraConfig for `--lora-rank` > 0 (agentstream's learner.model.LoraSpec: the same fields), else None."""
    if args.lora_rank <= 0:
        return None
    from peft import LoraConfig, TaskType

    return LoraConfig(
        task_type=TaskType.CAUSAL_LM,
        r=args.lora_rank,
        lora_alpha=args.lora_alpha,
        target_modules=[t for t in args.lora_targets.split(",") if t],
        lora_dropout=args.lora_dropout,
        bias="none",
    )


def main() -> None:
    args = arguments().parse_args()

    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    torch.set_num_threads(args.threads)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    rows = load_prompts(args.prompts, tokenizer)
    if len(rows) < args.steps * args.batch // args.group_size:
        raise SystemExit(f"{len(rows)} prompts for {args.steps} steps of {args.batch // args.group_size} groups")
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    dataset = Dataset.from_list(
        [
            {
                "prompt": r["prompt"],
                "task": r["dataset"],
                "seed": r["seed"],
                "kwargs": json.dumps(r.get("kwargs") or {}, sort_keys=True),
            }
            for r in rows
        ]
    )
    marks: dict[str, float] = {}
    dumped: dict[str, Any] = {}

    def reward(completions: list[str], task: list[str], seed: list[int], kwargs: list[str], **_: Any) -> list[float]:
        marks["generated"] = time.time()
        return [
            score(c, d, s, k, args.invalid_penalty, args.answer_format)
            for c, d, s, k in zip(completions, task, seed, kwargs, strict=True)
        ]

    class Timings(TrainerCallback):
        def on_step_begin(self, *_: Any, **__: Any) -> None:
            marks["begin"] = time.time()

        def on_step_end(self, _args: Any, state: Any, *_: Any, **__: Any) -> None:
            emit(
                event="step",
                step=state.global_step,
                t_begin=marks.get("begin"),
                t_generated=marks.get("generated"),
                t=time.time(),
            )

        def on_log(
            self, _args: Any, state: Any, _control: Any, logs: dict[str, float] | None = None, **__: Any
        ) -> None:
            if logs and "reward" in logs:  # TRL's mean reward of the step's completions
                emit(event="log", step=state.global_step, reward_mean=logs["reward"])
            if logs and args.dump and "grad_norm" in logs:  # a step's log, not the run's summary
                dumped["logs"] = dict(logs)

        def on_pre_optimizer_step(self, *_: Any, model: Any = None, **__: Any) -> None:  # after clipping
            if args.dump:
                dumped["grads"] = {
                    n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None
                }

    config = GRPOConfig(output_dir=str(args.out), **grpo_settings(args))
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[Timings()],
        peft_config=lora_config(args),
    )
    if args.completions:
        trainer._generate_single_turn = replay(args.completions)
    emit(event="ready", t=time.time())
    trainer.train()
    emit(event="done", t=time.time())
    if args.dump:
        torch.save({**dumped, "weights": {n: p.detach().clone() for n, p in model.named_parameters()}}, args.dump)


def replay(path: Path) -> Any:
    """A stand-in for `GRPOTrainer._generate_single_turn`: each prompt's next recorded completion (ids up to and with
    the first EOS, as TRL keeps them), in the order TRL asks (each prompt G times in a row)."""
    recorded = {tuple(r["prompt_ids"]): list(r["completions"]) for r in map(json.loads, path.read_text().splitlines())}

    def generate(prompt_ids: list[list[int]], *_: Any, **__: Any) -> tuple[list[list[int]], None]:
        return [recorded[tuple(ids)].pop(0) for ids in prompt_ids], None

    return generate


if __name__ == "__main__":
    main()
