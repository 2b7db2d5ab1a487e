"""seaborn figures for the benchmarks and experiments. Each is saved as PNG and as SVG beside it (same stem), every
file written atomically, and shown once in the cell that draws it when drawn in a Jupyter kernel.

No backend is forced: a kernel runs matplotlib's inline backend (ipykernel sets it), which must stay for figures to
reach executed notebooks; scripts, the CLI and tests without a display get Agg from matplotlib's own choice."""

from __future__ import annotations

import io
from pathlib import Path

import matplotlib
import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import seaborn as sns

from specprefill.atomic import write_bytes
from specprefill.workbench import stats
from specprefill.workbench.report import render

DPI = 160  # saved PNGs: sharp in the report and on dense screens, still ~100-400 KB each
PALETTE = "colorblind"  # seaborn's colour-blind-safe qualitative palette: every categorical hue and the colour cycle
SEQUENTIAL = "viridis"  # perceptually uniform and colour-blind-safe: ordered hues and heatmaps
INLINE = ("inline", "module://matplotlib_inline.backend_inline")  # the kernel's backend by either of its names

LINES_FROM = 3  # x values a curve needs before it is drawn as a line; fewer are points with their intervals

# no offset notation ("1e-17" above an axis): tick labels are the values themselves
sns.set_theme(style="whitegrid", context="notebook", palette=PALETTE, rc={"axes.formatter.useoffset": False})


def _render(fig, fmt: str) -> bytes:
    """The figure as a PNG or SVG file's bytes. SVG without its date and with element ids from a fixed salt (else a
    random one): the same figure gives the same file."""
    buf = io.BytesIO()
    with matplotlib.rc_context({"svg.hashsalt": "specprefill"}):
        fig.savefig(buf, format=fmt, dpi=DPI, bbox_inches="tight", metadata={"Date": None} if fmt == "svg" else None)
    return buf.getvalue()


def _save(fig, path) -> Path:
    """Write `fig` to `path` (PNG) and to the SVG beside it, both rendered before either is written; then, in a
    kernel, display it and close it (closed, the inline backend's end-of-cell flush cannot show it a second time),
    elsewhere just close it. Returns the PNG's path."""
    path = Path(path)
    files = {path.with_suffix(f".{fmt}"): _render(fig, fmt) for fmt in ("png", "svg")}
    for file, data in files.items():
        write_bytes(file, data)
    if matplotlib.get_backend() in INLINE:
        from IPython.display import Image, display  # lazy: only a kernel has it loaded, scripts need not import IPython

        display(Image(data=files[path.with_suffix(".png")], alt=render.alt_text(path)))  # the PNG written, described
    plt.close(fig)
    return path


def _legend(ax, series: int, outside: bool = False) -> None:
    """A legend only when there are two series or more to tell apart (else it is removed); `outside`: right of the
    axes, where it hides no point."""
    if series < 2 and ax.get_legend() is not None:
        ax.get_legend().remove()
    elif series >= 2:
        ax.legend(**({"loc": "upper left", "bbox_to_anchor": (1.02, 1), "fontsize": "small"} if outside else {}))


def _score_limits(ax, values) -> None:
    """A constant score (all zero, all one) gets the scale's own range instead of matplotlib's +-0.05 around it."""
    values = pd.Series(values, dtype=float).dropna()
    if len(values) and values.max() - values.min() < 1e-9:
        top = 1.0 if values.max() <= 1 else 100.0 if values.max() <= 100 else float(values.max()) * 1.1
        ax.set_ylim(min(0.0, float(values.min())), top)


