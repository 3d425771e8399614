"""Live dashboard, `/metrics` and JSON endpoints of a run, served by the broker over HTTP (aiohttp).

The broker owns the run's state; this module only reads it through `state_fn() -> dict`, a snapshot with
the keys time, run{name,status,reason,wall_s,total_steps}, learner{version,step_time_s,loss,publish_s,
batch_wait_s}, engines[{name,url,address,incarnation,version,alive,requests_in_flight,weight_sync_s,
last_seen_s}], actors[{name,address,incarnation,alive,episodes_in_flight,requests_in_flight,env_steps_hung,
version,last_seen_s}], envs{env: {episodes,successes,env_steps,reward_mean,success_rate,invalid_action_ratio}},
rates{...}, counters{...} (run totals), gauges{...}, staleness_hist{lag: count}, recent[point, ...]
(the newest once-a-second points, see `broker.sinks.flatten`) and images[{id,url,width,height,channels,actor,
traj_id,group_id,step,reward,version_lo,version_hi,done,valid,prompt_images,received}] (the observation pictures
kept, newest first, `broker.gallery`; [] in a text run); `history_fn() -> [point, ...]` gives every point kept.
Both run on the event loop per request and once per second per open stream: they must be quick and must not
block. Usage inside the broker:

    app = make_app(broker.snapshot, history_fn=lambda: list(broker.history), history_s=900,
                   gallery=broker.gallery)
    runner = await serve(app, "127.0.0.1", cfg.dashboard_port)      # port 0 picks a free one
    ...
    await runner.cleanup()                                           # ends open streams, then closes

Routes:
    GET /               the page (broker/static/dashboard.html; uPlot charts, vendored, nothing from a CDN)
    GET /static/vendor/ the page's chart library (uPlot 1.6.32, MIT: uPlot.LICENSE beside it)
    GET /api/state      the snapshot as JSON (non-finite floats become null: JSON has no NaN)
    GET /api/history    {"points": [...]}: the kept points, oldest first (the page fills its charts from it)
    GET /api/stream     server-sent events: one `data: <snapshot JSON>` per second until the client leaves
    GET /api/images     {"images": [...]}: the kept observation pictures' metadata, newest first (as in the snapshot)
    GET /api/images/{id}.png   one of them as PNG, encoded on request (404 once newer pictures pushed it out)
    GET /metrics        Prometheus text format 0.0.4 (names documented in broker/catalogue.py)

The page keeps showing the last state when the broker goes away (the run ended, or it died).
Open a tunnel and point a browser at it: `ssh -L 8787:127.0.0.1:8787 host`, then http://127.0.0.1:8787/.
"""

from __future__ import annotations

import asyncio
import errno
import json
import math
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from aiohttp import web

from broker import prometheus
from broker.gallery import Gallery, png

StateFn = Callable[[], dict[str, Any]]
HistoryFn = Callable[[], list[dict[str, Any]]]

STATIC_DIR = Path(__file__).parent / "static"
PAGE_PATH = STATIC_DIR / "dashboard.html"

_STATE_FN = web.AppKey("state_fn", StateFn)
_HISTORY_FN = web.AppKey("history_fn", HistoryFn)
_PAGE = web.AppKey("page", bytes)
_INTERVAL = web.AppKey("stream_interval_s", float)
_STOP = web.AppKey("stop", asyncio.Event)
_GALLERY = web.AppKey("gallery", Gallery)


def make_app(
    state_fn: StateFn,
    history_fn: HistoryFn | None = None,
    history_s: float = 600,
    stream_interval_s: float = 1.0,
    gallery: Gallery | None = None,
) -> web.Application:
    """The dashboard app. `history_s` is how much history the page keeps and plots (in the browser); `gallery`:
    the observation pictures `/api/images` serves (None: none)."""
    for needed in (PAGE_PATH, STATIC_DIR / "vendor" / "uPlot.iife.min.js"):
        if not needed.is_file():
            raise FileNotFoundError(f"dashboard file missing at {needed}; reinstall agentstream with its package data")
    page = PAGE_PATH.read_text(encoding="utf-8").replace("__HISTORY_S__", repr(float(history_s)))
    app = web.Application()
    app[_STATE_FN] = state_fn
    app[_HISTORY_FN] = history_fn or list  # list() is []: no history kept
    app[_PAGE] = page.encode("utf-8")
    app[_INTERVAL] = float(stream_interval_s)
    app[_STOP] = asyncio.Event()
    app[_GALLERY] = gallery if gallery is not None else Gallery(0)
    app.on_shutdown.append(_signal_stop)
    app.router.add_get("/", _page)
    app.router.add_get("/api/state", _state)
    app.router.add_get("/api/history", _history)
    app.router.add_static("/static/vendor/", STATIC_DIR / "vendor")  # uPlot's script, style, licence
    app.router.add_get("/api/stream", _stream)
    app.router.add_get("/api/images", _images)
    app.router.add_get("/api/images/{id}.png", _image_png)
    app.router.add_get("/metrics", _metrics)
    return app


