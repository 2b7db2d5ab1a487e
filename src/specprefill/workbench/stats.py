"""Uncertainty of the quality numbers, with methods that hold at the small n of CPU runs:

- a 0/1 metric (every score 0 or the top of its scale: exact match, pass@1, needle found): Wilson's score interval
  for the proportion (never zero-width, not even at 4 of 4);
- any other metric (F1, ROUGE, overlap): a BCa bootstrap (scipy), seeded so a table is reproducible;
- the paired difference to full prefill on the same samples: Newcombe's square-and-add interval for paired
  proportions (Wilson ends, correlation-adjusted) and an exact McNemar test for 0/1 metrics, a BCa bootstrap and
  Wilcoxon's signed-rank test otherwise.

Each summary row says which interval it holds, its n, and a verdict, set before the data: "lower" / "higher" when
the paired difference's interval excludes 0, "no difference found" when it lies within +-`MARGIN` points of 0 (on
the 0-100 scale), "too few samples to separate" otherwise (`workbench.power`: the n that would decide it).
"""

from __future__ import annotations

import math
import statistics
import warnings

import numpy as np
import pandas as pd

N_BOOT = 2000
LEVEL = 0.95
Z = statistics.NormalDist().inv_cdf(0.5 + LEVEL / 2)
MARGIN = 10.0  # "no difference found": the paired difference's interval within +-MARGIN points (0-100 scale)
SAME = "no difference found"  # `verdict`'s word for it
# the one floor for every comparison (claims, baselines, board groups): where full prefill scores below it (on a 0-100
# scale), a difference to it says little about the method (the base barely answers), so the cell is not judged
FLOOR = 50.0
BELOW_FLOOR = "not judged: full prefill below the floor"
SCALE = 100.0  # quality scores are on 0-100 (a 0/1 metric scores 0 or 100)


def is_binary(values, scale: float = SCALE) -> bool:
    """Every value is 0 or the top of the scale: a 0/1 metric."""
    x = set(np.asarray(values, dtype=float).tolist())
    return bool(x) and x <= {0.0, scale}


def wilson(successes: int, n: int) -> tuple[float, float]:
    """Wilson's score interval for a proportion (on 0-1)."""
    if n == 0:
        return math.nan, math.nan
    p = successes / n
    centre = (p + Z * Z / (2 * n)) / (1 + Z * Z / n)
    half = Z * math.sqrt(p * (1 - p) / n + Z * Z / (4 * n * n)) / (1 + Z * Z / n)
    low = 0.0 if successes == 0 else max(0.0, centre - half)
    return low, 1.0 if successes == n else min(1.0, centre + half)


def _scipy_stats():
    from scipy import stats  # lazy: ~2 s to import, and a table without intervals or tests needs none of it

    return stats


def bca(values, seed: int = 0, n_boot: int = N_BOOT) -> tuple[float, float]:
    """BCa bootstrap interval of the mean; NaN ends below two values or when every value is the same (no spread:
    the bootstrap cannot say anything)."""
    x = np.asarray(values, dtype=float)
    if x.size < 2 or np.ptp(x) == 0:
        return math.nan, math.nan
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # scipy warns on degenerate resamples; NaN ends say it
        res = _scipy_stats().bootstrap(
            (x,), np.mean, confidence_level=LEVEL, n_resamples=n_boot, method="BCa", random_state=seed
        )
    return float(res.confidence_interval.low), float(res.confidence_interval.high)


def mean_ci(values, seed: int = 0, scale: float = SCALE) -> tuple[float, float, float]:
    """(mean, low, high): Wilson for a 0/1 metric on `scale`, BCa bootstrap otherwise (`interval_method`)."""
    x = np.asarray(values, dtype=float)
    if x.size == 0:
        return math.nan, math.nan, math.nan
    if is_binary(x, scale):
        low, high = wilson(int(round((x / scale).sum())), x.size)
        return float(x.mean()), low * scale, high * scale
    low, high = bca(x, seed)
    return float(x.mean()), low, high


def interval_method(values, scale: float = SCALE) -> str:
    return "Wilson" if is_binary(values, scale) else "BCa bootstrap"


