"""The dashboard page in a real browser: headless Debian Chromium driven by Selenium (chromedriver at
/usr/bin/chromedriver; Selenium Manager never downloads anything).

    .venv/bin/python -m pytest tests/test_dashboard_browser.py -q -p no:cacheprovider

- `test_page_...` (~5 s): the page against hand-made snapshots: history then stream, a joining engine adds a
  line, the gallery of observation pictures stays hidden until pictures come, then shows the newest, and when
  the server goes away the page keeps the last state.
- `test_live_run_...` (~40-50 s): a real launcher run (the session's vLLM server, 1 learner rank, 2 actors); the charts'
  data advance between two moments, the actor table lists every actor, the page shows the final state after
  the run, and /metrics, metrics.jsonl and TensorBoard hold the same numbers. Screenshot: RUN/dashboard.png,
  copied to runs/test-artifacts/dashboard.png.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from e2e_testing import read_tensorboard, wait_for

from agentstream.wire.addresses import free_port
from agentstream.wire.messages import Transition
from broker.dashboard import make_app, serve
from broker.gallery import Gallery

ROOT = Path(__file__).resolve().parents[1]
ARTIFACTS = ROOT / "runs" / "test-artifacts"
CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
LINE_CHARTS = [
    "chart-env_steps",
    "chart-tokens",
    "chart-transitions",
    "chart-learner",
    "chart-step_time",
    "chart-versions",
    "chart-staleness",
    "chart-buffer",
    "chart-reward",
    "chart-success",
    "chart-invalid",
    "chart-weight_sync",
    "chart-mismatch",
]


@pytest.fixture
def browser() -> Iterator[Any]:
    missing = [p for p in (CHROMIUM, CHROMEDRIVER) if not os.access(p, os.X_OK)]
    if missing:
        pytest.fail(f"{missing} missing: `apt-get install -y chromium chromium-driver` (scripts/setup.sh does it)")
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    os.environ["SE_OFFLINE"] = "true"  # Selenium Manager must not look for drivers on the network
    opts = Options()
    opts.binary_location = CHROMIUM
    for arg in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--window-size=1500,2400",
        "--disable-extensions",
        "--no-first-run",
    ):
        opts.add_argument(arg)
    driver = webdriver.Chrome(options=opts, service=Service(executable_path=CHROMEDRIVER))
    driver.set_script_timeout(10)
    try:
        yield driver
    finally:
        driver.quit()


def wait_until(predicate: Callable[[], Any], timeout_s: float, what: str) -> Any:
    return wait_for(predicate, timeout_s, what, poll_s=0.2)


def page(driver: Any, expr: str) -> Any:
    return driver.execute_script(f"return {expr};")


def table(driver: Any, table_id: str) -> list[list[str]]:
    """The rows' cell texts, read in one go (the page rewrites its tables with every snapshot)."""
    return page(
        driver,
        f"Array.from(document.querySelectorAll('#{table_id} tbody tr'))"
        ".map(r => Array.from(r.cells).map(c => c.textContent))",
    )


# ------------------------------------------------------------------------------------------ hand-made states


def snapshot(n: int, engines: int) -> dict[str, Any]:
    """State number n: learner at version n, one point per second ending at time 1000 + n."""
    t = 1000.0 + n
    return {
        "time": t,
        "run": {"name": "fake", "status": "running", "reason": "", "wall_s": float(n), "total_steps": 99},
        "learner": {"version": n, "step_time_s": 1.5, "loss": 0.5, "publish_s": 0.1, "batch_wait_s": 0.0},
        "engines": [
            {
                "name": f"engine-{i}",
                "url": f"http://127.0.0.1:{8000 + i}",
                "address": f"http://127.0.0.1:{8000 + i}",
                "incarnation": 0,
                "version": n,
                "alive": True,
                "requests_in_flight": 3,
                "weight_sync_s": 0.05,
                "last_seen_s": 0.5,
            }
            for i in range(engines)
        ],
        "actors": [
            {
                "name": f"actor-{i}",
                "address": f"pid {100 + i}",
                "incarnation": i,
                "alive": i != 2,
                "episodes_in_flight": 4,
                "requests_in_flight": 2,
                "version": n,
                "last_seen_s": 0.3,
            }
            for i in range(3)
        ],
        "envs": {
            "lake": {
                "episodes": 10.0,
                "successes": 2.0,
                "env_steps": 50.0,
                "reward_mean": 0.2,
                "success_rate": 0.2,
                "invalid_action_ratio": 0.1,
            }
        },
        "rates": {
            "env_steps_per_s": 10.0 + n,
            "tokens_per_s": 500.0,
            "transitions_per_s": 10.0,
            "learner_samples_per_s": 8.0,
            "learner_steps_per_s": 0.5,
        },
        "counters": {"transitions_ingested": 100.0 * n, "transitions_trained": 90.0 * n},
        "gauges": {"buffered_transitions": 10.0, "staleness_mean": 0.5, "staleness_max": 1.0},
        "staleness_hist": {"0": 5, "1": 7},
        "recent": [point(m, engines) for m in range(max(0, n - 4), n + 1)],
    }


