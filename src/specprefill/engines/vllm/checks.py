"""Step two of starting engines: what is refused, before any engine starts where it can be. `validate` needs neither
weights, a GPU nor a vLLM import (a parameter check, `--prepare-only`); `check_memory` and `check_config` run once a
pair is planned (`planning`), with vLLM's own checks of each engine's arguments, so a refusal costs no engine start;
the modes whose rows the hooks would misread are refused from the arguments (`speculator_engine_kwargs`,
`check_base_kwargs`) and again from the started engines' own configs (`check_started`, `check_installed`)."""

from __future__ import annotations

import ast
import dataclasses
import functools
import importlib.util
import json
from pathlib import Path

from specprefill import hardware
from specprefill.config import BACKGROUND_PREFILL, EngineParams
from specprefill.engines.vllm import positions, sizing, workers
from specprefill.engines.vllm.planning import Plan, engine_kwargs
from specprefill.errors import SpecPrefillError
from specprefill.models import resolve, resolve_speculator


@functools.cache
def engine_arg_names() -> frozenset[str]:
    """The field names of vLLM's `EngineArgs`, read from the installed vLLM's source (a dataclass of annotated
    fields): `validate` runs in `--prepare-only` and every notebook's parameter check, where importing vLLM
    (~9 s on a 2-core CPU) would be most of the cost. Where the source is not laid out so, the class's fields."""
    spec = importlib.util.find_spec("vllm")  # a top-level name: found, not imported
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    source = Path(folders[0]) / "engine" / "arg_utils.py" if folders else None
    tree = ast.parse(source.read_text()) if source is not None and source.is_file() else ast.Module([], [])
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == "EngineArgs" and not node.bases:
            fields = [n for n in node.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)]
            if fields and not any("ClassVar" in ast.unparse(f.annotation) for f in fields):
                return frozenset(f.target.id for f in fields)  # type: ignore[union-attr]
    from vllm.engine.arg_utils import EngineArgs  # lazy: only where the source above is laid out otherwise

    return frozenset(f.name for f in dataclasses.fields(EngineArgs))


def validate(p: EngineParams) -> None:
    """Everything checkable without weights or a GPU: model names, dtype, sizes, and that vLLM knows every engine
    argument name (nothing is loaded or downloaded, vLLM is not imported). One-line error naming the fix."""
    resolve_speculator(p.speculator, p.base, materialize_missing=False)
    if p.base is not None:
        resolve(p.base, materialize_missing=False)
    hardware.resolve_dtype(p.dtype)
    for key in ("tensor_parallel_size", "speculator_tensor_parallel_size", "kv_sequences"):
        if not isinstance(getattr(p, key), int) or getattr(p, key) < 1:
            raise SpecPrefillError(f"{key} {getattr(p, key)!r} must be an integer >= 1")
    if p.background_prefill not in BACKGROUND_PREFILL:
        raise SpecPrefillError(
            f"background_prefill {p.background_prefill!r} is unknown: use one of {', '.join(BACKGROUND_PREFILL)}"
        )
    if not isinstance(p.min_new_tokens, int) or isinstance(p.min_new_tokens, bool) or p.min_new_tokens < 1:
        raise SpecPrefillError(f"min_new_tokens {p.min_new_tokens!r} must be an integer >= 1 (e.g. 512)")
    for key in (
        "max_model_len",
        "max_speculation_tokens",
        "max_num_seqs",
        "max_num_batched_tokens",
        "background_tokens_per_tenant",
        "speculation_queue",
    ):
        value = getattr(p, key)
        if value is not None and (not isinstance(value, int) or value < 1):
            raise SpecPrefillError(f"{key} {value!r} must be a positive integer (or null for the default)")
    timeout = p.speculation_timeout_s
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 <= timeout < float("inf"):
        raise SpecPrefillError(f"speculation_timeout_s {timeout!r} must be a number of seconds >= 0 (0: no limit)")
    for key in ("gpu_memory_utilization", "speculator_gpu_memory_utilization"):
        value = getattr(p, key)
        if value is not None and not 0 < value <= 1:
            raise SpecPrefillError(f"{key} {value!r} must be in (0, 1]")
    known = engine_arg_names()  # names only: building EngineArgs looks up the hub
    for who, kwargs in zip(("base", "speculator"), engine_kwargs(p)):
        check_kv_transfer(kwargs.get("kv_transfer_config"), who)
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise SpecPrefillError(
                f"{who} engine argument(s) {unknown} not known to vLLM: fix the name(s) in "
                "engine_args / speculator_engine_args (vLLM's EngineArgs field names)"
            )


# KV connectors that identify KV by vLLM's request block hashes (read in vLLM 0.32's
# distributed/kv_transfer/kv_connector/v1/offloading/events.py: `req.block_hashes`), which carry the positions key
# of a pruned request (`positions.position_key`); the others key KV by token ids and could hand a pruned request's KV,
# computed at other positions, to a request with the same tokens
BLOCK_HASH_CONNECTORS = ("OffloadingConnector",)


def check_kv_transfer(config, who: str = "base") -> None:
    """Refuse a KV connector that does not key KV by vLLM's block hashes (None: no connector)."""
    if config is None:
        return
    if isinstance(config, str):
        config = json.loads(config)
    name = config.get("kv_connector") if isinstance(config, dict) else getattr(config, "kv_connector", None)
    if name is not None and name not in BLOCK_HASH_CONNECTORS:
        raise SpecPrefillError(
            f"{who}: kv_transfer_config with kv_connector {name!r} keys KV by token ids, not by vLLM's block hashes "
            "that carry a pruned request's original positions: drop it, or use one of "
            f"{', '.join(BLOCK_HASH_CONNECTORS)}"
        )


