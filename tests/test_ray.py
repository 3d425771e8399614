"""launcher.backend=ray on a real local Ray cluster of three nodes on this machine (`ray.cluster_utils`, every node
on 127.0.0.2: tests stay on loopback), one run for three checks (~3 min on 2 cores):

- placement: the run's processes land where their resources say (Ray's state API): broker and learner on the
  head, the two engines on two different worker nodes, the two actors on two different worker nodes;
- scaling: two more launches, `role=actors` and `role=engines` with `launcher.backend=ray`, add an actor and an
  engine (with its sidecar beside it) to the running run; the broker trains transitions of that actor, and the
  engine takes the learner's new weights;
- node loss: the worker node holding one of the run's two engines (not the added one) and one actor dies mid-run:
  its raylet and every process on it are killed at once, as when a machine goes down. The run finishes its steps;
  summary.json names what was lost with the node; the engine and the actor are restarted on the surviving node;
  every acknowledged transition was trained once, dropped with a reason or is still buffered; the learner's versions
  have no gap and no repeat.

The run trains with GiGPO (`algorithm=gigpo`): the suite's end-to-end run of that preset (step groups by anchor).

Two smaller runs (~1 min each) lose the node holding the broker, then the node holding the learner (each alone on
one of two spare nodes): it moves to the other, and every process follows its record.

The unit tests below (milliseconds) cover the resource translation and the config checks.
"""

import json
import re
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import psutil
import pytest
from e2e_testing import check_accounting, lineage, processes_mentioning, wait_for

from agentstream import config as C
from agentstream.wire.addresses import free_port
from launcher.checks import backend_errors
from launcher.procs import RUN_ENV, end_marked, marked
from launcher.ray_backend import NODE_ENV, ray_options
from launcher.wiring import Places, wire_placed

ROOT = Path(__file__).resolve().parents[1]
IP = "127.0.0.2"  # Ray replaces 127.0.0.1 by the machine's other interface (FACTS.md)
STEPS = 8
RESOURCES = [
    "++launcher.resources.broker={CPU:1,head:0.1}",
    "++launcher.resources.learner={CPU:1,head:0.1}",
    "++launcher.resources.engine={CPU:1,engine_slot:1}",
    "++launcher.resources.actor={CPU:1,actor_slot:1}",
]


def test_ray_options_split_cpu_and_gpu_from_custom_resources() -> None:
    assert ray_options({"CPU": 2, "GPU": 1, "run_disk": 1}) == {
        "num_cpus": 2.0,
        "num_gpus": 1.0,
        "resources": {"run_disk": 1.0},
    }
    assert ray_options({}) == {"num_cpus": 0.0, "num_gpus": 0.0, "resources": {}}


def test_wire_placed_names_each_node_and_its_ports() -> None:
    cfg = C.Config()
    cfg.engines.count = 2
    w = wire_placed(
        cfg,
        Places(
            broker=("10.0.0.1", 5555, 8080),
            engines=[("10.0.0.2", 8000), ("10.0.0.3", 8000)],
            learner=("10.0.0.4", 5556, 5557),
            gateway=("10.0.0.5", 8100),
        ),
    )
    assert (w.broker, w.dashboard) == ("tcp://10.0.0.1:5555", "http://10.0.0.1:8080")
    assert w.engines == ["http://10.0.0.2:8000", "http://10.0.0.3:8000"]
    assert (w.weights, w.weights_bind, w.rdzv) == ("tcp://10.0.0.4:5556", "tcp://10.0.0.4:5556", "10.0.0.4:5557")
    assert (w.gateway, w.gateway_port, w.judges) == ("http://10.0.0.5:8100", 8100, [])
    cfg.engines.external_urls = ["http://gpu-box:9000"]  # servers started elsewhere keep their URLs
    assert wire_placed(cfg, Places(("10.0.0.1", 1, 2), [], ("10.0.0.4", 3, 4))).engines == ["http://gpu-box:9000"]


@pytest.mark.parametrize(
    "overrides, expected",
    [
        ({"backend": "k8s"}, "launcher.backend='k8s' is unknown"),
        ({"role": "gateway"}, "role=gateway joins a run from one host"),
        ({"judges": 1}, "does not place LLM judges yet"),
        ({"resources": {"engines": {"CPU": 1}}}, "launcher.resources has ['engines']"),
        ({"resources": {"actor": {"CPU": -1}}}, "negative amounts {'actor.CPU': -1}"),
    ],
)
def test_backend_checks_say_what_to_change(overrides: dict, expected: str) -> None:
    cfg = C.Config()
    cfg.launcher.backend = overrides.get("backend", "ray")
    cfg.run.role = overrides.get("role", "all")
    cfg.judges.count = overrides.get("judges", 0)
    cfg.launcher.resources.update(overrides.get("resources", {}))
    errors = backend_errors(cfg)
    assert len(errors) == 1 and expected in errors[0], errors
    assert backend_errors(C.Config()) == []  # local: nothing to check


