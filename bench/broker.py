"""Broker throughput: transitions/s through the real broker versus raw pyzmq PUSH/PULL, same payloads, same run.

    .venv/bin/python -m bench.broker [--transitions 20000] [--sizes small,large,image] [--repeats 2]

Three processes for the broker path, as in a run: a producer (an actor's stand-in: pipelined GroupRequests, then
every transition of each granted group, each built as a `Transition`, the group's sent as one `Transitions`
message (as the actor's client sends transitions that come together; `--one-per-message`: one message each)
encoded by `agentstream.wire.messages`), the real broker (`python -m broker.server`, ingest, group assembly, batch
forming) and a learner stub that only receives its batches (BatchRequest -> Batch -> VersionUpdate). The raw
baseline sends the same encoded messages from the same producer code over PUSH -> PULL to a sink that only counts
them. Rate = transitions / (last received - first sent). Sizes: small = 1 step per trajectory, 64 tokens (48
prompt + 16 response); large = 4 steps per trajectory, 2,048 tokens (1,536 + 512) per transition; image = small
plus its prompt's picture (a 96x96 RGB Sokoban room, 27,648 bytes, as preset=cpu_tiny_vl sends), so the small and
image rows of one run give the cost of images.
The last line is the broker/raw ratio for each size (target >= 0.5).
"""

from __future__ import annotations

import multiprocessing as mp
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import zmq

from agentstream.wire.addresses import free_port
from bench import harness

GROUP_SIZE = 4
WINDOW = 32  # group requests the producer keeps outstanding (an actor with many slots does the same)


@dataclass(frozen=True)
class Size:
    """One transition shape."""

    name: str
    prompt: int
    response: int
    steps: int  # transitions per trajectory
    groups_per_step: int  # groups per learner batch
    image: tuple[int, int, int] | None = None  # each prompt's picture [H, W, C] (None: text only)

    @property
    def tokens(self) -> int:
        return self.prompt + self.response

    @property
    def payload_bytes(self) -> int:
        """Token ids, log-probs and picture bytes of one transition."""
        return self.tokens * 4 + self.response * 4 + (int(np.prod(self.image)) if self.image else 0)


SIZES = {
    "small": Size("small", 48, 16, 1, 16),
    "large": Size("large", 1536, 512, 4, 4),
    "image": Size("image", 48, 16, 1, 16, image=(96, 96, 3)),
}


def make_transition(size: Size, rng: np.random.Generator, group_id: int, traj: int, step: int):
    from agentstream.wire.messages import Transition

    return Transition(
        traj_id=f"bench.g{group_id}.{traj}",
        group_id=group_id,
        actor="bench",
        step=step,
        prompt_ids=rng.integers(0, 400, size.prompt, dtype=np.int32),
        response_ids=rng.integers(0, 400, size.response, dtype=np.int32),
        logprobs=-rng.random(size.response, dtype=np.float32),
        version_lo=0,
        version_hi=0,
        reward=1.0,
        done=step == size.steps - 1,
        truncated=False,
        valid=True,
        anchor="",
        info={"success": False},
        images=rng.integers(0, 256, (1, *size.image), dtype=np.uint8)
        if size.image
        else np.zeros((0, 0, 0, 0), np.uint8),
    )


def _pool(size: Size) -> list:
    """Pre-drawn token arrays: the producer's time goes to building, encoding and sending, not to the RNG."""
    rng = np.random.default_rng(0)
    return [make_transition(size, rng, 0, 0, 0) for _ in range(64)]


