"""The leaderboard's runs: every method that shrinks a prompt before prefill, on the same prompts, at the same keep
rates: answers (scored against full prefill, paired) and time to the first token (selection included) side by side.

A board entry (`Entry`, one small dataclass each) is a selection method of `selectors.METHODS` with the SpecPrefill
knobs it runs under and the speculator it needs; `entries` spells a notebook's `methods` and `speculators` out:
  - "chunks": SpecPrefill as the paper ran it (the notebook's knobs, the original's fixed chunks);
  - a rule of `config.SELECTION_RULES` (e.g. "records+protect+query", this project's default selection);
  - "gemfilter": a GemFilter-style filter, the base's own early layer selects: the speculator is the base's first
    `gemfilter_layer + 1` layers (`self:K`), the last token's attention in that layer alone, averaged over its heads,
    keeps single tokens (no chunks, no pooling, no look-ahead) which the base receives re-numbered from 0, as
    GemFilter re-runs the kept tokens as a new prompt;
  - any other method of `selectors.METHODS` (RAG, LLMLingua-2 and their offline stand-ins, the random baseline);
  - each of `speculators` (another family, the same family, `self:K`, `calibrated:S`, `<model>:K`): SpecPrefill
    under `speculator_rule` with that speculator, labelled by it.
Entries that need another speculator run on their own pair (the same base), one pair after another.

TTFT (`ttft_unit`): per pair and prompt length, on the first `ttft_prompts` prompts of the length's first group,
alternating per repetition: full prefill, then for every entry and keep rate its selection from scratch followed by
the base on the kept tokens (one output token: `t_method`; SpecPrefill through the pair's own pipeline, as served;
`t_select` its selection's own part), and the base on those kept tokens alone (`t_kept`).
speedup = t_full / t_method; bound = t_full / (t_select + t_kept): notebook 04's Amdahl bound, what the method gets
without the orchestration between its steps. Memory: one more, untimed selection per cell. Prefix caching must be
off: a repeated full prefill would read its own cache.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

from specprefill import hardware
from specprefill.config import SELECTION_RULES, SpecPrefillConfig, is_keep_rate
from specprefill.engines.common import load_tokenizer
from specprefill.engines.vllm.pair import SpecPrefillLLM, greedy
from specprefill.errors import SpecPrefillError
from specprefill.models import resolve
from specprefill.selectors import METHODS, Selection, selector
from specprefill.workbench import bench, board, board_page, plots, quality, records, store
from specprefill.workbench.units import models_key, pair_context

GEMFILTER = "gemfilter"
# the notebook's leaderboard parameters, by name (`run` and `board_of` read them from one dict)
SETTINGS = (
    "groups", "keep_rates", "methods", "speculators", "speculator_rule", "gemfilter_layer", "max_tokens",
    "ttft_prompts", "ttft_reps", "data_dir",
)  # fmt: skip
CHUNKS = "chunks"


def settings_of(namespace: dict) -> dict:
    """The leaderboard parameters (`SETTINGS`) of a notebook's namespace or a params dict, by name."""
    missing = [name for name in SETTINGS if name not in namespace]
    if missing:
        raise SpecPrefillError(f"leaderboard parameters {missing} are missing: give each (notebook 11 lists them)")
    return {name: namespace[name] for name in SETTINGS}


@dataclass(frozen=True)
class Entry:
    """One row family of the board: `label` names it, `method` is a `selectors.METHODS` name, `overrides` are
    SpecPrefill knobs over the notebook's, `speculator` the pair it needs (None: the notebook's)."""

    label: str
    method: str
    overrides: dict = field(default_factory=dict)
    speculator: str | None = None

    def variant(self, keep_rate: float) -> dict:
        return {"method": self.method, "label": self.label, "keep_rate": keep_rate, **self.overrides}


