"""launcher.placement: the GPU plan on invented hosts, its refusals, and random configs."""

from __future__ import annotations

import random

import pytest

from agentstream.config import Config
from launcher.placement import PlacementError, host_plan, plan, visible


def test_two_hosts_of_8_tensor_parallel_2_learner_on_4():
    p = plan([8, 8], engines=6, gpus_per_engine=2, learner_ranks=4, colocate=False)
    # learner: GPUs 0-3 of host 0; engines: the 4 left on host 0 make 2 pairs, host 1's 8 make 4.
    assert p.learner == ((0, 1, 2, 3), ())
    assert p.engines == ((0, (4, 5)), (0, (6, 7)), (1, (0, 1)), (1, (2, 3)), (1, (4, 5)), (1, (6, 7)))
    with pytest.raises(PlacementError, match=r"engines.count=7 .* only 6 fit .*host 0: 4, host 1: 8.*engines.colocate"):
        plan([8, 8], engines=7, gpus_per_engine=2, learner_ranks=4, colocate=False)


def test_colocated_engines_share_the_learners_gpus_one_engine_per_gpu():
    one = plan([1], engines=1, gpus_per_engine=1, learner_ranks=1, colocate=True)
    assert one.learner == ((0,),) and one.engines == ((0, (0,)),)  # gpu_one: both on GPU 0
    with pytest.raises(PlacementError, match="engines.colocate=true"):  # not asked for: refused
        plan([1], engines=1, gpus_per_engine=1, learner_ranks=1, colocate=False)
    full = plan([8], engines=4, gpus_per_engine=2, learner_ranks=8, colocate=True)
    assert full.engines == ((0, (0, 1)), (0, (2, 3)), (0, (4, 5)), (0, (6, 7)))
    with pytest.raises(PlacementError, match="only 4 fit"):
        plan([8], engines=5, gpus_per_engine=2, learner_ranks=8, colocate=True)


def test_refusals_say_what_to_change():
    with pytest.raises(PlacementError, match=r"12 ranks fall unevenly on the hosts \(\[8, 4\] GPUs\)"):
        plan([8, 8], engines=0, gpus_per_engine=1, learner_ranks=12, colocate=False)
    assert plan([8, 8], 0, 1, 16, False).learner == (tuple(range(8)), tuple(range(8)))
    with pytest.raises(PlacementError, match="need one GPU each; the hosts have 16"):
        plan([8, 8], engines=0, gpus_per_engine=1, learner_ranks=17, colocate=False)
    with pytest.raises(PlacementError, match="only 0 fit"):  # a tensor-parallel group never spans hosts
        plan([4, 4], engines=1, gpus_per_engine=8, learner_ranks=0, colocate=False)
    with pytest.raises(PlacementError, match="gpus_per_engine=0"):
        plan([8], engines=1, gpus_per_engine=0, learner_ranks=0, colocate=False)


def test_a_cpu_host_places_nothing_and_sets_no_devices():
    p = plan([0], engines=3, gpus_per_engine=1, learner_ranks=2, colocate=False)
    assert p.learner == ((),) and p.engines == ((0, ()),) * 3
    assert visible((), []) == {}
    assert visible((1, 3), ["4", "5", "6", "7"]) == {"CUDA_VISIBLE_DEVICES": "5,7"}  # a launcher that sees 4-7


def test_host_plan_counts_what_this_launch_starts():
    cfg = Config()
    cfg.engines.count, cfg.engines.gpus_per_engine, cfg.learner.world_size = 3, 2, 2
    p = host_plan(cfg, 8)
    assert p.learner == ((0, 1),) and [g for _, g in p.engines] == [(2, 3), (4, 5), (6, 7)]
    cfg.run.role = "engines"  # a joining host of engines: no learner rank here
    assert [g for _, g in host_plan(cfg, 8).engines] == [(0, 1), (2, 3), (4, 5)] and host_plan(cfg, 8).learner == ((),)


@pytest.mark.parametrize("seed", range(30))
def test_random_plans_never_double_book_a_gpu(seed):
    rng = random.Random(seed)
    hosts = [rng.choice([0, 1, 2, 4, 8]) for _ in range(rng.randint(1, 3))] or [1]
    if not any(hosts):
        hosts[0] = 4
    tp, colocate = rng.choice([1, 2, 4]), rng.random() < 0.5
    try:
        p = plan(hosts, rng.randint(0, 8), tp, rng.randint(0, sum(hosts)), colocate)
    except PlacementError:
        return
    engine_gpus = [(h, g) for h, gs in p.engines for g in gs]
    assert len(engine_gpus) == len(set(engine_gpus))  # one engine per GPU
    for h, gs in p.engines:
        assert len(gs) == tp and all(0 <= g < hosts[h] for g in gs)
    learner_gpus = {(h, g) for h, gs in enumerate(p.learner) for g in gs}
    assert all(0 <= g < hosts[h] for h, g in learner_gpus)
    if not colocate:
        assert not learner_gpus & set(engine_gpus)
