"""Group assembly, admission under the staleness bound, batch formation and the accounting invariant."""

import dataclasses
import random

import numpy as np
import pytest

from agentstream.wire.messages import Transition
from broker.buffer import RejectedTransition, ReplayBuffer, partition_by_tokens


def tr(
    group_id: int,
    traj: str,
    step: int,
    done: bool = False,
    lo: int = 0,
    n_prompt: int = 3,
    n_resp: int = 2,
    reward: float = 0.0,
) -> Transition:
    return Transition(
        traj_id=traj,
        group_id=group_id,
        actor="a",
        step=step,
        prompt_ids=np.arange(n_prompt, dtype=np.int32),
        response_ids=np.arange(n_resp, dtype=np.int32) + 100,
        logprobs=np.full(n_resp, -1.0, dtype=np.float32),
        version_lo=lo,
        version_hi=lo,
        reward=reward,
        done=done,
        truncated=False,
        valid=True,
    )


def serve(b: ReplayBuffer, step: int, rank: int):
    """What the broker does for a BatchRequest: form the step if it can, then hand out the rank's share."""
    b.try_form(step)
    return b.share(step, rank)


def invariant(b: ReplayBuffer) -> None:
    assert b.counts["transitions_ingested"] == b.counts["transitions_trained"] + b.buffered() + sum(
        b.dropped().values()
    )


def test_group_completes_only_when_all_g_trajectories_are_done() -> None:
    b = ReplayBuffer(group_size=2, groups_per_step=1, world_size=1, max_staleness=0, max_buffered_transitions=100)
    gid, seed, min_v = b.admit()
    assert (gid, seed, min_v) == (0, 0, 0)
    assert b.add(tr(gid, "t0", 0)) is False
    assert b.add(tr(gid, "t0", 1, done=True)) is False  # one of two trajectories done
    assert b.add(tr(gid, "t1", 0)) is False
    assert b.add(tr(gid, "t1", 1, done=True)) is True  # both done: complete
    assert len(b.ready) == 1 and not b.open
    invariant(b)


@pytest.mark.parametrize(
    "bad, reason",
    [(tr(9, "t0", 0), "unknown_group"), (tr(0, "t0", 0), "duplicate"), (tr(0, "t2", 0), "group_overflow")],
)
def test_transitions_that_fit_no_group_are_rejected(bad, reason) -> None:
    b = ReplayBuffer(group_size=2, groups_per_step=1, world_size=1, max_staleness=0, max_buffered_transitions=100)
    gid, _, _ = b.admit()
    b.add(tr(gid, "t0", 0))
    b.add(tr(gid, "t1", 0))
    with pytest.raises(RejectedTransition) as exc:
        b.add(bad)
    assert exc.value.reason == reason
    invariant(b)


def test_admission_follows_the_staleness_bound() -> None:
    # groups_per_step=2, bound=1: at version 0 groups for steps 0 and 1 may start (4 groups), not a 5th.
    b = ReplayBuffer(group_size=1, groups_per_step=2, world_size=1, max_staleness=1, max_buffered_transitions=100)
    b.engine_versions = {"e": 0}
    grants = []
    while b.admissible():
        grants.append(b.admit())
    assert len(grants) == 4
    # min_version = max(0, step - bound): steps 0,0,1,1 -> 0,0,0,0
    assert [g[2] for g in grants] == [0, 0, 0, 0]
    b.learner_version = 1  # step 2 is now within the bound, but needs every engine at version >= 1
    assert not b.admissible()
    b.engine_versions = {"e": 1}
    assert b.admissible()
    assert b.admit()[2] == 1  # 5th group is for step 2: min_version 2 - 1 = 1


def test_bound_zero_is_synchronous() -> None:
    b = ReplayBuffer(group_size=1, groups_per_step=2, world_size=1, max_staleness=0, max_buffered_transitions=100)
    b.engine_versions = {"e": 0}
    assert b.admit()[2] == 0 and b.admit()[2] == 0
    assert not b.admissible()  # step 1's groups wait for version 1