def point(n: int, engines: int) -> dict[str, Any]:
    p = {
        "t": 1000.0 + n,
        "env_steps_per_s": 10.0 + n,
        "tokens_per_s": 500.0,
        "transitions_per_s": 10.0,
        "learner_samples_per_s": 8.0,
        "learner_step_time_s": 1.5,
        "learner_version": n,
        "staleness_mean": 0.5,
        "staleness_max": 1.0,
        "buffered_transitions": 10.0,
        "invalid_action_ratio": 0.1,
        "learner_publish_s": 0.1,
        "reward_mean/lake": 0.2,
        "success_rate/lake": 0.2,
        "invalid_action_ratio/lake": 0.1,
        "learner_mismatch_logp_abs_mean": 1e-6,
        "learner_mismatch_logp_abs_max": 4e-6,
        "learner_mismatch_kl": 1e-12,
    }
    p.update({f"engine_version/engine-{i}": n for i in range(engines)})
    p.update({f"weight_sync_s/engine-{i}": 0.05 for i in range(engines)})
    return p


class FakeBroker:
    """The dashboard app on a thread of its own (Selenium is synchronous), over states that advance."""

    def __init__(self) -> None:
        self.n, self.engines = 30, 1
        self.gallery = Gallery(3)
        self.loop = asyncio.new_event_loop()
        self.port = free_port()
        ready = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(ready,), daemon=True)
        self.thread.start()
        assert ready.wait(10), "dashboard did not start"

    def state(self) -> dict[str, Any]:
        self.n += 1  # one new point per snapshot
        return {**snapshot(self.n, self.engines), "images": self.gallery.entries()}

    def show(self, ts: list[Transition]) -> None:
        """Keep the pictures of `ts`, on the server's loop (where the snapshots read the gallery)."""

        async def keep() -> None:
            self.gallery.keep(ts, ["taken"] * len(ts), now=1000.0 + self.n)

        asyncio.run_coroutine_threadsafe(keep(), self.loop).result(timeout=10)

    def _run(self, ready: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)
        app = make_app(
            self.state,
            history_fn=lambda: [point(m, 1) for m in range(31)],
            history_s=600,
            stream_interval_s=0.25,
            gallery=self.gallery,
        )
        self.runner = self.loop.run_until_complete(serve(app, "127.0.0.1", self.port))
        ready.set()
        self.loop.run_forever()

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(timeout=10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)