def gemfilter_entry(layer: int) -> Entry:
    """The GemFilter-style filter at the base's layer `layer` (0-indexed): see the module's docstring."""
    if not isinstance(layer, int) or isinstance(layer, bool) or layer < 0:
        raise SpecPrefillError(
            f"gemfilter_layer {layer!r}: give the base's layer that selects, from 0 (GemFilter: ~0.4 x its layers)"
        )
    knobs = {"chunk_size": 0, "pool_kernel": 0, "look_ahead": 1, "score_heads": f"layers:{layer}-{layer}"}
    knobs |= {"layer_head_agg": "mean", "selection_unit": "chunks", "protect": False, "query_weight": 0.0}
    return Entry(GEMFILTER, "specprefill", {**knobs, "restore_positions": False}, speculator=f"self:{layer + 1}")


def entries(methods: list[str], speculators: list[str], speculator_rule: str, gemfilter_layer: int) -> list[Entry]:
    """The board's entries, full prefill first (one-line errors for a name that is none of the kinds above)."""
    if speculator_rule not in SELECTION_RULES:
        raise SpecPrefillError(f"speculator_rule {speculator_rule!r}: use one of {', '.join(SELECTION_RULES)}")
    out = [Entry("full", "full")]
    for name in methods:
        if name == CHUNKS or name in SELECTION_RULES:
            out.append(Entry(name, "specprefill", dict(SELECTION_RULES[CHUNKS if name == CHUNKS else name])))
        elif name == GEMFILTER:
            out.append(gemfilter_entry(gemfilter_layer))
        elif name in METHODS and name not in ("full", "specprefill"):
            out.append(Entry(name, name))
        else:
            known = [CHUNKS, *SELECTION_RULES, GEMFILTER, *(m for m in METHODS if m not in ("full", "specprefill"))]
            raise SpecPrefillError(f"leaderboard method {name!r} is unknown: use {', '.join(dict.fromkeys(known))}")
    rule = SELECTION_RULES[speculator_rule]
    out += [Entry(s, "specprefill", dict(rule), speculator=s) for s in speculators]
    labels = [e.label for e in out]
    twice = sorted({x for x in labels if labels.count(x) > 1})
    if twice:
        raise SpecPrefillError(f"leaderboard entries {twice} are listed twice: list each method or speculator once")
    for e in out:
        selector(e.method).check()  # a method that cannot run here: one line, before any model is built
    return out


def by_pair(board: list[Entry], default: str) -> dict[str, list[Entry]]:
    """Entries grouped by the speculator their pair needs, the notebook's first (it runs full prefill)."""
    pairs: dict[str, list[Entry]] = {default: []}
    for e in board:
        pairs.setdefault(e.speculator or default, []).append(e)
    return pairs


def check_groups(groups: dict, keep_rates: list[float], max_model_len: int | None = None, answer: int = 0) -> dict:
    """{name: {tasks, length, n, keep_rates (default: the board's)}} checked (known tasks; with `max_model_len`,
    room for the longest prompt and its `answer` tokens): one line naming the group and the fix otherwise."""
    if not isinstance(groups, dict) or not groups:
        raise SpecPrefillError("groups is empty: give {name: {tasks: [...], length: L, n: N}} for each task group")
    out = {}
    for name, g in groups.items():
        if not isinstance(g, dict) or not g.get("tasks") or not isinstance(g.get("tasks"), list):
            raise SpecPrefillError(f"group {name!r}: give its tasks as a list ({{tasks: [...], length: L, n: N}})")
        length, n, rates = g.get("length"), g.get("n"), g.get("keep_rates", keep_rates)
        if not isinstance(length, int) or length < 128 or not isinstance(n, int) or n < 1:
            raise SpecPrefillError(f"group {name!r}: length (>= 128 tokens) and n (>= 1 prompts) are whole numbers")
        if not rates or not all(is_keep_rate(r) for r in rates):
            raise SpecPrefillError(f"group {name!r}: keep_rates {rates!r} must be numbers in (0, 1]")
        records.check_tasks(g["tasks"])
        if max_model_len is not None and length + answer > max_model_len:
            raise SpecPrefillError(
                f"group {name!r}: {length} prompt tokens and {answer} answer tokens exceed max_model_len "
                f"{max_model_len}: raise max_model_len to {length + answer} or shorten the group"
            )
        out[name] = {"tasks": list(g["tasks"]), "length": length, "n": n, "keep_rates": [float(r) for r in rates]}
    return out


