"""seaborn figures for the benchmarks and experiments. Each is saved as PNG and as SVG beside it (same stem), every
file written atomically, and shown once in the cell that draws it when drawn in a Jupyter kernel.

No backend is forced: a kernel runs matplotlib's inline backend (ipykernel sets it), which must stay for figures to
reach executed notebooks; scripts, the CLI and tests without a display get Agg from matplotlib's own choice."""

from __future__ import annotations

import io
from pathlib import Path

import matplotlib
import matplotlib.pyplot as plt
import pandas as pd
import seaborn as sns

from specprefill.atomic import write_bytes

DPI = 160  # saved PNGs: sharp in the report and on dense screens, still ~100-400 KB each
PALETTE = "colorblind"  # seaborn's colour-blind-safe qualitative palette: every categorical hue and the colour cycle
SEQUENTIAL = "viridis"  # perceptually uniform and colour-blind-safe: ordered hues and heatmaps
INLINE = ("inline", "module://matplotlib_inline.backend_inline")  # the kernel's backend by either of its names

sns.set_theme(style="whitegrid", context="notebook", palette=PALETTE)


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
        from IPython.display import display  # lazy: only a kernel has it loaded, scripts need not import IPython

        display(fig)
    plt.close(fig)
    return path


def ttft(rows: list[dict], path) -> Path:
    """Speedup and its Amdahl bound against the keep rate (one line per length) when the rows sweep more keep rates
    than lengths, else against the length (one line per keep rate); one panel per configuration family."""
    df = pd.DataFrame([{k: v for k, v in r.items() if not k.startswith("overhead")} for r in rows])
    if "label" not in df:
        df["label"] = "specprefill"
    by_rate = df["keep_rate"].nunique() > df["length"].nunique()
    x, hue = ("keep_rate", "length") if by_rate else ("length", "keep_rate")
    long = df.melt(id_vars=[x, hue, "label"], value_vars=["speedup", "bound"], var_name="what", value_name="speed")
    grid = sns.relplot(
        data=long,
        x=x,
        y="speed",
        hue=hue,
        style="what",
        col="label" if df["label"].nunique() > 1 else None,
        kind="line",
        markers=True,
        palette=SEQUENTIAL,
        height=3.5,
        aspect=1.3,
    )
    grid.set(ylabel="TTFT speedup vs full prefill (x)", xlabel="keep rate" if by_rate else "prompt tokens")
    if not by_rate:
        grid.set(xscale="log")
    batch = f", {int(df['batch'].max())}-request batches" if "batch" in df and df["batch"].max() > 1 else ""
    grid.figure.suptitle(f"SpecPrefill TTFT speedup and its Amdahl bound{batch}", y=1.03)
    return _save(grid.figure, path)


def qps(rows: list[dict], slo_s: float, path) -> Path:
    fig, ax = plt.subplots(figsize=(5, 3.5))
    offered = pd.DataFrame(rows).query("rate != inf")  # a burst (all requests at once) has no offered rate
    sns.lineplot(data=offered, x="rate", y="ttft_p90", hue="mode", marker="o", ax=ax)
    ax.axhline(slo_s, ls="--", c="grey", label="SLO")
    ax.set(xlabel="offered load (requests/s)", ylabel="p90 TTFT (s)", yscale="log", title="TTFT under Poisson load")
    return _save(fig, path)


def category_qps(rows: list[dict], categories: dict[str, dict], path) -> Path:
    """One panel per category (the paper's Figure 2 layout): mean latency of the served requests against the offered
    rate, plain vLLM and SpecPrefill, the category's timeout dashed; a rate not sustained is drawn hollow."""
    df = pd.DataFrame(rows)
    fig, axes = plt.subplots(1, len(categories), figsize=(4.2 * len(categories), 3.6), squeeze=False)
    colors = dict(zip(("vllm", "specprefill"), sns.color_palette(n_colors=2)))
    for ax, (name, cat) in zip(axes[0], categories.items()):
        for mode, g in df[df["category"] == name].groupby("mode"):
            g = g.sort_values("rate")
            ax.plot(g["rate"], g["latency_mean"], color=colors.get(mode), label=mode, marker="o")
            missed = g[~g["sustained"].astype(bool)]
            ax.scatter(
                missed["rate"], missed["latency_mean"], facecolors="white", edgecolors=colors.get(mode), zorder=3
            )
        ax.axhline(cat["timeout_s"], ls="--", c="grey")
        ax.set(title=f"{name}: keep {cat['keep_rate']:g}, timeout {cat['timeout_s']:g} s", xlabel="QPS")
        ax.set_ylabel("mean latency of served requests (s)")
        ax.legend()
    fig.tight_layout()
    return _save(fig, path)