def test_a_request_for_several_groups_opens_them_at_once_when_the_first_fits() -> None:
    """Self-play's grant: a group per seat, all from the first one's seed. groups_per_step 2, bound 0: a pair is step
    0. After one group of the next pair is dropped alone, one slot of step 1 is free: the next pair is admitted (its
    first fits; waiting for two slots would wait forever, the step short of one group), its second group lies in step
    2, and serving checks the bound again: that group, trained at step 2 on version-1 tokens, is dropped as stale."""
    b = ReplayBuffer(group_size=1, groups_per_step=2, world_size=1, max_staleness=0, max_buffered_transitions=100)
    b.engine_versions = {"e": 0}
    assert b.admit("a", groups=2) == (0, 0, 0)
    assert sorted(b.open) == [0, 1] and (b.open[1].seed, b.open[1].owner) == (0, "a")
    assert b.counts["groups_admitted"] == 2 and not b.admissible()  # step 0 is full
    for gid in (0, 1):
        b.add(tr(gid, f"t{gid}", 0, done=True))
    assert serve(b, 0, 0).group_index.tolist() == [0, 1]
    b.learner_version, b.engine_versions = 1, {"e": 1}
    assert b.admit("a", groups=2) == (2, 2, 1)  # step 1: groups 2 and 3
    b.add(Transition.abandon_marker("u", 3, "a", 0, 1, "raised", whole_group=True))  # group 3 dropped alone
    assert b.admissible() and b.admit("a", groups=2) == (4, 4, 1)  # groups 4 (step 1) and 5 (step 2)
    for gid in (2, 4, 5):
        b.add(tr(gid, f"t{gid}", 0, done=True, lo=1))
    assert serve(b, 1, 0).group_index.tolist() == [0, 1]  # groups 2 and 4
    b.learner_version = 2
    assert serve(b, 2, 0) is None and b.counts["groups_dropped_stale"] == 1 and not b.ready  # group 5: lag 1 > 0
    invariant(b)


def test_shares_are_whole_groups_balanced_by_tokens_and_served_once() -> None:
    b = ReplayBuffer(group_size=2, groups_per_step=4, world_size=2, max_staleness=0, max_buffered_transitions=1000)
    sizes = [10, 1, 7, 4]  # prompt tokens per step: group tokens = 2 trajs * (p + 2)
    for n in sizes:
        gid, _, _ = b.admit()
        for t in ("x", "y"):
            b.add(tr(gid, f"{gid}{t}", 0, done=True, n_prompt=n))
    s0 = serve(b, 0, 0)
    assert serve(b, 1, 0) is None  # step 1 waits for groups; step 0 is untouched

    with pytest.raises(ValueError, match="already received"):
        serve(b, 0, 0)  # a rank gets its share once
    s1 = serve(b, 0, 1)
    # group tokens 24, 6, 18, 12 -> greedy: 24 -> r0, 18 -> r1, 12 -> r1 (30), 6 -> r0 (30)
    assert int(s0.prompt_lens.sum() + s0.response_lens.sum()) == 30
    assert int(s1.prompt_lens.sum() + s1.response_lens.sum()) == 30
    for s in (s0, s1):
        assert len(s.rewards) == 4 and sorted(set(s.group_index.tolist())) == [0, 1]
        assert np.bincount(s.group_index).tolist() == [2, 2]  # every group whole: G=2 trajectories
    assert 0 not in b.formed  # fully served: the batch is gone, and asking again is an error
    with pytest.raises(ValueError, match="already served"):
        serve(b, 0, 0)
    assert b.counts["transitions_trained"] == 8
    invariant(b)


