"""What runs inside vLLM's workers: the vLLM plugin's entry point (`register`, loaded in every vLLM process: the
position rewrite of `positions` and the RPCs below), the RPCs every worker answers by name (why its model cannot be
scored or pruned, its per-request SpecPrefill state, its settings) and the speculator's worker extension
(`CaptureExtension`, vLLM's `worker_extension_cls`: installs `capture`'s hooks and answers the driver's
`collective_rpc` calls). One module for both, so `capture` and `positions` need not import each other."""

from __future__ import annotations

import functools
import os
from typing import Any

import torch

from specprefill.engines.vllm import capture, positions

EXTENSION = "specprefill.engines.vllm.workers.CaptureExtension"
_REGISTERED: dict[str, bool] = {}


def register() -> None:
    """Entry point (`vllm.general_plugins`): the position rewrite and the workers' RPCs, once per process."""
    if _REGISTERED.get("done"):
        return
    positions.register()
    _patch_workers()
    _REGISTERED["done"] = True


def state_sizes(worker) -> dict:
    """Per-request state a worker holds for SpecPrefill: `llm.collective_rpc("specprefill_state_sizes")`."""
    runner = worker.model_runner
    capture = getattr(runner, "_specprefill_capture", None)
    return {
        "kept": len(runner.__dict__.get("_specprefill_kept", {})),
        "extra": len(runner.__dict__.get("_specprefill_extra", {})),
        "capture": len(capture.requests) if capture is not None else 0,
    }


def worker_settings(worker) -> dict:
    """The settings a running worker holds (`collective_rpc("specprefill_settings")`): what took effect, whatever the
    flags, defaults and platform made of them."""
    c = worker.vllm_config
    return {
        "rank": worker.rank,
        "pid": os.getpid(),  # the worker's process (an engine core's, or one of its tensor-parallel workers)
        "tensor_parallel_size": c.parallel_config.tensor_parallel_size,
        "enable_prefix_caching": c.cache_config.enable_prefix_caching,
        "max_num_seqs": c.scheduler_config.max_num_seqs,
        "max_num_batched_tokens": c.scheduler_config.max_num_batched_tokens,
        "max_model_len": c.model_config.max_model_len,
        "enforce_eager": c.model_config.enforce_eager,
        "dtype": str(c.model_config.dtype).removeprefix("torch."),
    }


def _patch_workers() -> None:
    """Every worker answers three RPCs by name (`collective_rpc` cannot ship functions without insecure pickling):
    `specprefill_refusal` (why its model's attention cannot be scored or pruned, or None),
    `specprefill_state_sizes` (its per-request SpecPrefill state) and `specprefill_settings` (`worker_settings`)."""
    from vllm.v1.worker.worker_base import WorkerBase

    WorkerBase.specprefill_refusal = capture.model_refusal
    WorkerBase.specprefill_state_sizes = state_sizes
    WorkerBase.specprefill_settings = worker_settings


class CaptureExtension:
    """Mixed into every vLLM worker of a speculator engine (`worker_extension_cls`)."""

    model_runner: Any  # the vLLM worker's own

    def specprefill_install(self) -> dict:
        """Hook every attention layer once. Returns {"layers": how many were hooked (0: the model cannot be
        speculated), "refusal": why its attention cannot be scored, or None}."""
        register()  # the entry point normally did this already in this process
        runner = self.model_runner
        layers = capture.attention_layers(runner.get_model())
        refusal = capture.attention_refusal(layers)
        state = getattr(runner, "_specprefill_capture", None)
        if state is None and refusal is None:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank  # lazy: a worker's vLLM

            state = capture.CaptureState(
                [capture.layer_rules(layer) for layer in layers], get_tensor_model_parallel_rank()
            )
            state.local_heads = layers[0].num_heads if layers else 0
            for i, layer in enumerate(layers):
                layer.register_forward_pre_hook(functools.partial(capture.pre_hook, state, i), with_kwargs=True)
            runner._specprefill_capture = state
        if state is not None and runner.cache_config.enable_prefix_caching:
            groups = runner.kv_cache_config.kv_cache_groups
            if len(groups) != 1:
                refusal = (
                    f"its KV cache has {len(groups)} groups (e.g. sliding-window and full layers), and a speculator "
                    "with prefix caching reads back one: start it without (speculator_engine_args="
                    "{'enable_prefix_caching': False}, or --speculator-engine-arg enable_prefix_caching=false)"
                )
            state.n_blocks = runner.kv_cache_config.num_blocks
            if refusal is None and state.cache_layout is None and layers:  # learned now: refused at start, not at
                try:  # the first cache hit inside a forward
                    state.cache_layout = capture.CacheLayout.probe(layers[0], state.n_blocks)
                except RuntimeError as exc:
                    refusal = (
                        f"its KV cache cannot be read back ({exc}), and a speculator with prefix caching reads it: "
                        "start it without (speculator_engine_args={'enable_prefix_caching': False}, or "
                        "--speculator-engine-arg enable_prefix_caching=false)"
                    )
        return {"layers": state.n_layers if state is not None else len(layers), "refusal": refusal}

    def specprefill_memory(self) -> dict:
        """What sizes the speculation budget: memory free now, and the bytes one held prompt token costs on this
        rank (its keys in every hooked layer, in the model's dtype)."""
        runner = self.model_runner
        layers = capture.attention_layers(runner.get_model())
        dtype = runner.model_config.dtype
        per_token = sum(layer.num_kv_heads * layer.head_size for layer in layers) * torch.finfo(dtype).bits // 8
        first = layers[0]
        return {
            "free": capture.free_bytes(runner.device),
            "per_token": per_token,
            "heads": first.num_heads,
            "kv_heads": first.num_kv_heads,
            "head_size": first.head_size,
        }

    def specprefill_collect(self, uids: list[str]) -> dict:
        return self.model_runner._specprefill_capture.collect(list(uids))

    def specprefill_peak_bytes(self, reset: bool = False) -> int:
        """Peak extra memory of speculation on this rank since the last reset: keys held, running scores and the
        temporaries of scoring."""
        state = self.model_runner._specprefill_capture
        peak = state.peak_bytes
        if reset:
            state.peak_bytes = 0
        return peak
