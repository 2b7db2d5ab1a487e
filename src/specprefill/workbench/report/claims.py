"""The paper's numbers (each with where it is printed) and the verdicts our numbers get beside them: per section
(TTFT, QPS, agreement) and in the claims summary at the top of the report."""

from __future__ import annotations

import html
import json
from pathlib import Path

import pandas as pd

from specprefill.config import SERVING_RULE
from specprefill.workbench import power, records, stats
from specprefill.workbench.report import render
from specprefill.workbench.report.verdicts import DECIDED, agreement_verdict, qps_verdict, ttft_verdict, verdict_word

# The paper's numbers (Liu, Chen, Zhang, ICML 2025, arXiv 2502.02789), each with where it is printed. Two kinds of
# source: what can be checked against the abstract and the two figures the original repository ships
# (figs/qps.jpg = Figure 2, figs/longbench.jpg = Figure 3), and Tables 1-2 of the paper's PDF, which neither the
# project's seed texts nor that repository carries: those are marked unchecked wherever they are shown.
UNCHECKED = "paper PDF; not in the seeds or the original repository's figures: unchecked here"
PAPER_CLAIMS = [  # (claim, paper value, where)
    ("TTFT improvement, Llama-3.1-405B-Instruct-FP8", "up to 7.66×", "abstract"),
    ("maximal end-to-end QPS on real downstream tasks, 405B-FP8", "up to 7×", "abstract; Figure 2"),
    ("LongBench average at 10% keep, 70B base", "52.74 vs 53.55 full", f"Table 1, §4.4 ({UNCHECKED})"),
    ("RULER average at 10% keep, 70B base, 64K", "90.4 vs 87.9 full", f"Table 2, §4.5 ({UNCHECKED})"),
]


# Figure 3's top axis (405B-FP8 base, 8B speculator): TTFT speedup printed per keep rate (669% / 275% / 182% / 133%)
PAPER_TTFT_405B = {0.1: 6.69, 0.3: 2.75, 0.5: 1.82, 0.7: 1.33}

# Figure 3's dashed lines: Llama-3.1-405B-Instruct-FP8 with its whole prompt, each LongBench task's score printed on
# its line (grouped by the figure's panels; which line is which task is a colour, not printed); the category mean is
# the original's per-task-then-per-category average (multi-doc QA 55.63 and few-shot 67.68 are also Figure 2's
# "405B" scores)
PAPER_LONGBENCH_405B_FULL = {
    "single-doc QA": (65.65, 56.5, 50.17, 33.32),
    "multi-doc QA": (68.3, 66.38, 51.81, 36.03),
    "summarization": (35.86, 26.55, 25.74, 18.0),
    "few-shot": (93.92, 78.5, 51.0, 47.28),
    "synthetic": (100.0, 100.0, 22.5),
    "code": (75.74, 73.01),
}


PAPER_QUALITY = [  # Table 1 (LongBench, Llama-3.1-70B base; UNCHECKED): (category, keep rate, full, SpecPrefill)
    ("single-doc QA", 0.1, 50.57, 47.64),
    ("multi-doc QA", 0.1, 53.11, 52.96),
    ("summarization", 0.1, 25.84, 21.74),
    ("few-shot", 0.1, 66.93, 64.52),
    ("synthetic", 0.1, 72.50, 66.25),
    ("code", 0.1, 52.33, 63.33),
    ("average", 0.1, 53.55, 52.74),
    ("single-doc QA", 0.3, 50.57, 49.47),
    ("multi-doc QA", 0.3, 53.11, 53.39),
    ("summarization", 0.3, 25.84, 24.41),
    ("few-shot", 0.3, 66.93, 65.83),
    ("synthetic", 0.3, 72.50, 67.83),
    ("code", 0.3, 52.33, 62.62),
    ("average", 0.3, 53.55, 53.92),
]