def test_page_draws_history_and_stream_and_keeps_the_last_state_when_the_server_goes(browser: Any) -> None:
    fake = FakeBroker()
    try:
        browser.get(f"http://127.0.0.1:{fake.port}/")
        assert page(browser, "typeof uPlot") == "function"  # the vendored library loaded from the broker
        # 31 history points (t = 1000..1030), then the stream's: every line chart holds more than 31.
        wait_until(
            lambda: min(page(browser, "agentstreamDashboard.points()")[c] for c in LINE_CHARTS) > 33,
            15,
            "history + streamed points in every chart",
        )
        first = page(browser, "agentstreamDashboard.latest()")
        time.sleep(1.0)
        second = page(browser, "agentstreamDashboard.latest()")
        assert all(second[c] > first[c] for c in LINE_CHARTS), (first, second)
        rows = table(browser, "actors-table")
        assert [r[0] for r in rows] == ["actor-0", "actor-1", "actor-2"]
        assert [r[3] for r in rows] == ["yes", "yes", "no"]  # actor-2 is dead in these states
        assert rows[1][:3] == ["actor-1", "pid 101", "1"] and rows[1][4:6] == [
            "4",
            "2",
        ]  # address, incarnation, in flight
        # An engine joins: the versions chart gains a line (x, learner, engine-0, engine-1).
        assert page(browser, "agentstreamDashboard.plots['chart-versions'].u.series.length") == 3
        fake.engines = 2
        wait_until(
            lambda: page(browser, "agentstreamDashboard.plots['chart-versions'].u.series.length") == 4,
            10,
            "a line for the new engine",
        )
        assert [r[0] for r in table(browser, "engines-table")] == ["engine-0", "engine-1"]
        # The histogram has bars at lags 0 and 1.
        assert page(browser, "agentstreamDashboard.plots['chart-staleness_hist'].u.data") == [[0, 1], [5, 7]]
        check_gallery(browser, fake)
    finally:
        fake.close()
    # The server is gone: the page says so and keeps the last state, charts included.
    wait_until(lambda: page(browser, "agentstreamDashboard.connection") == "disconnected", 15, "'disconnected'")
    kept = page(browser, "agentstreamDashboard.points()")
    last_version = page(browser, "agentstreamDashboard.lastState.learner.version")
    assert browser.find_element("id", "tile-version").text == f"{last_version} / 99"
    assert min(kept[c] for c in LINE_CHARTS) > 33
    assert len(table(browser, "actors-table")) == 3
    assert page(browser, "agentstreamDashboard.gallery()") == [e["id"] for e in fake.gallery.entries()]


def observation(n: int) -> Transition:
    """Step n of one trajectory; its prompt shows 2 pictures, 40 high and 48 wide, the current one last."""
    images = np.random.default_rng(n).integers(0, 256, (2, 40, 48, 3), dtype=np.uint8)
    return Transition(
        traj_id="t",
        group_id=0,
        actor="actor-1",
        step=n,
        prompt_ids=np.zeros(2, np.int32),
        response_ids=np.zeros(1, np.int32),
        logprobs=np.zeros(1, np.float32),
        version_lo=n,
        version_hi=n,
        reward=0.5,
        done=False,
        truncated=False,
        valid=True,
        images=images,
    )


def check_gallery(browser: Any, fake: FakeBroker) -> None:
    """No pictures: no gallery. Then 4 steps with pictures: the newest 3 (the ring of 3), newest first, each
    loaded at its own size, drawn 4x (224 px // 48) with pixelated rendering, with its caption."""
    assert page(browser, "document.getElementById('gallery').hidden") is True
    assert not browser.find_element("id", "gallery").is_displayed()
    fake.show([observation(n) for n in range(4)])
    want = [e["id"] for e in fake.gallery.entries()]
    wait_until(lambda: page(browser, "agentstreamDashboard.gallery()") == want, 10, "the newest 3 pictures")
    assert browser.find_element("id", "gallery").is_displayed()
    imgs = "Array.from(document.querySelectorAll('#gallery-items img'))"
    wait_until(lambda: page(browser, f"{imgs}.every(i => i.complete && i.naturalWidth > 0)"), 10, "pictures loaded")
    assert page(browser, f"{imgs}.map(i => [i.naturalWidth, i.naturalHeight])") == [[48, 40]] * 3
    assert page(browser, f"{imgs}.map(i => [i.clientWidth, i.clientHeight])") == [[192, 160]] * 3
    assert page(browser, f"{imgs}.map(i => getComputedStyle(i).imageRendering)") == ["pixelated"] * 3
    captions = page(browser, "Array.from(document.querySelectorAll('#gallery-items figcaption'), c => c.innerText)")
    assert [c.split("\n")[0] for c in captions] == ["actor-1 · step 3", "actor-1 · step 2", "actor-1 · step 1"]
    assert all(c.split("\n")[1].startswith(f"reward 0.500 · v{3 - i} ") for i, c in enumerate(captions)), captions


# ------------------------------------------------------------------------------------------ a real run

STEPS = 3


def get_json(url: str) -> dict[str, Any] | None:
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return json.loads(resp.read())
    except OSError:
        return None