def test_stale_groups_are_dropped_and_counted_at_serving() -> None:
    b = ReplayBuffer(group_size=1, groups_per_step=1, world_size=1, max_staleness=1, max_buffered_transitions=100)
    gid, _, _ = b.admit()
    b.add(tr(gid, "a", 0, done=True, lo=0))
    gid2, _, _ = b.admit()
    b.add(tr(gid2, "b", 0, done=True, lo=2))
    b.learner_version = 2  # group 0 has lag 2 > 1
    share = serve(b, 0, 0)
    assert share is not None and share.version_lo.tolist() == [2]
    assert b.dropped() == {"stale": 1} and b.counts["groups_dropped_stale"] == 1
    invariant(b)


def test_partition_gives_every_rank_a_group_on_random_inputs() -> None:
    from broker.buffer import Group

    rng = random.Random(0)
    for _ in range(200):
        world = rng.randint(1, 4)
        groups = []
        for gid in range(rng.randint(world, 12)):
            g = Group(gid, gid)
            g.trajectories["t"] = [tr(gid, "t", 0, n_prompt=rng.randint(1, 50))]
            groups.append(g)
        shares = partition_by_tokens(groups, world)
        assert all(shares)
        assert sorted(g.group_id for s in shares for g in s) == list(range(len(groups)))
        loads = [sum(g.tokens for g in s) for s in shares]
        assert max(loads) - min(loads) <= max(g.tokens for g in groups)  # greedy bound


def test_random_streams_keep_the_accounting_invariant() -> None:
    rng = random.Random(1)
    b = ReplayBuffer(group_size=3, groups_per_step=2, world_size=2, max_staleness=1, max_buffered_transitions=10**6)
    b.engine_versions = {"e": 0}
    live: dict[int, dict[str, int]] = {}
    step = 0
    for _ in range(3000):
        if b.admissible() and rng.random() < 0.3:
            gid, _, _ = b.admit()
            live[gid] = {f"{gid}.{i}": 0 for i in range(3)}
        elif live:
            gid = rng.choice(list(live))
            traj = rng.choice(list(live[gid]))
            done = rng.random() < 0.3
            b.add(tr(gid, traj, live[gid][traj], done=done, lo=b.learner_version))
            live[gid][traj] += 1
            if done:
                del live[gid][traj]
                if not live[gid]:
                    del live[gid]
        if rng.random() < 0.05 and (serve(b, step, 0) is not None):
            assert serve(b, step, 1) is not None
            step += 1
            b.learner_version = step
            b.engine_versions = {"e": step}
        invariant(b)
    assert step > 5


def test_dynamic_sampling_drops_zero_variance_groups_and_refills() -> None:
    # groups_per_step=1, bound 0: one group admitted at a time. Returns [1, 1] carry no signal -> dropped,
    # its slot is freed so a new group may start; returns [1, 0] are kept.
    b = ReplayBuffer(
        group_size=2,
        groups_per_step=1,
        world_size=1,
        max_staleness=0,
        max_buffered_transitions=100,
        drop_zero_variance=True,
    )
    b.engine_versions = {"e": 0}
    gid, _, _ = b.admit()
    assert not b.admissible()
    b.add(tr(gid, "a", 0, done=True, reward=1.0))
    assert b.add(tr(gid, "b", 0, done=True, reward=1.0)) is False
    assert b.dropped() == {"zero_variance": 2} and b.counts["groups_dropped_zero_variance"] == 1
    assert b.admissible()  # the dropped group's slot is free again
    gid2, _, _ = b.admit()
    b.add(tr(gid2, "c", 0, done=True, reward=1.0))
    assert b.add(tr(gid2, "d", 0, done=True, reward=0.0)) is True
    assert serve(b, 0, 0) is not None
    invariant(b)


def test_a_resumed_learner_starts_at_its_version_and_cannot_repeat_a_served_step() -> None:
    b = ReplayBuffer(group_size=1, groups_per_step=2, world_size=1, max_staleness=0, max_buffered_transitions=100)
    b.engine_versions = {"e": 5}
    b.resume_at(5)  # a learner resumed at version 5 asks a fresh broker for step 5 first (broker.state)
    assert serve(b, 5, 0) is None
    assert (b.next_step, b.learner_version, b.live_admitted) == (5, 5, 10)
    grants = [b.admit() for _ in range(2)]
    assert not b.admissible() and [g[2] for g in grants] == [5, 5]  # groups for step 5, from version >= 5
    for gid, _, _ in grants:
        b.add(tr(gid, f"t{gid}", 0, done=True, lo=5))
    assert serve(b, 5, 0) is not None
    with pytest.raises(ValueError, match="already served and released"):
        serve(b, 5, 0)  # world size 1: served in full and forgotten (no checkpoints: nothing is retained)


