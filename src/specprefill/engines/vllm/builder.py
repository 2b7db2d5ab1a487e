"""The one place vLLM engines are built. Every engine of the project — the offline pair (`pair.SpecPrefillLLM`), a
speculator alone, the server's async pair, lm-eval's engine, the QPS comparison's plain vLLM server — comes from one
`config.EngineParams` through `plan` (names resolved, engine arguments from the fields' roles, defaults decided once,
memory sized for two engines), so nothing needs an environment variable to start.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import importlib.util
import logging
import os
import weakref
from dataclasses import dataclass
from pathlib import Path

from specprefill import hardware, tokenmap
from specprefill.config import EngineParams
from specprefill.engines.common import load_tokenizer, model_context
from specprefill.engines.vllm import positions, sizing
from specprefill.engines.vllm.async_engine import AsyncSpeculator
from specprefill.engines.vllm.requests import (
    check_base_kwargs,
    check_installed,
    check_started,
    speculator_engine_kwargs,
)
from specprefill.engines.vllm.speculator import VLLMSpeculator
from specprefill.errors import SpecPrefillError
from specprefill.models import resolve, resolve_speculator

# given to the speculator too when set for the base (the same text must tokenize and run the same way in both)
SHARED_ENGINE_ARGS = ("dtype", "max_model_len", "seed", "trust_remote_code", "tokenizer_mode", "download_dir")
FIELDS = {f.name: f for f in dataclasses.fields(EngineParams)}


def prepare_vllm() -> None:
    if os.environ.get("VLLM_LOGGING_LEVEL") == "WARNING":  # vLLM imported before specprefill set it: quiet it too
        logging.getLogger("vllm").setLevel(logging.WARNING)
    positions.check_vllm_version()
    positions.register()  # the entry point does this too; in-process it may not have run yet
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
    for key in ("max_model_len", "max_speculation_tokens", "max_num_seqs", "max_num_batched_tokens"):
        value = getattr(p, key)
        if value is not None and (not isinstance(value, int) or value < 1):
            raise SpecPrefillError(f"{key} {value!r} must be a positive integer (or null for the default)")
    for key in ("gpu_memory_utilization", "speculator_gpu_memory_utilization"):
        value = getattr(p, key)
        if value is not None and not 0 < value <= 1:
            raise SpecPrefillError(f"{key} {value!r} must be in (0, 1]")
    known = engine_arg_names()  # names only: building EngineArgs looks up the hub
    for who, kwargs in zip(("base", "speculator"), engine_kwargs(p)):
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise SpecPrefillError(
                f"{who} engine argument(s) {unknown} not known to vLLM: fix the name(s) in "
                "engine_args / speculator_engine_args (vLLM's EngineArgs field names)"
            )


def share_parallel_state() -> None:
    """Engines whose core runs in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`: the CLI's one-prompt run,
    `reproduce`'s notebook kernels on CPU, the tests) share the process's vLLM parallel state, and vLLM tears that state
    down whenever one engine core stops — breaking every other engine still running here. Installed once per process:
    the teardown waits for the last engine core of the process (the stopped one's memory is already released by its
    model runner's own shutdown, which collects garbage)."""
    from vllm.v1.engine import core

    if getattr(core, "_specprefill_shared_state", False):
        return
    live: weakref.WeakSet = weakref.WeakSet()
    init, shutdown, cleanup = core.EngineCore.__init__, core.EngineCore.shutdown, core.cleanup_dist_env_and_memory

    def tracked_init(self, *args, **kwargs):
        live.add(self)
        init(self, *args, **kwargs)

    def tracked_shutdown(self):
        live.discard(self)
        shutdown(self)

    def last_one_cleans_up(*args, **kwargs):
        if not len(live):
            cleanup(*args, **kwargs)

    core.EngineCore.__init__, core.EngineCore.shutdown = tracked_init, tracked_shutdown
    core.cleanup_dist_env_and_memory = last_one_cleans_up
    core._specprefill_shared_state = True


def start_llm(model: str, kwargs: dict):
    """A `vllm.LLM` with the project's threads (`sizing.cpu_threads_env`)."""
    from vllm import LLM

    share_parallel_state()
    with sizing.cpu_threads_env(kwargs.get("tensor_parallel_size", 1)), sizing.engine_errors(model):
        return LLM(model=model, **kwargs)


def start_async_llm(engine_args, concurrent_engines: bool = True):
    """A `vllm.v1.engine.async_llm.AsyncLLM` from `AsyncEngineArgs`."""
    from vllm.v1.engine.async_llm import AsyncLLM

    with (
        sizing.cpu_threads_env(engine_args.tensor_parallel_size, concurrent_engines=concurrent_engines),
        sizing.engine_errors(engine_args.model),
    ):
        return AsyncLLM.from_engine_args(engine_args)


def _base_tokenizer(pl: Plan):
    """The base's tokenizer as its engine loads it (a `tokenizer` engine argument included)."""
    if pl.base is None:
        return None
    path = pl.base_kwargs.get("tokenizer") or pl.base
    return load_tokenizer(path) if path != pl.speculator else None


def shutdown_llm(llm) -> None:
    llm.llm_engine.engine_core.shutdown()


def start_speculator(pl: Plan) -> VLLMSpeculator:
    kwargs = speculator_engine_kwargs(pl.speculator_kwargs)
    llm = start_llm(pl.speculator, kwargs)
    try:
        check_started("speculator", llm.llm_engine.vllm_config, [])
        check_installed(llm.collective_rpc("specprefill_install"), pl.speculator, llm.llm_engine.model_config)
    except BaseException:
        shutdown_llm(llm)
        raise
    return VLLMSpeculator(llm, pl.speculator, pl.params.max_speculation_tokens, _base_tokenizer(pl))


def start_base(pl: Plan):
    """The base `LLM`, checked for what pruned prompts need (`requests.check_started`)."""
    assert pl.base is not None
    check_base_kwargs(pl.base_kwargs)
    llm = start_llm(pl.base, pl.base_kwargs)
    try:
        check_started("base", llm.llm_engine.vllm_config, llm.collective_rpc("specprefill_refusal"))
    except BaseException:
        shutdown_llm(llm)
        raise
    return llm


def build_speculator(p: EngineParams) -> VLLMSpeculator:
    """The speculator alone (importance only), sized as in a pair."""
    pl = plan(p, alone=True)
    sizing.check_cpu_memory([(pl.speculator, pl.speculator_kwargs)])
    speculator = start_speculator(pl)
    speculator.fit_budget()
    return speculator


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


def start_pair(p: EngineParams):
    """(plan, base `LLM`, `VLLMSpeculator`) of an offline pair: the speculator starts first; the speculation budget
    is sized once both run."""
    if p.base is None:
        raise SpecPrefillError("no base model given: pass base= (registry name, directory or hub id)")
    from vllm.engine.arg_utils import EngineArgs

    pl = plan(p)
    assert pl.base is not None  # resolved from p.base
    check_base_kwargs(pl.base_kwargs)
    check_memory(pl)
    check_config(EngineArgs(model=pl.base, **pl.base_kwargs))
    from vllm import envs as vllm_envs

    share_parallel_state()
    base_tp = pl.base_kwargs.get("tensor_parallel_size", 1)
    spec_tp = speculator_engine_kwargs(pl.speculator_kwargs).get("tensor_parallel_size", 1)
    if starts_together(spec_tp, base_tp, processes=vllm_envs.VLLM_ENABLE_V1_MULTIPROCESSING):
        with sizing.cpu_threads_env(base_tp):
            speculator, base = both(
                lambda: start_speculator(pl), lambda: start_base(pl), lambda s: shutdown_llm(s.llm), shutdown_llm
            )
    else:
        speculator = start_speculator(pl)
        try:
            base = start_base(pl)
        except BaseException:
            shutdown_llm(speculator.llm)
            raise
    speculator.fit_budget()
    return pl, base, speculator


def starts_together(speculator_tp: int, base_tp: int, processes: bool) -> bool:
    """Whether a pair's two engines start at the same time: on CPU, when each engine core runs in a process of its own
    (whose first ~15 s are spent importing vLLM, one core each then) and both take the same thread environment (the
    same tensor-parallel width: a core's process reads it when it starts). One after the other: engine cores in this
    process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`), different widths, and GPUs, where each engine measures the memory
    free while it starts."""
    return processes and speculator_tp == base_tp and sizing.is_cpu()


def both(first, second, stop_first, stop_second):
    """`first()` in a thread while `second()` runs here: both results, or the error once whichever did start is
    stopped again."""
    import concurrent.futures

    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="specprefill-start") as pool:
        future = pool.submit(first)
        try:
            second_result = second()
        except BaseException:
            if future.exception() is None:
                stop_first(future.result())
            raise
        try:
            first_result = future.result()
        except BaseException:
            stop_second(second_result)
            raise
    return first_result, second_result


async def start_async_pair(pl: Plan, vllm_args=None):
    """(base `AsyncLLM`, `AsyncSpeculator`) of a planned pair, for the server. `vllm_args`: `vllm serve`'s parsed
    flags, whose engine arguments the base takes where the plan sets none."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    # no stats: the base engine's Prometheus metrics are the server's; two engines would register them twice
    spec_args = AsyncEngineArgs(
        model=pl.speculator, **{**speculator_engine_kwargs(pl.speculator_kwargs), "disable_log_stats": True}
    )
    base_args = (
        AsyncEngineArgs(model=pl.base, **pl.base_kwargs)
        if vllm_args is None
        else dataclasses.replace(AsyncEngineArgs.from_cli_args(vllm_args), **pl.base_kwargs)
    )
    check_base_kwargs(pl.base_kwargs)
    check_memory(pl)
    check_config(base_args)
    base = None
    if starts_together(spec_args.tensor_parallel_size, base_args.tensor_parallel_size, processes=True):
        with sizing.cpu_threads_env(base_args.tensor_parallel_size, concurrent_engines=True):
            llm, base = both(
                lambda: start_async_llm(spec_args), lambda: start_async_llm(base_args), _stop_async, _stop_async
            )
    else:
        llm = start_async_llm(spec_args)
    try:
        check_started("speculator", llm.vllm_config, [])
        check_installed(await llm.collective_rpc("specprefill_install"), pl.speculator, llm.model_config)
        speculator = AsyncSpeculator(llm, pl.speculator, pl.params.max_speculation_tokens, _base_tokenizer(pl))
        if base is None:
            base = start_async_llm(base_args)
        check_started("base", base.vllm_config, await base.collective_rpc("specprefill_refusal"))
        await speculator.fit_budget()
    except BaseException:
        llm.shutdown()
        if base is not None:
            base.shutdown()
        raise
    return base, speculator


def _stop_async(engine) -> None:
    engine.shutdown()
