"""`scripts/gpu_check.py --engine hf`: the reference engine's checks (`checks`, `ttft`) within a time budget, each
reported as ran, refused (with its reason) or failed, on one screen and in `report.json`. Every unit of work (the
families, core, each TTFT cell) has a predicted time; a unit that would not fit in what is left of `--budget-s` is
refused with that reason instead of run."""

from __future__ import annotations

import argparse
import json
import tempfile
import time
import traceback
from pathlib import Path

import torch

from specprefill import atomic
from specprefill.refcheck import checks, ttft

FAMILY_S = 8.0  # predicted seconds per family (four tiny engines, three prompts), planning only
CORE_S_PER_MTOKEN = 60.0  # predicted seconds of the core check per million prompt tokens (CPU reference included)
LABEL = "transformers reference engine, random weights"


def _versions() -> dict:
    import transformers

    cuda = torch.cuda.is_available()
    return {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cuda": torch.version.cuda,
        "device_name": torch.cuda.get_device_name(0) if cuda else None,
    }


def manifest(root: Path) -> list[tuple[str, int]]:
    """The files the check needs on a GPU node, with their sizes: the package's Python sources and the script (a
    source checkout; no weights, no data)."""
    files = sorted((root / "src" / "specprefill").rglob("*.py")) + [root / "scripts" / "gpu_check.py"]
    return [(str(p.relative_to(root)), p.stat().st_size) for p in files]


def _write(out: Path, report: dict) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    return atomic.write_text(out / "report.json", json.dumps(report, indent=1, default=str) + "\n")


class Budget:
    """Seconds left of the run's budget; `fits(predicted)` says whether a unit may start."""

    def __init__(self, seconds: float) -> None:
        self.seconds, self.start = seconds, time.perf_counter()

    @property
    def left(self) -> float:
        return self.seconds - (time.perf_counter() - self.start)

    def refusal(self, predicted: float) -> str | None:
        if predicted <= self.left:
            return None
        return f"predicted ~{predicted:.0f} s, {max(0.0, self.left):.0f} s of --budget-s left"


def _run(name: str, predicted: float, budget: Budget, fn) -> dict:
    """One check: refused if it would not fit, else ran (no failure) or failed (its failures or exception)."""
    entry: dict = {"covers": checks.CHECKS.get(name, name), "predicted_s": round(predicted, 1)}
    refusal = budget.refusal(predicted)
    if refusal is not None:
        return {**entry, "result": "refused", "reason": refusal}
    t0 = time.perf_counter()
    try:
        found = fn()
    except Exception as exc:  # noqa: BLE001 - reported as the check's failure, the run goes on
        last = traceback.format_exception_only(type(exc), exc)[-1].strip()
        return {**entry, "result": "failed", "reason": last, "seconds": round(time.perf_counter() - t0, 1)}
    failures = found.pop("failures", [])
    result = "failed" if failures else "ran"
    out = {**entry, "result": result, "seconds": round(time.perf_counter() - t0, 1), **found}
    if failures:
        out["reason"] = f"{len(failures)} failure(s): {failures[0]}"
        out["failures"] = failures
    return out


def ttft_check(scale: checks.Scale, device: str, budget: Budget) -> dict:
    """Every (pair, length) cell that fits the budget and the device's memory; the paper's own pair said not to fit
    one GPU (at GPU scale)."""
    rate = ttft.matmul_rate(device, torch.bfloat16)
    cells: list[dict] = []
    rows: list[dict] = []
    if scale.name == "gpu":
        spec, base = (scale.shapes[n] for n in checks.PAPER_PAIR)
        paper = (
            ttft.memory_refusal(spec, base, 8192, device) or "fits this GPU, but the check times the 1B/3B -> 8B pairs"
        )
        cells.append({"pair": " -> ".join(checks.PAPER_PAIR), "result": "refused", "reason": paper})
    t0 = time.perf_counter()
    for names in scale.pairs:
        spec, base = (scale.shapes[n] for n in names)
        lengths: list[int] = []
        for m in scale.ttft_lengths:
            predicted = ttft.predicted_s(spec, base, m, scale.repeats, rate)
            why: str | None = ttft.memory_refusal(spec, base, m, device) or budget.refusal(predicted)
            cell: dict = {"pair": " -> ".join(names), "tokens": m, "predicted_s": round(predicted, 1)}
            cells.append({**cell, "result": "refused", "reason": why} if why else {**cell, "result": "ran"})
            if why is None:
                lengths.append(m)
        if lengths:
            rows += ttft.time_pair(names, scale.shapes, lengths, device, scale.repeats)
    ran = [c for c in cells if c["result"] == "ran"]
    return {
        "label": LABEL,
        "matmul_tflops": round(rate / 1e12, 3),
        "cells": cells,
        "rows": rows,
        "failures": [],
        **({} if ran else {"none_ran": True}),
        "seconds_timing": round(time.perf_counter() - t0, 1),
    }


