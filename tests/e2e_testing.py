"""Helpers shared by tests: launcher runs as subprocesses, raw broker clients, a vLLM server's load, the metrics
trackers' files (TensorBoard, W&B, MLflow) read back."""

import asyncio
import collections
import contextlib
import json
import os
import re
import signal
import struct
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import aiohttp
import zmq
import zmq.asyncio


def processes_mentioning(needle: str) -> list[str]:
    out = []
    for pid in os.listdir("/proc"):
        if pid.isdigit() and int(pid) != os.getpid():
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if needle in cmd:
                out.append(f"{pid}: {cmd[:200]}")
    return out


def check_accounting(s: dict) -> None:
    """The chaos test's accounting, from the broker's summary (with broker.track_keys): acknowledged =
    ingested + rejected; ingested = trained + buffered + dropped; every key trained, dropped, rejected or still
    buffered, and settled once."""
    rel, keys = s["reliability"], s["reliability"]["keys"]
    assert rel["transitions_acked"] == s["transitions_ingested"] + sum(rel["transitions_rejected"].values())
    assert s["transitions_ingested"] == (
        s["transitions_trained"] + s["transitions_buffered"] + sum(s["transitions_dropped"].values())
    )
    assert keys["settled_twice"] == 0
    settled = keys["trained"] + keys["dropped"] + keys["rejected"] + keys["buffered"]
    assert keys["tracked"] == settled == rel["transitions_acked"], (keys, rel["transitions_acked"])


def wait_for(predicate, timeout_s: float, what: str, poll_s: float = 0.5, run_dir: Path | None = None):
    """`predicate`'s first true value within `timeout_s`; on timeout, what the run `run_dir` said of itself."""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll_s)
    raise AssertionError(
        f"timed out after {timeout_s:.0f}s waiting for {what}"
        + ("" if run_dir is None else f"; the run says:\n{run_account(run_dir)}")
    )


def run_account(run_dir: Path) -> str:
    """A run's own account of how it stands: its summary's status and reason, else its launch log's end."""
    summary = run_dir / "summary.json"
    if summary.exists():
        s = json.loads(summary.read_text())
        return f"status {s.get('status')}: {s.get('reason', '')}"
    log = run_dir / "launch.log"
    return "\n".join(log.read_text().splitlines()[-20:]) if log.exists() else "(nothing yet)"


def api_state(port: int) -> dict | None:
    """The broker's /api/state on this dashboard port, or None while it does not answer."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/state", timeout=2) as resp:
            return json.loads(resp.read())
    except OSError:
        return None


def dealer(address: str, name: str) -> zmq.asyncio.Socket:
    sock = zmq.asyncio.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, name.encode())
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    return sock


def vllm_metric(text: str, name: str) -> float:
    """One of a vLLM server's Prometheus metrics (`vllm:<name>`) in its /metrics `text`, summed over its labels."""
    return sum(float(v) for v in re.findall(rf"^vllm:{name}\{{[^}}]*\}} (\S+)$", text, re.M))


async def vllm_metrics(session: aiohttp.ClientSession, url: str) -> str:
    async with session.get(url + "/metrics") as resp:
        return await resp.text()


async def wait_until_all_decode(
    session: aiohttp.ClientSession, url: str, tasks: list[asyncio.Task], tokens_before: float
) -> None:
    """Until all of `tasks`' requests are in the engine's running batch, none waits, and they have sampled a
    few tokens each. The token count alone can pass while one request has not yet reached the engine on a busy
    machine; that one would start after an update the test means to land mid-way."""
    n = len(tasks)
    while True:
        text = await vllm_metrics(session, url)  # one read for the three figures
        if (
            vllm_metric(text, "num_requests_running") == n
            and vllm_metric(text, "num_requests_waiting") == 0
            and vllm_metric(text, "generation_tokens_total") >= tokens_before + 2 * n
        ):
            return
        assert not any(t.done() for t in tasks), "a request ended before the update could start"
        await asyncio.sleep(0.05)


