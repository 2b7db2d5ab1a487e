"""Step three of starting engines, and the one place vLLM engines are built. Every engine of the project — the
offline pair (`pair.SpecPrefillLLM`), a speculator alone, the server's async pair, lm-eval's engine — starts from one
`config.EngineParams` in one pass: plan (`planning.plan`: names resolved, engine arguments from the fields' roles,
defaults decided once, memory sized for two engines) -> check (`checks`: refusals before any engine starts) -> start
(here), so nothing needs an environment variable to start.
"""

from __future__ import annotations

import dataclasses
import weakref

from specprefill.config import EngineParams
from specprefill.engines.common import load_tokenizer
from specprefill.engines.vllm import sizing
from specprefill.engines.vllm.async_speculator import AsyncSpeculator
from specprefill.engines.vllm.checks import (
    check_base_kwargs,
    check_config,
    check_installed,
    check_memory,
    check_started,
    speculator_engine_kwargs,
)
from specprefill.engines.vllm.planning import Plan, plan
from specprefill.engines.vllm.speculator import VLLMSpeculator
from specprefill.errors import SpecPrefillError


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
    """The base `LLM`, checked for what pruned prompts need (`checks.check_started`)."""
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
