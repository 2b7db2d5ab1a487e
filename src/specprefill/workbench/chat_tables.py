"""What the chat benchmark's rows say (`workbench.chat`): per mode, think time, server and turn the median TTFT and
its ratio to plain vLLM's and to SpecPrefill fresh's, tokens computed, answers right per server, answers one tenant's
request leaked into another's, and the checks the section prints (the serving issue's bars, each "holds" or
"fails" with its numbers)."""

from __future__ import annotations

import math

import pandas as pd

from specprefill.settings import CHAT_MODES as MODES
from specprefill.workbench import stats

LABELS = {
    "vllm": "vLLM + prefix caching",
    "specprefill": "SpecPrefill as served (prefix caching)",
    "specprefill-no-reuse": "SpecPrefill fresh (no prefix caching)",
}
KEYS = ["mode", "think_s"]  # a workload at one think time: what every table and check is per


def _ratio(rows: pd.DataFrame, kind: str, over: str) -> pd.Series:
    """Per mode, think time and turn: the median over documents of TTFT(`over`) / TTFT(`kind`), paired by document."""
    wide = rows.pivot_table(index=[*KEYS, "conversation", "turn"], columns="server", values="ttft_s")
    if kind not in wide or over not in wide:
        return pd.Series(dtype=float)
    return (wide[over] / wide[kind]).groupby(level=[*KEYS, "turn"]).median()


def _with_mode(rows: list[dict]) -> pd.DataFrame:
    df = pd.DataFrame(rows)
    if "mode" not in df:
        df["mode"] = "conversation"
    if "think_s" not in df:
        df["think_s"] = 0.0
    return df


def turn_table(rows: list[dict]) -> pd.DataFrame:
    """Per mode, think time, server and turn (a shared document's turn: its n-th user): median TTFT, its ratio to
    plain vLLM's (> 1: faster) and to SpecPrefill fresh's, median tokens computed by the base and by the speculator,
    the base's median hit rate, answers correct (k/n)."""
    df = _with_mode(rows)
    g = df.groupby([*KEYS, "server", "turn"])
    out = g.agg(
        ttft_s=("ttft_s", "median"),
        base_prefilled=("base_prefilled_tokens", "median"),
        speculator_prefilled=("speculator_prefilled_tokens", "median"),
        speculation_ms=("speculation_ms", "median"),
        base_hit_rate=("base_hit_rate", "median"),
        correct=("correct", "sum"),
        n=("correct", "size"),
    ).reset_index()
    for over, column in (("vllm", "speedup_vs_vllm"), ("specprefill-no-reuse", "speedup_vs_before")):
        ratios = {k: _ratio(df, k, over) for k in out["server"].unique()}
        out[column] = [
            ratios[k].get((m, th, t), float("nan"))
            for m, th, k, t in zip(out["mode"], out["think_s"], out["server"], out["turn"])
        ]
    order = {k: i for i, k in enumerate(LABELS)}
    modes = {m: i for i, m in enumerate(MODES)}
    keys = {"server": order, "mode": modes}
    return out.sort_values(
        [*KEYS, "server", "turn"], key=lambda c: c.map(keys[c.name]) if c.name in keys else c
    ).reset_index(drop=True)


def accuracy(rows: list[dict]) -> pd.DataFrame:
    """Per mode, think time and server: answers correct on turn 1 and on the later turns, with Wilson 95%
    intervals."""
    df = _with_mode(rows)
    out = []
    for (mode, think, kind), group in df.groupby([*KEYS, "server"], sort=False):
        for part, sel in (("turn 1", group["turn"] == 1), ("later turns", group["turn"] > 1)):
            k, n = int(group.loc[sel, "correct"].sum()), int(sel.sum())
            low, high = stats.wilson(k, n)
            out.append(
                {
                    "mode": mode,
                    "think_s": think,
                    "server": kind,
                    "turns": part,
                    "correct": k,
                    "n": n,
                    "low": low,
                    "high": high,
                }
            )
    return pd.DataFrame(out)


def shared_leaks(rows: list[dict]) -> int:
    """SpecPrefill requests of the tenant-per-user mode that used anything another request left: a reuse, a token
    the speculator's or the base's cache held."""
    df = _with_mode(rows)
    ours = df[(df["mode"] == "shared-tenants") & (df["server"] == "specprefill")]
    leaked = (
        (ours["reuse"].fillna("") != "")
        | (ours["speculator_prefilled_tokens"] < ours["prompt_tokens"])
        | (ours["base_prefilled_tokens"] < ours["base_received_tokens"])
    )
    return int(leaked.sum())


# the serving issue's bars: total TTFT per conversation <= plain vLLM's in this share of conversations, CPU-seconds at
# most this multiple of plain's, turn 1 this much faster, a later turn at least this ratio at think times from
# LATER_THINK_S, an agent's later turns this much faster, later-turn answers at most this many below plain's
TOTAL_SHARE, CPU_RATIO, TURN1_SPEEDUP, LATER_RATIO, LATER_THINK_S, AGENT_SPEEDUP, ANSWER_SLACK = (
    2 / 3, 1.15, 1.5, 0.9, 10.0, 1.2, 1,
)  # fmt: skip


def _verdict(ok: bool) -> str:
    return "holds" if ok else "fails"


