"""The learner process: FSDP2 policy training on batches from the broker, weights out to the engines.

    torchrun --nproc-per-node 2 -m learner.train --config RUN/config.yaml \\
        --broker tcp://127.0.0.1:5555 --weights-bind tcp://127.0.0.1:5556 --out RUN

Each rank asks the broker for its share of global batch k (`BatchRequest`), trains one optimizer step on
it (`learner.step`), and after the step all ranks gather the full weights, one parameter at a time; rank 0
streams them in buckets to the engines' workers as version k+1 (engines.weight_sync=stream; `file`: one
safetensors file through each sidecar) and sends the broker a `VersionUpdate` with the step's metrics and where
it publishes (the broker tells launches that join, and their sidecars, where a learner placed again is); every
rank sends `Stats`.
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

from agentstream.config import (
    AlgorithmConfig,
    CheckpointConfig,
    Config,
    LearnerConfig,
    ModelConfig,
    learner_threads,
    load,
)
from agentstream.process import setup_logging
from agentstream.weights import StreamLayout, StreamSource
from agentstream.wire.addresses import advertised_address
from agentstream.wire.client import SyncClient
from agentstream.wire.messages import Batch, BatchRequest, Hello, Message, Reject, Stats, VersionUpdate
from learner.checkpoint import (
    Extras,
    checkpoint_root,
    complete_checkpoints,
    load_checkpoint,
    resolve_resume,
    save_checkpoint,
)
from learner.model import (
    adapter_config,
    adapter_state_dict,
    full_parameters,
    full_state_dict,
    init_distributed,
    is_lora,
    load_policy,
    lora_spec,
    parameter_shapes,
    trainable_parameters,
)
from learner.publish import WeightPublisher
from learner.step import StepModels, StepOptions, all_reduce_dict, make_step_models, refresh_reference, train_step

log = logging.getLogger("learner")


class Publisher(Protocol):
    """Rank 0's link to the engines' weight sidecars (implemented by `learner.publish.WeightPublisher`)."""

    def publish(self, version: int, state_dict: dict[str, Tensor]) -> None: ...

    def publish_adapter(self, version: int, state_dict: dict[str, Tensor], config: dict) -> None: ...

    def publish_stream(self, version: int, source: StreamSource) -> None: ...

    def stream_again(self, version: int, source: StreamSource) -> None: ...

    def stream_pending(self) -> bool: ...

    def wait_for(self, version: int, n_engines: int, timeout_s: float) -> object: ...

    def service(self) -> None: ...

    def close(self) -> None: ...


PublisherFactory = Callable[..., Publisher]  # (bind_address, [curve_keys_dir=...]) -> Publisher


def default_publisher(bind_address: str, curve_keys_dir: str = "") -> Publisher:
    # The epoch tells agents that this process's weights replace any they run, even of a higher version
    # (a learner restarted from a checkpoint publishes the checkpoint's version again).
    # Compared for equality only; kept in int32 (the protocol's range) and never 0 (the engines' initial weights).
    return WeightPublisher(
        bind_address, epoch=time.time_ns() // 1_000_000 % (2**31 - 1) + 1, curve_keys_dir=curve_keys_dir
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m learner.train", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", required=True, help="resolved run config (agentstream.config.save)")
    p.add_argument(
        "--broker",
        required=True,
        help="broker ROUTER address, e.g. tcp://127.0.0.1:5555, or its record "
        "(RUN/broker.json: followed when the broker moves)",
    )
    p.add_argument("--weights-bind", default=None, help="address rank 0 binds to publish weights; omit: no publishing")
    p.add_argument("--out", default=None, type=Path, help="run folder; rank 0 appends learner_metrics.jsonl there")
    p.add_argument(
        "--engines",
        default=None,
        type=int,
        help="engines that must ack the final version (default: engines.count; 0: do not wait)",
    )
    p.add_argument(
        "--publish-initial",
        action="store_true",
        help="publish the initial weights as version 0 before training (engines started elsewhere)",
    )
    p.add_argument(
        "--resume",
        default="",
        help="override checkpoint.resume_from (the launcher passes `latest` to a restarted learner)",
    )
    p.add_argument("--batch-timeout-s", default=1800.0, type=float, help="give up when a batch takes longer than this")
    p.add_argument(
        "--final-timeout-s", default=300.0, type=float, help="give up waiting for the engines' acks after this"
    )
    return p.parse_args(argv)


@dataclass
class RankState:
    """What one rank reports in its Stats: totals since start (counters) and current values (gauges)."""

    rank: int
    counters: dict[str, float] = field(default_factory=dict)
    gauges: dict[str, float] = field(default_factory=dict)
    last_update: VersionUpdate | None = None  # rank 0: resent with batch requests (a restarted broker's version)
    reference_version: int = 0  # the policy version the frozen reference holds (SPIN refreshes it)

    def record(self, metrics: dict[str, float], version: int, wait_s: float, step_s: float) -> None:
        for name, key in [
            ("steps", None),
            ("tokens", "local_tokens"),
            ("micro_batches", "micro_batches"),
            ("zero_weight_micro_batches", "local_zero_weight_micro_batches"),
        ]:
            self.counters[name] = self.counters.get(name, 0) + (1 if key is None else metrics[key])
        # Idle = waiting for the broker's batch; busy = the rest of the step (train, gather, publish).
        self.counters["batch_wait_s"] = self.counters.get("batch_wait_s", 0.0) + wait_s
        self.counters["step_time_s"] = self.counters.get("step_time_s", 0.0) + step_s
        self.gauges.update(
            version=version,
            batch_wait_s=wait_s,
            step_time_s=step_s,
            loss=metrics["loss"],
            grad_norm=metrics["grad_norm"],
            local_tokens=metrics["local_tokens"],
        )

    def stats(self, final: bool = False) -> Stats:
        return Stats(
            source=f"learner-{self.rank}",
            role="learner",
            counters=dict(self.counters),
            gauges=dict(self.gauges),
            final=final,
        )


BATCH_RESEND_S = 10.0  # no batch this long: ask again (a broker restarted from its log lost the request)


def _answers(reply: Batch | Reject, step: int, rank: int) -> bool:
    """Whether `reply` answers this request, not a resend of an earlier step's (answered while it travelled)."""
    if isinstance(reply, Reject):
        return reply.step in (-1, step)
    return (reply.step, reply.rank) == (step, rank)


