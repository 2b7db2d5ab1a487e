# specprefill workbench. `make reproduce` and `make test` set everything up on a fresh machine.
PROFILE ?= cpu
PY := .venv/bin/python
SPEC := .venv/bin/specprefill
# no engine environment here: the project picks dtype, threads and each engine's memory from the machine
export TRANSFORMERS_VERBOSITY ?= error
export VLLM_LOGGING_LEVEL ?= WARNING

.PHONY: setup test test-all reproduce lab bench models clean gpu-check

.venv/.setup-done: pyproject.toml scripts/setup.sh
	bash scripts/setup.sh

setup: .venv/.setup-done

# the default loop; test-all adds the heavy end-to-end runs (the whole smoke profile, a killed-and-resumed run, ...)
test: .venv/.setup-done
	$(PY) -m pytest -q --durations=10

test-all: .venv/.setup-done
	$(PY) -m pytest -q -m "not gpu"

# On a GPU machine (set up with VLLM_PACKAGE=vllm==0.32.0): vLLM vs the transformers oracle with the V2 model
# runner, async scheduling and a compiled base, plus the engine tests. Not part of CI (no GPU there).
gpu-check: .venv/.setup-done
	$(PY) -m pytest -q -m gpu tests/test_vllm_engine.py
	$(PY) -m pytest -q tests/test_vllm_engine.py tests/test_capture.py

models: .venv/.setup-done
	$(SPEC) models --materialize

# Every notebook of the profile through papermill (finished ones are skipped; FORCE=1 reruns), then the report:
# outputs/$(PROFILE)/<notebook>/ and outputs/$(PROFILE)/report.html. Lists failures and exits non-zero if any.
reproduce: .venv/.setup-done
	$(SPEC) reproduce --profile $(PROFILE) $(if $(FORCE),--force,)

lab: .venv/.setup-done
	.venv/bin/jupyter lab notebooks/

bench: .venv/.setup-done
	$(SPEC) bench ttft --out outputs/bench
	$(SPEC) bench qps --burst 64 --out outputs/bench

clean:
	rm -rf outputs/*/ .pytest_cache
	find . -name __pycache__ -prune -exec rm -rf {} +
