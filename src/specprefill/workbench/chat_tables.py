"""What the chat benchmark's rows say (`workbench.chat`): per mode, server and turn the median TTFT and its ratio to
plain vLLM's and to SpecPrefill fresh's, tokens computed, answers right per server, answers one tenant's request
leaked into another's, and the checks the section prints."""

from __future__ import annotations

import pandas as pd

from specprefill.workbench import stats

LABELS = {
    "vllm": "vLLM + prefix caching",
    "specprefill": "SpecPrefill as served (prefix caching)",
    "specprefill-no-reuse": "SpecPrefill fresh (no prefix caching)",
}
MODES = ("conversation", "shared", "shared-tenants")


def _ratio(rows: pd.DataFrame, kind: str, over: str) -> pd.Series:
    """Per mode and turn: the median over documents of TTFT(`over`) / TTFT(`kind`), paired by document."""
    wide = rows.pivot_table(index=["mode", "conversation", "turn"], columns="server", values="ttft_s")
    if kind not in wide or over not in wide:
        return pd.Series(dtype=float)
    return (wide[over] / wide[kind]).groupby(level=["mode", "turn"]).median()


def _with_mode(rows: list[dict]) -> pd.DataFrame:
    df = pd.DataFrame(rows)
    if "mode" not in df:
        df["mode"] = "conversation"
    return df


def turn_table(rows: list[dict]) -> pd.DataFrame:
    """Per mode, server and turn (a shared document's turn: its n-th user): median TTFT, its ratio to plain vLLM's
    (> 1: faster) and to SpecPrefill fresh's, median tokens computed by the base and by the speculator, the base's
    median hit rate, answers correct (k/n)."""
    df = _with_mode(rows)
    g = df.groupby(["mode", "server", "turn"])
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
        out[column] = [ratios[k].get((m, t), float("nan")) for m, k, t in zip(out["mode"], out["server"], out["turn"])]
    order = {k: i for i, k in enumerate(LABELS)}
    modes = {m: i for i, m in enumerate(MODES)}
    keys = {"server": order, "mode": modes}
    return out.sort_values(["mode", "server", "turn"], key=lambda c: c.map(keys[c.name]) if c.name in keys else c)


def accuracy(rows: list[dict]) -> pd.DataFrame:
    """Per mode and server: answers correct on turn 1 and on the later turns, with Wilson 95% intervals."""
    df = _with_mode(rows)
    out = []
    for (mode, kind), group in df.groupby(["mode", "server"], sort=False):
        for part, sel in (("turn 1", group["turn"] == 1), ("later turns", group["turn"] > 1)):
            k, n = int(group.loc[sel, "correct"].sum()), int(sel.sum())
            low, high = stats.wilson(k, n)
            out.append({"mode": mode, "server": kind, "turns": part, "correct": k, "n": n, "low": low, "high": high})
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


def checks(table: pd.DataFrame, acc: pd.DataFrame, rows: list[dict] | None = None) -> list[str]:
    """The claims, each "holds" or "fails" with its numbers, per mode: SpecPrefill as served right at least as often
    as SpecPrefill fresh on turns >= 2 (conversations) or on every request (shared), plain vLLM's count beside them;
    the total TTFT of each document's requests no higher than plain vLLM's; with a tenant per user, no request
    reusing anything another left."""
    lines: list[str] = []
    df = _with_mode(rows or [])
    if "mode" not in acc:
        acc = acc.assign(mode="conversation")
    for mode in [m for m in MODES if m in set(acc["mode"])]:
        part = "later turns" if mode == "conversation" else None
        got = acc[(acc["mode"] == mode) & ((acc["turns"] == part) if part else True)]
        count = got.groupby("server")[["correct", "n"]].sum()
        if {"specprefill", "specprefill-no-reuse"} <= set(count.index):
            a, b = count.loc["specprefill"], count.loc["specprefill-no-reuse"]
            verdict = "holds" if a["correct"] >= b["correct"] else "fails"
            plain = f", vLLM {count.loc['vllm', 'correct']}/{count.loc['vllm', 'n']}" if "vllm" in count.index else ""
            lines.append(
                f"{mode}: {part or 'all requests'} correct: as served {a['correct']}/{a['n']} vs fresh "
                f"{b['correct']}/{b['n']}{plain} ({verdict})"
            )
        mine = df[df["mode"] == mode] if not df.empty else df
        if not mine.empty and {"specprefill", "vllm"} <= set(mine["server"]):
            total = mine.groupby(["conversation", "server"])["ttft_s"].sum().unstack("server")
            ok = int((total["specprefill"] <= total["vllm"]).sum())
            verdict = "holds" if ok == len(total) else "fails"
            lines.append(
                f"{mode}: total TTFT per document <= vLLM + prefix caching in {ok}/{len(total)} "
                f"(as served {total['specprefill'].sum():.1f} s vs {total['vllm'].sum():.1f} s) ({verdict})"
            )
    if rows and "shared-tenants" in set(df["mode"]):
        leaks = shared_leaks(rows)
        lines.append(
            f"shared-tenants: requests reusing another tenant's state: {leaks} ({'holds' if not leaks else 'fails'})"
        )
    return lines