def request_batch(
    client: SyncClient,
    step: int,
    rank: int,
    world: int,
    timeout_s: float,
    before: tuple = (),
    on_wait: Callable[[], None] | None = None,
) -> Batch:
    """Rank `rank`'s share of batch `step`; `before` (rank 0: its last VersionUpdate) is resent with it, so a
    restarted broker learns the learner's version again."""
    reply = client.request(
        BatchRequest(step=step, rank=rank, world_size=world),
        timeout_s=timeout_s,
        resend_every_s=BATCH_RESEND_S,
        before=before,
        accept=lambda r: not isinstance(r, (Batch, Reject)) or _answers(r, step, rank),
        on_wait=on_wait,
    )
    if not isinstance(reply, Batch):
        raise RuntimeError(f"asked the broker for batch {step}, got a {reply.kind} message")
    if reply.step != step or reply.rank != rank:
        raise RuntimeError(f"asked for batch {step} of rank {rank}, got batch {reply.step} of rank {reply.rank}")
    return reply


def streams_together(r: Rank) -> bool:
    """Whether a pass over the weights for the engines is a collective of several ranks (streamed full weights)."""
    return r.world > 1 and r.spec.weight_sync.mode == "stream" and not is_lora(r.model)


def request_batch_in_step(r: Rank, step: int, before: tuple) -> Batch:
    """`request_batch` for several ranks that stream weights: while they wait, every rank meets the others once a
    second (an all-reduce), and when rank 0's publisher has an engine that (re)joined and needs the current
    weights, they all make a pass over the parameters for it (a collective: `publish_weights`). A rank that has
    its share keeps meeting until every rank has one, so the ranks run the same collectives in the same order."""
    client, deadline = r.client, time.monotonic() + r.spec.batch_timeout_s
    request = BatchRequest(step=step, rank=r.rank, world_size=r.world)

    def accept(m: Message) -> bool:
        return not isinstance(m, (Batch, Reject)) or _answers(m, step, r.rank)

    client.send(request)
    sent, batch = time.monotonic(), None
    while True:
        if batch is None:
            reply = client.receive(1.0, accept, request.kind)
            if reply is not None and not isinstance(reply, Batch):
                raise RuntimeError(f"asked the broker for batch {step}, got a {reply.kind} message")
            batch = reply
            if batch is None and time.monotonic() - sent > BATCH_RESEND_S:  # a restarted broker lost the request
                client.follow()  # and may listen elsewhere now
                for m in (*before, request):
                    client.send(m)
                sent = time.monotonic()
        needs = r.publisher is not None and r.publisher.stream_pending()
        flags = all_reduce_dict({"have": float(batch is not None), "serve": float(needs)}, dist.ReduceOp.SUM, r.device)
        if flags["serve"]:
            publish_weights(r.model, r.publisher, step, r.spec.weight_sync, r.world, r.device, again=True)
        if flags["have"] == r.world:
            return batch
        if time.monotonic() > deadline:
            raise TimeoutError(f"no batch {step} from the broker within {r.spec.batch_timeout_s:.0f} s")