def run(scale: checks.Scale, device: str, budget_s: float, out: Path, families: list[str] | None = None) -> dict:
    budget = Budget(budget_s)
    report: dict = {"scale": scale.name, "device": device, "budget_s": budget_s, **_versions(), "checks": {}}
    with tempfile.TemporaryDirectory(prefix="specprefill-refcheck-") as folder:
        n_families = len(families) if families else 7
        report["checks"]["families"] = _run(
            "families",
            FAMILY_S * n_families,
            budget,
            lambda: checks.check_families(device, Path(folder), families, scale.family_prompts),
        )
    core_tokens = sum(scale.core_lengths) / 1e6
    report["checks"]["core"] = _run(
        "core", CORE_S_PER_MTOKEN * core_tokens, budget, lambda: checks.check_core(device, scale)
    )
    report["checks"]["ttft"] = _run("ttft", 0.0, budget, lambda: ttft_check(scale, device, budget))
    if report["checks"]["ttft"].pop("none_ran", False):
        report["checks"]["ttft"].update(result="refused", reason="no TTFT cell fits (see cells)")
    report["seconds"] = round(time.perf_counter() - budget.start, 1)
    report["path"] = str(_write(out, report))
    return report


def screen(report: dict) -> str:
    """One screen: each check's result, then the TTFT table."""
    lines = [f"gpu-check --engine hf on {report['device_name'] or report['device']} ({report['scale']} scale, "
             f"torch {report['torch']}, transformers {report['transformers']}, {report['seconds']} s): "
             f"{report['path']}"]  # fmt: skip
    for name, c in report["checks"].items():
        lines.append(f"  {c['result']:8s} {name}" + (f": {c['reason']}" if c.get("reason") else ""))
    rows = report["checks"]["ttft"].get("rows") or []
    if rows:
        lines.append(f"  TTFT ({LABEL}): pair, tokens, keep, full s, SpecPrefill s, speedup, bound, efficiency, peak")
    for r in rows:
        peak = f"{r['peak_gib']:.1f} GiB" if r["peak_gib"] is not None else "-"
        pair = f"{r['speculator'].split('/')[-1]} -> {r['base'].split('/')[-1]}"
        lines.append(
            f"    {pair}  {r['tokens']:>6}  {r['keep_rate']:.1f}"
            f"  {r['full_s']:.3f}  {r['specprefill_s']:.3f}  {r['speedup']:.2f}x  {r['bound']:.2f}x"
            f"  {r['efficiency']:.2f}  {peak}"
        )
    for c in report["checks"]["ttft"].get("cells", []):
        if c["result"] == "refused":
            lines.append(f"    refused {c['pair']} {c.get('tokens', '')}: {c['reason']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None, root: Path | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gpu_check.py --engine hf", description=__doc__.split("\n\n")[0])
    parser.add_argument("--list", action="store_true", help="name every check and what it covers, then exit")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes (on the CPU when there is no CUDA device)")
    parser.add_argument("--budget-s", type=float, default=480.0, help="seconds the whole check may take")
    parser.add_argument("--out", default=str((root or Path.cwd()) / "outputs" / "gpu-check"))
    args = parser.parse_args(argv)
    if args.list:
        for name, covers in checks.CHECKS.items():
            print(f"{name}: {covers}")
        return 0
    from transformers.utils import logging

    logging.disable_progress_bar()  # one screen of results, not of loading bars
    cuda = torch.cuda.is_available()
    if not cuda and not args.tiny:
        print("gpu-check --engine hf: no CUDA GPU on this machine (torch.cuda.is_available() is False): nothing was "
              "checked; --tiny runs the same checks on the CPU with tiny shapes")  # fmt: skip
        return 0
    report = run(checks.TINY if args.tiny else checks.GPU, "cuda" if cuda else "cpu", args.budget_s, Path(args.out))
    print(screen(report))
    return 1 if any(c["result"] == "failed" for c in report["checks"].values()) else 0
