"""The verdict sentences of the report's sections (TTFT, QPS, agreement) and the one rule every claim is decided by
(`DECIDED`), each computed from a notebook's summary rows."""

from __future__ import annotations

import pandas as pd

# The one verdict rule of every claim: "reproduced in shape" only when each cell the claim rests on is decided by its
# interval (a quality cell's paired difference separates from full prefill or its interval is narrow enough to show
# no difference; an agreement cell's lower bound clears chance); "not reproduced" when a decided cell contradicts
# the paper; otherwise "too few samples to tell" -- whatever the means say.
DECIDED = {"no difference found", "higher"}


def _spread(g: pd.DataFrame) -> tuple[list[bool], list[bool]]:
    """Per step between neighbouring keep rates of one curve (rising keep rate): whether the speedup falls beyond
    the repetitions' spread (the lower rate's slowest repetition above the higher rate's fastest), and whether it
    rises beyond it. Without a recorded spread (one repetition) each step is taken at its median."""
    g = g.sort_values("keep_rate")
    low = g["speedup_min"] if "speedup_min" in g else g["speedup"]
    high = g["speedup_max"] if "speedup_max" in g else g["speedup"]
    low, high = low.fillna(g["speedup"]).tolist(), high.fillna(g["speedup"]).tolist()
    falls = [low[i] > high[i + 1] for i in range(len(g) - 1)]
    rises = [low[i + 1] > high[i] for i in range(len(g) - 1)]
    return falls, rises


def ttft_verdict(rows: pd.DataFrame) -> str:
    """The paper's TTFT shape (§4.7): speedup falls as the keep rate rises and is above 1x at the lowest keep rate,
    in every configuration family and length with >= 3 keep rates. Decided beyond the machine's noise: a curve falls
    when each step's repetitions separate (`_spread`), does not when one step rises beyond them or its lowest keep
    rate's slowest repetition is not above 1x; overlapping spreads decide nothing (more repetitions would)."""
    curves = [g for _, g in rows.groupby(["label", "length"]) if g["keep_rate"].nunique() >= 3]
    if not curves:
        return "too few keep rates to tell (fewer than 3 per family and length)"
    steps = [_spread(g) for g in curves]
    lowest = rows["keep_rate"].min()
    slowest = [g.loc[g["keep_rate"].idxmin(), "speedup_min" if "speedup_min" in g else "speedup"] for g in curves]
    above = [float(v) > 1 for v in pd.Series(slowest).fillna(0)]
    falling = [all(f) for f, _ in steps]
    rising = [any(r) for _, r in steps]
    spread = ", ".join(
        f"{lab} at {int(n)}: {float(g['speedup_min'].min()):.2f}–{float(g['speedup_max'].max()):.2f}×"
        for (lab, n), g in rows.groupby(["label", "length"])
        if {"speedup_min", "speedup_max"} <= set(g) and g["speedup_min"].notna().all()
    )
    reps = f" (repetitions' spread: {spread})" if spread else " (one repetition per cell: no spread recorded)"
    if all(falling) and all(above):
        return (
            f"reproduced in shape: in all {len(curves)} family × length curves speedup falls as the keep rate rises "
            f"beyond the repetitions' spread and is above 1× at keep {lowest:g}{reps}"
        )
    if any(rising) or not all(above):
        return (
            f"not reproduced in shape: speedup rises with the keep rate beyond the spread in {sum(rising)} of "
            f"{len(curves)} curves, is not above 1× at keep {lowest:g} in {len(curves) - sum(above)}{reps}"
        )
    return (
        f"too few repetitions to tell: in {len(curves) - sum(falling)} of {len(curves)} curves neighbouring keep "
        f"rates' repetitions overlap{reps}"
    )


