"""The report's sections: the comparison with the paper (claims, TTFT, quality, QPS, agreement), the header that
places the numbers (profile, code version, machine), and one section per notebook folder."""

from __future__ import annotations

import html
import json
import subprocess
from pathlib import Path

import pandas as pd

from specprefill import selectors
from specprefill.workbench import protocol, stats, store
from specprefill.workbench.report import claims, render, verdicts


def comparison(out: Path) -> list[str]:
    headline = pd.DataFrame(claims.PAPER_CLAIMS, columns=["claim", "paper", "where"])
    parts = [render.heading(3, "The paper's headline claims", "paper-claims") + render.table(headline, settings=False)]
    parts += ttft_section(out)
    quality = render.read(out, "01_long_context_quality", "summary.csv")
    if quality is not None and len(quality):
        dataset = render.params(out, "01_long_context_quality").get("dataset", "analogue")
        label = {
            "analogue": "offline analogue (SQuAD multi-document QA), not LongBench",
            "longbench": "LongBench",
            "lm_eval": "LongBench (lm-eval)",
            "natural_qa": "offline natural text (SQuAD paragraphs, several questions per document; n counts "
            "documents), not LongBench",
        }.get(dataset, f"offline {dataset} (generated documents, data.keyed), not LongBench")
        ours = []
        main = claims.main_label(quality)
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
                    "full 95% CI": render.ci(full),
                    "SpecPrefill": sp["score"].mean(),
                    "SpecPrefill 95% CI": render.ci(sp),
                    "paired diff 95% CI": render.ci(sp, "diff_low", "diff_high", "n_paired"),
                    "verdict": ", ".join(sorted(set(sp["verdict"].dropna()))) if "verdict" in sp else render.MISSING,
                }
            )
        paper = pd.DataFrame(claims.PAPER_QUALITY, columns=["category", "keep rate", "full", "SpecPrefill"])
        printed = pd.DataFrame(
            [
                {"category": c, "per-task scores printed": ", ".join(f"{v:g}" for v in vs), "mean": sum(vs) / len(vs)}
                for c, vs in claims.PAPER_LONGBENCH_405B_FULL.items()
            ]
        )
        parts.append(
            render.heading(3, "Quality: full prompt vs SpecPrefill", "quality")
            + "<p>Paper, checkable (Figure 3, the original repository's <code>figs/longbench.jpg</code>: "
            "Llama-3.1-405B-Instruct-FP8 with its whole prompt, the score printed on each task's line; SpecPrefill's "
            f"curves are drawn, not printed):</p>{render.table(printed)}"
            f"<p>Paper (Table 1: LongBench by category, Llama-3.1-70B base; {claims.UNCHECKED}):</p>"
            f"{render.table(paper)}<p>Ours ({html.escape(label)}):</p>{render.table(pd.DataFrame(ours))}"
        )
    parts += baselines_section(out)
    parts += qps_section(out)
    parts += agreement_section(out)
    return parts


def baselines_section(out: Path) -> list[str]:
    """Notebook 07 beside the paper's baseline row: on LongBench (the paper profiles) the mean of the category means
    (each the mean of its tasks' means, as the original's calc_stats), else the mean over the offline records' tasks."""
    categories = render.read(out, "07_baselines", "categories.csv")
    summary = render.read(out, "07_baselines", "summary.csv")
    if categories is not None and len(categories):
        table, data = categories, "LongBench, mean of the category means (each the mean of its tasks' means)"
    elif summary is not None and len(summary):
        table, data = summary, "the offline records (RULER-style; not LongBench), mean of the task means"
    else:
        return []
    ours = table.groupby(["label", "keep_rate"], as_index=False).agg(score=("score", "mean"), n=("n", "sum"))
    return [
        render.heading(3, "Baselines at the same keep rate", "baselines"),
        f"<p>Paper (Table 1: baselines at ~10% keep; {claims.UNCHECKED}):</p>"
        f"{render.table(pd.DataFrame(claims.PAPER_BASELINES, columns=['method', 'LongBench average']))}"
        f"<p>Ours ({html.escape(data)}; offline stand-ins carry their own names: llmlingua for LLMLingua-2, "
        f"rag_bm25 for the dense RAG):</p>{render.table(ours)}",
    ]


