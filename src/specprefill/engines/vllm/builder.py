"""The one place engines are built from parameters: the CLI, `bench.Bench`, the experiments and the server use it.

`EngineParams` names the vLLM engine arguments of the base by vLLM's own names and those of the speculator with a
`speculator_` prefix; `engine_args` / `speculator_engine_args` carry any other vLLM engine argument. Memory left open is
filled by `sizing.plan` (inside `SpecPrefillLLM`), so nothing needs an environment variable to start.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from specprefill import core, hardware
from specprefill.engines.vllm import sizing
from specprefill.engines.vllm.engine import SHARED_ENGINE_ARGS, SpecPrefillLLM, VLLMSpeculator
from specprefill.errors import SpecPrefillError
from specprefill.models import resolve, resolve_speculator


@dataclass
class EngineParams:
    speculator: str
    base: str | None = None  # None: the speculator alone (importance only)
    dtype: str = "auto"  # hardware.auto_dtype(): bf16 only where the CPU has native bf16
    max_model_len: int | None = None  # None: the model's context
    tensor_parallel_size: int = 1
    speculator_tensor_parallel_size: int = 1
    gpu_memory_utilization: float | None = None  # None: split with the speculator by weight bytes
    speculator_gpu_memory_utilization: float | None = None
    kv_cache_memory_bytes: int | None = None  # None on CPU: kv_sequences x max_model_len tokens
    speculator_kv_cache_memory_bytes: int | None = None
    kv_sequences: int = sizing.DEFAULT_KV_SEQUENCES
    enforce_eager: bool = True  # the base's; the speculator always runs eager
    enable_prefix_caching: bool = False  # off: every measurement computes its own prefill
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    max_speculation_tokens: int | None = None  # prompt tokens speculated at once (bounds speculation memory)
    min_prompt_tokens: int = 0  # shorter prompts run whole
    seed: int | None = None
    engine_args: dict = field(default_factory=dict)  # more vLLM engine arguments for the base
    speculator_engine_args: dict = field(default_factory=dict)

    @classmethod
    def names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def pick(cls, namespace: dict) -> "EngineParams":
        """The fields found by name in `namespace` (a notebook's parameters, a params YAML)."""
        return cls(**{k: namespace[k] for k in cls.names() if k in namespace})

    def base_kwargs(self) -> dict:
        kwargs = {"dtype": hardware.resolve_dtype(self.dtype), "max_model_len": self.max_model_len,
                  "tensor_parallel_size": self.tensor_parallel_size, "gpu_memory_utilization": self.gpu_memory_utilization,
                  "kv_cache_memory_bytes": self.kv_cache_memory_bytes, "enforce_eager": self.enforce_eager,
                  "enable_prefix_caching": self.enable_prefix_caching, "max_num_seqs": self.max_num_seqs,
                  "max_num_batched_tokens": self.max_num_batched_tokens, "seed": self.seed, **self.engine_args}
        return {k: v for k, v in kwargs.items() if v is not None}

    def speculator_kwargs(self) -> dict:
        kwargs = {"tensor_parallel_size": self.speculator_tensor_parallel_size,
                  "gpu_memory_utilization": self.speculator_gpu_memory_utilization,
                  "kv_cache_memory_bytes": self.speculator_kv_cache_memory_bytes, **self.speculator_engine_args}
        return {k: v for k, v in kwargs.items() if v is not None}

    def validate(self) -> None:
        """Everything checkable without weights or a GPU: model names, dtype, sizes, and that vLLM knows every engine
        argument name (nothing is loaded or downloaded). One-line error naming the fix."""
        from vllm.engine.arg_utils import EngineArgs

        resolve_speculator(self.speculator, self.base, materialize_missing=False)
        if self.base is not None:
            resolve(self.base, materialize_missing=False)
        hardware.resolve_dtype(self.dtype)
        for key in ("tensor_parallel_size", "speculator_tensor_parallel_size", "kv_sequences"):
            if not isinstance(getattr(self, key), int) or getattr(self, key) < 1:
                raise SpecPrefillError(f"{key} {getattr(self, key)!r} must be an integer >= 1")
        for key in ("max_model_len", "max_speculation_tokens", "max_num_seqs", "max_num_batched_tokens"):
            value = getattr(self, key)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise SpecPrefillError(f"{key} {value!r} must be a positive integer (or null for the default)")
        for key in ("gpu_memory_utilization", "speculator_gpu_memory_utilization"):
            value = getattr(self, key)
            if value is not None and not 0 < value <= 1:
                raise SpecPrefillError(f"{key} {value!r} must be in (0, 1]")
        known = {f.name for f in dataclasses.fields(EngineArgs)}  # names only: building EngineArgs looks up the hub
        for who, kwargs in (("base", self.base_kwargs()), ("speculator", self.speculator_kwargs())):
            unknown = sorted(set(kwargs) - known)
            if unknown:
                raise SpecPrefillError(f"{who} engine argument(s) {unknown} not known to vLLM: fix the name(s) in "
                                       "engine_args / speculator_engine_args (vLLM's EngineArgs field names)")

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "resolved_dtype": hardware.resolve_dtype(self.dtype)}


def build(p: EngineParams, config: core.SpecPrefillConfig | None = None) -> SpecPrefillLLM:
    if p.base is None:
        raise SpecPrefillError("no base model given: pass base= (registry name, directory or hub id)")
    return SpecPrefillLLM(resolve(p.base), resolve_speculator(p.speculator, p.base), config,
                          min_prompt_tokens=p.min_prompt_tokens, speculator_kwargs=p.speculator_kwargs(),
                          max_speculation_tokens=p.max_speculation_tokens, kv_sequences=p.kv_sequences,
                          **p.base_kwargs())


def build_speculator(p: EngineParams) -> VLLMSpeculator:
    """The speculator alone, sized as in `build`."""
    path = resolve_speculator(p.speculator, p.base)
    base = p.base_kwargs()
    shared = {k: base[k] for k in SHARED_ENGINE_ARGS if k in base}
    _, kwargs = sizing.plan(None, path, {}, {**shared, **p.speculator_kwargs()}, p.kv_sequences)
    return VLLMSpeculator(path, p.max_speculation_tokens, **kwargs)