def check_memory(pl: Plan) -> None:
    """Both engines' weights and KV caches fit in the memory free now (CPU; `sizing.check_cpu_memory`)."""
    assert pl.base is not None
    sizing.check_cpu_memory([(pl.base, pl.base_kwargs), (pl.speculator, pl.speculator_kwargs)])


def check_config(engine_args) -> None:
    """vLLM's own checks of one engine's arguments (parallel sizes against the model's heads, lengths, ...), run
    before either engine of a pair starts: a refusal costs no engine start. One line naming the fix."""
    with (
        sizing.cpu_threads_env(engine_args.tensor_parallel_size),
        sizing.engine_errors(engine_args.model),
    ):
        dataclasses.replace(engine_args).create_engine_config()  # a copy: vLLM fills in defaults where it checks


def speculator_refusal(kwargs: dict) -> str | None:
    """Why a speculator with these engine arguments (or this engine config: `engine_refusal`) would score the wrong
    rows, or None."""
    if (kwargs.get("pipeline_parallel_size") or 1) > 1:
        return "pipeline parallel (each stage would score only its layers): use speculator tensor_parallel_size"
    if (kwargs.get("data_parallel_size") or 1) > 1:
        return "data parallel (each replica's workers would hold only their own requests' scores): use one replica"
    if kwargs.get("enable_dbo") or (kwargs.get("ubatch_size") or 1) > 1:
        return "dual-batch overlap / micro-batching (the hooks would see each micro-batch with the whole step's rows)"
    if kwargs.get("speculative_config"):
        return "speculative decoding (draft rows would be scored as look-ahead steps)"
    if (kwargs.get("prefill_context_parallel_size") or 1) > 1:
        return PCP_REFUSAL
    return None


# vLLM 0.32 (read, not run): with prefill context parallel each rank prefills its own segments of a prompt's tokens
# (`v1/worker/gpu/pcp_manager.py`) and samples from a gathered batch with positions of its own, while the capture
# hooks and the position rewrite take a request's rows as one contiguous run from its first cache position
PCP_REFUSAL = "prefill context parallel (each rank holds token segments, not the contiguous rows the hooks assume)"


def base_refusal(kwargs: dict) -> str | None:
    if kwargs.get("speculative_config"):
        return "speculative decoding (its drafts' positions would not follow the rewritten ones)"
    if (kwargs.get("prefill_context_parallel_size") or 1) > 1:
        return PCP_REFUSAL
    return None


def _refuse(who: str, reason: str | None) -> None:
    if reason is not None:
        raise SpecPrefillError(f"the {who} cannot run with {reason}: remove that engine argument")


def speculator_engine_kwargs(engine_kwargs: dict) -> dict:
    """The speculator's engine arguments: eager (the hooks run in eager mode), the capture extension in every
    worker. Prefix caching as asked (vLLM's default: on) on CPU, where the hooks read a cached prefix's keys back
    from the paged cache (`capture.CacheLayout`, verified by runs); off on GPUs, where that read is not verified.
    Modes whose rows the hooks would misread are refused (`speculator_refusal`)."""
    kwargs = {
        "enforce_eager": True,
        **engine_kwargs,
        "enable_prefix_caching": bool(engine_kwargs.get("enable_prefix_caching", True)) and sizing.is_cpu(),
        "worker_extension_cls": workers.EXTENSION,
    }
    if not kwargs["enforce_eager"]:
        raise SpecPrefillError("the speculator needs enforce_eager=True (its attention hooks run in eager mode)")
    _refuse("speculator", speculator_refusal(kwargs))
    return kwargs


def check_base_kwargs(kwargs: dict) -> None:
    _refuse("base", base_refusal(kwargs))


def engine_kwargs_of(vllm_config) -> dict:
    """The refusal-relevant engine arguments of a started engine (its config may come from flags or defaults)."""
    parallel = vllm_config.parallel_config
    return {
        "pipeline_parallel_size": parallel.pipeline_parallel_size,
        "data_parallel_size": parallel.data_parallel_size,
        "enable_dbo": getattr(parallel, "enable_dbo", False),
        "ubatch_size": getattr(parallel, "ubatch_size", 1),
        "speculative_config": vllm_config.speculative_config,
        "prefill_context_parallel_size": getattr(parallel, "prefill_context_parallel_size", 1),
    }


def check_started(who: str, vllm_config, model_refusals: list) -> None:
    """After an engine started: its actual config and its workers' attention (`capture.model_refusal`)."""
    kwargs = engine_kwargs_of(vllm_config)
    _refuse(who, speculator_refusal(kwargs) if who == "speculator" else base_refusal(kwargs))
    reason = next((r for r in model_refusals if r), None)
    if reason is None and who == "base":
        reason = positions.unsupported_base(vllm_config)
    if reason is not None:
        raise SpecPrefillError(
            f"the {who} model {vllm_config.model_config.model!r} cannot be used: {reason}; pick another model"
        )


def check_installed(installed: list[dict], model: str, model_config) -> None:
    """The speculator's workers after `specprefill_install` (one dict per rank)."""
    reason = next((i["refusal"] for i in installed if i["refusal"]), None)
    if reason is not None:
        raise SpecPrefillError(f"speculator {model!r} cannot be used: {reason}; pick another speculator")
    if min(i["layers"] for i in installed) == 0:
        raise SpecPrefillError(
            f"speculator {model!r} ({getattr(model_config.hf_config, 'architectures', None)}) has no vLLM "
            "Attention layers to hook: use a decoder model whose layers call vllm's Attention (e.g. Llama, Qwen2, "
            "Mistral, Gemma)"
        )
