"""The gateway's episodes: which group each belongs to, the token-exact chat so far, and the step held back until
its reward is known.

An episode's latest step is held until the agent's next call (or the episode's finish): only then is its
reward final (per-step rewards come with `POST /episodes/<id>/reward`, the last one with `finish`) and whether it
ended known, so each transition reaches the broker once, complete. Earlier steps have already gone.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from agentstream.wire.messages import GroupGrant, Transition
from engines.client import EngineClient, clamp_to_grant
from gateway.protocol import ApiError


@dataclass
class Slot:
    """One group being filled: the episodes opened with one task id, up to G of them, under one broker grant."""

    task_id: str
    grant: asyncio.Task[GroupGrant]
    members: int = 0


@dataclass
class ChatTurn:
    """The last chat call of an episode, kept to build the next prompt from its ids."""

    messages: list[dict[str, Any]]
    """The request's messages, as `gateway.protocol.messages` made them."""
    tools: list[dict[str, Any]]
    prompt_ids: list[int]
    response_ids: list[int]
    answer: dict[str, Any]
    """The assistant message returned, in the same form as `messages` (tool-call arguments as objects)."""


def same_answer(sent: dict[str, Any], returned: dict[str, Any]) -> bool:
    """Whether the agent sent back the answer the gateway returned (tool-call ids aside)."""

    def key(m: dict[str, Any]) -> tuple:
        calls = [(c["function"]["name"], c["function"]["arguments"]) for c in m.get("tool_calls") or []]
        return m.get("role"), m.get("content") or "", calls

    return key(sent) == key(returned)


@dataclass
class GatewayEpisode:
    """One agent episode as the gateway keeps it (agent code holds `gateway.episode_client.Episode`): a trajectory
    of its group, one transition per model call."""

    id: str
    task_id: str
    grant: GroupGrant
    index: int
    """Its place in the group (0..G-1)."""
    traj_id: str
    engine: EngineClient
    steps: int = 0
    total_reward: float = 0.0
    finished: bool = False
    pending: Transition | None = None
    """The latest step, held until its reward is final (the next call, or finish)."""
    last: ChatTurn | None = None
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    """One call at a time: each answer extends the token chain the next call builds on."""
    last_request: float = field(default_factory=time.monotonic)
    abandoned: str = ""
    """Why the gateway gave up on it (its agent went silent): its group was dropped; empty while it was not."""

    def abandon(self, why: str) -> int:
        """Give up on this episode (its group is dropped): the held step is never sent. Returns the steps sent."""
        sent = self.steps - (self.pending is not None)
        self.pending, self.finished, self.last, self.abandoned = None, True, None, why
        return sent

    def next_prompt(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> list[dict[str, Any]] | None:
        """The messages added since the last answer when `messages` continue the last call exactly (same
        tools, same history, the answer sent back as returned, at least one new message); else None."""
        last = self.last
        if last is None or tools != last.tools or len(messages) <= len(last.messages) + 1:
            return None
        n = len(last.messages)
        if messages[:n] != last.messages or not same_answer(messages[n], last.answer):
            return None
        return messages[n + 1 :]

    def step(
        self,
        prompt_ids: list[int],
        response_ids: np.ndarray,
        logprobs: np.ndarray,
        version_lo: int,
        version_hi: int,
        actor: str,
        info: dict[str, Any],
        valid: bool,
    ) -> Transition | None:
        """Record one answered call; returns the step before it, now final, to send (None for the first)."""
        ready = self.pending
        version_lo, version_hi = clamp_to_grant(version_lo, version_hi, self.grant.min_version)
        self.pending = Transition(
            traj_id=self.traj_id,
            group_id=self.grant.group_id,
            actor=actor,
            step=self.steps,
            prompt_ids=np.asarray(prompt_ids, dtype=np.int32),
            response_ids=response_ids,
            logprobs=logprobs,
            version_lo=version_lo,
            version_hi=version_hi,
            reward=0.0,
            done=False,
            truncated=False,
            valid=valid,
            info=info,
        )
        self.steps += 1
        return ready

    def reward(self, value: float) -> None:
        """Add `value` to the latest step's reward (the caller checked there is one)."""
        assert self.pending is not None
        self.pending = dataclasses.replace(self.pending, reward=self.pending.reward + value)
        self.total_reward += value

    def finish(self, value: float, truncated: bool) -> Transition:
        """The last step, final: `value` added to its reward, marked done (or truncated)."""
        self.reward(value)
        assert self.pending is not None
        last = dataclasses.replace(self.pending, done=not truncated, truncated=truncated)
        self.pending, self.finished, self.last = None, True, None
        return last


ENDED_KEPT = 65_536
"""Ended episodes whose ids the gateway keeps (~10 MiB); a call of an older one gets 404 unknown_episode."""


class Registry:
    """The gateway's episodes: the open ones, and the ids of the last `keep` ended ones, so that a late call of
    one gets 409 (finished) or 410 (abandoned) rather than 404. Older ended ids are forgotten: memory and each
    sweep stay bounded by what is open, not by how many episodes the run has had."""

    def __init__(self, keep: int):
        self.open: dict[str, GatewayEpisode] = {}
        self.keep = keep
        self._ended: OrderedDict[str, str] = OrderedDict()  # id -> why it was abandoned ("" if it finished)

    def __len__(self) -> int:
        return len(self.open)

    def add(self, episode: GatewayEpisode) -> None:
        self.open[episode.id] = episode

    def ended(self, episode: GatewayEpisode) -> None:
        """`episode` finished or was abandoned: from now on only its id is kept."""
        self.open.pop(episode.id, None)
        self._ended[episode.id] = episode.abandoned
        while len(self._ended) > self.keep:
            self._ended.popitem(last=False)

    def get(self, eid: str) -> GatewayEpisode:
        """The open episode `eid`; an ApiError says why there is none."""
        episode = self.open.get(eid)
        if episode is not None:
            return episode
        if eid not in self._ended:
            raise ApiError(404, f"no episode {eid[:40]!r}: open one with POST /episodes", "unknown_episode")
        if self._ended[eid]:
            raise ApiError(
                410, f"episode {eid[:40]!r} was given up: {self._ended[eid]}; open a new one", "episode_abandoned"
            )
        raise ApiError(409, f"episode {eid[:40]!r} is finished; open a new one for more calls", "episode_finished")


__all__ = ["ENDED_KEPT", "ChatTurn", "GatewayEpisode", "Registry", "Slot", "same_answer"]
