"""The GPU memory plan, made before any GPU job (`reproduce --prepare-only --gpu-memory-gib`): each engine's weights,
activations, runtime and KV cache per GPU for the paper profiles' models, from their shapes (published, the
registry's or their config), and the speculator's scoring memory against the longest prompt. Verified by reading
vLLM's sources and the models' configs; no GPU ran it."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

from specprefill import models
from specprefill.engines.vllm.sizing import (
    GPU_RUNTIME_GIB,
    GPU_TOTAL_UTILIZATION,
    ModelShape,
    activations_gib,
    gpu_shares,
    gpus_per_engine,
    kv_per_token_bytes,
    model_shape,
    speculator_need,
)
from specprefill.errors import SpecPrefillError
from specprefill.models.shapes import PUBLISHED

# The paper's models, from their published config.json and checkpoint sizes (`models.shapes`, vLLM-free): the plan
# reads these where the hub (and so the config) is out of reach, e.g. `reproduce --prepare-only` without hub access.
PUBLISHED_SHAPES = {
    name: ModelShape(
        p.layers, p.kv_heads, p.head_dim, p.context, p.weight_bytes, p.checkpoint_dtype, p.hidden, p.intermediate
    )
    for name, p in PUBLISHED.items()
}


@functools.cache
def shape_for_plan(model: str) -> tuple[ModelShape, str]:
    """The model's shape and where it came from: the paper's models by their hub id take their published shape (their
    configs do not state checkpoint bytes, e.g. FP8 weights under a bfloat16 `torch_dtype`); a registry model not
    materialized yet, the registry's shape; any other model, or a local directory, its config."""
    if model in PUBLISHED_SHAPES and not Path(model).is_dir():
        return PUBLISHED_SHAPES[model], "published shape"
    return model_shape(model), "registry" if models.planned_shape(model) else "config"


@dataclass
class GpuEngine:
    """One engine's memory on each GPU (GiB), and the KV tokens that leaves against the tokens its work needs."""

    role: str
    model: str
    source: str
    tensor_parallel_size: int
    share_gib: float
    weights_gib: float
    activations_gib: float
    runtime_gib: float
    kv_gib: float
    kv_tokens: int
    needs_tokens: int
    why: str = ""  # where the share came from
    gpus: int = 1  # GPUs one copy of the engine spans (tensor x pipeline parallel)

    @property
    def fits(self) -> bool:
        return self.kv_tokens >= self.needs_tokens


def _engine_plan(role, model, kwargs, share, gpu_gib, needs_tokens) -> GpuEngine:
    shape, source = shape_for_plan(model)
    tp = int(kwargs.get("tensor_parallel_size") or 1)
    weights = shape.weight_bytes / gpus_per_engine(kwargs) / 2**30
    activations = activations_gib(shape, kwargs, needs_tokens)
    kv = share * gpu_gib - weights - activations - GPU_RUNTIME_GIB
    per_token = kv_per_token_bytes(shape, kwargs)
    tokens = max(0, int(kv * 2**30 // per_token))
    return GpuEngine(role, model, source, tp, share * gpu_gib, weights, activations, GPU_RUNTIME_GIB, kv, tokens,
                     needs_tokens, gpus=gpus_per_engine(kwargs))  # fmt: skip


def gpu_memory_plan(
    base: str, speculator: str, base_kwargs: dict, spec_kwargs: dict, gpu_gib: float, needs_tokens: int
) -> list[GpuEngine]:
    """Per GPU of `gpu_gib` GiB: each engine's share, weights, activations (an estimate for one step of
    max_num_batched_tokens), runtime overhead (an estimate) and the KV cache left, in GiB and in tokens, against
    `needs_tokens` (the longest request, or a whole batch of the batched TTFT regime); the speculator must hold a
    whole prompt. vLLM measures the real numbers when it starts; this plan is what can be known before."""
    longest = int(base_kwargs.get("max_model_len") or shape_for_plan(base)[0].context)
    need = speculator_need(shape_for_plan(speculator)[0], spec_kwargs, longest)
    base_share, spec_share = gpu_shares(
        lambda: shape_for_plan(base)[0],
        lambda: shape_for_plan(speculator)[0],
        base_kwargs,
        spec_kwargs,
        lambda: need.total_gib,
        gpu_gib,
    )
    b = _engine_plan("base", base, base_kwargs, base_share, gpu_gib, needs_tokens)
    s = _engine_plan("speculator", speculator, spec_kwargs, spec_share, gpu_gib, longest)
    if base_kwargs.get("gpu_memory_utilization") is None and spec_kwargs.get("gpu_memory_utilization") is None:
        s.why = (
            f"its need for a {longest:,}-token prompt: weights {need.weights:.1f} + KV {need.kv:.1f} + captured keys "
            f"{need.captured:.1f} + scoring {need.scoring:.1f} + activations and runtime "
            f"{need.activations + need.runtime:.1f} = {need.total_gib:.1f} GiB"
        )
        b.why = f"the rest of {GPU_TOTAL_UTILIZATION:g} of each GPU"
    else:
        s.why = b.why = "gpu_memory_utilization as set (or the rest of 0.9)"
    return [b, s]


def plan_lines(plan: list[GpuEngine], gpu_gib: float) -> list[str]:
    lines = [f"  memory per GPU ({gpu_gib:g} GiB; activations and runtime are estimates):"]
    for e in plan:
        lines.append(
            f"    {e.role:<10} {e.model.split('/')[-1]} (TP {e.tensor_parallel_size}, {e.source}): share "
            f"{e.share_gib:.1f} = weights {e.weights_gib:.1f} + activations {e.activations_gib:.1f} + runtime "
            f"{e.runtime_gib:.1f} + KV {e.kv_gib:.1f} GiB -> {e.kv_tokens:,} KV tokens, needs {e.needs_tokens:,}"
            f"{'' if e.fits else '  (DOES NOT FIT)'}"
        )
        if e.why:
            lines.append(f"      share: {e.why}")
    base, spec = plan[0], plan[-1]
    spare = spec.share_gib
    if len(plan) == 2 and spec.gpus < base.gpus:  # the speculator's GPUs hold both; the base's share is uniform
        lines.append(
            f"    the base's other {base.gpus - spec.gpus} GPUs leave ~{spare:.1f} GiB each unused (vLLM gives an "
            "engine the same share of every GPU it uses): a speculator over as many GPUs as the base "
            "(speculator tensor_parallel_size) spreads its share"
        )
    return lines


def check_gpu_plan(plan: list[GpuEngine], gpu_gib: float) -> None:
    """One line naming the fixes when an engine's KV cache cannot hold what its work needs."""
    for e in plan:
        if not e.fits:
            raise SpecPrefillError(
                f"on {gpu_gib:g} GiB GPUs the {e.role} {e.model.split('/')[-1]} has KV for {e.kv_tokens:,} tokens, "
                f"needs {e.needs_tokens:,}: use bigger GPUs (H200: --gpu-memory-gib 141), raise its "
                "gpu_memory_utilization, an FP8 KV cache (engine_args: {kv_cache_dtype: fp8}) or lower "
                "max_model_len / token_budget"
            )
