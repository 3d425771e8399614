"""Turning a memory's history into chat messages that fit a token budget.

A memory hands `PromptFitter.fit` the instructions, its history as sections of blocks (oldest first) and
the current observation. The prompt is `[system: instructions, user: sections + "Now (step n):" + observation]`.
With a budget (`max_prompt_tokens`, counted exactly as the actor counts: the model's chat template with the
generation prompt), history blocks go first, oldest first; the instructions and the current observation
stay. If they alone are over the budget, the observation is cut from the front (its end, where the envs
put the current status, stays) and the step is counted in `truncated_steps`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol, Sequence

Messages = list[dict[str, str]]
CUT_MARK = "[...] "  # starts an observation whose beginning was cut for the budget


class ChatTokenizer(Protocol):
    """What the budget needs from a Hugging Face tokenizer."""

    def apply_chat_template(self, conversation: Messages, **kwargs: Any) -> Any: ...


@dataclass(frozen=True)
class Block:
    """One droppable piece of history."""

    text: str
    steps: int
    """How many episode steps the block stands for (what `dropped_steps` counts when it is left out)."""


@dataclass(frozen=True)
class Section:
    """A run of blocks under a title ("" for none); the title is shown only while a block of it is."""

    title: str
    blocks: tuple[Block, ...]


def render_step(index: int, observation: str, action: str, note: str = "") -> str:
    """A history step as the prompt shows it."""
    head = f"Step {index} ({note}):" if note else f"Step {index}:"
    return f"{head}\n{observation}\nYou answered: {action}"


def current_step(step: int, observation: str) -> str:
    """The current step as the prompt ends with it."""
    return f"Now (step {step}):\n{observation}"


def assemble(instructions: str, sections: Sequence[Section], current: str) -> Messages:
    """The chat messages: instructions as the system message, history and the current step as the user's."""
    parts = ["\n".join([s.title] * bool(s.title) + [b.text for b in s.blocks]) for s in sections if s.blocks]
    parts.append(current)
    return [{"role": "system", "content": instructions}, {"role": "user", "content": "\n\n".join(parts)}]


def keep_newest(sections: Sequence[Section], kept: int) -> list[Section]:
    """The sections with only their newest `kept` blocks in all (older sections lose blocks first)."""
    out: list[Section] = []
    for section in reversed(sections):
        take = min(kept, len(section.blocks))
        out.append(Section(section.title, section.blocks[len(section.blocks) - take:]))
        kept -= take
    return out[::-1]


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


def largest_fitting_reference(n: int, fits: Callable[[int], bool]) -> int:
    """Slow, obvious `largest_fitting`: count down from n - 1 (drop the oldest until it fits)."""
    x = n - 1
    while x > 0 and not fits(x):
        x -= 1
    return x


class PromptFitter:
    """Builds each prompt under an optional token budget and counts what the budget cost."""

    def __init__(self, tokenizer: ChatTokenizer | None = None, max_prompt_tokens: int | None = None):
        if max_prompt_tokens is not None and max_prompt_tokens <= 0:
            raise ValueError(f"max_prompt_tokens={max_prompt_tokens}: must be positive (None: no budget)")
        if max_prompt_tokens is not None and tokenizer is None:
            raise ValueError("a prompt token budget needs the model's tokenizer: pass tokenizer=...")
        self.tokenizer, self.max_prompt_tokens = tokenizer, max_prompt_tokens
        self.dropped_steps = 0
        """History steps left out of prompts for the budget, summed over prompts."""
        self.truncated_steps = 0
        """Prompts whose current observation was cut from the front for the budget."""
        self._last: tuple[tuple, list[int]] | None = None  # the last prompt tokenized: (its key, its ids)

    def count(self, messages: Messages) -> int:
        """Prompt tokens, exactly as the actor tokenizes the prompt."""
        return len(self._ids(messages))

    def token_ids(self, messages: Messages) -> list[int]:
        """The prompt's token ids (chat template with the generation prompt), as the engine gets them. The
        prompt `fit` returned was the last one it counted: asking for its ids right after costs nothing
        (the chat template was ~14% of an actor's samples, half of them for a second tokenization)."""
        return list(self._ids(messages))

    def _ids(self, messages: Messages) -> list[int]:
        """The ids of `messages`, tokenized only if they are not the last prompt tokenized (not a copy)."""
        if self.tokenizer is None:
            raise ValueError("token ids need the model's tokenizer: pass tokenizer=...")
        key = tuple(tuple(sorted(m.items())) for m in messages)
        if self._last is None or self._last[0] != key:
            ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                     return_dict=False)
            self._last = (key, list(ids))
        return self._last[1]

    def fits(self, messages: Messages) -> bool:
        """Whether the prompt is within the budget (always, without one)."""
        return self.max_prompt_tokens is None or self.count(messages) <= self.max_prompt_tokens

    def check(self, instructions: str, step: int = 1) -> None:
        """Raise unless the instructions fit with an empty observation (at reset: fail before any step)."""
        if not self.fits(assemble(instructions, [], current_step(step, CUT_MARK))):
            raise ValueError(
                f"memory.max_prompt_tokens={self.max_prompt_tokens} is too small for the env's instructions "
                f"alone ({self.count(assemble(instructions, [], ''))} tokens with the chat template): raise it.")

    def fit(self, instructions: str, sections: Sequence[Section], step: int, observation: str) -> Messages:
        """The prompt for step `step`: as much history as fits, newest kept; see the module docstring."""
        current = current_step(step, observation)
        full = assemble(instructions, sections, current)
        if self.fits(full):
            return full
        blocks = [b for s in sections for b in s.blocks]
        if self.fits(assemble(instructions, [], current)):
            kept = largest_fitting(len(blocks), lambda x: self.fits(
                assemble(instructions, keep_newest(sections, x), current)))
            self.dropped_steps += sum(b.steps for b in blocks[: len(blocks) - kept])
            return assemble(instructions, keep_newest(sections, kept), current)
        self.dropped_steps += sum(b.steps for b in blocks)
        self.truncated_steps += 1
        self.check(instructions, step)
        head = current_step(step, CUT_MARK)
        chars = largest_fitting(len(observation), lambda c: self.fits(
            assemble(instructions, [], head + observation[len(observation) - c:])))
        return assemble(instructions, [], head + observation[len(observation) - chars:])
