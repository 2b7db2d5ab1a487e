"""`specprefill bench`: TTFT and QPS of full prefill vs SpecPrefill side by side, prefill rates, result tables."""

from __future__ import annotations

import json
import os
import sys
import time

from specprefill import flags
from specprefill.cli import bench_analysis, bench_selection, common
from specprefill.errors import SpecPrefillError
from specprefill.settings import ChatSettings


def add(sub) -> None:
    bench = sub.add_parser("bench", help="TTFT / QPS benchmarks: full prefill vs SpecPrefill, side by side")
    bench_sub = bench.add_subparsers(dest="bench", required=True, parser_class=common.Parser)
    pre = bench_sub.add_parser("prefill", help="prefill tokens/s of each model in each dtype on this machine")
    pre.add_argument("--models", default="qwen2.5-coder-0.5b,qwen2.5-coder-1.5b")
    pre.add_argument("--dtypes", default="float32,bfloat16")
    pre.add_argument("--length", type=int, default=1024)
    pre.add_argument("--reps", type=int, default=3)
    pre.add_argument("--out", default=None, help="directory for prefill.json")
    pre.add_argument("--json", action="store_true", help="print the result as JSON")
    table = bench_sub.add_parser("table", help="`bench ttft` JSON files side by side (e.g. one per speculator)")
    table.add_argument("files", nargs="+", help="ttft.json files written by `bench ttft --out DIR`")
    table.add_argument("--json", action="store_true", help="print the result as JSON")
    chat = bench_sub.add_parser(
        "chat", help="multi-turn conversations turn by turn: vLLM with prefix caching vs SpecPrefill with and without"
    )
    flags.add_flags(chat, ChatSettings)
    chat.add_argument("--out", default=None, help="directory for chat.json, the per-turn table and the server logs")
    chat.add_argument("--json", action="store_true", help="print the result as JSON")
    common.knob_flags(chat)
    common.engine_flags(chat, required=(), **common.DEFAULT_PAIR)
    bench_selection.add(bench_sub)
    bench_analysis.add(bench_sub)
    for name in ("ttft", "qps"):
        _add_timing(bench_sub, name)


def _add_timing(bench_sub, name: str) -> None:
    b = bench_sub.add_parser(name)
    b.add_argument("--out", default=None, help="directory for the JSON and the plot")
    b.add_argument("--json", action="store_true", help="print the result as JSON")
    if name == "ttft":
        b.add_argument("--lengths", default="1024,2048,4096")
        b.add_argument(
            "--keep-rates", default=None, help="keep rates to sweep (default: 0.1,0.3,0.5; --keep-rate R: R alone)"
        )
        b.add_argument("--reps", type=int, default=3)
        b.add_argument(
            "--token-budget",
            type=int,
            default=0,
            help="the original's batched regime: tokens per batch, batch = budget / length (e.g. 524288 = "
            "128 x 4096); 0: one request at a time",
        )
        b.add_argument("--warmup", type=int, default=1, help="unrecorded repetitions before the timed ones")
        b.add_argument(
            "--families",
            default="",
            help="configuration families side by side, e.g. p,p_full_lah8 (default: the knobs given here)",
        )
    else:
        b.add_argument("--length", type=int, default=2048)
        b.add_argument("--requests", type=int, default=8, help="requests per rate")
        b.add_argument("--rates", default="0.05,0.1,0.2,0.4", help="offered requests/s")
        b.add_argument("--slo", type=float, default=20.0, help="p90 TTFT limit in seconds")
        b.add_argument("--max-tokens", type=int, default=16)
        b.add_argument(
            "--burst", type=int, default=0, help="also send this many requests at once to each server (0: none)"
        )
    common.knob_flags(b)
    common.engine_flags(b, required=(), **common.DEFAULT_PAIR)


