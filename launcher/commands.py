"""The command lines of a run's children: what the supervisor (`launcher.supervisor`) starts for each role, from the
run's config and its current wiring. Nothing here starts or watches a process.

    commands = Commands(cfg, run_dir, wire(cfg))
    commands.sidecar(0).argv     # [python, -m, engines.sidecar, --name, engine-0, --url, ...]

Roles: broker, engine (a vLLM server), sidecar (an engine's weight sidecar), judge (a vLLM server of an LLM judge),
teacher (a vLLM server of a distillation teacher), learner (torchrun, one command per learner node), actor, gateway,
evaluator. A placement other than this host's (`launcher.ray_backend.RayCommands`) changes where engines bind, which
GPUs they see and which learner nodes a launch starts, and nothing else.
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass
from pathlib import Path

from agentstream.config import Config, learner_threads
from agentstream.wire.addresses import BROKER_RECORD, LEARNER_RECORD, free_port
from launcher.placement import host_gpus, host_plan, visible
from launcher.procs import RUN_ENV
from launcher.wiring import Wiring

PY = sys.executable


@dataclass(frozen=True)
class Command:
    """What to start for one child: its name and role, its command line and environment (on top of the
    launcher's), the log its output goes to, and which incarnation of the child it starts."""

    name: str
    role: str  # broker | engine | sidecar | judge | teacher | learner | actor | gateway | evaluator
    argv: list[str]
    env: dict[str, str]
    log_path: Path
    incarnation: int = 0


class Commands:
    """The command lines of one launch's children. `wiring` is read at each call: the supervisor replaces it when
    a broker, learner or engine moves, and a restarted child gets the new addresses."""

    def __init__(self, cfg: Config, run_dir: Path, wiring: Wiring, prefix: str = "", started: float = 0.0):
        """`prefix` goes into every actor's and engine's name, unique per launch when several join one run;
        `started`: the run's start (unix time), the evaluator's time origin."""
        self.cfg, self.run_dir, self.wiring, self.prefix, self.started = cfg, run_dir, wiring, prefix, started
        self.main_launch = cfg.run.role == "all"  # it starts the broker and the learner (a joining launch reaches them)
        self.broker_host = ""  # the interface a moved broker binds (empty: broker.host)
        self.config_path = run_dir / "config.yaml"

    def command(
        self, name: str, role: str, argv: list[str], env: dict[str, str] | None = None, incarnation: int = 0
    ) -> Command:
        """A child of this run: its environment names the run folder (every descendant's marker), its log goes to
        RUN/logs/<name>.log."""
        return Command(
            name,
            role,
            argv,
            {RUN_ENV: str(self.run_dir.resolve()), **(env or {})},
            self.run_dir / "logs" / f"{name}.log",
            incarnation,
        )

    def broker(self, restart: bool = False) -> Command:
        """The broker; `restart`: started again from its log on any free ZeroMQ port (its old one may be held, and on
        another node it is another address anyway), which it writes to its record for the clients to follow."""
        w = self.wiring
        host = ["--host", self.broker_host] if self.broker_host else []  # a node of its own (`_reseat_broker`)
        return self.command(
            "broker",
            "broker",
            [
                PY,
                "-m",
                "broker.server",
                "--config",
                str(self.config_path),
                "--port",
                "0" if restart else str(w.broker_port),
                "--dashboard-port",
                str(w.dashboard_port),
                *host,
            ],
        )

    @property
    def learner_where(self) -> str:
        """What the weight sidecars are told of the learner: its record (`LEARNER_RECORD`, written by this launch
        each time it places the learner) when this launch runs it, else the address a joining launch was given."""
        return str((self.run_dir / LEARNER_RECORD).resolve()) if self.main_launch else self.wiring.weights

    @property
    def broker_where(self) -> str:
        """What the children are told of the broker: the record it writes in the run folder when this launch runs
        it (they follow a broker started again elsewhere: `agentstream.wire.client.RecordLink`), else the address
        a joining launch was given."""
        return str((self.run_dir / BROKER_RECORD).resolve()) if self.main_launch else self.wiring.broker

    def engines(self) -> list[Command]:
        """The policy's vLLM servers, one per engine URL of the wiring (none when they run elsewhere)."""
        from engines.server import server_command

        out: list[Command] = []
        if self.cfg.engines.external_urls:  # running servers: only their weight sidecars are ours
            return out
        for i, url in enumerate(self.wiring.engines):
            engines = dataclasses.replace(self.cfg.engines, host=self.engine_host(i))
            argv, env = server_command(self.cfg.model, engines, int(url.rsplit(":", 1)[1]), self.engine_on_gpu())
            out.append(self.command(f"engine-{self.prefix}{i}", "engine", argv, {**env, **self.gpus_of_engine(i)}))
        return out

    def gpus_of_engine(self, i: int) -> dict[str, str]:
        """Engine i's CUDA_VISIBLE_DEVICES from this host's placement plan (launcher.placement; none on CPU)."""
        names = host_gpus()
        return visible(host_plan(self.cfg, len(names)).engines[i][1], names)

    def gpus_of_learner(self) -> dict[str, str]:
        """The GPUs of this host's learner ranks (torchrun gives rank r the r-th of them)."""
        names = host_gpus()
        return visible(host_plan(self.cfg, len(names)).learner[0], names)

    def engine_host(self, i: int) -> str:
        """The interface engine i binds (on Ray: its node's IP)."""
        return self.cfg.engines.host

    def engine_on_gpu(self) -> bool | None:
        """Whether the engines run on GPUs (None: as this host; on Ray: whether they ask Ray for GPUs)."""
        return None

    def judges(self) -> list[Command]:
        """The LLM judges' vLLM servers: the engines' command on the judge's model (judges.model, else the run's
        initial model.path), without LoRA; no weight sidecar, so the learner never reaches them."""
        return self.fixed_servers("judge")

    def teachers(self) -> list[Command]:
        """The distillation teachers' vLLM servers (distill.model), as the judges'."""
        return self.fixed_servers("teacher")

    def fixed_urls(self, role: str) -> list[str]:
        """The URLs of the servers of a fixed model of `role` (judge or teacher), in the order of their names."""
        return {"judge": self.wiring.judges, "teacher": self.wiring.teachers}[role]

    def fixed_servers(self, role: str) -> list[Command]:
        """The vLLM servers of a fixed model of `role` (judge: judges.model, else the run's initial model.path;
        teacher: distill.model), named <role>-<i>: the engines' command without LoRA and without a weight sidecar,
        so the learner never reaches them."""
        from engines.server import server_command

        path = {"judge": self.cfg.judges.model or self.cfg.model.path, "teacher": self.cfg.distill.model}[role]
        model = dataclasses.replace(self.cfg.model, path=path, lora_rank=0)
        out = []
        for i, url in enumerate(self.fixed_urls(role)):
            argv, env = server_command(model, self.cfg.engines, int(url.rsplit(":", 1)[1]))
            out.append(self.command(f"{role}-{self.prefix}{i}", role, argv, env))
        return out

    def sidecar(self, i: int) -> Command:
        """Engine i's weight sidecar: it brings the server to the learner's newest weights."""
        from engines.server import takes_stream
        from envs.registry import traits as env_traits

        w = self.wiring
        frozen_seat = env_traits(self.cfg.env.name, self.cfg.env.kwargs).frozen_seat
        frozen_every = self.cfg.engines.frozen_every if frozen_seat else 0
        return self.command(
            f"sidecar-{self.prefix}{i}",
            "sidecar",
            [
                PY,
                "-m",
                "engines.sidecar",
                "--name",
                f"engine-{self.prefix}{i}",
                "--url",
                w.engines[i],
                "--learner",
                self.learner_where,
                "--broker",
                self.broker_where,
                "--workdir",
                str(self.run_dir / "weights" / f"engine-{self.prefix}{i}"),
                "--stats-interval",
                str(self.cfg.run.log_interval_s),
                "--initial-version",
                "-1" if self.cfg.engines.external_urls else "0",
                "--stream-workers",
                str(self.cfg.engines.gpus_per_engine if takes_stream(self.cfg.model, self.cfg.engines) else 0),
                "--frozen-every",
                str(frozen_every),  # a frozen seat's copy of the policy (0: none)
                *self.curve_args(),
            ],
        )

    def curve_args(self) -> list[str]:
        """The CURVE key folder for a child that takes no config (broker, actors, learner read
        broker.curve_keys_dir from the run's config.yaml), absolute so that any working directory works."""
        keys = self.cfg.broker.curve_keys_dir
        return ["--curve-keys", str(Path(keys).resolve())] if keys else []

    def learner_nodes(self) -> list[Command]:
        """The learner's nodes this launch starts: its own (node learner.node_rank; the others join by role=learner)."""
        return [self.learner()]

    def learner(self, resume: bool = False, node_rank: int | None = None) -> Command:
        """torchrun with one node's ranks of the learner: all of them, or (learner.nnodes > 1) node `node_rank`'s
        share (default learner.node_rank), which meets the other nodes at node 0's rendezvous (`Wiring.rdzv`)."""
        c = self.cfg.learner
        node = c.node_rank if node_rank is None else node_rank
        master, port = self.wiring.rdzv.rsplit(":", 1) if self.wiring.rdzv else ("127.0.0.1", str(free_port()))
        argv = [
            PY,
            "-m",
            "torch.distributed.run",
            "--nnodes",
            str(c.nnodes),
            "--node-rank",
            str(node),
            "--nproc-per-node",
            str(c.world_size // c.nnodes),
            "--master-addr",
            master,
            "--master-port",
            port,
            "-m",
            "learner.train",
            "--config",
            str(self.config_path),
            "--broker",
            self.broker_where,
            "--weights-bind",
            self.wiring.weights_bind,
            "--out",
            str(self.run_dir),
        ]
        if self.cfg.engines.external_urls:
            argv.append("--publish-initial")  # servers started elsewhere may hold other weights
        if resume:
            argv += ["--resume", "latest"]  # a restarted learner continues from its newest checkpoint
        name = "learner" if c.nnodes == 1 else f"learner-node{node}"
        env = {"OMP_NUM_THREADS": str(learner_threads(self.cfg)), **self.gpus_of_learner()}
        if c.tcmalloc:  # the ranks inherit torchrun's environment
            from engines.server import cpu_allocator_env

            env.update(cpu_allocator_env())
        return self.command(name, "learner", argv, env)

    def actor(self, i: int, incarnation: int = 0) -> Command:
        """Actor i (actors/actor.py); `incarnation`: how many times it was restarted."""
        name = f"actor-{self.prefix}{i}"
        argv = [
            PY,
            "-m",
            "actors.actor",
            "--config",
            str(self.config_path),
            "--name",
            name,
            "--incarnation",
            str(incarnation),
            "--broker",
            self.broker_where,
        ]
        for url in self.wiring.engines:  # none (a joining launch): the actor asks the broker
            argv += ["--engine", url]
        for url in self.wiring.judges:
            argv += ["--judge", url]
        for url in self.wiring.teachers:
            argv += ["--teacher", url]
        return self.command(name, "actor", argv, incarnation=incarnation)

    def gateway(self, incarnation: int = 0) -> Command:
        """The OpenAI-compatible gateway (gateway/server.py): to the broker an actor, restarted like one, on the
        same port (agent code keeps its URL; episodes open in the dead incarnation are its groups' loss)."""
        name = f"gateway-{self.prefix}0"
        argv = [
            PY,
            "-m",
            "gateway",
            "--config",
            str(self.config_path),
            "--name",
            name,
            "--incarnation",
            str(incarnation),
            "--broker",
            self.broker_where,
            "--port",
            str(self.wiring.gateway_port),
        ]
        for url in self.wiring.engines:  # none (a joining launch): the gateway asks the broker
            argv += ["--engine", url]
        return self.command(name, "gateway", argv, incarnation=incarnation)

    def env_server(self, incarnation: int = 0) -> Command:
        """The env's own server (`EnvTraits.serve`: OpenEnv's env.kwargs.app) under uvicorn, on 127.0.0.1 at the port
        the wiring picked; a restart takes the same port (the actors keep its URL, env.kwargs.base_url). uvicorn
        imports the app from the launch's working directory, as the actors import a user's env."""
        from envs.registry import traits as env_traits

        app = env_traits(self.cfg.env.name, self.cfg.env.kwargs).serve
        port = self.wiring.env_server.rsplit(":", 1)[1]
        argv = [PY, "-m", "uvicorn", app, "--host", "127.0.0.1", "--port", port, "--log-level", "warning"]
        return self.command("env-server", "env_server", argv, incarnation=incarnation)

    def evaluator(self) -> Command:  # validation (actors/evaluate.py): held-out seeds, never trained on
        return self.command(
            "evaluator",
            "evaluator",
            [
                PY,
                "-m",
                "actors.evaluate",
                "--config",
                str(self.config_path),
                "--broker",
                self.broker_where,
                "--engine",
                self.wiring.engines[0],
                "--out",
                str(self.run_dir),
                "--t0",
                str(self.started),
            ],
        )


__all__ = ["Command", "Commands"]
