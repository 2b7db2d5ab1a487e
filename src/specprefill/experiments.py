"""What the experiment notebooks call: engines from params, token selectors (SpecPrefill and baselines), quality
runs with resume, TTFT/QPS sweeps, speculator-base agreement. Results are tidy rows written atomically per unit of
work under the notebook's output directory; a unit whose file exists is not run again.
"""
from __future__ import annotations

import hashlib
import json
import os
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from specprefill import core
from specprefill.atomic import write_text
from specprefill.errors import SpecPrefillError

# ---------------------------------------------------------------- results on disk


MAX_UNIT_NAME = 200  # file names may have 255 bytes


def unit_path(output_dir: str | os.PathLike, kind: str, spec: dict) -> Path:
    """units/<kind>/<key=value,...>.jsonl: the results folder names its config (a name longer than a file name may
    be is cut and ends in a hash of the whole)."""
    name = ",".join(f"{k}={spec[k]}" for k in sorted(spec)).replace("/", "_").replace(" ", "")
    if len(name) > MAX_UNIT_NAME:
        digest = hashlib.sha256(name.encode()).hexdigest()[:16]
        name = f"{name[:MAX_UNIT_NAME - 18]}-{digest}"
    return Path(output_dir) / "units" / kind / f"{name}.jsonl"


def run_unit(output_dir, kind: str, spec: dict, compute: Callable[[], list[dict]], force: bool = False) -> list[dict]:
    """Rows of one unit: read back if finished, else computed and written atomically (with the spec on each row)."""
    path = unit_path(output_dir, kind, spec)
    if path.exists() and not force:
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    rows = [{**spec, **row} for row in compute()]
    write_text(path, "".join(json.dumps(r) + "\n" for r in rows))
    return rows


def save_table(rows: list[dict], output_dir, name: str, params: dict | None = None):
    """A tidy CSV of all rows plus a JSON with the params that produced them; returns the DataFrame."""
    import pandas as pd

    df = pd.DataFrame(rows)
    out = Path(output_dir)
    write_text(out / f"{name}.csv", df.to_csv(index=False))
    if params is not None:
        write_text(out / f"{name}.params.json", json.dumps(params, indent=1, default=str))
    return df


# ---------------------------------------------------------------- selectors


def random_chunks(m: int, keep_rate: float, chunk_size: int, seed: int) -> list[int]:
    """Baseline: uniformly random chunks at the same budget."""
    scores = torch.rand(m, generator=torch.Generator().manual_seed(seed))
    return core.select(scores, core.SpecPrefillConfig(keep_rate=keep_rate, chunk_size=chunk_size)).tolist()


def truncate_middle(m: int, keep_rate: float) -> list[int]:
    """Baseline: keep the first and last halves of the budget, drop the middle."""
    k = core.n_to_keep(m, keep_rate)
    head = k // 2
    return list(range(head)) + list(range(m - (k - head), m))


@dataclass
class Selector:
    """Kept indices per prompt for a method at a keep rate; speculator passes are cached across keep rates."""

    llm: object  # SpecPrefillLLM
    prompts: list[list[int]]
    _importance: dict = field(default_factory=dict)

    def importance(self, method: str, config: core.SpecPrefillConfig) -> list[torch.Tensor]:
        key = (method, config.look_ahead, config.pool_kernel, config.layer_head_agg, config.step_agg)
        if key not in self._importance:
            if method == "self_info":
                lps = self.llm.prompt_logprobs(self.prompts)
                self._importance[key] = [-torch.tensor(lp) for lp in lps]
            else:
                pruned = self.llm.speculator.speculate(self.prompts, [config] * len(self.prompts))
                self._importance[key] = [torch.tensor(p.importance) for p in pruned]
        return self._importance[key]

    def kept(self, method: str, config: core.SpecPrefillConfig, seed: int = 0) -> list[list[int] | None]:
        if method == "full":
            return [None] * len(self.prompts)
        if method == "random":
            return [random_chunks(len(p), config.keep_rate, config.chunk_size, seed * 100003 + i)
                    for i, p in enumerate(self.prompts)]
        if method == "truncate_middle":
            return [truncate_middle(len(p), config.keep_rate) for p in self.prompts]
        if method in ("specprefill", "self_info"):
            return [core.select(imp, config).tolist() for imp in self.importance(method, config)]
        raise SpecPrefillError(f"unknown method {method!r}: use one of {', '.join(METHODS)}")


METHODS = ("full", "specprefill", "random", "truncate_middle", "self_info")


# ---------------------------------------------------------------- quality