@dataclass(frozen=True)
class WeightSync:
    """How full weights reach the engines (engines.weight_sync and its fields)."""

    mode: str  # stream | file
    bucket_bytes: int
    dtype: str  # the engines' dtype (model.dtype): what goes on the wire
    timeout_s: float


def publish_weights(
    model: torch.nn.Module,
    publisher: Publisher | None,
    version: int,
    sync: WeightSync,
    world: int,
    device: torch.device,
    again: bool = False,
) -> float:
    """All ranks gather (a collective); rank 0 (the one holding `publisher`) publishes. Returns seconds.
    `again`: streamed, the same version once more to the engines that need it (`request_batch_in_step`)."""
    t0 = time.perf_counter()
    if is_lora(model):  # only the adapter: the engines keep their base weights
        adapter = adapter_state_dict(model)
        if publisher is not None:
            publisher.publish_adapter(version, adapter, adapter_config(model))
    elif sync.mode == "stream":  # parameter by parameter, bucket by bucket: never the whole model at once
        layout = StreamLayout.of(parameter_shapes(model), sync.bucket_bytes, dtype=sync.dtype)
        source = StreamSource(layout, lambda: full_parameters(model), device, solo=world == 1, timeout_s=sync.timeout_s)
        if publisher is not None:
            (publisher.stream_again if again else publisher.publish_stream)(version, source)
        else:
            for _ in full_parameters(model):  # rank 0 streams; the others gather in step with it
                pass
    else:
        state = full_state_dict(model)
        if publisher is not None:
            publisher.publish(version, state)
    return time.perf_counter() - t0


@dataclass(frozen=True)
class TrainSpec:
    """What one learner rank takes of the run's config and its command line, built once by `main()`."""

    model: ModelConfig
    learner: LearnerConfig
    algorithm: AlgorithmConfig
    checkpoint: CheckpointConfig
    total_steps: int
    seed: int
    curve_keys_dir: str
    """CURVE key folder for the broker and the engines' weight sidecars ("" : plain TCP on loopback)."""
    broker: str
    """The broker's ROUTER address."""
    weights_bind: str
    """What rank 0 binds to publish weights ("" : nothing is published)."""
    weights: str
    """Where the engines' sidecars reach what rank 0 binds, told to the broker with every VersionUpdate: a learner
    placed again elsewhere is found there by the sidecars of launches that joined the run ("": not said)."""
    out: Path | None
    """Run folder: rank 0 appends learner_metrics.jsonl there (None: no file)."""
    run_dir: str
    """Where checkpoints go when neither `out` nor checkpoint.dir says (run.output_dir)."""
    engines: int
    """Engines that must acknowledge the final version (0: do not wait)."""
    publish_initial: bool
    """Publish the initial weights as version 0 before training (engines started elsewhere)."""
    restarted: bool
    """Started again by the launcher after a death: continue from the newest checkpoint, if any."""
    batch_timeout_s: float
    final_timeout_s: float
    weight_sync: WeightSync


