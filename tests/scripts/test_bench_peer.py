"""scripts/bench_peer.py's parts that decide what the two systems compare: the prompts TRL trains on are the
ones agentstream's actors send, and the ratios put agentstream over TRL. (Its runs themselves take minutes and a
venv of their own: they are benchmarks, run by hand; docs/benchmarks.md.)"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

import bench_peer  # noqa: E402


def test_the_peer_gets_the_actors_prompts_one_group_per_seed(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    from agentstream.config import TINY_MODEL_DIR
    from envs.reasoning import INSTRUCTIONS
    from launcher.tiny_model import ensure_tiny_model

    tiny_model_dir = ensure_tiny_model(TINY_MODEL_DIR)  # the benchmark's own model

    w = bench_peer.Workload(model=str(tiny_model_dir), batch=16, steps=2)  # 2 steps x 2 groups
    n_tokens = bench_peer.write_prompts(w, tmp_path / "prompts.jsonl")
    lines = [json.loads(line) for line in (tmp_path / "prompts.jsonl").read_text().splitlines()]
    assert len(lines) == 4 and len({line["seed"] for line in lines}) == 4
    assert [line["seed"] - lines[0]["seed"] for line in lines] == [0, 1, 2, 3]  # group g: seed_base + g
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    for line in lines:
        assert INSTRUCTIONS[:40] in line["prompt"] and line["dataset"] == "basic_arithmetic"
        # the text TRL tokenizes is the prompt the engine gets, token for token
        assert tokenizer(line["prompt"], add_special_tokens=False)["input_ids"] == line["prompt_ids"]
    assert n_tokens == len(lines[0]["prompt_ids"]) > 20
    assert len({tuple(line["prompt_ids"]) for line in lines}) == 4  # each seed its own question


def test_ratios_put_agentstream_over_trl_with_the_targets() -> None:
    def result(system: str, mode: str, batch: int, steady_s: float) -> bench_peer.Result:
        return bench_peer.Result(system, mode, batch, steps=5, startup_s=1.0, steady_s=steady_s, detail="")

    # completions/s = (steps - 1) x batch / steady: TRL 4 x 16 / 2 = 32; agentstream 64 / 1 = 64 (2.00x),
    # 64 / 4 = 16 (0.50x); at 64: TRL 256 / 4 = 64, agentstream 256 / 2 = 128 (2.00x, target 1.5)
    results = [result("TRL", "sync", 16, 2.0), result("agentstream", "sync", 16, 1.0),
               result("agentstream", "async", 16, 4.0), result("TRL", "sync", 64, 4.0),
               result("agentstream", "async", 64, 2.0)]
    assert results[1].rate == pytest.approx(64.0)
    assert bench_peer.ratios(results) == ["sync at 16: 2.00x (target >= 1.0x)", "async at 16: 0.50x (no target)",
                                          "async at 64: 2.00x (target >= 1.5x)"]
