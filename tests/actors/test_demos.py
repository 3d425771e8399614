"""The format warm start's demonstrations (actors/demos.py): valid, uniform moves on the actor's own prompts,
and a model that fits them writes parseable actions. ~20 s."""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch

import envs
from actors.demos import FormatSpec, format_demos
from envs.base import Action
from envs.frozenlake import parse_action
from learner.sft import SftOptions, train_sft

torch.set_num_threads(1)  # two shared cores: never let a test fan out

SPEC = FormatSpec("agentstream/FrozenLake-v0", {"map_size": 5, "frozen_prob": 0.9}, max_steps=6)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from launcher.tiny_model import make_tiny_model

    # The tokenizer learns FrozenLake's text only (seconds; the real tiny model's corpus covers every env).
    env = envs.make(SPEC.env, **SPEC.env_kwargs)
    texts = [env.instructions] + [env.reset(seed=s)[0] for s in range(30)]
    texts += [f"<|im_start|>assistant\n<action>{a}</action><|im_end|>" for a in ("left", "down", "right", "up")]
    path = make_tiny_model(tmp_path_factory.mktemp("sft") / "tiny", texts=texts)
    return AutoTokenizer.from_pretrained(path), AutoModelForCausalLM.from_pretrained(path)


def test_demos_are_valid_uniform_moves_on_real_prompts(tiny) -> None:
    tok, _ = tiny
    demos = format_demos(SPEC, tok, episodes=60, seed=3)
    moves = Counter()
    for d in demos:
        answer = tok.decode(d.response_ids, skip_special_tokens=True)
        parsed = parse_action(answer)
        assert isinstance(parsed, Action), answer
        moves[parsed.value] += 1
        assert d.response_ids[-1] == tok.eos_token_id
        assert tok.decode(d.prompt_ids).endswith("<|im_start|>assistant\n")  # the actor's generation prompt
    # Uniform over 4 moves: each share within 0.25 +- 0.08 (n is a few hundred, std ~0.02-0.03).
    assert len(demos) >= 150
    for m in range(4):
        assert abs(moves[m] / len(demos) - 0.25) < 0.08, moves


def test_the_same_seed_makes_the_same_demos(tiny) -> None:
    tok, _ = tiny
    a, b = format_demos(SPEC, tok, episodes=5, seed=7), format_demos(SPEC, tok, episodes=5, seed=7)
    assert a == b and a != format_demos(SPEC, tok, episodes=5, seed=8)


def test_fitting_the_demos_makes_sampled_answers_parse(tiny) -> None:
    tok, model = tiny
    torch.manual_seed(0)
    demos = format_demos(SPEC, tok, episodes=40, seed=0)
    history = train_sft(
        model, demos, SftOptions(steps=60, batch_size=16, lr=2e-3, warmup=5), tok.pad_token_id, log_every=0
    )
    # The answer is 4 moves x ~7 tokens; a model that only learned the format has loss ~ln(4)/7 ~ 0.2 per
    # token, far below the ~6.2 (ln 512) of the random start.
    assert history[0]["loss"] > 4.0 and history[-1]["loss"] < 1.0
    rng = random.Random(0)
    valid = 0
    for d in rng.sample(demos, 20):
        ids = torch.tensor([d.prompt_ids])
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=True,
            max_new_tokens=16,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
        )
        valid += isinstance(parse_action(tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True)), Action)
    assert valid >= 15, f"only {valid}/20 sampled answers parse after the warm start"


def test_an_env_without_admissible_actions_answers_from_the_given_answers(tiny) -> None:
    from envs.reasoning import parse_answer

    tok, _ = tiny
    spec = FormatSpec(
        "agentstream/Reasoning-v0",
        {"dataset": "basic_arithmetic", "max_attempts": 1},
        max_steps=1,
        template="<answer>{}</answer>",
        answers=("7", "-3", "12"),
    )
    demos = format_demos(spec, tok, episodes=60, seed=0)
    assert len(demos) == 60  # one answer ends a one-attempt episode
    drawn = Counter(parse_answer(tok.decode(d.response_ids, skip_special_tokens=True)) for d in demos)
    assert set(drawn) == {Action("7"), Action("-3"), Action("12")}  # drawn from the answers only, each drawn
    assert all(n >= 8 for n in drawn.values()), drawn  # uniform: 20 each expected, P(< 8) ~ 1e-4
    questions = {tok.decode(d.prompt_ids) for d in demos}
    assert len(questions) > 50 and all("Calculate" in q for q in questions)  # the env's own questions
    with pytest.raises(ValueError, match="FormatSpec.answers"):
        format_demos(FormatSpec(spec.env, spec.env_kwargs, 1), tok, episodes=1)