def read_tensorboard(logdir: Path) -> dict[str, list[tuple[int, float]]]:
    """(step, value) per tag from the TFRecord event files: u64 length, u32 crc, Event proto, u32 crc."""
    from tensorboardX.proto.event_pb2 import Event

    out: dict[str, list[tuple[int, float]]] = {}
    for path in sorted(logdir.glob("events.out.tfevents.*")):
        data, i = path.read_bytes(), 0
        while i + 12 <= len(data):
            (n,) = struct.unpack("<Q", data[i : i + 8])
            event = Event.FromString(data[i + 12 : i + 12 + n])
            i += 12 + n + 4
            for v in event.summary.value:
                out.setdefault(v.tag, []).append((event.step, v.simple_value))
    return out


def read_wandb(wandb_dir: Path) -> tuple[dict, dict[str, list[tuple[int, float]]]]:
    """The one W&B run under `wandb_dir` (RUN/wandb), read by wandb's own reader of its run files
    (`wandb leet inspect --json`, one JSON record per line): its run record (name, project, ...) and
    (step, value) per logged key."""
    runs = sorted(wandb_dir.glob("*run-*/run-*.wandb"))
    assert len(runs) == 1, f"expected one W&B run in {wandb_dir}, found {runs}"
    proc = subprocess.run(
        [sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(runs[0])],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
        env={**os.environ, "WANDB_MODE": "offline"},
    )  # offline: no error reports sent
    run: dict = {}
    out: dict[str, list[tuple[int, float]]] = {}
    for line in proc.stdout.splitlines():
        record = json.loads(line)
        if record["type"] == "run":
            run = record["run"]
        elif record["type"] == "history":
            step = int(record["history"]["step"]["num"])
            for key, value in record["history"]["item"].items():
                if not key.startswith("_"):  # wandb's own columns: _step, _runtime, _timestamp
                    out.setdefault(key, []).append((step, value))
    return run, out


def read_mlflow(tracking_uri: str, experiment: str) -> tuple[object, dict[str, list[tuple[int, float]]]]:
    """The one MLflow run of `experiment` at `tracking_uri`, read with MlflowClient: the run and (step, value)
    per metric key (get_metric_history)."""
    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 reads a file store only when told to
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri)
    found = client.get_experiment_by_name(experiment)
    assert found is not None, f"no MLflow experiment {experiment!r} at {tracking_uri}"
    runs = client.search_runs([found.experiment_id])
    assert len(runs) == 1, f"expected one MLflow run in {experiment!r}, found {len(runs)}"
    run = runs[0]
    return run, {
        key: [(m.step, m.value) for m in sorted(client.get_metric_history(run.info.run_id, key), key=lambda m: m.step)]
        for key in run.data.metrics
    }


def lineage(metrics_log: Path) -> list[int]:
    """The learner's versions in the surviving lineage: a `resumed_from: v` line discards what came after v."""
    versions: list[int] = []
    for line in metrics_log.read_text().splitlines():
        rec = json.loads(line)
        if "resumed_from" in rec:
            versions = [v for v in versions if v <= rec["resumed_from"]]
        else:
            versions.append(rec["version"])
    return versions


def check_logged_calls(run: dict, groups: int, group_size: int) -> list:
    """A gateway run's broker log (`run`: "dir", "calls", "ends", as the example agents record them) holds exactly
    the calls the agent made, each episode's last call with the checker's reward ending its trajectory and the
    others 0, in `groups` groups of `group_size`. Returns the logged transitions."""
    from broker.state import logged_transitions

    def key(prompt: list[int], answer: list[int]) -> tuple:
        return tuple(prompt), tuple(answer)

    logged = list(logged_transitions(run["dir"] / "broker-wal"))
    assert collections.Counter(
        key(t.prompt_ids.tolist(), t.response_ids.tolist()) for t in logged
    ) == collections.Counter(key(c["prompt_token_ids"], c["token_ids"]) for c in run["calls"])  # as multisets
    last = {c["episode"]: c for c in run["calls"]}  # the record is in call order per episode
    ends = {key(c["prompt_token_ids"], c["token_ids"]): run["ends"][e]["reward"] for e, c in last.items()}
    for t in logged:
        k = key(t.prompt_ids.tolist(), t.response_ids.tolist())
        assert t.actor == "gateway-0"
        if k in ends:
            assert (t.done or t.truncated) and t.reward == ends[k]
        else:
            assert not (t.done or t.truncated) and t.reward == 0.0
    ended = collections.Counter(t.group_id for t in logged if t.done or t.truncated)
    assert sorted(ended.values()) == [group_size] * groups
    return logged


