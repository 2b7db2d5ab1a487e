"""The leaderboard as one static HTML page (no server, no network: the data and the script are inside it): per task
group a table (every column sortable by its header's button, `aria-sort` kept) and a frontier plot (accuracy against
TTFT speedup, one point per method and keep rate, the frontier of the points shown joined), both following the
filters by model pair and machine. The tables are rendered here, so the page reads without its script."""

from __future__ import annotations

import html
import json
import math
from pathlib import Path

from specprefill.atomic import write_text
from specprefill.workbench import board, stats
from specprefill.workbench.report.render import cell

SHOWN = (  # column, heading, how a value prints
    ("method", "Method", None),
    ("pair", "Model pair", None),
    ("keep_rate", "Keep", "{:g}"),
    ("kept_fraction", "Kept", "{:.3f}"),
    ("accuracy", "Accuracy", "{:.1f}"),
    ("acc_ci", "95% interval", None),
    ("diff_vs_full", "vs full (points)", "{:+.1f}"),
    ("diff_ci", "Paired 95% interval", None),
    ("verdict", "Verdict", None),
    ("speedup", "TTFT speedup", "{:.2f}x"),
    ("bound", "Bound", "{:.2f}x"),
    ("t_select_s", "Selection s", "{:.3f}"),
    ("spec_peak_mib", "Speculation MiB", "{:.0f}"),
    ("host_peak_mib", "Host MiB", "{:.0f}"),
    ("n", "n", "{:.0f}"),
    ("machine", "Machine", None),
)

# what the fastest cell per machine means, where it is read: the verdict's margin
LEAD = f"Fastest with no difference from full prefill found (the paired 95% interval within ±{stats.MARGIN:g} points): "
SORT_KEY = {"acc_ci": "acc_low", "diff_ci": "diff_low"}  # an interval column sorts by its lower end

STYLE = """
body{font-family:sans-serif;max-width:1260px;margin:1em auto;padding:0 1em;color:#1a1a1a;background:#fff}
table{border-collapse:collapse;font-size:0.82em;margin:0.5em 0 1.5em}
th,td{border-bottom:1px solid #bbb;padding:0.25em 0.45em;text-align:right}
th:nth-child(-n+2),td:nth-child(-n+2),th:nth-child(9),td:nth-child(9),th:last-child,td:last-child{text-align:left}
th button{font:inherit;font-weight:bold;background:none;border:0;padding:0;cursor:pointer;color:#0b3d91}
th button:focus{outline:2px solid #0b3d91}
caption{text-align:left;font-weight:bold;padding:0.3em 0}
svg text{font-size:11px;fill:#1a1a1a}
.filters label{margin-right:0.5em}
.filters select{margin-right:1.5em}
""".strip()

SCRIPT = Path(__file__).with_name("board_page.js")  # inlined into every page: sorting, filters, the frontier


def _value(row: dict, key: str, fmt: str | None) -> str:
    if key in ("acc_ci", "diff_ci"):
        low, high = (_finite(row.get(f"{key[:-3]}_{end}")) for end in ("low", "high"))
        sign = "+" if key == "diff_ci" else ""
        return f"{low:{sign}.1f} to {high:{sign}.1f}" if low is not None and high is not None else cell(None)
    if key == "verdict" and row.get("verdict"):  # the margin and n where the verdict is read
        n = _finite(row.get("n"))
        within = f"within ±{stats.MARGIN:g} points, " if row["verdict"] == stats.SAME else ""
        return f"{row['verdict']} ({within}n = {n:.0f})" if n is not None else str(row["verdict"])
    value = _finite(row.get(key))
    if key == "pair" and not value:
        return "the base alone"
    return cell(value) if value is None or fmt is None else fmt.format(value)


def _finite(value):
    """NaN and infinities as null: the page's JSON must parse."""
    return None if isinstance(value, float) and not math.isfinite(value) else value


