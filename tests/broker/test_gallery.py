"""The dashboard's gallery of observation pictures (broker/gallery.py, `/api/images` in broker/dashboard.py): the
ring keeps the newest N current observations of what the broker took, each PNG decodes to exactly the pixels sent,
an unknown or pushed-out id is a 404, and a text run keeps nothing. Under a second.

    .venv/bin/python -m pytest tests/broker/test_gallery.py -q
"""

from __future__ import annotations

import io

import aiohttp
import numpy as np
import pytest
from aiohttp.test_utils import TestClient, TestServer
from broker_testing import recv, start_broker
from e2e_testing import dealer
from PIL import Image

from agentstream.config import Config
from agentstream.wire import messages as P
from broker.dashboard import make_app
from broker.gallery import Gallery, png

RNG = np.random.default_rng(0)
NONE = np.zeros((0, 0, 0, 0), np.uint8)


def step(
    traj: str, n: int, images: np.ndarray, seq: int = -1, gid: int = 0, done: bool = False, reward: float = 0.0
) -> P.Transition:
    return P.Transition(
        traj_id=traj,
        group_id=gid,
        actor="actor-0",
        step=n,
        prompt_ids=np.array([1, 2], np.int32),
        response_ids=np.array([3], np.int32),
        logprobs=np.array([-0.5], np.float32),
        version_lo=2,
        version_hi=3,
        reward=reward,
        done=done,
        truncated=False,
        valid=True,
        images=images,
        seq=seq,
    )


def pictures(n: int, h: int = 6, w: int = 5, c: int = 3) -> np.ndarray:
    return RNG.integers(0, 256, (n, h, w, c), dtype=np.uint8)


def decoded(body: bytes) -> np.ndarray:
    """A PNG's pixels as [H, W, C] (Pillow reads a grey PNG as [H, W])."""
    pixels = np.asarray(Image.open(io.BytesIO(body)))
    return pixels[:, :, None] if pixels.ndim == 2 else pixels


# ------------------------------------------------------------------------------------------ the ring


def test_the_ring_keeps_the_newest_current_observations_of_what_was_taken() -> None:
    gallery = Gallery(3)
    shown = [pictures(2) for _ in range(6)]  # 6 transitions, 2 pictures each: the second is the current one
    ts = [step("t", n, shown[n]) for n in range(6)]
    # One at a time: steps 0, 1 (rejected: not kept), 2, then a text step (nothing to keep).
    assert gallery.keep([ts[0]], ["taken"]) == 1
    assert gallery.keep([ts[1]], ["rejected"]) == 0
    assert gallery.keep([ts[2], step("t", 9, NONE)], ["completed", "taken"]) == 1
    assert [e["step"] for e in gallery.entries()] == [2, 0]  # newest first
    first_id = gallery.entries()[-1]["id"]
    # A bundle of steps 3, 4, 5 (4 a duplicate): 3 and 5 are kept, and push step 0 out of the ring of 3.
    assert gallery.keep(ts[3:], ["taken", "duplicate", "taken"]) == 2
    assert [e["step"] for e in gallery.entries()] == [5, 3, 2]
    assert gallery.get(first_id) is None and len(gallery) == 3
    for e in gallery.entries():
        kept = gallery.get(e["id"])
        assert np.array_equal(kept.image, shown[e["step"]][1])  # the last picture of the prompt
        assert not np.shares_memory(kept.image, shown[e["step"]])  # a copy: the received message can go
        assert (e["width"], e["height"], e["channels"], e["prompt_images"]) == (5, 6, 3, 2)
        assert (e["actor"], e["version_lo"], e["version_hi"]) == ("actor-0", 2, 3)
        assert e["url"] == f"api/images/{e['id']}.png"
    assert len({e["id"] for e in gallery.entries()} | {first_id}) == 4  # ids are never reused


def test_a_large_bundle_copies_only_the_newest_pictures_and_a_text_run_keeps_nothing() -> None:
    gallery = Gallery(2)
    ts = [step("t", n, pictures(1)) for n in range(100)]
    assert gallery.keep(ts, ["taken"] * 100) == 2  # only steps 99 and 98 are looked at and copied
    assert [e["step"] for e in gallery.entries()] == [99, 98]
    text = Gallery(8)
    assert text.keep([step("t", n, NONE) for n in range(10)], ["taken"] * 10) == 0
    assert text.entries() == [] and len(Gallery(0)) == 0
    assert Gallery(0).keep(ts, ["taken"] * 100) == 0  # broker.dashboard_images=0: none kept


