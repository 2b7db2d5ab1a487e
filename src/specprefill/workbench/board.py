"""The leaderboard's definition and tidy rows. Its entries (`Entry`, one small dataclass per method; `entries`
spells a notebook's `methods` and `speculators` out, `workbench.leaderboard` describes each kind) and task groups
(`check_groups`), checked before any model starts. Its rows: one per machine, task group, method and keep rate,
with the answers' score and its 95% interval, the paired difference to full prefill on the same prompts and its
verdict, the TTFT speedup (selection included) and its bound, and the selection's peak memory. A board is keyed by
what makes its rows comparable: the code version, the models (names and fingerprints), the engine parameters as set
(dtype among them; not those that size a run to its machine), the settings (groups, lengths, n, keep rates,
methods, knobs, seed) and a digest of each group's prompts; `merge` joins boards whose keys agree, from any machines
(a CPU run, a sharded cluster run, a GPU run) and of any of the groups (a slow machine may run some), and refuses the
rest naming the field that differs. Under dtype "auto" each
machine picks its own dtype: the machine's label carries it."""

from __future__ import annotations

import copy
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from specprefill.atomic import write_text
from specprefill.config import SELECTION_RULES, is_keep_rate
from specprefill.errors import SpecPrefillError
from specprefill.selectors import METHODS, selector
from specprefill.workbench import records, stats, store

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


KEY = ("code", "models", "engine", "settings", "records")  # what two boards must share to merge
BOARD_FILE = "board.json"
COLUMNS = (
    "machine", "group", "length", "method", "pair", "keep_rate", "accuracy", "acc_low", "acc_high", "n",
    "diff_vs_full", "diff_low", "diff_high", "verdict", "kept_fraction", "speedup", "bound", "t_full_s",
    "t_method_s", "t_select_s", "t_kept_s", "spec_peak_mib", "host_peak_mib",
)  # fmt: skip
TIMED = ("speedup", "bound", "t_full_s", "t_method_s", "t_select_s", "t_kept_s", "spec_peak_mib", "host_peak_mib")


def machine_label(machine: dict, dtype: str) -> str:
    """A machine as the page's filter names it: CPU (or GPU) model, the CPU class kernels dispatch on, dtype, cores."""
    from specprefill.workbench import eta  # lazy: reads hardware

    if machine.get("gpu"):
        return f"{machine['gpus']}x {machine['gpu']} ({dtype})"
    return f"{machine.get('cpu_model') or 'CPU'} ({eta.cpu_class(machine.get('cpu_flags') or [])}, {dtype}, " \
           f"{machine.get('cpus') or '?'} cores)"  # fmt: skip


def key(settings: dict, records: dict, engine: dict, fingerprints: dict) -> dict:
    """A board's key (`KEY`): this code, the models (names as set, fingerprints of what was loaded), the engine
    parameters as set (dtype among them), the settings, a digest of each group's prompts ({group: digest})."""
    return {
        "code": store.code_version(),
        "models": {"base": engine.get("base"), "speculator": engine.get("speculator"), **fingerprints},
        "engine": engine,
        "settings": settings,
        "records": records,
    }


def _clean(value):
    return None if isinstance(value, float) and math.isnan(value) else value


def rows(quality_rows: list[dict], ttft_rows: list[dict], groups: dict, pairs: dict[str, str], machine: str) -> list:
    """The board's rows of one run: each group's rows pooled over its tasks (a prompt named by task and index),
    summarized against full prefill (`stats.summarize`), joined with the TTFT of the method at the group's length
    (full prefill: 1x). `pairs`: each label's model pair."""
    pooled = [{**r, "task": r["group"], "index": f"{r['task']}:{r['index']}"} for r in quality_rows]
    summary = stats.summarize(pooled).to_dict("records")
    timed = {(t["length"], t["label"], float(t["keep_rate"])): t for t in ttft_rows}
    full_score = {s["task"]: s["score"] for s in summary if s["label"] == "full"}
    out = []
    for s in summary:
        length = groups[s["task"]]["length"]
        t = timed.get((length, s["label"], float(s["keep_rate"])), {})
        full = s["label"] == "full"
        out.append(
            {
                "machine": machine,
                "group": s["task"],
                "length": length,
                "method": s["label"],
                "pair": pairs.get(s["label"], ""),
                "keep_rate": s["keep_rate"],
                "accuracy": s["score"],
                "acc_low": s["ci_low"],
                "acc_high": s["ci_high"],
                "n": s["n"],
                "diff_vs_full": s.get("diff_vs_full"),
                "diff_low": s.get("diff_low"),
                "diff_high": s.get("diff_high"),
                "verdict": "reference" if full else _judged(s.get("verdict"), full_score.get(s["task"])),
                "kept_fraction": s.get("kept_fraction"),
                **{k: t.get(k) for k in TIMED},
            }  # fmt: skip
        )
    return [{k: _clean(v) for k, v in r.items()} for r in out]