PAPER_BASELINES = [  # Table 1: LongBench average at ~10% keep, 70B base (UNCHECKED)
    ("RAG (10.38% kept)", 35.49),
    ("LLMLingua (~10%)", 29.85),
    ("MInference", 52.89),
    ("SpecPrefill (10%)", 52.74),
]


# Figure 2 (QPS by LongBench category, 8xH200): keep rate and timeout per category, the max-QPS gain it marks and
# the average task score above each curve (plain vLLM -> SpecPrefill)
PAPER_QPS_GAIN = [
    ("multi-doc QA", 0.1, 10, "405B-FP8", "7×", "55.63 -> 54.98"),
    ("multi-doc QA", 0.1, 10, "70B", "4.6×", "53.11 -> 53.84"),
    ("few-shot", 0.3, 20, "405B-FP8", "5×", "67.68 -> 66.95"),
    ("few-shot", 0.3, 20, "70B", "2.1×", "66.93 -> 65.72"),
    ("summarization", 0.5, 40, "405B-FP8", "plain vLLM timed out at every rate", "25.53 (SpecPrefill)"),
    ("summarization", 0.5, 40, "70B", "1.6×", "25.84 -> 25.19"),
]


def main_label(quality: pd.DataFrame) -> str:
    """The SpecPrefill rows set beside the paper: the notebook's own knobs ("specprefill"), else the configuration
    family closest to the paper's main one (chunks, pooling, the longest look-ahead)."""
    labels = set(quality["label"])
    for label in ("specprefill", *reversed(records.FAMILIES)):
        if label in labels:
            return label
    return "specprefill"


def _scale(out: Path, name: str) -> str:
    """Which models a notebook ran, and on what (the paper's are 8B-405B Llamas on 8xH200)."""
    summary = out / name / "summary.params.json"
    params = render.params(out, name) or (json.loads(summary.read_text()) if summary.exists() else {})
    speculators = params.get("speculators") or [params.get("speculator", "?")]
    machine = render.machine_record(out)[1]
    device = f"GPU {machine['gpu']}" if machine.get("gpu") else "CPU" if machine else "device not recorded"
    return f"{', '.join(map(str, speculators))} → {params.get('base', '?')}, {device}"


# a quality claim rests only on tasks where full prefill scores at least this (0-100): below it the base cannot do
# the task on this pair, and a difference to full prefill says nothing about keeping its quality
FULL_FLOOR = stats.FLOOR  # the one floor (`stats.FLOOR`)


def _quality_claim(out: Path, name: str, label: str | None = None) -> tuple[str, str] | None:
    """Ours and the verdict for a quality claim: the mean paired difference to full prefill per keep rate, from the
    summary's per-row verdicts by the one rule of every claim (`DECIDED`): any "lower" is not reproduced; reproduced
    only when every cell is decided; otherwise too few samples to tell. Only tasks where full prefill scores at
    least `FULL_FLOOR` count; the others are named. `label`: the rows of that label (a selection rule the notebook
    ran beside the paper's method, e.g. the serving default; None where it did not run it); default: the paper's
    method (`main_label`)."""
    summary = render.read(out, name, "summary.csv")
    if summary is None or not len(summary) or "diff_vs_full" not in summary:
        return None
    if label is not None and label not in set(summary["label"]):
        return None
    full = summary[summary["label"] == "full"]
    scores = dict(zip(full["task"], full["score"])) if {"task", "score"} <= set(full) else {}
    floor = sorted(t for t, v in scores.items() if v < FULL_FLOOR)
    below = f"; left out, full prefill below {FULL_FLOOR:g}: " + ", ".join(f"{t} {scores[t]:.0f}" for t in floor)
    main = label or main_label(summary)
    rows = summary[summary["label"] == main] if main in set(summary["label"]) else summary[summary["label"] != "full"]
    rows = rows.dropna(subset=["diff_vs_full"])
    if not len(rows):
        return None
    if "task" in rows:
        rows = rows[~rows["task"].isin(floor)]
    if not len(rows):
        return f"{main} vs full: no task the base can do ({_scale(out, name)}{below})", "too few samples to tell"
    diffs = "; ".join(
        f"{render.cell(float(g['diff_vs_full'].mean()))} points at keep {rate:g}"
        for rate, g in rows.groupby("keep_rate")
    )
    n = f"n = {int(rows['n'].min())}–{int(rows['n'].max())}"
    per_doc = "questions" in rows and rows["questions"].notna().any()  # n counts documents (`stats.per_document`)
    unit = " documents" if per_doc else ""
    n += f"{unit} ({int(rows['questions'].max())} questions) per cell" if per_doc else " per cell"
    tasks = f" on {', '.join(sorted(set(rows['task'])))}" if "task" in rows else ""
    ours = f"{main} vs full{tasks}: {diffs} ({n}; {_scale(out, name)}{below if floor else ''})"
    verdicts = set(rows["verdict"].dropna())
    if "lower" in verdicts:
        return ours, "not reproduced"
    if verdicts - DECIDED:
        need = power.needed(rows[~rows["verdict"].isin(DECIDED)], scores)
        return ours, "too few samples to tell" + (f" (deciding needs n ≈ {need}{unit} per cell)" if need else "")
    return ours, "reproduced in shape"


