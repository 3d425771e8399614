"""Trajectory and group assembly, staleness-bounded admission, and batch formation: the broker's logic.

Pure bookkeeping, no sockets: `broker.server` feeds it messages and sends what it returns. Invariant, at
every moment:  ingested == trained + buffered + dropped  (each in transitions).

Admission (the rule AReaL uses): the j-th live group admitted (0-based) is meant for global
step j // groups_per_step; it may start only while that step is within `max_staleness` of the learner's
version, i.e.  live_admitted < (version + max_staleness + 1) * groups_per_step, and only once every engine
serves at least version  step - max_staleness, so its tokens cannot be staler than the bound when trained.
With max_staleness = 0 this is synchronous training: generate a step's groups, train, repeat.
"""

from __future__ import annotations

import re
from collections import Counter, deque
from dataclasses import dataclass, field

import numpy as np

from agentstream.wire.messages import ABANDON, ABANDON_GROUP, Batch, Transition, image_columns, token_rewards_column

_CAUSE = re.compile(r"[a-z_]{1,32}")  # an abandon marker's cause becomes part of a counter's name


class RejectedTransition(ValueError):
    """A transition that cannot belong to any admitted group; the text says why."""

    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason = reason


@dataclass
class Group:
    """G trajectories started from one seed; complete when all G are done."""

    group_id: int
    seed: int
    owner: str = ""  # the actor that plays it
    trajectories: dict[str, list[Transition]] = field(default_factory=dict)
    finished: set[str] = field(default_factory=set)
    _min_version: int | None = field(default=None, repr=False, compare=False)
    samples: int = 0  # batches it has been in (sample reuse: at most max_samples_per_group)

    @property
    def transitions(self) -> int:
        return sum(len(steps) for steps in self.trajectories.values())

    @property
    def tokens(self) -> int:
        return sum(len(t.prompt_ids) + len(t.response_ids) for steps in self.trajectories.values() for t in steps)

    def returns(self) -> list[float]:
        """Each trajectory's return (sum of its step rewards)."""
        return [sum(t.reward for t in steps) for steps in self.trajectories.values()]

    def zero_variance(self) -> bool:
        """All G returns equal: group-normalised advantages are all zero (DAPO drops such groups)."""
        returns = self.returns()
        return max(returns) - min(returns) <= 1e-9

    def min_version(self) -> int:
        """The oldest policy version in the group. Asked of ready groups only, which take no more transitions:
        cached (every batch formation asks it of every ready group, bench/broker.py)."""
        if self._min_version is None:
            self._min_version = min(t.version_lo for steps in self.trajectories.values() for t in steps)
        return self._min_version


@dataclass
class FormedStep:
    """A formed global batch: the learner version it was formed at and each rank's groups."""

    version: int
    shares: list[list[Group]]
    served: set[int] = field(default_factory=set)


def partition_by_tokens(groups: list[Group], world_size: int) -> list[list[Group]]:
    """Whole groups -> `world_size` shares with balanced token counts (longest-first greedy).

    With at least `world_size` groups every share gets one: the first `world_size` groups (the largest)
    each land on a different, still-empty share.
    """
    shares: list[list[Group]] = [[] for _ in range(world_size)]
    loads = [0] * world_size
    sized = sorted(((g.tokens, i) for i, g in enumerate(groups)), key=lambda x: x[0], reverse=True)  # counted once
    for tokens, i in sized:
        r = min(range(world_size), key=lambda k: (loads[k], len(shares[k])))
        shares[r].append(groups[i])
        loads[r] += tokens
    return shares


def _step_of(t: Transition) -> int:
    return t.step


