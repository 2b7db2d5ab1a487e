"""The report's pieces of HTML: a notebook's tables read from its folder and rendered (settings folded away,
missing cells as a dash), figures inline with their alt text, headings, the table of contents, links to the executed
notebooks and the explorer's snapshot, and `specprefill bench table`'s markdown."""

from __future__ import annotations

import base64
import html
import json
import math
import re
from pathlib import Path

import pandas as pd

from specprefill.errors import SpecPrefillError

# What each figure shows, for its alt text (a reader on a screen reader, or with images off, gets the figure's point)
FIGURE_ALT = {
    "ttft_speedup.png": "TTFT speedup of SpecPrefill over full prefill and its Amdahl bound against the keep rate, "
    "one line per prompt length, one panel per configuration family",
    "qps.png": "Mean latency of served requests against the offered request rate, plain vLLM and SpecPrefill, one "
    "panel per category with its timeout dashed",
    "agreement.png": "Heatmaps of KL divergence and Kendall tau between speculator and base attention per layer "
    "pair, and the top-k Jaccard overlap with the base against the keep rate beside a random scorer",
    "quality_vs_keep.png": "Long-context quality score against the keep rate, SpecPrefill beside full prefill, with "
    "95% intervals",
    "ruler_vs_keep.png": "RULER score against the keep rate, SpecPrefill beside full prefill, with 95% intervals",
    "short_tasks_vs_keep.png": "Short-task scores against the keep rate, SpecPrefill beside full prefill, with 95% "
    "intervals",
    "baselines.png": "Quality of SpecPrefill and the baseline prompt-compression methods against the keep rate, with "
    "95% intervals",
    "ablations.png": "Quality of each ablated SpecPrefill setting at one keep rate, bars with 95% intervals",
    "speculator_quality.png": "Quality by speculator model, bars with 95% intervals",
    "board_frontier.png": "The leaderboard: accuracy against TTFT speedup per task group, one point per method and "
    "keep rate, the frontier of each group dashed and labelled",
    "frontier.png": "TTFT speedup against quality pooled over tasks, one labelled point per speculator with its 95% "
    "interval, the speed-quality frontier joined by a dashed line",
}


MISSING = "—"  # what an unmeasured cell reads: never "NaN"


KEYS = ("claim", "task", "category", "label", "speculator", "length", "keep_rate", "keep rate", "method")


MEASURED = ("n", "n_paired", "verdict", "top_rate_sustained", "interval", "overlaps_full")


def alt_text(path: Path) -> str:
    """What a figure shows, for its alt text (the report's and the executed notebooks')."""
    return FIGURE_ALT.get(path.name, f"Figure {path.stem.replace('_', ' ')} of notebook {path.parent.name}")


def img(path: Path) -> str:
    """A figure inline (one self-contained file); its alt text says what it shows, the caption names the file."""
    data = base64.b64encode(path.read_bytes()).decode()
    alt = alt_text(path)
    name = html.escape(path.name)
    return (
        f'<figure><img alt="{html.escape(alt)}" src="data:image/png;base64,{data}" style="max-width:100%">'
        f"<figcaption>{name}</figcaption></figure>"
    )


def cell(value: object) -> str:
    """One table cell as text: missing (None, NaN, "nan") reads as a dash, a number with 3 significant digits (whole
    numbers whole, so token counts do not turn into 1.02e+03)."""
    if value is None or (isinstance(value, float) and math.isnan(value)) or value is pd.NA:
        return MISSING
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, float):
        return str(int(value)) if value.is_integer() and abs(value) < 1e15 else f"{value:.3g}"
    text = str(value)
    return MISSING if text.strip().lower() in ("", "nan", "none", "<na>") else text


def _measured(df: pd.DataFrame, col: str) -> bool:
    """A column that holds a result (float numbers, n, intervals, verdicts) rather than a setting of the run."""
    if col in KEYS:
        return False
    return col in MEASURED or "CI" in col or pd.api.types.is_float_dtype(df[col])


def wrap(inner: str, label: str) -> str:
    """A table in its own horizontal scroller, so a wide table never makes the page scroll sideways; focusable and
    named, as a keyboard user must be able to scroll it."""
    return f'<div class="scroll" tabindex="0" role="region" aria-label="{html.escape(label)}">{inner}</div>'


def table(df: pd.DataFrame, settings: bool = True) -> str:
    """The rows with the columns that tell them apart and the measured ones first; settings the same in every row go
    to a collapsed block under it (a reader wants the numbers, not ten columns of one value)."""
    cols = [str(c) for c in df.columns]
    df = df.set_axis(cols, axis=1)
    measured = [c for c in cols if _measured(df, c)]
    df = df.astype(object)  # cells as Python values: a missing one is None or NaN whatever its column's type
    varies = {c: df[c].map(cell).nunique() > 1 or not settings for c in cols}
    keys = [c for c in cols if c in KEYS and (varies[c] or len(df) < 2)]  # a single row keeps what it is about
    rest = [c for c in cols if c not in KEYS and c not in measured and varies[c]]
    fixed = [c for c in cols if c not in keys and c not in measured and c not in rest]
    shown = df[keys + measured + rest].map(cell).rename(columns=lambda c: c.replace("_", " "))
    label = "table: " + ", ".join(shown.columns[:3])
    page = wrap(shown.to_html(index=False, border=0, classes="t"), label)
    if fixed and len(df):
        same = pd.DataFrame({"setting": fixed, "value": [cell(df[c].iloc[0]) for c in fixed]})
        inner = wrap(same.to_html(index=False, border=0, classes="t"), label + " settings")
        page += f"<details><summary>settings</summary>{inner}</details>"
    return page