def raylets() -> set[int]:
    return {p.pid for p in psutil.process_iter(["name"]) if p.info["name"] == "raylet"}


@pytest.mark.e2e
def test_plain_ray_backend_on_one_host_stays_on_loopback(tmp_path: Path) -> None:
    """`launcher.backend=ray` and nothing else: the Ray instance the launcher starts for the run advertises 127.0.0.2
    (not this host's other interface, which the loopback checks would refuse), the run trains, and the instance
    stops with it. Runs before the module's cluster starts (a plain launch must start its own instance anyway)."""
    run_dir, out = tmp_path / "run", tmp_path / "main.out"
    before = raylets()
    main = launch(
        [
            f"run.output_dir={run_dir}",
            "launcher.backend=ray",
            "trainer.total_steps=2",
            "broker.track_keys=true",
            "run.startup_timeout_s=300",
        ],
        out,
    )
    try:
        assert main.wait(timeout=600) == 0, out.read_text()[-3000:]
    finally:
        if main.poll() is None:
            main.send_signal(signal.SIGINT)
            main.wait(timeout=120)
    assert re.search(r"broker:\s+tcp://127\.0\.0\.2:", out.read_text()), out.read_text()[-3000:]
    s = json.loads((run_dir / "summary.json").read_text())
    assert s["status"] == "finished", s["reason"]
    versions = [json.loads(ln)["version"] for ln in (run_dir / "learner_metrics.jsonl").read_text().splitlines()]
    assert versions == [1, 2]
    check_accounting(s)
    assert s["processes_left"] == [] and not processes_mentioning(str(run_dir))
    wait_for(lambda: raylets() <= before, 30, "the run's Ray instance stopped")


@pytest.fixture(scope="module")
def cluster():
    """Head (broker, learner) and two worker nodes, each with room for three engines and four actors."""
    from ray.cluster_utils import Cluster

    c = Cluster(
        initialize_head=True,
        head_node_args={
            "node_ip_address": IP,
            "num_cpus": 4,
            "resources": {"head": 1},
            "include_dashboard": True,
            "dashboard_host": IP,
            "dashboard_port": 0,
            # A dead node is declared dead after ~3 s instead of Ray's ~15-30 s (the test waits less; nothing else
            # changes)
            "_system_config": {"health_check_period_ms": 1000, "health_check_failure_threshold": 3},
        },
    )
    nodes = {
        "a": c.add_node(node_ip_address=IP, num_cpus=8, resources={"engine_slot": 3, "actor_slot": 4}),
        "b": c.add_node(node_ip_address=IP, num_cpus=8, resources={"engine_slot": 3, "actor_slot": 4}),
    }
    c.wait_for_nodes()
    yield c, nodes
    c.shutdown()


def hosts(address: str) -> dict[str, str]:
    """{child name: Ray node id} of every live ProcessHost (named `<launcher pid>/<child>/<serial>`)."""
    from ray.util.state import list_actors

    alive = list_actors(address=address, filters=[("state", "=", "ALIVE")], limit=1000)
    return {a.name.split("/")[1]: a.node_id for a in alive if a.class_name == "ProcessHost"}


def kill_node(c, node) -> list[int]:
    """The node dies: its raylet and every process below it (Ray's workers, the run's processes they started), all
    SIGKILLed at once, then Ray forgets it. Returns the pids killed."""
    raylet = psutil.Process(node.all_processes["raylet"][0].process.pid)
    tree = [raylet, *raylet.children(recursive=True)]
    for p in tree:
        p.kill()
    c.remove_node(node, allow_graceful=False)
    end_marked(NODE_ENV, node.node_id)  # anything of the run on it that left the tree (none expected)
    return [p.pid for p in tree]


def launch(args: list[str], log: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "scripts/launch.py", *args],
        cwd=ROOT,
        stdout=open(log, "w"),
        stderr=subprocess.STDOUT,
        text=True,
    )