def _judged(verdict, full_score) -> str | None:
    """A cell's verdict under the one floor (`stats.FLOOR`): where full prefill scores below it, not judged."""
    if full_score is not None and not math.isnan(full_score) and full_score < stats.FLOOR:
        return f"{stats.BELOW_FLOOR} ({full_score:.0f} < {stats.FLOOR:g})"
    return verdict


def save(board: dict, output_dir) -> Path:
    """board.json (key, machines, rows) and board.csv beside it, each written whole."""
    out = Path(output_dir)
    write_text(out / "board.csv", pd.DataFrame(board["rows"], columns=list(COLUMNS)).to_csv(index=False))
    return write_text(out / BOARD_FILE, json.dumps(board, indent=1, default=str))


def load(path) -> dict:
    """A board.json (or the folder holding one), checked for its parts."""
    p = Path(path)
    p = p / BOARD_FILE if p.is_dir() else p
    try:
        board = json.loads(p.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise SpecPrefillError(
            f"{p}: not a leaderboard ({exc}): give a board.json that a leaderboard run wrote"
        ) from exc
    if (
        not isinstance(board, dict)
        or not {"key", "rows", "machines"} <= set(board)
        or not isinstance(board["key"], dict)
    ):
        raise SpecPrefillError(f"{p}: not a leaderboard (no key, rows and machines): give a leaderboard run's board")
    if not isinstance(board["key"].get("records"), dict):  # one digest of every prompt: written before 44703ff
        raise SpecPrefillError(f"{p}: a board of an older version (no prompt digest per group): run it again")
    return board


def _shared(k: dict) -> dict:
    """A key less what a board holds per task group (each group's definition and the digest of its prompts)."""
    return {**k, "settings": {s: v for s, v in k["settings"].items() if s != "groups"}, "records": None}


def merge(boards: list[dict], names: list[str] | None = None) -> dict:
    """One board of several runs' rows; refused, naming the field, when two keys differ in anything but the machine
    and the task groups run (a run may hold some of the groups: one group in two runs must be defined alike and ask
    the same prompts), or when one machine's rows of a group come twice."""
    if not boards:
        raise SpecPrefillError("nothing to merge: give two or more board.json files")
    names = names or [f"board {i + 1}" for i in range(len(boards))]
    key = copy.deepcopy(boards[0]["key"])
    groups, prompts = key["settings"]["groups"], key["records"]
    origin = dict.fromkeys(groups, names[0])  # the board each group was first read from
    for name, b in zip(names[1:], boards[1:]):
        _refuse(name, names[0], _first_difference(_shared(b["key"]), _shared(key), KEY))  # before reading its groups
        for g, definition in b["key"]["settings"]["groups"].items():
            theirs = {g: b["key"]["records"].get(g)}
            if g in groups:
                _refuse(name, origin[g], _first_difference({g: definition}, groups, (g,), "settings.groups."))
                _refuse(name, origin[g], _first_difference(theirs, prompts, (g,), "records."))
            groups.setdefault(g, definition)
            prompts.setdefault(g, theirs[g])
            origin.setdefault(g, name)
    seen: dict[tuple, str] = {}
    for name, b in zip(names, boards):
        for m, g in dict.fromkeys((r["machine"], r["group"]) for r in b["rows"]):
            if (m, g) in seen:
                raise SpecPrefillError(
                    f"{name} repeats the rows of {m} in group {g!r} (as {seen[(m, g)]}): give each machine's rows "
                    "of a group once"
                )
            seen[(m, g)] = name
    machines = {m: info for b in boards for m, info in b["machines"].items()}
    return {"key": key, "machines": machines, "rows": [r for b in boards for r in b["rows"]]}


def _refuse(name: str, against: str, diff: tuple | None) -> None:
    if diff:
        raise SpecPrefillError(
            f"{name} differs from {against} in {diff[0]} ({diff[1]!r} vs {diff[2]!r}): merge only runs of the "
            "same code, models, engine parameters, settings and prompts (the machine and the groups run may differ)"
        )


def _first_difference(a: dict, b: dict, fields, prefix: str = "") -> tuple | None:
    """The first field (dotted, into nested settings) where two keys differ, with both values; None if none."""
    for f in fields:
        x, y = a.get(f), b.get(f)
        if isinstance(x, dict) and isinstance(y, dict):
            inner = _first_difference(x, y, sorted(set(x) | set(y)), f"{prefix}{f}.")
            if inner:
                return inner
        elif x != y:
            return f"{prefix}{f}", x, y
    return None


def best(board_rows: list[dict], group: str, machine: str | None = None) -> dict | None:
    """The fastest cell of `group` whose answers show no difference from full prefill (None: no such cell)."""
    ok = [
        r for r in board_rows
        if r["group"] == group and r["verdict"] == "no difference found" and r.get("speedup") is not None
        and (machine is None or r["machine"] == machine)
    ]  # fmt: skip
    return max(ok, key=lambda r: r["speedup"]) if ok else None