def ttft_section(out: Path) -> list[str]:
    ttft = render.read(out, "04_ttft", "summary.csv")
    if ttft is None or not len(ttft):
        return []
    if "label" not in ttft:
        ttft = ttft.assign(label="specprefill")
    cols = [c for c in ("label", "length", "batch", "keep_rate", "speedup", "bound", "efficiency") if c in ttft]
    table = ttft[cols].sort_values([c for c in ("label", "length", "keep_rate") if c in cols])
    paper = pd.DataFrame(
        [{"keep rate": k, "paper speedup (405B-FP8, 8xH200)": v} for k, v in sorted(claims.PAPER_TTFT_405B.items())]
    )
    return [
        render.heading(3, "TTFT speedup vs keep rate and length (batched)", "ttft"),
        "<p>Paper: Figure 3's top axis (Llama-3.1-405B-FP8 base, 8B speculator, 8xH200; printed there), measured "
        "as the original's <code>run_efficiency_search.sh</code> and <code>run_efficiency_context_scaling_.sh</code> "
        "do: batches of a fixed token budget, output length 1, warm-up then timed iterations.</p>",
        render.table(paper),
        f"<p>Ours (bound: the Amdahl limit from the speculator's and the kept prefill's own times; efficiency = "
        f"speedup / bound):</p>{render.table(table)}",
        f"<p><b>Verdict vs keep rate</b>: {html.escape(verdicts.ttft_verdict(ttft))}.</p>",
        f"<p>Context scaling: {html.escape(selectors.minference_refusal())}.</p>",
        f"<p><b>Verdict vs length</b> (the paper prints no context-scaling numbers in its text; expected: the gain "
        f"grows with length as the base's attention cost grows faster than linearly): "
        f"{html.escape(verdicts.length_verdict(ttft))}.</p>",
    ]


def qps_section(out: Path) -> list[str]:
    table = render.read(out, "05_qps", "summary.csv")
    if table is None or not len(table) or "category" not in table:
        return []
    params = render.params(out, "05_qps")  # the notebook saves its settings beside results.csv
    data = "offline analogues of the categories (labelled)" if params.get("dataset") == "analogue" else "LongBench rows"
    paper = pd.DataFrame(
        claims.PAPER_QPS_GAIN,
        columns=[
            "category",
            "keep rate",
            "timeout s (figure; its client waited 5 s more)",
            "base",
            "max-QPS gain",
            "avg task score",
        ],
    )
    return [
        render.heading(3, "Max QPS by LongBench category", "qps"),
        "<p>Paper: Figure 2 (70B and 405B-FP8 bases, 8B speculator, 8xH200; gains as the figure marks them), "
        "protocol of the original's <code>eval/qps_client.py</code>: a request counts as served within its "
        "category's timeout.</p>",
        render.table(paper),
        f"<p>Ours ({html.escape(data)}; plain vLLM and SpecPrefill servers from the same arguments, one at a time, "
        "under vLLM's load generator; max QPS = highest rate sustained before the first that was not, on the tested "
        f"grid):</p>{render.table(table)}",
        f"<p><b>Verdict</b>: {html.escape(verdicts.qps_verdict(table))}.</p>",
        *chat_part(out),
    ]


def chat_part(out: Path) -> list[str]:
    """Notebook 05's multi-turn and shared-document tables (`workbench.chat`), where it ran them: beyond the paper."""
    turns, acc = render.read(out, "05_qps", "chat_turns.csv"), render.read(out, "05_qps", "chat_accuracy.csv")
    if turns is None or not len(turns):
        return []
    part = [
        render.heading(4, "Conversations and shared documents (beyond the paper)", "chat"),
        "<p>Plain vLLM with prefix caching, SpecPrefill as served and SpecPrefill fresh, each server alone, turn by "
        "turn, each turn sent its think time after the previous answer (nothing waits for background work; "
        "<code>workbench.chat</code>): median TTFT per workload, think time and turn and its ratio to plain vLLM's, "
        "tokens each engine computed, answers right.</p>",
        render.table(turns),
    ]
    return part + ([render.table(acc)] if acc is not None and len(acc) else [])


