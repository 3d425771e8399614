"""Joining a running run: `scripts/launch.py role=actors|engines broker.address=...` from other processes.

The end-to-end test (~2-3 min on 2 idle cores) starts a run with 1 actor (1 vLLM engine, 1 learner rank), then,
once the main launch prints the broker's address, adds 2 actors with role=actors and 1 engine with
role=engines. It checks that all 3 actors send transitions that the broker takes in and that the dashboard
lists them; that the joined engine is brought to a weight version newer than the learner's when it joined,
and generates for the joined actors (which follow engines that join; the main run's actor keeps its own);
that Ctrl-C of each joining launch stops its processes cleanly (the actors' unfinished groups dropped as
`actor_left`, nothing left running); and that the run goes on without them. The staleness bound is loose
on purpose: this test is about joining, and admission never waits on weight sync here (tests/test_e2e.py
covers that). The unit tests (milliseconds) cover the ETA, the progress line and how a joining launch merges
its own fields into the run's config.
"""

import json
import os
import re
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from e2e_testing import processes_mentioning, wait_for
from omegaconf import OmegaConf

from agentstream import config as C
from agentstream.wire.addresses import free_port
from agentstream.wire.messages import Welcome
from launcher.join import joined_config
from launcher.progress import eta_s, format_progress

ROOT = Path(__file__).resolve().parents[1]


def test_eta_uses_the_pace_since_the_first_sample() -> None:
    # Versions 2 -> 5 took 30 s: 10 s per step; 10 - 5 = 5 steps left: 50 s. Start-up time is not counted.
    assert eta_s([(100.0, 2), (115.0, 3), (130.0, 5)], total_steps=10) == pytest.approx(50.0)
    assert eta_s([(100.0, 2), (130.0, 2)], total_steps=10) is None  # no progress yet: unknown, not infinite
    assert eta_s([(100.0, 0)], total_steps=10) is None


def test_progress_line_names_step_rates_and_eta() -> None:
    state = {
        "learner": {"version": 4},
        "engines": [{"version": 4}, {"version": 3}],
        "rates": {"env_steps_per_s": 12.34, "tokens_per_s": 567.8, "transitions_per_s": 12.0},
        "gauges": {"buffered_transitions": 40, "success_rate": 0.25, "actors_alive": 3},
    }
    line = format_progress(state, 20, 80.4)
    assert line.startswith("[agentstream] step 4/20 | engines v[4,3] | 12.3 env steps/s | 568 tok/s")
    assert "actors 3" in line and line.endswith("ETA 80s")


def test_a_joining_launch_takes_the_runs_config_but_its_own_actors_and_broker_fields() -> None:
    run = C.Config()
    run.run.output_dir = "runs/main"  # the launcher resolves `${now:...}` before the broker sends the config
    run.env.group_size, run.trainer.total_steps, run.sampling.max_tokens = 2, 50, 40
    run.broker.port, run.engines.count, run.engines.max_model_len = 5555, 3, 2048
    local = C.Config()
    local.run.output_dir = "runs/join"
    local.run.role, local.broker.address, local.actors.count = "actors", "tcp://10.0.0.5:5555", 7
    welcome = Welcome(engines=["http://e:1"], config=OmegaConf.to_yaml(OmegaConf.structured(run)))
    cfg = joined_config(local, welcome)
    assert (cfg.env.group_size, cfg.trainer.total_steps, cfg.sampling.max_tokens) == (2, 50, 40)  # the run's
    assert cfg.engines.max_model_len == 2048  # the run's: prompts must fit the engines that serve them
    assert (cfg.run.role, cfg.actors.count, cfg.broker.address) == ("actors", 7, "tcp://10.0.0.5:5555")  # ours
    assert cfg.engines.count == 1 and cfg.engines.external_urls == []  # this host's servers: ours (default 1)


