"""A notebook's time on a CPU class predicted from its parameters, before it runs (`reproduce --prepare-only`): the
work its parameters ask for (tokens each model prefills, decoding steps, engines started, requests served) times the
class's recorded rates (`RATES`, measured on 2-core machines, docs/measurements.md). Vague by design: it answers "how
long will this take here", not a benchmark; a machine's own last run of a notebook replaces it (`eta.predict`).

A model's prefill time per token scales with its non-embedding parameters to the power `SIZE_EXPONENT` from the
1.5B base the rates were measured with (the 0.5B prefilled 867 tokens/s where the 1.5B did 354 on the Xeon: 3.6x the
parameters, 2.45x the time)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from specprefill.errors import SpecPrefillError
from specprefill.models import self_speculation
from specprefill.models.registry import MODELS
from specprefill.workbench.records import FAMILIES

SIZE_EXPONENT = 0.7
REFERENCE = "qwen2.5-coder-1.5b"  # the model the rates were measured with


@dataclass(frozen=True)
class Rates:
    prefill: float  # the reference model's vLLM prefill, tokens/s (one request of 2-4k tokens)
    step: float  # one decoding step of the reference model, seconds (a batch of up to ~10 sequences)
    start: float  # a notebook's fixed cost: kernel, imports, both engines loaded, seconds
    hf_prefill: float  # the reference model in transformers (float32, attention weights kept), tokens/s
    server_start: float  # one `vllm serve` / `specprefill serve` up and healthy, seconds


# per CPU class (`eta.cpu_class`); where from: docs/measurements.md
RATES = {
    # Xeon, AMX bf16: 1.5B prefill 354 tok/s; 01 (one engine pair, little work) took 136 s in a whole run
    "amx": Rates(prefill=354.0, step=0.12, start=60.0, hf_prefill=90.0, server_start=40.0),
    # EPYC, AVX-512 bf16: 4,096 tokens prefilled in 39.6 s by the 1.5B (103 tok/s)
    "avx512_bf16": Rates(prefill=103.0, step=0.2, start=70.0, hf_prefill=45.0, server_start=50.0),
    # AVX2 only, float32: the Xeon under AVX2 emulation prefilled 53 tok/s; the AVX2 EPYC's core is ~1.95x slower
    "avx2": Rates(prefill=27.0, step=0.5, start=110.0, hf_prefill=25.0, server_start=80.0),
}
# the tasks of notebook 03 and their prompt tokens (median characters / 4 of `data.tasks`' rows)
SHORT_TOKENS = {"mmlu": 470, "arc_challenge": 400, "gsm8k": 900, "humaneval": 200, "ifeval_local": 120}
NOTEBOOK_SECONDS = {"09_token_importance_explorer": 30.0, "99_report": 6.0}  # fixed work, AMX; others scale by start


def _body(shape: dict) -> float:
    h, hd = shape["hidden_size"], shape["head_dim"]
    attention = h * hd * (2 * shape["num_attention_heads"] + 2 * shape["num_key_value_heads"])
    return shape["num_hidden_layers"] * (attention + 3 * h * shape["intermediate_size"])


def size(model: str | None, base: str | None = None) -> float | None:
    """A model's time per prefilled token relative to the reference model's; None for a model the registry does not
    hold (a hub id, a local directory). Speculators cut from a model (`self:K`, `<model>:K`, `calibrated:S`: S's own
    depth, calibration may cut it further) count their layers (`self_speculation.self_layers`' rule)."""
    if not model:
        return None
    if model.startswith("calibrated:"):
        model = model[len("calibrated:") :]
    name, _, cut = model.rpartition(":") if ":" in model else (model, "", "")
    spec = MODELS.get(base or "" if name == "self" else name)
    if spec is None:
        return None
    layers = spec.shape["num_hidden_layers"]
    if cut:
        try:
            layers = self_speculation.self_layers(model, layers)
        except SpecPrefillError:
            return None  # the notebook says what is wrong in its own turn
    body = _body(spec.shape) * layers / spec.shape["num_hidden_layers"]
    return (body / _body(MODELS[REFERENCE].shape)) ** SIZE_EXPONENT


def _n_prompts(params: dict) -> dict[str, tuple[int, int]]:
    """Per task: (prompts, tokens each)."""
    tasks = params.get("tasks")
    if isinstance(tasks, dict):
        return {t: (int(n), SHORT_TOKENS.get(t, 500)) for t, n in tasks.items()}
    names = tasks if isinstance(tasks, list) else [params.get("dataset", "task")]
    n = int(params.get("n_samples", 1)) * int(params.get("questions_per_document", 1))
    return {t: (n, int(params.get("length", 1024))) for t in names}


def _variants(params: dict) -> list[dict]:
    """The variants a quality notebook runs (`records.variants`, `rule_variants`, `ablation_variants`): keep rate,
    look-ahead, whether it runs the speculator, and what identifies its unit across notebooks (`unit`)."""
    la = int(params.get("look_ahead", 8))

    def one(rate, unit, look_ahead=la, speculates=True) -> dict:
        return {"keep_rate": float(rate), "look_ahead": look_ahead, "speculates": speculates, "unit": unit}

    if "ablations" in params:
        rate = params.get("keep_rate", 0.1)
        return [
            one(rate, ("ablation", a.get("label"), rate), int(a.get("look_ahead", la))) for a in params["ablations"]
        ]
    rates = params.get("keep_rates") or [params.get("keep_rate", 0.1)]
    families = params.get("families") or []
    out = [one(1.0, ("full",), 0, False)]
    for m in params.get("methods", ["specprefill"]):
        if m == "specprefill" and families:
            out += [one(r, (f, r), int(FAMILIES[f]["look_ahead"])) for f in families for r in rates]
        elif m == "specprefill":
            out += [one(r, (m, r)) for r in rates]
        else:
            out += [one(r, (m, r), 0, m in ("llmlingua", "self_info")) for r in rates]
    rate = params.get("baseline_keep_rate", 0.1)
    out += [one(rate, (m, rate), 0, m in ("llmlingua", "self_info")) for m in params.get("baselines") or []]
    return out + [one(r, (rule, r)) for rule in params.get("selection_rules") or [] for r in rates]


def _quality(params: dict, r: Rates, base: float, spec: float, done: set) -> float:
    """Prefill and decoding of every task x variant, but the units an earlier notebook of the run computes (`done`,
    updated: the store reads them back)."""
    tokens = step = spec_tokens = 0.0
    max_tokens = params.get("max_tokens", 16)
    # the questions of one document (`data.natural`) share it: with prefix caching each engine prefills it once
    shared = int(params.get("questions_per_document", 1)) if params.get("enable_prefix_caching") else 1
    for task, (n, length) in _n_prompts(params).items():
        limit = max_tokens.get(task, 16) if isinstance(max_tokens, dict) else int(max_tokens)
        todo = []
        for v in _variants(params):
            key = (task, n, length, limit, *v["unit"])
            if key not in done:
                done.add(key)
                todo.append(v)
        tokens += sum(n * length * (v["keep_rate"] if v["keep_rate"] < 1 else 1 / shared) for v in todo)
        step += len(todo) * limit
        passes = {v["look_ahead"] for v in todo if v["speculates"]}  # a speculator pass serves every keep rate
        spec_tokens += sum(n * length / (shared if la > 0 else 1) for la in passes)  # a baseline's scorer: no cache
        step += sum(n * max(0, la - 1) for la in passes) * spec / base
    return tokens * base / r.prefill + spec_tokens * spec / r.prefill + step * r.step * base


def _ttft(params: dict, r: Rates, base: float, spec: float) -> float:
    cells = max(1, len(params.get("families") or [])) * len(params.get("keep_rates", [0.1]))
    total = 0.0
    for length in params.get("lengths", [1024]):
        batch = max(1, int(params.get("token_budget") or length) // length)
        runs = int(params.get("warmup", 1)) + int(params.get("reps", 1))
        per_rate = [(length * (1 + k) * base + length * spec) / r.prefill for k in params.get("keep_rates", [0.1])]
        total += runs * batch * sum(per_rate) * cells / max(1, len(per_rate))
    return total


def _qps(params: dict, r: Rates) -> float:
    """Two servers, each through every category's rates: n requests at each rate, then half the category's timeout
    for the last to finish or miss (the cpu profile's QPS grid took 768 s on the AVX-512 EPYC on 2026-11-24; this
    gives 786 s there)."""
    n = int(params.get("n_requests", 6))
    sweep = sum(
        n / float(rate) + float(c.get("timeout_s", 10.0)) / 2 for c in params.get("categories", {}).values()
        for rate in c.get("rates", [])
    )  # fmt: skip
    return 2 * (r.server_start + sweep)


def _agreement(params: dict, r: Rates, base_name: str | None) -> float:
    prompts = sum(n * length for n, length in _n_prompts(params).values())
    models = [*params.get("speculators", []), base_name]
    scale = [size(m, base_name) for m in models]
    return sum(prompts * (s if s is not None else 1.0) / r.hf_prefill for s in scale)


def _board(params: dict, r: Rates, base_name: str | None) -> float:
    """Notebook 11: per pair (the notebook's, the GemFilter-style cut, each speculator) its start; every group's
    prompts through full prefill (the first pair), every entry at every keep rate and the pair's speculator passes
    (`_passes`), and decoding; then per length the TTFT unit: warm-up and repetitions of full prefill and of every
    cell's speculator pass and kept prefill (twice: in the method and alone)."""
    base, methods = size(base_name), list(params.get("methods", []))
    pairs = [(params.get("speculator"), [m for m in methods if m != "gemfilter"])]
    pairs += [(f"self:{int(params.get('gemfilter_layer', 0)) + 1}", ["gemfilter"])] if "gemfilter" in methods else []
    pairs += [(s, [s]) for s in params.get("speculators", [])]
    found = [size(s, base_name) for s, _ in pairs]
    sizes = [s for s in found if s is not None]
    if base is None or len(sizes) < len(found):
        raise ValueError("a model the registry does not hold")
    default = params.get("keep_rates", [0.1])
    limit, runs = (
        int(params.get("max_tokens", 16)),
        (int(params.get("ttft_reps", 1)) + 1) * int(params.get("ttft_prompts", 1)),
    )
    lengths: dict[int, set] = {}
    for g in params["groups"].values():
        lengths.setdefault(int(g["length"]), set()).update(g.get("keep_rates", default))
    total = 0.0
    for i, ((_, entries), spec) in enumerate(zip(pairs, sizes)):
        total += r.start
        for g in params["groups"].values():
            rates, tokens = g.get("keep_rates", default), g["length"] * g["n"] * len(g["tasks"])
            prefill = tokens * base * ((i == 0) + sum(rates) * len(entries)) + tokens * spec * _passes(
                entries, len(rates)
            )
            total += prefill / r.prefill + (len(entries) * len(rates) + (i == 0)) * limit * r.step * base
        for length, rates in lengths.items():
            select = sum(LLMLINGUA_PASSES if e == "llmlingua" else 1.0 for e in entries) * length * spec
            per = length * base + len(rates) * select + len(entries) * sum(2 * length * base * k for k in rates)
            total += runs * per / r.prefill
    return total


# LLMLingua's selection (its iterative compression, the speculator in float32 transformers) in speculator passes:
# 17.9 s against the pair's 2.61 s pass at 1,024 tokens (Qwen2.5-Coder 0.5B, 2-core EPYC, 2026-11-28; measurements.md)
LLMLINGUA_PASSES = 7.0


def _passes(entries: list[str], n_rates: int) -> float:
    """A pair's speculator passes over a group: one shared by its SpecPrefill entries (their scores serve every keep
    rate), `LLMLINGUA_PASSES` per keep rate for LLMLingua, one for self-information; none for RAG and the random or
    truncating baselines."""
    own = ("rag_bm25", "rag_dense", "random", "truncate_middle", "llmlingua2", "llmlingua", "self_info")
    shared = any(e not in own for e in entries)
    return int(shared) + n_rates * LLMLINGUA_PASSES * entries.count("llmlingua") + entries.count("self_info")


def seconds(
    name: str, params: dict, cpu_class: str, done: set | None = None, rates: Rates | None = None
) -> float | None:
    """Predicted seconds of notebook `name` with `params` (its profile's, merged) on `cpu_class`; `done`: the quality
    units earlier notebooks of the same run compute (shared across calls in run order). None where the model cannot
    tell: a model the registry does not hold, lm-eval tasks, the chat sections, the speculator choice, a class
    without rates, parameters the notebook itself will refuse. `rates`: this machine's, measured
    (`workbench.timing`), in place of the class's recorded ones."""
    r = rates or RATES.get(cpu_class)
    if r is not None and "groups" in params:  # the leaderboard
        try:
            return r.start + _board(params, r, params.get("base"))
        except (TypeError, ValueError, KeyError, AttributeError, ZeroDivisionError):
            return None
    if (
        r is None
        or params.get("lm_eval_tasks")
        or params.get("chat_conversations")
        or "speculators" in params
        and "scorer" not in params
    ):
        return None
    if name in NOTEBOOK_SECONDS:
        return NOTEBOOK_SECONDS[name] * r.start / RATES["amx"].start
    base_name = params.get("base")
    base, spec = size(base_name), size(params.get("speculator"), base_name)
    if base is None or spec is None:
        return None
    try:
        if "categories" in params:
            work = _qps(params, r)
        elif "lengths" in params:
            work = _ttft(params, r, base, spec)
        elif "scorer" in params:
            work = _agreement(params, r, base_name)
        elif "max_tokens" in params:
            work = _quality(params, r, base, spec, set() if done is None else done)
        else:
            return None
    except (TypeError, ValueError, KeyError, AttributeError, OverflowError, ZeroDivisionError):
        return None  # parameters the notebook refuses with its own one-line message, in its turn
    return r.start + work if math.isfinite(work) else None
