"""Step one of starting engines: from one `config.EngineParams`, the pair's resolved models and both engines'
arguments (read off the fields' roles, defaults decided once, memory sized for two engines: `sizing.plan`), before
anything is checked (`checks`) or started (`builder`)."""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass

from specprefill import hardware, tokenmap
from specprefill.config import EngineParams
from specprefill.engines.common import load_tokenizer, model_context
from specprefill.engines.vllm import positions, sizing, workers
from specprefill.models import resolve, resolve_speculator

# given to the speculator too when set for the base (the same text must tokenize and run the same way in both)
SHARED_ENGINE_ARGS = (
    "dtype",
    "max_model_len",
    "seed",
    "trust_remote_code",
    "tokenizer_mode",
    "download_dir",
    "enable_prefix_caching",
)
FIELDS = {f.name: f for f in dataclasses.fields(EngineParams)}


def prepare_vllm() -> None:
    if os.environ.get("VLLM_LOGGING_LEVEL") == "WARNING":  # vLLM imported before specprefill set it: quiet it too
        logging.getLogger("vllm").setLevel(logging.WARNING)
    positions.check_vllm_version()
    workers.register()  # the entry point does this too; in-process it may not have run yet
    if sizing.is_cpu():
        inspect_models_in_process()


def inspect_models_in_process() -> None:
    """The first time vLLM meets a model class it inspects it in a new Python process (a vLLM import: ~10 s here, per
    architecture), so as not to initialize CUDA in the caller; the result is cached on disk. Without CUDA there is
    nothing to protect: on CPU the inspection runs in this process, with the same result and cache."""
    from vllm.model_executor.models import registry

    registry._run_in_subprocess = _call


def _call(fn):
    return fn()


def engine_kwargs(p: EngineParams) -> tuple[dict, dict]:
    """vLLM engine arguments of the base and of the speculator, read off the fields' roles (unset fields: vLLM's
    defaults). The dtype is resolved (`hardware.resolve_dtype`); an unset `enforce_eager` is True on CPU unless a
    compilation setting was given."""
    base: dict = {}
    spec: dict = {}
    for name, f in FIELDS.items():
        value, role = getattr(p, name), f.metadata["role"]
        target = spec if role == "speculator" else base if role in ("base", "both") else None
        if target is None or value is None:
            continue
        if isinstance(value, dict):  # engine_args / speculator_engine_args
            target.update(value)
        else:
            target[name.removeprefix("speculator_") if role == "speculator" else name] = value
    base["dtype"] = hardware.resolve_dtype(p.dtype)
    compile_asked = {"compilation_config", "optimization_level"} & set(p.engine_args)
    if p.enforce_eager is None and sizing.is_cpu() and not compile_asked:
        base["enforce_eager"] = True
    return base, spec


@dataclass
class Plan:
    """A pair's resolved models and engine arguments, before any engine starts."""

    params: EngineParams
    base: str | None  # resolved path; None: the speculator alone
    speculator: str
    base_kwargs: dict
    speculator_kwargs: dict


def is_cross_pair(speculator: str, base: str | None) -> bool:
    return (
        base is not None
        and speculator != base
        and not tokenmap.same_tokenizer(load_tokenizer(speculator), load_tokenizer(base))
    )


def plan(p: EngineParams, alone: bool = False) -> Plan:
    """Resolve the names, derive both engines' arguments and fill in memory (`sizing.plan`). `SHARED_ENGINE_ARGS`
    set for the base reach the speculator; a speculator with another tokenizer may need more tokens for the same
    text: its max_model_len is twice the base's (within its own context) unless set. `alone`: the speculator is the
    only engine (the base, if named, only resolves self:K and maps tokens)."""
    prepare_vllm()
    base = resolve(p.base) if p.base is not None else None
    spec = resolve_speculator(p.speculator, p.base)
    base_kwargs, spec_kwargs = engine_kwargs(p)
    shared = {k: base_kwargs[k] for k in SHARED_ENGINE_ARGS if k in base_kwargs}
    unset = "max_model_len" in shared and "max_model_len" not in spec_kwargs
    if unset and is_cross_pair(spec, base_kwargs.get("tokenizer") or base):
        shared["max_model_len"] = min(2 * shared["max_model_len"], model_context(spec))
    spec_kwargs = {**shared, **spec_kwargs}
    if base is None or alone:
        _, spec_kwargs = sizing.plan(None, spec, {}, spec_kwargs, p.kv_sequences)
        return Plan(p, base, spec, {}, spec_kwargs)
    base_kwargs = {"disable_log_stats": False, **base_kwargs}  # stats give per-request TTFT
    base_kwargs, spec_kwargs = sizing.plan(base, spec, base_kwargs, spec_kwargs, p.kv_sequences)
    return Plan(p, base, spec, base_kwargs, spec_kwargs)