def test_a_joining_learner_node_takes_the_runs_learner_but_its_own_node_rank() -> None:
    from launcher.join import join_wiring

    run = C.Config()
    run.run.output_dir = "runs/main"
    run.learner.world_size, run.learner.nnodes, run.learner.rdzv_port, run.learner.lr = 8, 2, 29400, 3e-6
    local = C.Config()
    local.run.role, local.broker.address, local.learner.node_rank = "learner", "tcp://10.0.0.5:5555", 1
    welcome = Welcome(weights="tcp://hosta:5556", config=OmegaConf.to_yaml(OmegaConf.structured(run)))
    cfg = joined_config(local, welcome)
    assert (cfg.learner.world_size, cfg.learner.nnodes, cfg.learner.lr, cfg.learner.node_rank) == (8, 2, 3e-6, 1)
    wiring = join_wiring(cfg, welcome)
    assert wiring.rdzv == "hosta:29400"  # node 0's host (where rank 0 publishes) and the run's rendezvous port
    assert wiring.weights_bind == "tcp://hosta:5556" and wiring.engines == []


@pytest.mark.parametrize("external", [True, False], ids=["external-engines", "own-engines"])
def test_every_learner_node_publishes_version_0_with_node_0_when_the_runs_engines_run_elsewhere(
    tmp_path: Path, external: bool
) -> None:
    from launcher.checks import check_config
    from launcher.join import join_wiring
    from launcher.supervisor import Launcher

    run = C.Config()
    run.run.output_dir = "runs/main"
    run.learner.world_size, run.learner.nnodes = 2, 2
    if external:
        run.engines.external_urls = ["http://e:1"]  # (engines.count stays 1: one server started elsewhere)
    main = Launcher(run, tmp_path / "main").commands.learner().argv
    local = C.Config()
    local.run.role, local.broker.address, local.learner.node_rank = "learner", "tcp://127.0.0.1:5555", 1
    welcome = Welcome(weights="tcp://127.0.0.1:5556", config=OmegaConf.to_yaml(OmegaConf.structured(run)))
    cfg = joined_config(local, welcome)
    check_config(cfg)  # what run_join checks before it starts the node's ranks
    node = Launcher(cfg, tmp_path / "node", join_wiring(cfg, welcome), prefix="h-1-").commands.learner().argv
    # Publishing version 0 gathers the weights from every rank (rank 0 sends them): a node whose ranks skip it
    # while node 0's wait in the gather hangs the learner before its first step.
    assert ("--publish-initial" in main, "--publish-initial" in node) == (external, external)


def make_broker(max_staleness: int = 1):  # noqa: ANN201
    """A Broker without sockets: what it would send is recorded as (ident, message)."""
    from broker.server import Broker
    from broker.spec import broker_spec

    cfg = C.Config()
    cfg.run.output_dir = "runs/x"
    cfg.trainer.max_staleness, cfg.learner.weight_port = max_staleness, 5556
    broker = Broker(broker_spec(cfg), port=5555, dashboard_port=8787)
    sent: list = []

    async def record(ident: bytes, msg) -> None:  # noqa: ANN001
        sent.append((ident, msg))

    broker._send = record  # type: ignore[method-assign]
    return broker, sent


async def test_hello_with_want_welcome_gets_the_runs_engines_weights_and_config() -> None:
    from agentstream.wire.messages import EngineStatus, Hello

    broker, sent = make_broker()
    await broker.handle(b"engine-0", EngineStatus(engine="engine-0", url="http://127.0.0.1:8000", version=0))
    await broker.handle(b"learner-0", Hello(role="learner", name="learner-0"))  # no want_welcome: no answer
    assert [m for _, m in sent if m.kind == "welcome"] == []
    await broker.handle(b"launcher-x", Hello(role="launcher", name="launcher-x", want_welcome=True))
    ((ident, welcome),) = [(i, m) for i, m in sent if m.kind == "welcome"]
    assert ident == b"launcher-x" and welcome.engines == ["http://127.0.0.1:8000"]
    assert welcome.weights == "tcp://127.0.0.1:5556" and welcome.dashboard == "http://127.0.0.1:8787/"
    assert C.to_object(OmegaConf.create(welcome.config)).trainer.max_staleness == 1  # the run's config, loadable