def group_records(tokenizer, groups: dict[str, dict], seed: int, data_dir: str | None = None) -> dict[str, dict]:
    """Each group's records by task (`records.task_records`)."""
    return {
        name: records.task_records(tokenizer, g["tasks"], g["length"], g["n"], seed, data_dir=data_dir)
        for name, g in groups.items()
    }


def run_pair(llm, pair_entries, groups, by_group, output_dir, max_tokens, config, seed, ttft) -> tuple:
    """One pair's quality rows (every group, entry, the group's keep rates) and TTFT rows (one unit per length)."""
    rows = []
    for group, recs in by_group.items():
        variants = _variants(pair_entries, groups[group]["keep_rates"])
        got = quality.quality(llm, recs, variants, output_dir, max_tokens, kind="board", base_config=config, seed=seed)
        rows += [{**r, "group": group} for r in got]
    timed = []
    for length, (recs, rates) in ttft["prompts"].items():
        prompts = [llm.tokenizer(r["input"])["input_ids"] for r in recs]
        timed += ttft_unit(llm, pair_entries, rates, prompts, length, output_dir, config, ttft["reps"])
    return rows, timed


def _variants(pair_entries: list[Entry], keep_rates: list[float]) -> list[dict]:
    """Every entry at every keep rate, full prefill once (at 1.0)."""
    out = [e.variant(1.0) for e in pair_entries if e.method == "full"]
    return out + [e.variant(r) for e in pair_entries if e.method != "full" for r in keep_rates]


def ttft_prompts(by_group: dict, groups: dict[str, dict], count: int) -> dict[int, tuple[list[dict], list[float]]]:
    """Per prompt length: the first `count` records of the first group at that length (its first task's), and the
    keep rates of every group at that length."""
    out: dict[int, tuple[list[dict], list[float]]] = {}
    for name, g in groups.items():
        recs, rates = out.get(g["length"], (next(iter(by_group[name].values()))[:count], []))
        out[g["length"]] = (recs, sorted(set(rates) | set(g["keep_rates"])))
    return out


def records_of(engine, settings: dict, seed: int = 0) -> dict[str, dict[str, list[dict]]]:
    """Every group's prompts by task, in the base's tokens (every pair reads the same ones)."""
    groups = check_groups(settings["groups"], settings["keep_rates"])
    return group_records(load_tokenizer(resolve(engine.base)), groups, seed, settings.get("data_dir"))


def run(engine, config: SpecPrefillConfig, settings: dict, by_group: dict, output_dir, seed: int = 0) -> tuple:
    """Every pair in turn (the notebook's first), each shut down before the next: (quality rows with their group,
    TTFT rows). `settings`: the notebook's leaderboard parameters (`SETTINGS`); `by_group`: `records_of`'s."""
    if engine.enable_prefix_caching:
        raise SpecPrefillError("the board's TTFT would read cached prefills: set enable_prefix_caching = False")
    groups = check_groups(settings["groups"], settings["keep_rates"], engine.max_model_len, settings["max_tokens"])
    board_entries = entries(settings["methods"], settings["speculators"], settings["speculator_rule"],
                            settings["gemfilter_layer"])  # fmt: skip
    ttft = {"prompts": ttft_prompts(by_group, groups, settings["ttft_prompts"]), "reps": settings["ttft_reps"]}
    quality_rows, ttft_rows = [], []
    for speculator, pair_entries in by_pair(board_entries, engine.speculator).items():
        llm = SpecPrefillLLM.from_params(dataclasses.replace(engine, speculator=speculator), config)
        try:
            got = run_pair(llm, pair_entries, groups, by_group, output_dir,
                           settings["max_tokens"], config, seed, ttft)  # fmt: skip
        finally:
            llm.shutdown()
        quality_rows += got[0]
        ttft_rows += got[1]
    return quality_rows, ttft_rows


