"""Delivery bookkeeping and recovery: in-order de-duplicated intake, idempotent grants, and a state rebuilt from
the log that equals the state that wrote it, on random streams with crashes at random points."""

import random
import shutil
from pathlib import Path

import numpy as np

from agentstream.wire.messages import Transition, Transitions, decode, encode
from broker.buffer import ReplayBuffer
from broker.state import BrokerState
from broker.wal import WriteAheadLog


def make_state(folder: Path | None, **kw) -> BrokerState:
    buf = ReplayBuffer(
        group_size=2,
        groups_per_step=2,
        world_size=2,
        max_staleness=1,
        max_buffered_transitions=10**6,
        track_keys=True,
        **kw,
    )
    buf.engine_versions = {"e": 0}
    return BrokerState(buf, WriteAheadLog(folder) if folder else None, compact_every=40)


def tr(actor: str, inc: int, seq: int, gid: int, traj: str, step: int, done: bool, lo: int = 0) -> Transition:
    return Transition(
        traj_id=traj,
        group_id=gid,
        actor=actor,
        step=step,
        prompt_ids=np.arange(3, dtype=np.int32),
        response_ids=np.arange(2, dtype=np.int32),
        logprobs=np.full(2, -0.5, np.float32),
        version_lo=lo,
        version_hi=lo,
        reward=float(seq % 3),
        done=done,
        truncated=False,
        valid=True,
        incarnation=inc,
        seq=seq,
    )


def ingest(state: BrokerState, t: Transition):
    return state.ingest(t, [bytes(f) for f in encode(t)])


def ingest_bundle(state: BrokerState, ts: list[Transition]) -> list:
    """`ts` as one Transitions message, through its encoding (as the broker gets it)."""
    frames = [bytes(f) for f in encode(Transitions.of(ts))]
    return state.ingest_many(decode(frames).split(), frames)


def test_a_bundle_is_taken_as_its_transitions_one_by_one() -> None:
    single, bundled = make_state(None), make_state(None)
    gs = [st.admit("a", 0, request=0) for st in (single, bundled)]
    assert gs[0] == gs[1]
    g = gs[0].group_id
    stream = [
        tr("a", 0, 0, g, "x", 0, False),
        tr("a", 0, 2, g, "x", 2, False),
        tr("a", 0, 0, g, "x", 0, False),
        tr("a", 0, 1, g, "x", 1, True),
        tr("a", 0, 2, g, "y", 0, True),
    ]
    one_by_one = [(r.outcome, r.ack) for r in (ingest(single, t) for t in stream)]
    assert one_by_one == [("taken", 0), ("gap", None), ("duplicate", 0), ("taken", 1), ("completed", 2)]
    assert [(r.outcome, r.ack) for r in ingest_bundle(bundled, stream)] == one_by_one
    assert bundled.snapshot() == single.snapshot()
    # The usual bundle (the next seqs, in order) takes a shorter path: the same outcome. Group g2 is complete
    # after its two trajectories; the third transition names a group that is not open any more.
    g2 = [st.admit("a", 0, request=1) for st in (single, bundled)][0].group_id
    in_order = [tr("a", 0, 3, g2, "p", 0, True), tr("a", 0, 4, g2, "q", 0, True), tr("a", 0, 5, g2, "r", 0, True)]
    one_by_one = [(r.outcome, r.ack) for r in (ingest(single, t) for t in in_order)]
    assert one_by_one == [("taken", 3), ("completed", 4), ("rejected", 5)]
    assert [(r.outcome, r.ack) for r in ingest_bundle(bundled, in_order)] == one_by_one
    assert bundled.snapshot() == single.snapshot()


def test_only_the_newest_grants_are_kept_for_resent_requests(monkeypatch) -> None:
    import broker.state as state_mod

    monkeypatch.setattr(state_mod, "MAX_GRANTS_KEPT", 5)
    s = make_state(None)
    s.buffer.max_staleness = 10**6  # admission never waits here
    grants = [s.admit("a", 0, request=r) for r in range(8)]
    assert sorted(s.grants["a"][1]) == [3, 4, 5, 6, 7]  # the 5 newest; 0, 1, 2 forgotten oldest first
    assert s.admit("a", 0, request=4) == grants[4]  # a kept request: its grant again, nothing admitted
    assert s.buffer.counts["groups_admitted"] == 8
    again = s.admit("a", 0, request=1)  # forgotten: answered with a new group
    assert again.group_id == 8 and s.buffer.counts["groups_admitted"] == 9
    assert sorted(s.grants["a"][1]) == [1, 4, 5, 6, 7]