def quality_unit(llm, selector: Selector, records: list[dict], method: str, config: core.SpecPrefillConfig,
                 max_tokens: int) -> list[dict]:
    """Generate greedily for every record with one method/config and score it."""
    from vllm import SamplingParams

    from specprefill.metrics import score

    kept = selector.kept(method, config)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    outs = llm.generate_kept(selector.prompts, kept, params, restore_positions=config.restore_positions)
    rows = []
    for rec, k, out in zip(records, kept, outs):
        text = out.outputs[0].text
        n = len(out.prompt_token_ids)
        rows.append({"task": rec["task"], "index": rec["index"], "n_prompt": n, "n_kept": n if k is None else len(k),
                     "score": score(rec, text), "prediction": text[:500]})
    return rows


def quality(llm, records_by_task: dict[str, list[dict]], variants: list[dict], output_dir, max_tokens: int | dict,
            kind: str = "quality", base_config: core.SpecPrefillConfig | None = None, progress: bool = True) -> list[dict]:
    """Every task x variant (a dict with "method", "keep_rate" and optional config overrides), resumable.

    Variant keys other than "method" and "label" are SpecPrefillConfig fields."""
    from tqdm.auto import tqdm

    base_config = base_config or core.SpecPrefillConfig()
    rows = []
    selectors = {task: Selector(llm, [llm.tokenizer(r["input"])["input_ids"] for r in records])
                 for task, records in records_by_task.items()}  # speculator passes shared across variants
    jobs = [(t, v) for t in records_by_task for v in variants]
    for task, variant in tqdm(jobs, desc=kind, disable=not progress):
        records = records_by_task[task]
        overrides = {k: v for k, v in variant.items() if k not in ("method", "label")}
        config = base_config.replace(**overrides)
        selector = selectors[task]
        limit = max_tokens[task] if isinstance(max_tokens, dict) else max_tokens
        spec = {"task": task, "method": variant["method"], "label": variant.get("label", variant["method"]),
                "dtype": getattr(llm, "dtype", None),
                **{k: getattr(config, k) for k in ("keep_rate", "chunk_size", "look_ahead", "pool_kernel",
                                                   "layer_head_agg", "step_agg", "restore_positions")}}
        rows += run_unit(output_dir, kind, spec,
                         lambda: quality_unit(llm, selector, records, variant["method"], config, limit))
    return rows


def summarize(rows: list[dict], by: tuple[str, ...] = ("task", "label", "keep_rate")):
    import pandas as pd

    df = pd.DataFrame(rows)
    return df.groupby(list(by), as_index=False).agg(score=("score", "mean"), n=("score", "size"),
                                                     kept_fraction=("n_kept", "sum"), tokens=("n_prompt", "sum")) \
        .assign(kept_fraction=lambda d: d.kept_fraction / d.tokens).drop(columns="tokens")


# ---------------------------------------------------------------- speed


def ttft_sweep(bench_obj, lengths: list[int], keep_rates: list[float], reps: int, output_dir) -> list[dict]:
    rows = []
    for length in lengths:
        for rate in keep_rates:
            spec = {"length": length, "keep_rate": rate, "reps": reps, **_engine_key(bench_obj)}
            rows += run_unit(output_dir, "ttft", spec,
                             lambda: [_flatten(bench_obj.ttft(length, rate, reps))])
    return rows


def _engine_key(bench_obj) -> dict:
    """What of the engines shapes a speed number: the models and the dtype actually used (part of the unit key)."""
    return {"speculator": Path(bench_obj.engine.speculator).name, "base": Path(bench_obj.engine.base).name,
            "dtype": bench_obj.dtype}


def _flatten(row: dict) -> dict:
    out = {k: v for k, v in row.items() if k != "overhead"}
    out.update({f"overhead_{k}": v for k, v in row.get("overhead", {}).items()})
    return out


def qps_sweep(engine, config: core.SpecPrefillConfig, length: int, n_requests: int, rates: list[float], slo_s: float,
              max_tokens: int, output_dir, seed: int = 0, burst: int = 0) -> list[dict]:
    """Plain vLLM and `specprefill serve` (keep rate `config.keep_rate`) under vLLM's load generator at the same
    rates, one server at a time; one unit per server, keyed by everything that shapes its numbers."""
    from specprefill.serve import loadtest

    engine.validate()
    settings = {k: v for k, v in engine.to_dict().items() if v not in (None, {}, [])}
    rows = []
    for kind in loadtest.KINDS:
        spec = {"server": kind, "rates": list(rates), "length": length, "requests": n_requests, "burst": burst,
                "slo_s": slo_s, "max_tokens": max_tokens, "seed": seed, **settings,
                "specprefill": config.to_dict() if kind == "specprefill" else None}
        rows += run_unit(output_dir, "qps", spec, lambda: loadtest.sweep(
            kind, engine, config, length, n_requests, rates, max_tokens, slo_s, seed, burst, str(output_dir)))
    return rows