def _group_transitions(size: Size, pool: list, group_id: int) -> list:
    """Every transition of one group, built as an actor builds them (a new Transition per step), keyed for
    the broker's acknowledgements (actor, incarnation 0, seq) as an actor's are."""
    from agentstream.wire.messages import Transition

    out = []
    for traj in range(GROUP_SIZE):
        for step in range(size.steps):
            src = pool[(group_id * GROUP_SIZE + traj + step) % len(pool)]
            out.append(
                Transition(
                    traj_id=f"bench.g{group_id}.{traj}",
                    group_id=group_id,
                    actor="bench",
                    step=step,
                    prompt_ids=src.prompt_ids,
                    response_ids=src.response_ids,
                    logprobs=src.logprobs,
                    version_lo=0,
                    version_hi=0,
                    reward=1.0,
                    done=step == size.steps - 1,
                    truncated=False,
                    valid=True,
                    info={"success": False},
                    incarnation=0,
                    seq=group_id * GROUP_SIZE * size.steps + len(out),
                    images=src.images,
                )
            )
    return out


def _messages(transitions: list, bundle: bool) -> list:
    """What goes over the socket: the group's transitions in one Transitions message (as the actor's client
    sends transitions that come together), or one Transition message each."""
    from agentstream.wire.messages import Transitions

    return [Transitions.of(transitions)] if bundle else transitions


# ------------------------------------------------------------------------------------ raw PUSH/PULL
def raw_producer(address: str, size: Size, n: int, start_q: mp.Queue, bundle: bool = True) -> None:
    from agentstream.wire.messages import encode

    sock = zmq.Context.instance().socket(zmq.PUSH)
    sock.setsockopt(zmq.SNDHWM, 10_000)
    sock.connect(address)
    pool = _pool(size)
    per_group = GROUP_SIZE * size.steps
    time.sleep(0.3)  # let the connection settle before the clock starts
    start_q.put(time.time())
    sent, gid = 0, 0
    while sent < n:
        for m in _messages(_group_transitions(size, pool, gid), bundle):
            sock.send_multipart(encode(m), copy=False)
        sent += per_group
        gid += 1
    sock.close(linger=-1)
    zmq.Context.instance().term()  # every zero-copy frame sent and released before the interpreter goes


def raw_sink(address_q: mp.Queue, n: int, out_q: mp.Queue, per_message: int = 1) -> None:
    sock = zmq.Context.instance().socket(zmq.PULL)
    sock.setsockopt(zmq.RCVHWM, 10_000)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    address_q.put(f"tcp://127.0.0.1:{port}")
    got = 0
    while got < n:
        sock.recv_multipart(copy=False)
        got += per_message
    out_q.put((time.time(), got))
    sock.close()


def run_raw(size: Size, n: int, bundle: bool = True) -> float:
    ctx = mp.get_context("spawn")
    addr_q, out_q, start_q = ctx.Queue(), ctx.Queue(), ctx.Queue()
    n = _round_up(n, GROUP_SIZE * size.steps)
    sink = ctx.Process(target=raw_sink, args=(addr_q, n, out_q, GROUP_SIZE * size.steps if bundle else 1))
    sink.start()
    producer = ctx.Process(target=raw_producer, args=(addr_q.get(timeout=60), size, n, start_q, bundle))
    producer.start()
    t0 = start_q.get(timeout=60)
    t1, got = _get(out_q, [sink, producer], None)
    producer.join(30)
    sink.join(30)
    return got / (t1 - t0)


# ------------------------------------------------------------------------------------ through the broker
def broker_producer(address: str, size: Size, n_groups: int, start_q: mp.Queue, bundle: bool = True) -> None:
    from agentstream.wire.client import SyncClient
    from agentstream.wire.messages import Ack, GroupGrant, GroupRequest, Hello, decode, encode

    client = SyncClient(address, name="bench-actor", hwm=10_000)
    client.send(Hello(role="actor", name="bench-actor"))
    pool = _pool(size)
    sock = client._sock  # the pipelined loop needs recv without a request (AsyncClient does the same)
    time.sleep(0.3)
    start_q.put(time.time())
    asked = min(WINDOW, n_groups)
    for _ in range(asked):
        sock.send_multipart(encode(GroupRequest(actor="bench-actor")), copy=False)
    acked, last_seq = -1, -1
    for _ in range(n_groups):
        grant = decode(sock.recv_multipart(copy=False))
        while isinstance(grant, Ack):  # acknowledgements of what was sent: an actor reads them too
            acked = max(acked, grant.upto)
            grant = decode(sock.recv_multipart(copy=False))
        assert isinstance(grant, GroupGrant), grant
        transitions = _group_transitions(size, pool, grant.group_id)
        last_seq = max(last_seq, transitions[-1].seq)
        for m in _messages(transitions, bundle):
            sock.send_multipart(encode(m), copy=False)
        if asked < n_groups:
            sock.send_multipart(encode(GroupRequest(actor="bench-actor")), copy=False)
            asked += 1
    # As an actor does, keep the socket until the broker has acknowledged the last transition: closing with
    # messages still queued loses them when the process exits (the learner stub then waits for its last batch).
    sock.setsockopt(zmq.RCVTIMEO, 120_000)
    while acked < last_seq:
        msg = decode(sock.recv_multipart(copy=False))
        if isinstance(msg, Ack):
            acked = max(acked, msg.upto)
    client.close()


