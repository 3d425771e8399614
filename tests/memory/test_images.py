"""Memory with pictures: the chat parts and `prompt_images` of "current" and "last_k" (worked out by hand),
"none" unchanged from the text-only memory, the budget dropping history pictures oldest first (counted)
before any history step and never the current picture, and, on random episodes of every kind and mode,
one picture per image part, each before the text of the step it shows, within the budget."""

import random
import re

import numpy as np
import pytest

import memory
from memory.prompt import CUT_MARK

IMAGE = {"type": "image"}
IMAGE_TOKENS = 40
# The tiny model's chat template, with part lists rendered as a vision-language template renders them: an
# image part as "<image>", text parts as they are.
VL_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ '<image>' }}{% else %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}{{ '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


class VisionTokenizer:
    """The tiny tokenizer with `VL_TEMPLATE` (the session's tokenizer stays as it is for the other tests)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def apply_chat_template(self, messages, **kwargs):
        return self.tokenizer.apply_chat_template(messages, chat_template=VL_TEMPLATE, **kwargs)


@pytest.fixture(scope="module")
def vl(tokenizer) -> VisionTokenizer:
    return VisionTokenizer(tokenizer)


def tokens(vl: VisionTokenizer, messages) -> int:
    """Prompt tokens as the model sees them, counted here: the template's ids, plus IMAGE_TOKENS per image."""
    ids = vl.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    images = sum(part == IMAGE for m in messages if isinstance(m["content"], list) for part in m["content"])
    return len(ids) + IMAGE_TOKENS * images


def picture(i: int) -> np.ndarray:
    """The picture of observation i: distinct per i, and says which it is (its pixels are i)."""
    return np.full((2, 3, 3), i, dtype=np.uint8)


def text(s: str) -> dict:
    return {"type": "text", "text": s}


def three_steps(mem: memory.Memory) -> None:
    """Observations o1..o3 answered a1..a3, each picture i arriving as the env gives it: picture 1 with the
    first observation (reset), picture i + 1 in the info of step i."""
    mem.reset("RULES")
    for i in (1, 2, 3):
        mem.messages(f"o{i}", image=picture(i))
        mem.record(f"o{i}", f"a{i}", info={"valid": True, "image": picture(i + 1)})


def test_current_shows_the_current_picture_before_the_current_step() -> None:
    mem = memory.make("last_k", k=2, images="current")
    three_steps(mem)
    now = picture(4)
    msgs = mem.messages("o4", image=now)
    assert msgs == [
        {"role": "system", "content": [text("RULES")]},
        {
            "role": "user",
            "content": [
                text("Recent steps:\nStep 2:\no2\nYou answered: a2\nStep 3:\no3\nYou answered: a3\n\n"),
                IMAGE,
                text("Now (step 4):\no4"),
            ],
        },
    ]
    assert len(mem.prompt_images) == 1 and mem.prompt_images[0] is now
    # no picture this step: no image part, and none from the history
    assert memory.make("last_k", images="current").messages("o1")[1]["content"] == [text("Now (step 1):\no1")]


def test_last_k_shows_each_shown_steps_picture_before_its_text() -> None:
    mem = memory.make("last_k", k=2, images="last_k")
    three_steps(mem)
    msgs = mem.messages("o4", image=picture(4))
    assert msgs[1]["content"] == [
        text("Recent steps:\n"),
        IMAGE,
        text("Step 2:\no2\nYou answered: a2\n"),
        IMAGE,
        text("Step 3:\no3\nYou answered: a3\n\n"),
        IMAGE,
        text("Now (step 4):\no4"),
    ]
    assert [int(p[0, 0, 0]) for p in mem.prompt_images] == [2, 3, 4]
    # the text parts joined are exactly the text-only prompt
    plain = memory.make("last_k", k=2)
    three_steps(plain)
    joined = "".join(p["text"] for p in msgs[1]["content"] if p["type"] == "text")
    assert joined == plain.messages("o4")[1]["content"]


def test_a_step_without_a_picture_of_its_own_takes_the_one_the_step_before_brought() -> None:
    mem = memory.make("full", images="last_k")
    mem.reset("RULES")
    mem.messages("o1", image=picture(1))
    mem.record("o1", "a1", info={"image": picture(2)})
    mem.record("o2", "a2", info={"image": picture(3)})  # no messages() for o2: its picture came with step 1
    msgs = mem.messages("o3")  # no current picture: none shown for the current step
    assert [int(p[0, 0, 0]) for p in mem.prompt_images] == [1, 2]
    assert msgs[1]["content"] == [
        text("Steps so far:\n"),
        IMAGE,
        text("Step 1:\no1\nYou answered: a1\n"),
        IMAGE,
        text("Step 2:\no2\nYou answered: a2\n\nNow (step 3):\no3"),
    ]


def random_observation(rng: random.Random) -> str:
    return " ".join(rng.choice(["wall", "box", "you", "row 3", "left"]) for _ in range(rng.randint(1, 40)))


@pytest.mark.parametrize("kind", memory.MEMORIES.names())
def test_none_is_the_text_only_memory_whatever_pictures_come(kind, tokenizer) -> None:
    """With images="none", pictures passed in change nothing: every prompt equals the one a memory built
    without the options gives, content strings, no prompt images, the same drops under the budget."""
    text_only = memory.make(kind, k=3, tokenizer=tokenizer, max_prompt_tokens=250)
    mem = memory.make(kind, k=3, tokenizer=tokenizer, max_prompt_tokens=250, images="none", image_tokens=IMAGE_TOKENS)
    rng = random.Random(kind)
    for m in (text_only, mem):
        m.reset("RULES")
    for n in range(1, 31):
        obs = random_observation(rng)
        got = mem.messages(obs, image=picture(n))
        assert got == text_only.messages(obs) and all(isinstance(m["content"], str) for m in got)
        assert mem.prompt_images == []
        answer, info = f"<action>{rng.choice(['left', 'up'])}</action>", {"valid": rng.random() < 0.8}
        text_only.record(obs, answer, 0.0, info)
        mem.record(obs, answer, 0.0, {**info, "image": picture(n + 1)})
    assert (mem.dropped_steps, mem.truncated_steps) == (text_only.dropped_steps, text_only.truncated_steps)
    assert mem.dropped_steps > 0 or kind == "summary"  # the budget did drop steps: the comparison covered that


def test_the_budget_drops_the_oldest_pictures_first_and_counts_them(vl) -> None:
    mem = memory.make("last_k", k=3, tokenizer=vl, max_prompt_tokens=10_000, images="last_k", image_tokens=IMAGE_TOKENS)
    three_steps(mem)
    history = (
        "Step 1:\no1\nYou answered: a1\n",
        "Step 2:\no2\nYou answered: a2\n",
        "Step 3:\no3\nYou answered: a3\n\n",
    )
    system = {"role": "system", "content": [text("RULES")]}
    # the prompts with the newest 3, 1 and 0 history pictures (all text kept), worked out by hand
    all_pictures = [
        system,
        {
            "role": "user",
            "content": [
                text("Recent steps:\n"),
                IMAGE,
                text(history[0]),
                IMAGE,
                text(history[1]),
                IMAGE,
                text(history[2]),
                IMAGE,
                text("Now (step 4):\no4"),
            ],
        },
    ]
    newest_one = [
        system,
        {
            "role": "user",
            "content": [
                text("Recent steps:\n" + history[0] + history[1]),
                IMAGE,
                text(history[2]),
                IMAGE,
                text("Now (step 4):\no4"),
            ],
        },
    ]
    none_old = [
        system,
        {"role": "user", "content": [text("Recent steps:\n" + "".join(history)), IMAGE, text("Now (step 4):\no4")]},
    ]
    assert mem.messages("o4", image=picture(4)) == all_pictures and mem.dropped_images == 0
    # a budget that holds one history picture and not two: the two oldest go
    mem.fitter.max_prompt_tokens = tokens(vl, newest_one)
    assert mem.messages("o4", image=picture(4)) == newest_one
    assert [int(p[0, 0, 0]) for p in mem.prompt_images] == [3, 4]
    assert (mem.dropped_images, mem.dropped_steps) == (2, 0)
    # one token less: the last history picture goes too, never the current one, and no step
    mem.fitter.max_prompt_tokens -= 1
    assert mem.messages("o4", image=picture(4)) == none_old
    assert [int(p[0, 0, 0]) for p in mem.prompt_images] == [4]
    assert (mem.dropped_images, mem.dropped_steps) == (2 + 3, 0)
    # below the text of all steps: steps go (oldest first), their pictures counted as dropped once
    mem.fitter.max_prompt_tokens = tokens(vl, none_old) - 1
    msgs = mem.messages("o4", image=picture(4))
    assert msgs[1]["content"][0] == text("Recent steps:\n" + history[1] + history[2])
    assert [int(p[0, 0, 0]) for p in mem.prompt_images] == [4]
    assert (mem.dropped_images, mem.dropped_steps) == (5 + 3, 1)


def test_bad_image_options_say_what_to_use(tokenizer) -> None:
    with pytest.raises(ValueError, match="images='all': use one of none, current, last_k"):
        memory.make("last_k", images="all")
    with pytest.raises(ValueError, match="image_tokens=0"):
        memory.make("last_k", tokenizer=tokenizer, max_prompt_tokens=500, images="current")


STEP_OF_TEXT = re.compile(r"(?:Step|Now \(step) (\d+)")


@pytest.mark.parametrize("kind", memory.MEMORIES.names())
@pytest.mark.parametrize("images", ["none", "current", "last_k"])
def test_random_episodes_keep_one_picture_per_image_part_within_the_budget(kind, images, vl) -> None:
    rng = random.Random(f"{kind}-{images}")
    floor = max(
        tokens(
            vl,
            [
                {"role": "system", "content": [text("RULES")]},
                {"role": "user", "content": [IMAGE, text(f"Now (step {n}):\n{CUT_MARK}")]},
            ],
        )
        for n in range(1, 21)
    )
    for episode in range(4):
        budget = floor + rng.randint(0, 300)
        mem = memory.make(
            kind,
            k=rng.randint(0, 4),
            max_events=rng.randint(0, 3),
            tokenizer=vl,
            max_prompt_tokens=budget,
            images=images,
            image_tokens=IMAGE_TOKENS,
        )
        mem.reset("RULES")
        dropped = 0
        for n in range(1, rng.randint(2, 20)):
            obs = random_observation(rng)
            now = picture(n) if rng.random() < 0.8 else None  # now and then a step without a picture
            msgs = mem.messages(obs, image=now)
            assert tokens(vl, msgs) <= budget, (episode, n)
            parts = [p for m in msgs if isinstance(m["content"], list) for p in m["content"]]
            shown = mem.prompt_images
            assert sum(p == IMAGE for p in parts) == len(shown)
            if images == "none":
                assert shown == [] and all(isinstance(m["content"], str) for m in msgs)
                continue
            assert (shown[-1] is now) if now is not None else all(int(p[0, 0, 0]) != n for p in shown)
            if images == "current":
                assert len(shown) <= 1
            # each picture comes right before the text of the step it shows
            after = [parts[i + 1]["text"] for i, p in enumerate(parts) if p == IMAGE]
            assert [int(STEP_OF_TEXT.match(t).group(1)) for t in after] == [int(p[0, 0, 0]) for p in shown]
            assert mem.dropped_images >= dropped
            dropped = mem.dropped_images
            info = {"valid": rng.random() < 0.8, "image": picture(n + 1) if rng.random() < 0.8 else None}
            mem.record(
                obs, f"<action>{rng.choice(['left', 'up'])}</action>", reward=rng.choice([0.0, -0.1, 1.0]), info=info
            )


@pytest.fixture(scope="module")
def vl_processor(tmp_path_factory):
    """The real tiny VL model's processor (its tokenizer knows "<image>" as the image token)."""
    from transformers import AutoProcessor

    from launcher.tiny_vl_model import make_tiny_vl_model

    return AutoProcessor.from_pretrained(make_tiny_vl_model(tmp_path_factory.mktemp("vl") / "vl", texts=["go up"]))


@pytest.mark.parametrize("kind", memory.MEMORIES.names())
def test_an_image_placeholder_written_in_the_text_is_quoted_so_each_one_left_has_its_picture(
    kind, vl_processor
) -> None:
    """An observation or an action that spells the model's image token out ("<image>") would become, through the
    chat template, a placeholder with no picture (the engine refuses such a prompt, the learner cannot pair it).
    With images shown, the memory writes it "[image]": the real tiny VL tokenizer then finds exactly one image
    token per picture in every prompt. Text-only memories leave the text as it is."""
    tok, image_id = vl_processor.tokenizer, vl_processor.image_token_id
    for images in ("current", "last_k"):
        mem = memory.make(kind, k=2, tokenizer=tok, images=images, image_placeholder="<image>")
        mem.reset("RULES: never write <image>")
        for n in range(1, 6):
            msgs = mem.messages(f"o{n} shows <image> here", image=picture(n))
            ids = mem.fitter.token_ids(msgs)
            assert ids.count(image_id) == len(mem.prompt_images) >= 1, (kind, images, n)
            texts = [p["text"] for m in msgs for p in m["content"] if p["type"] == "text"]
            assert not any("<image>" in t for t in texts) and f"o{n} shows [image] here" in texts[-1]
            mem.record(f"o{n} shows <image> here", "<image><action>up</action>", info={"image": picture(n + 1)})
    plain = memory.make(kind, k=2, tokenizer=tok, image_placeholder="<image>")  # images="none": text as it is
    plain.reset("RULES")
    assert "o1 shows <image> here" in plain.messages("o1 shows <image> here")[1]["content"]
