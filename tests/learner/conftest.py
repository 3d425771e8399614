"""Fixtures of the learner's tests: one tiny model directory per test session."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from agentstream.wire.addresses import free_port

torch.set_num_threads(1)  # two shared cores: never let a test fan out


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny tied-embedding Qwen2 (hidden 128, 2 layers) with a ~300-token tokenizer; ~1 s to make."""
    from launcher.tiny_model import make_tiny_model

    texts = [f"<|im_start|>user\nstep {i}: go left or right?<|im_end|>\n<action>left</action>" for i in range(50)]
    return make_tiny_model(tmp_path_factory.mktemp("tiny-model"), texts=texts, vocab_size=300)


@pytest.fixture(scope="module")
def one_rank():
    """One gloo rank in this process (world size 1): what FSDP2 needs to shard a model here."""
    with pytest.MonkeyPatch.context() as mp:
        for k, v in dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                         MASTER_PORT=str(free_port())).items():
            mp.setenv(k, v)
        dist.init_process_group("gloo")
        try:
            yield
        finally:
            dist.destroy_process_group()