def learner_stub(address: str, n: int, out_q: mp.Queue) -> None:
    from agentstream.wire.client import SyncClient
    from agentstream.wire.messages import Batch, BatchRequest, Hello, VersionUpdate

    client = SyncClient(address, name="learner-0")
    client.send(Hello(role="learner", name="learner-0"))
    got, step = 0, 0
    while got < n:
        batch = client.request(BatchRequest(step=step, rank=0, world_size=1), timeout_s=120)
        assert isinstance(batch, Batch), batch
        got += len(batch.rewards)
        step += 1
        client.send(VersionUpdate(version=step))
    out_q.put((time.time(), got))
    client.close()


def set_field(cfg: object, assignment: str) -> None:
    """`section.field=value` on a Config (the value cast to the field's type), e.g. broker.wal=false."""
    key, _, value = assignment.partition("=")
    section, _, name = key.partition(".")
    node = getattr(cfg, section)
    old = getattr(node, name)  # AttributeError names a field that does not exist
    cast = (lambda v: v.lower() in ("1", "true", "yes")) if isinstance(old, bool) else type(old)
    setattr(node, name, cast(value))


def broker_config(size: Size, n: int, folder: Path, overrides: tuple[str, ...] = ()) -> Path:
    from agentstream import config as config_mod
    from agentstream.config import Config

    cfg = Config()
    cfg.run.output_dir = str(folder)
    cfg.env.group_size = GROUP_SIZE
    cfg.learner.world_size = 1
    cfg.trainer.groups_per_step = size.groups_per_step
    cfg.trainer.total_steps = 10**9
    cfg.trainer.max_staleness = 10**6  # throughput only: admission never waits for the learner
    cfg.broker.max_buffered_transitions = max(n, 1000)
    cfg.engines.max_model_len = 4096  # the broker refuses transitions longer than the engines' context
    for assignment in overrides:
        set_field(cfg, assignment)
    path = folder / "config.yaml"
    config_mod.save(cfg, path)
    return path


def run_broker(
    size: Size, n: int, folder: Path, profile: Path | None = None, overrides: tuple[str, ...] = (), bundle: bool = True
) -> tuple[float, float]:
    """(transitions/s, the broker's CPU seconds per transition). `profile`: run the broker under cProfile
    and write its stats there."""
    per_group = GROUP_SIZE * size.steps
    n_groups = _round_up(n, per_group * size.groups_per_step) // per_group
    n = n_groups * per_group
    port = free_port()
    folder = Path(tempfile.mkdtemp(prefix=f"{size.name}-", dir=folder))  # a fresh run folder (the broker's log)
    prof = ["-m", "cProfile", "-o", str(profile)] if profile else []
    log = folder / f"broker-{size.name}.log"
    with harness.started(harness.broker_argv(broker_config(size, n, folder, overrides), port, prof), log) as proc:
        harness.wait_listening(port, "the broker")
        cpu0 = harness.cpu_s(proc.pid)
        ctx = mp.get_context("spawn")
        out_q, start_q = ctx.Queue(), ctx.Queue()
        address = f"tcp://127.0.0.1:{port}"
        stub = ctx.Process(target=learner_stub, args=(address, n, out_q))
        stub.start()
        producer = ctx.Process(target=broker_producer, args=(address, size, n_groups, start_q, bundle))
        producer.start()
        t0 = start_q.get(timeout=60)
        t1, got = _get(out_q, [stub, producer], log)
        cpu = harness.cpu_s(proc.pid) - cpu0
        producer.join(30)
        stub.join(30)
        return got / (t1 - t0), cpu / got


