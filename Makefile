# specprefill workbench. `make reproduce` and `make test` set everything up on a fresh machine.
PROFILE ?= cpu
PY := .venv/bin/python
SPEC := .venv/bin/specprefill
export OMP_NUM_THREADS ?= 2
export VLLM_ENABLE_V1_MULTIPROCESSING ?= 0
export TRANSFORMERS_VERBOSITY ?= error

.PHONY: setup test reproduce lab bench models clean

.venv/.setup-done: pyproject.toml scripts/setup.sh
	bash scripts/setup.sh

setup: .venv/.setup-done

test: .venv/.setup-done
	$(PY) -m pytest -q

models: .venv/.setup-done
	$(SPEC) models --materialize

# Until the experiment notebooks land, reproduce runs the quick-start: SpecPrefill (10% keep) on a long
# needle-in-a-haystack prompt with the default pair, written atomically to outputs/$(PROFILE)/quickstart.json.
reproduce: .venv/.setup-done
	mkdir -p outputs/$(PROFILE)
	$(SPEC) generate --speculator qwen2.5-coder-0.5b --base qwen2.5-coder-1.5b --keep-rate 0.1 \
		--prompt-file examples/needle.txt --max-tokens 16 --json > outputs/$(PROFILE)/quickstart.json.tmp
	mv outputs/$(PROFILE)/quickstart.json.tmp outputs/$(PROFILE)/quickstart.json
	$(PY) -c "import json; r = json.load(open('outputs/$(PROFILE)/quickstart.json')); \
		print('kept', len(r['kept_indices']), 'of', r['n_prompt_tokens'], 'tokens; answer:', repr(r['output_text']))"

lab: .venv/.setup-done
	.venv/bin/jupyter lab notebooks/

bench: .venv/.setup-done
	$(SPEC) bench ttft --out outputs/bench
	$(SPEC) bench qps --out outputs/bench

clean:
	rm -rf outputs/*/ .pytest_cache
	find . -name __pycache__ -prune -exec rm -rf {} +
