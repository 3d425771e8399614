"""The learner process: FSDP2 policy training on batches from the broker, weights out to the engines.

    torchrun --nproc-per-node 2 -m learner.train --config RUN/config.yaml \\
        --broker tcp://127.0.0.1:5555 --weights-bind tcp://127.0.0.1:5556 --out RUN

Each rank asks the broker for its share of global batch k (`BatchRequest`), trains one optimizer step on
it (`learner.step`), and after the step all ranks gather the full weights; rank 0 publishes them as
version k+1 and sends the broker a `VersionUpdate` with the step's metrics; every rank sends `Stats`.
Without `--weights-bind` nothing is published (and no engine is waited for). At the end rank 0 waits
until `--engines` engines (default: engines.count) acknowledged the final version; `--engines 0` skips
that. Any error: a message naming the rank, exit status 1 (torchrun then stops the other ranks).

With model.lora_rank > 0 only a peft LoRA adapter is trained and published (`WeightUpdate` format
"peft_adapter"). With checkpoint.every_steps, every rank saves model, optimizer and RNG states
(`learner.checkpoint`); with checkpoint.resume_from the run continues at the checkpoint's version v: it
publishes those weights as version v first (engines catch up), then asks the broker for batch v.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Protocol

import torch
import torch.distributed as dist
from torch import Tensor

from agentstream.config import Config, load
from broker.client import SyncClient
from broker.protocol import Batch, BatchRequest, Hello, Reject, Stats, VersionUpdate
from learner.checkpoint import (
    Extras, checkpoint_root, complete_checkpoints, load_checkpoint, resolve_resume, save_checkpoint,
)
from learner.model import (
    adapter_config, adapter_state_dict, full_state_dict, init_distributed, is_lora, load_policy, lora_spec,
    trainable_parameters,
)
from learner.step import StepModels, StepOptions, make_step_models, train_step

log = logging.getLogger("learner")


class Publisher(Protocol):
    """Rank 0's link to the engines' weight agents (implemented by `engines.weights.WeightPublisher`)."""

    def publish(self, version: int, state_dict: dict[str, Tensor]) -> None: ...

    def publish_adapter(self, version: int, state_dict: dict[str, Tensor], config: dict) -> None: ...

    def wait_for(self, version: int, n_engines: int, timeout_s: float) -> object: ...

    def service(self) -> None: ...

    def close(self) -> None: ...


PublisherFactory = Callable[..., Publisher]  # (bind_address, [curve_keys_dir=...]) -> Publisher


def default_publisher(bind_address: str, curve_keys_dir: str = "") -> Publisher:
    try:  # imported here: the learner runs (and is tested) without the engines package
        from engines.weights import WeightPublisher
    except ImportError as exc:
        raise RuntimeError(f"--weights-bind needs engines.weights.WeightPublisher, which cannot be imported "
                           f"({exc}); omit --weights-bind to train without publishing weights") from exc
    # The epoch tells agents that this process's weights replace any they run, even of a higher version
    # (a learner restarted from a checkpoint publishes the checkpoint's version again).
    # Compared for equality only; kept in int32 (the protocol's range) and never 0 (the engines' initial weights).
    return WeightPublisher(bind_address, epoch=time.time_ns() // 1_000_000 % (2**31 - 1) + 1,
                           curve_keys_dir=curve_keys_dir)  # security: CURVE + allow-list for the agents


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m learner.train", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", required=True, help="resolved run config (agentstream.config.save)")
    p.add_argument("--broker", required=True, help="broker ROUTER address, e.g. tcp://127.0.0.1:5555")
    p.add_argument("--weights-bind", default=None, help="address rank 0 binds to publish weights; omit: no publishing")
    p.add_argument("--out", default=None, type=Path, help="run folder; rank 0 appends learner_metrics.jsonl there")
    p.add_argument("--engines", default=None, type=int,
                   help="engines that must ack the final version (default: engines.count; 0: do not wait)")
    p.add_argument("--publish-initial", action="store_true",
                   help="publish the initial weights as version 0 before training (engines started elsewhere)")
    p.add_argument("--resume", default="",
                   help="override checkpoint.resume_from (the launcher passes `latest` to a restarted learner)")
    p.add_argument("--batch-timeout-s", default=1800.0, type=float,
                   help="give up when a batch takes longer than this")
    p.add_argument("--final-timeout-s", default=300.0, type=float,
                   help="give up waiting for the engines' acks after this")
    return p.parse_args(argv)


@dataclass
class RankState:
    """What one rank reports in its Stats: totals since start (counters) and current values (gauges)."""

    rank: int
    counters: dict[str, float] = field(default_factory=dict)
    gauges: dict[str, float] = field(default_factory=dict)
    last_update: VersionUpdate | None = None  # rank 0: resent with batch requests (a restarted broker's version)

    def record(self, metrics: dict[str, float], version: int, wait_s: float, step_s: float) -> None:
        for name, key in [("steps", None), ("tokens", "local_tokens"), ("micro_batches", "micro_batches"),
                          ("zero_weight_micro_batches", "local_zero_weight_micro_batches")]:
            self.counters[name] = self.counters.get(name, 0) + (1 if key is None else metrics[key])
        # Idle = waiting for the broker's batch; busy = the rest of the step (train, gather, publish).
        self.counters["batch_wait_s"] = self.counters.get("batch_wait_s", 0.0) + wait_s
        self.counters["step_time_s"] = self.counters.get("step_time_s", 0.0) + step_s
        self.gauges.update(version=version, batch_wait_s=wait_s, step_time_s=step_s, loss=metrics["loss"],
                           grad_norm=metrics["grad_norm"], local_tokens=metrics["local_tokens"])

    def stats(self, final: bool = False) -> Stats:
        return Stats(source=f"learner-{self.rank}", role="learner", counters=dict(self.counters),
                     gauges=dict(self.gauges), final=final)


BATCH_RESEND_S = 10.0  # no batch this long: ask again (a broker restarted from its log lost the request)


def _answers(reply: Batch | Reject, step: int, rank: int) -> bool:
    """Whether `reply` answers this request, not a resend of an earlier step's (answered while it travelled)."""
    if isinstance(reply, Reject):
        return reply.step in (-1, step)
    return (reply.step, reply.rank) == (step, rank)


