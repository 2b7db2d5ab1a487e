"""What the machine can do, and the defaults chosen from it: dtype, threads, and the record every number carries.

The dtype rule (`auto_dtype`): on a GPU, "auto" (vLLM / the checkpoint decide); on a CPU, bfloat16 only where the
CPU computes it natively (AMX-BF16 or AVX512-BF16), float32 otherwise. Without native bf16, vLLM's CPU kernels
emulate it and prefill runs several times slower than in float32 (measured 4.7x on an AVX2-only EPYC).
Override with an explicit dtype anywhere a dtype is taken.

`SPECPREFILL_CPU_FLAGS` (space-separated) replaces the flags read from /proc/cpuinfo, for every rule here and in
the record; `scripts/avx2_emulation/` uses it to run the project as an AVX2-only CPU would.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
from functools import lru_cache

import torch

from specprefill.config import DTYPES, EngineParams
from specprefill.errors import SpecPrefillError

NATIVE_BF16_FLAGS = ("amx_bf16", "avx512_bf16")
# the flags worth naming beside a number (what vLLM's CPU kernels dispatch on)
REPORTED_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile", "amx_int8")


@lru_cache(maxsize=1)
def _cpuinfo() -> dict[str, str]:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            text = f.read()
    except OSError:
        return {}
    info: dict[str, str] = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key in ("model name", "flags", "Features") and key not in info:
            info[key] = value.strip()
    return info


def cpu_flags() -> frozenset[str]:
    if os.environ.get("SPECPREFILL_CPU_FLAGS"):
        return frozenset(os.environ["SPECPREFILL_CPU_FLAGS"].split())
    info = _cpuinfo()
    return frozenset((info.get("flags") or info.get("Features") or "").split())


def cpu_model() -> str:
    return _cpuinfo().get("model name") or platform.processor() or platform.machine()


def native_bf16(flags: frozenset[str] | set[str]) -> bool:
    return any(f in flags for f in NATIVE_BF16_FLAGS)


def auto_dtype(flags: frozenset[str] | set[str] | None = None, cuda: bool | None = None) -> str:
    """The dtype "auto" means here: "auto" on CUDA (vLLM picks), else bfloat16 iff the CPU has native bf16."""
    if cuda if cuda is not None else torch.cuda.is_available():
        return "auto"
    return "bfloat16" if native_bf16(cpu_flags() if flags is None else flags) else "float32"


def resolve_dtype(dtype: str | torch.dtype | None, flags=None, cuda: bool | None = None) -> str:
    """A dtype name for the engines: "auto"/None resolved by `auto_dtype`, anything else checked and kept."""
    name = str(dtype or "auto").replace("torch.", "")
    if name not in DTYPES:
        raise SpecPrefillError(f"dtype {dtype!r} is unknown: use one of {', '.join(DTYPES)}")
    return auto_dtype(flags, cuda) if name == "auto" else name


def torch_dtype(name: str) -> torch.dtype:
    """For the transformers engine: a resolved name ("auto" on a GPU means bfloat16 there)."""
    return getattr(torch, "bfloat16" if name == "auto" else name)


def allowed_cpus() -> list[int]:
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return list(range(os.cpu_count() or 1))


def _cpu_list(cpus: list[int]) -> str:
    if len(cpus) > 1 and cpus == list(range(cpus[0], cpus[-1] + 1)):
        return f"{cpus[0]}-{cpus[-1]}"
    return ",".join(map(str, cpus))


def threads_bind(ranks: int, cpus: list[int] | None = None) -> str:
    """vLLM-CPU's VLLM_CPU_OMP_THREADS_BIND for `ranks` workers: the allowed cores split into equal groups, one per
    rank ("0-1" for one rank on two cores, "0|1" for two). vLLM's own "auto" keeps a core in reserve, which
    halves a 2-core machine."""
    cpus = allowed_cpus() if cpus is None else cpus
    ranks = max(1, ranks)
    if len(cpus) < ranks:
        raise SpecPrefillError(
            f"tensor parallel size {ranks} needs at least {ranks} CPU cores, {len(cpus)} are "
            "allowed here: lower the tensor parallel size"
        )
    per = len(cpus) // ranks
    return "|".join(_cpu_list(cpus[i * per : (i + 1) * per]) for i in range(ranks))


def default_threads() -> int:
    """OMP threads per process when the user set none: every allowed core (vLLM alone would use 1 on CPU)."""
    return len(allowed_cpus())


def machine() -> dict:
    """What every benchmark and result records about where it ran."""
    flags = cpu_flags()
    try:  # the installed distribution's version (e.g. 0.32.0+cpu), read without importing vLLM
        vllm_version = importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        vllm_version = None
    cuda = torch.cuda.is_available()
    return {
        "cpu_model": cpu_model(),
        "cpu_flags": [f for f in REPORTED_FLAGS if f in flags],
        "cpu_flags_from": "SPECPREFILL_CPU_FLAGS" if os.environ.get("SPECPREFILL_CPU_FLAGS") else "/proc/cpuinfo",
        "native_bf16": native_bf16(flags),
        "auto_dtype": auto_dtype(flags, cuda),
        "platform": platform.platform(),
        "cpus": len(allowed_cpus()),
        "omp_num_threads": int(os.environ.get("OMP_NUM_THREADS") or default_threads()),
        "threads_bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND") or "one core group per rank (project default)",
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "vllm": vllm_version,
        "cuda": cuda,
        "gpu": torch.cuda.get_device_name(0) if cuda else None,
    }


def engine_record(params: EngineParams) -> dict:
    """An engine's parameters as recorded with results and in unit keys: its fields and the dtype `auto` resolves to
    on this machine (a unit computed in bfloat16 is not one computed in float32)."""
    return {**params.to_dict(), "resolved_dtype": resolve_dtype(params.dtype)}