def run(args) -> dict:
    own = {"table": table, "prefill": prefill, "chat": chat}
    own |= {"selection": bench_selection.run, "analysis": bench_analysis.run}
    if args.bench in own:  # before the imports below (`table` reads JSON only)
        return own[args.bench](args)
    from specprefill import hardware  # lazy: torch
    from specprefill.workbench import plots, store  # lazy: seaborn

    config = common.config(args, args.speculator or common.DEFAULT_PAIR["speculator"])
    sweep = ttft_sweep(args, config) if args.bench == "ttft" else None
    rates = None if sweep else common.numbers(args.rates, float, "--rates")  # checked before any server starts
    lengths = sweep["lengths"] if sweep else [args.length]
    max_len = max(lengths) + max(64, config.look_ahead + 16, args.max_tokens if args.bench == "qps" else 0)
    budget = getattr(args, "token_budget", 0)
    engine = common.engine_params(
        args,
        **common.DEFAULT_PAIR,
        max_model_len=max_len,
        **({"kv_sequences": max(4, -(-budget // max_len) + 1)} if budget else {}),  # a whole batch's KV at once
    )
    machine = common.machine_header("bench")
    t0 = time.perf_counter()
    if sweep is not None:
        rows, dtype = ttft(engine, config, args, sweep)
    else:
        assert rates is not None  # `bench qps`: parsed above
        rows, dtype = qps(engine, config, args, rates)
    settings = {
        **vars(args),
        "engine": hardware.engine_record(engine),
        "dtype": dtype,
        "specprefill": config.to_dict(),
        "selection_rule": config.rule,
    }
    result = {"rows": rows, "machine": machine, "config": {**settings, "wall_s": time.perf_counter() - t0}}
    if args.bench == "qps":
        from specprefill.serve import loadtest  # lazy: vLLM

        result["max_qps"] = loadtest.max_qps_by_mode(rows)
    if args.out:
        store.write_json(os.path.join(args.out, f"{args.bench}.json"), result)
        if args.bench == "ttft":
            plots.ttft(rows, os.path.join(args.out, "ttft.png"))
        else:
            plots.qps(rows, args.slo, os.path.join(args.out, "qps.png"))
    return result


def chat(args) -> dict:
    """`bench chat`: every workload at every think time on each server alone (`workbench.chat`), a line per turn."""
    import tempfile

    from specprefill import hardware  # lazy: torch
    from specprefill.workbench import chat as bench_chat  # lazy: pandas
    from specprefill.workbench import (
        chat_tables,  # lazy: pandas
        store,  # lazy: pandas
    )

    settings = ChatSettings(**flags.given(args, ChatSettings))
    if settings.chat_conversations == 0:
        raise SpecPrefillError("--chat-conversations 0: give at least 1 conversation")
    config = common.config(args, args.speculator or common.DEFAULT_PAIR["speculator"])
    engine = common.engine_params(args, **common.DEFAULT_PAIR, max_model_len=bench_chat.max_model_len(settings))
    machine = common.machine_header("bench")
    log_dir = os.path.join(args.out, "logs") if args.out else tempfile.mkdtemp(prefix="specprefill-chat-")
    print(f"[bench] servers one at a time: {', '.join(settings.server_kinds())}; logs in {log_dir}", file=sys.stderr)
    t0 = time.perf_counter()
    rows, cpu = bench_chat.run(
        engine,
        config,
        settings,
        log_dir,
        on_turn=lambda r: print(
            f"[bench] {r['mode']} think {r['think_s']:g} s {r['server']} document {r['conversation']} turn "
            f"{r['turn']}: TTFT "
            f"{r['ttft_s']:.2f} s, "
            f"base computed {r['base_prefilled_tokens']} of {r['base_received_tokens']}, speculator "
            f"{r['speculator_prefilled_tokens']}{' (' + r['reuse'] + ')' if r['reuse'] else ''}, "
            f"{'correct' if r['correct'] else 'wrong'}",
            file=sys.stderr,
        ),
    )
    table, acc = chat_tables.turn_table(rows), chat_tables.accuracy(rows)
    result = {
        "rows": rows,
        "turns": table.to_dict("records"),
        "accuracy": acc.to_dict("records"),
        "checks": chat_tables.checks(table, acc, rows, cpu),
        "cpu_s": cpu,
        "machine": machine,
        "config": {
            **vars(args),
            "engine": hardware.engine_record(engine),
            "specprefill": config.to_dict(),
            "wall_s": time.perf_counter() - t0,
        },
    }
    if args.out:
        store.write_json(os.path.join(args.out, "chat.json"), result)
        store.save_table(table.to_dict("records"), args.out, "chat_turns")
    return result


def ttft_sweep(args, config) -> dict:
    """`bench ttft`'s grid from its flags, checked before any engine starts: keep rates, families, batch per length."""
    from specprefill.workbench import bench, records  # lazy: torch

    if args.keep_rates is not None and args.keep_rate is not None:
        raise SpecPrefillError("--keep-rate and --keep-rates both given: pass one (--keep-rate R is --keep-rates R)")
    rates = (
        [config.keep_rate]
        if args.keep_rate is not None
        else common.numbers(args.keep_rates or "0.1,0.3,0.5", float, "--keep-rates")
    )
    lengths = common.numbers(args.lengths, int, "--lengths")
    for r in rates:
        config.replace(keep_rate=r)  # validates
    if args.reps < 1:
        raise SpecPrefillError(f"--reps {args.reps} must be >= 1")
    if args.warmup < 0:
        raise SpecPrefillError(f"--warmup {args.warmup} must be >= 0")
    families = [f.strip() for f in args.families.split(",") if f.strip()]
    unknown = sorted(set(families) - set(records.TIMING_FAMILIES))
    if unknown:
        raise SpecPrefillError(f"--families {','.join(unknown)}: use names from {', '.join(records.TIMING_FAMILIES)}")
    batches = {n: bench.batch_of(args.token_budget, n) for n in lengths}  # validates the budget
    return {"rates": rates, "families": families, "batches": batches, "lengths": lengths}


def ttft(engine, config, args, sweep: dict) -> tuple[list[dict], str]:
    """Every (family, length, keep rate) of the sweep on one engine pair, a line per case as it finishes."""
    from tqdm.auto import tqdm  # lazy: with the modules below

    from specprefill.workbench import bench, records  # lazy: vLLM

    b = bench.Bench(engine, config)
    print(f"[bench] dtype {b.dtype}", file=sys.stderr)
    rows = []
    cases = tqdm(
        [(f, n, r) for f in sweep["families"] or [None] for n in sweep["lengths"] for r in sweep["rates"]],
        desc="bench ttft",
        unit="case",
        file=sys.stderr,
        disable=None,
    )
    for family, length, rate in cases:
        overrides = records.TIMING_FAMILIES[family] if family else {}
        batch = sweep["batches"][length]
        row = b.ttft(length, rate, args.reps, batch=batch, warmup=args.warmup, overrides=overrides)
        rows.append({**row, "label": family or "specprefill"})
        cases.write(
            f"[bench] {family + ' ' if family else ''}{batch} x {length} tokens keep {rate}: "
            f"speedup {row['speedup']:.2f}x (bound {row['bound']:.2f}x, efficiency {row['efficiency']:.2f}; "
            f"speculator {row['spec_share']:.1%} of full prefill, {row['spec_peak_extra_mib']:.0f} MiB held)",
            file=sys.stderr,
        )
    return rows, b.llm.dtype


def qps(engine, config, args, rates: list[float]) -> tuple[list[dict], str]:
    """Plain vLLM, then SpecPrefill, served one at a time under the same load; a line per rate."""
    from specprefill import hardware  # lazy: torch
    from specprefill.serve import loadtest  # lazy: vLLM

    dtype = hardware.resolve_dtype(engine.dtype)
    print(f"[bench] dtype {dtype}; servers one at a time: {', '.join(loadtest.KINDS)}", file=sys.stderr)
    rows = loadtest.compare(
        engine,
        config,
        args.length,
        args.requests,
        rates,
        args.max_tokens,
        args.slo,
        engine.seed or 0,
        args.burst,
        args.out,
        on_row=lambda r: print(
            f"[bench] {r['mode']} at {r['rate']}/s ({r['requests']} requests): p50/p90 TTFT "
            f"{r['ttft_p50']:.2f}/{r['ttft_p90']:.2f} s, {r['duration_s']:.1f} s in all",
            file=sys.stderr,
        ),
    )
    return rows, dtype


def prefill(args) -> dict:
    from specprefill import models  # lazy: transformers
    from specprefill.workbench import bench, store  # lazy: vLLM

    if args.reps < 1 or args.length < 1:
        raise SpecPrefillError("--reps and --length must be >= 1")
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    names = [n.strip() for n in args.models.split(",") if n.strip()]
    paths = {n: models.resolve(n) for n in names}  # unknown names fail before any engine starts
    machine, rows = common.machine_header("bench"), []
    for name, dtype in [(n, d) for n in names for d in dtypes]:
        rows.append({**bench.prefill_rate(paths[name], dtype, args.length, args.reps), "model": name})
        print(f"[bench] {name} {rows[-1]['dtype']}: {rows[-1]['tokens_per_s']:.0f} tokens/s", file=sys.stderr)
    result = {"rows": rows, "machine": machine, "config": vars(args)}
    if args.out:
        store.write_json(os.path.join(args.out, "prefill.json"), result)
    return result


def table(args) -> dict:
    from specprefill.workbench import report  # lazy: pandas

    results = []
    for path in args.files:
        try:
            with open(path, encoding="utf-8") as f:
                results.append(json.load(f))
        except (OSError, ValueError) as exc:
            raise SpecPrefillError(
                f"cannot read {path} ({exc}): pass ttft.json files from `bench ttft --out DIR`"
            ) from None
    return {"table": report.bench_table(results), "files": args.files}


def human(result: dict) -> str:
    if "table" in result:
        return result["table"]
    if "select_ms" in result:  # bench selection
        from specprefill.workbench import selection as sel  # lazy: torch, pandas

        return sel.human(result)
    if "turns" in result:  # bench chat
        import pandas as pd

        table = pd.DataFrame(result["turns"]).to_string(index=False, float_format=lambda v: f"{v:.3g}")
        usage = pd.DataFrame(result.get("cpu_s") or [], columns=["mode", "think_s", "server", "cpu_s"])
        cpu = "CPU-seconds (background included) per mode, think time and server:\n" + usage.groupby(
            ["mode", "think_s", "server"], sort=False
        )["cpu_s"].sum(min_count=1).to_string(float_format=lambda v: f"{v:.0f}")
        accuracy = pd.DataFrame(result["accuracy"]).to_string(index=False)
        return "\n".join([table, "", accuracy, cpu, *result["checks"]])
    rule = result.get("config", {}).get("selection_rule")
    return "\n".join(
        ([f"selection rule: {rule}"] if rule else [])
        + [
            "  ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items() if k != "overhead")
            for row in result["rows"]
        ]
    )
