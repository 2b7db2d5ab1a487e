"""A paper profile against the original: what Jingyu6/speculative_prefill's scripts and the paper's figures ran
(`data/files/original_protocol.yaml`, facts) beside what the profile runs, field by field. A difference is either
gone or carries the project's reason (`REASONS`); `differences` lists them for `reproduce --prepare-only`, each
run's `protocol.json` and the report, and a test fails on a difference without a reason."""

from __future__ import annotations

import functools
import importlib.metadata
from pathlib import Path
from typing import Any

import yaml

from specprefill.data import longbench
from specprefill.workbench import harness, protocol, records

ORIGINAL = Path(__file__).resolve().parents[1] / "data" / "files" / "original_protocol.yaml"
PAPER_PROFILES = ("paper-8b", "paper-70b", "paper-405b")
# lm-eval's names of RULER's tasks (the rest are RULER's own names)
RULER_NAMES = {
    "ruler_vt": "vt", "ruler_cwe": "cwe", "ruler_fwe": "fwe", "ruler_qa_squad": "qa_1", "ruler_qa_hotpot": "qa_2"
}  # fmt: skip

# What the project's code does where no parameter says it (the other side of the original's code-level facts).
CODE = {
    ("01_long_context_quality", "averaging"): "per task, then per category",
    ("01_long_context_quality", "few_shot_answers"): {  # lm-eval's LongBench definitions stop all four at a newline
        "samsum": "generation stops at the first newline",
        "trec, triviaqa, lsht": "generation stops at the first newline",
    },
    ("02_ruler", "template"): "the model's chat template (lm-eval's RULER tasks)",
    ("03_short_tasks", "scoring"): {
        "gsm8k, mmlu, arc": "the original's prompts, stops and scoring as the project's task definitions (*_original)",
        "gpqa, ifeval": "lm-eval's stock tasks",
        "humaneval+, mbpp+": "EvalPlus's rows, chat prompt and tests as the project's lm-eval tasks",
    },
    ("03_short_tasks", "evalplus"): "the notebook's engine: max_model_len 16,384, eager as the profile sets it",
    ("04_ttft", "context_scaling"): "no separate sweep: lengths x token_budget time every family at every length",
    ("04_ttft", "statistic"): "median",
    ("04_ttft", "prompts"): "filler text of the length",
    ("05_qps", "rows"): "the original's rows (qps_rows) on LongBench's split, sent in an order shuffled with the "
    "notebook's seed",
    ("05_qps", "latency"): "end to end, sent to last token; a request at or past the timeout is missed",
    ("05_qps", "pause_s"): "none: a rate starts once every request of the one before has finished",
    ("05_qps", "templates"): "LongBench's own (configs/dataset2prompt.json)",  # read from lm-eval's copy of them
    ("07_baselines", "data"): "RULER-style records made offline",  # LongBench when every task is one (`_ours`)
    ("07_baselines", "minference"): "refused",
    ("07_baselines", "rag"): "rag_dense: all-mpnet-base-v2 + faiss L2, best first until one does not fit, every "
    "sentence a candidate; query = the prompt's closing sentences; budget = keep rate x prompt tokens; kept sentences "
    "in document order at their original positions",  # selectors.RetrievalDense
    ("07_baselines", "rag_earlier"): "not run: main's rag_dense only",
    ("08_agreement", "kl"): "kl_div(log_softmax, softmax) of attention",  # core.LAYER_METRICS["kl"]
    ("08_agreement", "tau"): "Kendall tau over argsort permutations",  # core.LAYER_METRICS["tau"]
    ("08_agreement", "data"): "RULER-style records (needles, QA)",
}