def _ttft_claim(out: Path) -> tuple[str, str] | None:
    ttft = render.read(out, "04_ttft", "summary.csv")
    if ttft is None or not len(ttft):
        return None
    if "label" not in ttft:
        ttft = ttft.assign(label="specprefill")
    low = ttft[ttft["keep_rate"] == ttft["keep_rate"].min()]
    ours = (
        f"up to {render.cell(float(low['speedup'].max()))}× at keep {float(low['keep_rate'].iloc[0]):g} "
        f"(n = {len(ttft)} measurements, {int(ttft['reps'].max()) if 'reps' in ttft else 1} timed rep each; "
        f"{_scale(out, '04_ttft')})"
    )
    return ours, verdict_word(ttft_verdict(ttft))


def _qps_claim(out: Path) -> tuple[str, str] | None:
    table = render.read(out, "05_qps", "summary.csv")
    if table is None or not len(table) or "category" not in table:
        return None
    gains = "; ".join(f"{r['category']} {render.cell(r['gain'])}×" for _, r in table.iterrows())
    ours = f"max-QPS gain {gains} (n = {len(table)} categories; {_scale(out, '05_qps')})"
    verdict = qps_verdict(table)
    return ours, "too few samples to tell" if verdict.startswith("cannot") else verdict_word(verdict)


def _agreement_claim(out: Path) -> tuple[str, str] | None:
    summary = render.read(out, "08_agreement", "summary.csv")
    if summary is None or not len(summary) or "jaccard" not in summary:
        return None
    ours = (
        f"top-k Jaccard {render.cell(float(summary['jaccard'].mean()))} vs random "
        f"{render.cell(float(summary['random_jaccard'].mean()))}"
        f" (mean over keep rates; n = {int(summary['n'].min())} prompts per cell; {_scale(out, '08_agreement')})"
    )
    if summary["jaccard_low"].isna().any():  # no interval: a mean alone cannot tell
        return ours, "too few samples to tell"
    return ours, verdict_word(agreement_verdict(summary))


# the paper's baselines (Table 1's RAG and LLMLingua rows) and the methods that stand for them offline
PAPER_BASELINE_METHODS = ("rag_dense", "rag_bm25", "llmlingua2", "llmlingua")