def test_a_request_for_two_groups_is_granted_once_and_replays_from_the_log(tmp_path: Path) -> None:
    s = make_state(tmp_path / "wal")
    s.recover()
    grant = s.admit("a", 0, request=0, groups=2)
    assert s.admit("a", 0, request=0, groups=2) == grant  # a resent request: its grant again, nothing admitted
    assert sorted(s.buffer.open) == [0, 1] and s.buffer.counts["groups_admitted"] == 2
    for seq, (gid, traj) in enumerate([(0, "x0"), (1, "x1"), (0, "y0"), (1, "y1")]):
        ingest(s, tr("a", 0, seq, gid, traj, 0, True))
    assert [g.group_id for g in s.buffer.ready] == [0, 1]
    s.wal.flush()
    again = make_state(tmp_path / "wal")
    again.recover()
    assert again.snapshot() == s.snapshot()
    accounting(again)


def test_intake_is_in_order_once_and_acknowledged() -> None:
    s = make_state(None)
    g = s.admit("a", 0, request=0)
    assert s.admit("a", 0, request=0) == g  # a resent request: the same grant, nothing new admitted
    assert s.buffer.counts["groups_admitted"] == 1
    r0 = ingest(s, tr("a", 0, 0, g.group_id, "x", 0, False))
    assert (r0.outcome, r0.ack) == ("taken", 0)
    gap = ingest(s, tr("a", 0, 2, g.group_id, "x", 2, False))
    assert (gap.outcome, gap.ack) == ("gap", None)  # seq 1 is missing: 2 is not taken
    dup = ingest(s, tr("a", 0, 0, g.group_id, "x", 0, False))
    assert (dup.outcome, dup.ack) == ("duplicate", 0)
    assert ingest(s, tr("a", 0, 1, g.group_id, "x", 1, True)).ack == 1
    c = s.buffer.counts
    # Hand count: 3 distinct seqs sent (0, 1, 2); 0 and 1 taken, 2 was a gap, 0 came twice.
    assert (
        c["transitions_acked"],
        c["transitions_ingested"],
        c["transitions_duplicate"],
        c["transitions_out_of_order"],
    ) == (2, 2, 1, 1)


def test_a_new_incarnation_settles_the_old_ones_groups_and_ignores_its_stragglers() -> None:
    s = make_state(None)
    g = s.admit("a", 0, request=0)
    ingest(s, tr("a", 0, 0, g.group_id, "x", 0, True))
    assert s.admit("a", 1, request=0) is not None  # incarnation 1: group g (half played) is dropped
    assert s.buffer.counts["groups_dropped_actor_died"] == 1 and s.buffer.dropped() == {"actor_died": 1}
    late = ingest(s, tr("a", 0, 1, g.group_id, "y", 0, True))
    assert late.outcome == "stale_incarnation" and late.ack is None
    assert s.admit("a", 0, request=5) is None


def test_partial_groups_serve_the_finished_trajectories_when_configured() -> None:
    s = make_state(None, partial_groups="serve", min_partial=1)
    g = s.admit("a", 0, 0)
    ingest(s, tr("a", 0, 0, g.group_id, "x", 0, True))  # x finished
    ingest(s, tr("a", 0, 1, g.group_id, "y", 0, False))  # y did not
    s.drop_owner("a", "actor_silent")
    assert len(s.buffer.ready) == 1 and list(s.buffer.ready[0].trajectories) == ["x"]
    assert s.buffer.dropped() == {"actor_silent": 1}


def random_run(s: BrokerState, rng: random.Random, steps: int, actors: dict) -> None:
    """Two actors play groups; now and then a learner takes a batch, checkpoints, or an actor restarts. Half
    of the transitions go in bundles (Transitions messages) of random size, duplicates included."""
    pending: dict[str, list[Transition]] = {"a": [], "b": []}

    def send(name: str, t: Transition) -> None:
        if rng.random() < 0.5:
            pending[name].append(t)
        else:
            flush(name)
            ingest(s, t)

    def flush(name: str) -> None:
        if pending[name]:
            ingest_bundle(s, pending[name])
            pending[name] = []

    for _ in range(steps):
        name = rng.choice(["a", "b"])
        st = actors.setdefault(name, {"inc": 0, "seq": 0, "req": 0, "groups": {}})
        roll = rng.random()
        if rng.random() < 0.2:
            flush(name)
        if roll < 0.03:
            flush(name)
            st.update(inc=st["inc"] + 1, seq=0, req=0, groups={})
            s.observe(name, st["inc"])
        elif roll < 0.25 and s.buffer.admissible():
            g = s.admit(name, st["inc"], st["req"])
            st["req"] += 1
            st["groups"][g.group_id] = {f"{g.group_id}.{i}": 0 for i in range(2)}
        elif roll < 0.32:
            b = s.buffer
            if s.try_form(b.next_step):
                step = b.next_step - 1
                assert s.share(step, 0) is not None and s.share(step, 1) is not None
                s.version(step + 1, checkpointed=step + 1 if rng.random() < 0.5 else -1)
                b.engine_versions = {"e": step + 1}
        elif st["groups"]:
            gid = rng.choice(list(st["groups"]))
            traj = rng.choice(list(st["groups"][gid]))
            done = rng.random() < 0.4
            send(
                name, tr(name, st["inc"], st["seq"], gid, traj, st["groups"][gid][traj], done, s.buffer.learner_version)
            )
            if rng.random() < 0.1:  # a resend of the same transition (lost ack): a duplicate
                send(name, tr(name, st["inc"], st["seq"], gid, traj, st["groups"][gid][traj], done))
            st["seq"] += 1
            st["groups"][gid][traj] += 1
            if done:
                del st["groups"][gid][traj]
                if not st["groups"][gid]:
                    del st["groups"][gid]
        s.maybe_compact()
    for name in pending:
        flush(name)