def request_batch(client: SyncClient, step: int, rank: int, world: int, timeout_s: float,
                  before: tuple = (), on_wait: Callable[[], None] | None = None) -> Batch:
    """Rank `rank`'s share of batch `step`; `before` (rank 0: its last VersionUpdate) is resent with it, so a
    restarted broker learns the learner's version again."""
    reply = client.request(BatchRequest(step=step, rank=rank, world_size=world), timeout_s=timeout_s,
                           resend_every_s=BATCH_RESEND_S, before=before,
                           accept=lambda r: not isinstance(r, (Batch, Reject)) or _answers(r, step, rank),
                           on_wait=on_wait)
    if not isinstance(reply, Batch):
        raise RuntimeError(f"asked the broker for batch {step}, got a {reply.kind} message")
    if reply.step != step or reply.rank != rank:
        raise RuntimeError(f"asked for batch {step} of rank {rank}, got batch {reply.step} of rank {reply.rank}")
    return reply


def publish_weights(model: torch.nn.Module, publisher: Publisher | None, version: int) -> float:
    """All ranks gather (a collective); rank 0 (the one holding `publisher`) publishes. Returns seconds."""
    t0 = time.perf_counter()
    if is_lora(model):  # only the adapter: the engines keep their base weights
        adapter = adapter_state_dict(model)
        if publisher is not None:
            publisher.publish_adapter(version, adapter, adapter_config(model))
    else:
        state = full_state_dict(model)
        if publisher is not None:
            publisher.publish(version, state)
    return time.perf_counter() - t0


