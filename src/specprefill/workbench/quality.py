"""Quality per method and keep rate: the workbench's own records (RULER, short tasks, analogues) and lm-eval's task
definitions (LongBench, RULER, the short tasks), scored; LongBench's categories and LongBench-E's length groups.

Each experiment is a loop of resumable units (`store.run_unit`) keyed by everything that shapes its rows.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import pandas as pd
from tqdm.auto import tqdm

from specprefill.config import SpecPrefillConfig
from specprefill.data import longbench, sandbox
from specprefill.data.metrics import METRIC_VERSION, score
from specprefill.engines.vllm.pair import greedy
from specprefill.errors import SpecPrefillError
from specprefill.selectors import Selection, selector
from specprefill.settings import LmEvalSettings
from specprefill.workbench import harness, likelihood, stats, store
from specprefill.workbench.units import models_key, pair_context


def quality_unit(
    llm,
    selection: Selection,
    records: list[dict],
    method: str,
    config: SpecPrefillConfig,
    max_tokens: int,
    seed: int = 0,
    fidelity: Callable[[], list] | None = None,
) -> list[dict]:
    """Generate greedily for every record with one method/config and score it; `fidelity` (full prefill's answer
    fits of these records, `likelihood.full_fits`): the paired fidelity measure beside the score."""
    kept = selection.kept(method, config, seed)
    params = greedy(max_tokens)
    outs = llm.generate_kept(selection.prompts, kept, params, restore_positions=config.restore_positions)
    fits: list[dict] = [{} for _ in records]
    if fidelity is not None:
        answers = [likelihood.gold_ids(llm.tokenizer, r) for r in records]
        fits = likelihood.fit_columns(llm, selection.prompts, answers, kept, config.restore_positions, fidelity)
    rows = []
    for rec, k, out, fit in zip(records, kept, outs, fits):
        text = out.outputs[0].text
        n = len(out.prompt_token_ids)
        row = {
            "task": rec["task"],
            "index": rec["index"],
            **({"doc": rec["doc"]} if "doc" in rec else {}),  # the document several questions share (`data.natural`)
            "n_prompt": n,
            "n_kept": n if k is None else len(k),
            "score": score(rec, text),
            "prediction": text[:500],
            **fit,
        }
        if rec.get("metric") == "pass@1":
            row["sandbox"] = sandbox.boundary()  # "weak" only when opted in: labelled in every row
        rows.append(row)
    return rows


def quality(
    llm,
    records_by_task: dict[str, list[dict]],
    variants: list[dict],
    output_dir,
    max_tokens: int | dict,
    kind: str = "quality",
    base_config: SpecPrefillConfig | None = None,
    progress: bool = True,
    seed: int = 0,
    lm_eval: LmEvalSettings | None = None,
    fidelity: bool = False,
) -> list[dict]:
    """Every task x variant (a dict with "method", "keep_rate" and optional config overrides), resumable; then the
    tasks of `lm_eval`, if it names any, through lm-evaluation-harness (`lm_eval_quality`).

    Variant keys other than "method" and "label" are SpecPrefillConfig fields. A unit is keyed by the method, every
    knob, both models' fingerprints, dtype, sampling, the seed and a digest of its records (inputs, references,
    metric), so changing any of them (another model, more samples, a longer prompt) computes it again. `fidelity`:
    each row also carries the paired fidelity measure (`likelihood`; the base engine needs max_logprobs=-1), full
    prefill's fits computed once per task."""
    base_config = base_config or SpecPrefillConfig()
    rows = []
    selections = {
        task: Selection(llm, [llm.tokenizer(r["input"])["input_ids"] for r in records])
        for task, records in records_by_task.items()
    }  # speculator passes shared across variants
    prompts = {t: s.prompts for t, s in selections.items()}
    full_fits = likelihood.lazy_full_fits(llm, prompts, records_by_task) if fidelity else {}
    jobs = [(t, v) for t in records_by_task for v in variants]
    for task, variant in tqdm(jobs, desc=kind, disable=not progress):
        records, selection = records_by_task[task], selections[task]
        config = base_config.replace(**{k: v for k, v in variant.items() if k not in ("method", "label")})
        limit = max_tokens[task] if isinstance(max_tokens, dict) else max_tokens
        spec = {
            "task": task,
            "method": variant["method"],
            "label": variant.get("label", variant["method"]),
            **config.to_dict(),
            **models_key(llm),
            "max_tokens": limit,
            "temperature": 0.0,
            "seed": seed,
            "n_records": len(records),
            "records": store.digest(records),  # every field of every record: whatever the metric reads
            "metric_version": METRIC_VERSION,
            **({"sandbox": sandbox.boundary()} if any(r.get("metric") == "pass@1" for r in records) else {}),
            **({"fidelity": likelihood.VERSION} if fidelity else {}),
        }
        fits = full_fits[task] if fidelity else None
        rows += store.run_unit(
            output_dir,
            kind,
            spec,
            lambda: quality_unit(llm, selection, records, variant["method"], config, limit, seed, fits),
            context=pair_context(llm),
        )
    if lm_eval is not None and lm_eval.lm_eval_tasks:
        rows += lm_eval_quality(llm, variants, output_dir, base_config, lm_eval, seed)
    return rows


