"""Turning a memory's history into chat messages that fit a token budget.

A memory hands `PromptFitter.fit` the instructions, its history as sections of blocks (oldest first) and
the current observation. The prompt is `[system: instructions, user: sections + "Now (step n):" + observation]`.
With a budget (`max_prompt_tokens`, counted exactly as the actor counts: the model's chat template with the
generation prompt), history blocks go first, oldest first; the instructions and the current observation
stay. If they alone are over the budget, the observation is cut from the front (its end, where the envs
put the current status, stays) and the step is counted in `truncated_steps`.

Images (`images="current"|"last_k"`, for vision-language models): every message's content becomes a list of
Hugging Face chat parts, `{"type": "image"}` placed right before the text of the step it shows, and
`prompt_images` holds the pictures of the last prompt in the order of its image parts (what the engine gets
beside the token ids). Joined, the text parts are exactly the string content of `images="none"`, except that
the model's image placeholder written out in any text (an observation, or an action the model spelt) reads
`QUOTED_IMAGE`: the chat template would make it a placeholder with no picture, which the engine refuses. "current"
shows the current observation's picture; "last_k" also shows the picture of every history step shown. The
budget counts `image_tokens` per image on top of the chat template's tokens (its placeholder included) and
drops history pictures first, oldest first (`dropped_images`), then history steps; never the current one.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Protocol, Sequence

import numpy as np

from memory.history import Step

Messages = list[dict[str, Any]]
"""Chat messages; content is a string, or a list of parts when the memory shows images."""
CUT_MARK = "[...] "  # starts an observation whose beginning was cut for the budget
IMAGE_MODES = ("none", "current", "last_k")
IMAGE_PART = {"type": "image"}
QUOTED_IMAGE = "[image]"  # what a placeholder written in the text becomes when the memory shows images
# Per tokenizer, the reset checks that passed (budget, image cost, prompt): every episode of an env starts with
# the same instructions, and tokenizing them again was ~12% of an actor's samples (py-spy, Reasoning at 64).
_PASSED_CHECKS: weakref.WeakKeyDictionary[Any, set[tuple]] = weakref.WeakKeyDictionary()


class ChatTokenizer(Protocol):
    """What the budget needs from a Hugging Face tokenizer."""

    def apply_chat_template(self, conversation: Messages, **kwargs: Any) -> Any: ...


@dataclass(frozen=True)
class Block:
    """One droppable piece of history."""

    text: str
    steps: int
    """How many episode steps the block stands for (what `dropped_steps` counts when it is left out)."""
    image: np.ndarray | None = field(default=None, compare=False)
    """The picture shown right before the text (None: none)."""


@dataclass(frozen=True)
class Section:
    """A run of blocks under a title ("" for none); the title is shown only while a block of it is."""

    title: str
    blocks: tuple[Block, ...]


def render_step(index: int, observation: str, action: str, note: str = "") -> str:
    """A history step as the prompt shows it."""
    head = f"Step {index} ({note}):" if note else f"Step {index}:"
    return f"{head}\n{observation}\nYou answered: {action}"


def step_block(step: Step, note: str = "") -> Block:
    """A history step as one block: its text, and its observation's picture when the memory kept it."""
    return Block(render_step(step.index, step.observation, step.action, note), 1, step.image)


def current_step(step: int, observation: str) -> str:
    """The current step as the prompt ends with it."""
    return f"Now (step {step}):\n{observation}"


def assemble(
    instructions: str,
    sections: Sequence[Section],
    current: str,
    image: bool = False,
    parts: bool = False,
    placeholder: str = "",
) -> Messages:
    """The chat messages: instructions as the system message, history and the current step as the user's.

    With `parts`, contents are lists of chat parts: an image part before each block that has a picture and
    before the current step when `image`, and `placeholder` (the model's image token, "" for none) in the text
    written QUOTED_IMAGE; without, strings (pictures cannot be shown)."""
    chunks: list[str | dict[str, str]] = []  # the user's text pieces, and image parts where pictures go
    for section in (s for s in sections if s.blocks):
        chunks += ["\n\n"] * bool(chunks) + [section.title + "\n"] * bool(section.title)
        for i, block in enumerate(section.blocks):
            chunks += ["\n"] * bool(i) + [IMAGE_PART] * (block.image is not None) + [block.text]
    chunks += ["\n\n"] * bool(chunks) + [IMAGE_PART] * image + [current]
    if not parts:
        user = "".join(c for c in chunks if isinstance(c, str))
        return [{"role": "system", "content": instructions}, {"role": "user", "content": user}]
    if placeholder:
        instructions = instructions.replace(placeholder, QUOTED_IMAGE)
        chunks = [c.replace(placeholder, QUOTED_IMAGE) if isinstance(c, str) else c for c in chunks]
    content: list[dict[str, str]] = []
    for chunk in chunks:
        if isinstance(chunk, dict):
            content.append(dict(chunk))
        elif content and content[-1]["type"] == "text":
            content[-1]["text"] += chunk
        else:
            content.append({"type": "text", "text": chunk})
    return [
        {"role": "system", "content": [{"type": "text", "text": instructions}]},
        {"role": "user", "content": content},
    ]