# Why a difference stays, by (notebook or "models"/"engines", field). Everything else must match the original.
REASONS = {
    ("engines", "vllm"): "vLLM 0.6.3 no longer installs or runs on current drivers; the method is ported to this one",
    ("engines", "base_eager"): "the base compiles (CUDA graphs, as vLLM serves by default); both arms of every "
    "comparison run the same base, so ratios compare like with like",
    ("engines", "chunked_prefill"): "vLLM's V1 scheduler prefills in chunks; both arms are scheduled alike",
    ("01_long_context_quality", "truncation"): "a prompt over max_model_len fails a run; lm-eval cuts it (LongBench's "
    "own middle cut) and the protocol line says so",
    ("01_long_context_quality", "few_shot_answers"): "lm-eval's LongBench tasks stop trec, triviaqa and lsht at a "
    "newline, so an answer that opens with one scores empty where the original skipped to the next line; samsum "
    "stops at the first newline in both, as the original",
    ("02_ruler", "template"): "lm-eval's RULER tasks take the model's chat template; RULER's own client template is "
    "not part of lm-eval",
    ("03_short_tasks", "scoring"): "the repository's patched task files are its code: the project writes its own "
    "definitions of the three tasks it patched, with the same prompts, stop strings and scoring; GPQA and IFEval are "
    "lm-eval's stock tasks, as the original; HumanEval+/MBPP+ run as lm-eval tasks so that one engine and one "
    "sandbox serve the notebook",
    ("03_short_tasks", "evalplus"): "one engine serves every task of the notebook; HumanEval+/MBPP+ prompts and "
    "answers fit in 16,384 tokens (EvalPlus's vLLM backend sets its own max_model_len, 2,048 in evalplus/provider/"
    "vllm.py), and the base compiles as in the original's EvalPlus runs",
    ("04_ttft", "lengths"): "one grid: the search's families at lengths up to 65,536 (batch 8 of the same budget), a "
    "length the original timed only in its 70B context-scaling runs",
    ("04_ttft", "keep_rates"): "keep 0.9, the quality notebooks' top rate, is timed too: one extra point per length",
    ("04_ttft", "context_scaling"): "the context-scaling runs (p_full at batch 128..4) are a separate sweep there: "
    "lengths x token_budget here run every family at every length",
    ("04_ttft", "statistic"): "medians of paired repetitions resist the stragglers of shared machines; means are "
    "in each unit's rows",
    ("04_ttft", "prompts"): "prefill cost depends on the token count, not the ids; text keeps tokenizers honest",
    ("05_qps", "rows"): "the original's rows on LongBench's 200-row test split (`longbench.qps_rows`); a data "
    "directory with fewer rows (paper-mini) sends its first rows; the send order is shuffled with the notebook's seed",
    ("05_qps", "warmup"): "vLLM's load generator warms up with copies of its first request, sent at once; in both, "
    "the warm-up only readies the server and no measurement includes it",
    ("05_qps", "max_num_seqs"): "a rate sends 128 requests, so at most 128 are in flight: the original's cap of 256 "
    "never binds, nor does vLLM's default",
    ("05_qps", "pause_s"): "vLLM's load generator returns when every request of a rate has finished, so the next rate "
    "starts on an idle server, as after the original's pause",
    ("07_baselines", "methods"): "MInference is refused: its vLLM patch supports vLLM 0.4.x only (no port to 0.32)",
    ("07_baselines", "minference"): "MInference is refused: its vLLM patch supports vLLM 0.4.x only (no port to 0.32)",
    ("07_baselines", "rag"): "the baselines select tokens of the prompt lm-eval renders (as SpecPrefill does), so "
    "the query is read from the prompt's end where LongBench's templates put the question, and the kept sentences "
    "keep their positions as SpecPrefill's chunks do; the embedder, index and budget rule are the original's; its "
    "cap of budget // 10 + 1 candidates is not adopted yet",
    ("07_baselines", "rag_earlier"): "the rag_baseline branch's variant is main's earlier RAG baseline, which main "
    "replaced before the paper (commit 28feac4, 2025-01-26); the project runs main's",
    ("08_agreement", "data"): "C4 needs the hub; offline records of the same shape (32 prompts of 512 tokens) "
    "carry a known needle to find",
}


@functools.cache
def original() -> dict[str, Any]:
    """The original's protocol table."""
    return yaml.safe_load(ORIGINAL.read_text())