LM_EVAL_ROWS_VERSION = 5  # bump when the rows taken from lm-eval's samples change: every lm-eval unit is redone


def lm_eval_quality(
    llm, variants: list[dict], output_dir, base_config: SpecPrefillConfig, settings: LmEvalSettings, seed: int = 0
) -> list[dict]:
    """The benchmarks' own protocol (prompts, truncation, metrics) through lm-evaluation-harness, on the pair
    already built: one resumable unit per variant ("full", a SpecPrefill variant or a baseline of `selectors.METHODS`
    at a keep rate) and task (a sharded run spreads them over its jobs), one row per sample with its task's score on
    a 0-100 scale (a group's samples under the group, `subtask` naming the member).
    `settings.chat_template`: the model's chat template as the original ran the tasks (`harness.uses_chat_template`;
    few-shot examples as turns); `data_dir`: every task's rows read from that directory (`harness.local_tasks`);
    `lm_eval_max_gen_toks`: a cap on every answer's length (small profiles); `lm_eval_task_args`: per task, as the
    original ran it ({task: {chat_template, num_fewshot, max_gen_toks}}, `harness.run_groups`); `lm_eval_truncation`:
    which part of a prompt longer than the context is cut ("middle" keeps its start and end, as LongBench's own
    prediction script does)."""
    tasks = list(settings.lm_eval_tasks)
    s, lm, plan, manager = _lm_eval_setup(llm, settings, tasks, output_dir)
    groups = harness.run_groups(tasks, s.chat_template, s.lm_eval_task_args, s.lm_eval_max_gen_toks)
    rows, default = [], llm.config
    for variant in variants:
        selector(variant["method"]).check()  # a baseline that cannot run here: one line, before any unit
    for variant in variants:  # one unit per task (what a sharded run spreads), the variant's tasks evaluated at once
        config = base_config.replace(**{k: v for k, v in variant.items() if k not in ("method", "label")})
        label = variant.get("label", variant["method"])
        specs = {}
        for task in tasks:
            digests = {t: d for t, d in plan.digests.items() if t == task}
            args = {t: a for t, a in s.lm_eval_task_args.items() if t == task}  # its own settings only
            own = s.replace(lm_eval_tasks=[task], lm_eval_task_args=args)
            specs[task] = _lm_eval_key(llm, own, config, label, seed, digests)
            if variant["method"] not in ("full", "specprefill"):  # a baseline's tokens: its method is in the key
                specs[task]["method"] = variant["method"]

        def compute(todo, config=config, method=variant["method"]):
            group = {k: [t for t in members if t in todo] for k, members in groups.items()}
            boundary = next((specs[t]["sandbox"] for t in todo if "sandbox" in specs[t]), None)
            llm.config, lm.method, lm.method_seed = config, method, seed
            try:
                got = _lm_eval_unit(lm, manager, plan, {k: g for k, g in group.items() if g}, s, seed, boundary)
            finally:
                llm.config, lm.method = default, "specprefill"
            by_task = {t: [r for r in got if r["task"] == t] for t in todo}
            empty = [t for t, r in by_task.items() if not r]
            if empty:  # never a finished unit without rows: it would be absent from every mean
                raise SpecPrefillError(f"lm-eval returned no samples for {', '.join(empty)}: check the task's rows")
            return by_task

        done = store.run_units(output_dir, "lm_eval", specs, compute, context=pair_context(llm))
        rows += [{**r, "label": label, "keep_rate": config.keep_rate} for task in tasks for r in done[task]]
    return rows


