"""Speculator-base agreement: how well each speculator's token importance (per layer, and as chosen) matches the
base's own.

Each experiment is a loop of resumable units (`store.run_unit`) keyed by everything that shapes its rows.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import pandas as pd
import torch

from specprefill import core, hardware, models, tokenmap
from specprefill.config import EngineParams, SpecPrefillConfig
from specprefill.engines import scoring
from specprefill.engines.common import load_tokenizer, tokenize_prompt
from specprefill.models import resolve
from specprefill.models.self_speculation import carried_heads
from specprefill.workbench import stats, store


def agreement(
    speculators: Sequence[str],
    base: str,
    texts: list[str],
    keep_rates: list[float],
    config: SpecPrefillConfig,
    output_dir,
    scorer: str = "hf",
    params: EngineParams | None = None,
) -> list[dict]:
    """Speculator vs base attention, per speculator (one unit each): for every pair of layers, the original analysis'
    KL and Kendall tau (`kl`, `tau`) and the project's variants (`kl_importance`, `tau_values`) of the two layers'
    importance over the prompt (`core.layer_agreement`; rows with `spec_layer`, `base_layer`), and per keep rate the
    top-k Jaccard of the two final importance vectors beside a random scorer's (rows with `keep_rate`). Importance
    is the base's tokens' (a speculator with another tokenizer is moved onto them, `tokenmap`). Each model is scored
    alone by `scorer` ("hf": transformers on the CPU, the oracle; "vllm": the workers' capture, the base with its own
    tensor-parallel width from `params`), one engine at a time."""
    base_path = resolve(base)
    params = params or EngineParams(speculator=base, base=base)
    base_ids = [tokenize_prompt(load_tokenizer(base_path), t) for t in texts]
    longest = max(map(len, base_ids), default=1)
    # scored once, and only if some speculator's unit has to be computed
    base_importance = functools.cache(lambda: _score_base(base_path, base_ids, scorer, config, params))

    def compute(speculator: str, spec_path: str) -> list[dict]:
        b = base_importance()
        role = scoring.capture_params(params, spec_path, "speculator")
        spec_config = config.with_heads(carried_heads(spec_path))  # a calibrated speculator's own heads
        # a speculator with another tokenizer may need more tokens for the same text
        spec_scorer = scoring.open_scorer(spec_path, scorer, config.look_ahead, role, 2 * longest)
        try:
            pair = tokenmap.Pair(spec_scorer.tokenizer, b["tokenizer"])
            out = []
            for i, ids in enumerate(b["ids"]):
                tmap = pair.map(ids)
                cache = spec_scorer(pair.speculator_ids(ids, tmap))
                layers, final = cache.layer_importance(spec_config), cache.importance(spec_config)
                if tmap is not None:
                    layers = torch.stack([tmap.project(x, config.cross_token_agg) for x in layers])
                    final = tmap.project(final, config.cross_token_agg)
                out += _prompt_rows(i, (layers, final), (b["layers"][i], b["final"][i]), keep_rates)
            return [{"speculator": speculator, **r} for r in out]
        finally:
            spec_scorer.close()

    rows = []
    for speculator in speculators:
        spec_path = models.resolve_speculator(speculator, base)
        spec = _unit_spec(spec_path, base_path, texts, keep_rates, config, scorer, params)
        rows += store.run_unit(output_dir, "agreement", spec, functools.partial(compute, speculator, spec_path))
    return rows


def _unit_spec(spec_path, base_path, texts, keep_rates, config: SpecPrefillConfig, scorer, params) -> dict:
    """What one speculator's agreement unit is keyed by."""
    return {
        "speculator_model": models.fingerprint(spec_path),
        "base": models.fingerprint(base_path),
        "scorer": scorer,
        "prompts": len(texts),
        "texts": store.digest(texts),
        "keep_rates": list(keep_rates),
        "layer_metrics": list(core.LAYER_METRICS),  # what the rows hold (units of earlier definitions are redone)
        **{k: v for k, v in config.to_dict().items() if k != "keep_rate"},
        **({"engine_params": hardware.engine_record(params)} if scorer == "vllm" else {}),
    }