@pytest.mark.e2e
def test_a_run_on_ray_places_scales_and_survives_a_node(cluster, tmp_path: Path) -> None:
    c, nodes = cluster
    run_dir, join_dir, port = tmp_path / "run", tmp_path / "join", free_port()
    common = ["launcher.backend=ray", f"launcher.ray_address={c.address}", f"launcher.ray_node_ip={IP}", *RESOURCES]
    main = launch(
        [
            f"run.output_dir={run_dir}",
            *common,
            "engines.count=2",
            "actors.count=2",
            "learner.world_size=1",
            f"trainer.total_steps={STEPS}",
            "trainer.groups_per_step=2",
            "algorithm=gigpo",
            "broker.track_keys=true",
            f"broker.dashboard_port={port}",
            "run.startup_timeout_s=300",
        ],
        tmp_path / "main.out",
    )
    joiner = engine_joiner = None
    try:

        def version() -> int:
            s = dashboard(port, "state")
            return s["learner"]["version"] if s else -1

        out = tmp_path / "main.out"
        broker = wait_for(
            lambda: re.search(r"broker:\s+(tcp://\S+)", out.read_text()), 300, "the broker's address", run_dir=run_dir
        ).group(1)
        assert broker.startswith(f"tcp://{IP}:")
        joiner = launch(
            [f"run.output_dir={join_dir}", "role=actors", f"broker.address={broker}", "actors.count=1", *common],
            tmp_path / "join.out",
        )  # it joins while the run starts
        engine_joiner = launch(
            [
                f"run.output_dir={tmp_path / 'join-engine'}",
                "role=engines",
                f"broker.address={broker}",
                "engines.count=1",
                *common,
            ],
            tmp_path / "join-engine.out",
        )
        wait_for(lambda: version() >= 1, 400, "the first learner step", run_dir=run_dir)
        where = hosts(c.address)
        head = c.head_node.node_id
        assert where["broker"] == where["learner"] == head, where
        assert where["engine-0"] != where["engine-1"] and head not in (where["engine-0"], where["engine-1"]), where
        assert where["actor-0"] != where["actor-1"] and head not in (where["actor-0"], where["actor-1"]), where
        assert where["sidecar-0"] == where["engine-0"] and where["sidecar-1"] == where["engine-1"], where
        added = [n for n in where if n.startswith("engine-") and n not in ("engine-0", "engine-1")]
        assert len(added) == 1 and where[added[0]] != head, where  # the engine added by role=engines, with its sidecar
        assert where[added[0].replace("engine-", "sidecar-", 1)] == where[added[0]], where

        def joined_sending() -> str:
            sent = (dashboard(port, "summary") or {}).get("transitions_sent_by_actor", {})
            return next((name for name, n in sent.items() if name not in ("actor-0", "actor-1") and n > 0), "")

        joined = wait_for(joined_sending, 300, "the joined actor sending transitions", run_dir=run_dir)

        # the node to kill holds one of the run's engines, not the added one (still starting on a slow machine,
        # it would die with the node and never take weights)
        k = 1 if where["engine-1"] != where[added[0]] else 0
        lost_engine = {f"engine-{k}", f"sidecar-{k}"}
        victim = next(n for n in nodes.values() if n.node_id == where[f"engine-{k}"])
        on_victim = sorted(name for name, node in hosts(c.address).items() if node == victim.node_id)
        assert lost_engine <= set(on_victim) and {"actor-0", "actor-1"} & set(on_victim), on_victim
        lost_at = version()
        killed = kill_node(c, victim)
        assert not marked(NODE_ENV, victim.node_id), "a process of the dead node survived"

        assert main.wait(timeout=600) == 0, (tmp_path / "main.out").read_text()[-3000:]
        joiner.wait(timeout=120)
        engine_joiner.wait(timeout=120)
    finally:
        for p in (main, joiner, engine_joiner):
            if p is not None and p.poll() is None:
                p.send_signal(signal.SIGINT)
                p.wait(timeout=120)

    s = json.loads((run_dir / "summary.json").read_text())
    assert s["status"] == "finished" and lost_at < STEPS, (s["reason"], lost_at)
    lost = {x["process"] for x in s["lost_with_node"]}
    assert lost_engine <= lost, s["lost_with_node"]
    assert all("Ray node" in x["why"] for x in s["lost_with_node"]), s["lost_with_node"]
    assert lost - lost_engine <= {"actor-0", "actor-1"} and len(lost) == 3, lost
    assert s["restarts"].get("engine", 0) >= 1 and s["actor_restarts"] >= 1
    check_accounting(s)
    trained = s["reliability"]["keys"]["trained_by_actor"]
    assert trained.get(joined, 0) > 0, (joined, trained)  # the added actor's transitions were trained
    added = {name: v for name, v in s["engine_versions"].items() if name not in ("engine-0", "engine-1")}
    assert len(added) == 1 and list(added.values())[0] >= 1, s["engine_versions"]  # the added engine took new weights
    assert json.loads((tmp_path / "join-engine" / "summary.json").read_text())["status"] == "finished"
    versions = [json.loads(ln)["version"] for ln in (run_dir / "learner_metrics.jsonl").read_text().splitlines()]
    assert versions == list(range(1, STEPS + 1))
    assert all(a == b for a, b in (shape.split("/") for shape in s["trained_group_shapes"]))  # whole groups only
    assert s["processes_left"] == [] and not marked(RUN_ENV, str(run_dir.resolve()))
    assert not [p for p in processes_mentioning(str(run_dir)) if int(p.split(":")[0]) not in killed]
    # every ProcessHost of the three launches is gone (ray.kill is asynchronous): their resources are free again
    wait_for(lambda: not hosts(c.address), 30, "every ProcessHost gone")
    print(
        f"[ray] lost at version {lost_at}: {sorted(lost)}; joined {joined} trained {trained.get(joined)}; "
        f"wall {s['launcher_wall_s']:.0f}s",
        flush=True,
    )