def image_parts(messages: Messages) -> int:
    """How many image parts the messages hold."""
    return sum(p == IMAGE_PART for m in messages if not isinstance(m["content"], str) for p in m["content"])


def keep_newest(sections: Sequence[Section], kept: int) -> list[Section]:
    """The sections with only their newest `kept` blocks in all (older sections lose blocks first)."""
    out: list[Section] = []
    for section in reversed(sections):
        take = min(kept, len(section.blocks))
        out.append(Section(section.title, section.blocks[len(section.blocks) - take :]))
        kept -= take
    return out[::-1]


def keep_newest_images(sections: Sequence[Section], kept: int) -> list[Section]:
    """The sections with the pictures of only their newest `kept` blocks (older blocks keep their text)."""
    out: list[Section] = []
    for section in reversed(sections):
        blocks = []
        for block in reversed(section.blocks):
            keep = block.image is not None and kept > 0
            kept -= keep
            blocks.append(block if keep or block.image is None else replace(block, image=None))
        out.append(Section(section.title, tuple(blocks[::-1])))
    return out[::-1]


def shown_images(sections: Sequence[Section], image: np.ndarray | None) -> list[np.ndarray]:
    """The pictures a prompt of `sections` and the current `image` shows, in the order of its image parts."""
    return [b.image for s in sections for b in s.blocks if b.image is not None] + [image] * (image is not None)


def largest_fitting(n: int, fits: Callable[[int], bool]) -> int:
    """The largest x in [0, n) with fits(x), given fits(0) and not fits(n), for a monotone `fits`.

    Galloping from 0 (1, 2, 4, ...) then bisecting: about 2*log2(answer) probes, each of them a prompt no
    longer than twice the answer's, which beats bisecting from n when most of a long history is dropped.
    """
    good, bad, probe = 0, n, 1
    while probe < bad:
        if not fits(probe):
            bad = probe
            break
        good, probe = probe, probe * 2
    while bad - good > 1:
        mid = (good + bad) // 2
        good, bad = (mid, bad) if fits(mid) else (good, mid)
    return good


def _frozen(value: Any) -> Any:
    """`value` (messages: dicts, lists, strings) as nested tuples, to compare later whatever happens to it."""
    if isinstance(value, dict):
        return tuple(sorted((k, _frozen(v)) for k, v in value.items()))
    if isinstance(value, list):
        return tuple(_frozen(v) for v in value)
    return value


