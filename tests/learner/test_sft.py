"""The format warm start's fitting (learner/sft.py): masking, the loss, and that fitting an answer works.
Making the demonstrations is tested in tests/actors/test_demos.py. ~5 s."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from learner.sft import IGNORE, SftOptions, answer_loss, collate, train_sft


@dataclass(frozen=True)
class Pair:
    """A demonstration as train_sft takes it: any record with prompt_ids and response_ids."""

    prompt_ids: list[int]
    response_ids: list[int]


def test_collate_masks_everything_but_the_answer() -> None:
    # Two demos: prompt [1,2,3] answer [4,5]; prompt [6] answer [7]. Width 5, pad 0.
    ids, labels, mask = collate([Pair([1, 2, 3], [4, 5]), Pair([6], [7])], pad_id=0)
    assert ids.tolist() == [[1, 2, 3, 4, 5], [6, 7, 0, 0, 0]]
    assert labels.tolist() == [[IGNORE, IGNORE, IGNORE, 4, 5], [IGNORE, 7, IGNORE, IGNORE, IGNORE]]
    assert mask.tolist() == [[1, 1, 1, 1, 1], [1, 1, 0, 0, 0]]


def test_answer_loss_by_hand() -> None:
    # V = 2, one row of 3 tokens, only the last labelled (token 1). It is predicted by position 1's logits
    # [0, ln 3]: p(1) = 3 / (1 + 3) = 0.75, so loss = -ln 0.75 and the argmax (1) is right.
    logits = torch.tensor([[[5.0, 0.0], [0.0, math.log(3.0)], [9.0, 9.0]]])
    labels = torch.tensor([[IGNORE, IGNORE, 1]])
    loss, stats = answer_loss(logits, labels)
    assert loss.item() == pytest.approx(-math.log(0.75), rel=1e-6)
    assert stats["token_accuracy"] == 1.0 and stats["tokens"] == 1.0


def test_answer_loss_refuses_a_batch_without_answers() -> None:
    with pytest.raises(ValueError, match="no labelled tokens"):
        answer_loss(torch.zeros(1, 3, 2), torch.full((1, 3), IGNORE))


def test_fitting_one_answer_to_many_prompts(tiny_model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    torch.manual_seed(0)
    answer = tok.encode("<action>left</action>", add_special_tokens=False) + [tok.eos_token_id]
    demos = [Pair(tok.encode(f"<|im_start|>user\nstep {i}: go left or right?<|im_end|>\n"), answer) for i in range(40)]
    history = train_sft(
        model, demos, SftOptions(steps=40, batch_size=8, lr=2e-3, warmup=5), tok.pad_token_id, log_every=0
    )
    # The random start spreads its mass over the 300-token vocabulary: ~ln 300 = 5.7 per answer token. The
    # answer never changes with the prompt, so a fitted model predicts it almost surely: loss near 0.
    assert history[0]["loss"] > 4.0 and history[-1]["loss"] < 0.5
    assert history[-1]["token_accuracy"] == 1.0