async def test_the_welcome_names_where_the_learner_last_said_it_publishes() -> None:
    """A learner placed again on another node tells the broker its new weight address with its reports
    (VersionUpdate.weights); launches that join after that, and sidecars that ask again, are told the new one."""
    from agentstream.wire.messages import Hello, VersionUpdate

    broker, sent = make_broker()

    async def welcome() -> Welcome:
        sent.clear()
        await broker.handle(b"launcher-x", Hello(role="launcher", name="launcher-x", want_welcome=True))
        (answer,) = [m for _, m in sent if m.kind == "welcome"]
        return answer

    assert (await welcome()).weights == "tcp://127.0.0.1:5556"  # as the run started (learner.weight_port)
    await broker.handle(b"learner-0", VersionUpdate(version=1, weights="tcp://127.0.0.1:5556"))  # where it was
    assert (await welcome()).weights == "tcp://127.0.0.1:5556"
    # Its node died: restarted from its version-1 checkpoint on another node, it reports from there.
    await broker.handle(
        b"learner-0", VersionUpdate(version=1, resumed=True, checkpointed=1, weights="tcp://10.0.0.9:41000")
    )
    assert (await welcome()).weights == "tcp://10.0.0.9:41000"
    await broker.handle(b"learner-0", VersionUpdate(version=2, metrics={"loss": 0.5}))  # "": not said, kept
    moved = await welcome()
    assert moved.weights == "tcp://10.0.0.9:41000" and moved.learner_version == 2


async def test_a_late_engine_is_used_only_once_it_serves_recent_weights() -> None:
    from agentstream.wire.messages import EngineStatus, Hello

    broker, sent = make_broker(max_staleness=1)
    await broker.handle(b"engine-0", EngineStatus(engine="engine-0", url="http://a:1", version=0))
    await broker.handle(b"actor-j", Hello(role="actor", name="actor-j", want_welcome=True))
    broker.buffer.learner_version = 5
    await broker.handle(b"engine-0", EngineStatus(engine="engine-0", url="http://a:1", version=5))
    sent.clear()
    # Joins at version 0 while the learner is at 5 (bound 1): 0 < 5 - 1, so admission must not wait on it
    # (the learner that would update it may be waiting for a batch) and no actor is told about it.
    await broker.handle(b"engine-9", EngineStatus(engine="engine-9", url="http://b:2", version=0))
    assert broker.buffer.engine_versions == {"engine-0": 5} and sent == []
    # Its weight sidecar applied the learner's version 5: now it counts and the following actor hears of it.
    await broker.handle(b"engine-9", EngineStatus(engine="engine-9", url="http://b:2", version=5))
    assert broker.buffer.engine_versions == {"engine-0": 5, "engine-9": 5}
    ((ident, welcome),) = [(i, m) for i, m in sent if m.kind == "welcome"]
    assert ident == b"actor-j" and welcome.engines == ["http://a:1", "http://b:2"]


async def test_an_engine_that_leaves_is_no_longer_waited_for_nor_sent_to_joiners() -> None:
    from agentstream.wire.messages import EngineStatus, GroupRequest, Hello, Stats

    broker, sent = make_broker(max_staleness=1)
    for name, url, version in (("engine-0", "http://a:1", 3), ("engine-9", "http://b:2", 1)):
        await broker.handle(name.encode(), EngineStatus(engine=name, url=url, version=version))
    b = broker.buffer
    b.learner_version, b.live_admitted = 3, 3 * b.groups_per_step  # the next group trains at step 3
    await broker.handle(b"actor-0", Hello(role="actor", name="actor-0"))
    await broker.handle(b"actor-0", GroupRequest(actor="actor-0", incarnation=0, request=0))
    assert [m for _, m in sent if m.kind == "group_grant"] == []  # engine-9 at 1 < 3 - 1: admission waits for it
    # engine-9's launch stops it (role=engines, Ctrl-C): its sidecar's final stats say it is leaving.
    await broker.handle(b"engine-9", Stats(source="engine-9", role="engine", final=True))
    assert broker.buffer.engine_versions == {"engine-0": 3}
    ((ident, grant),) = [(i, m) for i, m in sent if m.kind == "group_grant"]
    assert ident == b"actor-0" and grant.min_version == 2
    await broker.handle(b"gateway-j", Hello(role="actor", name="gateway-j", want_welcome=True))
    (welcome,) = [m for _, m in sent if m.kind == "welcome"]
    assert welcome.engines == ["http://a:1"]


