# specprefill workbench. `make reproduce` and `make test` set everything up on a fresh machine.
PROFILE ?= cpu
# the Python environment make installs into and runs from: a venv it creates, or yours (conda: make ENV=$$CONDA_PREFIX)
ENV ?= .venv
PY := $(ENV)/bin/python
HF_PYTHON ?= python3
SPEC := $(PY) -m specprefill
SETUP := $(ENV)/.setup-done
SETUP_TEST := $(ENV)/.setup-test-done
LINTED := src tests scripts/pins.py scripts/peak_memory.py scripts/capture_memory.py scripts/uv_args.py scripts/gpu_check.py
# no engine environment here: the project picks dtype, threads and each engine's memory from the machine
export TRANSFORMERS_VERBOSITY ?= error
export VLLM_LOGGING_LEVEL ?= WARNING

.PHONY: setup setup-test constraints test test-fast test-paper-mini test-all lint style reproduce lab bench models clean gpu-check gpu-check-hf

# what running the workbench needs (vLLM, the project, papermill/JupyterLab/lm-eval, bubblewrap) ...
$(SETUP): pyproject.toml scripts/setup.sh scripts/uv_args.py constraints/cpu.txt
	ENV=$(ENV) bash scripts/setup.sh

# ... or that and what the tests add (pytest, playwright, ruff, mypy, Debian chromium, axe-core, the tests' model)
# in one pass: one pip resolution, Debian's packages installing while pip works
$(SETUP_TEST): pyproject.toml scripts/setup.sh scripts/uv_args.py constraints/cpu.txt
	ENV=$(ENV) bash scripts/setup.sh test

setup: $(SETUP)

setup-test: $(SETUP_TEST)

# pin what this environment resolved, for the next install (pip -c; the CPU build). The only place the pins are
# regenerated: refused (the file left as it was) when a pin excludes the oldest Python pyproject.toml admits
# (scripts/pins.py, from the installed metadata; `make test` runs the same check on the committed file)
constraints: $(SETUP)
	{ sed -n '1,2p' constraints/cpu.txt; $(PY) -m pip freeze --exclude-editable | grep -v '^vllm=='; } > constraints/cpu.txt.new
	$(PY) scripts/pins.py constraints/cpu.txt.new || { rm -f constraints/cpu.txt.new; exit 1; }
	mv constraints/cpu.txt.new constraints/cpu.txt

# the default loop (CI): lint, then every test but the heavy ones in a random order (its seed is printed), the
# slowest listed; no test may use more CPU than tests/conftest.py's CPU_LIMIT_S. test-all adds the heavy end-to-end
# runs (the whole smoke and paper-mini profiles, a killed-and-resumed run, ...). test-fast: no weights, no engines.
test: lint
	$(PY) -m pytest -q --durations=15

# no engines here, so the tests run on every core (pytest-xdist); the engine loops stay on one worker: the engines'
# threads would oversubscribe the cores
test-fast: $(SETUP_TEST)
	$(PY) -m pytest -q -n auto -m "not model and not engine and not e2e and not gpu and not heavy"

# ruff (lint + format check) and mypy, as configured in pyproject.toml; `make style` applies ruff's fixes
lint: $(SETUP_TEST)
	$(PY) -m ruff check $(LINTED)
	$(PY) -m ruff format --check $(LINTED)
	$(PY) -m mypy

style: $(SETUP_TEST)
	$(PY) -m ruff check --fix $(LINTED)
	$(PY) -m ruff format $(LINTED)

# paper-mini end to end (the paper profiles' protocol on the offline pair: its two heavy tests share one run); CI runs
# it after `make test`
test-paper-mini: $(SETUP_TEST)
	$(PY) -m pytest -q -p no:randomly -m heavy -k paper_mini --durations=5

test-all: $(SETUP_TEST)
	$(PY) -m pytest -q -m "not gpu" --durations=15

# On a GPU machine (set-up installs vLLM's CUDA build there: scripts/setup.sh sees the GPU): the GPU checks
# (tests/test_gpu.py: V1/V2 runners, async scheduling, a compiled base, FP8 KV cache, TP=2, bf16 on the default
# attention backend, a 16k-token chunked prefill, the server's keep rates, memory against the plan, the TTFT speedup)
# and the engine tests, each reported ran / refused / failed in outputs/gpu-check/report.json; `make gpu-check
# ARGS=--list` names them. Without a GPU: one line, nothing run.
gpu-check: $(SETUP_TEST)
	@$(PY) scripts/gpu_check.py $(ARGS)

# The transformers reference engine's checks (families in bf16 against the CPU, core at 32k/128k tokens, TTFT of
# random-weight 1B/3B -> 8B pairs) on a CUDA machine that has torch and transformers only: no set-up, no vLLM, no
# network, no model files; ~8 min on one H100-class GPU (ARGS=--budget-s N, --list, --tiny: the CPU, tiny shapes)
gpu-check-hf:
	@PYTHONPATH=src $(HF_PYTHON) scripts/gpu_check.py --engine hf $(ARGS)

models: $(SETUP)
	$(SPEC) models --materialize

# Every notebook of the profile through papermill (finished ones are skipped; FORCE=1 reruns), then the report:
# outputs/$(PROFILE)/<notebook>/ and outputs/$(PROFILE)/report.html. Lists failures and exits non-zero if any. ARGS: more
# flags, e.g. ARGS="--executor slurm --jobs 32 --partition gpu" (docs/guide.md, Running on a Slurm cluster)
reproduce: $(SETUP)
	$(SPEC) reproduce --profile $(PROFILE) $(if $(FORCE),--force,) $(ARGS)

# at the project root: notebooks/, params/ and outputs/ side by side. As root (a container's user) JupyterLab refuses
# to start without --allow-root: given then. ARGS: more JupyterLab flags, e.g. ARGS="--port=8899 --no-browser"
lab: $(SETUP)
	$(PY) -m jupyter lab --notebook-dir=. $$([ "$$(id -u)" = 0 ] && echo --allow-root) $(ARGS)

# the speculator-choice table: the same base, 4096 tokens, 10% kept, look-ahead 1, one speculator at a time
SPECULATORS ?= qwen2.5-coder-0.5b smollm2-135m self:0.125 self:0.25 self:0.5

bench: $(SETUP)
	$(SPEC) bench ttft --out outputs/bench
	$(SPEC) bench qps --burst 64 --out outputs/bench
	for s in $(SPECULATORS); do $(SPEC) bench ttft --speculator $$s --lengths 4096 --keep-rates 0.1 --look-ahead 1 \
	  --out "outputs/bench/speculators/$$s" || exit 1; done
	$(SPEC) bench table $(foreach s,$(SPECULATORS),"outputs/bench/speculators/$(s)/ttft.json") \
	  | tee outputs/bench/speculators.md

clean:
	rm -rf outputs/*/ .pytest_cache
	find . -name __pycache__ -prune -exec rm -rf {} +