def paired_to(out: Path, name: str, reference: str) -> pd.DataFrame | None:
    """Every other label's paired difference to `reference` on the same prompts at the same keep rate (the
    notebook's results.csv; full prefill left out): one summary row per task, label and keep rate, with the verdict
    of the one rule (`stats.verdict`), or None where the notebook did not run `reference`."""
    rows = render.read(out, name, "results.csv")
    if rows is None or not len(rows) or not {"label", "keep_rate", "score", "index", "task"} <= set(rows):
        return None
    rows = rows[rows["label"] != "full"]
    if reference not in set(rows["label"]):
        return None
    parts = [stats.summarize(g.to_dict("records"), baseline=reference) for _, g in rows.groupby("keep_rate")]
    table = pd.concat(parts, ignore_index=True)
    table = table[table["label"] != reference].dropna(subset=["diff_vs_full"])
    reference_scores = rows[rows["label"] == reference].groupby("task")["score"].mean()
    return table.assign(reference_score=table["task"].map(reference_scores))


def _against(out: Path, name: str, reference: str, cells: pd.DataFrame, wanted: set, contradicting: set):
    """Ours and the verdict of a claim on `cells` (`paired_to` rows): "not reproduced" where a cell's verdict
    contradicts the paper, reproduced in shape only when each is decided as the paper says, else too few samples
    (with the n that would decide them)."""
    diffs = "; ".join(
        f"{label} {render.cell(float(g['diff_vs_full'].mean()))} points" for label, g in cells.groupby("label")
    )
    rates = ", ".join(f"{r:g}" for r in sorted(cells["keep_rate"].unique()))
    n = f"n = {int(cells['n'].min())}–{int(cells['n'].max())} per cell"
    tasks = ", ".join(sorted(set(cells["task"])))
    ours = f"vs {reference} on {tasks} at keep {rates}: {diffs} ({n}; {_scale(out, name)})"
    verdicts = set(cells["verdict"].dropna())
    if verdicts & contradicting:
        return ours, "not reproduced"
    if verdicts - wanted or cells["verdict"].isna().any():
        scores = dict(zip(cells["task"], cells["reference_score"]))
        need = power.needed(cells[~cells["verdict"].isin(wanted)], scores)
        return ours, "too few samples to tell" + (f" (deciding needs n ≈ {need} per cell)" if need else "")
    return ours, "reproduced in shape"


def _baselines_claim(out: Path, reference: str = "specprefill") -> tuple[str, str] | None:
    """Table 1: the paper's baselines (RAG, LLMLingua) score below SpecPrefill at the same keep rate; a baseline
    "higher" or shown no different (within the margin, while the paper's gap is 17-23 points) contradicts it.
    `reference`: SpecPrefill's row, the paper's method ("specprefill") or a selection rule the notebook ran."""
    table = paired_to(out, "07_baselines", reference)
    cells = table[table["label"].isin(PAPER_BASELINE_METHODS)] if table is not None else None
    if cells is not None:  # the one floor: a task where full prefill barely answers is not judged
        rows = render.read(out, "07_baselines", "results.csv")
        full = rows[rows["label"] == "full"].groupby("task")["score"].mean() if rows is not None else pd.Series()
        cells = cells[~cells["task"].map(full).lt(FULL_FLOOR).fillna(False).astype(bool)]
    if cells is None or not len(cells):
        return None
    return _against(out, "07_baselines", reference, cells, {"lower"}, {"higher", "no difference found"})


def _ablations_claim(out: Path) -> tuple[str, str] | None:
    """The original's ablations: each design choice (look-ahead, chunks, pooling, original positions, the
    aggregations) helps or does no harm, so no ablation scores above the default; one that does contradicts it."""
    cells = paired_to(out, "06_ablations", "default")
    if cells is None or not len(cells):
        return None
    return _against(out, "06_ablations", "default", cells, {"lower", "no difference found"}, {"higher"})