def paired_difference(a, b, seed: int = 0, scale: float = SCALE) -> tuple[float, float, float, float]:
    """(mean of a - b, low, high, p-value) for paired samples: Newcombe's square-and-add interval and an exact McNemar
    test when both are 0/1 on `scale`, else a BCa bootstrap of the differences and Wilcoxon's signed-rank test."""
    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    n = a.size
    if n == 0:
        return math.nan, math.nan, math.nan, math.nan
    top = scale
    if is_binary(np.concatenate([a, b]), scale):
        x, y = a / top > 0.5, b / top > 0.5
        both, only_a, only_b = int((x & y).sum()), int((x & ~y).sum()), int((~x & y).sum())
        diff, low, high = newcombe(both, only_a, only_b, n)
        discordant = only_a + only_b
        p = _scipy_stats().binomtest(only_a, discordant, 0.5).pvalue if discordant else 1.0
        return diff * top, low * top, high * top, float(p)
    d = a - b
    low, high = bca(d, seed)
    if np.all(d == 0):
        # every pair scores the same (the bootstrap sees no spread): as strong as n concordant 0/1 pairs at b's
        # mean share, so Newcombe's interval for those (never zero-width; 35 such pairs reach "no difference found")
        _, low, high = newcombe(int(round(float(np.clip(b.mean() / top, 0, 1)) * n)), 0, 0, n)
        low, high = low * top, high * top
        p = 1.0
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            p = float(_scipy_stats().wilcoxon(d, zero_method="zsplit").pvalue)
    return float(d.mean()), low, high, p


def newcombe(both: int, only_a: int, only_b: int, n: int) -> tuple[float, float, float]:
    """(p_a - p_b, low, high) for paired proportions from the pair counts: Newcombe's square-and-add interval."""
    neither = n - both - only_a - only_b
    p1, p2 = (both + only_a) / n, (both + only_b) / n
    (l1, u1), (l2, u2) = wilson(both + only_a, n), wilson(both + only_b, n)
    margins = (both + only_a) * (only_b + neither) * (both + only_b) * (only_a + neither)
    # Newcombe's correlation term, reduced by n/2 when positive so all-concordant pairs do not give a zero width
    cross = both * neither - only_a * only_b
    phi = (max(cross - n / 2, 0.0) if cross > 0 else cross) / math.sqrt(margins) if margins else 0.0
    d_low = math.sqrt(max(0.0, (p1 - l1) ** 2 - 2 * phi * (p1 - l1) * (u2 - p2) + (u2 - p2) ** 2))
    d_high = math.sqrt(max(0.0, (u1 - p1) ** 2 - 2 * phi * (u1 - p1) * (p2 - l2) + (p2 - l2) ** 2))
    diff = p1 - p2
    return diff, max(-1.0, diff - d_low), min(1.0, diff + d_high)


def discordance(full, pruned, scale: float = SCALE) -> float:
    """A paired 0/1 sample's discordant share: pairs where exactly one of full prefill and the pruned setting is
    right (what a power calculation for the verdict rule needs, `workbench.power`)."""
    a, b = np.asarray(full, dtype=float) / scale > 0.5, np.asarray(pruned, dtype=float) / scale > 0.5
    return float((a != b).mean()) if a.size else math.nan


def verdict(row: dict, scale: float) -> str:
    """What the intervals let a reader say about a pruned setting against full prefill."""
    low, high = row.get("diff_low", math.nan), row.get("diff_high", math.nan)
    if not math.isnan(high) and high < 0:
        return "lower"
    if not math.isnan(low) and low > 0:
        return "higher"
    if not math.isnan(low + high) and -MARGIN * scale / SCALE <= low and high <= MARGIN * scale / SCALE:
        return SAME
    return "too few samples to separate"


DOC = "doc"  # the document several rows' questions share (`data.natural`): the unit every interval counts


def per_document(df: pd.DataFrame, by: tuple[str, ...], value: str = "score") -> pd.DataFrame:
    """Rows that share a document (a `doc` value: several questions asked of one document) as one row per group and
    document, `value` their mean, `index` the document, `questions` how many; other rows as they are. One document's
    questions share its difficulty, so they are not independent samples: an interval over documents is honest where
    one over questions would be too narrow."""
    if DOC not in df or df[DOC].isna().all():
        return df
    shared, alone = df[df[DOC].notna()], df[df[DOC].isna()]
    sums = {c: (c, "sum") for c in ("n_kept", "n_prompt") if c in shared}
    keys = [*by, *(["task"] if "task" in shared and "task" not in by else []), DOC]  # documents are per task
    docs = shared.groupby(keys, as_index=False, dropna=False).agg(
        **{value: (value, "mean"), "questions": (value, "size")}, **sums
    )
    docs["index"] = docs[DOC]
    return pd.concat([docs, alone], ignore_index=True)


