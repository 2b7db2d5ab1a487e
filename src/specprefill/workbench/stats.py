"""Uncertainty of the quality numbers: percentile-bootstrap 95% intervals for a mean, and paired intervals for the
difference to full prefill (same samples, so the sample-to-sample spread cancels). Seeded: a table is reproducible.
"""

from __future__ import annotations

import math
from typing import cast

import numpy as np
import pandas as pd

N_BOOT = 2000
LEVEL = 0.95


def mean_ci(values, n_boot: int = N_BOOT, level: float = LEVEL, seed: int = 0) -> tuple[float, float, float]:
    """(mean, low, high) of a percentile bootstrap; low/high are NaN below two values (no spread to resample)."""
    x = np.asarray(values, dtype=float)
    if x.size == 0:
        return math.nan, math.nan, math.nan
    if x.size < 2:
        return float(x.mean()), math.nan, math.nan
    idx = np.random.default_rng(seed).integers(0, x.size, size=(n_boot, x.size))
    means = x[idx].mean(axis=1)
    tail = (1 - level) / 2 * 100
    low, high = cast(np.ndarray, np.percentile(means, [tail, 100 - tail]))  # q is a list: two values, not a scalar
    return float(x.mean()), float(low), float(high)


def summarize(
    rows: list[dict],
    by: tuple[str, ...] = ("task", "label", "keep_rate"),
    value: str = "score",
    baseline: str = "full",
    pair_on: str = "index",
) -> pd.DataFrame:
    """One row per group: mean, n, 95% interval; where the group's task has a `baseline` label, the paired
    difference to it (matched on `pair_on`), its interval, and whether the two groups' intervals overlap."""
    df = pd.DataFrame(rows)
    if df.empty:
        return pd.DataFrame(columns=[*by, value, "n", "ci_low", "ci_high"])
    base = df[df["label"] == baseline] if "label" in df else df.iloc[:0]
    out = []
    for keys, g in df.groupby(list(by), sort=True):
        keys = keys if isinstance(keys, tuple) else (keys,)
        mean, low, high = mean_ci(g[value])
        row = dict(zip(by, keys)) | {value: mean, "n": len(g), "ci_low": low, "ci_high": high}
        if {"n_kept", "n_prompt"} <= set(g):
            row["kept_fraction"] = g["n_kept"].sum() / g["n_prompt"].sum()
        ref = base[base["task"] == row["task"]] if "task" in row and len(base) else base
        if len(ref) and row.get("label") != baseline:
            per_doc = ref.groupby(pair_on, as_index=False)[value].mean()  # one baseline value per document
            pairs = g.merge(per_doc, on=pair_on, suffixes=("", "_base"))
            diff, d_low, d_high = mean_ci(pairs[value] - pairs[f"{value}_base"])
            _, b_low, b_high = mean_ci(ref[value])
            row |= {
                "diff_vs_full": diff,
                "diff_low": d_low,
                "diff_high": d_high,
                "n_paired": len(pairs),
                "overlaps_full": bool(low <= b_high and b_low <= high) if not math.isnan(low + b_low) else None,
            }
        out.append(row)
    return pd.DataFrame(out)


def overlap_sentence(summary: pd.DataFrame) -> str:
    """What the intervals say (for the report): the paired difference first, the overlap of the two groups' own
    intervals as a fact beside it (overlapping intervals alone do not show that there is no difference)."""
    if "overlaps_full" not in summary or summary["overlaps_full"].isna().all():
        return ""
    rows = summary.dropna(subset=["overlaps_full"])
    worse, better = int((rows["diff_high"] < 0).sum()), int((rows["diff_low"] > 0).sum())
    same = int(rows["overlaps_full"].astype(bool).sum())
    lo, hi = int(summary["n"].min()), int(summary["n"].max())
    return (
        f"95% bootstrap intervals (n = {lo if lo == hi else f'{lo}–{hi}'} samples per cell). Paired with full "
        f"prefill on the same samples, {worse} of {len(rows)} pruned settings score lower and {better} higher "
        f"with the difference's interval excluding 0; for the other {len(rows) - worse - better} the data cannot "
        f"tell them apart at this n. {same} of {len(rows)} have intervals that overlap full prefill's."
    )