def _score_base(base_path: str, base_ids: list[list[int]], engine: str, config: SpecPrefillConfig,
                params: EngineParams) -> dict:  # fmt: skip
    """The target: the base's per-layer and final importance over every head of it, for each prompt, reduced as
    scored (a large base's raw scores are not all held at once)."""
    base_config = config.replace(score_heads="all")
    role = scoring.capture_params(params, base_path, "base")
    scorer = scoring.open_scorer(base_path, engine, config.look_ahead, role, max(map(len, base_ids), default=1))
    layers, final = [], []
    try:
        for ids in base_ids:
            cache = scorer(ids)
            layers.append(cache.layer_importance(base_config))
            final.append(cache.importance(base_config))
    finally:
        scorer.close()
    return {"tokenizer": scorer.tokenizer, "ids": base_ids, "layers": layers, "final": final}


def _prompt_rows(i: int, spec: tuple, base: tuple, keep_rates: list[float]) -> list[dict]:
    """Prompt i's rows from the speculator's and the base's (per-layer, final) importance on the base's tokens: every
    `core.LAYER_METRICS` (the original's KL and tau, the project's variants) for every pair of layers, and per keep
    rate the top-k Jaccard and overlap of the final ones beside a random scorer's Jaccard (seeded by the prompt)."""
    (layers, final), (base_layers, base_final) = spec, base
    matrices = core.layer_agreement(layers, base_layers)
    n_spec, n_base = matrices["kl"].shape
    out = [
        {"prompt": i, "spec_layer": a, "base_layer": c, **{k: float(m[a, c]) for k, m in matrices.items()}}
        for a in range(n_spec)
        for c in range(n_base)
    ]
    n = len(final)
    rand = torch.rand(n, generator=torch.Generator().manual_seed(i))
    for rate in keep_rates:
        k = core.n_to_keep(n, rate)
        out.append(
            {
                "prompt": i,
                "n_prompt": n,
                "keep_rate": rate,
                "jaccard": core.top_k_jaccard(final, base_final, k),
                "random_jaccard": core.top_k_jaccard(rand, base_final, k),
                "overlap": core.top_k_overlap(final, base_final, k),
            }
        )
    return out


def agreement_summary(rows: list[dict]) -> list[dict]:
    """Per speculator and keep rate: mean top-k Jaccard with the base (and a random scorer's) with n and 95%
    intervals, and the speculator's best and last layer by Kendall tau with the base's last layer."""
    df = pd.DataFrame(rows)
    topk, layers = df[df["keep_rate"].notna()], df[df["spec_layer"].notna()]
    out = []
    for (name, rate), g in topk.groupby(["speculator", "keep_rate"], sort=False):
        row = {"speculator": name, "keep_rate": rate, "n": len(g)}
        for col in ("jaccard", "random_jaccard"):
            row[col], row[f"{col}_low"], row[f"{col}_high"] = stats.mean_ci(g[col])
        own = layers[layers["speculator"] == name]
        last_base = own[own["base_layer"] == own["base_layer"].max()].groupby("spec_layer")["tau"].mean().dropna()
        best = last_base.idxmax() if len(last_base) else None
        row["best_layer_tau"] = float(last_base.max()) if best is not None else None
        row["best_layer"] = int(best) if best is not None else None
        out.append(row)
    return out


def layer_matrices(rows: list[dict]) -> dict[str, dict[str, pd.DataFrame]]:
    """Per speculator: a [speculator layer x base layer] matrix per `core.LAYER_METRICS` key, averaged over
    prompts."""
    df = pd.DataFrame(rows)
    layers = df[df["spec_layer"].notna()].astype({"spec_layer": int, "base_layer": int})
    return {
        name: {
            m: g.pivot_table(index="spec_layer", columns="base_layer", values=m, aggfunc="mean")
            for m in core.LAYER_METRICS
        }
        for name, g in layers.groupby("speculator", sort=False)
    }