def accounting(s: BrokerState) -> None:
    c, b = s.buffer.counts, s.buffer
    rejected = sum(v for k, v in c.items() if k.startswith("transitions_rejected_"))
    assert c["transitions_acked"] == c["transitions_ingested"] + rejected
    assert c["transitions_ingested"] == c["transitions_trained"] + b.buffered() + sum(b.dropped().values())
    assert c["keys_settled_twice"] == 0


def test_recovery_rebuilds_the_same_state_after_crashes_at_random_points(tmp_path: Path) -> None:
    for trial in range(6):
        rng = random.Random(trial)
        folder = tmp_path / f"wal{trial}"
        reuse = {"max_samples_per_group": 2} if trial % 2 else {}  # odd trials: groups are trained twice
        s = make_state(folder, **reuse)
        s.recover()
        actors: dict = {}
        for crash in range(4):
            random_run(s, rng, rng.randint(50, 300), actors)
            s.wal.flush()  # what the broker does before it sends anything
            expected = s.snapshot()
            copy = tmp_path / f"crash{trial}.{crash}"
            shutil.copytree(folder, copy)  # the files as a kill -9 leaves them (unflushed appends are lost)
            s = make_state(copy, **reuse)
            s.recover()
            assert s.snapshot() == expected
            accounting(s)
            folder = copy
        assert s.buffer.counts["groups_trained"] > 0 and s.buffer.counts["transitions_duplicate"] > 0
        assert (s.buffer.counts["groups_reused"] > 0) == bool(reuse)


def test_retained_batches_are_served_again_to_a_resumed_learner_until_checkpointed(tmp_path: Path) -> None:
    s = make_state(tmp_path, retain_formed=True)
    s.recover()
    seq = 0
    for _ in range(4):  # two steps of two groups
        g = s.admit("a", 0, seq)
        for traj in ("x", "y"):
            ingest(s, tr("a", 0, seq, g.group_id, traj, 0, True))
            seq += 1
    b = s.buffer
    for step in (0, 1):
        assert s.try_form(step)
        first = [b.share(step, r) for r in (0, 1)]
        s.version(step + 1)
    # The learner checkpointed nothing and died after step 1: it resumes at version 0 and asks again.
    s.version(0, resumed=True)
    again = b.share(0, 0)
    assert again is not None and again.prompt_ids.tolist() == b.share(0, 0).prompt_ids.tolist()
    assert b.counts["transitions_trained"] == 8  # trained once each, however often served
    s.version(1, checkpointed=1)
    assert 0 not in b.formed and 1 in b.formed  # released up to the checkpoint only
    assert first[1] is not None


def test_abandon_markers_replay_from_the_log_to_the_same_state(tmp_path: Path) -> None:
    """An actor's retried attempt (its marker alone) and a given-up group (its marker inside a bundle) are logged as
    the transitions they are, and a broker rebuilt from the log drops the same steps for the same reasons."""
    import dataclasses

    from agentstream.wire.messages import ABANDON, ABANDON_GROUP

    def marker(seq: int, gid: int, traj: str, step: int, give_up: bool) -> Transition:
        empty = np.zeros(0, np.int32)
        return dataclasses.replace(
            tr("a", 0, seq, gid, traj, step, False),
            prompt_ids=empty,
            response_ids=empty,
            logprobs=np.zeros(0, np.float32),
            valid=False,
            info={ABANDON: "timeout" if not give_up else "raised", ABANDON_GROUP: give_up},
        )

    s = make_state(tmp_path / "wal")
    s.recover()
    g0, g1 = s.admit("a", 0, 0).group_id, s.admit("a", 0, 1).group_id
    ingest(s, tr("a", 0, 0, g0, "t0", 0, False))
    ingest(s, marker(1, g0, "t0", 1, give_up=False))
    ingest(s, tr("a", 0, 2, g0, "t0.r1", 0, True))
    ingest(s, tr("a", 0, 3, g0, "t1", 0, True))  # group 0 complete: t0.r1 and t1
    ingest_bundle(s, [tr("a", 0, 4, g1, "u0", 0, False), marker(5, g1, "u0", 1, give_up=True)])
    s.wal.flush()
    expected = s.snapshot()
    again = make_state(tmp_path / "wal")
    again.recover()
    assert again.snapshot() == expected
    b = again.buffer
    assert b.dropped() == {"infra_timeout": 2, "infra_raised": 2} and b.counts["groups_dropped_infra_raised"] == 1
    assert [sorted(g.trajectories) for g in b.ready] == [["t0.r1", "t1"]] and not b.open
    accounting(again)
