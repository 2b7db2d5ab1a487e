"""`specprefill bench selection`: selection rules side by side on the same prompts and scores, answers and the paired
fidelity measure against full prefill (`workbench.selection`), then each rule's select time."""

from __future__ import annotations

import argparse
import dataclasses
import os
import time

from specprefill.cli import common
from specprefill.config import SELECTION_RULES


def add(bench_sub) -> None:
    sel = bench_sub.add_parser(
        "selection", help="selection rules side by side: answers on each task vs full prefill (paired), select time"
    )
    sel.add_argument(
        "--rules",
        default="chunks,lines,records,records+protect,records+protect+query",
        help="rules (workbench.selection.RULES): " + ", ".join(SELECTION_RULES),
    )
    sel.add_argument(
        "--tasks",
        default="keyed_records,keyed_json,niah_single_2,niah_multikey_2,qa_1",
        help="tasks by name: natural_qa, follow_up, RULER's, keyed records, shape and real-file cells or groups",
    )
    sel.add_argument("--length", type=int, default=2048, help="prompt tokens")
    sel.add_argument("--n", type=int, default=10, help="prompts per task (the same for every rule)")
    sel.add_argument("--keep-rates", default="0.3,0.1")
    sel.add_argument("--max-tokens", type=int, default=16)
    sel.add_argument(
        "--fidelity",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the paired fidelity measure beside exact match: the gold answer's log-likelihood per token and the "
        "first answer token's KL, pruned vs full (two more base requests per prompt and rule)",
    )
    sel.add_argument("--out", default=None, help="directory for the resumable units and selection.json")
    sel.add_argument("--json", action="store_true", help="print the result as JSON")
    common.knob_flags(sel, skip=("keep_rate", "selection_unit", "protect", "query_weight"))
    common.engine_flags(sel, required=(), **common.DEFAULT_PAIR)


def run(args) -> dict:
    """`bench selection`: every rule on the same prompts and scores (`workbench.selection`), then select times."""
    import tempfile

    from specprefill import hardware  # lazy: torch
    from specprefill.engines.vllm.pair import SpecPrefillLLM  # lazy: vLLM
    from specprefill.workbench import likelihood, records, store  # lazy: torch, pandas
    from specprefill.workbench import selection as sel  # lazy: torch

    rules = [r.strip() for r in args.rules.split(",") if r.strip()]
    sel.check_rules(rules)
    rates = common.numbers(args.keep_rates, float, "--keep-rates")
    config = common.config(args, args.speculator or common.DEFAULT_PAIR["speculator"])
    for r in rates:
        config.replace(keep_rate=r)  # validates
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    # with the fidelity measure: the first answer token's whole distribution (`SpecPrefillLLM.answer_fits`), and
    # prefix caching (unless set), so its one-token request reuses a prefill of the same tokens at the same positions
    # (the teacher-forced one asks for prompt log-probs: vLLM reads no cache for it); nothing here is timed but the
    # model-free selection
    fidelity = {"enable_prefix_caching": True} if args.fidelity else {}
    engine = common.engine_params(
        args, **common.DEFAULT_PAIR, **fidelity, max_model_len=args.length + max(args.max_tokens, 192) + 64
    )
    if args.fidelity:
        engine = dataclasses.replace(engine, engine_args={**engine.engine_args, "max_logprobs": -1})
    machine = common.machine_header("bench")
    t0 = time.perf_counter()
    seed = engine.seed if engine.seed is not None else 0
    llm = SpecPrefillLLM.from_params(engine, config)
    try:
        data = records.task_records(llm.tokenizer, tasks, args.length, args.n, seed)
        out = args.out or tempfile.mkdtemp(prefix="specprefill-selection-")
        rows, summary = sel.selection_quality(
            llm, data, rules, rates, out, args.max_tokens, config, seed, fidelity=args.fidelity
        )
        prompts = [llm.tokenizer(r["input"])["input_ids"] for recs in data.values() for r in recs]
        timing = sel.selection_seconds(llm.tokenizer, prompts, rules, rates[-1])
    finally:
        llm.shutdown()
    result = {
        "summary": summary.to_dict("records"),
        "vs_chunks": sel.versus(rows).to_dict("records") if "chunks" in rules else [],
        "fidelity": likelihood.table(rows).to_dict("records"),
        "fidelity_rule": likelihood.MARGIN_NOTE,
        "select_ms": timing,
        "machine": machine,
        "config": {
            **vars(args),
            "engine": hardware.engine_record(engine),
            "specprefill": config.to_dict(),
            "dtype": llm.dtype,
            "wall_s": time.perf_counter() - t0,
        },
    }
    if args.out:
        store.write_json(os.path.join(args.out, "selection.json"), result)
        store.save_table(result["summary"], args.out, "selection_summary")
    return result