def build_batch(step: int, rank: int, learner_version: int, group_size: int, groups: list[Group]) -> Batch:
    """One rank's share as a columnar Batch (trajectories and steps in order), each transition's images with it."""
    group_index: list[int] = []
    traj_index: list[int] = []
    ts: list[Transition] = []
    traj = 0
    for gi, group in enumerate(groups):
        for traj_id in sorted(group.trajectories):
            steps = sorted(group.trajectories[traj_id], key=_step_of)
            traj_index += [traj] * len(steps)
            group_index += [gi] * len(steps)
            ts += steps
            traj += 1
    # Measured by bench/broker.py: one row tuple per transition, transposed once; token arrays concatenated
    # straight into their dtype (they arrive as int32/float32: no second copy)
    rows = [
        (
            t.step,
            t.prompt_ids.size,
            t.response_ids.size,
            t.reward,
            t.done or t.truncated,
            t.valid,
            t.version_lo,
            t.version_hi,
        )
        for t in ts
    ]
    cols = list(zip(*rows)) if rows else [()] * 8

    def cat(arrays: list[np.ndarray], dtype: str) -> np.ndarray:
        return np.concatenate(arrays, dtype=dtype, casting="same_kind") if arrays else np.zeros(0, dtype)

    image_shapes, image_data = image_columns(ts)
    return Batch(
        step=step,
        rank=rank,
        learner_version=learner_version,
        group_size=group_size,
        group_index=np.array(group_index, np.int32),
        traj_index=np.array(traj_index, np.int32),
        step_index=np.array(cols[0], np.int32),
        prompt_lens=np.array(cols[1], np.int32),
        response_lens=np.array(cols[2], np.int32),
        rewards=np.array(cols[3], np.float32),
        dones=np.array(cols[4], bool),
        valid=np.array(cols[5], bool),
        version_lo=np.array(cols[6], np.int32),
        version_hi=np.array(cols[7], np.int32),
        prompt_ids=cat([t.prompt_ids for t in ts], "int32"),
        response_ids=cat([t.response_ids for t in ts], "int32"),
        logprobs=cat([t.logprobs for t in ts], "float32"),
        anchors=[t.anchor for t in ts],
        token_rewards=token_rewards_column(ts),
        image_shapes=image_shapes,
        image_data=image_data,
    )