def dashboard(port: int, what: str) -> dict | None:
    """The dashboard's /api/<what> on the broker's node (every node is 127.0.0.2 here)."""
    try:
        with urllib.request.urlopen(f"http://{IP}:{port}/api/{what}", timeout=5) as r:
            return json.loads(r.read())
    except OSError:
        return None


@pytest.mark.e2e
@pytest.mark.parametrize("role", ["broker", "learner"])
def test_the_broker_or_the_learner_moves_off_a_dead_node_and_every_client_follows(
    cluster, tmp_path: Path, role: str
) -> None:
    """The node holding the broker (or the learner) dies mid-run: it starts again on another node, the broker from
    its log in the run folder, the learner from its checkpoint there (in its placement group's bundle, which Ray
    reserves again), and its new address goes to its record (RUN/broker.json, RUN/learner.json), which the learner,
    the sidecar and the actors (the sidecar) follow. The run finishes with every transition accounted for, the
    learner's versions without a gap or a repeat, and the engine at the final version."""
    c, _ = cluster
    spare = [c.add_node(node_ip_address=IP, num_cpus=2, resources={"spare": 1}) for _ in range(2)]
    c.wait_for_nodes()
    run_dir, port, steps = tmp_path / "run", free_port(), 6
    resources = {
        "broker": "{CPU:1,head:0.1}",
        "learner": "{CPU:1,head:0.1}",
        "engine": "{CPU:1,head:0.1}",
        "actor": "{CPU:0.5,head:0.1}",
        role: "{CPU:1,spare:1}",
    }
    record = run_dir / ("broker.json" if role == "broker" else "learner.json")
    key = "address" if role == "broker" else "weights"
    main = launch(
        [
            f"run.output_dir={run_dir}",
            "launcher.backend=ray",
            f"launcher.ray_address={c.address}",
            f"launcher.ray_node_ip={IP}",
            *(f"++launcher.resources.{r}={v}" for r, v in resources.items()),
            "engines.count=1",
            "actors.count=2",
            "learner.world_size=1",
            f"trainer.total_steps={steps}",
            "trainer.groups_per_step=2",
            "checkpoint.every_steps=1",
            "broker.track_keys=true",
            f"broker.dashboard_port={port}",
            "run.startup_timeout_s=300",
        ],
        tmp_path / "main.out",
    )
    victim = None
    try:

        def version() -> int:
            s = dashboard(port, "state")
            return s["learner"]["version"] if s else -1

        wait_for(lambda: version() >= 2, 400, "the second learner step", run_dir=run_dir)
        first = json.loads(record.read_text())
        victim = next(n for n in spare if n.node_id == hosts(c.address)[role])
        lost_at = version()
        killed = kill_node(c, victim)
        assert main.wait(timeout=600) == 0, (tmp_path / "main.out").read_text()[-3000:]
    finally:
        if main.poll() is None:
            main.send_signal(signal.SIGINT)
            main.wait(timeout=120)
        for node in spare:
            if node is not victim:
                c.remove_node(node)

    s = json.loads((run_dir / "summary.json").read_text())
    assert s["status"] == "finished" and lost_at < steps, (s["reason"], lost_at)
    assert [x["process"] for x in s["lost_with_node"]] == [role], s["lost_with_node"]
    assert s["restarts"] == {role: 1}, s["restarts"]
    moved = json.loads(record.read_text())
    assert moved[key] != first[key], (first, moved)
    rel = s["reliability"]
    metrics = (run_dir / "learner_metrics.jsonl").read_text()
    if role == "broker":  # it began from the dead broker's log
        assert rel["wal_snapshot_recovered"] or rel["wal_events_recovered"] > 0
    else:
        assert "resumed_from" in metrics  # from its checkpoint
    check_accounting(s)
    assert lineage(run_dir / "learner_metrics.jsonl") == list(range(1, steps + 1)) and s["learner_version"] == steps
    assert set(s["engine_versions"].values()) == {steps}  # the sidecar followed: the engine took the final weights
    assert s["processes_left"] == [] and not marked(RUN_ENV, str(run_dir.resolve()))
    assert not [p for p in processes_mentioning(str(run_dir)) if int(p.split(":")[0]) not in killed]
    print(
        f"[ray] {role} moved at version {lost_at}: {first[key]} -> {moved[key]}; wall {s['launcher_wall_s']:.0f}s",
        flush=True,
    )