def test_a_dead_actors_unfinished_groups_are_dropped_and_their_slots_freed() -> None:
    b = ReplayBuffer(group_size=2, groups_per_step=1, world_size=1, max_staleness=0, max_buffered_transitions=100)
    b.engine_versions = {"e": 0}
    gid, _, _ = b.admit(owner="actor-0")
    b.add(tr(gid, "a", 0))  # one step of one trajectory, then the actor dies
    assert not b.admissible()
    assert b.drop_owner("actor-1") == 0  # another actor's name drops nothing
    assert b.drop_owner("actor-0") == 1
    assert b.dropped() == {"actor_died": 1} and not b.open
    assert b.admissible()  # the slot is free for the restarted actor
    invariant(b)


def complete_group(b: ReplayBuffer, lo: int = 0) -> int:
    """Admit one group of G=2 and finish both trajectories (one step each)."""
    gid, _, _ = b.admit()
    b.add(tr(gid, f"g{gid}.a", 0, done=True, lo=lo))
    b.add(tr(gid, f"g{gid}.b", 0, done=True, lo=lo))
    return gid


def formed_groups(b: ReplayBuffer, step: int) -> list[int]:
    return sorted(g.group_id for share in b.formed[step].shares for g in share)


def test_sample_reuse_trains_a_group_at_most_max_samples_times_fresh_groups_first() -> None:
    b = ReplayBuffer(
        group_size=2,
        groups_per_step=2,
        world_size=1,
        max_staleness=10,
        max_buffered_transitions=100,
        max_samples_per_group=2,
    )
    g0, g1 = complete_group(b), complete_group(b)
    assert b.try_form(0) and formed_groups(b, 0) == [g0, g1]
    assert b.try_form(1) and formed_groups(b, 1) == [g0, g1]  # nothing fresh: both again (their 2nd sample)
    assert not b.try_form(2)  # both used up: the learner waits for fresh groups
    g2 = complete_group(b)
    assert not b.try_form(2)  # one fresh, none left to reuse
    g3 = complete_group(b)
    assert b.try_form(2) and formed_groups(b, 2) == [g2, g3]
    c = b.counts  # hand count: 4 groups x 2 transitions trained once, g0 and g1 once more
    assert (c["groups_trained"], c["groups_reused"], c["transitions_trained"], c["transitions_reused"]) == (4, 2, 8, 4)
    invariant(b)  # a reused group is not counted as trained twice


def test_sample_to_insert_ratio_holds_back_reuse() -> None:
    b = ReplayBuffer(
        group_size=2,
        groups_per_step=2,
        world_size=1,
        max_staleness=10,
        max_buffered_transitions=100,
        max_samples_per_group=3,
        samples_per_insert=1.5,
    )
    complete_group(b), complete_group(b)
    assert b.try_form(0)  # 2 samples of 2 inserts
    assert not b.try_form(1)  # 2 reused would make 4 samples > 1.5 x 2 inserts = 3
    g2 = complete_group(b)  # 3 inserts: up to 4.5 samples
    assert b.try_form(1) and g2 in formed_groups(b, 1) and b.counts["groups_reused"] == 1  # 1 fresh + 1 reused


