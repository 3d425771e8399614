"""Fixtures of the learner's tests: one tiny model directory per test session."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

torch.set_num_threads(1)  # two shared cores: never let a test fan out


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny tied-embedding Qwen2 (hidden 128, 2 layers) with a ~300-token tokenizer; ~1 s to make."""
    from launcher.tiny_model import make_tiny_model

    texts = [f"<|im_start|>user\nstep {i}: go left or right?<|im_end|>\n<action>left</action>" for i in range(50)]
    return make_tiny_model(tmp_path_factory.mktemp("tiny-model"), texts=texts, vocab_size=300)
