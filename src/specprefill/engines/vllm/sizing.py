"""How big the two engines of SpecPrefill are, so both start side by side with no environment variables.

CPU: each engine gets an explicit KV budget (`kv_cache_memory_bytes`) of `kv_sequences` sequences of
`max_model_len` tokens, computed from the model's shape and dtype; vLLM's own default would reserve 0.92 of RAM per
engine and the second engine could not start. `VLLM_CPU_KVCACHE_SPACE`, when set, still wins (vLLM applies it).
GPU: the device memory share (`gpu_memory_utilization`) is split between base and speculator by weight bytes.
Explicit engine arguments always win.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.metadata
import math
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch

from specprefill import core, hardware, models
from specprefill.engines.common import model_errors
from specprefill.errors import SpecPrefillError

DEFAULT_KV_SEQUENCES = 4
# CPU, one rank: the worker runs inside vLLM's engine-core process instead of a process of its own (vLLM-CPU turns
# "uni" into "mp"; naming the class keeps it). One Python + torch + vLLM process less per engine: ~0.6 GiB each.
IN_ENGINE_PROCESS = "vllm.v1.executor.uniproc_executor.UniProcExecutor"
GPU_TOTAL_UTILIZATION = 0.9
KV_SLACK_TOKENS = 512  # block rounding and the look-ahead tokens
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float8": 1}
GPU_RUNTIME_GIB = 1.5  # per engine and GPU besides weights, activations and KV: CUDA context, NCCL, CUDA graphs
DEFAULT_STEP_TOKENS = 8192  # tokens per forward step when max_num_batched_tokens is not set (vLLM's chunk)


@dataclass
class ModelShape:
    layers: int
    kv_heads: int
    head_dim: int
    context: int
    weight_bytes: int
    checkpoint_dtype: str
    hidden: int = 0
    intermediate: int = 0

    def kv_bytes_per_token(self, dtype: str, tensor_parallel_size: int = 1) -> int:
        """K and V of one token on one rank (KV heads are split across ranks, or replicated when fewer)."""
        kv = max(1, math.ceil(self.kv_heads / tensor_parallel_size))
        return (
            2 * self.layers * kv * self.head_dim * (DTYPE_BYTES.get(dtype) or DTYPE_BYTES.get(self.checkpoint_dtype, 2))
        )


def model_shape(path: str) -> ModelShape:
    """The shape a plan needs: from the model's config, or, for a registry model not materialized yet, from the
    registry (nothing is downloaded to plan)."""
    planned = models.planned_shape(path)
    if planned is not None:
        return _shape(SimpleNamespace(**planned), planned["dtype"], planned["weight_bytes"])
    from transformers import AutoConfig

    with model_errors(path):
        cfg = AutoConfig.from_pretrained(path)
    text = getattr(cfg, "text_config", None) or cfg
    dtype = str(getattr(text, "dtype", None) or getattr(cfg, "torch_dtype", None) or "bfloat16").replace("torch.", "")
    quant = getattr(cfg, "quantization_config", None) or {}
    if str((quant if isinstance(quant, dict) else vars(quant)).get("quant_method", "")).startswith("fp8"):
        dtype = "float8"  # FP8 checkpoints state their compute dtype; their weights are one byte each
    folder = Path(path)  # sorted: a sum needs no order, but no listing here is left to the filesystem's
    files = sorted(folder.glob("*.safetensors")) + sorted(folder.glob("*.bin")) if folder.is_dir() else []
    if files:
        weights = sum(f.stat().st_size for f in files)
    else:  # a hub id: a transformer's parameter count from its shape
        params = text.num_hidden_layers * 12 * text.hidden_size**2 + 2 * text.vocab_size * text.hidden_size
        weights = params * DTYPE_BYTES.get(dtype, 2)
    return _shape(text, dtype, weights)


def _shape(text, dtype: str, weights: int) -> ModelShape:
    heads = text.num_attention_heads
    return ModelShape(
        text.num_hidden_layers,
        getattr(text, "num_key_value_heads", None) or heads,
        getattr(text, "head_dim", None) or text.hidden_size // heads,
        int(getattr(text, "max_position_embeddings", 0) or 0),
        weights,
        dtype,
        text.hidden_size,
        int(getattr(text, "intermediate_size", 0) or 0),
    )


def is_cpu() -> bool:
    """Whether vLLM runs on its CPU platform, by vLLM's own rule for it (`vllm.platforms.cpu_platform_plugin`:
    VLLM_TARGET_DEVICE=cpu, a CPU build's version "+cpu", or macOS) read without importing vLLM, whose import
    (~9 s on 2 cores) a parameter check or a memory plan should not pay. A test holds it to `current_platform`."""
    if os.environ.get("VLLM_TARGET_DEVICE", "cuda").lower() == "cpu" or sys.platform.startswith("darwin"):
        return True
    return "cpu" in _vllm_version()


@functools.cache
def _vllm_version() -> str:
    """The installed vLLM's version as vLLM's platform check reads it (a CPU build: "...+cpu"); "" when none is
    installed. Read once: `is_cpu` runs for every engine argument set a profile's parameter check plans."""
    try:
        return importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        try:
            return importlib.metadata.version("vllm-cpu") + "+cpu"
        except importlib.metadata.PackageNotFoundError:
            return ""


