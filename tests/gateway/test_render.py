"""The next turn's prompt ids without re-tokenising the answer (gateway/render.py), held against the slow, obvious
reference: rendering and tokenising the whole chat again. A small byte-level BPE tokenizer with ChatML specials is
trained here (no model, no engine).

    .venv/bin/python -m pytest tests/gateway/test_render.py -q -p no:cacheprovider      # ~2 s
"""

import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from agentstream.config import REPO_ROOT
from gateway.render import Renderer, ended_with_eos
from launcher.tiny_model import CHAT_TEMPLATE

TOOLS_TEMPLATE = (REPO_ROOT / "gateway/templates/chatml_tools.jinja").read_text()
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "Find a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = [
        "<|im_start|>user\nWhere is paris? The city of lights.<|im_end|>\n<|im_start|>assistant\n"
        '<tool_call>\n{"name": "lookup", "arguments": {"city": "paris"}}\n</tool_call><|im_end|>\n'
        "<tool_response>\nFrance\n</tool_response>"
    ] * 20
    bpe.train_from_iterator(corpus, trainer=trainer)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


@pytest.mark.parametrize("template, tools", [(None, []), (TOOLS_TEMPLATE, TOOLS), (TOOLS_TEMPLATE, [])])
def test_extending_equals_rendering_anew_when_the_answer_tokenises_canonically(tokenizer, template, tools) -> None:
    r = Renderer(tokenizer, template)
    rng = random.Random(0)
    for _ in range(20):
        msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Where is paris?"}]
        prompt = r.full(msgs, tools)
        for _turn in range(3):
            text = "".join(rng.choice(["The city", " of", " lights", " paris", "!", " 42", "\n"]) for _ in range(5))
            # The answer as the engine would return it: its canonical ids, ended by the end-of-turn token or cut
            # by max_tokens (then the template's closing <|im_end|> comes with the suffix).
            stopped = rng.random() < 0.7
            answer = r.encode(text) + ([tokenizer.eos_token_id] if stopped else [])
            new = rng.choice(
                [
                    [{"role": "user", "content": "And rome?"}],
                    [
                        {"role": "tool", "content": "France", "tool_call_id": "c1"},
                        {"role": "tool", "content": "Italy", "tool_call_id": "c2"},
                    ],
                ]
            )
            tail = r.suffix(new, tools, ended_with_eos(answer, r.eos_id))
            msgs = msgs + [{"role": "assistant", "content": text}] + new
            assert prompt + answer + tail == r.full(msgs, tools)  # the reference: the whole chat, tokenised again
            prompt = prompt + answer + tail


def test_the_suffix_is_what_the_template_adds_after_the_answer(tokenizer) -> None:
    r = Renderer(tokenizer, TOOLS_TEMPLATE)
    new = [{"role": "tool", "content": "France", "tool_call_id": "c1"}]
    # By hand from the template: after an answer ended by <|im_end|> (written by the model) comes "\n", then the
    # tool result as one user turn, then the generation prompt; a cut answer gets the <|im_end|> first.
    turn = "<|im_start|>user\n<tool_response>\nFrance\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.decode(r.suffix(new, TOOLS, ended_with_eos=True)) == "\n" + turn
    assert tokenizer.decode(r.suffix(new, TOOLS, ended_with_eos=False)) == "<|im_end|>\n" + turn


def test_a_template_that_rewrites_earlier_turns_gives_no_suffix(tokenizer) -> None:
    # This template numbers the turns from the end: adding a message changes what came before it.
    template = (
        "{% for m in messages %}{{ (messages|length - loop.index)|string + m['content'] }}{% endfor %}"
        "{% if add_generation_prompt %}>{% endif %}"
    )
    assert Renderer(tokenizer, template).suffix([{"role": "user", "content": "x"}], [], True) is None