def _lm_eval_setup(llm, settings: LmEvalSettings, tasks: list[str], output_dir) -> tuple:
    """The checked settings, lm-eval's model on the pair, the tasks' local rows and lm-eval's task manager."""
    from lm_eval.tasks import TaskManager  # lazy: lm-eval (and datasets) only when lm_eval_tasks are given

    from specprefill.lm_eval import SpecPrefillLM  # lazy, as above

    s = settings.replace(
        lm_eval_metadata=settings.lm_eval_metadata or {},
        lm_eval_task_args=harness.check_task_args(tasks, settings.lm_eval_task_args),
    )
    lm = SpecPrefillLM(llm=llm, batch_size="auto", truncation_side=harness.check_truncation(s.lm_eval_truncation))
    plan = harness.local_tasks(tasks, s.data_dir, Path(output_dir) / "lm_eval_tasks", s.lm_eval_include_path)
    local = Path(output_dir) / "lm_eval_tasks" if plan.digests else None
    includes = harness.include_paths(s.lm_eval_include_path, local)
    # the tasks' metadata (RULER's lengths, and the tokenizer its prompts are built with) goes through the manager
    harness.index_stock_tasks_once()
    manager = harness.loading_once(TaskManager)(
        include_path=includes, metadata={"pretrained": llm.base_path, **s.lm_eval_metadata}
    )
    return s, lm, plan, manager


def _lm_eval_key(llm, s: LmEvalSettings, config: SpecPrefillConfig, label: str, seed: int, local: dict) -> dict:
    """An lm-eval unit's key: everything that shapes its rows (tasks, knobs, models, lm-eval's version, templates,
    the rows read from a data folder, the sandbox code runs in)."""
    import lm_eval  # lazy, as in lm_eval_quality

    tasks = list(s.lm_eval_tasks)
    runs_code = bool(set(tasks) & set(harness.CODE_TASKS))
    return {
        "lm_eval_tasks": tasks,
        "label": label,
        **config.to_dict(),
        **models_key(llm),
        "limit": s.lm_eval_limit,
        "seed": seed,
        "metadata": s.lm_eval_metadata,
        "max_model_len": llm.max_model_len,
        "lm_eval": lm_eval.__version__,
        "include_path": s.lm_eval_include_path,
        "chat_template": {t: harness.uses_chat_template(t, s.chat_template, s.lm_eval_task_args) for t in tasks},
        "task_args": s.lm_eval_task_args,
        "truncation": s.lm_eval_truncation,
        "max_gen_toks": s.lm_eval_max_gen_toks,
        "local_data": local,  # digests of the rows read from data_dir, by task
        "rows_version": LM_EVAL_ROWS_VERSION,
        **({"sandbox": sandbox.boundary()} if runs_code else {}),  # refused here, before generating, without one
        **({"project_tasks": harness.tasks_digest()} if runs_code else {}),
    }


def _lm_eval_unit(lm, manager, plan, groups: dict, s: LmEvalSettings, seed: int, boundary: str | None) -> list[dict]:
    """One variant's rows: each group of tasks (same template, few-shot count and answer cap) through
    `lm_eval.simple_evaluate` on the pair (its config already set), every sample scored."""
    import lm_eval  # lazy, as in lm_eval_quality

    out_rows = []
    for (templated, fewshot, cap), group in groups.items():
        if cap:  # the tasks are built once (the manager keeps them): lower their answer limits here
            harness.cap_answers(manager.load([plan.run[t] for t in group]), cap, lm.max_gen_toks)
        out = lm_eval.simple_evaluate(
            model=lm,
            tasks=[plan.run[t] for t in group],
            limit=s.lm_eval_limit,
            log_samples=True,
            task_manager=manager,
            apply_chat_template=templated,
            fewshot_as_multiturn=templated,
            random_seed=seed,
            numpy_random_seed=seed,
            torch_random_seed=seed,
            fewshot_random_seed=seed,
            num_fewshot=fewshot,
        )
        for task, samples in out["samples"].items():
            owner, subtask = plan.task_of(task), task.removeprefix(harness.LOCAL_PREFIX)
            task_filter = (s.lm_eval_task_args.get(owner) or {}).get("filter")
            out_rows += [
                {**row, "task": owner, "subtask": subtask, "chat_template": templated}
                | ({"sandbox": boundary} if owner in harness.CODE_TASKS else {})
                | ({"index": f"{subtask}:{row['index']}"} if owner != subtask else {})  # unique in a group
                for row in lm_eval_rows(task, samples, out["configs"][task]["metric_list"], task_filter)
            ]
    return out_rows


def _one(response):
    """A filter's result for one document: its single response (code filters return a list per document)."""
    return response[0] if isinstance(response, list) and len(response) == 1 else response


