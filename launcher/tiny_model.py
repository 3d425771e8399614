"""Make a tiny Hugging Face model directory locally, in seconds: no download.

A Qwen2ForCausalLM (hidden 128, 2 layers, 4 heads -> head_dim 32, the minimum vLLM's CPU attention takes;
tied embeddings like real Qwen2.5 0.5B/1.5B) and a byte-level BPE tokenizer trained on the environments'
own text, with ChatML special tokens and a chat template. The directory loads in transformers, peft and
vLLM like any real model directory.

    python scripts/make_tiny_model.py --out .cache/tiny-model
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any, Callable, Iterable

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
SMALL_SHAPE = {"hidden_size": 512, "num_layers": 4, "num_heads": 8, "num_kv_heads": 4}
"""The 4x wider, 2x deeper model of the same family (12.6M parameters): `bench.peer`'s speed workload (issue 38)."""


def corpus_envs() -> list[str]:
    """The registered envs whose text trains the tokenizer: every env that does not block (the Java- and
    subprocess-backed ones take seconds per episode) and whose package is installed."""
    import importlib

    import gymnasium as gym

    import envs

    names = []
    for name in envs.known_envs():
        module, _, cls = str(gym.registry[name].entry_point).partition(":")
        try:
            env_cls = getattr(importlib.import_module(module), cls)
        except ImportError:
            continue
        if not env_cls.blocking:
            names.append(name)
    return names


def env_corpus(episodes_per_env: int = 40, seed: int = 0, steps_per_episode: int = 6) -> list[str]:
    """Prompts and answers from random play of the `corpus_envs` through the actors' episode loop (random
    admissible actions, `last_k` memory), each prompt with its answer rendered with the chat template."""
    import asyncio

    from jinja2 import Template

    import envs
    import memory
    from actors import episode
    from actors.episode import Answer, StepRecord, Turn

    template = Template(CHAT_TEMPLATE)
    rng = random.Random(seed)
    texts: list[str] = []

    def draw(turn: Turn) -> Answer:
        return Answer(f"<action>{rng.choice(list(turn.info.get('admissible_actions') or ['noop']))}</action>")

    def render(step: StepRecord[Answer]) -> None:
        msgs = step.turn.messages + [{"role": "assistant", "content": step.response.text}]
        texts.append(template.render(messages=msgs, add_generation_prompt=False))

    async def play_all() -> None:
        for name in corpus_envs():
            env = envs.make(name)
            try:
                mem = memory.make("last_k", k=2)  # no tokenizer: the tokenizer is what this text trains
                for ep in range(episodes_per_env):
                    await episode.play(env, mem, draw, render, seed=seed + ep, step_limit=steps_per_episode)
            finally:
                env.close()

    asyncio.run(play_all())
    return texts


def make_tiny_model(
    out: str | Path,
    texts: Iterable[str] | None = None,
    vocab_size: int = 512,
    hidden_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    seed: int = 0,
    tied: bool = True,
    tokenizer_from: str | Path | None = None,
) -> Path:
    """Write a tiny Qwen2 model + tokenizer into `out` (created; overwritten if present); `tied`: the LM head is
    the token embedding (as in Qwen2.5 0.5B/1.5B), else a weight of its own. `tokenizer_from`: a model directory
    whose tokenizer (and chat template) the model takes instead of training one (`texts` and `vocab_size` unused): a
    student that shares its teacher's tokenizer, for distillation (docs/distillation.md)."""
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if tokenizer_from is not None:
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_from)
        tokenizer.save_pretrained(out)
    else:
        tokenizer = _train_tokenizer(out, list(texts) if texts is not None else env_corpus(seed=seed), vocab_size)

    n_vocab = len(tokenizer)
    padded_vocab = (n_vocab + 63) // 64 * 64
    eos_id = tokenizer.eos_token_id
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_id
    config = Qwen2Config(
        vocab_size=padded_vocab,
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=2048,
        tie_word_embeddings=tied,
        bos_token_id=pad_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    return save_tiny(Qwen2ForCausalLM(config), out, eos_id, pad_id, __name__, seed)


def _train_tokenizer(out: Path, corpus: list[str], vocab_size: int) -> Any:
    """A byte-level BPE tokenizer of `vocab_size` tokens trained on `corpus`, with ChatML specials and the chat
    template, saved into `out`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(corpus, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(out)
    return tokenizer


def save_tiny(model: Any, out: Path, eos_id: int, pad_id: int, made_by: str, seed: int) -> Path:
    """Save a tiny model made by `made_by` (a module) with its generation config and our marker file."""
    from transformers import GenerationConfig

    model.save_pretrained(out, safe_serialization=True)
    GenerationConfig(eos_token_id=eos_id, pad_token_id=pad_id, bos_token_id=pad_id).save_pretrained(out)
    (out / "agentstream_tiny.json").write_text(json.dumps({"made_by": made_by, "seed": seed}))
    return out


def ensure_tiny_model(path: str | Path, make: Callable[[Path], Path] = make_tiny_model) -> Path:
    """Make the tiny model at `path` with `make` unless a model directory is already there."""
    path = Path(path)
    if not (path / "config.json").is_file():
        make(path)
    return path


def ensure_small_model(path: str | Path) -> Path:
    """`ensure_tiny_model` in the `SMALL_SHAPE`."""
    return ensure_tiny_model(path, lambda out: make_tiny_model(out, **SMALL_SHAPE))