async def test_an_actor_follows_engines_that_join_later() -> None:
    import asyncio
    from types import SimpleNamespace

    from engines.pool import follow_engines

    broker = SimpleNamespace(welcomes=asyncio.Queue())
    actor = SimpleNamespace(name="actor-0", engines=[SimpleNamespace(url="http://a:1")])
    task = asyncio.create_task(follow_engines(broker, actor, lambda url: SimpleNamespace(url=url.rstrip("/"))))
    try:
        # The broker lists every usable engine each time; the one already known (trailing slash or not) is kept.
        broker.welcomes.put_nowait(Welcome(engines=["http://a:1/", "http://b:2"]))
        broker.welcomes.put_nowait(Welcome(engines=["http://a:1", "http://b:2", "http://c:3"]))
        for _ in range(100):
            if len(actor.engines) == 3:
                break
            await asyncio.sleep(0.01)
        assert [e.url for e in actor.engines] == ["http://a:1", "http://b:2", "http://c:3"]
    finally:
        task.cancel()


# ------------------------------------------------------------------------------------------------ end to end
def get_json(url: str) -> dict | None:
    try:
        with urllib.request.urlopen(url, timeout=3) as resp:
            return json.loads(resp.read())
    except OSError:
        return None


def start(argv: list[str], log: Path) -> subprocess.Popen:
    with open(log, "w") as out:
        return subprocess.Popen(
            [sys.executable, "scripts/launch.py", *argv],
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )


def stop(proc: subprocess.Popen, timeout_s: float = 120) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)  # the launcher stops its own children
    try:
        return proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        return proc.wait(10)


def generated_tokens(engine_url: str) -> float:
    """vLLM's own count of the tokens an engine generated (its Prometheus /metrics), -1 if it does not answer."""
    try:
        with urllib.request.urlopen(f"{engine_url}/metrics", timeout=3) as resp:
            text = resp.read().decode()
    except OSError:
        return -1.0
    return sum(
        float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith("vllm:generation_tokens_total")
    )