def kv_budget(shape: ModelShape, dtype: str, max_model_len: int | None, sequences: int, tp: int = 1) -> int:
    if not (max_model_len or shape.context):
        raise SpecPrefillError("the model's config gives no context length: pass max_model_len (--max-model-len)")
    tokens = (max_model_len or shape.context) + KV_SLACK_TOKENS
    return shape.kv_bytes_per_token(dtype, tp) * tokens * max(1, sequences)


def plan(
    base: str | None, speculator: str, base_kwargs: dict, spec_kwargs: dict, kv_sequences: int = DEFAULT_KV_SEQUENCES
) -> tuple[dict, dict]:
    """Engine arguments for base and speculator with memory filled in where the caller left it open
    (base None: the speculator alone; on a GPU it then keeps vLLM's default share)."""
    base_kwargs, spec_kwargs = dict(base_kwargs), dict(spec_kwargs)
    if is_cpu():
        for kw in (base_kwargs, spec_kwargs):
            if kw.get("tensor_parallel_size", 1) == 1 and kw.get("distributed_executor_backend") is None:
                kw["distributed_executor_backend"] = IN_ENGINE_PROCESS
        if os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
            return base_kwargs, spec_kwargs
        for path, kw in ((base, base_kwargs), (speculator, spec_kwargs)):
            if path is not None and kw.get("kv_cache_memory_bytes") is None:
                kw["kv_cache_memory_bytes"] = kv_budget(
                    model_shape(path),
                    kw.get("dtype", "auto"),
                    kw.get("max_model_len"),
                    kv_sequences,
                    kw.get("tensor_parallel_size", 1),
                )
        return base_kwargs, spec_kwargs
    if base is None:
        return base_kwargs, spec_kwargs
    longest = int(spec_kwargs.get("max_model_len") or model_shape(speculator).context)
    base_util, spec_util = gpu_shares(
        lambda: model_shape(base),
        lambda: model_shape(speculator),
        base_kwargs,
        spec_kwargs,
        lambda: speculator_need(model_shape(speculator), spec_kwargs, longest).total_gib,
        _device_gib(),
    )
    base_kwargs["gpu_memory_utilization"], spec_kwargs["gpu_memory_utilization"] = base_util, spec_util
    return base_kwargs, spec_kwargs


def gpus_per_engine(kwargs: dict) -> int:
    """How many GPUs one copy of an engine's weights is spread over: tensor x pipeline parallel ranks."""
    return int(kwargs.get("tensor_parallel_size") or 1) * int(kwargs.get("pipeline_parallel_size") or 1)


