"""Chat messages -> prompt token ids with the model's chat template, tools included; and the token-exact next
prompt of a multi-turn episode.

    r = Renderer(tokenizer)                               # or Renderer(tokenizer, chat_template=TEMPLATE_TEXT)
    ids = r.full(messages, tools)                         # turn 1: the whole chat, with the generation prompt
    ids = prompt_ids + response_ids + r.suffix(new_messages, tools, ended_with_eos)   # turn k+1

Token fidelity: the model's own answer is never decoded and tokenised again (BPE would often split it into
other ids than those sampled, and the log-probs refer to the sampled ones). Only the messages added since the
answer are tokenised: the template renders a fixed stand-in conversation ending with an assistant turn, once
without and once with the new messages; what the second adds to the first, after the text that closes the
assistant's turn (minus the end-of-turn token when the model already generated it), is the suffix.
"""

from __future__ import annotations

from typing import Any

_STAND_IN = "\x00ANSWER\x00"  # the assistant's content in the stand-in conversation; never in a real template


class Renderer:
    """The chat template of one model (or an override), applied with tools."""

    def __init__(self, tokenizer: Any, chat_template: str | None = None):
        self.tokenizer, self.chat_template = tokenizer, chat_template
        self.eos_token: str = tokenizer.eos_token or ""
        self.eos_id: int | None = tokenizer.eos_token_id

    def text(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]], generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            messages,
            tools=tools or None,
            chat_template=self.chat_template,
            add_generation_prompt=generation_prompt,
            tokenize=False,
        )

    def full(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> list[int]:
        """The whole chat's ids with the generation prompt, as `memory`'s prompts are made for actors."""
        return self.encode(self.text(messages, tools, True))

    def encode(self, text: str) -> list[int]:
        """Template text -> ids; special tokens written in the text (<|im_start|>) become their ids."""
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def suffix(
        self, new_messages: list[dict[str, Any]], tools: list[dict[str, Any]], ended_with_eos: bool
    ) -> list[int] | None:
        """The ids that follow a model's answer when `new_messages` are added after it, up to and with the next
        generation prompt. None when this template cannot say (rendering the stand-in conversation with the
        new messages changes what it rendered before them): render the whole chat instead."""
        base = [{"role": "user", "content": "."}, {"role": "assistant", "content": _STAND_IN}]
        before = self.text(base, tools, False)
        after = self.text(base + new_messages, tools, True)
        at = before.rfind(_STAND_IN)
        if at < 0 or not after.startswith(before):
            return None
        closing = before[at + len(_STAND_IN) :]  # what the template writes after an answer, e.g. "<|im_end|>\n"
        if ended_with_eos and self.eos_token and closing.startswith(self.eos_token):
            closing = closing[len(self.eos_token) :]  # the model wrote the end-of-turn token itself
        return self.encode(closing + after[len(before) :])


def ended_with_eos(response_ids: list[int], eos_id: int | None) -> bool:
    return bool(response_ids) and eos_id is not None and response_ids[-1] == eos_id


__all__ = ["Renderer", "ended_with_eos"]