def _select(name: str, label: str, values: list[str]) -> str:
    options = "".join(f'<option value="{html.escape(v)}">{html.escape(v)}</option>' for v in values)
    return (
        f'<label for="f-{name}">{label} </label><select id="f-{name}"><option value="">all</option>{options}</select>'
    )


def _group(number: int, name: str, rows: list[tuple[int, dict]]) -> str:
    length = rows[0][1]["length"]
    head = "".join(
        f'<th scope="col" data-key="{SORT_KEY.get(k, k)}" aria-sort="none"><button type="button">{html.escape(h)}'
        "</button></th>"
        for k, h, _ in SHOWN
    )
    body = "".join(
        f'<tr data-row="{i}">' + "".join(f"<td>{html.escape(_value(r, k, f))}</td>" for k, _, f in SHOWN) + "</tr>"
        for i, r in rows
    )
    gid = f"group-{number}"
    group_rows = [r for _, r in rows]
    best = []
    for machine in sorted({r["machine"] for r in group_rows}):
        b = board.best(group_rows, name, machine)
        best.append(
            f"{html.escape(machine)}: {html.escape(b['method'])} at keep {b['keep_rate']:g}, {b['speedup']:.2f}x, "
            f"accuracy {b['accuracy']:.1f} (n = {b['n']:.0f})"
            if b
            else f"{html.escape(machine)}: no pruned cell shows no difference from full prefill"
        )
    return (
        f'<section aria-labelledby="{gid}"><h2 id="{gid}">{html.escape(name)} ({length:,} tokens)</h2>'
        f'<svg class="frontier" data-group="{html.escape(name)}" width="560" height="300" role="img" '
        f'aria-labelledby="{gid}-t {gid}-d"><title id="{gid}-t">Accuracy against TTFT speedup in {html.escape(name)}, '
        f'the frontier dashed</title><desc id="{gid}-d"></desc></svg>'
        f'<p class="fastest" data-group="{html.escape(name)}" data-lead="{LEAD}">{LEAD}{"; ".join(best)}.</p>'
        f"<table><caption>{html.escape(name)}: every method and keep rate (sort by any column)</caption>"
        f"<thead><tr>{head}</tr></thead><tbody>{body}</tbody></table></section>"
    )


def render(board: dict, path) -> Path:
    """The page of a board (`workbench.board`: one run's or a merge's), written whole to `path`."""
    rows = board["rows"]
    k = board["key"]
    models, engine = k.get("models") or {}, k.get("engine") or {}
    groups: dict[str, list[tuple[int, dict]]] = {}
    for i, r in enumerate(rows):
        groups.setdefault(r["group"], []).append((i, r))
    data = json.dumps([{c: _finite(v) for c, v in r.items()} for r in rows], allow_nan=False).replace("</", "<\\/")
    pairs = sorted({r["pair"] for r in rows if r.get("pair")})
    machines = sorted(board["machines"])
    page = (
        '<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>Pruning before prefill: leaderboard</title>'
        f"<style>{STYLE}</style></head><body><main><h1>Pruning before prefill: leaderboard</h1>"
        f"<p>Code {html.escape(str(k['code']))}; speculator {html.escape(str(models.get('speculator')))}, base "
        f"{html.escape(str(models.get('base')))}; dtype {html.escape(str(engine.get('dtype')))}. "
        "Accuracy is the score on the group's prompts (95% interval); the paired difference and its verdict compare "
        "each method with full prefill on the same prompts (no difference found: the interval within "
        f"±{stats.MARGIN:g} points; each verdict shows its n); "
        "TTFT speedup includes the selection; its bound divides full prefill by the selection and the kept prefill "
        "measured apart (no orchestration between them).</p>"
        f'<div class="filters">{_select("pair", "Model pair", pairs)}{_select("machine", "Machine", machines)}</div>'
        + "".join(_group(i, name, g) for i, (name, g) in enumerate(groups.items()))
        + f'</main><script type="application/json" id="board-data">{data}</script>'
        + f"<script>{SCRIPT.read_text(encoding='utf-8')}</script></body></html>"
    )
    return write_text(path, page)