def _quality_rows(out: Path, claim: str, paper: str, cited: str, name: str, anchor: str) -> list[tuple]:
    """A quality claim's two rows, on the same prompts: the paper's method as the profile runs it, and this project's
    default selection (`SERVING_RULE`, run where the notebook's `selection_rules` name it)."""
    return [
        (f"{claim}: the paper's method", paper, cited, _quality_claim(out, name), anchor),
        (f"{claim}: this project's selection ({SERVING_RULE})", paper, cited,
         _quality_claim(out, name, SERVING_RULE), anchor),
    ]  # fmt: skip


NOTEBOOK_OF = {"ttft": "04_ttft", "qps": "05_qps", "quality": "01_long_context_quality", "agreement": "08_agreement"}


def claims_summary(out: Path) -> str:
    """One row per paper claim at the top of the page: the paper's value and where it is printed, ours with n and
    scale, the verdict, and a link to the section that shows the numbers."""
    claims = [  # (claim, paper value, where, ours and verdict or None, section anchor)
        ("TTFT speedup over full prefill", "up to 7.66× (405B-FP8); 6.69× at keep 0.1", "abstract; Figure 3's top axis",
         _ttft_claim(out), "ttft"),
        ("max QPS on real tasks", "up to 7× (405B-FP8), 4.6× (70B)", "abstract; Figure 2", _qps_claim(out), "qps"),
        *_quality_rows(out, "long-context quality kept at 10–30% keep",
                       "LongBench avg 52.74 (10%), 53.92 (30%) vs 53.55 full",
                       f"Table 1, §4.4 ({UNCHECKED}); Figure 3: the 405B's per-task curves",
                       "01_long_context_quality", "quality"),
        *_quality_rows(out, "RULER quality kept", "90.4 at 10% keep vs 87.9 full (70B, 64K)",
                       f"Table 2, §4.5 ({UNCHECKED})", "02_ruler", "02_ruler"),
        *_quality_rows(out, "short tasks unharmed", "GSM8K, MMLU, ARC, GPQA, IFEval, HumanEval+/MBPP+ at keep 0.3–0.9",
                       "the original's experiments/run_*_70b.sh", "03_short_tasks", "03_short_tasks"),
        ("speculator attention agrees with the base's", "top-k overlap far above chance",
         "the original's visualization/attn_correlation.py", _agreement_claim(out), "agreement"),
        *[(f"SpecPrefill above the baselines: {row}", "LongBench avg 52.74 vs RAG 35.49, LLMLingua 29.85 (~10% keep, "
           "70B)", f"Table 1 ({UNCHECKED})", _baselines_claim(out, reference), "07_baselines")
          for row, reference in (("the paper's method", "specprefill"),
                                 (f"this project's selection ({SERVING_RULE})", SERVING_RULE))],
        ("each design choice helps or does no harm", "ablation studies; the configuration families p, p_full, "
         "p_full_lah4/8 (token-level, chunks + pooling, look-ahead)", "abstract; the original's configs/",
         _ablations_claim(out), "06_ablations"),
    ]  # fmt: skip
    rows = []
    skip = render.skipped(out)  # a notebook the profile leaves out: its reason (e.g. the n it would need) beside it
    for claim, paper, cited, result, anchor in claims:
        why = skip.get(NOTEBOOK_OF.get(anchor, anchor))
        ours, verdict = result or ("not run in this profile" + (f": {why}" if why else ""), "not run in this profile")
        link = f'<a href="#{anchor}">{anchor.replace("_", " ")}</a>' if result else render.MISSING
        cells = (claim, f"{paper} ({cited})", ours, verdict)
        rows.append(
            "<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in cells) + f'<td class="nowrap">{link}</td></tr>'
        )
    head = "".join(
        f'<th scope="col">{h}</th>' for h in ("claim", "paper (where)", "ours (n; scale)", "verdict", "section")
    )
    table = f'<table class="t claims"><thead><tr>{head}</tr></thead><tbody>{"".join(rows)}</tbody></table>'
    return render.heading(2, "The paper's claims, and ours", "claims") + render.wrap(table, "claims summary")
