"""`specprefill bench analysis`: the prompt analysis' time per length and document kind (`workbench.analysis`)."""

from __future__ import annotations

import os

from specprefill.cli import common


def add(bench_sub) -> None:
    p = bench_sub.add_parser(
        "analysis", help="time of reading a prompt's structure and selecting (no model) per length and document kind"
    )
    p.add_argument("--tokenizer", default=common.DEFAULT_PAIR["base"], help="registry model, directory or hub id")
    p.add_argument("--lengths", default="4096,16384,65536,131072")
    p.add_argument("--kinds", default="prose,records,code,one-line")
    p.add_argument("--reps", type=int, default=5, help="timed runs per cell (the median is reported)")
    p.add_argument("--out", default=None, help="directory for analysis.json")
    p.add_argument("--json", action="store_true", help="print the result as JSON")


def run(args) -> dict:
    from transformers import AutoTokenizer  # lazy: transformers

    from specprefill.models import resolution  # lazy: torch
    from specprefill.workbench import analysis, store  # lazy: torch

    lengths = common.numbers(args.lengths, int, "--lengths")
    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    machine = common.machine_header("bench")
    tokenizer = AutoTokenizer.from_pretrained(resolution.resolve(args.tokenizer))
    rows = analysis.run(tokenizer, lengths, kinds, args.reps)
    result = {"rows": rows, "machine": machine, "config": vars(args)}
    result["table"] = "\n".join(lines(result))
    if args.out:
        store.write_json(os.path.join(args.out, "analysis.json"), result)
    return result


def lines(result: dict) -> list[str]:
    """The table a person reads: per kind and length, the median ms, ms per 16k tokens and the growth."""
    out = [f"{'kind':<9} {'tokens':>7} {'layout ms':>9} {'total ms':>9} {'ms/16k':>7} {'x time':>7} {'x tokens':>8}"]
    for r in result["rows"]:
        growth = f"{r['growth']:.2f}" if "growth" in r else ""
        ratio = f"{r['length_ratio']:.2f}" if "length_ratio" in r else ""
        out.append(
            f"{r['kind']:<9} {r['tokens']:>7} {1000 * r['layout_s']:>9.1f} {1000 * r['total_s']:>9.1f} "
            f"{r['ms_per_16k']:>7.1f} {growth:>7} {ratio:>8}"
        )
    return out
