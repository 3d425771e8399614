"""The newest observation pictures the broker took, for the dashboard's gallery (`/api/images`, broker/dashboard.py).

A vision-language run's transitions carry their prompt's pictures (`Transition.images` [n, H, W, C], the current
observation's picture last). The broker keeps that last picture of the newest `broker.dashboard_images` transitions
it took, with what a caption needs (actor, step, reward, policy version, time received). It keeps a copy of the
raw array, so that no received message stays alive for it, and encodes a picture as PNG only when a client asks.
A text run keeps nothing and pays one size check per message (`Broker._on_transitions`).

    gallery = Gallery(8)
    gallery.keep(transitions, [r.outcome for r in results])   # what the broker took, in order
    gallery.entries()                                           # newest first: [{"id", "url", "actor", ...}]
    png(gallery.get(entry_id).image)                            # the PNG's bytes
"""

from __future__ import annotations

import io
import secrets
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from PIL import Image

from agentstream.wire.messages import Transition

TAKEN = frozenset({"taken", "completed"})
"""`broker.state.Ingested.outcome`s of a transition the broker took (not rejected, duplicate, out of order, stale)."""
_CHANNELS = (1, 3, 4)  # grey, RGB, RGBA: what the wire lets through


@dataclass(frozen=True)
class Picture:
    """One kept picture: the current observation of a transition the broker took, and where it came from."""

    id: str
    image: np.ndarray  # [H, W, C] uint8, C in (1, 3, 4); a copy of the received bytes
    actor: str
    traj_id: str
    group_id: int
    step: int
    reward: float
    version_lo: int
    version_hi: int
    done: bool
    valid: bool
    prompt_images: int
    """Pictures in the transition's prompt (this one the last)."""
    received: float
    """Unix time the broker took the transition."""

    def meta(self) -> dict[str, Any]:
        """What `/api/images` and the dashboard's snapshot say of it (JSON-ready)."""
        height, width, channels = self.image.shape
        return {
            "id": self.id,
            "url": f"api/images/{self.id}.png",
            "width": width,
            "height": height,
            "channels": channels,
            "actor": self.actor,
            "traj_id": self.traj_id,
            "group_id": self.group_id,
            "step": self.step,
            "reward": self.reward,
            "version_lo": self.version_lo,
            "version_hi": self.version_hi,
            "done": self.done,
            "valid": self.valid,
            "prompt_images": self.prompt_images,
            "received": self.received,
        }


class Gallery:
    """A ring of the newest `size` pictures (0: keeps none). Ids are never reused, not even by a restarted broker:
    a page that outlived the broker never shows an old picture under a new caption."""

    def __init__(self, size: int) -> None:
        self.size = max(0, size)
        self._kept: deque[Picture] = deque(maxlen=self.size)
        self._prefix = secrets.token_hex(3) + "-"  # this broker's; the counter after it numbers its pictures
        self._next = 0

    def keep(self, ts: Sequence[Transition], outcomes: Sequence[str], now: float | None = None) -> int:
        """Keep the current observation (last prompt picture) of each of `ts` (in the order taken) whose outcome
        is in TAKEN and that shows a picture; only the newest `size` of them are copied. Returns how many."""
        chosen: list[Transition] = []
        for t, outcome in zip(reversed(ts), reversed(outcomes), strict=True):
            if len(chosen) == self.size:
                break
            if outcome in TAKEN and t.images.size:
                chosen.append(t)
        received = time.time() if now is None else now
        for t in reversed(chosen):
            self._kept.append(
                Picture(
                    id=f"{self._prefix}{self._next}",
                    image=np.array(t.images[-1]),
                    actor=t.actor,
                    traj_id=t.traj_id,
                    group_id=t.group_id,
                    step=t.step,
                    reward=float(t.reward),
                    version_lo=t.version_lo,
                    version_hi=t.version_hi,
                    done=bool(t.done or t.truncated),
                    valid=bool(t.valid),
                    prompt_images=int(t.images.shape[0]),
                    received=received,
                )
            )
            self._next += 1
        return len(chosen)

    def entries(self) -> list[dict[str, Any]]:
        """The kept pictures' metadata, newest first."""
        return [p.meta() for p in reversed(self._kept)]

    def get(self, picture_id: str) -> Picture | None:
        """The kept picture `picture_id`, or None (never kept, or pushed out by newer ones)."""
        return next((p for p in self._kept if p.id == picture_id), None)

    def __len__(self) -> int:
        return len(self._kept)


def png(image: np.ndarray) -> bytes:
    """`image` [H, W, C] uint8 as a lossless PNG: grey for C = 1, RGB for 3, RGBA for 4."""
    if image.dtype != np.uint8 or image.ndim != 3 or image.shape[2] not in _CHANNELS:
        raise ValueError(
            f"a picture must be uint8 [H, W, C] with C in (1, 3, 4), not {image.dtype} {list(image.shape)}"
        )
    pixels = image[:, :, 0] if image.shape[2] == 1 else image
    out = io.BytesIO()
    Image.fromarray(np.ascontiguousarray(pixels)).save(out, format="PNG", compress_level=1)  # mode from the shape
    return out.getvalue()