def train(cfg: Config, args: argparse.Namespace, rank: int, world: int, device: torch.device,
          publisher_factory: PublisherFactory) -> None:
    """The whole run of one rank."""
    client = SyncClient(args.broker, name=f"learner-{rank}", curve_keys_dir=cfg.broker.curve_keys_dir)  # security
    client.send(Hello(role="learner", name=f"learner-{rank}", pid=os.getpid()))
    keys = {"curve_keys_dir": cfg.broker.curve_keys_dir} if cfg.broker.curve_keys_dir else {}  # security: CURVE
    publisher = publisher_factory(args.weights_bind, **keys) if rank == 0 and args.weights_bind else None
    try:
        m = cfg.model
        lora = lora_spec(m.lora_rank, m.lora_alpha, m.lora_target_modules, m.lora_dropout, cfg.run.seed)
        model = load_policy(m.path, m.dtype, device, world, lora=lora)
        optimizer = torch.optim.AdamW(trainable_parameters(model), lr=cfg.learner.lr,
                                      weight_decay=cfg.learner.weight_decay)
        state = RankState(rank)
        # ---- algorithm hook (issue 3; owned by learner/step.py): step options, and the critic / frozen
        # reference policy when cfg.algorithm needs them (a collective: FSDP2 sharding). Passed to train_step.
        opts = StepOptions.from_config(cfg.learner, cfg.algorithm)
        step_models = make_step_models(cfg.model, cfg.algorithm, cfg.learner, device, world)
        # ---- end of algorithm hook
        ckpt_root = checkpoint_root(cfg.checkpoint, args.out if args.out is not None else cfg.run.output_dir)
        critic = step_models.critic  # trained beside the policy: checkpointed with it
        extras = {"critic": (critic.model, critic.optimizer)} if critic is not None else {}
        if args.resume == "latest" and not complete_checkpoints(ckpt_root):
            # Restarted before its first checkpoint: start over from the initial weights, which the engines
            # (running the dead process's later versions) are brought back to.
            cfg.checkpoint.resume_from, args.publish_initial = "", True
        start = resume(cfg.checkpoint.resume_from, ckpt_root, model, optimizer, publisher, args, extras)
        n_engines = cfg.engines.count if args.engines is None else args.engines
        if (start > 0 or args.resume) and rank == 0:
            # The broker serves batch `start` again (it kept what this checkpoint had not consumed), and every
            # engine runs the checkpoint's weights before the first resumed step trains.
            state.last_update = VersionUpdate(version=start, resumed=True, checkpointed=start)
            client.send(state.last_update)
            if args.out is not None:  # versions after this line replace any later ones written before it
                with open(Path(args.out) / "learner_metrics.jsonl", "a") as f:
                    f.write(json.dumps({"resumed_from": start}) + "\n")
            if publisher is not None and n_engines > 0:
                wait_for_engines(publisher, start, n_engines, args.final_timeout_s)
        for k in range(start, cfg.trainer.total_steps):
            run_one_step(model, optimizer, client, publisher, k, opts, args, state, world, device, step_models)
            version = k + 1
            every = cfg.checkpoint.every_steps
            if every > 0 and (version % every == 0 or version == cfg.trainer.total_steps):
                save_checkpoint(ckpt_root, model, optimizer, version, extras)
                if state.last_update is not None:  # rank 0: the broker may forget the batches before it
                    state.last_update = dataclasses.replace(state.last_update, checkpointed=version)
                    client.send(state.last_update)
        if publisher is not None and n_engines > 0:
            wait_for_engines(publisher, cfg.trainer.total_steps, n_engines, args.final_timeout_s)
        dist.barrier()  # ranks leave together: none tears down the group under another's feet
        client.send(state.stats(final=True))
    finally:
        if publisher is not None:
            publisher.close()
        client.close()


def resume(resume_from: str, root: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
           publisher: Publisher | None, args: argparse.Namespace, extras: Extras) -> int:
    """Load the checkpoint `resume_from` names (if any) and publish its weights under its version, so that
    every engine is brought to them before training goes on. Returns the version (0: fresh start)."""
    folder = resolve_resume(resume_from, root)
    if folder is None:
        if args.weights_bind and args.publish_initial:
            publish_weights(model, publisher, 0)
        return 0
    version = load_checkpoint(folder, model, optimizer, extras)
    if args.weights_bind and version > 0:
        publish_weights(model, publisher, version)
    return version


