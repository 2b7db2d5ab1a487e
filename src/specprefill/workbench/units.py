"""What every experiment's units share: the engines as built and the models' fingerprints in unit keys, seeds,
and the main table (summary with intervals beside every row).

Each experiment is a loop of resumable units (`store.run_unit`) keyed by everything that shapes its rows.
"""

from __future__ import annotations

import random

import pandas as pd
import torch

from specprefill import hardware, models
from specprefill.config import EngineParams
from specprefill.engines.vllm import planning
from specprefill.workbench import stats, store


def models_key(llm) -> dict:
    """The speculator's and the base's fingerprints and the dtype the engines run in (in the rows)."""
    return {
        "speculator": models.fingerprint(llm.speculator_path),
        "base": models.fingerprint(llm.base_path),
        "dtype": llm.dtype,
    }


def engine_context(params: EngineParams, plan: planning.Plan | None = None) -> dict:
    """The engines as built, for unit keys (`store.run_unit`'s context): every `EngineParams` field and both
    engines' arguments after the builder derived and sized them."""
    plan = plan or planning.plan(params)
    return {
        "engine": hardware.engine_record(params),
        "base_engine_args": plan.base_kwargs,
        "speculator_engine_args": plan.speculator_kwargs,
    }


def pair_context(llm) -> dict:
    """`engine_context` of a pair already built (its own params and plan)."""
    return engine_context(llm.params, llm.plan)


def set_seed(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)


def main_table(rows: list[dict], output_dir, params: dict, by=("task", "label", "keep_rate")) -> pd.DataFrame:
    """summary.csv (mean score, n, 95% interval and the paired difference to full prefill per group) + all rows as
    results.csv, with the params and where it ran (`hardware.machine()`) beside them."""
    store.save_table(rows, output_dir, "results", {**params, "machine": params.get("machine") or hardware.machine()})
    return store.save_table(stats.summarize(rows, by).to_dict("records"), output_dir, "summary")