def _curve(ax, x, y, low=None, high=None, lines: bool = True, **style) -> None:
    """One series: a line with its interval as a band over >= LINES_FROM x values, else the points with their
    intervals as error bars (no line joins two points, none spans one)."""
    x, y = pd.Series(x).reset_index(drop=True), pd.Series(y, dtype=float).reset_index(drop=True)
    has_band = low is not None and high is not None
    if has_band:
        low = pd.Series(low, dtype=float).reset_index(drop=True)
        high = pd.Series(high, dtype=float).reset_index(drop=True)
    if lines:
        ax.plot(x, y, marker="o", **style)
        if has_band:
            ax.fill_between(x, low.fillna(y), high.fillna(y), color=style.get("color"), alpha=0.18, lw=0)
    else:
        yerr = _yerr(y, low, high) if has_band else None
        ax.errorbar(x, y, yerr=yerr, fmt="o", capsize=4, **style)


def _yerr(y, low, high) -> np.ndarray:
    """matplotlib's yerr from an interval's bounds (2 x n: distances below and above), 0 where there is none (n = 1)."""
    y, low, high = (pd.Series(v, dtype=float).reset_index(drop=True) for v in (y, low, high))
    return np.vstack([(y - low).fillna(0).clip(lower=0).to_numpy(), (high - y).fillna(0).clip(lower=0).to_numpy()])


def _categorical_x(ax, values) -> None:
    """Fewer than LINES_FROM x values: ticks at exactly those values, labelled with them, and some room either side
    (a single keep rate 0.3 must not become an axis from 0.29 to 0.31)."""
    values = sorted(set(float(v) for v in values))
    ax.set_xticks(values, [f"{v:g}" for v in values])
    span = (values[-1] - values[0]) or abs(values[0]) or 1.0
    ax.set_xlim(values[0] - 0.5 * span, values[-1] + 0.5 * span)


def ttft(rows: list[dict], path) -> Path:
    """Speedup and its Amdahl bound against the keep rate (one curve per length) when the rows sweep more keep rates
    than lengths, else against the length (one curve per keep rate); one panel per configuration family."""
    df = pd.DataFrame([{k: v for k, v in r.items() if not k.startswith("overhead")} for r in rows])
    if "label" not in df:
        df["label"] = "specprefill"
    by_rate = df["keep_rate"].nunique() > df["length"].nunique()
    x, hue = ("keep_rate", "length") if by_rate else ("length", "keep_rate")
    lines = df[x].nunique() >= LINES_FROM
    labels = sorted(df["label"].unique())
    fig, axes = plt.subplots(1, len(labels), figsize=(4.6 * len(labels), 3.6), squeeze=False, sharey=True)
    levels = sorted(df[hue].unique())
    colors = dict(zip(levels, sns.color_palette(SEQUENTIAL, n_colors=len(levels))))
    for ax, label in zip(axes[0], labels):
        for level in levels:
            g = df[(df["label"] == label) & (df[hue] == level)].sort_values(x)
            if not len(g):
                continue
            name = f"{int(level)} tokens" if hue == "length" else f"keep {level:g}"
            _curve(ax, g[x], g["speedup"], lines=lines, color=colors[level], label=f"{name}: speedup")
            _curve(ax, g[x], g["bound"], lines=lines, color=colors[level], ls="--", mfc="white",
                   label=f"{name}: bound")  # fmt: skip
        ax.axhline(1.0, c="grey", lw=0.8)
        ax.set(xlabel="keep rate" if by_rate else "prompt tokens", title=label if len(labels) > 1 else None)
        if not by_rate and lines:
            ax.set_xscale("log")
            lengths = sorted(df[x].unique())
            ax.set_xticks(lengths, [f"{int(v)}" for v in lengths], minor=False)
            ax.set_xticks([], minor=True)
        if not lines:
            _categorical_x(ax, df[x])
    _legend(axes[0, -1], len(levels), outside=True)  # solid/dashed: said in the title
    axes[0, 0].set_ylabel("TTFT speedup vs full prefill (x)")
    batch = f", {int(df['batch'].max())}-request batches" if "batch" in df and df["batch"].max() > 1 else ""
    fig.suptitle(f"SpecPrefill TTFT speedup (solid) and its Amdahl bound (dashed){batch}", y=1.02)
    fig.tight_layout()
    return _save(fig, path)