def agreement_section(out: Path) -> list[str]:
    summary = render.read(out, "08_agreement", "summary.csv")
    if summary is None or not len(summary) or "jaccard" not in summary:
        return []
    figure = out / "08_agreement" / "agreement.png"
    return [
        render.heading(3, "Speculator ↔ base attention agreement", "agreement"),
        "<p>Paper: the original's <code>visualization/attn_correlation.py</code> (speculators 1B/3B/8B against 8B/70B "
        "bases): per-layer KL divergence and Kendall τ heatmaps between speculator and base attention, and top-k "
        "Jaccard against the keep rate.</p>",
        '<p>Figure: in <a href="#08_agreement">08_agreement</a>.</p>' if figure.exists() else "",
        render.table(summary),
        f"<p><b>Verdict</b>: {html.escape(verdicts.agreement_verdict(summary))}.</p>",
    ]


def where(out: Path) -> str:
    """Where the numbers ran (the speed notebooks' record, else a quality notebook's): CPU model and flags, the dtype
    the engines actually used, threads."""
    name, machine = render.machine_record(out)
    if not machine:
        return ""
    tables = [render.read(out, name, file) for file in ("summary.csv", "results.csv")]
    dtypes = next((t for t in tables if t is not None and "dtype" in t), None)
    used = sorted(set(dtypes["dtype"].astype(str))) if dtypes is not None else ["?"]
    flags = " ".join(machine.get("cpu_flags") or []) or "none of avx2/avx512/amx"
    gpu = f", GPU {machine['gpu']}" if machine.get("gpu") else ""
    return (
        f"<p>Measured on {html.escape(str(machine.get('cpu_model')))} ({machine.get('cpus')} cores; "
        f"{html.escape(flags)}{html.escape(gpu)}), dtype {html.escape(', '.join(used))}, "
        f"{machine.get('omp_num_threads')} threads, vLLM {html.escape(str(machine.get('vllm')))}.</p>"
    )


def units_line(folder: Path) -> str:
    """How the notebook's last run got its units: computed, or read back from earlier runs (same code version)."""
    try:
        ledger = json.loads((folder / "units.json").read_text())
    except (OSError, ValueError):
        return ""
    missing = (ledger.get("units") or {}).get("missing") or []
    lost = (
        f"<p><b>{len(missing)} unit(s) missing</b> (their job did not finish them; no mean above includes them): "
        + ", ".join(f"<code>{html.escape(str(m))}</code>" for m in missing)
        + ". Rerun the same command: only these are computed.</p>"
        if missing
        else ""
    )
    return (
        f"<p>Units of work in the last run: {ledger.get('computed', 0)} computed, {ledger.get('reused', 0)} read back "
        f"from earlier runs (or a sharded run's jobs) of the same inputs and code version "
        f"<code>{html.escape(str(ledger.get('code_version')))}</code>.</p>{lost}"
    )


def protocol_line(folder: Path) -> str:
    """The notebook's protocol as run (`protocol.json`): tasks, template use, keep rates, families, baselines, ..."""
    try:
        proto = json.loads((folder / "protocol.json").read_text())
    except (OSError, ValueError):
        return ""
    differs = proto.pop("differs_from_original", [])  # a paper profile's differences from the original, with reasons
    items = "".join(f"<li>{html.escape(k)}: {html.escape(protocol.text(v))}</li>" for k, v in proto.items())
    if differs:
        rows = "".join(f"<li>{html.escape(str(line))}</li>" for line in differs)
        items += f"<li>differs from the original:<ul>{rows}</ul></li>"
    return f"<details><summary>Protocol</summary><ul>{items}</ul></details>"


def git_commit(root: Path) -> str:
    """The checkout's commit, when the project runs from a git checkout (else empty: the package version stands)."""
    try:
        done = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10
        )
    except OSError:
        return ""
    return done.stdout.strip() if done.returncode == 0 else ""