# ---------------------------------------------------------------- agreement


def agreement(speculator: str, base: str, texts: list[str], keep_rates: list[float], config: core.SpecPrefillConfig,
              output_dir) -> list[dict]:
    """Top-k overlap between the speculator's and the base model's own importance (transformers capture)."""
    def compute():
        from specprefill.models import resolve
        from specprefill.viz import ScoreCache, hf_capture

        spec_capture, tokenizer = hf_capture(resolve(speculator), config.look_ahead)
        base_capture, _ = hf_capture(resolve(base), config.look_ahead)
        out = []
        for i, text in enumerate(texts):
            ids = tokenizer(text)["input_ids"]
            a = ScoreCache.from_capture(ids, *spec_capture(ids)).importance(config)
            b = ScoreCache.from_capture(ids, *base_capture(ids)).importance(config)
            rand = torch.rand(len(ids), generator=torch.Generator().manual_seed(i))
            for rate in keep_rates:
                k = core.n_to_keep(len(ids), rate)
                out.append({"prompt": i, "n_prompt": len(ids), "keep_rate": rate,
                            "overlap": core.top_k_overlap(a, b, k), "random_overlap": core.top_k_overlap(rand, b, k)})
        return out

    spec = {"speculator": Path(speculator).name, "base": Path(base).name, "prompts": len(texts),
            "look_ahead": config.look_ahead, "pool_kernel": config.pool_kernel}
    return run_unit(output_dir, "agreement", spec, compute)


def set_seed(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)


# ---------------------------------------------------------------- notebook helpers (records and variants)


def long_context_records(dataset: str, tokenizer, length: int, n: int, tasks: list[str], data_dir: str | None = None,
                         seed: int = 0) -> dict[str, list[dict]]:
    """"analogue": offline multi-document QA built from SQuAD (labelled analogue); "longbench": the hub tasks."""
    from specprefill.datasets import hub, tasks as offline

    if dataset == "analogue":
        return {"mdqa_squad_analogue": offline.long_qa_analogue(tokenizer, length, n, seed)}
    if dataset == "longbench":
        return {t: hub.longbench(t, n, data_dir) for t in tasks}
    raise SpecPrefillError(f"dataset {dataset!r} is unknown: use analogue or longbench")


def ruler_records(tokenizer, tasks: list[str], length: int, n: int, seed: int = 0) -> dict[str, list[dict]]:
    from specprefill.datasets import ruler

    return {t: ruler.generate(t, tokenizer, length, n, seed) for t in tasks}


def short_records(tasks: dict[str, int]) -> dict[str, list[dict]]:
    from specprefill.datasets.tasks import short_task

    return {name: short_task(name, n) for name, n in tasks.items()}


def variants(keep_rates: list[float], methods: tuple[str, ...] = ("specprefill",), full: bool = True,
             extra: list[dict] | None = None) -> list[dict]:
    """[full] + every method at every keep rate + extra variants (dicts with "method", "label", overrides)."""
    out = [{"method": "full", "label": "full", "keep_rate": 1.0}] if full else []
    out += [{"method": m, "label": m, "keep_rate": r} for m in methods for r in keep_rates]
    return out + list(extra or [])


def main_table(rows: list[dict], output_dir, params: dict, by=("task", "label", "keep_rate")):
    """summary.csv (mean score per group) + all rows as results.csv, with the params beside them."""
    save_table(rows, output_dir, "results", params)
    return save_table(summarize(rows, by).to_dict("records"), output_dir, "summary")


def ablation_variants(ablations: list[dict], keep_rate: float) -> list[dict]:
    """SpecPrefill at one keep rate, one variant per ablation dict ({"label", **config overrides})."""
    return [{"method": "specprefill", "keep_rate": keep_rate, **a} for a in ablations]


def texts(records_by_task: dict[str, list[dict]]) -> list[str]:
    return [r["input"] for records in records_by_task.values() for r in records]


def agreement_summary(rows: list[dict]) -> list[dict]:
    import pandas as pd

    df = pd.DataFrame(rows)
    return df.groupby("keep_rate", as_index=False)[["overlap", "random_overlap"]].mean().to_dict("records")