def _ours(name: str, merged: dict) -> dict[str, Any]:
    """What the profile runs in the fields the original's table has for notebook `name`."""
    proto = protocol.protocol(merged)
    tasks = [t for t in proto["tasks"] if not t.endswith("_e")]  # LongBench-E: an extra table
    ours: dict[str, Any] = {k: proto.get(k) for k in ("keep_rates", "families", "max_length", "samples")}
    ours.update({field: text for (nb, field), text in CODE.items() if nb == name})
    if name == "01_long_context_quality":
        task_args = merged.get("lm_eval_task_args") or {}
        ours["tasks"] = [t.removeprefix("longbench_") for t in tasks]
        ours["untemplated"] = [
            t.removeprefix("longbench_")
            for t in tasks
            if not harness.uses_chat_template(t, bool(merged.get("chat_template")), task_args)
        ]
        ours["truncation"] = merged.get("lm_eval_truncation")
    elif name == "02_ruler":
        ours["tasks"] = [RULER_NAMES.get(t, t) for t in tasks]
    elif name == "04_ttft":
        ours.update({k: merged.get(k) for k in ("token_budget", "warmup", "reps", "lengths")})
    elif name == "05_qps":
        cats = merged.get("categories") or {}
        ours["timeouts_s"] = {c: v.get("timeout_s") for c, v in cats.items()}
        ours["rates"] = {c: v.get("rates") for c, v in cats.items()}
        ours["category_tasks"] = {c: list(longbench.QPS_TASKS.get(c, ())) for c in cats}
        ours["n_requests"] = merged.get("n_requests")
        knobs = {k: merged.get(k) for k in ("chunk_size", "pool_kernel", "look_ahead")}
        ours["family"] = next((f for f, v in records.FAMILIES.items() if v == knobs), f"knobs {knobs}")
        ours["warmup"] = f"{merged.get('warmup')} copies of the first request at once (vLLM's load generator)"
        ours["max_num_seqs"] = merged.get("max_num_seqs") or "vLLM's default"
        ours["tolerance"] = merged.get("tolerance")
    elif name == "07_baselines":
        ours["methods"] = proto["baselines"]
        if tasks and all(harness.longbench_config(t) for t in tasks):  # no records of its own: LongBench only
            ours["data"] = "LongBench"
    return ours


def _checkpoint(name: str) -> str:
    """A hub id under its current name: the hub renamed meta-llama/Meta-Llama-3.1-* to Llama-3.1-* (the old names
    redirect to the same repositories)."""
    return name.replace("meta-llama/Meta-Llama-3.1-", "meta-llama/Llama-3.1-")


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, list) and isinstance(b, list) and all(isinstance(x, str) for x in a + b):
        return sorted(a) == sorted(b)  # task and method lists: the set is the protocol
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return float(a) == float(b)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _row(where: str, field: str, ours: Any, theirs: Any) -> dict[str, Any]:
    return {"where": where, "field": field, "ours": ours, "original": theirs, "reason": REASONS.get((where, field))}


def _not_run(profile: str, name: str) -> list[dict[str, Any]]:
    """A row saying the original never ran notebook `name` with the profile's base (the table's `not_run`)."""
    if name not in original().get("not_run", {}).get(profile, []):
        return []
    size = profile.removeprefix("paper-").upper()
    return [
        {
            "where": name,
            "field": "run",
            "ours": f"run on {profile}'s pair",
            "original": f"not run on {size}",
            "reason": f"the original did not run this on {size}; the profile runs the 70B protocol, and the rows "
            "below compare it with the original's 70B runs",
        }
    ]


def differences(profile: str, name: str, merged: dict) -> list[dict[str, Any]]:
    """Each field where notebook `name` of a paper profile differs from the original, with the project's reason
    (None: unexplained); [] for profiles the original did not run and notebooks without an entry. A notebook the
    original never ran with the profile's base opens with a row that says so (then its 70B facts are compared)."""
    table = original()
    if profile not in PAPER_PROFILES or name not in table["notebooks"]:
        return []
    rows = _not_run(profile, name)
    models = table["models"][profile]
    for field in ("base", "speculator"):
        if merged.get(field) is not None and _checkpoint(merged[field]) != _checkpoint(models[field]):
            rows.append(_row("models", field, merged.get(field), models[field]))
    if merged.get("base") is not None and "enforce_eager" in merged:
        eng = table["engines"]
        try:
            installed = importlib.metadata.version("vllm")
        except importlib.metadata.PackageNotFoundError:
            installed = "not installed"
        ours = {"vllm": installed, "base_eager": bool(merged.get("enforce_eager")), "chunked_prefill": True}
        rows += [_row("engines", k, ours[k], eng[k]) for k in eng if not _same(ours[k], eng[k])]
    ours_nb = _ours(name, merged)
    for field, theirs in table["notebooks"][name].items():  # a field `_ours` does not read is reported, unexplained
        if field not in ours_nb or not _same(ours_nb[field], theirs):
            rows.append(_row(name, field, ours_nb.get(field, "not read by fidelity._ours"), theirs))
    return rows


def lines(rows: list[dict[str, Any]]) -> list[str]:
    """One line per difference: what differs, ours against the original's, and why (or that no reason is given)."""
    out = []
    for r in rows:
        why = f"because {r['reason']}" if r["reason"] else "NO REASON GIVEN"
        out.append(
            f"{r['where']} {r['field']}: {protocol.text(r['ours'])} (original: {protocol.text(r['original'])}) {why}"
        )
    return out
