"""The broker's durable state: the replay buffer plus delivery bookkeeping, changed only by logged events.

Every change goes through one method here, which applies it and appends it to the write-ahead log
(`broker.wal`); a restarted broker rebuilds the same state by loading the last snapshot and applying the
logged events again through the same methods. The server flushes the log before it sends anything that
depends on a change (an Ack, a GroupGrant, a Batch), so whatever a client was told survives a kill -9.

Delivery (at-least-once, de-duplicated here): a keyed transition (actor, incarnation, seq) is taken only in
order, seq == last taken + 1; an older seq is a duplicate (dropped, counted, acknowledged again); a newer
one is a gap (not taken: the actor resends from the last acknowledged). A message from a newer
incarnation of an actor means the old one died: its unfinished groups are settled by the buffer's rule.
Group requests are idempotent: a resent (actor, incarnation, request) gets the grant it got before.

Events: admit, transition, transitions (a Transitions message: what its transitions did is derived again on
replay, so nothing inside it is logged separately), incarnation, drop_owner, version, resume, form, served,
count. Accounting, at every moment:
transitions_acked == transitions_ingested + transitions_rejected_*, and
transitions_ingested == transitions_trained + buffered + transitions_dropped_*.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agentstream.registry import unknown_name
from agentstream.wire.messages import Batch, GroupGrant, Transition, Transitions, decode, encode
from broker.buffer import RejectedTransition, ReplayBuffer
from broker.wal import WriteAheadLog, iter_records

log = logging.getLogger("broker.state")
MAX_GRANTS_KEPT = 4096  # per actor: resent requests older than this many are answered with a new group


@dataclass
class Ingested:
    """What became of one transition: `ack` is the seq to acknowledge now (None: nothing to acknowledge)."""

    outcome: str  # taken | completed | rejected | duplicate | gap | stale_incarnation
    ack: int | None = None
    detail: str = ""


def _frames(t: Transition) -> list[bytes]:
    return [bytes(f) for f in encode(t)]


def _transition(frames: list[bytes]) -> Transition:
    msg = decode(frames)
    assert isinstance(msg, Transition)
    return msg


def _bundle(frames: list[bytes]) -> list[Transition]:
    msg = decode(frames)
    assert isinstance(msg, Transitions)
    return msg.split()


def logged_transitions(wal_folder: Path) -> Iterator[Transition]:
    """Every transition the broker's log holds as an event (since its last compaction), in log order."""
    for _, kind, body in iter_records(wal_folder):
        if kind == "transition":
            yield _transition(body)
        elif kind == "transitions":
            yield from _bundle(body)