def length_verdict(rows: pd.DataFrame) -> str:
    """Speedup against the prompt length at the lowest keep rate under a constant token budget (the original's
    context-scaling runs): grows, flat or shrinks, per family."""
    low = rows[rows["keep_rate"] == rows["keep_rate"].min()]
    trends = []
    for label, g in low.groupby("label"):
        if g["length"].nunique() < 2:
            continue
        g = g.sort_values("length")
        first, last = float(g["speedup"].iloc[0]), float(g["speedup"].iloc[-1])
        word = "grows" if last > 1.05 * first else "shrinks" if last < first / 1.05 else "is flat"
        trends.append(
            f"{label}: {word} ({first:.2f}× at {int(g['length'].iloc[0])} → {last:.2f}× at "
            f"{int(g['length'].iloc[-1])} tokens)"
        )
    if not trends:
        return "one length only: no trend to tell"
    return "speedup at keep {:g} vs length — ".format(float(low["keep_rate"].iloc[0])) + "; ".join(trends)


def qps_verdict(table: pd.DataFrame) -> str:
    """Figure 2's shape: SpecPrefill sustains a higher max QPS in every category, the gain largest at the lowest
    keep rate (multi-doc QA, 10%) and smallest at the highest (summarization, 50%). A category cannot tell where both
    servers sustained the grid's top rate, or where neither sustained its lowest (a machine too slow for the grid:
    equal zeros say nothing of the servers); one where only SpecPrefill sustained any rate counts as higher."""
    capped = table.get("top_rate_sustained", pd.Series(["-"] * len(table))).astype(str)
    both = capped.str.contains("vllm") & capped.str.contains("specprefill")
    neither = (table["max_qps_vllm"] <= 0) & (table["max_qps_specprefill"] <= 0)
    higher = table["max_qps_specprefill"] > table["max_qps_vllm"]
    untold = both | neither
    told = table[~untold]
    top, bottom = (", ".join(table.loc[m, "category"]) for m in (both, neither))  # "" where none
    notes = [f"{top}: both sustained every rate tried"] if top else []
    notes += [f"{bottom}: neither sustained the lowest rate tried"] if bottom else []
    if told.empty:
        fixes = ([f"higher rates to {top}"] if top else []) + ([f"lower rates to {bottom}"] if bottom else [])
        return f"cannot tell in any category ({'; '.join(notes)}): add {' and '.join(fixes)}"
    note = f" ({'; '.join(notes)})" if notes else ""
    wins = int(higher[~untold].sum())
    if wins < len(told):
        of = f"{len(told)} categor{'y' if len(told) == 1 else 'ies'}"
        return f"not reproduced: SpecPrefill's max QPS is higher in {wins} of {of}{note}"
    gains = told.sort_values("keep_rate")["gain"]
    ordered = gains.notna().all() and gains.is_monotonic_decreasing
    return (
        "reproduced in shape: SpecPrefill sustains more QPS in "
        + ("every category" if not note else "each category the grid tells")
        + note
        + (", the gain falling as the keep rate rises (as in Figure 2)" if ordered and len(told) > 1 else "")
    )


def agreement_verdict(summary: pd.DataFrame) -> str:
    """The original's agreement analysis: the speculators' top-k choice overlaps the base's far above chance."""
    above = summary["jaccard_low"].fillna(summary["jaccard"]) > summary["random_jaccard"]
    names = summary["speculator"].nunique()
    n = int(summary["n"].min())
    if summary["jaccard_low"].isna().any():  # the one rule (`DECIDED`): a mean alone decides nothing
        return (
            f"too few samples to tell: no interval at n = {n} prompts per cell "
            f"(the means {'are' if bool(above.all()) else 'are not all'} above a random scorer's)"
        )
    how = "lower 95% bound above chance"
    if bool(above.all()):
        return (
            f"reproduced in shape: all {names} speculators' top-k tokens overlap the base's above a random scorer's "
            f"at every keep rate ({how}, n = {n} prompts per cell)"
        )
    bad = sorted(set(summary.loc[~above, "speculator"]))
    return f"not everywhere: {', '.join(bad)} not above chance at some keep rate (n = {n})"


def verdict_word(verdict: str) -> str:
    """A section's verdict sentence as one of the claims summary's four words."""
    if verdict.startswith("reproduced"):
        return "reproduced in shape"
    if verdict.startswith("not"):
        return "not reproduced"
    return "too few samples to tell"
