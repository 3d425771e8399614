"""Chaos: one real run (2 vLLM engines, a 2-rank FSDP2 learner checkpointing every step, 2 actors)
in which the test pauses the learner, then kill -9s actors three times, one engine, the broker and the learner
(each kill once the run made progress after the previous one).

What must hold at the end, from summary.json, the learner's metrics log and /proc:
- back-pressure: with the learner paused, the actors stop stepping and the broker's buffer stays bounded;
- every acknowledged transition was trained exactly once or dropped with a recorded reason (or is still
  buffered from groups in play when the run ended), and no partial group was trained;
- the learner's version sequence, across its restart from a checkpoint, has no gaps or repeats;
- the restarted broker listens on a new port (its record says which) and every client followed it there;
- every process was restarted as configured, the run finished, and nothing is left behind: not even the
  EngineCore of the engine's API server killed alone (it outlives its parent, reparented to init), found by the
  run's marker in every descendant's environment (launcher.procs.RUN_ENV).
"""

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from e2e_testing import api_state, check_accounting, lineage, processes_mentioning, wait_for

from agentstream.wire.addresses import free_port
from launcher.procs import RUN_ENV, kill_matching, marked

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.e2e
STEPS = 18  # enough that every kill lands while the run is still going (asserted before the learner kill: it came at
# version 8 here, the broker kill at 10; each step after the last kill costs ~5 s of the suite)
G, MAX_STEPS, IN_PLAY = 4, 8, 6  # group_size, max_steps, groups in play: actors x (episodes_per_actor/G + 1)
MAX_BUFFERED = 64


def newest_pid(run_dir: Path, child: str) -> int:
    """The pid the launcher last started `child` under (its log: `started NAME (pid N)`)."""
    pids = re.findall(rf"started {re.escape(child)} \(pid (\d+)\)", (run_dir / "launch.log").read_text())
    assert pids, f"{child} not in the launcher's log"
    return int(pids[-1])


def test_kill_everything_once_and_lose_nothing(tmp_path: Path) -> None:
    run_dir, port = tmp_path / "run", free_port()
    argv = [
        sys.executable,
        "scripts/launch.py",
        f"run.output_dir={run_dir}",
        "actors.count=2",
        "actors.episodes_per_actor=8",
        f"env.group_size={G}",
        f"env.max_steps={MAX_STEPS}",
        "engines.count=2",
        "learner.world_size=2",
        f"trainer.total_steps={STEPS}",
        "trainer.groups_per_step=2",
        "trainer.max_staleness=2",
        "checkpoint.every_steps=1",
        "broker.track_keys=true",
        f"broker.max_buffered_transitions={MAX_BUFFERED}",
        "actors.max_restarts=10",
        "actors.ack_timeout_s=2",
        "run.startup_timeout_s=600",
        f"broker.dashboard_port={port}",
        "broker.heartbeat_timeout_s=600",
    ]  # (the actors held while engine-0 restarts are not taken for dead)
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    rng = random.Random(5)
    figures: dict[str, object] = {}

    def state() -> dict | None:
        return api_state(port)

    def version() -> int:
        s = state()
        return s["learner"]["version"] if s else -1

    def progress(by: int, what: str) -> None:
        start = max(version(), 0)
        wait_for(lambda: version() >= min(start + by, STEPS), 400, what, run_dir=run_dir)

    try:
        wait_for(lambda: version() >= 1, 600, "the first learner step", run_dir=run_dir)
        figures["pause"] = pause_learner(run_dir, state)
        for _ in range(3):
            victim = rng.choice(["actor-0", "actor-1"])
            pid = newest_pid(run_dir, victim)
            assert psutil.pid_exists(pid), (victim, pid, (run_dir / "launch.log").read_text()[-3000:])
            print(f"chaos: kill -9 {victim} (pid {pid}) at {time.time():.3f}", flush=True)
            os.kill(pid, signal.SIGKILL)
            wait_for(lambda: newest_pid(run_dir, victim) != pid, 120, f"{victim}'s restart", run_dir=run_dir)  # noqa: B023
            time.sleep(3)
        progress(1, "a learner step after the actor kills")
        engine_pid, sidecar_pid = newest_pid(run_dir, "engine-0"), newest_pid(run_dir, "sidecar-0")
        cores = [c.pid for c in psutil.Process(engine_pid).children(recursive=True)]  # EngineCore (and worker)
        assert cores, "the vLLM server has no child process: is it still multiprocess?"
        os.kill(engine_pid, signal.SIGKILL)  # the API server alone: its EngineCore would live on, reparented
        progress(1, "a learner step while engine-0 is down (actors moved to engine-1)")
        # The run would go on with engine-1 alone (admission does not wait for an engine that left) and could end
        # before the learner kill: the actors are held (SIGSTOP) until engine-0 is back.
        actors = [newest_pid(run_dir, name) for name in ("actor-0", "actor-1")]
        for pid in actors:
            os.kill(pid, signal.SIGSTOP)
        try:  # (a new pid, not a larger one: pids wrap around)
            wait_for(
                lambda: newest_pid(run_dir, "sidecar-0") != sidecar_pid and engine_serves_current(state()),
                900,
                "engine-0 back, at the learner's current weights",
            )
        finally:
            for pid in actors:
                os.kill(pid, signal.SIGCONT)
        assert [p for p in cores if running(p)] == [], "the dead server's EngineCore outlived the engine's restart"
        assert version() <= STEPS - 5, "the run is nearly over before the learner kill: raise STEPS"
        learner = kill_matching("learner.train", str(run_dir))  # torchrun and both ranks (each in its own session)
        assert len(learner) == 3, learner
        progress(2, "learner steps after its restart from the checkpoint")
        first_broker = json.loads((run_dir / "broker.json").read_text())["address"]
        os.kill(newest_pid(run_dir, "broker"), signal.SIGKILL)
        out, _ = proc.communicate(timeout=900)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            proc.communicate(timeout=120)
    assert proc.returncode == 0, out[-4000:]
    s = json.loads((run_dir / "summary.json").read_text())
    rel = s["reliability"]
    figures.update(
        restarts=s["restarts"],
        actor_restarts=s["actor_restarts"],
        reliability=rel,
        dropped=s["transitions_dropped"],
        shapes=s["trained_group_shapes"],
    )
    print("chaos figures:", json.dumps(figures, indent=1))

    assert s["status"] == "finished" and s["restarts"] == {"broker": 1, "engine": 1, "learner": 1}
    assert s["actor_restarts"] == 3
    # The learner's lineage: 1..STEPS once each, across its restart from a checkpoint.
    assert lineage(run_dir / "learner_metrics.jsonl") == list(range(1, STEPS + 1))
    assert "resumed_from" in (run_dir / "learner_metrics.jsonl").read_text()
    assert s["learner_version"] == STEPS and set(s["engine_versions"].values()) == {STEPS}
    # Delivery accounting, per transition key (broker.track_keys) and in totals.
    check_accounting(s)
    assert rel["keys"]["trained"] == s["transitions_trained"] > 0
    assert set(s["transitions_dropped"]) <= {"actor_died", "actor_left", "actor_silent", "stale"}
    assert set(s["trained_group_shapes"]) == {f"{G}/{G}"}  # no partial group was trained
    assert rel["wal_snapshot_recovered"] or rel["wal_events_recovered"] > 0  # the second broker began from its log
    # ... on a port of its own, which its record named: the actors, sidecars, evaluator and learner followed it there
    # (else they would have waited on the old port to the end).
    assert json.loads((run_dir / "broker.json").read_text())["address"] != first_broker
    assert s["processes_left"] == [] and processes_mentioning(str(run_dir)) == []
    assert marked(RUN_ENV, str(run_dir.resolve())) == {}  # no descendant of any incarnation, reparented or not