def _later_median(df: pd.DataFrame, over: str, kind: str) -> float:
    """The median over every later turn of every document of TTFT(`over`) / TTFT(`kind`), paired."""
    wide = df[df["turn"] > 1].pivot_table(index=["conversation", "turn"], columns="server", values="ttft_s")
    return float((wide[over] / wide[kind]).median()) if {over, kind} <= set(wide) else math.nan


def _against_plain(name: str, mode: str, think: float, mine: pd.DataFrame, spent: pd.DataFrame, multi_turn: bool):
    """One workload at one think time against plain vLLM: total TTFT per document, CPU-seconds, turn 1's speedup,
    the later turns' median ratio."""
    lines = []
    total = mine.groupby(["conversation", "server"])["ttft_s"].sum().unstack("server")
    ok = int((total["specprefill"] <= total["vllm"]).sum())
    lines.append(
        f"{name}: total TTFT per document <= vLLM + prefix caching in {ok}/{len(total)} "
        f"(as served {total['specprefill'].sum():.1f} s vs {total['vllm'].sum():.1f} s) "
        f"({_verdict(ok >= TOTAL_SHARE * len(total))})"
    )
    cpu = spent.groupby("server")["cpu_s"].sum(min_count=1)
    if {"specprefill", "vllm"} <= set(cpu.dropna().index):
        ratio = cpu["specprefill"] / cpu["vllm"]
        lines.append(
            f"{name}: CPU-seconds, background included: as served {cpu['specprefill']:.0f} vs vLLM "
            f"{cpu['vllm']:.0f} ({ratio:.2f}x; <= {CPU_RATIO}x: {_verdict(ratio <= CPU_RATIO)})"
        )
    if multi_turn:
        first = mine[mine["turn"] == 1].pivot_table(index="conversation", columns="server", values="ttft_s")
        speedup = float((first["vllm"] / first["specprefill"]).median())
        lines.append(
            f"{name}: turn 1 median speedup {speedup:.2f}x (>= {TURN1_SPEEDUP}x: {_verdict(speedup >= TURN1_SPEEDUP)})"
        )
        later = _later_median(mine, "vllm", "specprefill")
        bar = AGENT_SPEEDUP if mode == "agent" else LATER_RATIO if think >= LATER_THINK_S else None
        if math.isnan(later):  # one turn per conversation: no later turn to judge
            return lines
        lines.append(
            f"{name}: later turns median ratio vLLM/as served {later:.2f}x"
            + (f" (>= {bar}x: {_verdict(later >= bar)})" if bar is not None else " (no bar below think 10 s)")
        )
    return lines


def checks(
    table: pd.DataFrame, acc: pd.DataFrame, rows: list[dict] | None = None, cpu: list[dict] | None = None
) -> list[str]:
    """The claims per mode and think time, each "holds" or "fails" with its numbers: against plain vLLM the total
    TTFT per document, the CPU-seconds (background included), turn 1's speedup, the later turns' median ratio (from
    `LATER_THINK_S` in conversations, at every think time for an agent), later-turn answers; against SpecPrefill
    fresh, answers; with a tenant per user, no request reusing anything another left."""
    lines: list[str] = []
    df = _with_mode(rows or [])
    for col, value in (("mode", "conversation"), ("think_s", 0.0)):
        if col not in acc:
            acc = acc.assign(**{col: value})
    usage = pd.DataFrame(cpu or [], columns=["server", "mode", "think_s", "conversation", "cpu_s"])
    groups = acc[KEYS].drop_duplicates().sort_values(KEYS, key=lambda c: c.map(MODES.index) if c.name == "mode" else c)
    for mode, think in groups.itertuples(index=False):
        name = f"{mode}, think {think:g} s"
        part = "later turns" if mode in ("conversation", "agent") else None
        got = acc[(acc["mode"] == mode) & (acc["think_s"] == think) & ((acc["turns"] == part) if part else True)]
        count = got.groupby("server")[["correct", "n"]].sum()
        if {"specprefill", "specprefill-no-reuse"} <= set(count.index):
            a, b = count.loc["specprefill"], count.loc["specprefill-no-reuse"]
            plain = f", vLLM {count.loc['vllm', 'correct']}/{count.loc['vllm', 'n']}" if "vllm" in count.index else ""
            lines.append(
                f"{name}: {part or 'all requests'} correct: as served {a['correct']}/{a['n']} vs fresh "
                f"{b['correct']}/{b['n']}{plain} ({_verdict(a['correct'] >= b['correct'])})"
            )
        if {"specprefill", "vllm"} <= set(count.index) and part:
            a, p = count.loc["specprefill"], count.loc["vllm"]
            lines.append(
                f"{name}: later turns correct: as served {a['correct']}/{a['n']} vs vLLM {p['correct']}/{p['n']} "
                f"(>= vLLM's - {ANSWER_SLACK}: {_verdict(a['correct'] >= p['correct'] - ANSWER_SLACK)})"
            )
        mine = df[(df["mode"] == mode) & (df["think_s"] == think)] if not df.empty else df
        if not mine.empty and {"specprefill", "vllm"} <= set(mine["server"]):
            spent = usage[(usage["mode"] == mode) & (usage["think_s"] == think)]
            lines += _against_plain(name, mode, think, mine, spent, multi_turn=part is not None)
    if rows and "shared-tenants" in set(df["mode"]):
        leaks = shared_leaks(rows)
        lines.append(f"shared-tenants: requests reusing another tenant's state: {leaks} ({_verdict(not leaks)})")
    return lines
