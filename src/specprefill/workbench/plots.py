"""seaborn figures for the benchmarks and experiments; every file is written atomically (temp + rename)."""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display: must precede pyplot
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402
import seaborn as sns  # noqa: E402

from specprefill.atomic import atomic_path  # noqa: E402

sns.set_theme(style="whitegrid", context="notebook")


def _save(fig, path) -> Path:
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return Path(path)


def ttft(rows: list[dict], path) -> Path:
    df = pd.DataFrame([{k: v for k, v in r.items() if not k.startswith("overhead")} for r in rows])
    long = df.melt(id_vars=["length", "keep_rate"], value_vars=["speedup", "bound"], var_name="what", value_name="x")
    grid = sns.relplot(data=long, x="length", y="x", hue="keep_rate", style="what", kind="line", markers=True,
                       palette="viridis", height=3.5, aspect=1.3)
    grid.set(xscale="log", ylabel="TTFT speedup vs full prefill (x)", xlabel="prompt tokens")
    grid.figure.suptitle("SpecPrefill TTFT speedup and its Amdahl bound", y=1.03)
    return _save(grid.figure, path)


def qps(rows: list[dict], slo_s: float, path) -> Path:
    fig, ax = plt.subplots(figsize=(5, 3.5))
    offered = pd.DataFrame(rows).query("rate != inf")  # a burst (all requests at once) has no offered rate
    sns.lineplot(data=offered, x="rate", y="ttft_p90", hue="mode", marker="o", ax=ax)
    ax.axhline(slo_s, ls="--", c="grey", label="SLO")
    ax.set(xlabel="offered load (requests/s)", ylabel="p90 TTFT (s)", yscale="log", title="TTFT under Poisson load")
    return _save(fig, path)


def quality_vs_keep(summary, path, title: str) -> Path:
    """Score vs keep rate per method, one panel per task; methods without a keep rate (full) as lines."""
    pruned = summary[summary["label"] != "full"]
    grid = sns.relplot(data=pruned, x="keep_rate", y="score", hue="label", col="task", kind="line", marker="o",
                       col_wrap=min(3, max(1, summary["task"].nunique())), height=3, aspect=1.2,
                       facet_kws={"sharey": False})
    for task, ax in grid.axes_dict.items():
        full = summary[(summary["label"] == "full") & (summary["task"] == task)]
        if len(full):
            ax.axhline(float(full["score"].mean()), ls="--", c="black", label="full prompt")
    grid.set(xlabel="keep rate", ylabel="score")
    grid.figure.suptitle(title, y=1.03)
    return _save(grid.figure, path)


def bars(summary, x: str, path, title: str) -> Path:
    grid = sns.catplot(data=summary, x=x, y="score", col="task", kind="bar", height=3, aspect=1.6, sharey=False,
                       col_wrap=min(2, max(1, summary["task"].nunique())))
    for ax in grid.axes.flat:
        ax.tick_params(axis="x", rotation=30)
    grid.figure.suptitle(title, y=1.03)
    return _save(grid.figure, path)


def agreement(rows: list[dict], path) -> Path:
    df = pd.DataFrame(rows).melt(id_vars=["prompt", "keep_rate"], value_vars=["overlap", "random_overlap"],
                                 var_name="scorer", value_name="top-k overlap")
    fig, ax = plt.subplots(figsize=(5, 3.5))
    sns.lineplot(data=df, x="keep_rate", y="top-k overlap", hue="scorer", marker="o", ax=ax)
    ax.set(title="speculator vs base importance: top-k overlap", xlabel="keep rate")
    return _save(fig, path)