async def serve(app: web.Application, host: str, port: int) -> web.AppRunner:
    """Start serving `app` on host:port; the caller owns the returned runner and calls `runner.cleanup()`."""
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port).start()
    except OSError as exc:
        await runner.cleanup()
        if exc.errno == errno.EADDRINUSE:
            raise OSError(
                errno.EADDRINUSE,
                f"dashboard port {port} on {host} is already in use; set broker.dashboard_port to a free port "
                f"(or 0 to pick one)",
            ) from exc
        raise
    return runner


async def _signal_stop(app: web.Application) -> None:
    app[_STOP].set()  # open streams end now instead of holding the shutdown for up to its timeout


async def _page(request: web.Request) -> web.Response:
    return web.Response(
        body=request.app[_PAGE], content_type="text/html", charset="utf-8", headers={"Cache-Control": "no-store"}
    )


async def _state(request: web.Request) -> web.Response:
    return web.Response(
        text=to_json(request.app[_STATE_FN]()), content_type="application/json", headers={"Cache-Control": "no-store"}
    )


async def _history(request: web.Request) -> web.Response:
    return web.Response(
        text=to_json({"points": request.app[_HISTORY_FN]()}),
        content_type="application/json",
        headers={"Cache-Control": "no-store"},
    )


async def _images(request: web.Request) -> web.Response:
    return web.Response(
        text=to_json({"images": request.app[_GALLERY].entries()}),
        content_type="application/json",
        headers={"Cache-Control": "no-store"},
    )


async def _image_png(request: web.Request) -> web.Response:
    gallery, picture_id = request.app[_GALLERY], request.match_info["id"]
    picture = gallery.get(picture_id)
    if picture is None:
        raise web.HTTPNotFound(
            text=(
                f"no observation picture {picture_id!r}: the broker keeps only the newest {gallery.size} "
                f"(broker.dashboard_images) and none of a text run; /api/images lists those kept now"
            )
        )
    # A picture's id is never reused (broker.gallery): the browser may keep it for good.
    return web.Response(
        body=png(picture.image),
        content_type="image/png",
        headers={"Cache-Control": "private, max-age=86400, immutable"},
    )


async def _stream(request: web.Request) -> web.StreamResponse:
    app = request.app
    resp = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-store", "X-Accel-Buffering": "no"}
    )
    await resp.prepare(request)
    try:
        await resp.write(b"retry: 2000\n\n")  # how long the browser waits before reconnecting
        async for snapshot in _snapshots(app[_STATE_FN], app[_STOP], app[_INTERVAL]):
            await resp.write(f"data: {to_json(snapshot)}\n\n".encode())
    except ConnectionResetError:  # the client left; aiohttp's ClientConnectionResetError is one of these
        pass
    return resp


async def _snapshots(state_fn: StateFn, stop: asyncio.Event, interval_s: float) -> AsyncIterator[dict[str, Any]]:
    """One snapshot now, then one per `interval_s`, until `stop` is set (app shutdown)."""
    while not stop.is_set():
        yield state_fn()
        try:  # asyncio.sleep(interval_s) that wakes early on shutdown
            await asyncio.wait_for(stop.wait(), timeout=interval_s)
        except TimeoutError:
            pass


async def _metrics(request: web.Request) -> web.Response:
    body = prometheus.render_prometheus(request.app[_STATE_FN]())
    return web.Response(body=body, headers={"Content-Type": prometheus.CONTENT_TYPE})


def to_json(state: dict[str, Any]) -> str:
    """One-line JSON of `state`; NaN and infinities become null (browsers' JSON.parse rejects them)."""
    return json.dumps(_finite(state), separators=(",", ":"), allow_nan=False)


def _finite(obj: Any) -> Any:
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj
