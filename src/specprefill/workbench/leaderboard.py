"""The leaderboard's runs: every method that shrinks a prompt before prefill, on the same prompts, at the same keep
rates: answers (scored against full prefill, paired) and time to the first token (selection included) side by side.

A board entry (`board.Entry`, one small dataclass each) is a selection method of `selectors.METHODS` with the
SpecPrefill knobs it runs under and the speculator it needs; `board.entries` spells a notebook's `methods` and
`speculators` out:
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
from pathlib import Path

from specprefill import hardware
from specprefill.config import SpecPrefillConfig
from specprefill.engines.common import load_tokenizer
from specprefill.engines.vllm.pair import SpecPrefillLLM, greedy
from specprefill.errors import SpecPrefillError
from specprefill.models import resolve
from specprefill.selectors import Selection
from specprefill.workbench import bench, board, board_page, plots, quality, records, store
from specprefill.workbench.units import models_key, pair_context


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


def _variants(pair_entries: list[board.Entry], keep_rates: list[float]) -> list[dict]:
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
    groups = board.check_groups(settings["groups"], settings["keep_rates"])
    return group_records(load_tokenizer(resolve(engine.base)), groups, seed, settings.get("data_dir"))


def run(engine, config: SpecPrefillConfig, settings: dict, by_group: dict, output_dir, seed: int = 0) -> tuple:
    """Every pair in turn (the notebook's first), each shut down before the next: (quality rows with their group,
    TTFT rows). `settings`: the notebook's leaderboard parameters (`board.SETTINGS`); `by_group`: `records_of`'s."""
    if engine.enable_prefix_caching:
        raise SpecPrefillError("the board's TTFT would read cached prefills: set enable_prefix_caching = False")
    groups = board.check_groups(
        settings["groups"], settings["keep_rates"], engine.max_model_len, settings["max_tokens"]
    )
    board_entries = board.entries(settings["methods"], settings["speculators"], settings["speculator_rule"],
                            settings["gemfilter_layer"])  # fmt: skip
    ttft = {"prompts": ttft_prompts(by_group, groups, settings["ttft_prompts"]), "reps": settings["ttft_reps"]}
    quality_rows, ttft_rows = [], []
    for speculator, pair_entries in board.by_pair(board_entries, engine.speculator).items():
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
    a digest of each group's prompts), this machine, its rows (each method's model pair named). `rows`: `run`'s."""
    from specprefill import models  # lazy: the registry reads packages only when a board is published

    board_entries = board.entries(settings["methods"], settings["speculators"], settings["speculator_rule"],
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
            {name: store.digest(recs) for name, recs in by_group.items()},
            own,
            fingerprints,
        ),
        "machines": {label: {**machine, "dtype": dtype}},
        "rows": board.rows(
            quality_rows, ttft_rows, board.check_groups(settings["groups"], settings["keep_rates"]), pairs, label
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