def run_one_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, client: SyncClient,
                 publisher: Publisher | None, k: int, opts: StepOptions, args: argparse.Namespace,
                 state: RankState, world: int, device: torch.device, step_models: StepModels | None = None) -> None:
    t0 = time.perf_counter()
    before = (state.last_update,) if state.last_update is not None else ()
    # While rank 0 waits, its publisher serves engines that (re)start: they get the newest weights at once.
    batch = request_batch(client, k, state.rank, world, args.batch_timeout_s, before,
                          publisher.service if publisher is not None else None)
    wait_s = time.perf_counter() - t0
    metrics = train_step(model, optimizer, batch, opts, version=k, world_size=world, device=device,
                         models=step_models)  # algorithm hook (issue 3): critic / reference
    version = k + 1
    publish_s = publish_weights(model, publisher, version) if args.weights_bind else 0.0
    step_s = time.perf_counter() - t0
    state.record(metrics, version, wait_s, step_s)
    if state.rank == 0:
        drop = ("local_tokens", "local_zero_weight_micro_batches")
        report = {k: v for k, v in metrics.items() if k not in drop}
        report.update(step_time_s=step_s, batch_wait_s=wait_s, publish_s=publish_s,
                      learner_idle_fraction=state.counters["batch_wait_s"] / max(state.counters["step_time_s"], 1e-9),
                      learner_busy_s_total=state.counters["step_time_s"] - state.counters["batch_wait_s"])
        state.last_update = VersionUpdate(version=version, metrics=report)
        client.send(state.last_update)
        if args.out is not None:
            with open(Path(args.out) / "learner_metrics.jsonl", "a") as f:
                f.write(json.dumps({"version": version, **report}) + "\n")
        log.info("version %d  loss %.4f  grad_norm %.3f  tokens %d  %.2fs (waited %.2fs)", version,
                 metrics["loss"], metrics["grad_norm"], metrics["tokens"], step_s, wait_s)
    client.send(state.stats())


def wait_for_engines(publisher: Publisher, version: int, n_engines: int, timeout_s: float) -> None:
    log.info("waiting up to %.0fs for %d engine(s) to acknowledge version %d", timeout_s, n_engines, version)
    if publisher.wait_for(version, n_engines, timeout_s) is False:
        raise TimeoutError(
            f"{n_engines} engine(s) did not all acknowledge weights version {version} within {timeout_s}s; "
            f"check the engines' weight-agent logs (or pass --engines 0 to skip waiting)"
        )


def main(argv: list[str] | None = None, publisher_factory: PublisherFactory = default_publisher) -> int:
    args = parse_args(argv)
    rank_name = f"learner rank {os.environ.get('RANK', '?')}"
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {rank_name} %(levelname)s %(message)s")
    try:
        cfg = load(args.config)
        if args.resume:
            cfg.checkpoint.resume_from = args.resume
        torch.set_num_threads(cfg.learner.torch_threads)
        rank, world, device = init_distributed(cfg.learner.backend)
    except Exception as exc:
        print(f"{rank_name}: cannot start: {exc.__class__.__name__}: {exc}", file=sys.stderr)
        return 2
    try:
        if world != cfg.learner.world_size:
            raise RuntimeError(f"torchrun started {world} ranks but learner.world_size={cfg.learner.world_size}; "
                               f"run torchrun --nproc-per-node {cfg.learner.world_size}")
        if args.out is not None:
            Path(args.out).mkdir(parents=True, exist_ok=True)
        train(cfg, args, rank, world, device, publisher_factory)
        return 0
    except Exception as exc:
        log.exception("failed")
        print(f"{rank_name}: failed: {exc.__class__.__name__}: {exc}", file=sys.stderr)
        return 1
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