def _n(summary) -> str:
    lo, hi = int(summary["n"].min()), int(summary["n"].max())
    return f"n = {lo}" if lo == hi else f"n = {lo}-{hi}"


def _interval(df: pd.DataFrame):
    """yerr for matplotlib from ci_low/ci_high (0 where a cell has no interval: a single sample)."""
    low = (df["score"] - df["ci_low"]).fillna(0).clip(lower=0)
    high = (df["ci_high"] - df["score"]).fillna(0).clip(lower=0)
    return [low.to_numpy(), high.to_numpy()]


def _line_band(data, color, label=None, **_):
    d = data.sort_values("keep_rate")
    plt.plot(d["keep_rate"], d["score"], marker="o", color=color, label=label)
    plt.fill_between(d["keep_rate"], d["ci_low"], d["ci_high"], color=color, alpha=0.18, lw=0)


def quality_vs_keep(summary, path, title: str) -> Path:
    """Score vs keep rate per method with its 95% interval as a band, one panel per task; full prefill (no keep
    rate) as a dashed line with its interval shaded grey."""
    pruned = summary[summary["label"] != "full"]
    grid = sns.FacetGrid(
        pruned,
        col="task",
        hue="label",
        col_wrap=min(3, max(1, summary["task"].nunique())),
        height=3,
        aspect=1.2,
        sharey=False,
    )
    grid.map_dataframe(_line_band)
    for task, ax in grid.axes_dict.items():
        full = summary[(summary["label"] == "full") & (summary["task"] == task)]
        if len(full):
            ax.axhline(float(full["score"].mean()), ls="--", c="black", label="full prompt")
            if full["ci_low"].notna().all():
                ax.axhspan(float(full["ci_low"].min()), float(full["ci_high"].max()), color="grey", alpha=0.15, lw=0)
    grid.add_legend()
    grid.set(xlabel="keep rate", ylabel="score (95% CI)")
    grid.figure.suptitle(f"{title} ({_n(summary)} per point)", y=1.03)
    return _save(grid.figure, path)


def _bars_ci(data, x, color=None, **_):
    ax = plt.gca()
    ax.bar(data[x].astype(str), data["score"], color=sns.color_palette()[0])
    ax.errorbar(data[x].astype(str), data["score"], yerr=_interval(data), fmt="none", ecolor="black", capsize=3)


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
    for ax in grid.axes.flat:
        ax.tick_params(axis="x", rotation=30)
    grid.set(ylabel="score (95% CI)")
    grid.figure.suptitle(f"{title} ({_n(summary)} per bar)", y=1.03)
    return _save(grid.figure, path)


def agreement(matrices: dict[str, dict[str, pd.DataFrame]], summary: list[dict], path) -> Path:
    """Per speculator (columns): heatmaps of KL(base || speculator) and Kendall tau for every pair of layers (rows),
    then the top-k Jaccard of the final importance against the keep rate, a random scorer dashed."""
    names = list(matrices)
    fig, axes = plt.subplots(3, len(names), figsize=(4.2 * len(names), 11), squeeze=False)
    for col, name in enumerate(names):
        for row, (metric, title) in enumerate((("kl", "KL(base || speculator)"), ("tau", "Kendall tau"))):
            ax = axes[row, col]
            # the cells as one image in the SVG (a path per cell makes it ~4x larger), axes and text stay vector
            sns.heatmap(matrices[name][metric], ax=ax, cmap=SEQUENTIAL, cbar_kws={"shrink": 0.8}, rasterized=True)
            ax.invert_yaxis()
            ax.set(title=f"{name}: {title}", xlabel="base layer", ylabel="speculator layer")
        ax = axes[2, col]
        df = pd.DataFrame([r for r in summary if r["speculator"] == name]).sort_values("keep_rate")
        ax.plot(df["keep_rate"], df["jaccard"], marker="o", label="speculator")
        ax.fill_between(df["keep_rate"], df["jaccard_low"], df["jaccard_high"], alpha=0.2, lw=0)
        ax.plot(df["keep_rate"], df["random_jaccard"], ls="--", c="grey", label="random")
        ax.set(title=f"{name}: top-k Jaccard with the base", xlabel="keep rate", ylabel="Jaccard", ylim=(0, 1))
        ax.legend()
    fig.tight_layout()
    return _save(fig, path)