def qps(rows: list[dict], slo_s: float, path) -> Path:
    fig, ax = plt.subplots(figsize=(5, 3.5))
    offered = pd.DataFrame(rows).query("rate != inf")  # a burst (all requests at once) has no offered rate
    lines = offered["rate"].nunique() >= LINES_FROM
    modes = sorted(offered["mode"].unique())
    for color, mode in zip(sns.color_palette(n_colors=len(modes)), modes):
        g = offered[offered["mode"] == mode].sort_values("rate")
        _curve(ax, g["rate"], g["ttft_p90"], lines=lines, color=color, label=mode)
    ax.axhline(slo_s, ls="--", c="grey")
    ax.annotate("SLO", (1, slo_s), xycoords=("axes fraction", "data"), ha="right", va="bottom", color="grey")
    ax.set(xlabel="offered load (requests/s)", ylabel="p90 TTFT (s)", yscale="log", title="TTFT under Poisson load")
    if not lines and len(offered):
        _categorical_x(ax, offered["rate"])
    _legend(ax, len(modes))
    return _save(fig, path)


def category_qps(rows: list[dict], categories: dict[str, dict], path) -> Path:
    """One panel per category (the paper's Figure 2 layout): mean latency of the served requests against the offered
    rate, plain vLLM and SpecPrefill, the category's timeout dashed; a rate not sustained is drawn hollow."""
    df = pd.DataFrame(rows)
    fig, axes = plt.subplots(1, len(categories), figsize=(4.2 * len(categories), 3.6), squeeze=False)
    colors = dict(zip(("vllm", "specprefill"), sns.color_palette(n_colors=2)))
    for ax, (name, cat) in zip(axes[0], categories.items()):
        here = df[df["category"] == name]
        lines = here["rate"].nunique() >= LINES_FROM
        for mode, g in here.groupby("mode"):
            g = g.sort_values("rate")
            ax.plot(
                g["rate"], g["latency_mean"], color=colors.get(mode), label=mode, marker="o", ls="-" if lines else ""
            )
            missed = g[~g["sustained"].astype(bool)]
            ax.scatter(
                missed["rate"], missed["latency_mean"], facecolors="white", edgecolors=colors.get(mode), zorder=3
            )
        ax.axhline(cat["timeout_s"], ls="--", c="grey")
        ax.set(title=f"{name}: keep {cat['keep_rate']:g}, timeout {cat['timeout_s']:g} s", xlabel="QPS")
        ax.set_ylabel("mean latency of served requests (s)")
        if not lines and len(here):
            _categorical_x(ax, here["rate"])
        _legend(ax, here["mode"].nunique())
    fig.tight_layout()
    return _save(fig, path)


def _n(summary) -> str:
    lo, hi = int(summary["n"].min()), int(summary["n"].max())
    return f"n = {lo}" if lo == hi else f"n = {lo}-{hi}"