def train_spec(cfg: Config, args: argparse.Namespace) -> TrainSpec:
    """The learner's part of the run's config, with the command line's overrides."""
    checkpoint = dataclasses.replace(cfg.checkpoint, resume_from=args.resume) if args.resume else cfg.checkpoint
    return TrainSpec(
        model=cfg.model,
        learner=cfg.learner,
        algorithm=cfg.algorithm,
        checkpoint=checkpoint,
        total_steps=cfg.trainer.total_steps,
        seed=cfg.run.seed,
        curve_keys_dir=cfg.broker.curve_keys_dir,
        broker=args.broker,
        weights_bind=args.weights_bind or "",
        weights=advertised_address(args.weights_bind or ""),
        out=Path(args.out) if args.out is not None else None,
        run_dir=cfg.run.output_dir,
        engines=cfg.engines.count if args.engines is None else args.engines,
        publish_initial=args.publish_initial,
        restarted=args.resume == "latest",
        batch_timeout_s=args.batch_timeout_s,
        final_timeout_s=args.final_timeout_s,
        weight_sync=WeightSync(
            cfg.engines.weight_sync,
            cfg.engines.weight_bucket_mb << 20,
            cfg.model.dtype,
            cfg.engines.weight_sync_timeout_s,
        ),
    )


@dataclass
class Rank:
    """One rank's training parts: what every step uses."""

    spec: TrainSpec
    rank: int
    world: int
    device: torch.device
    client: SyncClient
    publisher: Publisher | None
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    opts: StepOptions
    step_models: StepModels
    state: RankState


def train(spec: TrainSpec, rank: int, world: int, device: torch.device, publisher_factory: PublisherFactory) -> None:
    """The whole run of one rank."""
    client = SyncClient(spec.broker, name=f"learner-{rank}", curve_keys_dir=spec.curve_keys_dir)
    client.send(Hello(role="learner", name=f"learner-{rank}", pid=os.getpid()))
    keys = {"curve_keys_dir": spec.curve_keys_dir} if spec.curve_keys_dir else {}
    publisher = publisher_factory(spec.weights_bind, **keys) if rank == 0 and spec.weights_bind else None
    try:
        m = spec.model
        lora = lora_spec(m.lora_rank, m.lora_alpha, m.lora_target_modules, m.lora_dropout, spec.seed)
        model = load_policy(
            m.path,
            m.dtype,
            device,
            world,
            lora=lora,
            train_vision=m.train_vision,
            activation_checkpointing=spec.learner.activation_checkpointing,
        )
        optimizer = torch.optim.AdamW(
            trainable_parameters(model),
            lr=spec.learner.lr,
            betas=tuple(spec.learner.betas),
            eps=spec.learner.eps,
            weight_decay=spec.learner.weight_decay,
        )
        # The critic and the frozen reference policy, when the algorithm needs them (a collective: FSDP2 sharding).
        step_models = make_step_models(m, spec.algorithm, spec.learner, device, world)
        r = Rank(
            spec,
            rank,
            world,
            device,
            client,
            publisher,
            model,
            optimizer,
            StepOptions.from_config(spec.learner, spec.algorithm),
            step_models,
            RankState(rank),
        )
        ckpt_root = checkpoint_root(spec.checkpoint, spec.out if spec.out is not None else spec.run_dir)
        critic = step_models.critic  # trained beside the policy: checkpointed with it
        extras = {"critic": (critic.model, critic.optimizer)} if critic is not None else {}
        start = resume(r, ckpt_root, extras)
        for k in range(start, spec.total_steps):
            run_one_step(r, k)
            version = k + 1
            every = spec.checkpoint.every_steps
            if every > 0 and (version % every == 0 or version == spec.total_steps):
                save_checkpoint(ckpt_root, model, optimizer, version, extras)
                if r.state.last_update is not None:  # rank 0: the broker may forget the batches before it
                    r.state.last_update = dataclasses.replace(r.state.last_update, checkpointed=version)
                    client.send(r.state.last_update)
        wait_for_engines(r, spec.total_steps, wait=publisher is not None and spec.engines > 0)
        dist.barrier()  # ranks leave together: none tears down the group under another's feet
        client.send(r.state.stats(final=True))
    finally:
        if publisher is not None:
            publisher.close()
        client.close()