# engine parameters that size a run to its machine (cores, GPUs, memory): a board's key leaves them to the machine
MACHINE_FIELDS = (
    "tensor_parallel_size", "speculator_tensor_parallel_size", "gpu_memory_utilization",
    "speculator_gpu_memory_utilization", "kv_cache_memory_bytes", "speculator_kv_cache_memory_bytes", "kv_sequences",
)  # fmt: skip


def publish(engine, config, settings: dict, seed: int, by_group: dict, rows: tuple[list, list], output_dir) -> dict:
    """This run's board (`workbench.board`) saved with its page and frontier figure: its key (code, models with
    their fingerprints, the engine parameters but those sizing the machine, the settings with the knobs and seed,
    a digest of every prompt), this machine, its rows (each method's model pair named). `rows`: `run`'s."""
    from specprefill import models  # lazy: the registry reads packages only when a board is published

    board_entries = entries(settings["methods"], settings["speculators"], settings["speculator_rule"],
                            settings["gemfilter_layer"])  # fmt: skip
    pairs = {e.label: "" if e.method == "full" else f"{e.speculator or engine.speculator} \u2192 {engine.base}"
             for e in board_entries}  # fmt: skip
    dtype = hardware.resolve_dtype(engine.dtype)
    machine = store.machine_identity()
    label = board.machine_label(machine, dtype)
    own = {k: v for k, v in dataclasses.asdict(engine).items() if k not in MACHINE_FIELDS}
    fingerprints = {
        "base_fingerprint": models.fingerprint(resolve(engine.base)),
        "speculator_fingerprint": models.fingerprint(models.resolve_speculator(engine.speculator, engine.base)),
    }
    quality_rows, ttft_rows = rows
    result: dict = {
        "key": board.key(
            {**{k: v for k, v in settings.items() if k != "data_dir"}, "config": config.to_dict(), "seed": seed},
            store.digest(by_group),
            own,
            fingerprints,
        ),
        "machines": {label: {**machine, "dtype": dtype}},
        "rows": board.rows(
            quality_rows, ttft_rows, check_groups(settings["groups"], settings["keep_rates"]), pairs, label
        ),
    }
    board.save(result, output_dir)
    board_page.render(result, Path(output_dir) / "leaderboard.html")
    plots.board_frontier(result["rows"], Path(output_dir) / "board_frontier.png")
    return result


def _host_peak_reset() -> int | None:
    """Resets this process's peak resident memory (Linux `clear_refs`); returns the resident bytes now."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return _status_kib("VmRSS") * 1024
    except OSError:
        return None


def _status_kib(field_name: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field_name + ":"):
            return int(line.split()[1])
    raise OSError(field_name)


def select_and_prefill(llm, method: str, prompts: list[list[int]], config: SpecPrefillConfig, params, clock) -> tuple:
    """One method's time to the first token: SpecPrefill (any rule or speculator) through the pair's own pipeline
    (`SpecPrefillLLM.generate`, as served), any other method selecting from scratch (`selectors.Selection`) and then
    the base on the kept tokens. Returns (kept indices per prompt (None: whole), the selection's own seconds)."""
    if method == "specprefill":
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, config=config, use_tqdm=False)
        parts = llm.speculator.last_timings
        kept = [o.specprefill.kept_indices if o.specprefill is not None else None for o in outs]
        return kept, parts.get("speculator_s", 0.0) + parts.get("scoring_s", 0.0)
    t0 = clock()
    kept = Selection(llm, prompts).kept(method, config)
    selecting = clock() - t0
    llm.generate_kept(prompts, kept, params, restore_positions=config.restore_positions)
    return kept, selecting


