"""The HTML report: every notebook's summary table and figures inline, our numbers beside the paper's."""

from __future__ import annotations

import base64
import html
import json
from pathlib import Path

import pandas as pd

from specprefill.atomic import write_text
from specprefill.errors import SpecPrefillError
from specprefill.serve.loadtest import max_qps
from specprefill.workbench import protocol, records, stats, store
from specprefill.workbench.runner import project_root

# The paper's numbers (Liu, Chen, Zhang, ICML 2025, arXiv 2502.02789), each with where it is printed. Only numbers
# printed in the paper's text or tables are here, except where a row says it was read off a plot.
PAPER_CLAIMS = [  # (claim, paper value, where)
    ("TTFT improvement, Llama-3.1-405B-Instruct-FP8", "up to 7.66×", "abstract"),
    ("maximal end-to-end QPS on real downstream tasks, 405B-FP8", "up to 7×", "abstract; Figure 1"),
    ("LongBench average at 10% keep, 70B base", "52.74 vs 53.55 full", "Table 1, §4.4"),
    ("RULER average at 10% keep, 70B base, 64K", "90.4 vs 87.9 full", "Table 2, §4.5"),
]
# §4.7 (efficiency benchmarking, 405B-FP8 base, 8B speculator, 8xH200): speedups read off its TTFT plot, approximate
PAPER_TTFT_405B = {0.1: 6.69, 0.3: 2.75, 0.5: 1.82, 0.7: 1.33}
PAPER_QUALITY = [  # Table 1 (LongBench, Llama-3.1-70B base): (category, keep rate, full, SpecPrefill)
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
PAPER_BASELINES = [  # Table 1: LongBench average at ~10% keep, 70B base
    ("RAG (10.38% kept)", 35.49),
    ("LLMLingua (~10%)", 29.85),
    ("MInference", 52.89),
    ("SpecPrefill (10%)", 52.74),
]
# §4.7's QPS plots (read off, approximate) and Figure 1 (the 7× headline): max-QPS gain per LongBench category
PAPER_QPS_GAIN = [
    ("multi-doc QA", "405B", 0.1, 7.0),
    ("multi-doc QA", "70B", 0.1, 4.6),
    ("few-shot", "405B", 0.3, 5.0),
    ("few-shot", "70B", 0.3, 2.1),
    ("summarization", "70B", 0.5, 1.6),
]


def _img(path: Path) -> str:
    data = base64.b64encode(path.read_bytes()).decode()
    name = html.escape(path.name)
    return (
        f'<figure><img alt="{name}" src="data:image/png;base64,{data}" style="max-width:100%">'
        f"<figcaption>{name}</figcaption></figure>"
    )


def _table(df: pd.DataFrame) -> str:
    return df.to_html(index=False, float_format=lambda x: f"{x:.3g}", border=0, classes="t")


def _read(out: Path, name: str, file: str) -> pd.DataFrame | None:
    """The table, an empty frame for a file with no rows (reported as such), None when there is no file."""
    path = out / name / file
    if not path.exists():
        return None
    try:
        return pd.read_csv(path)
    except pd.errors.EmptyDataError:
        return pd.DataFrame()


def _params(out: Path, name: str) -> dict:
    path = out / name / "results.params.json"
    return json.loads(path.read_text()) if path.exists() else {}


def _ci(df: pd.DataFrame, low: str = "ci_low", high: str = "ci_high", n: str = "n") -> str:
    """The interval of a one-row selection with its n; several tasks (rows) are averaged with their intervals'
    ends."""
    if low not in df or df[low].isna().all() or not len(df):
        return "n/a"
    ends = f"[{df[low].mean():.3g}, {df[high].mean():.3g}], n = {int(df[n].sum())}"
    return ends if len(df) == 1 else f"{ends} (mean of {len(df)} tasks' interval ends)"


def main_label(quality: pd.DataFrame) -> str:
    """The SpecPrefill rows set beside the paper: the notebook's own knobs ("specprefill"), else the configuration
    family closest to the paper's main one (chunks, pooling, the longest look-ahead)."""
    labels = set(quality["label"])
    for label in ("specprefill", *reversed(records.FAMILIES)):
        if label in labels:
            return label
    return "specprefill"


def comparison(out: Path) -> list[str]:
    claims = pd.DataFrame(PAPER_CLAIMS, columns=["claim", "paper", "where"])
    parts = ["<h3>The paper's headline claims</h3>" + _table(claims)]
    ttft = _read(out, "04_ttft", "summary.csv")
    if ttft is not None and len(ttft):
        longest = ttft[ttft["length"] == ttft["length"].max()]
        labels = sorted(longest["label"].unique()) if "label" in longest else [None]
        batch = f", batches of {int(longest['batch'].max())}" if "batch" in longest else ""

        def measured(rate, label):
            cell = longest[(longest["keep_rate"] == rate) & ((longest["label"] == label) if label else True)]
            return float(cell["speedup"].mean()) if len(cell) else None

        rows = [
            {
                "keep rate": r,
                "paper TTFT speedup (405B, 8xH200; §4.7 plot, approximate)": PAPER_TTFT_405B.get(r),
                **{
                    f"ours ({label + ', ' if label else ''}{int(longest['length'].iloc[0])} tokens{batch})": measured(
                        r, label
                    )
                    for label in labels
                },
            }
            for r in sorted(set(PAPER_TTFT_405B) | set(longest["keep_rate"]))
        ]
        parts.append("<h3>TTFT speedup</h3>" + _table(pd.DataFrame(rows)))
    quality = _read(out, "01_long_context_quality", "summary.csv")
    if quality is not None and len(quality):
        label = (
            "offline analogue (SQuAD multi-document QA), not LongBench"
            if _params(out, "01_long_context_quality").get("dataset", "analogue") == "analogue"
            else "LongBench"
        )
        ours = []
        main = main_label(quality)
        for rate in sorted(quality[quality["label"] == main]["keep_rate"].unique()):
            full = quality[quality["label"] == "full"]
            sp = quality[(quality["label"] == main) & (quality["keep_rate"] == rate)]
            ours.append(
                {
                    "data": label,
                    "SpecPrefill configuration": main,
                    "keep rate": rate,
                    "n": int(sp["n"].sum()),
                    "full": full["score"].mean(),
                    "full 95% CI": _ci(full),
                    "SpecPrefill": sp["score"].mean(),
                    "SpecPrefill 95% CI": _ci(sp),
                    "paired diff 95% CI": _ci(sp, "diff_low", "diff_high", "n_paired"),
                    "verdict": ", ".join(sorted(set(sp["verdict"].dropna()))) if "verdict" in sp else "n/a",
                }
            )
        paper = pd.DataFrame(PAPER_QUALITY, columns=["category", "keep rate", "full", "SpecPrefill"])
        baselines = pd.DataFrame(PAPER_BASELINES, columns=["method", "LongBench average"])
        parts.append(
            "<h3>Quality: full prompt vs SpecPrefill</h3><p>Paper (Table 1: LongBench by category, Llama-3.1-70B "
            f"base):</p>{_table(paper)}<p>Paper (Table 1: baselines at ~10% keep):</p>{_table(baselines)}"
            f"<p>Ours ({html.escape(label)}):</p>{_table(pd.DataFrame(ours))}"
        )
    qps = _read(out, "05_qps", "summary.csv")
    if qps is not None and len(qps):
        paper = pd.DataFrame(PAPER_QPS_GAIN, columns=["category", "base", "keep rate", "max-QPS gain"])
        rows = qps.to_dict("records")
        full, sp = max_qps(rows, "vllm"), max_qps(rows, "specprefill")
        gain = f"{sp / full:.1f}×" if full else "n/a (plain vLLM met the SLO at no tested rate)"
        parts.append(
            f"<h3>Max QPS within the latency SLO</h3><p>Paper (§4.7's QPS plots, approximate; Figure 1 for 7×):</p>"
            f"{_table(paper)}<p>Ours (servers under "
            f"vLLM's load generator): max QPS plain vLLM "
            f"{full:g}, SpecPrefill {sp:g} requests/s (gain {gain}, on the tested rate grid):</p>{_table(qps)}"
        )
    return parts


def bench_table(results: list[dict]) -> str:
    """`specprefill bench ttft` results (their JSON) side by side as a markdown table: one line per speculator,
    length and keep rate, with the Amdahl bound, the efficiency, and where it ran."""
    head = [
        "speculator",
        "base",
        "look-ahead",
        "tokens",
        "keep",
        "t_spec s",
        "t_base(kept) s",
        "t_full s",
        "speedup",
        "bound",
        "efficiency",
        "dtype",
        "CPU flags",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for res in results:
        cfg, flags = res.get("config", {}), " ".join(res.get("machine", {}).get("cpu_flags", []))
        look = cfg.get("specprefill", {}).get("look_ahead")
        for r in res.get("rows", []):
            if "t_spec" not in r:
                raise SpecPrefillError(
                    "bench table reads `bench ttft` results (ttft.json); this file holds other "
                    "rows (qps.json?): pass ttft.json files"
                )
            cells = [
                cfg.get("speculator"),
                cfg.get("base"),
                look,
                r["length"],
                r["keep_rate"],
                f"{r['t_spec']:.2f}",
                f"{r['t_base_kept']:.2f}",
                f"{r['t_full']:.2f}",
                f"{r['speedup']:.2f}x",
                f"{r['bound']:.2f}x",
                f"{r['efficiency']:.2f}",
                r.get("dtype"),
                flags,
            ]
            lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines)


def where(out: Path) -> str:
    """Where the speed numbers ran: CPU model and flags, the dtype actually used, threads."""
    for name in ("04_ttft", "05_qps"):
        path = out / name / "summary.params.json"
        machine = json.loads(path.read_text()).get("machine") if path.exists() else None
        if machine:
            dtypes = _read(out, name, "summary.csv")
            used = sorted(set(dtypes["dtype"].astype(str))) if dtypes is not None and "dtype" in dtypes else ["?"]
            flags = " ".join(machine.get("cpu_flags") or []) or "none of avx2/avx512/amx"
            gpu = f", GPU {machine['gpu']}" if machine.get("gpu") else ""
            return (
                f"<p>Measured on {html.escape(str(machine.get('cpu_model')))} ({machine.get('cpus')} cores; "
                f"{html.escape(flags)}{html.escape(gpu)}), dtype {html.escape(', '.join(used))}, "
                f"{machine.get('omp_num_threads')} threads, vLLM {html.escape(str(machine.get('vllm')))}.</p>"
            )
    return ""


def units_line(folder: Path) -> str:
    """How the notebook's last run got its units: computed, or read back from earlier runs (same code version)."""
    try:
        ledger = json.loads((folder / "units.json").read_text())
    except (OSError, ValueError):
        return ""
    return (
        f"<p>Units of work in the last run: {ledger.get('computed', 0)} computed, {ledger.get('reused', 0)} read back "
        f"from earlier runs of the same inputs and code version <code>{html.escape(str(ledger.get('code_version')))}"
        "</code>.</p>"
    )


def protocol_line(folder: Path) -> str:
    """The notebook's protocol as run (`protocol.json`): tasks, template use, keep rates, families, baselines, ..."""
    try:
        proto = json.loads((folder / "protocol.json").read_text())
    except (OSError, ValueError):
        return ""
    items = "".join(f"<li>{html.escape(k)}: {html.escape(protocol.text(v))}</li>" for k, v in proto.items())
    return f"<details><summary>Protocol</summary><ul>{items}</ul></details>"


def build(profile: str, root: Path | None = None) -> Path:
    """outputs/<profile>/report.html, written atomically."""
    root = root or project_root()
    out = root / "outputs" / profile
    body = [
        f"<h1>specprefill report — profile <code>{html.escape(profile)}</code></h1>",
        f"<p>Code version <code>{html.escape(store.code_version())}</code> (package version + digest of its "
        "source; every result below is keyed by it).</p>",
        "<p>Every number here was produced by the notebooks of this profile; the paper's numbers come from its "
        "figures and were measured on 8xH200 with Llama 3.1 models. Offline analogues are labelled as such.</p>",
        where(out),
        "<h2>Beside the paper</h2>",
        *comparison(out),
    ]
    for d in sorted(p for p in out.iterdir() if p.is_dir()) if out.exists() else []:
        if d.name.startswith("99_"):
            continue
        body.append(f"<h2>{html.escape(d.name)}</h2>")
        params = _params(out, d.name)
        if params.get("dataset") == "analogue" or any("analogue" in str(v) for v in params.values()):
            body.append(
                "<p><b>Offline analogue</b>: the paper's data is hub-only; this uses the closest offline data.</p>"
            )
        if line := units_line(d):
            body.append(line)
        if line := protocol_line(d):
            body.append(line)
        summary = _read(out, d.name, "summary.csv")
        if summary is not None and not len(summary):
            body.append(
                "<p><b>No rows</b>: this notebook's summary table is empty (nothing was run for its parameters).</p>"
            )
        elif summary is not None:
            body.append(_table(summary))
            if sentence := stats.overlap_sentence(summary):
                body.append(f"<p>{html.escape(sentence)}</p>")
        for file, caption in (
            (
                "categories.csv",
                "LongBench by the paper's categories (documents pooled per category; LongBench's own tables "
                "average the tasks' means):",
            ),
            ("longbench_e.csv", "LongBench-E by context length:"),
        ):
            table = _read(out, d.name, file)
            if table is not None and len(table):
                body += [f"<p>{html.escape(caption)}</p>", _table(table)]
        speculators = _read(out, d.name, "speculators.csv")  # notebook 10: TTFT beside quality, per speculator
        if speculators is not None and len(speculators):
            body += [
                "<p>Per speculator: TTFT speedup at the bound's efficiency, beside quality (mean [95% interval]) "
                "per task and keep rate.</p>",
                _table(speculators),
            ]
        body += [_img(p) for p in sorted(d.glob("*.png")) if not p.name.startswith(".")]  # dot-named: temp files
        snapshot = d / "snapshot.html"
        if snapshot.exists():
            body.append(f"<p>Static snapshot: <code>{html.escape(str(snapshot.relative_to(out)))}</code></p>")
    style = (
        "<style>body{font-family:sans-serif;max-width:1100px;margin:2em auto;padding:0 1em}"
        "table.t{border-collapse:collapse;margin:.5em 0}"
        "table.t td,table.t th{border:1px solid #ccc;padding:2px 6px}</style>"
    )
    title = f"<title>specprefill {html.escape(profile)}</title>"
    page = f"<!doctype html><html><head><meta charset='utf-8'>{title}{style}</head><body>{''.join(body)}</body></html>"
    return write_text(out / "report.html", page)
