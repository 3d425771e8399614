"""A vision-language agent end to end: `preset=cpu_tiny_vl` (the tiny Idefics3, Sokoban rooms as pictures) for its
3 learner steps with every real part: the pictures go from the env through the memory to the engine with the token
ids, on every transition through the broker (whose dashboard shows the newest ones), and into the learner's
forward. ~60 s."""

from __future__ import annotations

import io
import json
import signal
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from agentstream.wire.addresses import free_port

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.e2e


def test_the_vl_preset_trains_its_steps_on_transitions_that_carry_their_pictures(tmp_path: Path) -> None:
    from PIL import Image

    run_dir, port = tmp_path / "run", free_port()
    argv = [
        sys.executable,
        "scripts/launch.py",
        "preset=cpu_tiny_vl",
        f"run.output_dir={run_dir}",
        "actors.episodes_per_actor=4",
        f"broker.dashboard_port={port}",
        "run.shutdown_timeout_s=5",
    ]
    proc = subprocess.Popen(
        argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    seen: dict[str, object] = {}  # the dashboard's gallery while the run goes: its newest list and one PNG
    done = threading.Event()

    def watch() -> None:
        while not done.wait(1.0):
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/images", timeout=5) as r:
                    images = json.loads(r.read())["images"]
                if images:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/{images[0]['url']}", timeout=5) as r:
                        seen.update(images=images, png=r.read())
            except OSError:  # not up yet, or already gone
                pass

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        out, _ = proc.communicate(timeout=600)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGINT)  # the launcher stops its children; then report what it printed
        out, _ = proc.communicate(timeout=60)
    finally:
        done.set()
        watcher.join()
    assert proc.returncode == 0, out[-4000:]
    s = json.loads((run_dir / "summary.json").read_text())
    assert s["status"] == "finished" and s["processes_left"] == [], s.get("reason")
    assert s["learner_version"] == 3 and s["engine_versions"] == {"engine-0": 3}
    assert s["transitions_sent_reported"] == s["transitions_sent"] == s["transitions_ingested"] > 0
    assert s["transitions_ingested"] == (
        s["transitions_trained"] + s["transitions_buffered"] + sum(s["transitions_dropped"].values())
    )
    rows = [json.loads(line) for line in (run_dir / "learner_metrics.jsonl").read_text().splitlines()]
    assert [r["version"] for r in rows] == [1, 2, 3]
    # memory.images=current: every trained transition carried exactly its prompt's one picture
    assert all(r["images_per_transition"] == 1.0 and r["transitions"] > 0 for r in rows), rows
    # the dashboard showed the newest rooms: 96 x 96 RGB (a 6 x 6 room in 16-pixel tiles), the PNG as listed
    assert seen, "the dashboard's /api/images never listed a picture during the run"
    newest = seen["images"][0]
    assert (newest["width"], newest["height"], newest["channels"]) == (96, 96, 3) and newest["prompt_images"] == 1
    assert len(seen["images"]) <= 8 and {e["actor"] for e in seen["images"]} <= {"actor-0", "actor-1"}
    picture = np.asarray(Image.open(io.BytesIO(seen["png"])))
    assert picture.shape == (96, 96, 3) and len(np.unique(picture.reshape(-1, 3), axis=0)) > 1