def resume(r: Rank, root: Path, extras: Extras) -> int:
    """Load the checkpoint to resume from (if any) and publish its weights under its version, so that every
    engine is brought to them before training goes on; tell the broker. Returns the version (0: fresh start)."""
    resume_from, publish_initial = r.spec.checkpoint.resume_from, r.spec.publish_initial
    if r.spec.restarted and not complete_checkpoints(root):
        # Restarted before its first checkpoint: start over from the initial weights, which the engines
        # (running the dead process's later versions) are brought back to.
        resume_from, publish_initial = "", True
    folder = resolve_resume(resume_from, root)
    version = 0 if folder is None else load_checkpoint(folder, r.model, r.optimizer, extras)
    if version > 0 and r.spec.algorithm.ref_update_every > 0 and r.step_models.reference is not None:
        # The reference is not checkpointed: a refreshed one restarts as the resumed policy (SPIN's opponent is
        # the latest iteration's model), the initial weights otherwise.
        refresh_reference(r.model, r.step_models.reference)
        r.state.reference_version = version
    # Publishing is a gather every rank joins: all ranks do what rank 0 decides, so that ranks whose command lines
    # disagree (another node's launch, a node restarted alone) cannot leave rank 0 waiting in it for good.
    publish = bool(r.spec.weights_bind and (version > 0 or publish_initial)) if r.rank == 0 else False
    if all_reduce_dict({"publish": float(publish)}, dist.ReduceOp.SUM, r.device)["publish"]:
        publish_weights(r.model, r.publisher, version, r.spec.weight_sync, r.world, r.device)
    if (version > 0 or r.spec.restarted) and r.rank == 0:
        # The broker serves batch `version` again (it kept what this checkpoint had not consumed).
        r.state.last_update = VersionUpdate(version=version, resumed=True, checkpointed=version, weights=r.spec.weights)
        r.client.send(r.state.last_update)
        if r.spec.out is not None:  # versions after this line replace any later ones written before it
            with open(r.spec.out / "learner_metrics.jsonl", "a") as f:
                f.write(json.dumps({"resumed_from": version}) + "\n")
    # Every engine runs the checkpoint's weights before the first resumed step trains.
    resumed = (version > 0 or r.spec.restarted) and r.rank == 0
    wait_for_engines(r, version, wait=resumed and r.publisher is not None and r.spec.engines > 0)
    return version


def run_one_step(r: Rank, k: int) -> None:
    """Train step k on this rank's share of batch k, publish version k+1, report."""
    t0 = time.perf_counter()
    state = r.state
    before = (state.last_update,) if state.last_update is not None else ()
    # While rank 0 waits, its publisher serves engines that (re)start: they get the newest weights at once.
    if streams_together(r):
        batch = request_batch_in_step(r, k, before)  # with the other ranks: streaming is a collective
    else:
        batch = request_batch(
            r.client,
            k,
            r.rank,
            r.world,
            r.spec.batch_timeout_s,
            before,
            r.publisher.service if r.publisher is not None else None,
        )
    wait_s = time.perf_counter() - t0
    metrics = train_step(
        r.model, r.optimizer, batch, r.opts, version=k, world_size=r.world, device=r.device, models=r.step_models
    )
    version = k + 1
    metrics.update(maybe_refresh_reference(r, version))
    publish_s = (
        publish_weights(r.model, r.publisher, version, r.spec.weight_sync, r.world, r.device)
        if r.spec.weights_bind
        else 0.0
    )
    step_s = time.perf_counter() - t0
    state.record(metrics, version, wait_s, step_s)
    if r.rank == 0:
        drop = ("local_tokens", "local_zero_weight_micro_batches")
        report = {k: v for k, v in metrics.items() if k not in drop}
        report.update(
            step_time_s=step_s,
            batch_wait_s=wait_s,
            publish_s=publish_s,
            learner_idle_fraction=state.counters["batch_wait_s"] / max(state.counters["step_time_s"], 1e-9),
            learner_busy_s_total=state.counters["step_time_s"] - state.counters["batch_wait_s"],
        )
        state.last_update = VersionUpdate(version=version, metrics=report, weights=r.spec.weights)
        r.client.send(state.last_update)
        if r.spec.out is not None:
            with open(r.spec.out / "learner_metrics.jsonl", "a") as f:
                f.write(json.dumps({"version": version, **report}) + "\n")
        log.info(
            "version %d  loss %.4f  grad_norm %.3f  tokens %d  %.2fs (waited %.2fs)",
            version,
            metrics["loss"],
            metrics["grad_norm"],
            metrics["tokens"],
            step_s,
            wait_s,
        )
    r.client.send(state.stats())


