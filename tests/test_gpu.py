"""`make gpu-check` (scripts/gpu_check.py): what only a CUDA GPU can run, each check reported ran / refused / failed.
Every check compares the GPU engines with the transformers oracle through a plain script in a plain environment
(vLLM's default multiprocess engines, the project sizing memory itself). Not part of CI: no GPU there."""

import pytest
import torch
from test_vllm_engine import run_plain_against_oracle

pytestmark = [pytest.mark.gpu, pytest.mark.engine]
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU (make gpu-check)", allow_module_level=True)

EAGER = {"enforce_eager": True}


def _speculator_tp() -> dict:
    """The speculator over 2 GPUs' tensor-parallel ranks where there are 2."""
    return {"tensor_parallel_size": 2} if torch.cuda.device_count() >= 2 else {}


def test_v1_runner_matches_the_oracle(tiny_tp_model, tmp_path):
    """vLLM's V1 model runner, both engines eager: selection, importance and greedy tokens equal the oracle's."""
    run_plain_against_oracle(tiny_tp_model, tmp_path, EAGER, {}, env_extra={"VLLM_USE_V2_MODEL_RUNNER": "0"})


def test_v2_runner_async_scheduling_compiled_base(tiny_tp_model, tmp_path):
    """vLLM's V2 model runner (the GPU default), async scheduling and a compiled base (CUDA graphs): the rewritten
    positions, the capture and `min_tokens` bound through V2's own paths."""
    run_plain_against_oracle(
        tiny_tp_model,
        tmp_path,
        {"enforce_eager": False, "async_scheduling": True},
        {},
        env_extra={"VLLM_USE_V2_MODEL_RUNNER": "1"},
    )


def test_tensor_parallel_speculator(tiny_tp_model, tmp_path):
    """The speculator over 2 GPUs (each rank scores its own heads; the driver merges them)."""
    if torch.cuda.device_count() < 2:
        pytest.skip("refused: needs 2 GPUs for a tensor-parallel speculator (this machine has 1)")
    run_plain_against_oracle(tiny_tp_model, tmp_path, EAGER, _speculator_tp())


def test_fp8_kv_cache_base(tiny_tp_model, tmp_path):
    """The base with an FP8 KV cache: the speculator's selection is the oracle's (its cache is its own), the base
    generates from the pruned prompt at its original positions."""
    run_plain_against_oracle(tiny_tp_model, tmp_path, {**EAGER, "kv_cache_dtype": "fp8"}, {}, same_tokens=False)