class ReplayBuffer:
    """Groups in assembly, complete groups, formed batches, and the counts that account for all of them."""

    def __init__(
        self,
        group_size: int,
        groups_per_step: int,
        world_size: int,
        max_staleness: int,
        max_buffered_transitions: int,
        seed_base: int = 0,
        drop_zero_variance: bool = False,
        retain_formed: bool = False,
        partial_groups: str = "drop",
        min_partial: int = 2,
        track_keys: bool = False,
        max_samples_per_group: int = 1,
        samples_per_insert: float = 0.0,
    ):
        self.group_size = group_size
        self.groups_per_step = groups_per_step
        self.world_size = world_size
        self.max_staleness = max_staleness
        self.max_buffered = max_buffered_transitions
        self.seed_base = seed_base
        self.drop_zero_variance = drop_zero_variance  # DAPO dynamic sampling
        # Keep formed batches until the learner checkpoints past them, so that a learner resuming from its
        # checkpoint is served exactly the groups it lost (none trained twice in the surviving lineage).
        self.retain_formed = retain_formed
        self.partial_groups = partial_groups  # a dead actor's group: "drop" it, or "serve" its finished part
        self.min_partial = min_partial
        # Sample reuse, as DeepMind's Reverb: a trained group may be trained again (max_samples_per_group
        # times in all) while no staler than the bound, and while samples <= samples_per_insert x inserts
        # (0: no ratio limit). Fresh groups always come first; with the default 1 nothing is reused.
        self.max_samples = max_samples_per_group
        self.samples_per_insert = samples_per_insert
        self.reuse: deque[Group] = deque()  # trained groups that may be sampled again, newest last
        # key -> "trained:<step>" | "dropped:<why>" | "rejected:<why>"
        self.fates: dict[str, str] | None = {} if track_keys else None
        self.learner_version = 0
        self.engine_versions: dict[str, int] = {}
        self.open: dict[int, Group] = {}  # admitted, not complete
        self.ready: deque[Group] = deque()  # complete, not yet in a batch
        self.formed: dict[int, FormedStep] = {}  # step -> its groups per rank (kept while retained or unserved)
        self.next_step = 0  # the next global batch to form
        self.next_group_id = 0
        self.live_admitted = 0  # admitted groups not dropped
        self.counts: Counter[str] = Counter()  # transitions_{ingested,trained,dropped_<reason>}, groups_*
        self.staleness_hist: Counter[int] = Counter()
        self.trained_group_shapes: Counter[str] = Counter()  # "trajectories/finished" of every trained group
        self.last_staleness: list[int] = []
        self.dropped_total = 0  # sum of counts["transitions_dropped_*"] (admission asks it per request)

    # ------------------------------------------------------------------ admission
    def admissible(self) -> bool:
        """Whether one more group may start now (staleness bound, engine versions, memory bound)."""
        step = self.live_admitted // self.groups_per_step
        if step > self.learner_version + self.max_staleness:
            return False
        held = (
            self.counts["transitions_ingested"]
            - self.counts["transitions_trained"]
            - self.dropped_total
            + self.reused_held()
        )
        if held >= self.max_buffered:
            return False
        need = max(0, step - self.max_staleness)
        if not self.engine_versions:
            return need == 0
        return min(self.engine_versions.values()) >= need  # an engine at -1 (weights unknown) waits for v0

    def admit(self, owner: str = "", groups: int = 1) -> tuple[int, int, int]:
        """Admit one group for actor `owner`: (group_id, seed, min_version its tokens may come from).

        `groups` > 1 (self-play: a group per seat, each seat's G trajectories compared among themselves) opens
        groups group_id .. group_id + groups - 1 at once, all from the first one's seed, when the first is
        admissible: admitting them one by one could deadlock, an actor holding the first while the learner waits
        for it to complete. The others may fall in the next step, past the bound (a pair does when groups_per_step
        is odd, or after one group of a pair was dropped alone); their tokens carry the first's min_version, which
        every engine serves, and `try_form` checks the bound again (dropped as stale if trained too late)."""
        step = self.live_admitted // self.groups_per_step
        gid = self.next_group_id
        self.next_group_id += groups
        self.live_admitted += groups
        for g in range(gid, gid + groups):
            self.open[g] = Group(g, self.seed_base + gid, owner)
        self.counts["groups_admitted"] += groups
        return gid, self.seed_base + gid, max(0, step - self.max_staleness)

    def drop_owner(self, owner: str, reason: str = "actor_died") -> int:
        """Settle every unfinished group of `owner` (an actor that died, went silent, or left): by the
        `partial_groups` rule its finished trajectories are served as a smaller group ("serve", when at least
        `min_partial` finished) or the group is dropped; unfinished trajectories are never trained as if
        complete. Everything dropped is counted under `reason`. Returns the groups settled."""
        gone = [g for g in self.open.values() if g.owner == owner]
        for group in gone:
            del self.open[group.group_id]
            if self.partial_groups == "serve" and len(group.finished) >= self.min_partial:
                for traj_id in [t for t in group.trajectories if t not in group.finished]:
                    steps = group.trajectories.pop(traj_id)
                    self._count_drop(steps, reason)
                self.counts["groups_served_partial"] += 1
                self.ready.append(group)
            else:
                self._drop(group, reason)
        return len(gone)

    # ------------------------------------------------------------------ ingestion
    def add(self, t: Transition) -> bool:
        """Ingest one transition; True when it completed its group. Raises RejectedTransition."""
        group = self.open.get(t.group_id)
        if group is None:
            raise RejectedTransition("unknown_group", f"group {t.group_id} was not admitted or is already complete")
        if t.info and ABANDON in t.info:
            self._abandon(group, t)
            return False
        steps = group.trajectories.get(t.traj_id)
        if steps is None:
            if len(group.trajectories) >= self.group_size:
                raise RejectedTransition(
                    "group_overflow", f"group {t.group_id} already has {self.group_size} trajectories"
                )
            steps = group.trajectories[t.traj_id] = []
        if t.traj_id in group.finished:
            raise RejectedTransition("after_done", f"trajectory {t.traj_id} already ended")
        if any(s.step == t.step for s in steps):
            raise RejectedTransition("duplicate", f"trajectory {t.traj_id} step {t.step} arrived twice")
        steps.append(t)
        self.counts["transitions_ingested"] += 1
        if t.done or t.truncated:
            group.finished.add(t.traj_id)
        if len(group.finished) == self.group_size:
            del self.open[t.group_id]
            self.counts["groups_completed"] += 1
            if self.drop_zero_variance and group.zero_variance():
                self._drop(group, "zero_variance")  # no signal: its slot is freed, admission refills it
                return False
            self.ready.append(group)
            self.counts["groups_inserted"] += 1  # (sample reuse: the ratio's denominator)
            return True
        return False

    def _abandon(self, group: Group, marker: Transition) -> None:
        """An abandon marker (agentstream.wire.messages.ABANDON): the actor's attempt at `marker.traj_id` failed
        (an env step timed out or raised, its engines failed). Its steps are dropped as `infra_<cause>`, the marker
        with them (ingested, so that acked = ingested + rejected holds), and its place in the group is free for the
        retry, which comes under a new traj_id; with ABANDON_GROUP the actor gave up and the whole group goes."""
        cause = marker.info[ABANDON]
        if not isinstance(cause, str) or not _CAUSE.fullmatch(cause):
            raise RejectedTransition("bad_abandon", f"abandon cause {str(cause)[:40]!r} is not 1-32 of [a-z_]")
        if marker.traj_id in group.finished:
            raise RejectedTransition("after_done", f"trajectory {marker.traj_id} already ended")
        reason = f"infra_{cause}"
        self.counts["transitions_ingested"] += 1
        self._count_drop([*group.trajectories.pop(marker.traj_id, []), marker], reason)
        if marker.info.get(ABANDON_GROUP):
            del self.open[group.group_id]
            self._drop(group, reason)
        else:
            self.counts["trajectories_retried"] += 1

    # ------------------------------------------------------------------ serving
    def try_form(self, step: int) -> bool:
        """Form global batch `step` (the next one) from complete groups; False while too few are ready."""
        if step != self.next_step:
            return False
        version = max(self.learner_version, step)  # the learner's version while it trains step k is k
        self._drop_stale(version)
        fresh = min(len(self.ready), self.groups_per_step)
        again = self.groups_per_step - fresh
        if again and (again > len(self.reuse) or not self._may_sample(again)):
            return False
        groups = [self.ready.popleft() for _ in range(fresh)] + [self.reuse.pop() for _ in range(again)]  # newest
        self.formed[step] = FormedStep(version, partition_by_tokens(groups, self.world_size))
        self.next_step = step + 1
        self.last_staleness = []
        for group in groups:
            first = group.samples == 0
            group.samples += 1
            self.counts["groups_sampled"] += 1
            self.counts["groups_trained" if first else "groups_reused"] += 1
            if first:
                self.trained_group_shapes[f"{len(group.trajectories)}/{len(group.finished)}"] += 1
            for steps in group.trajectories.values():
                self.counts["transitions_trained" if first else "transitions_reused"] += len(steps)
                lags = [version - t.version_lo for t in steps]
                self.staleness_hist.update(lags)
                self.last_staleness += lags
                if first:
                    self.settle(steps, f"trained:{step}")
            if group.samples < self.max_samples:
                self.reuse.append(group)
        return True

    def _may_sample(self, again: int) -> bool:
        """Reverb's rate limit: `again` more reused samples keep samples <= samples_per_insert x inserts."""
        if self.samples_per_insert <= 0:
            return True
        samples = self.counts["groups_sampled"] + self.groups_per_step
        return samples <= self.samples_per_insert * self.counts["groups_inserted"]

    def reused_held(self) -> int:
        """Transitions held only for reuse (already trained once)."""
        return sum(g.transitions for g in self.reuse) if self.reuse else 0

    def share(self, step: int, rank: int) -> Batch | None:
        """Rank `rank`'s share of global batch `step` once formed (see `try_form`), else None. A retained step
        is served again on request (a learner resuming from a checkpoint asks for it a second time)."""
        formed = self.formed.get(step)
        if formed is None:
            if step < self.next_step:
                raise ValueError(
                    f"batch {step} was already served and released (the broker is at step "
                    f"{self.next_step}); a learner that resumes must resume from its latest checkpoint"
                )
            return None
        if rank in formed.served and not self.retain_formed:
            raise ValueError(f"rank {rank} already received step {step}")
        formed.served.add(rank)
        batch = build_batch(step, rank, formed.version, self.group_size, formed.shares[rank])
        if not self.retain_formed and len(formed.served) == self.world_size:
            del self.formed[step]
        return batch

    def release_before(self, step: int) -> int:
        """The learner checkpointed version `step`: forget retained batches before it. Returns how many."""
        old = [s for s in self.formed if s < step and len(self.formed[s].served) == self.world_size]
        for s in old:
            del self.formed[s]
        return len(old)

    def resume_at(self, step: int) -> None:
        """A learner resumed at version `step` (from a checkpoint): batches start there, and admission counts
        as if the groups of the steps before it had been admitted and trained."""
        if step in self.formed or (step < self.next_step):
            self.learner_version = step  # a retained batch is served again; the version goes back with the learner
            return
        self.next_step = step
        self.learner_version = max(self.learner_version, step)
        self.live_admitted = max(self.live_admitted, step * self.groups_per_step)

    def _drop_stale(self, version: int) -> None:
        if version <= self.max_staleness:
            return  # (versions are >= 0: no group can lag more than the bound yet)
        if self.reuse:  # trained already: too stale to train again, it is let go (nothing to account as dropped)
            kept = deque(g for g in self.reuse if version - g.min_version() <= self.max_staleness)
            self.counts["groups_retired_stale"] += len(self.reuse) - len(kept)
            self.reuse = kept
        keep: deque[Group] = deque()
        for group in self.ready:
            if version - group.min_version() > self.max_staleness:
                self._drop(group, "stale")
            else:
                keep.append(group)
        self.ready = keep

    def _drop(self, group: Group, reason: str) -> None:
        for steps in group.trajectories.values():
            self._count_drop(steps, reason)
        self.counts[f"groups_dropped_{reason}"] += 1
        self.live_admitted -= 1  # a dropped group frees its admission slot

    def _count_drop(self, steps: list[Transition], reason: str) -> None:
        self.counts[f"transitions_dropped_{reason}"] += len(steps)
        self.dropped_total += len(steps)
        self.settle(steps, f"dropped:{reason}")

    def settle(self, steps: list[Transition], fate: str) -> None:
        """Record the fate of these keyed transitions (with track_keys): trained, dropped or rejected."""
        if self.fates is None:
            return
        for t in steps:
            if t.seq < 0:
                continue
            key = f"{t.actor}/{t.incarnation}/{t.seq}"
            if self.fates.get(key, "").startswith("trained"):
                self.counts["keys_settled_twice"] += 1
            self.fates[key] = fate

    # ------------------------------------------------------------------ accounting
    def buffered(self) -> int:
        """Transitions held: groups in assembly and complete groups not yet in a batch."""
        held = sum(g.transitions for g in self.open.values()) + sum(g.transitions for g in self.ready)
        return held

    def retained(self) -> int:
        """Transitions of formed (trained) batches kept for a learner that may resume."""
        return sum(g.transitions for f in self.formed.values() for share in f.shares for g in share)

    def dropped(self) -> dict[str, int]:
        return {
            k.removeprefix("transitions_dropped_"): v
            for k, v in self.counts.items()
            if k.startswith("transitions_dropped_")
        }

    # ------------------------------------------------------------------ durability (broker.state snapshots)
    def to_state(self, encode_transition) -> dict:  # noqa: ANN001
        """Everything needed to rebuild this buffer, as msgpack-able values; transitions as their frames."""

        def group(g: Group) -> dict:
            return {
                "id": g.group_id,
                "seed": g.seed,
                "owner": g.owner,
                "samples": g.samples,
                "steps": [encode_transition(t) for steps in g.trajectories.values() for t in steps],
            }

        return {
            "counts": dict(self.counts),
            "staleness_hist": dict(self.staleness_hist),
            "shapes": dict(self.trained_group_shapes),
            "learner_version": self.learner_version,
            "next_step": self.next_step,
            "next_group_id": self.next_group_id,
            "live_admitted": self.live_admitted,
            "open": [group(g) for g in self.open.values()],
            "ready": [group(g) for g in self.ready],
            "formed": [
                [s, f.version, sorted(f.served), [[group(g) for g in share] for share in f.shares]]
                for s, f in self.formed.items()
            ],
            "reuse": [group(g) for g in self.reuse],
            "fates": self.fates,
        }

    def load_state(self, state: dict, decode_transition) -> None:  # noqa: ANN001
        """Inverse of `to_state` (into a freshly made buffer of the same configuration)."""

        def group(d: dict) -> Group:
            g = Group(d["id"], d["seed"], d["owner"], samples=d.get("samples", 0))
            for frames in d["steps"]:
                t = decode_transition(frames)
                g.trajectories.setdefault(t.traj_id, []).append(t)
                if t.done or t.truncated:
                    g.finished.add(t.traj_id)
            return g

        self.counts = Counter(state["counts"])
        self.dropped_total = sum(self.dropped().values())
        self.staleness_hist = Counter({int(k): v for k, v in state["staleness_hist"].items()})
        self.trained_group_shapes = Counter(state["shapes"])
        self.learner_version, self.next_step = state["learner_version"], state["next_step"]
        self.next_group_id, self.live_admitted = state["next_group_id"], state["live_admitted"]
        self.open = {d["id"]: group(d) for d in state["open"]}
        self.ready = deque(group(d) for d in state["ready"])
        self.formed = {
            s: FormedStep(v, [[group(d) for d in share] for share in shares], set(served))
            for s, v, served, shares in state["formed"]
        }
        self.reuse = deque(group(d) for d in state.get("reuse", []))
        if self.fates is not None and state.get("fates") is not None:
            self.fates = dict(state["fates"])
