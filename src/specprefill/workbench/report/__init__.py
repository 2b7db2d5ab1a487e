"""The HTML report: every notebook's summary table and figures inline, our numbers beside the paper's. `render`:
tables, figures and page; `claims`: the paper's numbers and the claims' verdicts; `verdicts`: the sections' verdict
sentences and the one rule of every claim; `sections`: what the page says, section by section."""

from __future__ import annotations

import html
from pathlib import Path

from specprefill.atomic import write_text
from specprefill.project import project_root
from specprefill.workbench.report import claims, render, sections
from specprefill.workbench.report.render import FIGURE_ALT, bench_table
from specprefill.workbench.report.verdicts import (
    agreement_verdict,
    length_verdict,
    qps_verdict,
    ttft_verdict,
    verdict_word,
)

__all__ = [
    "FIGURE_ALT",
    "agreement_verdict",
    "bench_table",
    "build",
    "length_verdict",
    "qps_verdict",
    "ttft_verdict",
    "verdict_word",
]


def build(profile: str, root: Path | None = None) -> Path:
    """outputs/<profile>/report.html, written atomically."""
    root = root or project_root()
    out = root / "outputs" / profile
    body = [
        render.heading(2, "Beside the paper", "beside-the-paper"),
        "<p>Every number here was produced by the notebooks of this profile; the paper's numbers come from its "
        "figures and were measured on 8xH200 with Llama 3.1 models. Offline analogues are labelled as such.</p>",
        *sections.comparison(out),
    ]
    folders = sorted(p for p in out.iterdir() if p.is_dir()) if out.exists() else []
    skip = render.skipped(out)
    for folder in folders:
        if folder.name in skip:  # an older run's outputs: not this profile's now
            body.append(
                f"<p>{html.escape(folder.name)}: not run in this profile ({html.escape(skip[folder.name])}).</p>"
            )
        elif not folder.name.startswith("99_"):
            body += sections.notebook_section(out, folder)
    top = [
        f"<h1>specprefill report — profile <code>{html.escape(profile)}</code></h1>",
        claims.claims_summary(out),
        sections.header(out, profile, root),
    ]
    return write_text(out / "report.html", render.page(profile, top + [render.contents(body)] + body))