def header(out: Path, profile: str, root: Path) -> str:
    """What a reader needs to place the numbers: profile, machine and dtype, and the code that made them."""
    recorded = set()
    for ledger in sorted(out.glob("*/units.json")):
        try:
            recorded.add(str(json.loads(ledger.read_text()).get("code_version")))
        except ValueError:
            continue
    commit = git_commit(root)
    code = (f"git {commit}, " if commit else "") + f"package {store.code_version()}"
    if recorded:
        code += f"; results computed by {', '.join(sorted(recorded))}"
    machine = where(out) or "<p>Machine: not recorded (no notebook of this profile recorded one).</p>"
    return (
        f'<dl class="meta"><dt>profile</dt><dd><code>{html.escape(profile)}</code></dd><dt>code version</dt><dd>'
        f"<code>{html.escape(code)}</code> (package version + digest of its source; every result is keyed by it)</dd>"
        f"<dt>machine and dtype</dt><dd>{machine}</dd></dl>"
    )


def notebook_section(out: Path, folder: Path) -> list[str]:
    """One notebook's section: what its data is, how its units and protocol ran, its summary table (and the
    category, LongBench-E and per-speculator tables where it saved them), its figures, links and explorer."""
    body = [render.heading(2, folder.name, folder.name)]
    params = render.params(out, folder.name)
    if params.get("dataset") == "analogue" or any("analogue" in str(v) for v in params.values()):
        body.append("<p><b>Offline analogue</b>: the paper's data is hub-only; this uses the closest offline data.</p>")
    if line := units_line(folder):
        body.append(line)
    if line := protocol_line(folder):
        body.append(line)
    summary = render.read(out, folder.name, "summary.csv")
    if summary is not None and not len(summary):
        body.append(
            "<p><b>No rows</b>: this notebook's summary table is empty (nothing was run for its parameters).</p>"
        )
    elif summary is not None:
        body.append(render.table(summary))
        if sentence := stats.overlap_sentence(summary):
            body.append(f"<p>{html.escape(sentence)}</p>")
    for file, caption in (
        (
            "categories.csv",
            "LongBench by its categories as the original averages them (each task's mean, then the mean of a "
            "category's task means):",
        ),
        ("categories_pooled.csv", "The same categories with their documents pooled (n, 95% intervals; an extra):"),
        ("longbench_e.csv", "LongBench-E by context length:"),
        (
            "board.csv",
            "The leaderboard's rows (machine, group, method, keep rate; accuracy against full prefill "
            "paired on the same prompts, TTFT speedup with the selection included):",
        ),
    ):
        table = render.read(out, folder.name, file)
        if table is not None and len(table):
            body += [f"<p>{html.escape(caption)}</p>", render.table(table)]
    body += speculators_part(render.read(out, folder.name, "speculators.csv"))  # notebook 10
    body += [render.img(p) for p in sorted(folder.glob("*.png")) if not p.name.startswith(".")]  # dot-named: temp
    body += render.notebook_links(folder)
    body += render.explorer(folder / "snapshot.html")
    body += render.page_link(folder / "leaderboard.html", "the leaderboard's page (sortable tables, the frontier, "
                             "filters by model pair and machine)")  # fmt: skip
    return body


def speculators_part(speculators: pd.DataFrame | None) -> list[str]:
    """Notebook 10's table: TTFT speedup beside quality per speculator, and the frontier."""
    if speculators is None or not len(speculators):
        return []
    body = [
        "<p>Per speculator: TTFT speedup at the bound's efficiency, beside quality (mean [95% interval]) per task and "
        "keep rate.</p>",
        render.table(speculators),
    ]
    if "pareto" in speculators:
        front = speculators[speculators["pareto"].astype(bool)].sort_values("speedup")
        names = ", ".join(
            f"{r.speculator_name} ({r.speedup:.2f}×, quality {r.quality:.3g})" for r in front.itertuples()
        )
        body.append(
            "<p><b>Frontier</b> (no other speculator both faster and better, quality pooled over the tasks): "
            f"{html.escape(names)}.</p>"
        )
    return body