def quality_vs_keep(summary, path, title: str) -> Path:
    """Score vs keep rate per method with its 95% interval (a band over >= 3 keep rates, else error bars), one panel
    per task; full prefill (no keep rate) as a dashed line with its interval shaded grey; one legend, outside the
    panels (inside, it sat on the full-prompt line and its band)."""
    tasks = sorted(summary["task"].unique())
    wrap = min(3, max(1, len(tasks)))
    rows_n = -(-len(tasks) // wrap)
    fig, axes = plt.subplots(rows_n, wrap, figsize=(4.2 * wrap, 3.3 * rows_n), squeeze=False)
    labels = sorted(summary.loc[summary["label"] != "full", "label"].unique())
    colors = dict(zip(labels, sns.color_palette(n_colors=max(1, len(labels)))))
    for ax in axes.flat[len(tasks) :]:
        ax.set_visible(False)
    for ax, task in zip(axes.flat, tasks):
        here = summary[summary["task"] == task]
        pruned = here[here["label"] != "full"]
        lines = pruned["keep_rate"].nunique() >= LINES_FROM
        for label, g in pruned.groupby("label"):
            g = g.sort_values("keep_rate")
            _curve(ax, g["keep_rate"], g["score"], g["ci_low"], g["ci_high"], lines=lines, color=colors[label],
                   label=label)  # fmt: skip
        full = here[here["label"] == "full"]
        if len(full):
            ax.axhline(float(full["score"].mean()), ls="--", c="black", label="full prompt")
            if full["ci_low"].notna().all():
                ax.axhspan(float(full["ci_low"].min()), float(full["ci_high"].max()), color="grey", alpha=0.15, lw=0)
        if not lines and len(pruned):
            _categorical_x(ax, pruned["keep_rate"])
        _score_limits(ax, pd.concat([here["score"], here["ci_low"], here["ci_high"]]))
        ax.set(title=task, xlabel="keep rate", ylabel="score (95% CI)")
        if ax is axes.flat[min(wrap, len(tasks)) - 1]:  # one legend, right of the first row: on no line or band
            _legend(ax, summary["label"].nunique(), outside=True)
    fig.suptitle(f"{title} ({_n(summary)} per point)", y=1.02)
    fig.tight_layout()
    return _save(fig, path)


def _bars_ci(data, x, color=None, **_):
    ax = plt.gca()
    ax.bar(data[x].astype(str), data["score"], color=sns.color_palette()[0])
    yerr = _yerr(data["score"], data["ci_low"], data["ci_high"])
    ax.errorbar(data[x].astype(str), data["score"], yerr=yerr, fmt="none", ecolor="black", capsize=3)


def bars(summary, x: str, path, title: str) -> Path:
    grid = sns.FacetGrid(
        summary,
        col="task",
        col_wrap=min(2, max(1, summary["task"].nunique())),
        height=3,
        aspect=1.6,
        sharey=False,
        sharex=False,
    )
    grid.map_dataframe(_bars_ci, x=x)
    for task, ax in grid.axes_dict.items():
        ax.tick_params(axis="x", rotation=30)
        here = summary[summary["task"] == task]
        _score_limits(ax, pd.concat([here["score"], here["ci_low"], here["ci_high"]]))
    grid.set(ylabel="score (95% CI)")
    grid.figure.suptitle(f"{title} ({_n(summary)} per bar)", y=1.03)
    return _save(grid.figure, path)


def frontier(table: pd.DataFrame, path, title: str) -> Path:
    """Speed against quality, one point per speculator with its quality interval (pooled over tasks), labelled; the
    Pareto frontier (no other speculator both faster and better) joined by a line."""
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    t = table.dropna(subset=["speedup", "quality"]).sort_values("speedup")
    colors = sns.color_palette(n_colors=2)
    yerr = _yerr(t["quality"], t["quality_low"], t["quality_high"])
    ax.errorbar(t["speedup"], t["quality"], yerr=yerr, fmt="o", color=colors[0], capsize=3, label="speculator")
    front = t[t["pareto"].astype(bool)]
    if len(front) >= 2:
        ax.plot(front["speedup"], front["quality"], color=colors[1], ls="--", label="frontier")
    for _, r in t.iterrows():
        ax.annotate(str(r["speculator_name"]), (r["speedup"], r["quality"]), xytext=(4, 4), textcoords="offset points",
                    fontsize="small")  # fmt: skip
    _score_limits(ax, pd.concat([t["quality"], t["quality_low"], t["quality_high"]]))
    ax.set(xlabel="TTFT speedup vs full prefill (x)", ylabel="quality, pooled over tasks (95% CI)", title=title)
    _legend(ax, 1 + (len(front) >= 2))
    return _save(fig, path)


AGREEMENT_TITLES = {
    "kl": "KL, the original's",
    "tau": "Kendall tau of orderings",
    "kl_importance": "KL(base || speculator)",
    "tau_values": "Kendall tau of values",
}


def agreement(
    matrices: dict[str, dict[str, pd.DataFrame]], summary: list[dict], path, metrics: tuple[str, str] = ("kl", "tau")
) -> Path:
    """Per speculator (columns): heatmaps of two `core.LAYER_METRICS` for every pair of layers (rows; by default
    the original analysis' KL and Kendall tau, `("kl_importance", "tau_values")` the project's variants), then the
    top-k Jaccard of the final importance against the keep rate, a random scorer dashed."""
    names = list(matrices)
    fig, axes = plt.subplots(3, len(names), figsize=(4.2 * len(names), 11), squeeze=False)
    for col, name in enumerate(names):
        for row, metric in enumerate(metrics):
            title = AGREEMENT_TITLES[metric]
            ax = axes[row, col]
            # the cells as one image in the SVG (a path per cell makes it ~4x larger), axes and text stay vector
            sns.heatmap(matrices[name][metric], ax=ax, cmap=SEQUENTIAL, cbar_kws={"shrink": 0.8}, rasterized=True)
            ax.invert_yaxis()
            ax.set(title=f"{name}: {title}", xlabel="base layer", ylabel="speculator layer")
        ax = axes[2, col]
        df = pd.DataFrame([r for r in summary if r["speculator"] == name]).sort_values("keep_rate")
        lines = df["keep_rate"].nunique() >= LINES_FROM
        blue, _ = sns.color_palette(n_colors=2)
        _curve(ax, df["keep_rate"], df["jaccard"], df["jaccard_low"], df["jaccard_high"], lines=lines, color=blue,
               label="speculator")  # fmt: skip
        _curve(ax, df["keep_rate"], df["random_jaccard"], lines=lines, color="grey", ls="--", label="random")
        if not lines:
            _categorical_x(ax, df["keep_rate"])
        ax.set(title=f"{name}: top-k Jaccard with the base", xlabel="keep rate", ylabel="Jaccard", ylim=(0, 1))
        _legend(ax, 2)
    fig.tight_layout()
    return _save(fig, path)


def board_frontier(rows: list[dict], path) -> Path:
    """The leaderboard's frontier: per task group (panels) accuracy against TTFT speedup, one point per method and
    keep rate, a colour per machine; each machine's frontier (no other point of that machine both faster and more
    accurate: speedups are each machine's own) joined by a dashed line and labelled."""
    df = pd.DataFrame(rows).dropna(subset=["speedup", "accuracy"])
    groups = list(dict.fromkeys(df["group"])) or ["(no rows)"]
    machines = sorted(set(df["machine"])) if "machine" in df else []
    fig, axes = plt.subplots(1, len(groups), figsize=(5.2 * len(groups), 4.2), squeeze=False)
    colors = dict(zip(machines, sns.color_palette(n_colors=max(1, len(machines)))))
    for ax, group in zip(axes[0], groups):
        for machine in machines:
            g = df[(df["group"] == group) & (df["machine"] == machine)].sort_values("speedup")
            front = g[stats.pareto(g["speedup"], g["accuracy"])] if len(g) else g
            name = machine if len(machines) > 1 else "method at a keep rate"
            ax.scatter(g["speedup"], g["accuracy"], color=colors[machine], s=18, label=name)
            if len(front) >= 2:
                ax.plot(front["speedup"], front["accuracy"], color=colors[machine], ls="--")
            for _, r in front.iterrows():  # labels of the right fifth point left: none runs past the panel's edge
                left = bool(r["speedup"] > 0.8 * df["speedup"].max())
                ax.annotate(f"{r['method']}@{r['keep_rate']:g}", (r["speedup"], r["accuracy"]),
                            xytext=(-4 if left else 4, 4), textcoords="offset points", fontsize="small",
                            ha="right" if left else "left")  # fmt: skip
        ax.set(xlabel="TTFT speedup vs full prefill (x)", ylabel="accuracy", title=str(group), ylim=(-5, 105))
        _legend(ax, max(1, len(machines)))
    return _save(fig, path)