def selection_memory(llm, method: str, prompts: list[list[int]], config: SpecPrefillConfig) -> dict:
    """One untimed selection's memory: the speculator engine's speculation bytes at their peak, and this process's
    resident growth at its peak (selections that run here: RAG, LLMLingua, the baselines), in MiB."""
    llm.speculator.peak_extra_bytes(reset=True)
    before = _host_peak_reset()
    Selection(llm, prompts).kept(method, config)
    host = _status_kib("VmHWM") * 1024 - before if before is not None else None
    spec = max(llm.speculator.peak_extra_bytes())
    return {"spec_peak_mib": round(spec / 2**20, 1), "host_peak_mib": None if host is None else round(host / 2**20, 1)}


def timed_cells(llm, pair_entries, keep_rates, prompts, config, reps, clock=time.perf_counter) -> list[dict]:
    """The measurements of the module's docstring, medians over `reps` after one unrecorded warm-up, then each
    cell's memory in one more, untimed selection; with full prefill among the entries, its own row (1x)."""
    one = greedy(1)
    cells = [(e, r) for e in pair_entries if e.method != "full" for r in keep_rates]
    kept: dict[tuple, list] = {}
    selecting: dict[tuple, list[float]] = {}

    def knobs(e, rate):
        return config.replace(**{**e.overrides, "keep_rate": rate})

    def method(e, rate):
        def fn(rep):
            kept[(e.label, rate)], s = select_and_prefill(llm, e.method, prompts, knobs(e, rate), one, clock)
            if rep >= 0:  # the warm-up is not recorded
                selecting.setdefault((e.label, rate), []).append(s)

        return fn

    def base_kept(e, rate):
        restore = knobs(e, rate).restore_positions
        return lambda rep: llm.generate_kept(prompts, kept[(e.label, rate)], one, restore_positions=restore)

    tasks = {"full": lambda rep: llm.generate_kept(prompts, [None] * len(prompts), one)}
    for e, r in cells:
        tasks[f"m:{e.label}@{r}"] = method(e, r)
        tasks[f"k:{e.label}@{r}"] = base_kept(e, r)
    t = {k: statistics.median(v) for k, v in bench.alternate(tasks, reps, clock).items()}
    rows = [
        {
            "label": "full",
            "keep_rate": 1.0,
            "t_full_s": t["full"],
            "t_method_s": t["full"],
            "t_select_s": 0.0,
            "t_kept_s": t["full"],
            "speedup": 1.0,
            "bound": 1.0,
            "spec_peak_mib": 0.0,
            "host_peak_mib": 0.0,
        }
    ]
    for e, r in cells:
        m, k, sel = t[f"m:{e.label}@{r}"], t[f"k:{e.label}@{r}"], statistics.median(selecting[(e.label, r)])
        rows.append(
            {
                "label": e.label,
                "keep_rate": r,
                "t_full_s": t["full"],
                "t_method_s": m,
                "t_select_s": sel,
                "t_kept_s": k,
                "speedup": t["full"] / m,
                "bound": t["full"] / (sel + k),
                **selection_memory(llm, e.method, prompts, knobs(e, r)),
            }
        )
    return rows if any(e.method == "full" for e in pair_entries) else rows[1:]  # fmt: skip


def ttft_unit(llm, pair_entries, keep_rates, prompts, length, output_dir, config, reps) -> list[dict]:
    """`timed_cells` as one resumable unit per pair and length, keyed by the entries, prompts and models; computed
    alone (`store.run_units`: never in a job of a sharded run, where other jobs share the machine)."""
    spec = {
        "entries": [dataclasses.asdict(e) for e in pair_entries],
        "keep_rates": list(keep_rates),
        "prompts": store.digest(prompts),
        "length": length,
        "reps": reps,
        **config.to_dict(),
        **models_key(llm),
    }
    got = store.run_unit(
        output_dir,
        "board_ttft",
        spec,
        lambda: timed_cells(llm, pair_entries, keep_rates, prompts, config, reps),
        context=pair_context(llm),
        alone=True,
    )
    return [{**r, "length": length, "prompts": len(prompts), "reps": reps} for r in got]
