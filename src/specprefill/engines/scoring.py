"""A model's own attention weights over a prompt (`core.ScoreCache`: every layer, head and look-ahead step), from
either engine: transformers on the CPU (the oracle, any model that fits in RAM) or the vLLM workers' capture (any
size and tensor-parallel width: a 70B or 405B base on GPUs). The explorer and the agreement notebook score the
speculator and the base through this, so the paper profiles run them without loading weights on the CPU."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from specprefill import core
from specprefill.config import EngineParams
from specprefill.errors import SpecPrefillError

ENGINES = ("hf", "vllm")


@dataclass
class Scorer:
    """`scorer(token_ids) -> core.ScoreCache` of one model; `tokenizer` is the model's; `close()` frees it."""

    model: str
    tokenizer: Any
    score: Callable[[list[int]], core.ScoreCache]
    close: Callable[[], None] = lambda: None

    def __call__(self, token_ids: list[int]) -> core.ScoreCache:
        return self.score(list(token_ids))


def capture_params(params: EngineParams, model: str, role: str) -> EngineParams:
    """The engine arguments a capture engine of `model` runs with: the pair's, with the role's own tensor-parallel
    width, GPU share and engine arguments (the base's for role "base"), the model alone (no second engine)."""
    if role not in ("speculator", "base"):
        raise ValueError(f"role {role!r}: speculator or base")
    out = dataclasses.replace(params, speculator=model, base=None)
    if role == "base":
        out.speculator_tensor_parallel_size = params.tensor_parallel_size
        out.speculator_gpu_memory_utilization = params.gpu_memory_utilization
        out.speculator_engine_args = dict(params.engine_args)
        out.speculator_kv_cache_memory_bytes = params.kv_cache_memory_bytes
    return out


def concurrent_shares(params: EngineParams, spec_path: str, base_path: str) -> EngineParams:
    """`params` for a speculator and a base scorer alive at the same time (the explorer): on GPUs each gets its share
    of the memory as a pair's engines do (`sizing.gpu_shares`: as given, else split by weight bytes); on the CPU
    unchanged (each engine's KV cache is sized from its own shape)."""
    from specprefill.engines.vllm import sizing  # lazy: vLLM only for this engine

    if sizing.is_cpu():
        return params
    base_util, spec_util = sizing.gpu_shares(
        lambda: sizing.model_shape(base_path),
        lambda: sizing.model_shape(spec_path),
        {"gpu_memory_utilization": params.gpu_memory_utilization, "tensor_parallel_size": params.tensor_parallel_size},
        {
            "gpu_memory_utilization": params.speculator_gpu_memory_utilization,
            "tensor_parallel_size": params.speculator_tensor_parallel_size,
        },
    )
    return dataclasses.replace(params, gpu_memory_utilization=base_util, speculator_gpu_memory_utilization=spec_util)


def open_scorer(
    model_path: str,
    engine: str,
    look_ahead: int,
    params: EngineParams | None = None,
    max_prompt_tokens: int | None = None,
) -> Scorer:
    """A scorer of the resolved model `model_path` on `engine` ("hf": transformers fp32 on the CPU; "vllm": a vLLM
    engine of that model alone, started from `params` as `capture_params` gives them; without a max_model_len there,
    `max_prompt_tokens` + look-ahead within the model's context, else the model's context)."""
    if engine not in ENGINES:
        raise SpecPrefillError(f"scoring engine {engine!r} is unknown: use one of {', '.join(ENGINES)}")
    if engine == "hf":
        from specprefill.engines.hf import hf_capture  # lazy: transformers' model code only for this engine

        capture, tokenizer = hf_capture(model_path, look_ahead)
        return Scorer(model_path, tokenizer, lambda ids: core.ScoreCache.from_capture(ids, *capture(ids)))
    from specprefill.engines.vllm import builder  # lazy: vLLM only for this engine

    params = dataclasses.replace(params or EngineParams(), speculator=model_path)
    if params.max_model_len is None and max_prompt_tokens:
        from specprefill.engines.common import model_context  # lazy: reads the model's config only here

        params.max_model_len = min(model_context(model_path), max_prompt_tokens + look_ahead)
    speculator = builder.build_speculator(params)
    return Scorer(
        model_path,
        speculator.tokenizer,
        lambda ids: speculator.score_caches([ids], look_ahead)[0],
        lambda: builder.shutdown_llm(speculator.llm),
    )