def heading(level: int, text: str, anchor: str) -> str:
    """A section heading with its id: the table of contents and the claims summary link to it."""
    return f'<h{level} id="{html.escape(anchor)}">{html.escape(text)}</h{level}>'


def contents(body: list[str]) -> str:
    """The table of contents, from the headings the page holds (so it cannot list a section that is not there)."""
    found = re.findall(r'<h([23]) id="([^"]+)">(.*?)</h\1>', "".join(body))
    items = "".join(f'<li class="l{level}"><a href="#{anchor}">{text}</a></li>' for level, anchor, text in found)
    return f'<nav aria-label="contents"><h2 id="contents">Contents</h2><ul>{items}</ul></nav>'


def skipped(out: Path) -> dict[str, str]:
    """The notebooks the profile of `out` (outputs/<profile>) leaves out, with why (its `_profile.yaml` `skip:`):
    their folders hold an older run's outputs, which the report does not show as this profile's."""
    from specprefill.workbench import parameters  # lazy: the profile's files, only where they exist

    root = out.parent.parent
    return parameters.skipped(root, out.name) if (root / "params" / out.name).is_dir() else {}


def read(out: Path, name: str, file: str) -> pd.DataFrame | None:
    """The table, an empty frame for a file with no rows (reported as such), None when there is no file or the
    profile skips the notebook."""
    path = out / name / file
    if not path.exists() or name in skipped(out):
        return None
    try:
        return pd.read_csv(path)
    except pd.errors.EmptyDataError:
        return pd.DataFrame()


def params(out: Path, name: str) -> dict:
    path = out / name / "results.params.json"
    return json.loads(path.read_text()) if path.exists() else {}


def ci(df: pd.DataFrame, low: str = "ci_low", high: str = "ci_high", n: str = "n") -> str:
    """The interval of a one-row selection with its n; several tasks (rows) are averaged with their intervals'
    ends."""
    if low not in df or df[low].isna().all() or not len(df):
        return MISSING
    ends = f"[{df[low].mean():.3g}, {df[high].mean():.3g}], n = {int(df[n].sum())}"
    return ends if len(df) == 1 else f"{ends} (mean of {len(df)} tasks' interval ends)"


SPEED_NOTEBOOKS = ("04_ttft", "05_qps")


def machine_record(out: Path) -> tuple[str, dict]:
    """(notebook, machine record): the first speed notebook's (saved beside its summary), else the first notebook
    whose results record one (the quality notebooks' `units.main_table`); ("", {}) when none does."""
    speed = [out / name / "summary.params.json" for name in SPEED_NOTEBOOKS]
    for path in [*speed, *sorted(out.glob("*/results.params.json"))]:
        try:
            machine = json.loads(path.read_text()).get("machine") if path.exists() else None
        except ValueError:
            machine = None
        if machine:
            return path.parent.name, machine
    return "", {}


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


EMBED_BYTES = 400_000  # an explorer snapshot up to this size is embedded in the page; a larger one is linked only


def _href(path: Path, out: Path) -> str:
    """A link relative to the report (outputs/<profile>/), so the folder can be moved or sent whole."""
    return html.escape("/".join(path.relative_to(out).parts), quote=True)


def notebook_links(folder: Path) -> list[str]:
    """Links to the executed notebook of this section and to its HTML export, those that exist."""
    links = [
        f'<a href="{_href(folder / name, folder.parent)}">{label}</a>'
        for name, label in ((f"{folder.name}.ipynb", "executed notebook"), (f"{folder.name}.html", "as HTML"))
        if (folder / name).exists()
    ]
    return [f"<p>Notebook: {' · '.join(links)}</p>"] if links else []


def page_link(page: Path, what: str) -> list[str]:
    """A link to a static page a notebook wrote (the leaderboard's), when it exists."""
    if not page.exists():
        return []
    return [f'<p>Open <a href="{_href(page, page.parent.parent)}">{html.escape(what)}</a>.</p>']


def explorer(snapshot: Path) -> list[str]:
    """The token-importance explorer's static page: linked, and embedded (a frame of its own) when light."""
    if not snapshot.exists():
        return []
    link = f'<a href="{_href(snapshot, snapshot.parent.parent)}">the explorer\'s static page</a>'
    size = snapshot.stat().st_size
    if size > EMBED_BYTES:
        return [f"<p>Open {link} ({size / 1e6:.1f} MB, too large to embed).</p>"]
    frame = (
        '<iframe title="Token-importance explorer: static snapshot" style="width:100%;height:28em;border:1px solid '
        f'#ccc" srcdoc="{html.escape(snapshot.read_text(encoding="utf-8"), quote=True)}"></iframe>'
    )
    return [f"<p>The token-importance explorer, embedded below; or open {link}.</p>", frame]


STYLE = (
    "<style>body{font-family:sans-serif;max-width:1100px;margin:1em auto;padding:0 1em}"
    ".scroll{overflow-x:auto;max-width:100%}table.t{border-collapse:collapse;margin:.5em 0}"
    "table.t td,table.t th{border:1px solid #ccc;padding:2px 6px;vertical-align:top;overflow-wrap:break-word;"
    "max-width:24em}table.t th{text-align:left}dl.meta dt{font-weight:bold}dl.meta dd{margin:0 0 .3em 1em}"
    "dl.meta p{margin:0}"
    "nav li.l3{margin-left:1.5em}.nowrap{white-space:nowrap}</style>"
)


def page(profile: str, body: list[str]) -> str:
    """The whole self-contained HTML page around the report's body."""
    title = f"<title>specprefill {html.escape(profile)}</title>"
    return (
        f"<!doctype html><html lang='en'><head><meta charset='utf-8'>{title}{STYLE}</head><body><main>{''.join(body)}"
        "</main></body></html>"
    )
