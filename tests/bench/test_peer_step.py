"""bench/peer_step.py's parts that decide what is compared: the batch the learner gets holds the completions TRL
replays, group by group, and the comparison reads a difference where there is one. (The step itself needs the
peer venv that bench.peer makes: a benchmark, run by hand; docs/benchmarks.md.)"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from bench.peer_step import compare, make_batch
from bench.peer_trl import replay


def test_the_learner_batch_and_trls_replay_hold_the_same_completions(tmp_path: Path) -> None:
    prompts = [{"prompt_ids": [5, 6, 7]}, {"prompt_ids": [8, 9]}]
    completions = [[[10, 2], [11, 12, 2]], [[13], [14, 15]]]
    rewards = [[1.0, 0.0], [-0.1, 0.5]]
    b = make_batch(prompts, completions, rewards)
    assert b.group_index.tolist() == [0, 0, 1, 1] and b.traj_index.tolist() == [0, 1, 2, 3]
    assert b.group_size == 2 and b.dones.all() and (b.step_index == 0).all()
    assert b.prompt_lens.tolist() == [3, 3, 2, 2] and b.response_lens.tolist() == [2, 3, 1, 2]
    assert b.prompt_ids.tolist() == [5, 6, 7, 5, 6, 7, 8, 9, 8, 9]
    assert b.response_ids.tolist() == [10, 2, 11, 12, 2, 13, 14, 15]
    assert b.rewards.tolist() == pytest.approx([1.0, 0.0, -0.1, 0.5])
    path = tmp_path / "completions.jsonl"
    path.write_text(
        "".join(
            json.dumps({"prompt_ids": p["prompt_ids"], "completions": c}) + "\n" for p, c in zip(prompts, completions)
        )
    )
    generate = replay(path)
    # TRL asks for each prompt G times in a row; it gets that prompt's completions in order
    ids, logprobs = generate([[5, 6, 7], [5, 6, 7], [8, 9], [8, 9]], None, {}, 2)
    assert ids == [[10, 2], [11, 12, 2], [13], [14, 15]] and logprobs is None


def test_compare_reads_the_difference_and_the_parameter_that_differs_most() -> None:
    rng = np.random.default_rng(0)
    b = {"a": torch.from_numpy(rng.normal(size=(4, 3))), "b": torch.from_numpy(rng.normal(size=5))}
    assert compare(b, b)[:2] == (pytest.approx(1.0), pytest.approx(0.0))
    a = {"a": b["a"].clone(), "b": b["b"] * 1.1}  # only "b" is off, by 10% of itself
    cos, rel, worst, worst_rel = compare(a, b)
    total = float(torch.cat([b["a"].flatten(), b["b"]]).norm())
    assert rel == pytest.approx(0.1 * float(b["b"].norm()) / total)
    assert worst == "b" and worst_rel == pytest.approx(0.1) and cos < 1.0
    with pytest.raises(RuntimeError, match="different parameters"):
        compare({"a": b["a"]}, b)