def maybe_refresh_reference(r: Rank, version: int) -> dict[str, float]:
    """Every `algorithm.ref_update_every` versions the frozen reference becomes the policy (SPIN); returns the
    reference's version and the refreshes so far as metrics (none without a refreshed reference)."""
    every, reference = r.spec.algorithm.ref_update_every, r.step_models.reference
    if every <= 0 or reference is None:
        return {}
    if version % every == 0:
        refresh_reference(r.model, reference)
        r.state.reference_version = version
        r.state.counters["reference_refreshes"] = r.state.counters.get("reference_refreshes", 0.0) + 1
    return {
        "reference_version": float(r.state.reference_version),
        "reference_refreshes": r.state.counters.get("reference_refreshes", 0.0),
    }


def wait_for_engines(r: Rank, version: int, wait: bool) -> None:
    """Until `r.spec.engines` engines acknowledge `version`, when rank 0 says `wait`. Every rank calls it: with
    streamed weights and several ranks, an engine that (re)joins meanwhile gets the weights from all of them (a pass
    over the parameters is a collective), so the ranks meet every half second; otherwise rank 0 waits alone."""
    spec, publisher = r.spec, r.publisher
    if wait and publisher is not None:
        log.info(
            "waiting up to %.0fs for %d engine(s) to acknowledge version %d",
            spec.final_timeout_s,
            spec.engines,
            version,
        )
    if not streams_together(r):
        if wait and publisher is not None:
            if publisher.wait_for(version, spec.engines, spec.final_timeout_s) is False:
                raise TimeoutError(_unacknowledged(spec.engines, version, spec.final_timeout_s))
        return
    if not all_reduce_dict({"wait": float(wait)}, dist.ReduceOp.SUM, r.device)["wait"]:
        return
    deadline = time.monotonic() + spec.final_timeout_s
    while True:
        done = needs = late = False
        if wait and publisher is not None:  # rank 0, half a second at most
            try:
                done = publisher.wait_for(version, spec.engines, 0.5) is not False
            except TimeoutError:
                needs, late = publisher.stream_pending(), time.monotonic() > deadline
        flags = all_reduce_dict(
            {"done": float(done), "serve": float(needs), "late": float(late)}, dist.ReduceOp.SUM, r.device
        )
        if flags["serve"]:
            publish_weights(r.model, publisher, version, spec.weight_sync, r.world, r.device, again=True)
        if flags["done"]:
            return
        if flags["late"]:
            raise TimeoutError(_unacknowledged(spec.engines, version, spec.final_timeout_s))


def _unacknowledged(n_engines: int, version: int, timeout_s: float) -> str:
    return (
        f"{n_engines} engine(s) did not all acknowledge weights version {version} within {timeout_s}s; "
        f"check the engines' weight-sidecar logs (or pass --engines 0 to skip waiting)"
    )


def main(argv: list[str] | None = None, publisher_factory: PublisherFactory = default_publisher) -> int:
    args = parse_args(argv)
    rank_name = f"learner rank {os.environ.get('RANK', '?')}"
    setup_logging(f"%(asctime)s {rank_name} %(levelname)s %(message)s")
    try:
        cfg = load(args.config)
        spec = train_spec(cfg, args)
        torch.set_num_threads(learner_threads(cfg))
        rank, world, device = init_distributed(cfg.learner.backend)
    except Exception as exc:
        print(f"{rank_name}: cannot start: {exc.__class__.__name__}: {exc}", file=sys.stderr)
        return 2
    try:
        if world != cfg.learner.world_size:
            raise RuntimeError(
                f"torchrun started {world} ranks but learner.world_size={cfg.learner.world_size}; "
                f"run torchrun --nproc-per-node {cfg.learner.world_size}"
            )
        if spec.out is not None:
            spec.out.mkdir(parents=True, exist_ok=True)
        train(spec, rank, world, device, publisher_factory)
        return 0
    except Exception as exc:
        log.exception("failed")
        print(f"{rank_name}: failed: {exc.__class__.__name__}: {exc}", file=sys.stderr)
        return 1
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