def tool_round_trips(calls: list[dict], model_dir: str) -> int:
    """Check that every later call of an episode came after a tool call and that its prompt ids extend the previous
    call's prompt and answer ids (never re-tokenised) with the tool's response and a new assistant turn; returns
    how many such round trips there were (`calls`: the example agents' --record rows, in call order)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    by_episode = collections.defaultdict(list)
    for c in calls:
        by_episode[c["episode"]].append(c)
    round_trips = 0
    for episode in by_episode.values():
        assert episode[0]["finish_reason"] in ("tool_calls", "length")  # the first call was forced to act
        for a, b in zip(episode, episode[1:]):
            assert a["tool_calls"], a
            p, r = a["prompt_token_ids"], a["token_ids"]
            assert b["prompt_token_ids"][: len(p) + len(r)] == p + r
            suffix = tok.decode(b["prompt_token_ids"][len(p) + len(r) :])
            assert "<tool_response>" in suffix and suffix.endswith("<|im_start|>assistant\n")
            round_trips += 1
    return round_trips


def agent_run_overrides(run_dir: Path, model: str, url: str, steps: int, dashboard_port: int) -> list[str]:
    """The launcher overrides of an agent example's `--launch` run in the tests: one learner rank, the session's
    vLLM server as the one engine, a group a step, `steps` steps."""
    return [
        f"run.output_dir={run_dir}",
        f"model.path={model}",
        "engines.count=1",
        f"engines.external_urls=[{url}]",
        "learner.world_size=1",
        "trainer.groups_per_step=1",
        f"trainer.total_steps={steps}",
        f"broker.dashboard_port={dashboard_port}",
        "run.shutdown_timeout_s=5",
    ]


def run_agent(argv: list[str], run_dir: Path, record: Path, timeout_s: float = 300) -> dict:
    """Run an agent example with `--launch` to its end (SIGTERM after `timeout_s`: the agent stops its launch, which
    stops its children) and assert it exited 0. Returns its run folder, output, wall time, summary, the calls and
    episode ends it recorded (`--record`), every recorded row and the run's metrics text."""
    t0 = time.monotonic()
    proc = subprocess.Popen(
        argv,
        cwd=Path(__file__).resolve().parents[1],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    wall = time.monotonic() - t0
    assert proc.returncode == 0, f"{out[-3000:]}\n{err[-3000:]}"
    rows = [json.loads(line) for line in record.read_text().splitlines()]
    return {
        "dir": run_dir,
        "out": out,
        "wall_s": wall,
        "summary": json.loads((run_dir / "summary.json").read_text()),
        "calls": [r for r in rows if "turn" in r],
        "ends": {r["episode"]: r for r in rows if "reward" in r},
        "rows": rows,
        "metrics": (run_dir / "metrics.txt").read_text(),
    }


@contextlib.asynccontextmanager
async def broker_and_client(cfg, dashboard_port: int = 0, name: str = "actor-0"):
    """A broker serving on this event loop and an actor's client to it (started, its Hello sent): (broker, client).
    On exit the client drains and closes, then the broker stops. `dashboard_port` 0: any free port."""
    from agentstream.wire.addresses import free_port
    from agentstream.wire.client import AsyncClient
    from agentstream.wire.messages import Hello
    from broker.server import Broker
    from broker.spec import broker_spec

    port = free_port()
    broker = Broker(broker_spec(cfg), port, dashboard_port or free_port())
    serving = asyncio.create_task(broker.serve())
    while broker.status != "running":
        await asyncio.sleep(0.01)
    client = AsyncClient(f"tcp://127.0.0.1:{port}", name=name)
    await client.start(0, cfg.actors.max_unacked, cfg.actors.ack_timeout_s)
    await client.send(Hello(role="actor", name=name, incarnation=0, pid=os.getpid()))
    try:
        yield broker, client
    finally:
        await client.drain(5)
        await client.close()
        broker.stop()
        await serving


async def play_until_ready(actor, broker, groups: int, timeout_s: float = 120) -> None:
    """Run `actor` (an actors.actor.Actor) until `broker`'s buffer holds `groups` formed groups, then stop it; fails
    if the actor ends first or the groups take longer than `timeout_s`."""
    playing = asyncio.create_task(actor.run())
    try:
        async with asyncio.timeout(timeout_s):
            while len(broker.buffer.ready) < groups:
                assert not playing.done(), playing
                await asyncio.sleep(0.1)
    finally:
        playing.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await playing
