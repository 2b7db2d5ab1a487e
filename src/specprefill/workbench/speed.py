"""Speed: TTFT sweeps of the offline pair (`bench.Bench`) and the served-QPS protocol (plain vLLM and
`specprefill serve` under vLLM's load generator, per LongBench category).

Each experiment is a loop of resumable units (`store.run_unit`) keyed by everything that shapes its rows.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Sequence
from pathlib import Path

import pandas as pd
from tqdm.auto import tqdm

from specprefill.atomic import write_text
from specprefill.config import EngineParams, SpecPrefillConfig, is_keep_rate
from specprefill.data import longbench
from specprefill.engines.vllm import checks
from specprefill.errors import SpecPrefillError
from specprefill.serve import loadtest
from specprefill.workbench import bench, records, store
from specprefill.workbench.units import engine_context, models_key, pair_context


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
    unknown = sorted(set(families) - set(records.TIMING_FAMILIES))
    if unknown:
        raise SpecPrefillError(f"families {', '.join(unknown)}: use names from {', '.join(records.TIMING_FAMILIES)}")
    rows = []
    cells = [(family, length, rate) for family in list(families) or [""] for length in lengths for rate in keep_rates]
    for family, length, rate in tqdm(cells, desc="TTFT sweep", unit="cell", disable=None):  # a sign of life per cell
        overrides = records.TIMING_FAMILIES[family] if family else {}
        batch = bench.batch_of(token_budget, length)
        spec = {
            "length": length,
            "reps": reps,
            **bench_obj.config.replace(**overrides).to_dict(),
            "keep_rate": rate,
            **models_key(bench_obj.llm),
            **({"batch": batch, "warmup": warmup} if token_budget or warmup != 1 else {}),
        }
        rows += [
            {**r, "label": family or "specprefill"}
            for r in store.run_unit(
                output_dir,
                "ttft",
                spec,
                lambda: [_flatten(bench_obj.ttft(length, rate, reps, batch=batch, warmup=warmup, overrides=overrides))],
                context=pair_context(bench_obj.llm),
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
        if not is_keep_rate(rate):
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
            per_task = -(-n_requests // len(longbench.QPS_TASKS.get(name, (0,))))
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
    checks.validate(engine)
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
    from specprefill import hardware  # lazy: torch

    settings = {k: v for k, v in hardware.engine_record(engine).items() if v not in (None, {}, [])}
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