def tensorboard_tags(logdir: Path) -> dict[str, list[float]]:
    return {tag: [v for _, v in points] for tag, points in read_tensorboard(logdir).items()}


@pytest.mark.e2e
def test_live_run_dashboard_advances_lists_every_actor_and_keeps_the_final_state(
    browser: Any, tiny_engine, tmp_path: Path
) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    run_dir, port = tmp_path / "run", free_port()
    base = f"http://127.0.0.1:{port}"
    model, url = tiny_engine  # the session's server (its learner brings it to the run's weights first)
    argv = [
        sys.executable,
        "scripts/launch.py",
        f"run.output_dir={run_dir}",
        f"model.path={model}",
        f"engines.external_urls=[{url}]",
        "actors.count=2",
        "actors.episodes_per_actor=8",
        "env.group_size=4",
        "learner.world_size=1",
        f"trainer.total_steps={STEPS}",
        "trainer.groups_per_step=2",
        f"broker.dashboard_port={port}",
        "run.startup_timeout_s=600",
    ]  # a loaded 2-core machine has taken 4 min to start vLLM
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:

        def streaming() -> bool:
            if proc.poll() is not None:
                raise AssertionError(f"the launcher exited early:\n{proc.communicate()[0][-3000:]}")
            s = get_json(base + "/api/state")
            return bool(s and len(s["actors"]) == 2 and s["counters"].get("transitions_ingested", 0) > 0)

        wait_until(streaming, 600, "both actors streaming transitions")
        browser.get(base + "/")
        wait_until(
            lambda: min(page(browser, "agentstreamDashboard.points()")[c] for c in LINE_CHARTS) >= 3,
            20,
            "points in every chart",
        )
        first = page(browser, "agentstreamDashboard.latest()")
        time.sleep(2.5)
        second = page(browser, "agentstreamDashboard.latest()")
        assert all(second[c] > first[c] for c in LINE_CHARTS), (first, second)
        state = get_json(base + "/api/state")
        names = [r[0] for r in table(browser, "actors-table")]
        assert sorted(names) == sorted(a["name"] for a in state["actors"]) == ["actor-0", "actor-1"]
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        browser.save_screenshot(str(run_dir / "dashboard.png"))
        shutil.copy(run_dir / "dashboard.png", ARTIFACTS / "dashboard.png")
        out, _ = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:  # a failed check: Ctrl-C makes the launcher stop everything it started
            proc.send_signal(signal.SIGINT)
            try:
                proc.communicate(timeout=90)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.communicate()
    assert proc.returncode == 0, out[-3000:]
    # The run ended and the broker with it: the page shows the final state.
    wait_until(lambda: page(browser, "agentstreamDashboard.connection") == "disconnected", 15, "'disconnected'")
    assert page(browser, "agentstreamDashboard.lastState.run.status") == "finished"
    assert browser.find_element("id", "tile-version").text == f"{STEPS} / {STEPS}"
    browser.save_screenshot(str(ARTIFACTS / "dashboard-final.png"))
    # Same numbers in /metrics (as the launcher saved it at the end), metrics.jsonl and TensorBoard.
    fams = {f.name: f for f in text_string_to_metric_families((run_dir / "metrics.txt").read_text())}
    assert fams["agentstream_learner_version"].samples[0].value == STEPS
    env_rows = {s.labels["env"]: s.value for s in fams["agentstream_env_episodes"].samples}
    assert list(env_rows) == ["agentstream/FrozenLake-v0"] and env_rows["agentstream/FrozenLake-v0"] > 0
    actors = {s.labels["actor"] for s in fams["agentstream_actor_requests_in_flight"].samples}
    assert actors == {"actor-0", "actor-1"}
    points = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert points[-1]["learner_version"] == STEPS and points[-1]["engine_version/engine-0"] == STEPS
    assert [p["t"] for p in points] == sorted(p["t"] for p in points)
    assert max(p["env_steps_per_s"] or 0 for p in points) > 0
    tags = tensorboard_tags(run_dir / "tensorboard")
    assert tags["learner_version"][-1] == STEPS and len(tags["learner_version"]) == len(points)
    assert "reward_mean/agentstream/FrozenLake-v0" in tags