# ------------------------------------------------------------------------------------ helpers, main
def _get(q: mp.Queue, procs: list, log: Path | None, timeout_s: float = 300):
    """The result from `q`; fails at once (naming the log) if a process died without giving one."""
    import queue

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            return q.get(timeout=0.5)
        except queue.Empty:
            dead = [p for p in procs if p.exitcode not in (None, 0)]
            if dead:
                break
    for p in procs:
        p.kill()
    tail = log.read_text()[-2000:] if log is not None and log.exists() else ""
    raise RuntimeError(f"benchmark process failed or timed out ({[p.exitcode for p in procs]}); log tail:\n{tail}")


def _round_up(n: int, k: int) -> int:
    return max(k, (n + k - 1) // k * k)


def main() -> None:
    parser = harness.arguments(__doc__)
    parser.add_argument(
        "--transitions",
        type=int,
        default=20_000,
        help="small (and image) transitions per measurement (large ones: a quarter of this)",
    )
    parser.add_argument("--sizes", default="small,large", help="comma-separated: small, large, image")
    parser.add_argument("--repeats", type=int, default=2, help="measurements of each path (median reported)")
    parser.add_argument(
        "--one-per-message",
        action="store_true",
        help="send each transition as its own "
        "Transition message (both paths) instead of each group's as one Transitions message",
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SECTION.FIELD=VALUE",
        help="broker config override, e.g. --set broker.wal=false --set broker.wal_fsync=true",
    )
    args = parser.parse_args()
    harness.stop_on_sigterm()
    names = [s.strip() for s in args.sizes.split(",") if s.strip()]
    unknown = [s for s in names if s not in SIZES]
    if unknown:
        parser.error(f"--sizes: unknown {unknown}; known: {sorted(SIZES)}")
    bundle = not args.one_per_message
    print(
        f"# messages: {'one Transitions message per group' if bundle else 'one Transition message per transition'}"
        f" (same payloads on both paths)",
        flush=True,
    )
    print(harness.load_line(), flush=True)
    print(
        f"{'size':<6} {'tokens':>6} {'n':>7} {'raw tr/s':>10} {'broker tr/s':>12} {'raw MB/s':>9} "
        f"{'broker MB/s':>11} {'broker us/tr':>12} {'ratio':>6}",
        flush=True,
    )
    ratios = {}
    with tempfile.TemporaryDirectory(prefix="bench-broker-") as tmp:
        for name in names:
            size = SIZES[name]
            n = args.transitions if name != "large" else max(args.transitions // 4, 64)
            raws, brokers, cpus = [], [], []
            for _ in range(args.repeats):  # interleaved: drift on the shared machine hits both alike
                raws.append(run_raw(size, n, bundle))
                rate, cpu = run_broker(size, n, Path(tmp), overrides=tuple(args.set), bundle=bundle)
                brokers.append(rate)
                cpus.append(cpu)
            raw, brk = statistics.median(raws), statistics.median(brokers)
            mb = size.payload_bytes
            ratios[name] = brk / raw
            print(
                f"{name:<6} {size.tokens:>6} {n:>7} {raw:>10.0f} {brk:>12.0f} {raw * mb / 1e6:>9.1f} "
                f"{brk * mb / 1e6:>11.1f} {statistics.median(cpus) * 1e6:>12.1f} {brk / raw:>6.3f}",
                flush=True,
            )
    print("ratio broker/raw: " + ", ".join(f"{k} {v:.3f}" for k, v in ratios.items()) + " (target >= 0.50)")


if __name__ == "__main__":
    main()