def gpu_shares(
    base_shape, spec_shape, base_kwargs: dict, spec_kwargs: dict, spec_need_gib=None, gpu_gib: float | None = None
) -> tuple[float, float]:
    """(base, speculator) shares of each GPU's memory: as given, the other one the rest of 0.9; neither given: the
    speculator's share is what it needs on each of its GPUs (`spec_need_gib()`, its longest prompt: `speculator_need`)
    over `gpu_gib`, the base the rest; without those, 0.9 split by the weight bytes each GPU holds.
    `base_shape`/`spec_shape`/`spec_need_gib`: callables (read only when needed)."""
    base_util, spec_util = base_kwargs.get("gpu_memory_utilization"), spec_kwargs.get("gpu_memory_utilization")
    if base_util is None and spec_util is None and spec_need_gib is not None and gpu_gib:
        spec_util = round(min(GPU_TOTAL_UTILIZATION - 0.05, max(0.02, spec_need_gib() / gpu_gib)), 3)
        base_util = round(GPU_TOTAL_UTILIZATION - spec_util, 3)
    elif base_util is None and spec_util is None:
        wb = base_shape().weight_bytes / gpus_per_engine(base_kwargs)
        ws = spec_shape().weight_bytes / gpus_per_engine(spec_kwargs)
        spec_util = round(max(0.05, GPU_TOTAL_UTILIZATION * ws / (wb + ws)), 3)
        base_util = round(GPU_TOTAL_UTILIZATION - spec_util, 3)
    elif spec_util is None:
        assert base_util is not None
        spec_util = round(GPU_TOTAL_UTILIZATION - base_util, 3)
    elif base_util is None:
        base_util = round(GPU_TOTAL_UTILIZATION - spec_util, 3)
    assert base_util is not None and spec_util is not None
    if spec_util <= 0 or base_util <= 0 or base_util + spec_util > 1:
        raise SpecPrefillError(
            f"gpu_memory_utilization {base_util} (base) + {spec_util} (speculator) must both be "
            "positive and sum to at most 1: lower one of them"
        )
    return base_util, spec_util


PROCESS_BYTES = 1 << 30  # what one more server process holds beyond weights and KV (Python, torch, vLLM, buffers)


def check_cpu_memory(plan_items: list[tuple[str, dict]], processes: int = 0, what: str = "the engines") -> None:
    """On CPU: the engines' weights (in the dtype they run in) and KV caches, and `processes` more server processes,
    must fit in the memory free now, else a one-line error naming the fix instead of an engine process killed
    halfway through its start (or, for servers started one after another, later by the OOM killer)."""
    import psutil

    if not is_cpu():
        return
    need = processes * PROCESS_BYTES
    for path, kw in plan_items:
        shape = model_shape(path)
        itemsize = DTYPE_BYTES.get(kw.get("dtype", "auto"))
        stored = DTYPE_BYTES.get(shape.checkpoint_dtype, 2)
        need += shape.weight_bytes * (itemsize or stored) // stored + int(kw.get("kv_cache_memory_bytes") or 0)
    free = int(psutil.virtual_memory().available)
    if need > free:
        raise SpecPrefillError(
            f"{what} need ~{need / 2**30:.1f} GiB (weights + KV caches) but {free / 2**30:.1f} GiB are free: "
            "lower max_model_len or kv_sequences, use a smaller model or bfloat16, or stop other engines"
        )


@contextlib.contextmanager
def engine_errors(model: str):
    """What vLLM raises at start for causes a user can fix, as one line naming the fix (the original stays chained:
    `--log-level DEBUG` prints it)."""
    try:
        yield
    except Exception as exc:
        text = f"{type(exc).__name__}: {exc}"
        if "are not supported for now" in text or "not supported by vllm" in text.lower():
            arch = re.search(r"architectures? (\[[^\]]*\])", text)
            raise SpecPrefillError(
                f"vLLM cannot run model {model!r} (architecture {arch.group(1) if arch else 'unknown'}): choose a "
                "model of a family vLLM supports (its supported-models list), or one whose transformers code vLLM "
                "can wrap"
            ) from exc
        if any(
            s in text
            for s in (
                "out of memory",
                "OutOfMemoryError",
                "MemoryError",
                "No available memory",
                "larger than the available KV cache memory",
                "Insufficient memory",
            )
        ):
            raise SpecPrefillError(
                f"not enough memory to start the engine for {model!r}: lower max_model_len or kv_sequences, set "
                "gpu_memory_utilization (GPU), use a smaller model, or stop other engines"
            ) from exc
        if type(exc).__name__ == "ValidationError" and hasattr(exc, "errors"):  # vLLM's config checks (pydantic)
            why = "; ".join(
                ".".join(map(str, e.get("loc") or ()))
                + (": " if e.get("loc") else "")
                + str(e.get("msg", "")).removeprefix("Value error, ").rstrip(".")
                for e in exc.errors()
            )
            raise SpecPrefillError(f"vLLM refused the engine arguments of {model!r}: {why}: change that flag") from exc
        if "Engine core initialization failed" in text:
            raise SpecPrefillError(
                f"the vLLM engine for {model!r} failed to start (its reason is logged above): fix what it names, "
                "or rerun with --log-level DEBUG for the full trace"
            ) from exc
        raise