def lm_eval_rows(task: str, samples: list[dict], metric_list: list[dict], filter: str | None = None) -> list[dict]:
    """One row per document from lm-eval's logged samples: the result of `filter` (default: the task's first
    filter) and the task's first metric, x100. RULER names its metrics by context length and marks the lengths a
    document is not as -1: its row takes the document's own length."""
    filters = list(dict.fromkeys(s.get("filter") for s in samples))
    if filter is not None and samples and filter not in filters:
        raise SpecPrefillError(
            f"lm-eval task {task} has no filter {filter!r}: use one of {', '.join(map(str, filters))}"
        )
    chosen = filter if filter is not None else (filters[0] if filters else None)
    # a metric given as a function (`!function`) is dumped as its source: samples carry it under the function's name
    names = [re.sub(r"(?s)^\s*def (\w+)\(.*", r"\1", str(m["metric"])) for m in metric_list]
    rows = []
    for s in samples:
        if s.get("filter") != chosen:
            continue
        metric = (
            str(s["doc"]["max_length"]) if all(n.isdigit() for n in names) and "max_length" in s["doc"] else names[0]
        )
        value = s[metric]
        if isinstance(value, (list, tuple, dict)):
            raise SpecPrefillError(
                f"lm-eval task {task}: its first metric {metric!r} is not one number per sample; "
                "put a task with a per-sample score first"
            )
        rows.append(
            {
                "task": task,
                "index": s["doc_id"],
                "score": 100.0 * float(value),
                "metric": metric,
                "prediction": str(_one(s["filtered_resps"][0]))[:500],
                "filter": chosen,
                **({"length": s["doc"]["length"]} if isinstance(s["doc"].get("length"), (int, float)) else {}),
            }
        )
    return rows


# LongBench's own categories of its 21 tasks (the English ones this project words, and the Chinese ones)
LONGBENCH_CATEGORIES = {
    c: (*tasks, *(t for t, home in longbench.CHINESE.items() if home == c)) for c, tasks in longbench.CATEGORIES.items()
}


LONGBENCH_E_BUCKETS = ((4000, "0-4k"), (8000, "4-8k"), (float("inf"), "8k+"))  # LongBench-E's length groups


def longbench_tables(rows: list[dict], output_dir) -> dict[str, pd.DataFrame]:
    """LongBench by category as the original averages it (`categories`: each task's mean score, then the mean of a
    category's task means; `diff_vs_full` the same mean of each task's paired difference to full prefill), the same
    categories with their documents pooled (`categories_pooled`: n, 95% intervals, the paired difference; the
    project's extra), and LongBench-E by length (`longbench_e`: 0-4k, 4-8k, 8k+ by the rows' `length` field). Saved
    as <name>.csv; empty (and nothing saved) without LongBench rows."""
    category = {f"longbench_{t}": c for c, tasks in LONGBENCH_CATEGORIES.items() for t in tasks}

    def cell(r: dict, name: str) -> dict:  # a document is paired with full prefill by its task and index
        return {**r, "task": name, "index": f"{r['task']}:{r['index']}"}

    longbench_rows = [r for r in rows if r["task"] in category]
    by_length = [
        cell(r, next(name for limit, name in LONGBENCH_E_BUCKETS if r["length"] < limit))
        for r in rows
        if str(r["task"]).startswith("longbench_") and str(r["task"]).endswith("_e") and r.get("length") is not None
    ]
    out = {}
    if longbench_rows:
        per_task = stats.summarize(longbench_rows)
        out["categories"] = store.save_table(_mean_of_task_means(per_task, category), output_dir, "categories", {})
        pooled = stats.summarize([cell(r, category[r["task"]]) for r in longbench_rows])
        pooled_rows = pooled.rename(columns={"task": "category"}).to_dict("records")
        out["categories_pooled"] = store.save_table(pooled_rows, output_dir, "categories_pooled", {})
    if by_length:
        table = stats.summarize(by_length).rename(columns={"task": "length"})
        out["longbench_e"] = store.save_table(table.to_dict("records"), output_dir, "longbench_e", {})
    return out


def _mean_of_task_means(per_task: pd.DataFrame, category: dict[str, str]) -> list[dict]:
    """Per category, label and keep rate: the mean of its tasks' mean scores (and of their paired differences to
    full prefill), with how many tasks and documents went in."""
    table = per_task.assign(category=per_task["task"].map(category))
    out = []
    for (cat, label, rate), g in table.groupby(["category", "label", "keep_rate"], sort=True):
        row = {"category": cat, "label": label, "keep_rate": rate, "score": float(g["score"].mean())}
        row |= {"tasks": len(g), "n": int(g["n"].sum())}
        if "diff_vs_full" in g and g["diff_vs_full"].notna().any():
            row["diff_vs_full"] = float(g["diff_vs_full"].mean())
        out.append(row)
    return out
