"""Memory: what each step's prompt contains (task, history, current observation), within a token budget.

    mem = memory.make("summary", k=2, tokenizer=tokenizer, max_prompt_tokens=1000)
    mem.reset(env.instructions)              # the env's prompt template; raises if it alone overflows
    messages = mem.messages(observation)      # chat messages for the model's chat template
    mem.record(observation, action_text, reward=env_reward, info=info)   # after the step
    mem.dropped_steps, mem.truncated_steps    # what the budget cost so far

With pictures (vision-language models; envs built with `observation="image"` put them in `info["image"]`):

    mem = memory.make("last_k", k=2, tokenizer=tokenizer, max_prompt_tokens=4096, images="last_k",
                      image_tokens=64)        # what one image costs in the model, from its processor
    messages = mem.messages(observation, image=info["image"])   # contents: [{"type": "image"}, {"type": "text", ...}]
    mem.prompt_images                         # the prompt's pictures, in the order of its image parts
    mem.dropped_images                        # history pictures the budget left out so far

Kinds: `last_k` (the last k steps), `full` (every step: the baseline that outgrows the context),
`summary` (a rule-based summary of older steps + the last k), `key_events` (key steps + the last k).
Every kind takes the same options and respects `max_prompt_tokens`, counted with the tokenizer's chat
template exactly as the actor tokenizes: history is dropped oldest first, never the instructions or the
current observation; when those alone overflow, the observation is cut from the front (`memory.prompt`).
`images`: "none" (text only, contents are strings), "current" (the current observation's picture), "last_k"
(also the picture of each history step shown; under the budget those go first, oldest first).
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Protocol

import numpy as np

from agentstream.registry import Registry
from memory.full import Full
from memory.key_events import KeyEvents
from memory.last_k import LastK
from memory.prompt import ChatTokenizer, Messages, PromptFitter
from memory.summary import Summary


class Memory(Protocol):
    """Builds each step's chat prompt from the episode so far."""

    fitter: PromptFitter
    """Fits prompts to the token budget; `fitter.token_ids(messages)` gives a prompt's token ids."""

    @property
    def dropped_steps(self) -> int:
        """History steps left out of prompts for the token budget, summed over prompts."""

    @property
    def truncated_steps(self) -> int:
        """Prompts whose current observation was cut from the front for the token budget."""

    @property
    def dropped_images(self) -> int:
        """History pictures left out of prompts for the token budget, summed over prompts."""

    @property
    def prompt_images(self) -> list[np.ndarray]:
        """The pictures of the last prompt `messages` built, in the order of its image parts."""

    def reset(self, instructions: str) -> None: ...

    def record(
        self, observation: str, action: str, reward: float = 0.0, info: Mapping[str, Any] | None = None
    ) -> None: ...

    def messages(self, observation: str, image: np.ndarray | None = None) -> Messages: ...


MEMORIES: Registry[Callable[[int, int, PromptFitter], Memory]] = Registry("memory")
"""Every memory module by kind. Every entry takes the same options (k, max_events, fitter), so callers never branch
on the kind."""
MEMORIES.add("last_k", lambda k, max_events, fitter: LastK(k, fitter))
MEMORIES.add("full", lambda k, max_events, fitter: Full(fitter))
MEMORIES.add("summary", lambda k, max_events, fitter: Summary(k, fitter))
MEMORIES.add("key_events", lambda k, max_events, fitter: KeyEvents(k, max_events, fitter))


def make(
    kind: str,
    *,
    k: int = 2,
    max_events: int = 8,
    tokenizer: ChatTokenizer | None = None,
    max_prompt_tokens: int | None = None,
    images: str = "none",
    image_tokens: int = 0,
    image_placeholder: str = "",
) -> Memory:
    """Build a memory module by name; an unknown name lists the known ones.

    k: recent steps shown verbatim (ignored by `full`); max_events: older key steps `key_events` keeps;
    max_prompt_tokens: the prompt budget (None: no budget), which needs the model's `tokenizer`;
    images: "none", "current" or "last_k" (see the module docstring); image_tokens: what one image costs
    in the model on top of the chat template's tokens (needed with images under a budget); image_placeholder:
    the model's image token as text ("<image>"), written "[image]" where the text holds it (see memory.prompt).
    """
    return MEMORIES.get(kind)(
        k, max_events, PromptFitter(tokenizer, max_prompt_tokens, images, image_tokens, image_placeholder)
    )


__all__ = ["MEMORIES", "Memory", "Full", "KeyEvents", "LastK", "Summary", "make"]
