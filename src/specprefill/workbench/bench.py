"""Benchmarks: TTFT (full vs SpecPrefill, with the Amdahl bound) and prefill rates. Serving load (QPS) is
`serve.loadtest`: real servers driven by vLLM's load generator.

Every number is measured side by side in one run: the measurements of one repetition alternate
(pipeline, full, speculator, base-on-kept), so drift on a noisy machine hits all of them alike.
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable

from specprefill import core, hardware
from specprefill.config import EngineParams, SpecPrefillConfig
from specprefill.data.synthetic import prompt_of_tokens
from specprefill.engines.vllm import builder
from specprefill.engines.vllm.pair import SpecPrefillLLM, greedy
from specprefill.engines.vllm.payloads import base_request
from specprefill.errors import SpecPrefillError

TTFT_TASKS = ("t_specprefill", "t_full", "t_spec", "t_base_kept")


def alternate(
    tasks: dict[str, Callable[[int], object]],
    reps: int,
    clock: Callable[[], float] = time.perf_counter,
    warmup: int = 1,
) -> dict[str, list[float]]:
    """Run every task once per repetition, in the given order (A B C A B C ...); unrecorded warm-up reps first."""
    times: dict[str, list[float]] = {name: [] for name in tasks}
    for rep in range(-warmup, reps):
        for name, fn in tasks.items():
            t0 = clock()
            fn(rep)
            if rep >= 0:
                times[name].append(clock() - t0)
    return times


def ttft_row(length: int, keep_rate: float, times: dict[str, list[float]], parts: dict[str, list[float]]) -> dict:
    """Medians, speedup, Amdahl bound and efficiency; per-rep speedup min-max; the pipeline's overhead breakdown.

    bound = t_full / (t_spec + t_base_kept): what a pipeline with no look-ahead, scoring or orchestration cost gets;
    spec_share = t_spec / t_full: the speculator's prefill as a share of the base's full prefill.
    """
    med = {k: statistics.median(v) for k, v in times.items()}
    speedup = med["t_full"] / med["t_specprefill"]
    bound = med["t_full"] / (med["t_spec"] + med["t_base_kept"])
    per_rep = [f / s for f, s in zip(times["t_full"], times["t_specprefill"])]
    p = {k: statistics.median(v) for k, v in parts.items()}
    return {
        "length": length,
        "keep_rate": keep_rate,
        **med,
        "speedup": speedup,
        "speedup_min": min(per_rep),
        "speedup_max": max(per_rep),
        "bound": bound,
        "efficiency": speedup / bound,
        "spec_share": med["t_spec"] / med["t_full"],
        "overhead": {
            "look_ahead_s": p["speculator_s"] - med["t_spec"],
            "scoring_s": p["scoring_s"],
            "base_in_pipeline_s": p["base_s"],
            "orchestration_s": med["t_specprefill"] - p["speculator_s"] - p["scoring_s"] - p["base_s"],
        },
        "reps": len(per_rep),
    }


class Bench:
    """Both engines, built once through the engine builder (prefix caching off, so no measurement reuses another's
    KV). `engine`: a `config.EngineParams` (speculator, base, dtype, engine arguments)."""

    def __init__(self, engine, config: SpecPrefillConfig, llm=None) -> None:
        """`llm`: a pair already built from `engine` (a notebook's), else one is built here."""
        self.engine, self.config = engine, config
        self.llm = llm if llm is not None else SpecPrefillLLM.from_params(engine, config)
        self.tokenizer = self.llm.tokenizer
        self.dtype = self.llm.dtype

    def _one_token(self, llm, inputs, params=None):
        params = params or greedy(1)
        return llm.generate(inputs, params, use_tqdm=False)

    def ttft(
        self,
        length: int,
        keep_rate: float,
        reps: int,
        clock=time.perf_counter,
        batch: int = 1,
        warmup: int = 1,
        overrides: dict | None = None,
    ) -> dict:
        """TTFT of `batch` prompts of `length` tokens prefilled together (one output token each): the pipeline, full
        prefill, the speculator alone and the base on the kept tokens, alternating per repetition after `warmup`
        unrecorded ones. `overrides`: SpecPrefill knobs over the bench's (a configuration family's)."""
        config = self.config.replace(keep_rate=keep_rate, **(overrides or {}))
        one = greedy(1)
        seed = length * 1000 + round(keep_rate * 100) * 10
        prompts = {
            rep: [prompt_of_tokens(self.tokenizer, length, seed=seed + rep + 1 + 7919 * i) for i in range(batch)]
            for rep in range(-warmup, reps)
        }
        state: dict = {"parts": {"speculator_s": [], "scoring_s": [], "base_s": []}}
        pair = self.llm.speculator.pair  # a cross-tokenizer speculator reads its own tokens of the same text
        spec_prompts = {rep: [pair.speculator_ids(p, pair.map(p)) for p in ps] for rep, ps in prompts.items()}

        def requests(ids):
            return [{"prompt_token_ids": p} for p in ids]

        def pipeline(rep):
            outs = self.llm.generate(requests(prompts[rep]), one, config=config, use_tqdm=False)
            state["pruned"] = [core.prune(p, o.specprefill.kept_indices, config) for p, o in zip(prompts[rep], outs)]
            if rep >= 0:
                for k, v in self.llm.speculator.last_timings.items():
                    state["parts"][k].append(v)
                state["parts"]["base_s"].append(outs[0].specprefill.timings["base_s"])  # one base call per batch

        def full(rep):
            self._one_token(self.llm.llm, requests(prompts[rep]), one)

        def spec(rep):
            self._one_token(self.llm.speculator.llm, requests(spec_prompts[rep]), one)

        def base_kept(rep):
            inputs, params = zip(*[base_request(p, k, config, one) for p, k in zip(prompts[rep], state["pruned"])])
            self._one_token(self.llm.llm, list(inputs), list(params))

        tasks = dict(zip(TTFT_TASKS, (pipeline, full, spec, base_kept)))
        self.llm.speculator.peak_extra_bytes(reset=True)
        times = alternate(tasks, reps, clock, warmup)
        peak = max(self.llm.speculator.peak_extra_bytes())
        return {
            **ttft_row(length, keep_rate, times, state["parts"]),
            "batch": batch,
            "warmup": warmup,
            "dtype": self.dtype,
            "spec_peak_extra_mib": round(peak / 2**20, 1),
        }


def batch_of(token_budget: int | None, length: int) -> int:
    """Requests per batch in the original's batched regime: a fixed token budget per batch (batch x length, e.g.
    128 x 4096 = 524,288); None or 0: one request at a time."""
    if not token_budget:
        return 1
    if token_budget < 0:
        raise SpecPrefillError(f"token budget {token_budget} must be positive (0 or none: one request at a time)")
    if token_budget < length:
        raise SpecPrefillError(
            f"token budget {token_budget} is smaller than a {length}-token prompt: raise the budget or drop that length"
        )
    return token_budget // length


# ---------------------------------------------------------------- prefill throughput


def prefill_rate(model: str, dtype: str, length: int, reps: int) -> dict:
    """Prefill tokens/s of one model alone on vLLM (eager, one request of `length` tokens, one output token):
    median of `reps` fresh prompts after a warm-up. The engine is shut down afterwards."""
    resolved = hardware.resolve_dtype(dtype)
    spec = builder.build_speculator(EngineParams(model, dtype=resolved, max_model_len=length + 16, kv_sequences=1))
    prompts = [prompt_of_tokens(spec.tokenizer, length, seed=7000 + rep) for rep in range(reps + 1)]
    one = greedy(1)

    def prefill(rep):
        spec.llm.generate([{"prompt_token_ids": prompts[rep + 1]}], one, use_tqdm=False)

    t = statistics.median(alternate({"prefill": prefill}, reps)["prefill"])
    builder.shutdown_llm(spec.llm)
    gc.collect()
    return {
        "model": model.rstrip("/").split("/")[-1],
        "dtype": resolved,
        "length": length,
        "prefill_s": t,
        "tokens_per_s": length / t,
        "reps": reps,
    }
