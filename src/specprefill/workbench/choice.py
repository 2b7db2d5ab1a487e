"""Choosing a speculator: speed and quality of each candidate beside the others, and the Pareto front.

Each experiment is a loop of resumable units (`store.run_unit`) keyed by everything that shapes its rows.
"""

from __future__ import annotations

import dataclasses

import pandas as pd

from specprefill import calibrate, models
from specprefill.config import SpecPrefillConfig
from specprefill.engines.vllm.pair import SpecPrefillLLM
from specprefill.workbench import stats, store
from specprefill.workbench.bench import Bench
from specprefill.workbench.quality import quality
from specprefill.workbench.stats import pareto
from specprefill.workbench.units import models_key, pair_context


def speculator_choice(
    engine,
    config: SpecPrefillConfig,
    speculators: list[str],
    records_by_task: dict,
    keep_rates: list[float],
    max_tokens: int,
    output_dir,
    ttft_length: int,
    ttft_keep_rate: float,
    ttft_reps: int,
    seed: int = 0,
) -> tuple[list[dict], list[dict]]:
    """Each speculator in turn with the same base (`engine` with its speculator replaced): quality at every keep
    rate (full prefill once, with the first pair; the paired differences use it) and TTFT at one length, both
    resumable. Returns (quality rows labelled by speculator, TTFT rows). Each pair is shut down before the next."""
    quality_rows, ttft_rows = [], []
    for i, name in enumerate(speculators):
        params = dataclasses.replace(engine, speculator=name)
        if engine.base is not None:
            calibrate.ensure(name, engine.base, "vllm", params)  # a calibrated:S speculator without one: made here
        llm = SpecPrefillLLM.from_params(params, config)
        try:
            variants = ([{"method": "full", "label": "full", "keep_rate": 1.0}] if i == 0 else []) + [
                {"method": "specprefill", "label": name, "keep_rate": r} for r in keep_rates
            ]
            quality_rows += quality(
                llm,
                records_by_task,
                variants,
                output_dir,
                max_tokens,
                kind="speculator_choice",
                base_config=config,
                seed=seed,
            )
            spec = {
                "speculator_name": name,
                **models_key(llm),
                "length": ttft_length,
                "keep_rate": ttft_keep_rate,
                "reps": ttft_reps,
                **{k: v for k, v in config.to_dict().items() if k != "keep_rate"},
                "speculator_params": models.param_count(llm.speculator_path),
                "base_params": models.param_count(llm.base_path),
            }
            ttft_rows += store.run_unit(
                output_dir,
                "speculator_ttft",
                spec,
                lambda: [Bench(params, config, llm).ttft(ttft_length, ttft_keep_rate, ttft_reps)],
                context=pair_context(llm),
            )
        finally:
            llm.shutdown()
    return quality_rows, ttft_rows


def speculator_table(
    quality_summary: pd.DataFrame, ttft_rows: list[dict], rows: list[dict] | None = None, keep_rate: float | None = None
) -> pd.DataFrame:
    """One row per speculator: its TTFT speedup, bound and efficiency beside its quality per task and keep rate;
    with the quality `rows`, also its quality pooled over the tasks at `keep_rate` (the TTFT's: mean, 95% interval,
    n) and whether it is on the speed-quality frontier (`pareto`)."""
    ttft = pd.DataFrame(ttft_rows)[["speculator_name", "speculator_params", "speedup", "bound", "efficiency"]]
    q = quality_summary[quality_summary["label"] != "full"].copy()
    q["cell"] = q.apply(lambda r: f"{r['score']:.1f} [{r['ci_low']:.1f}, {r['ci_high']:.1f}]", axis=1)
    wide = q.pivot_table(index="label", columns=["task", "keep_rate"], values="cell", aggfunc="first")
    wide.columns = [f"{t} @{k:g}" for t, k in wide.columns]
    table = ttft.merge(wide, left_on="speculator_name", right_index=True, how="left")
    if rows is None or keep_rate is None:
        return table
    at_rate = [{**r, "task": "pooled"} for r in rows if r["label"] != "full" and r["keep_rate"] == keep_rate]
    pooled = stats.summarize(at_rate, by=("label",))[["label", "score", "ci_low", "ci_high", "n"]]
    pooled.columns = ["speculator_name", "quality", "quality_low", "quality_high", "quality_n"]
    table = table.merge(pooled, on="speculator_name", how="left")
    return table.assign(pareto=pareto(table["speedup"], table["quality"]))