def summarize(
    rows: list[dict],
    by: tuple[str, ...] = ("task", "label", "keep_rate"),
    value: str = "score",
    baseline: str = "full",
    pair_on: str = "index",
    scale: float = SCALE,
) -> pd.DataFrame:
    """One row per group: mean, n, 95% interval and its method; where the group's task has a `baseline` label, the
    paired difference to it (matched on `pair_on`), its interval, the paired test's p-value, whether the two groups'
    intervals overlap, and the verdict (`verdict`)."""
    df = pd.DataFrame(rows)
    if df.empty:
        return pd.DataFrame(columns=[*by, value, "n", "ci_low", "ci_high", "interval"])
    df = per_document(df, by, value)
    base = df[df["label"] == baseline] if "label" in df else df.iloc[:0]
    out = []
    for keys, g in df.groupby(list(by), sort=True):
        keys = keys if isinstance(keys, tuple) else (keys,)
        mean, low, high = mean_ci(g[value], scale=scale)
        row = dict(zip(by, keys)) | {
            value: mean,
            "n": len(g),
            "ci_low": low,
            "ci_high": high,
            "interval": interval_method(g[value], scale),
        }
        if {"n_kept", "n_prompt"} <= set(g):
            row["kept_fraction"] = g["n_kept"].sum() / g["n_prompt"].sum()
        if DOC in g and g[DOC].notna().any():
            row["questions"] = int(g["questions"].sum())  # n counts documents, this their questions
        ref = base[base["task"] == row["task"]] if "task" in row and len(base) else base
        if len(ref) and row.get("label") != baseline:
            per_doc = ref.groupby(pair_on, as_index=False)[value].mean()  # one baseline value per document
            pairs = g.merge(per_doc, on=pair_on, suffixes=("", "_base"))
            diff, d_low, d_high, p = paired_difference(pairs[value], pairs[f"{value}_base"], scale=scale)
            _, b_low, b_high = mean_ci(ref[value], scale=scale)
            row |= {
                "diff_vs_full": diff,
                "diff_low": d_low,
                "diff_high": d_high,
                "p_paired": p,
                "n_paired": len(pairs),
                "overlaps_full": bool(low <= b_high and b_low <= high) if not math.isnan(low + b_low) else None,
            }
            if is_binary(np.concatenate([pairs[value], pairs[f"{value}_base"]]), scale):
                row["discordant"] = discordance(pairs[f"{value}_base"], pairs[value], scale)
            row["verdict"] = verdict(row, scale)
        out.append(row)
    return pd.DataFrame(out)


def overlap_sentence(summary: pd.DataFrame) -> str:
    """What the intervals say (for the report): the paired difference first, the overlap of the two groups' own
    intervals as a fact beside it (overlapping intervals alone do not show that there is no difference)."""
    if "verdict" not in summary or summary["verdict"].isna().all():
        return ""
    rows = summary.dropna(subset=["verdict"])
    counts = rows["verdict"].value_counts()
    lo, hi = int(summary["n"].min()), int(summary["n"].max())
    methods = " / ".join(sorted(set(summary.get("interval", pd.Series(dtype=str)).dropna())))
    few = int(counts.get("too few samples to separate", 0))
    same = int(rows["overlaps_full"].fillna(False).astype(bool).sum())
    return (
        f"95% intervals ({methods}; n = {lo if lo == hi else f'{lo}–{hi}'} samples per cell). Paired with full "
        f"prefill on the same samples, {int(counts.get('lower', 0))} of {len(rows)} pruned settings score lower and "
        f"{int(counts.get('higher', 0))} higher with the difference's interval excluding 0; "
        f"{int(counts.get('no difference found', 0))} show no difference; for {few} there are too few samples to "
        f"separate them from full prefill. {same} of {len(rows)} have intervals that overlap full prefill's."
    )


def pareto(speed: pd.Series, quality: pd.Series) -> list[bool]:
    """Which points no other point beats on both axes (faster and at least as good, or as fast and better)."""
    points = list(zip(speed.astype(float), quality.astype(float)))
    beaten = [any((s2 >= s and q2 >= q) and (s2 > s or q2 > q) for s2, q2 in points) for s, q in points]
    return [s == s and q == q and not b for (s, q), b in zip(points, beaten)]  # NaN (missing): on no frontier