class PromptFitter:
    """Builds each prompt under an optional token budget and counts what the budget cost."""

    def __init__(
        self,
        tokenizer: ChatTokenizer | None = None,
        max_prompt_tokens: int | None = None,
        images: str = "none",
        image_tokens: int = 0,
        image_placeholder: str = "",
    ):
        if max_prompt_tokens is not None and max_prompt_tokens <= 0:
            raise ValueError(f"max_prompt_tokens={max_prompt_tokens}: must be positive (None: no budget)")
        if max_prompt_tokens is not None and tokenizer is None:
            raise ValueError("a prompt token budget needs the model's tokenizer: pass tokenizer=...")
        if images not in IMAGE_MODES:
            raise ValueError(f"images={images!r}: use one of {', '.join(IMAGE_MODES)}")
        if image_tokens < 0 or (images != "none" and max_prompt_tokens is not None and image_tokens == 0):
            raise ValueError(
                f"image_tokens={image_tokens}: with images under a token budget, give the tokens one "
                "image costs in the model (from its processor), a positive int"
            )
        self.tokenizer, self.max_prompt_tokens = tokenizer, max_prompt_tokens
        self.images, self.image_tokens, self.image_placeholder = images, image_tokens, image_placeholder
        self.dropped_steps = 0
        """History steps left out of prompts for the budget, summed over prompts."""
        self.truncated_steps = 0
        """Prompts whose current observation was cut from the front for the budget."""
        self.dropped_images = 0
        """History pictures left out of prompts for the budget (a dropped step's included), summed over prompts."""
        self.prompt_images: list[np.ndarray] = []
        """The pictures of the last prompt `fit` built, in the order of its image parts."""
        self._last: tuple[tuple, list[int]] | None = None  # the last prompt tokenized: (its key, its ids)

    def count(self, messages: Messages) -> int:
        """Prompt tokens, exactly as the actor tokenizes the prompt, plus `image_tokens` per image part."""
        return len(self._ids(messages)) + self.image_tokens * image_parts(messages)

    def token_ids(self, messages: Messages) -> list[int]:
        """The prompt's token ids (chat template with the generation prompt), as the engine gets them. The
        prompt `fit` returned was the last one it counted: asking for its ids right after costs nothing
        (the chat template was ~14% of an actor's samples, half of them for a second tokenization)."""
        return list(self._ids(messages))

    def _ids(self, messages: Messages) -> list[int]:
        """The ids of `messages`, tokenized only if they are not the last prompt tokenized (not a copy)."""
        if self.tokenizer is None:
            raise ValueError("token ids need the model's tokenizer: pass tokenizer=...")
        key = _frozen(messages)
        if self._last is None or self._last[0] != key:
            ids = self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=True, return_dict=False
            )
            self._last = (key, list(ids))
        return self._last[1]

    def fits(self, messages: Messages) -> bool:
        """Whether the prompt is within the budget (always, without one)."""
        return self.max_prompt_tokens is None or self.count(messages) <= self.max_prompt_tokens

    def _assemble(self, instructions: str, sections: Sequence[Section], current: str, image: bool) -> Messages:
        """`assemble` in this fitter's form: part lists when it shows images; `image`: the current step has one."""
        shows = self.images != "none"
        return assemble(
            instructions,
            sections,
            current,
            image and shows,
            parts=shows,
            placeholder=self.image_placeholder if shows else "",
        )

    def check(self, instructions: str, step: int = 1, image: bool = True) -> None:
        """Raise unless the instructions fit with an empty observation and, when this fitter shows images and
        `image`, its picture (at reset: fail before any step)."""
        if self.max_prompt_tokens is None:
            return
        messages = self._assemble(instructions, [], current_step(step, CUT_MARK), image)
        passed = _PASSED_CHECKS.setdefault(self.tokenizer, set())
        key = (self.max_prompt_tokens, self.image_tokens, _frozen(messages))
        if key in passed:
            return
        if not self.fits(messages):
            raise ValueError(
                f"memory.max_prompt_tokens={self.max_prompt_tokens} is too small for the env's instructions "
                f"alone ({self.count(self._assemble(instructions, [], '', image))} tokens with the chat template"
                f"{' and an image' if self.images != 'none' and image else ''}): raise it."
            )
        passed.add(key)

    def fits_text(
        self,
        instructions: str,
        sections: Sequence[Section],
        step: int,
        observation: str,
        image: np.ndarray | None = None,
    ) -> bool:
        """Whether the sections' text fits beside the instructions and the current step (and its picture), the
        history's pictures left out: `fit` drops those before any history step, so a memory that shortens its
        history for the budget (summary) tests this."""
        current = current_step(step, observation)
        return self.fits(self._assemble(instructions, keep_newest_images(sections, 0), current, image is not None))

    def fit(
        self,
        instructions: str,
        sections: Sequence[Section],
        step: int,
        observation: str,
        image: np.ndarray | None = None,
    ) -> Messages:
        """The prompt for step `step`: as much history as fits, newest kept; see the module docstring.

        `image`: the current observation's picture (left out with images="none"). Sets `prompt_images`."""
        image = None if self.images == "none" else image
        sections, current = self._fitting(instructions, list(sections), step, observation, image is not None)
        self.prompt_images = shown_images(sections, image)
        return self._assemble(instructions, sections, current, image is not None)

    def _fitting(
        self, instructions: str, sections: list[Section], step: int, observation: str, image: bool
    ) -> tuple[list[Section], str]:
        """(history, current step) that fit: history pictures go first, then history steps, both oldest first;
        when the instructions and the current step alone overflow, the observation's beginning."""
        current = current_step(step, observation)

        def fits(secs: Sequence[Section], cur: str = current) -> bool:
            return self.fits(self._assemble(instructions, secs, cur, image))

        if fits(sections):
            return sections, current
        pictures, text = len(shown_images(sections, None)), keep_newest_images(sections, 0)
        if pictures and fits(text):
            kept = largest_fitting(pictures, lambda x: fits(keep_newest_images(sections, x)))
            self.dropped_images += pictures - kept
            return keep_newest_images(sections, kept), current
        self.dropped_images += pictures
        blocks = [b for s in sections for b in s.blocks]
        if fits([]):
            kept = largest_fitting(len(blocks), lambda x: fits(keep_newest(text, x)))
            self.dropped_steps += sum(b.steps for b in blocks[: len(blocks) - kept])
            return keep_newest(text, kept), current
        self.dropped_steps += sum(b.steps for b in blocks)
        self.truncated_steps += 1
        self.check(instructions, step, image)
        head = current_step(step, CUT_MARK)
        chars = largest_fitting(len(observation), lambda c: fits([], head + observation[len(observation) - c :]))
        return [], head + observation[len(observation) - chars :]