@pytest.mark.e2e
def test_actors_and_an_engine_added_from_other_launches_work_and_leave_cleanly(tmp_path: Path) -> None:
    main_dir, join_dir, engine_dir, port = tmp_path / "main", tmp_path / "join", tmp_path / "engine", free_port()
    api = f"http://127.0.0.1:{port}/api"
    main = start(
        [
            f"run.output_dir={main_dir}",
            "actors.count=1",
            "actors.episodes_per_actor=4",
            "env.group_size=4",
            "env.max_steps=4",
            "sampling.max_tokens=12",
            "engines.count=1",
            "learner.world_size=1",
            "trainer.groups_per_step=3",
            "trainer.max_staleness=50",
            "trainer.total_steps=1000",
            f"broker.dashboard_port={port}",
            "run.shutdown_timeout_s=5",
        ],
        tmp_path / "main.out",
    )
    joiner = engines = gateway = None
    gw_dir = tmp_path / "gateway"
    try:
        out = tmp_path / "main.out"
        line = wait_for(lambda: re.search(r"broker:\s+(tcp://\S+)", out.read_text()), 120, "the broker's address")
        joiner = start(
            [
                "role=actors",
                f"broker.address={line.group(1)}",
                "actors.count=2",
                "actors.episodes_per_actor=4",
                f"run.output_dir={join_dir}",
                "run.shutdown_timeout_s=20",
            ],
            tmp_path / "join.out",
        )
        joined_at = (get_json(f"{api}/state") or {"learner": {"version": 0}})["learner"]["version"]
        engines = start(
            [
                "role=engines",
                f"broker.address={line.group(1)}",
                "engines.count=1",
                "engines.kv_cache_gib=1",
                f"run.output_dir={engine_dir}",
                "run.shutdown_timeout_s=20",
            ],
            tmp_path / "engines.out",
        )

        def senders() -> dict | None:  # every actor that has sent transitions, and how many
            s = get_json(f"{api}/summary")
            sent = {k: v for k, v in (s or {}).get("transitions_sent_by_actor", {}).items() if v > 0}
            return sent if len(sent) == 3 else None

        sent = wait_for(senders, 300, "three actors sending transitions", run_dir=main_dir)
        assert "actor-0" in sent and sum(name.startswith("actor-") for name in sent) == 3
        state = get_json(f"{api}/state")
        assert state is not None and sum(a["alive"] for a in state["actors"]) == 3  # the dashboard shows them
        assert state["counters"]["transitions_ingested"] >= sum(sent.values()) - 3 * 30  # stats lag by <= 1 s

        def joined_engine() -> dict | None:  # the joined engine, once it serves weights newer than at its join
            rows = (get_json(f"{api}/state") or {}).get("engines", [])
            new = [e for e in rows if e["name"] != "engine-0" and e["alive"] and e["version"] > joined_at]
            return new[0] if new else None

        engine = wait_for(joined_engine, 420, "the joined engine serving a newer weight version", run_dir=main_dir)
        wait_for(lambda: generated_tokens(engine["url"]) > 0, 180, "the joined actors generating on the joined engine")

        for proc, folder, log, n in ((joiner, join_dir, "join.out", 2), (engines, engine_dir, "engines.out", 2)):
            assert stop(proc) == 130, (tmp_path / log).read_text()[-3000:]
            js = json.loads((folder / "summary.json").read_text())
            assert js["status"] == "interrupted" and js["processes_left"] == [], js
            assert len(js["processes"]) == n and processes_mentioning(str(folder)) == []  # (engine + its agent)
        version = get_json(f"{api}/state")["learner"]["version"]
        # The run goes on with actor-0 alone: the joiners' unfinished groups do not hold admission slots.
        wait_for(
            lambda: (s := get_json(f"{api}/state")) and s["learner"]["version"] >= version + 1,
            180,
            "another learner step after the joined actors and engine left",
            run_dir=main_dir,
        )
        joined = [n for n in sent if n != "actor-0"]
        final = get_json(f"{api}/summary")
        assert all(final["transitions_sent_by_actor"][n] >= sent[n] for n in joined)
        gateway = start(
            [
                "role=gateway",
                f"broker.address={line.group(1)}",
                f"run.output_dir={gw_dir}",
                "run.shutdown_timeout_s=20",
            ],
            tmp_path / "gateway.out",
        )
        gw_name = a_gateway_is_killed_restarted_at_its_url_and_plays_a_group(gw_dir, api)
        assert stop(gateway) == 130, (tmp_path / "gateway.out").read_text()[-3000:]
        js = json.loads((gw_dir / "summary.json").read_text())
        assert js["status"] == "interrupted" and js["processes_left"] == [], js
        assert processes_mentioning(str(gw_dir)) == []
        sent[gw_name] = G_GW
        assert stop(main) == 130, out.read_text()[-3000:]
    finally:
        for proc in (joiner, engines, gateway, main):
            if proc is not None and proc.poll() is None:
                stop(proc)
    summary = json.loads((main_dir / "summary.json").read_text())
    assert summary["processes_left"] == [] and processes_mentioning(str(main_dir)) == []
    dropped = sum(summary["transitions_dropped"].values())
    assert summary["transitions_ingested"] == summary["transitions_trained"] + summary["transitions_buffered"] + dropped
    assert set(summary["transitions_sent_by_actor"]) == set(sent)
    assert set(summary["trained_group_shapes"]) == {"4/4"}  # a left actor's partial groups are never trained
    assert summary["transitions_sent_by_actor"][gw_name] == G_GW  # the restarted gateway's group, whole


G_GW = 4  # the main run's env.group_size: the gateway's episodes of one task id