def test_reuse_stops_once_a_group_is_too_stale() -> None:
    b = ReplayBuffer(
        group_size=2,
        groups_per_step=1,
        world_size=1,
        max_staleness=1,
        max_buffered_transitions=100,
        max_samples_per_group=5,
    )
    complete_group(b, lo=0)
    assert b.try_form(0) and b.try_form(1)  # versions 0 and 1: lag 0 and 1, within the bound
    b.learner_version = 2
    assert not b.try_form(2)  # lag 2 > 1: let go, not trained again
    assert b.counts["groups_retired_stale"] == 1 and b.counts["groups_reused"] == 1 and not b.reuse
    assert b.dropped() == {}  # trained already: nothing is dropped


def test_the_reuse_pool_survives_a_snapshot() -> None:
    from broker.state import _frames, _transition

    b = ReplayBuffer(
        group_size=2,
        groups_per_step=1,
        world_size=1,
        max_staleness=10,
        max_buffered_transitions=100,
        max_samples_per_group=3,
    )
    complete_group(b)
    assert b.try_form(0)
    copy = ReplayBuffer(
        group_size=2,
        groups_per_step=1,
        world_size=1,
        max_staleness=10,
        max_buffered_transitions=100,
        max_samples_per_group=3,
    )
    copy.load_state(b.to_state(_frames), _transition)
    assert [g.samples for g in copy.reuse] == [1] and copy.try_form(1) and copy.try_form(2) and not copy.try_form(3)


def test_a_batch_lists_groups_trajectories_and_steps_in_order_with_their_columns() -> None:
    from broker.buffer import Group, build_batch

    def t(traj: str, step: int, n_prompt: int, reward: float, lo: int, done: bool = False, valid: bool = True):
        return Transition(
            traj_id=traj,
            group_id=0,
            actor="a",
            step=step,
            prompt_ids=np.full(n_prompt, step, np.int32),
            response_ids=np.array([7, step], np.int32),
            logprobs=np.array([-1.0, -0.5 * step], np.float32),
            version_lo=lo,
            version_hi=lo + 1,
            reward=reward,
            done=done,
            truncated=False,
            valid=valid,
            anchor=f"{traj}@{step}",
        )

    g0 = Group(
        0,
        0,
        trajectories={
            "b": [t("b", 1, 1, 2.0, 3, done=True), t("b", 0, 2, 1.0, 2)],  # steps arrive 1, 0
            "a": [t("a", 0, 1, 0.5, 1, done=True, valid=False)],
        },
    )
    g1 = Group(1, 1, trajectories={"z": [t("z", 0, 3, -1.0, 0, done=True)]})
    b = build_batch(5, 1, 9, 2, [g0, g1])
    # By hand: group 0's trajectories sorted by id (a, then b with its steps 0, 1), then group 1's z.
    assert (b.step, b.rank, b.learner_version, b.group_size) == (5, 1, 9, 2)
    assert b.group_index.tolist() == [0, 0, 0, 1] and b.traj_index.tolist() == [0, 1, 1, 2]
    assert b.step_index.tolist() == [0, 0, 1, 0] and b.prompt_lens.tolist() == [1, 2, 1, 3]
    assert b.response_lens.tolist() == [2, 2, 2, 2] and b.rewards.tolist() == [0.5, 1.0, 2.0, -1.0]
    assert b.dones.tolist() == [True, False, True, True] and b.valid.tolist() == [False, True, True, True]
    assert b.version_lo.tolist() == [1, 2, 3, 0] and b.version_hi.tolist() == [2, 3, 4, 1]
    assert b.prompt_ids.tolist() == [0, 0, 0, 1, 0, 0, 0] and b.response_ids.tolist() == [7, 0, 7, 0, 7, 1, 7, 0]
    assert b.logprobs.tolist() == [-1.0, 0.0, -1.0, 0.0, -1.0, -0.5, -1.0, 0.0]
    assert b.anchors == ["a@0", "b@0", "b@1", "z@0"]
    assert (b.group_index.dtype, b.rewards.dtype, b.dones.dtype, b.prompt_ids.dtype, b.logprobs.dtype) == (
        np.int32,
        np.float32,
        np.bool_,
        np.int32,
        np.float32,
    )
    empty = build_batch(0, 0, 0, 2, [])
    assert empty.prompt_ids.size == 0 and empty.rewards.dtype == np.float32 and empty.anchors == []
    assert b.token_rewards.size == 0  # none of its transitions has token rewards: the column is empty
    # one transition with rewards on its tokens: the column holds one per response token, 0 for the others
    b0 = g0.trajectories["b"][1]  # b's step 0
    g0.trajectories["b"][1] = dataclasses.replace(b0, token_rewards=np.array([0.25, -1], np.float32))
    assert build_batch(5, 1, 9, 2, [g0, g1]).token_rewards.tolist() == [0, 0, 0.25, -1, 0, 0, 0, 0]