# ------------------------------------------------------------------------------------------ /api/images


@pytest.mark.parametrize("channels", [1, 3, 4], ids=["grey", "rgb", "rgba"])
def test_png_decodes_to_exactly_the_pixels(channels: int) -> None:
    image = pictures(1, 7, 9, channels)[0]
    assert np.array_equal(decoded(png(image)), image)


async def test_the_routes_serve_the_kept_pictures_and_404_for_an_unknown_or_expired_id() -> None:
    gallery = Gallery(2)
    shown = pictures(3, 4, 6, 3)
    for n in range(3):  # step 0's picture is pushed out by steps 1 and 2
        gallery.keep([step("t", n, shown[n : n + 1], reward=0.5 * n)], ["taken"])
    old_id = f"{gallery.entries()[0]['id'][:-1]}0"  # the prefix of this gallery, number 0: step 0's id
    async with TestClient(TestServer(make_app(dict, gallery=gallery))) as c:
        listed = (await (await c.get("/api/images")).json())["images"]
        assert listed == gallery.entries() and [e["step"] for e in listed] == [2, 1]
        assert [e["reward"] for e in listed] == [1.0, 0.5]
        for e in listed:
            resp = await c.get("/" + e["url"])
            assert resp.status == 200 and resp.content_type == "image/png"
            assert np.array_equal(decoded(await resp.read()), shown[e["step"]])
        for unknown in (old_id, "nope"):
            resp = await c.get(f"/api/images/{unknown}.png")
            assert resp.status == 404, unknown
            assert "newest 2 (broker.dashboard_images)" in await resp.text() and "/api/images" in await resp.text()
    async with TestClient(TestServer(make_app(dict))) as c:  # no gallery: an empty list
        assert await (await c.get("/api/images")).json() == {"images": []}


# ------------------------------------------------------------------------------------------ in the broker


async def test_the_broker_keeps_nothing_of_a_text_run_then_the_pictures_it_takes() -> None:
    cfg = Config()
    cfg.env.group_size, cfg.trainer.groups_per_step, cfg.learner.world_size, cfg.broker.logger = 2, 1, 1, []
    cfg.broker.dashboard_images = 8
    broker, task, address = await start_broker(cfg)
    actor = dealer(address, "actor-0")
    a, c = pictures(2, 8, 8, 3), pictures(3, 4, 4, 4)

    async def send(*msgs: P.Message, upto: int) -> None:
        for msg in msgs:
            await actor.send_multipart(P.encode(msg))
        acked = -1
        while acked < upto:
            ack = await recv(actor)
            assert isinstance(ack, P.Ack), ack
            acked = ack.upto

    try:
        await actor.send_multipart(P.encode(P.GroupRequest(actor="actor-0")))
        gid = (await recv(actor)).group_id
        await send(step("t0", 0, NONE, 0, gid), step("t0", 1, NONE, 1, gid, done=True), upto=1)
        assert len(broker.gallery) == 0 and broker.snapshot()["images"] == []  # text only so far: nothing kept
        # t1's two steps bundled (seq 2, 3), then seq 2 again (a resend: a duplicate, not kept twice).
        bundle = P.Transitions.of([step("t1", 0, a, 2, gid, reward=0.25), step("t1", 1, c, 3, gid, done=True)])
        await send(bundle, step("t1", 0, a, 2, gid), upto=3)
        snap = broker.snapshot()["images"]
        assert [(e["traj_id"], e["step"], e["reward"], e["prompt_images"]) for e in snap] == [
            ("t1", 1, 0.0, 3),
            ("t1", 0, 0.25, 2),
        ]
        host = f"http://127.0.0.1:{broker.dashboard_port}"
        async with aiohttp.ClientSession() as http:
            async with http.get(f"{host}/api/images") as resp:
                assert (await resp.json())["images"] == snap
            for e, want in zip(snap, (c[-1], a[-1]), strict=True):  # each prompt's last picture
                async with http.get(f"{host}/{e['url']}") as resp:
                    assert np.array_equal(decoded(await resp.read()), want)
    finally:
        broker.stop()
        await task
        actor.close()