def running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def engine_serves_current(st: dict | None) -> bool:
    """engine-0 reports a version within one step of the learner's (it was brought to the current weights)."""
    if not st:
        return False
    versions = {e["name"]: e["version"] for e in st["engines"] if e["alive"]}
    return versions.get("engine-0", -1) >= st["learner"]["version"] - 1 >= 0


def pause_learner(run_dir: Path, state) -> dict:
    """SIGSTOP the learner until the actors have been blocked for 5 s (they finish the groups already admitted,
    then admission holds them back): the buffer and the broker's memory stay bounded meanwhile."""
    broker = psutil.Process(newest_pid(run_dir, "broker"))
    assert len(kill_matching("learner.train", str(run_dir), sig=signal.SIGSTOP)) == 3  # torchrun + 2 ranks
    samples: list[tuple[float, float, int]] = []
    try:
        for _ in range(120):
            time.sleep(1)
            st = state()
            if st:
                samples.append(
                    (
                        st["gauges"]["buffered_transitions"],
                        st["counters"].get("env_steps", 0.0),
                        broker.memory_info().rss,
                    )
                )
            if len(samples) >= 6 and len({e for _, e, _ in samples[-6:]}) == 1:
                break
    finally:
        kill_matching("learner.train", str(run_dir), sig=signal.SIGCONT)
    buffered = [b for b, _, _ in samples]
    steps = [e for _, e, _ in samples]
    rss = [r for _, _, r in samples]
    assert len(set(steps[-6:])) == 1, f"actors kept stepping for 2 min while the learner was paused: {steps}"
    # Admission stops at MAX_BUFFERED held transitions; groups already in play may add at most G x MAX_STEPS
    # each, and an actor has at most episodes_per_actor / G + 1 in play (actors.actor.Actor.max_open_groups).
    assert max(buffered) <= MAX_BUFFERED + IN_PLAY * G * MAX_STEPS, buffered
    assert max(rss) - rss[0] < 50 * 2**20, rss  # no growth beyond noise while held back
    return {"paused_s": len(samples), "buffered_max": max(buffered), "broker_rss_mib_peak": round(max(rss) / 2**20, 1)}