def abandon(group_id: int, traj: str, step: int, cause: str, group: bool = False) -> Transition:
    from agentstream.wire.messages import ABANDON, ABANDON_GROUP

    empty = np.zeros(0, np.int32)
    return Transition(
        traj_id=traj,
        group_id=group_id,
        actor="a",
        step=step,
        prompt_ids=empty,
        response_ids=empty,
        logprobs=np.zeros(0, np.float32),
        version_lo=0,
        version_hi=0,
        reward=0.0,
        done=False,
        truncated=False,
        valid=False,
        info={ABANDON: cause, ABANDON_GROUP: group},
    )


def test_an_abandoned_attempt_is_dropped_and_its_retry_takes_its_place_in_the_group() -> None:
    """G = 2. Attempt t0 sends 2 steps and fails (env timeout): its marker drops those 2 steps and itself (3 dropped
    as infra_timeout); the retry t0.r1 is the group's second trajectory, and the group trains t0.r1 and t1 only."""
    b = ReplayBuffer(
        group_size=2, groups_per_step=1, world_size=1, max_staleness=0, max_buffered_transitions=100, track_keys=True
    )
    gid, _, _ = b.admit()
    b.add(tr(gid, "t1", 0, done=True))
    b.add(tr(gid, "t0", 0))
    b.add(tr(gid, "t0", 1))
    assert b.add(abandon(gid, "t0", 2, "timeout")) is False
    invariant(b)
    assert b.dropped() == {"infra_timeout": 3} and b.counts["trajectories_retried"] == 1
    assert b.add(tr(gid, "t0.r1", 0)) is False  # the freed place: no group_overflow
    assert b.add(tr(gid, "t0.r1", 1, done=True)) is True
    batch = serve(b, 0, 0)
    assert batch.traj_index.tolist() == [0, 0, 1] and batch.step_index.tolist() == [0, 1, 0]  # t0.r1, then t1
    assert b.counts["transitions_trained"] == 3 and b.counts["transitions_ingested"] == 6
    invariant(b)


def test_giving_up_drops_the_whole_group_and_frees_its_slot_and_bad_causes_are_rejected() -> None:
    b = ReplayBuffer(group_size=2, groups_per_step=1, world_size=1, max_staleness=0, max_buffered_transitions=100)
    gid, _, _ = b.admit()
    b.add(tr(gid, "t0", 0))
    b.add(tr(gid, "t1", 0, done=True))
    with pytest.raises(RejectedTransition) as exc:
        b.add(abandon(gid, "t0", 1, "Bad Cause!"))
    assert exc.value.reason == "bad_abandon"
    with pytest.raises(RejectedTransition) as exc:
        b.add(abandon(gid, "t1", 1, "raised"))  # t1 finished: it is not abandoned
    assert exc.value.reason == "after_done"
    assert b.add(abandon(gid, "t0", 1, "raised", group=True)) is False
    assert not b.open and not b.ready and b.live_admitted == 0  # its admission slot is free again
    assert b.dropped() == {"infra_raised": 3}  # t0's step, t1's, the marker
    assert b.counts["groups_dropped_infra_raised"] == 1
    invariant(b)
    with pytest.raises(RejectedTransition) as exc:
        b.add(tr(gid, "t0.r1", 0))  # a straggler of the dropped group
    assert exc.value.reason == "unknown_group"