class BrokerState:
    """Buffer + who-sent-what; `wal=None` keeps everything in memory (tests of pure logic)."""

    def __init__(self, buffer: ReplayBuffer, wal: WriteAheadLog | None = None, compact_every: int = 50_000):
        self.buffer = buffer
        self.wal = wal
        self.compact_every = compact_every
        self.delivery: dict[str, list[int]] = {}  # actor -> [incarnation, highest seq taken]
        self.grants: dict[str, list[Any]] = {}  # actor -> [incarnation, {request: [gid, seed, min_version]}]
        self._replaying = False
        self._inside = False  # applying a logged Transitions message: the events inside it are not logged
        self._since_compaction = 0
        self.recovered_events = 0
        self.recovered_snapshot = False

    # ------------------------------------------------------------------ durability
    def _log(self, kind: str, body: Any) -> None:
        if self.wal is not None and not self._replaying and not self._inside:
            if kind in ("transition", "transitions"):  # a message's frames, as received
                self.wal.append_frames(kind, body)
            else:
                self.wal.append(kind, body)
            self._since_compaction += 1

    def recover(self) -> None:
        """Rebuild from the log (snapshot + events); a fresh folder leaves the state empty."""
        if self.wal is None:
            return
        snapshot, events = self.wal.recover()
        self._replaying = True
        try:
            if snapshot is not None:
                self.buffer.load_state(snapshot["buffer"], _transition)
                self.delivery = {k: list(v) for k, v in snapshot["delivery"].items()}
                self.grants = {k: [v[0], {int(r): g for r, g in v[1].items()}] for k, v in snapshot["grants"].items()}
            for kind, body in events:
                self.apply(kind, body)
        finally:
            self._replaying = False
        self.recovered_events = len(events)
        self.recovered_snapshot = snapshot is not None
        if snapshot is not None or events:
            log.info(
                "recovered %d events after %s snapshot: %d transitions buffered, %d retained, step %d",
                len(events),
                "a" if snapshot is not None else "no",
                self.buffer.buffered(),
                self.buffer.retained(),
                self.buffer.next_step,
            )

    def apply(self, kind: str, body: Any) -> None:
        """Re-apply one logged event (recovery)."""
        replay = _REPLAY.get(kind)
        if replay is None:  # `lookup`'s message, a RuntimeError still: a log from a newer broker, not a typo
            raise RuntimeError(unknown_name("event in the broker's log", kind, _REPLAY))
        replay(self, body)

    def snapshot(self) -> dict:
        return {
            "buffer": self.buffer.to_state(_frames),
            "delivery": self.delivery,
            "grants": {k: [v[0], {str(r): g for r, g in v[1].items()}] for k, v in self.grants.items()},
        }

    def maybe_compact(self, force: bool = False) -> bool:
        """Replace the log by a snapshot once enough events piled up (or `force`: after a checkpoint)."""
        if self.wal is None or not (force or self._since_compaction >= self.compact_every):
            return False
        try:
            self.wal.compact(self.snapshot())
        except OSError as exc:  # a full disk: the old segments stand; tried again after compact_every more events
            log.error("compacting the write-ahead log failed (%s); it goes on growing until a compaction succeeds", exc)
            return False
        finally:
            self._since_compaction = 0
        return True

    # ------------------------------------------------------------------ events
    def new_incarnation(self, actor: str, incarnation: int) -> int:
        """`actor` is back as `incarnation`: the old one's unfinished groups are settled. Returns how many."""
        self._log("incarnation", [actor, incarnation])
        self.delivery[actor] = [incarnation, -1]
        self.grants[actor] = [incarnation, {}]
        return self.buffer.drop_owner(actor, "actor_died")

    def observe(self, actor: str, incarnation: int) -> str:
        """'current', 'new' (settled the old incarnation) or 'stale' (a message of a dead incarnation)."""
        known = self.delivery.get(actor)
        if known is None:
            # Not logged: replaying the event that brought this message here (admit, transition) does it again.
            self.delivery[actor] = [incarnation, -1]
            self.grants.setdefault(actor, [incarnation, {}])
            return "current"
        if incarnation < known[0]:
            return "stale"
        if incarnation > known[0]:
            dropped = self.new_incarnation(actor, incarnation)
            log.warning(
                "%s is back as incarnation %d: settled %d unfinished groups of the previous one",
                actor,
                incarnation,
                dropped,
            )
            return "new"
        return "current"

    def admit(self, owner: str, incarnation: int = 0, request: int = -1, groups: int = 1) -> GroupGrant | None:
        """A group for `owner` (`groups`: that many at once, `ReplayBuffer.admit`); a resent request gets its earlier
        grant back (and changes nothing); a request of a replaced incarnation gets None."""
        if self.observe(owner, incarnation) == "stale":
            return None
        grants = self.grants.get(owner)
        if request >= 0 and grants is not None and grants[0] == incarnation and request in grants[1]:
            gid, seed, min_version = grants[1][request]
            return GroupGrant(group_id=gid, seed=seed, min_version=min_version, request=request)
        self._log("admit", [owner, incarnation, request, groups])
        gid, seed, min_version = self.buffer.admit(owner=owner, groups=groups)
        if request >= 0:
            kept = self.grants.setdefault(owner, [incarnation, {}])[1]
            kept[request] = [gid, seed, min_version]
            if len(kept) > MAX_GRANTS_KEPT:  # the oldest: requests are numbered upwards and kept in that order
                del kept[next(iter(kept))]
        return GroupGrant(group_id=gid, seed=seed, min_version=min_version, request=request)

    def ingest(self, t: Transition, frames: list[bytes] | None) -> Ingested:
        """Take one transition (in order, once), or say why not. `frames`: its encoding, for the log (None
        when there is no log)."""
        if t.seq >= 0:
            state = self.observe(t.actor, t.incarnation)
            if state == "stale":
                self.count("messages_stale_incarnation")  # never taken: not ingested, not acknowledged
                return Ingested("stale_incarnation", detail=f"{t.actor} incarnation {t.incarnation} was replaced")
            upto = self.delivery[t.actor][1]
            if t.seq <= upto:
                self.count("transitions_duplicate")
                return Ingested("duplicate", ack=upto)
            if t.seq > upto + 1:
                self.count("transitions_out_of_order")
                return Ingested("gap", detail=f"seq {t.seq} after {upto}: waiting for {upto + 1}")
        self._log("transition", frames)
        return self._take(t)

    def _take(self, t: Transition) -> Ingested:
        """Take `t`, whose key (if any) is the next expected of its actor's current incarnation."""
        if t.seq >= 0:
            self.delivery[t.actor][1] = t.seq
            self.buffer.counts["transitions_acked"] += 1
        try:
            completed = self.buffer.add(t)
        except RejectedTransition as exc:
            self.buffer.counts[f"transitions_rejected_{exc.reason}"] += 1
            self.buffer.settle([t], f"rejected:{exc.reason}")  # acknowledged, so accounted for per key too
            return Ingested("rejected", ack=t.seq if t.seq >= 0 else None, detail=f"{exc.reason}: {exc}")
        return Ingested("completed" if completed else "taken", ack=t.seq if t.seq >= 0 else None)

    def ingest_many(self, ts: list[Transition], frames: list[bytes] | None) -> list[Ingested]:
        """`ingest` each of a Transitions message's transitions, in order; `frames`: the message's encoding,
        logged once (replaying it takes the same decisions again, from the same state)."""
        self._log("transitions", frames)
        if ts:  # the usual bundle (the next keys in order, of a current incarnation) needs no per-key checks
            known = self.delivery.get(ts[0].actor)
            if (
                known is not None
                and known[0] == ts[0].incarnation
                and all(t.seq == known[1] + 1 + i for i, t in enumerate(ts))
            ):
                return [self._take(t) for t in ts]
        self._inside = True
        try:
            return [self.ingest(t, None) for t in ts]
        finally:
            self._inside = False

    def count(self, name: str) -> None:
        """A message that changed nothing but is counted (logged too, so that the counts survive a restart)."""
        self._log("count", name)
        self.buffer.counts[name] += 1

    def drop_owner(self, owner: str, reason: str) -> int:
        self._log("drop_owner", [owner, reason])
        return self.buffer.drop_owner(owner, reason)

    def version(self, version: int, resumed: bool = False, checkpointed: int = -1) -> bool:
        """The learner's version (a resumed learner may go back); True when a checkpoint released batches."""
        self._log("version", [version, resumed, checkpointed])
        b = self.buffer
        if resumed:
            b.resume_at(version)
        else:
            b.learner_version = max(b.learner_version, version)
        return checkpointed >= 0 and b.release_before(checkpointed) > 0

    def resume(self, step: int) -> None:
        """A learner asks for batch `step` of a broker that formed nothing yet (it resumed a checkpoint)."""
        self._log("resume", step)
        self.buffer.resume_at(step)

    def try_form(self, step: int) -> bool:
        """Form batch `step` if enough groups are complete. Logged whenever it changed anything: forming also
        drops groups that became too stale (and lets go of reusable ones), even when it forms nothing."""
        counts = self.buffer.counts
        before = counts["groups_dropped_stale"], counts["groups_retired_stale"]
        formed = self.buffer.try_form(step)
        if formed or (counts["groups_dropped_stale"], counts["groups_retired_stale"]) != before:
            self._log("form", step)
        return formed

    def share(self, step: int, rank: int) -> Batch | None:
        """Rank `rank`'s share of formed batch `step` (None: not formed). Raises ValueError (see the buffer)."""
        batch = self.buffer.share(step, rank)
        if batch is not None:
            self._log("served", [step, rank])
        return batch

    # ------------------------------------------------------------------ not logged
    # Engine versions and refused messages change no delivery state: engines report their version again every
    # few seconds, so a restarted broker learns it anew, and a refused message was never taken.
    def engine_serving(self, engine: str, version: int) -> None:
        """Admission may rely on `engine`, which serves `version`."""
        self.buffer.engine_versions[engine] = version

    def engine_gone(self, engine: str) -> None:
        """Admission stops waiting for `engine` (silent, or back at an older version)."""
        self.buffer.engine_versions.pop(engine, None)

    def count_refused(self) -> None:
        """A message the broker refused (malformed, over a limit, or a transition the buffer rejected)."""
        self.buffer.counts["malformed_messages"] += 1

    def audit(self) -> dict[str, Any]:
        """The delivery accounting (summary.json `reliability`): every acknowledged transition is trained,
        dropped with a reason, rejected with a reason, or still buffered; with broker.track_keys, per key."""
        b, c = self.buffer, self.buffer.counts
        out: dict[str, Any] = {
            "transitions_acked": c["transitions_acked"],
            "transitions_duplicate": c["transitions_duplicate"],
            "transitions_out_of_order": c["transitions_out_of_order"],
            "transitions_rejected": {
                k.removeprefix("transitions_rejected_"): v
                for k, v in c.items()
                if k.startswith("transitions_rejected_")
            },
            "transitions_retained": b.retained(),
            "wal_events_recovered": self.recovered_events,
            "wal_snapshot_recovered": self.recovered_snapshot,
            "wal_torn_bytes": self.wal.torn_bytes if self.wal is not None else 0,
            "wal_bytes": self.wal.size_bytes() if self.wal is not None else 0,
            "wal_write_errors": self.wal.write_errors if self.wal is not None else 0,  # a full disk: see wal.py
        }
        if b.fates is not None:
            held = {
                f"{t.actor}/{t.incarnation}/{t.seq}"
                for g in [*b.open.values(), *b.ready]
                for steps in g.trajectories.values()
                for t in steps
                if t.seq >= 0
            }
            fates = [f.split(":", 1)[0] for f in b.fates.values()]
            out["keys"] = {
                "tracked": len(b.fates) + len(held - b.fates.keys()),
                "trained": fates.count("trained"),
                "dropped": fates.count("dropped"),
                "rejected": fates.count("rejected"),
                "buffered": len(held - b.fates.keys()),
                "settled_twice": c["keys_settled_twice"],
                "trained_by_actor": dict(
                    Counter(k.split("/", 1)[0] for k, f in b.fates.items() if f.startswith("trained"))
                ),
            }
        return out


_REPLAY: dict[str, Callable[[BrokerState, Any], Any]] = {
    "admit": lambda s, body: s.admit(*body),
    "transition": lambda s, body: s.ingest(_transition(body), body),
    "transitions": lambda s, body: s.ingest_many(_bundle(body), body),
    "incarnation": lambda s, body: s.new_incarnation(*body),
    "drop_owner": lambda s, body: s.drop_owner(*body),
    "version": lambda s, body: s.version(*body),
    "resume": lambda s, body: s.resume(body),
    "form": lambda s, body: s.try_form(body),
    "count": lambda s, body: s.count(body),
    "served": lambda s, body: s.share(*body),
}
"""Each logged event's kind -> the method that made it, called again with the logged arguments."""
