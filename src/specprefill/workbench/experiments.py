"""The experiments the notebooks run: quality per method and keep rate, TTFT and served-QPS sweeps, speculator-base
agreement. Each is a loop of resumable units (`store.run_unit`) keyed by everything that shapes their rows.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import random
import re
from collections.abc import Sequence
from pathlib import Path

import pandas as pd
import torch
from tqdm.auto import tqdm

from specprefill import calibrate, core, models, tokenmap
from specprefill.atomic import write_text
from specprefill.config import EngineParams, SpecPrefillConfig
from specprefill.data import longbench, sandbox
from specprefill.data.metrics import METRIC_VERSION, score  # a new version recomputes every quality unit
from specprefill.engines import scoring
from specprefill.engines.common import load_tokenizer, tokenize_prompt
from specprefill.engines.vllm import builder
from specprefill.engines.vllm.pair import SpecPrefillLLM, greedy
from specprefill.errors import SpecPrefillError
from specprefill.models import resolve
from specprefill.models.self_speculation import carried_heads
from specprefill.selectors import Selection
from specprefill.serve import loadtest
from specprefill.workbench import bench, harness, records, stats, store
from specprefill.workbench.bench import Bench

# ---------------------------------------------------------------- quality


def _models_key(llm) -> dict:
    """The speculator's and the base's fingerprints and the dtype the engines run in (in the rows)."""
    return {
        "speculator": models.fingerprint(llm.speculator_path),
        "base": models.fingerprint(llm.base_path),
        "dtype": llm.dtype,
    }


def engine_context(params: EngineParams, plan: builder.Plan | None = None) -> dict:
    """The engines as built, for unit keys (`store.run_unit`'s context): every `EngineParams` field and both
    engines' arguments after the builder derived and sized them."""
    plan = plan or builder.plan(params)
    return {
        "engine": params.to_dict(),
        "base_engine_args": plan.base_kwargs,
        "speculator_engine_args": plan.speculator_kwargs,
    }


def _context(llm) -> dict:
    return engine_context(llm.params, llm.plan)


def quality_unit(
    llm,
    selection: Selection,
    records: list[dict],
    method: str,
    config: SpecPrefillConfig,
    max_tokens: int,
    seed: int = 0,
) -> list[dict]:
    """Generate greedily for every record with one method/config and score it."""
    kept = selection.kept(method, config, seed)
    params = greedy(max_tokens)
    outs = llm.generate_kept(selection.prompts, kept, params, restore_positions=config.restore_positions)
    rows = []
    for rec, k, out in zip(records, kept, outs):
        text = out.outputs[0].text
        n = len(out.prompt_token_ids)
        row = {
            "task": rec["task"],
            "index": rec["index"],
            "n_prompt": n,
            "n_kept": n if k is None else len(k),
            "score": score(rec, text),
            "prediction": text[:500],
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
    lm_eval_tasks: Sequence[str] = (),
    lm_eval_limit: int | None = None,
    lm_eval_metadata: dict | None = None,
    lm_eval_include_path: str | None = None,
    chat_template: bool = False,
    data_dir: str | None = None,
    lm_eval_max_gen_toks: int | None = None,
    lm_eval_task_args: dict | None = None,
    lm_eval_truncation: str = "left",
) -> list[dict]:
    """Every task x variant (a dict with "method", "keep_rate" and optional config overrides), resumable.

    Variant keys other than "method" and "label" are SpecPrefillConfig fields. A unit is keyed by the method, every
    knob, both models' fingerprints, dtype, sampling, the seed and a digest of its records (inputs, references,
    metric), so changing any of them (another model, more samples, a longer prompt) computes it again."""
    base_config = base_config or SpecPrefillConfig()
    rows = []
    selections = {
        task: Selection(llm, [llm.tokenizer(r["input"])["input_ids"] for r in records])
        for task, records in records_by_task.items()
    }  # speculator passes shared across variants
    jobs = [(t, v) for t in records_by_task for v in variants]
    for task, variant in tqdm(jobs, desc=kind, disable=not progress):
        records = records_by_task[task]
        runs_code = any(r.get("metric") == "pass@1" for r in records)
        overrides = {k: v for k, v in variant.items() if k not in ("method", "label")}
        config = base_config.replace(**overrides)
        selection = selections[task]
        limit = max_tokens[task] if isinstance(max_tokens, dict) else max_tokens
        spec = {
            "task": task,
            "method": variant["method"],
            "label": variant.get("label", variant["method"]),
            **config.to_dict(),
            **_models_key(llm),
            "max_tokens": limit,
            "temperature": 0.0,
            "seed": seed,
            "n_records": len(records),
            "records": store.digest(records),  # every field of every record: whatever the metric reads
            "metric_version": METRIC_VERSION,
            **({"sandbox": sandbox.boundary()} if runs_code else {}),
        }
        rows += store.run_unit(
            output_dir,
            kind,
            spec,
            lambda: quality_unit(llm, selection, records, variant["method"], config, limit, seed),
            context=_context(llm),
        )
    if lm_eval_tasks:
        rows += lm_eval_quality(
            llm,
            list(lm_eval_tasks),
            variants,
            output_dir,
            base_config,
            lm_eval_limit,
            seed,
            lm_eval_metadata,
            lm_eval_include_path,
            chat_template,
            data_dir,
            lm_eval_max_gen_toks,
            lm_eval_task_args,
            lm_eval_truncation,
        )
    return rows


LM_EVAL_ROWS_VERSION = 5  # bump when the rows taken from lm-eval's samples change: every lm-eval unit is redone


def lm_eval_quality(
    llm,
    tasks: list[str],
    variants: list[dict],
    output_dir,
    base_config: SpecPrefillConfig,
    limit: int | None = None,
    seed: int = 0,
    metadata: dict | None = None,
    include_path: str | None = None,
    chat_template: bool = False,
    data_dir: str | None = None,
    max_gen_toks: int | None = None,
    task_args: dict | None = None,
    truncation: str = "left",
) -> list[dict]:
    """The benchmarks' own protocol (prompts, truncation, metrics) through lm-evaluation-harness, on the pair
    already built: one resumable unit per variant ("full" or a SpecPrefill variant at a keep rate), one row per
    sample with its task's score on a 0-100 scale (a group's samples under the group, `subtask` naming the member).
    `chat_template`: the model's chat template as the original ran the tasks (`harness.uses_chat_template`; few-shot
    examples as turns); `data_dir`: every task's rows read from that directory (`harness.local_tasks`);
    `max_gen_toks`: a cap on every answer's length (small profiles); `task_args`: per task, as the original ran it
    ({task: {chat_template, num_fewshot, max_gen_toks}}, `harness.run_groups`); `truncation`: which part of a prompt
    longer than the context is cut ("middle" keeps its start and end, as LongBench's own prediction script does)."""
    import lm_eval  # lazy, as below
    from lm_eval.tasks import TaskManager

    from specprefill.lm_eval import SpecPrefillLM  # lazy: lm-eval (and datasets) only when lm_eval_tasks are given

    lm = SpecPrefillLM(llm=llm, batch_size="auto", truncation_side=harness.check_truncation(truncation))
    metadata = metadata or {}
    plan = harness.local_tasks(tasks, data_dir, Path(output_dir) / "lm_eval_tasks", include_path)
    includes = harness.include_paths(include_path, Path(output_dir) / "lm_eval_tasks" if plan.digests else None)
    # the tasks' metadata (RULER's lengths, and the tokenizer its prompts are built with) goes through the manager
    harness.index_stock_tasks_once()
    manager = harness.loading_once(TaskManager)(
        include_path=includes, metadata={"pretrained": llm.base_path, **metadata}
    )
    task_args = harness.check_task_args(tasks, task_args)
    groups = harness.run_groups(tasks, chat_template, task_args, max_gen_toks)
    runs_code = bool(set(tasks) & set(harness.CODE_TASKS))
    rows, default = [], llm.config
    for variant in variants:
        if variant["method"] not in ("full", "specprefill"):
            raise SpecPrefillError(
                f"lm-eval tasks run full prefill and SpecPrefill only, not {variant['method']!r}: "
                "drop that method or the lm_eval_tasks"
            )
        config = base_config.replace(**{k: v for k, v in variant.items() if k not in ("method", "label")})
        label = variant.get("label", variant["method"])
        spec = {
            "lm_eval_tasks": tasks,
            "label": label,
            **config.to_dict(),
            **_models_key(llm),
            "limit": limit,
            "seed": seed,
            "metadata": metadata,
            "max_model_len": llm.max_model_len,
            "lm_eval": lm_eval.__version__,
            "include_path": include_path,
            "chat_template": {t: harness.uses_chat_template(t, chat_template, task_args) for t in tasks},
            "task_args": task_args,
            "truncation": truncation,
            "max_gen_toks": max_gen_toks,
            "local_data": plan.digests,  # digests of the rows read from data_dir, by task
            "rows_version": LM_EVAL_ROWS_VERSION,
            **({"sandbox": sandbox.boundary()} if runs_code else {}),  # refused here, before generating, without one
            **({"project_tasks": harness.tasks_digest()} if runs_code else {}),
        }

        def compute():
            llm.config = config
            out_rows = []
            try:
                for (templated, fewshot, cap), group in groups.items():
                    if cap:  # the tasks are built once (the manager keeps them): lower their answer limits here
                        harness.cap_answers(manager.load([plan.run[t] for t in group]), cap, lm.max_gen_toks)
                    out = lm_eval.simple_evaluate(
                        model=lm,
                        tasks=[plan.run[t] for t in group],
                        limit=limit,
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
                        out_rows += [
                            {**row, "task": owner, "subtask": subtask, "chat_template": templated}
                            | ({"sandbox": spec["sandbox"]} if owner in harness.CODE_TASKS else {})
                            | ({"index": f"{subtask}:{row['index']}"} if owner != subtask else {})  # unique in a group
                            for row in lm_eval_rows(
                                task,
                                samples,
                                out["configs"][task]["metric_list"],
                                (task_args.get(owner) or {}).get("filter"),
                            )
                        ]
            finally:
                llm.config = default
            return out_rows

        rows += [
            {**r, "label": label, "keep_rate": config.keep_rate}
            for r in store.run_unit(output_dir, "lm_eval", spec, compute, context=_context(llm))
        ]
    return rows


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


# ---------------------------------------------------------------- speed


def ttft_sweep(
    bench_obj,
    lengths: list[int],
    keep_rates: list[float],
    reps: int,
    output_dir,
    token_budget: int | None = None,
    warmup: int = 1,
    families: Sequence[str] = (),
) -> list[dict]:
    """TTFT speedup at every length x keep rate, one resumable unit each; with `token_budget` in the original's
    batched regime (budget / length prompts prefilled together), with `families` once per configuration family
    (`records.FAMILIES`, rows labelled by family; none: the bench's own knobs, labelled "specprefill")."""
    unknown = sorted(set(families) - set(records.FAMILIES))
    if unknown:
        raise SpecPrefillError(f"families {', '.join(unknown)}: use names from {', '.join(records.FAMILIES)}")
    rows = []
    for family in list(families) or [""]:
        overrides = records.FAMILIES[family] if family else {}
        label = family or "specprefill"
        for length in lengths:
            batch = bench.batch_of(token_budget, length)
            for rate in keep_rates:
                spec = {
                    "length": length,
                    "reps": reps,
                    **bench_obj.config.replace(**overrides).to_dict(),
                    "keep_rate": rate,
                    **_models_key(bench_obj.llm),
                    **({"batch": batch, "warmup": warmup} if token_budget or warmup != 1 else {}),
                }
                rows += [
                    {**r, "label": label}
                    for r in store.run_unit(
                        output_dir,
                        "ttft",
                        spec,
                        lambda: [
                            _flatten(
                                bench_obj.ttft(length, rate, reps, batch=batch, warmup=warmup, overrides=overrides)
                            )
                        ],
                        context=_context(bench_obj.llm),
                    )
                ]
    return rows


def _flatten(row: dict) -> dict:
    out = {k: v for k, v in row.items() if k != "overhead"}
    out.update({f"overhead_{k}": v for k, v in row.get("overhead", {}).items()})
    return out


def check_categories(categories: dict) -> None:
    """Each category of a QPS run: a keep rate in (0, 1], a positive timeout and positive rates; one-line errors."""
    if not isinstance(categories, dict) or not categories:
        raise SpecPrefillError("categories is empty: give {name: {keep_rate, timeout_s, rates}} for each category")
    for name, cat in categories.items():
        if not isinstance(cat, dict):
            raise SpecPrefillError(f"category {name!r}: give {{keep_rate, timeout_s, rates}}, not {cat!r}")
        missing = {"keep_rate", "timeout_s", "rates"} - set(cat)
        if missing:
            raise SpecPrefillError(f"category {name!r} needs {', '.join(sorted(missing))}: add them under categories")
        rate, timeout, rates = cat["keep_rate"], cat["timeout_s"], cat["rates"]
        if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0 < rate <= 1:
            raise SpecPrefillError(f"category {name!r}: keep_rate {rate!r} must be in (0, 1]")
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
            raise SpecPrefillError(f"category {name!r}: timeout_s {timeout!r} must be a positive number of seconds")
        if (
            not isinstance(rates, list)
            or not rates
            or not all(isinstance(r, (int, float)) and not isinstance(r, bool) and 0 < r < float("inf") for r in rates)
        ):
            raise SpecPrefillError(f"category {name!r}: rates {rates!r} must be a list of positive requests/s")


def qps_requests(
    categories: dict[str, dict],
    dataset: str,
    tokenizer,
    length: int,
    n_requests: int,
    data_dir: str | None = None,
    chat_template: bool = True,
    answer_tokens: int | None = None,
    seed: int = 0,
) -> dict[str, list[dict]]:
    """Per category, the `n_requests` requests of a load test: LongBench rows of its tasks ("longbench": the hub or
    `data_dir`) or the category's offline analogue ("analogue"), prompts of at most `length` tokens."""
    check_categories(categories)
    if isinstance(n_requests, bool) or not isinstance(n_requests, int) or n_requests < 1:
        raise SpecPrefillError(f"n_requests {n_requests!r} must be an integer >= 1 (requests per rate and category)")
    if answer_tokens is not None and (
        isinstance(answer_tokens, bool) or not isinstance(answer_tokens, int) or answer_tokens < 1
    ):
        raise SpecPrefillError(f"answer_tokens {answer_tokens!r} must be an integer >= 1 (or null: LongBench's)")
    out = {}
    for name in categories:
        if dataset == "longbench":
            per_task = -(-n_requests // len(longbench.CATEGORIES.get(name, (0,))))
            reqs = longbench.category_requests(
                name, tokenizer, per_task, length, data_dir, chat_template, answer_tokens, seed
            )
        elif dataset == "analogue":
            reqs = longbench.category_analogue(name, tokenizer, n_requests, length, chat_template, answer_tokens, seed)
        else:
            raise SpecPrefillError(f"QPS dataset {dataset!r} is unknown: use longbench or analogue")
        if not reqs:
            raise SpecPrefillError(f"no requests for category {name!r}: give rows for its tasks")
        out[name] = (reqs * -(-n_requests // len(reqs)))[:n_requests]  # fewer rows than requests: repeated
    return out


def category_qps(
    engine: EngineParams,
    config: SpecPrefillConfig,
    categories: dict[str, dict],
    requests: dict[str, list[dict]],
    tolerance: int,
    output_dir,
    warmup: int = 0,
    burstiness: float = 1.0,
    seed: int = 0,
) -> list[dict]:
    """Plain vLLM and `specprefill serve` of the same base, one server at a time, each replaying every category's
    requests under vLLM's load generator at the category's rates (`loadtest.category_sweep`: served within the
    category's timeout, SpecPrefill at the category's keep rate); one unit per server."""
    builder.validate(engine)
    check_categories(categories)
    if not requests or any(not r for r in requests.values()):
        raise SpecPrefillError("no requests for some category: give n_requests >= 1 and rows for its tasks")
    n = min(len(r) for r in requests.values())  # requests per rate and category
    if isinstance(tolerance, bool) or not isinstance(tolerance, int) or not 0 <= tolerance < n:
        raise SpecPrefillError(
            f"tolerance {tolerance!r} must be an integer in [0, {n}): the requests a sustained rate may miss"
        )
    if isinstance(burstiness, bool) or not isinstance(burstiness, (int, float)) or not burstiness > 0:
        raise SpecPrefillError(f"burstiness {burstiness!r} must be > 0 (1: Poisson arrivals, large: nearly constant)")
    settings = {k: v for k, v in engine.to_dict().items() if v not in (None, {}, [])}
    folder = Path(output_dir) / "requests"
    paths = {}
    for name, reqs in requests.items():
        text = "".join(json.dumps({"prompt": r["prompt"], "output_tokens": r["output_tokens"]}) + "\n" for r in reqs)
        paths[name] = str(write_text(folder / f"{re.sub(r'[^A-Za-z0-9]+', '_', name)}.jsonl", text))
    rows = []
    for kind in loadtest.KINDS:
        spec = {
            "server": kind,
            "categories": categories,
            "request_digests": {
                k: store.digest([[r["prompt"], r["output_tokens"]] for r in v]) for k, v in requests.items()
            },
            "n_requests": n,
            "tolerance": tolerance,
            "warmup": warmup,
            "burstiness": burstiness,
            "seed": seed,
            **settings,
            "specprefill": config.to_dict() if kind == "specprefill" else None,
        }
        sweep = functools.partial(
            loadtest.category_sweep, kind, engine, config, categories, paths, n, tolerance, warmup, burstiness, seed
        )
        rows += store.run_unit(
            output_dir,
            "qps",
            spec,
            functools.partial(sweep, str(output_dir)),
            context=engine_context(engine),
        )
    return [{k: v for k, v in r.items() if k not in ("categories", "request_digests")} for r in rows]


def qps_table(rows: list[dict], categories: dict[str, dict]) -> pd.DataFrame:
    """Per category: its keep rate and timeout, max QPS of plain vLLM and of SpecPrefill and their ratio, and which
    server sustained even the highest rate tried (its max QPS is then at least that: the grid, not the server,
    set it)."""
    best = {(r["category"], r["mode"]): r["max_qps"] for r in loadtest.category_max_qps(rows)}
    out = []
    for name, cat in categories.items():
        plain, sp = best.get((name, "vllm"), 0.0), best.get((name, "specprefill"), 0.0)
        top = max(cat.get("rates") or [0.0])
        out.append(
            {
                "category": name,
                "keep_rate": cat["keep_rate"],
                "timeout_s": cat["timeout_s"],
                "max_qps_vllm": plain,
                "max_qps_specprefill": sp,
                "gain": sp / plain if plain else None,
                "top_rate_sustained": ", ".join(m for m, q in (("vllm", plain), ("specprefill", sp)) if q >= top)
                or "-",
            }
        )
    return pd.DataFrame(out)


# ---------------------------------------------------------------- speculator choice


def speculator_choice(
    engine,
    config: SpecPrefillConfig,
    speculators: list[str],
    records_by_task: dict,
    keep_rates: list[float],
    max_tokens: int,
    output_dir,
    ttft_length: int,
    ttft_keep_rate: float,
    ttft_reps: int,
    seed: int = 0,
) -> tuple[list[dict], list[dict]]:
    """Each speculator in turn with the same base (`engine` with its speculator replaced): quality at every keep
    rate (full prefill once, with the first pair; the paired differences use it) and TTFT at one length, both
    resumable. Returns (quality rows labelled by speculator, TTFT rows). Each pair is shut down before the next."""
    quality_rows, ttft_rows = [], []
    for i, name in enumerate(speculators):
        params = dataclasses.replace(engine, speculator=name)
        if engine.base is not None:
            calibrate.ensure(name, engine.base, "vllm", params)  # a calibrated:S speculator without one: made here
        llm = SpecPrefillLLM.from_params(params, config)
        try:
            variants = ([{"method": "full", "label": "full", "keep_rate": 1.0}] if i == 0 else []) + [
                {"method": "specprefill", "label": name, "keep_rate": r} for r in keep_rates
            ]
            quality_rows += quality(
                llm,
                records_by_task,
                variants,
                output_dir,
                max_tokens,
                kind="speculator_choice",
                base_config=config,
                seed=seed,
            )
            spec = {
                "speculator_name": name,
                **_models_key(llm),
                "length": ttft_length,
                "keep_rate": ttft_keep_rate,
                "reps": ttft_reps,
                **{k: v for k, v in config.to_dict().items() if k != "keep_rate"},
                "speculator_params": models.param_count(llm.speculator_path),
                "base_params": models.param_count(llm.base_path),
            }
            ttft_rows += store.run_unit(
                output_dir,
                "speculator_ttft",
                spec,
                lambda: [Bench(params, config, llm).ttft(ttft_length, ttft_keep_rate, ttft_reps)],
                context=_context(llm),
            )
        finally:
            llm.shutdown()
    return quality_rows, ttft_rows


def speculator_table(
    quality_summary: pd.DataFrame, ttft_rows: list[dict], rows: list[dict] | None = None, keep_rate: float | None = None
) -> pd.DataFrame:
    """One row per speculator: its TTFT speedup, bound and efficiency beside its quality per task and keep rate;
    with the quality `rows`, also its quality pooled over the tasks at `keep_rate` (the TTFT's: mean, 95% interval,
    n) and whether it is on the speed-quality frontier (`pareto`)."""
    ttft = pd.DataFrame(ttft_rows)[["speculator_name", "speculator_params", "speedup", "bound", "efficiency"]]
    q = quality_summary[quality_summary["label"] != "full"].copy()
    q["cell"] = q.apply(lambda r: f"{r['score']:.1f} [{r['ci_low']:.1f}, {r['ci_high']:.1f}]", axis=1)
    wide = q.pivot_table(index="label", columns=["task", "keep_rate"], values="cell", aggfunc="first")
    wide.columns = [f"{t} @{k:g}" for t, k in wide.columns]
    table = ttft.merge(wide, left_on="speculator_name", right_index=True, how="left")
    if rows is None or keep_rate is None:
        return table
    at_rate = [{**r, "task": "pooled"} for r in rows if r["label"] != "full" and r["keep_rate"] == keep_rate]
    pooled = stats.summarize(at_rate, by=("label",))[["label", "score", "ci_low", "ci_high", "n"]]
    pooled.columns = ["speculator_name", "quality", "quality_low", "quality_high", "quality_n"]
    table = table.merge(pooled, on="speculator_name", how="left")
    return table.assign(pareto=pareto(table["speedup"], table["quality"]))


def pareto(speed: pd.Series, quality: pd.Series) -> list[bool]:
    """Which points no other point beats on both axes (faster and at least as good, or as fast and better)."""
    points = list(zip(speed.astype(float), quality.astype(float)))
    beaten = [any((s2 >= s and q2 >= q) and (s2 > s or q2 > q) for s2, q2 in points) for s, q in points]
    return [s == s and q == q and not b for (s, q), b in zip(points, beaten)]  # NaN (missing): on no frontier


# ---------------------------------------------------------------- agreement


def agreement(
    speculators: Sequence[str],
    base: str,
    texts: list[str],
    keep_rates: list[float],
    config: SpecPrefillConfig,
    output_dir,
    engine: str = "hf",
    params: EngineParams | None = None,
) -> list[dict]:
    """Speculator vs base attention, per speculator (one unit each): for every pair of layers, KL(base || speculator)
    and Kendall tau of the two layers' importance over the prompt (`core.layer_agreement`; rows with `spec_layer`,
    `base_layer`), and per keep rate the top-k Jaccard of the two final importance vectors beside a random scorer's
    (rows with `keep_rate`). Importance is the base's tokens' (a speculator with another tokenizer is moved onto
    them, `tokenmap`). Each model is scored alone on `engine` ("hf": transformers on the CPU, the oracle; "vllm": the
    workers' capture, the base with its own tensor-parallel width from `params`), one engine at a time."""
    base_path = resolve(base)
    params = params or EngineParams(speculator=base, base=base)
    base_ids = [tokenize_prompt(load_tokenizer(base_path), t) for t in texts]
    longest = max(map(len, base_ids), default=1)
    base_cache: dict = {}
    base_config = config.replace(score_heads="all")  # the target: every head of the base

    def base_importance():  # scored once, and only if some speculator's unit has to be computed
        if not base_cache:
            role = scoring.capture_params(params, base_path, "base")
            scorer = scoring.open_scorer(base_path, engine, config.look_ahead, role, longest)
            layers, final = [], []
            try:
                for ids in base_ids:  # reduced as scored: a large base's raw weights are not all held at once
                    cache = scorer(ids)
                    layers.append(cache.layer_importance(base_config))
                    final.append(cache.importance(base_config))
            finally:
                scorer.close()
            base_cache.update(tokenizer=scorer.tokenizer, ids=base_ids, layers=layers, final=final)
        return base_cache

    def compute(speculator: str, spec_path: str) -> list[dict]:
        b = base_importance()
        role = scoring.capture_params(params, spec_path, "speculator")
        scorer = scoring.open_scorer(spec_path, engine, config.look_ahead, role, 2 * longest)  # other tokenizers: more
        try:
            pair = tokenmap.Pair(scorer.tokenizer, b["tokenizer"])
            out = []
            for i, ids in enumerate(b["ids"]):
                tmap = pair.map(ids)
                cache = scorer(pair.speculator_ids(ids, tmap))
                spec_config = config.with_heads(carried_heads(spec_path))  # a calibrated speculator's own heads
                layers, final = cache.layer_importance(spec_config), cache.importance(spec_config)
                if tmap is not None:
                    layers = torch.stack([tmap.project(x, config.cross_token_agg) for x in layers])
                    final = tmap.project(final, config.cross_token_agg)
                kl, tau = core.layer_agreement(layers, b["layers"][i])
                out += [
                    {"prompt": i, "spec_layer": a, "base_layer": c, "kl": float(kl[a, c]), "tau": float(tau[a, c])}
                    for a in range(kl.shape[0])
                    for c in range(kl.shape[1])
                ]
                rand = torch.rand(len(ids), generator=torch.Generator().manual_seed(i))
                for rate in keep_rates:
                    k = core.n_to_keep(len(ids), rate)
                    out.append(
                        {
                            "prompt": i,
                            "n_prompt": len(ids),
                            "keep_rate": rate,
                            "jaccard": core.top_k_jaccard(final, b["final"][i], k),
                            "random_jaccard": core.top_k_jaccard(rand, b["final"][i], k),
                            "overlap": core.top_k_overlap(final, b["final"][i], k),
                        }
                    )
            return [{"speculator": speculator, **r} for r in out]
        finally:
            scorer.close()

    rows = []
    for speculator in speculators:
        spec_path = models.resolve_speculator(speculator, base)
        spec = {
            "speculator_model": models.fingerprint(spec_path),
            "base": models.fingerprint(base_path),
            "engine": engine,
            "prompts": len(texts),
            "texts": store.digest(texts),
            "keep_rates": list(keep_rates),
            **{k: v for k, v in config.to_dict().items() if k != "keep_rate"},
            **({"engine_params": params.to_dict()} if engine == "vllm" else {}),
        }
        rows += store.run_unit(output_dir, "agreement", spec, functools.partial(compute, speculator, spec_path))
    return rows


def set_seed(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)


# ---------------------------------------------------------------- notebook helpers (records and variants)


def main_table(rows: list[dict], output_dir, params: dict, by=("task", "label", "keep_rate")) -> pd.DataFrame:
    """summary.csv (mean score, n, 95% interval and the paired difference to full prefill per group) + all rows as
    results.csv, with the params beside them."""
    store.save_table(rows, output_dir, "results", params)
    return store.save_table(stats.summarize(rows, by).to_dict("records"), output_dir, "summary")


LONGBENCH_CATEGORIES = longbench.CATEGORIES
LONGBENCH_E_BUCKETS = ((4000, "0-4k"), (8000, "4-8k"), (float("inf"), "8k+"))  # LongBench-E's length groups


def longbench_tables(rows: list[dict], output_dir) -> dict[str, pd.DataFrame]:
    """LongBench's per-category table (English tasks) and LongBench-E's by length (0-4k, 4-8k, 8k+ by the rows'
    `length` field), each with n, 95% intervals and the paired difference to full prefill, pooled over the documents
    of a cell; saved as categories.csv and longbench_e.csv. Empty (and nothing saved) without LongBench rows."""
    category = {f"longbench_{t}": c for c, tasks in LONGBENCH_CATEGORIES.items() for t in tasks}

    def cell(r: dict, name: str) -> dict:  # a document is paired with full prefill by its task and index
        return {**r, "task": name, "index": f"{r['task']}:{r['index']}"}

    english = [cell(r, category[r["task"]]) for r in rows if r["task"] in category]
    by_length = [
        cell(r, next(name for limit, name in LONGBENCH_E_BUCKETS if r["length"] < limit))
        for r in rows
        if str(r["task"]).startswith("longbench_") and str(r["task"]).endswith("_e") and r.get("length") is not None
    ]
    out = {}
    for name, part in (("categories", english), ("longbench_e", by_length)):
        if part:
            table = stats.summarize(part).rename(columns={"task": "category" if name == "categories" else "length"})
            out[name] = store.save_table(table.to_dict("records"), output_dir, name, {})
    return out


def agreement_summary(rows: list[dict]) -> list[dict]:
    """Per speculator and keep rate: mean top-k Jaccard with the base (and a random scorer's) with n and 95%
    intervals, and the speculator's best and last layer by Kendall tau with the base's last layer."""
    df = pd.DataFrame(rows)
    topk, layers = df[df["keep_rate"].notna()], df[df["spec_layer"].notna()]
    out = []
    for (name, rate), g in topk.groupby(["speculator", "keep_rate"], sort=False):
        row = {"speculator": name, "keep_rate": rate, "n": len(g)}
        for col in ("jaccard", "random_jaccard"):
            row[col], row[f"{col}_low"], row[f"{col}_high"] = stats.mean_ci(g[col])
        own = layers[layers["speculator"] == name]
        last_base = own[own["base_layer"] == own["base_layer"].max()].groupby("spec_layer")["tau"].mean().dropna()
        best = last_base.idxmax() if len(last_base) else None
        row["best_layer_tau"] = float(last_base.max()) if best is not None else None
        row["best_layer"] = int(best) if best is not None else None
        out.append(row)
    return out


def layer_matrices(rows: list[dict]) -> dict[str, dict[str, pd.DataFrame]]:
    """Per speculator: the [speculator layer x base layer] KL and Kendall tau matrices, averaged over prompts."""
    df = pd.DataFrame(rows)
    layers = df[df["spec_layer"].notna()].astype({"spec_layer": int, "base_layer": int})
    return {
        name: {
            m: g.pivot_table(index="spec_layer", columns="base_layer", values=m, aggfunc="mean") for m in ("kl", "tau")
        }
        for name, g in layers.groupby("speculator", sort=False)
    }
