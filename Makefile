# specprefill workbench. `make reproduce` and `make test` set everything up on a fresh machine.
PROFILE ?= cpu
PY := .venv/bin/python
SPEC := .venv/bin/specprefill
# no engine environment here: the project picks dtype, threads and each engine's memory from the machine
export TRANSFORMERS_VERBOSITY ?= error
export VLLM_LOGGING_LEVEL ?= WARNING

.PHONY: setup test test-fast test-all lint style reproduce lab bench models clean gpu-check

.venv/.setup-done: pyproject.toml scripts/setup.sh
	bash scripts/setup.sh

setup: .venv/.setup-done

# the default loop (CI): lint, then every test but the heavy ones; test-all adds the heavy end-to-end runs (the
# whole smoke profile, a killed-and-resumed run, ...). test-fast: no weights, no engines, seconds (while editing).
test: lint
	$(PY) -m pytest -q --durations=10

test-fast: .venv/.setup-done
	$(PY) -m pytest -q -m "not model and not engine and not e2e and not gpu and not heavy"

# ruff (lint + format check) and mypy, as configured in pyproject.toml; `make style` applies ruff's fixes
lint: .venv/.setup-done
	.venv/bin/ruff check src tests scripts/peak_memory.py scripts/capture_memory.py
	.venv/bin/ruff format --check src tests scripts/peak_memory.py scripts/capture_memory.py
	.venv/bin/mypy

style: .venv/.setup-done
	.venv/bin/ruff check --fix src tests scripts/peak_memory.py scripts/capture_memory.py
	.venv/bin/ruff format src tests scripts/peak_memory.py scripts/capture_memory.py

test-all: .venv/.setup-done
	$(PY) -m pytest -q -m "not gpu"

# On a GPU machine (set up with VLLM_PACKAGE=vllm==0.32.0): vLLM vs the transformers oracle with the V2 model
# runner, async scheduling and a compiled base, plus the engine tests. Not part of CI (no GPU there).
gpu-check: .venv/.setup-done
	$(PY) -m pytest -q -m gpu tests/test_vllm_engine.py
	$(PY) -m pytest -q tests/test_vllm_engine.py tests/test_capture.py tests/test_families.py

models: .venv/.setup-done
	$(SPEC) models --materialize

# Every notebook of the profile through papermill (finished ones are skipped; FORCE=1 reruns), then the report:
# outputs/$(PROFILE)/<notebook>/ and outputs/$(PROFILE)/report.html. Lists failures and exits non-zero if any.
reproduce: .venv/.setup-done
	$(SPEC) reproduce --profile $(PROFILE) $(if $(FORCE),--force,)

lab: .venv/.setup-done
	.venv/bin/jupyter lab notebooks/

# the speculator-choice table: the same base, 4096 tokens, 10% kept, look-ahead 1, one speculator at a time
SPECULATORS ?= qwen2.5-coder-0.5b smollm2-135m self:0.125 self:0.25 self:0.5

bench: .venv/.setup-done
	$(SPEC) bench ttft --out outputs/bench
	$(SPEC) bench qps --burst 64 --out outputs/bench
	for s in $(SPECULATORS); do $(SPEC) bench ttft --speculator $$s --lengths 4096 --keep-rates 0.1 --look-ahead 1 \
	  --out "outputs/bench/speculators/$$s" || exit 1; done
	$(SPEC) bench table $(foreach s,$(SPECULATORS),"outputs/bench/speculators/$(s)/ttft.json") \
	  | tee outputs/bench/speculators.md

clean:
	rm -rf outputs/*/ .pytest_cache
	find . -name __pycache__ -prune -exec rm -rf {} +
