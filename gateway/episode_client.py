"""A thin helper for agent code: open an episode at a gateway, point the `openai` client at it, finish it.

    from openai import OpenAI
    from gateway.episode_client import open_episode

    with open_episode("http://127.0.0.1:8100", task_id="task-17") as ep:
        client = OpenAI(base_url=ep.base_url, api_key=ep.api_key)
        answer = client.chat.completions.create(model="policy", messages=[...], tools=[...])
        ...
        ep.finish(reward=1.0)            # or ep.reward(r) after each call, then ep.finish()
                                         # or ep.abandon("why"): not the model's fault, the group is dropped

Standard library only (urllib): agent code needs nothing of this project but this file. Opening waits while
the gateway answers 429 (no group admitted yet: the learner is behind), as its Retry-After says.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any


class GatewayError(RuntimeError):
    """The gateway refused a call; `status` is its HTTP status, the message its error message."""

    def __init__(self, status: int, message: str, code: str = ""):
        super().__init__(f"HTTP {status}: {message}")
        self.status, self.code = status, code


def _post(
    url: str, body: dict[str, Any], timeout_s: float, key: str = ""
) -> tuple[int, dict[str, Any], dict[str, str]]:
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST", headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            return resp.status, json.loads(resp.read() or b"{}"), dict(resp.headers)
    except urllib.error.HTTPError as exc:
        try:
            payload = json.loads(exc.read() or b"{}")
        except ValueError:
            payload = {}
        return exc.code, payload, dict(exc.headers or {})


def _raise(status: int, payload: dict[str, Any]) -> None:
    err = payload.get("error") if isinstance(payload.get("error"), dict) else {}
    raise GatewayError(status, str(err.get("message", payload)), str(err.get("code", "")))


@dataclass
class Episode:
    """An open episode: give `base_url` and `api_key` to `openai.OpenAI`; end it with `finish`."""

    gateway: str
    id: str
    base_url: str
    api_key: str
    task_id: str
    group_id: int
    seed: int
    """The env seed of its group (the same for the G episodes of one task id)."""
    timeout_s: float = 60.0
    finished: bool = False

    def reward(self, value: float) -> float:
        """Add `value` to the reward of the latest call's step; returns the episode's return so far."""
        status, payload, _ = _post(f"{self.gateway}/episodes/{self.id}/reward", {"reward": value}, self.timeout_s)
        if status != 200:
            _raise(status, payload)
        return float(payload["return"])

    def finish(self, reward: float = 0.0, truncated: bool = False) -> float:
        """End the episode: `reward` joins its last step's; returns the episode's return."""
        status, payload, _ = _post(
            f"{self.gateway}/episodes/{self.id}/finish", {"reward": reward, "truncated": truncated}, self.timeout_s
        )
        if status != 200:
            _raise(status, payload)
        self.finished = True
        return float(payload["return"])

    def abandon(self, reason: str = "") -> int:
        """Give up on the episode because something outside the model failed (the env's reward raised, say): its
        whole group is dropped at once, never trained (the broker counts it as `infra_agent_failed`), and the
        group's other open episodes get 410 from now on. Returns how many episodes were given up."""
        status, payload, _ = _post(f"{self.gateway}/episodes/{self.id}/abandon", {"reason": reason}, self.timeout_s)
        if status != 200:
            _raise(status, payload)
        self.finished = True
        return int(payload["abandoned"])

    def __enter__(self) -> Episode:
        return self

    def __exit__(self, *exc: object) -> None:
        if not self.finished and exc[0] is None:
            raise RuntimeError(f"episode {self.id} left its `with` block unfinished: call ep.finish(reward)")


def open_episode(gateway: str, task_id: str, wait_s: float = 600.0, timeout_s: float = 60.0, key: str = "") -> Episode:
    """Open an episode of `task_id` (episodes sharing it form one group). While the gateway answers 429, wait as
    its Retry-After says, up to `wait_s` in all. `key`: the run's gateway key, if it has one (gateway.key_file)."""
    gateway = gateway.rstrip("/")
    deadline = time.monotonic() + wait_s
    while True:
        status, payload, headers = _post(f"{gateway}/episodes", {"task_id": task_id}, timeout_s, key)
        if status == 201:
            return Episode(
                gateway,
                payload["id"],
                payload["base_url"],
                payload["api_key"],
                payload["task_id"],
                int(payload["group_id"]),
                int(payload["seed"]),
                timeout_s,
            )
        if status != 429 or time.monotonic() >= deadline:
            _raise(status, payload)
        time.sleep(max(0.1, min(float(headers.get("Retry-After", 1)), deadline - time.monotonic())))


__all__ = ["Episode", "GatewayError", "open_episode"]