@contextlib.contextmanager
def cpu_threads_env(tensor_parallel_size: int = 1, concurrent_engines: bool = False):
    """While an engine starts (its processes inherit the environment): OMP threads for the cores present and, for
    tensor parallel on CPU, one core group per rank. `concurrent_engines` (a server: speculator and base run at the
    same time on the same cores): idle OpenMP threads sleep instead of spinning (OMP_WAIT_POLICY=PASSIVE), so one
    engine's waiting threads do not take the cores the other is computing on. Values the user set are kept."""
    changes = {}
    if is_cpu():  # on GPUs vLLM splits the cores between its workers itself
        if "OMP_NUM_THREADS" not in os.environ:
            changes["OMP_NUM_THREADS"] = str(hardware.default_threads())
        if "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
            changes["VLLM_CPU_OMP_THREADS_BIND"] = hardware.threads_bind(tensor_parallel_size)
        if concurrent_engines and "OMP_WAIT_POLICY" not in os.environ:
            changes["OMP_WAIT_POLICY"] = "PASSIVE"
    saved = {k: os.environ.get(k) for k in changes}
    os.environ.update(changes)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


# ---------------------------------------------------------------- a speculator's GPU memory (its scoring included)


def _kv_dtype(kwargs: dict, shape: ModelShape) -> str:
    kv = str(kwargs.get("kv_cache_dtype") or "auto")
    if kv.startswith("fp8"):
        return "float8"
    return "bfloat16" if shape.checkpoint_dtype == "float8" else shape.checkpoint_dtype


def activations_gib(shape: ModelShape, kwargs: dict, tokens: int) -> float:
    """The largest activations of one step: hidden states and residual, the sharded MLP's two intermediates (bf16)."""
    step = int(kwargs.get("max_num_batched_tokens") or min(DEFAULT_STEP_TOKENS, tokens))
    tp = int(kwargs.get("tensor_parallel_size") or 1)
    return step * (4 * shape.hidden + 2 * shape.intermediate / tp) * 2 / 2**30


def kv_per_token_bytes(shape: ModelShape, kwargs: dict) -> float:
    """KV bytes of one token on one GPU: KV heads split over tensor ranks, layers over pipeline stages."""
    tp, pp = int(kwargs.get("tensor_parallel_size") or 1), int(kwargs.get("pipeline_parallel_size") or 1)
    return shape.kv_bytes_per_token(_kv_dtype(kwargs, shape), tp) / pp


@dataclass
class SpeculatorNeed:
    """What the speculator needs on each of its GPUs to speculate its longest prompt (GiB)."""

    tokens: int
    weights: float
    activations: float
    runtime: float
    kv: float
    captured: float  # the prompt's keys held between look-ahead steps and their fp32 scores
    scoring: float  # one key head's logits and copies while a layer is scored

    @property
    def total_gib(self) -> float:
        return self.weights + self.activations + self.runtime + self.kv + self.captured + self.scoring


def speculator_need(shape: ModelShape, kwargs: dict, longest: int, look_ahead: int = 8) -> SpeculatorNeed:
    """The speculator's memory need per GPU for a prompt of `longest` tokens plus `look_ahead` steps (the share a
    pair gives it when none is set): weights over its GPUs, one step's activations, the runtime, the KV of the prompt,
    the keys the capture holds (half the KV: keys only) with N fp32 scores per token, and scoring's temporaries."""
    tp = int(kwargs.get("tensor_parallel_size") or 1)
    kv_per_token = kv_per_token_bytes(shape, kwargs)
    heads = max(1, shape.hidden // shape.head_dim if shape.hidden else shape.kv_heads)
    kv_rank = max(1, math.ceil(shape.kv_heads / tp))
    scoring = core.score_temporaries(max(kv_rank, heads // tp), kv_rank, look_ahead, longest, shape.head_dim, 13)
    return SpeculatorNeed(
        longest,
        shape.weight_bytes / gpus_per_engine(kwargs) / 2**30,
        activations_gib(shape, kwargs, longest),
        GPU_RUNTIME_GIB,
        kv_per_token * (longest + KV_SLACK_TOKENS) / 2**30,
        (kv_per_token / 2 + 4 * look_ahead) * longest / 2**30,
        scoring / 2**30,
    )


def _device_gib() -> float | None:
    """Total memory of GPU 0 (GiB), or None without CUDA."""
    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_properties(0).total_memory / 2**30