def a_gateway_is_killed_restarted_at_its_url_and_plays_a_group(gw_dir: Path, api: str) -> str:
    """role=gateway joined the run: an episode makes a call through it (the real `openai` client), the gateway
    process is killed (-9), its launch restarts it at the same URL under a new incarnation, the dead one's episode
    is unknown there (404) and its group is dropped at the broker as a dead actor's, and a new group of G_GW
    episodes plays through the new one. Returns the gateway's name (its actor name at the broker)."""
    from openai import NotFoundError, OpenAI

    from gateway.episode_client import open_episode

    url_file = gw_dir / "gateway_url"
    url = wait_for(lambda: url_file.exists() and url_file.read_text().strip(), 120, "the gateway's URL")

    def call(ep) -> None:
        client = OpenAI(base_url=ep.base_url, api_key=ep.api_key, max_retries=0)
        answer = client.chat.completions.create(
            model="policy", messages=[{"role": "user", "content": "Hello"}], max_tokens=4
        )
        assert answer.usage.completion_tokens >= 1

    lost = open_episode(url, "lost-task", wait_s=120)
    call(lost)
    pids = [int(p.split(":")[0]) for p in processes_mentioning("-m gateway ") if str(gw_dir) in p]
    assert len(pids) == 1, pids
    os.kill(pids[0], signal.SIGKILL)
    wait_for(
        lambda: [
            p for p in processes_mentioning("-m gateway ") if str(gw_dir) in p and int(p.split(":")[0]) != pids[0]
        ],
        60,
        "the gateway restarted",
    )
    name = wait_for(
        lambda: next(
            (
                a["name"]
                for a in (get_json(f"{api}/state") or {}).get("actors", [])
                if a["name"].startswith("gateway-") and a["alive"] and a["incarnation"] == 1
            ),
            None,
        ),
        120,
        "the restarted gateway at the broker",
    )
    eps = [open_episode(url, "kept-task", wait_s=120) for _ in range(G_GW)]  # the same URL answers again
    with pytest.raises(NotFoundError) as refused:
        call(lost)
    assert refused.value.code == "unknown_episode", refused.value
    for ep in eps:
        call(ep)
        ep.finish(reward=1.0)
    wait_for(
        lambda: (get_json(f"{api}/summary") or {}).get("transitions_sent_by_actor", {}).get(name) == G_GW,
        60,
        "the restarted gateway's group at the broker",
    )
    return name


@pytest.mark.e2e
def test_a_learner_on_two_nodes_trains_once_the_second_node_joins(tmp_path: Path, tiny_engine) -> None:
    """Multi-node torchrun, both "hosts" on this machine: the main launch runs node 0 (one rank), a role=learner
    launch node 1 (the other); the run's 2-rank learner can only take a step once both are in. The engine is the
    session's (tests/conftest.py, through engines.external_urls): both nodes' ranks first publish version 0."""
    (model, url), main_dir, node_dir = tiny_engine, tmp_path / "main", tmp_path / "node1"
    main = start(
        [
            f"run.output_dir={main_dir}",
            f"model.path={model}",
            "actors.count=1",
            "actors.episodes_per_actor=4",
            "env.group_size=4",
            "env.max_steps=4",
            "sampling.max_tokens=12",
            "engines.count=1",
            f"engines.external_urls=[{url}]",
            "learner.world_size=2",
            "learner.nnodes=2",
            "trainer.groups_per_step=2",
            "trainer.total_steps=3",
            f"broker.dashboard_port={free_port()}",
        ],
        tmp_path / "main.out",
    )
    node = None
    try:
        out = tmp_path / "main.out"
        line = wait_for(
            lambda: re.search(r"role=learner broker.address=(tcp://\S+)", out.read_text()),
            120,
            "the main launch's line for the other learner nodes",
        )
        node = start(
            ["role=learner", f"broker.address={line.group(1)}", "learner.node_rank=1", f"run.output_dir={node_dir}"],
            tmp_path / "node.out",
        )
        assert main.wait(600) == 0, out.read_text()[-3000:]
        assert node.wait(120) == 0, (tmp_path / "node.out").read_text()[-3000:]
    finally:
        for proc in (node, main):
            if proc is not None and proc.poll() is None:
                stop(proc)
    summary = json.loads((main_dir / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["processes_left"] == []
    versions = [
        json.loads(x)["version"]
        for x in (main_dir / "learner_metrics.jsonl").read_text().splitlines()
        if "resumed_from" not in x
    ]
    assert versions == [1, 2, 3]
    ns = json.loads((node_dir / "summary.json").read_text())
    assert ns["status"] == "finished" and ns["reason"] == "the learner finished its steps", ns
    assert ns["processes"] == ["learner-node1"] and ns["processes_left"] == [], ns
    assert summary["launcher_wall_s"] < 240  # (torchrun's exit barrier did not wait for a node stopped early)
    assert processes_mentioning(str(main_dir)) == [] and processes_mentioning(str(node_dir)) == []
