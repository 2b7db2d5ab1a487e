"""Selection rules side by side (`specprefill bench selection`, notebook 10): each rule's answers on every task
and keep rate against full prefill on the same prompts (paired), the fraction of tokens it actually sent, and the
time it takes to select, measured on its own. Scores are the speculator's, computed once per prompt and shared by
every rule (`selectors.Selection`): only what a score selects changes.

Each experiment is a loop of resumable units (`store.run_unit`) keyed by everything that shapes its rows.
"""

from __future__ import annotations

import statistics
import time

import pandas as pd
import torch

from specprefill import core, structure
from specprefill.config import SELECTION_RULES, SpecPrefillConfig
from specprefill.errors import SpecPrefillError
from specprefill.workbench import likelihood, records, stats
from specprefill.workbench.quality import quality

RULES = SELECTION_RULES


def check_rules(rules: list[str]) -> None:
    if not rules:
        raise SpecPrefillError(f"no selection rule given: use names from {', '.join(RULES)}")
    records.rule_variants(rules, [])  # one-line error naming the unknown ones


def variants(rules: list[str], keep_rates: list[float]) -> list[dict]:
    """Full prefill, then every rule at every keep rate (labelled by the rule)."""
    check_rules(rules)
    return [{"method": "full", "label": "full", "keep_rate": 1.0}, *records.rule_variants(rules, keep_rates)]


def selection_quality(
    llm,
    records_by_task: dict,
    rules: list[str],
    keep_rates: list[float],
    output_dir,
    max_tokens: int,
    config: SpecPrefillConfig,
    seed: int = 0,
    fidelity: bool = False,
) -> tuple[list[dict], pd.DataFrame]:
    """Rows (one per prompt, rule and keep rate) and their summary: mean, interval, kept fraction, and the paired
    difference to full prefill with its interval; `fidelity`: the rows carry the paired fidelity measure too
    (`likelihood`)."""
    rows = quality(
        llm,
        records_by_task,
        variants(rules, keep_rates),
        output_dir,
        max_tokens,
        kind="selection",
        base_config=config,
        seed=seed,
        fidelity=fidelity,
    )
    return rows, stats.summarize(rows, by=("task", "label", "keep_rate"))


def versus(rows: list[dict], baseline: str = "chunks") -> pd.DataFrame:
    """Every other rule against `baseline` (the original's chunks) on the same prompts at the same keep rate: the
    paired difference, its interval and the verdict ("lower": the interval lies below 0)."""
    out = []
    for rate in sorted({r["keep_rate"] for r in rows if r["label"] == baseline}):
        same = [r for r in rows if r["keep_rate"] == rate and r["label"] != "full"]
        table = stats.summarize(same, by=("task", "label", "keep_rate"), baseline=baseline)
        if "diff_vs_full" in table:
            out.append(table[table["label"] != baseline].rename(columns={"diff_vs_full": f"diff_vs_{baseline}"}))
    return pd.concat(out, ignore_index=True) if out else pd.DataFrame()


def selection_seconds(
    tokenizer, prompts: list[list[int]], rules: list[str], keep_rate: float, reps: int = 5
) -> list[dict]:
    """Per rule, the median seconds one request's selection takes on this CPU (reading the prompt's structure
    included, scores given): what a rule adds to time to first token beside the speculator's pass."""
    check_rules(rules)
    out = []
    for rule in rules:
        config = SpecPrefillConfig(keep_rate=keep_rate, **RULES[rule])
        times = []
        for ids in prompts:
            importance = torch.rand(len(ids), generator=torch.Generator().manual_seed(len(ids)))
            for _ in range(reps):
                t0 = time.perf_counter()
                core.select(importance, config, structure.layout(tokenizer, ids, config))
                times.append(time.perf_counter() - t0)
        out.append(
            {
                "label": rule,
                "keep_rate": keep_rate,
                "tokens": statistics.median(map(len, prompts)),
                "select_ms": 1000 * statistics.median(times),
            }
        )
    return out


def human(result: dict) -> str:
    """`bench selection`'s result as text: each rule against full prefill, against the original's chunks, and the
    time each takes to select."""
    cols = ["task", "label", "keep_rate", "score", "n", "kept_fraction", "diff_vs_full", "diff_low", "diff_high"]
    summary = pd.DataFrame(result["summary"])
    text = summary[[c for c in cols if c in summary]].to_string(index=False, float_format=lambda v: f"{v:.3g}")
    versus = pd.DataFrame(result.get("vs_chunks") or [])
    if len(versus):
        cols = ["task", "label", "keep_rate", "score", "diff_vs_chunks", "diff_low", "diff_high", "verdict"]
        table = versus[[c for c in cols if c in versus]].to_string(index=False, float_format=lambda v: f"{v:.3g}")
        text += "\n\nagainst the original's chunks (paired, same prompts and keep rate):\n" + table
    fidelity = pd.DataFrame(result.get("fidelity") or [])
    if len(fidelity):
        table = fidelity.to_string(index=False, float_format=lambda v: f"{v:.3g}")
        text += f"\n\n{likelihood.MARGIN_NOTE}:\n{table}"
    return text + "\n\n" + pd.DataFrame(result["select_ms"]).to_string(index=False)
