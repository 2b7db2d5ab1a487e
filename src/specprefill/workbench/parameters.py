"""A profile's notebooks and their parameters: the params folders (`params/<profile>/<name>.yaml` over the profile's
shared `_profile.yaml`), each notebook's tagged parameters cell (its engine and knob lines generated from the
dataclasses, kept in sync), and the checks of a notebook's parameters before anything runs (`validate_params`, the
memory plan of `--prepare-only --gpu-memory-gib`).
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import json
import sys
from pathlib import Path

import yaml

from specprefill import flags, models, selectors
from specprefill.atomic import write_text
from specprefill.config import EngineParams, SpecPrefillConfig
from specprefill.data import userprompts
from specprefill.engines.vllm import checks, gpu_plan, planning
from specprefill.errors import SpecPrefillError
from specprefill.workbench import harness

SHARED = "_profile"  # params/<profile>/_profile.yaml: keys every notebook of the profile shares


EXECUTOR = "executor"  # ... and under this key where `reproduce` computes its units (`settings.ExecutorSettings`)


SKIP = "skip"  # ... and under this key the notebooks the profile leaves to another, each with its reason


UNITS_TAG = "units"  # the code cells that compute a notebook's units: a sharded run's jobs execute up to them


def notebooks(root: Path) -> list[str]:
    return sorted(p.stem for p in (root / "notebooks").glob("*.ipynb"))


def profiles(root: Path) -> list[str]:
    return sorted(p.name for p in (root / "params").iterdir() if p.is_dir())


def parameters_cell(path: Path) -> dict:
    """Names and literal values assigned in the notebook's cell tagged `parameters` (must be the first code cell)."""
    cells = [c for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code"]
    if not cells or "parameters" not in cells[0].get("metadata", {}).get("tags", []):
        raise SpecPrefillError(f"{path}: the first code cell must be tagged `parameters`")
    tree = ast.parse("".join(cells[0]["source"]))
    return {
        t.id: ast.literal_eval(node.value)
        for node in tree.body
        if isinstance(node, ast.Assign)
        for t in node.targets
        if isinstance(t, ast.Name)
    }


# fields whose value is an experiment's own choice: the parameters cell keeps its value instead of the field default
OWN_VALUES = ("speculator", "base", "max_model_len", "seed", "keep_rate")


GENERATED = ("# SpecPrefill knobs (generated from SpecPrefillConfig)", "# engines (generated from EngineParams)")


# a notebook that sweeps a knob has the sweep in its parameters cell, not the knob: one value to set, never two
SWEPT = {"keep_rates": "keep_rate"}


def parameters_source(source: str, classes: tuple[type, ...] = (SpecPrefillConfig, EngineParams)) -> str:
    """A parameters cell with one line per field of `classes` (`flags.parameters_lines`) but a knob the cell sweeps
    (`SWEPT`): the cell's own lines stay where they are, the generated blocks go where the first field line was,
    fields in `OWN_VALUES` keep the cell's value. Engine notebooks' cells are kept in this form (`sync_parameters`,
    checked by the tests)."""
    names = {f.name for cls in classes for f in dataclasses.fields(cls)}
    values = {
        t.id: ast.get_source_segment(source, node.value)
        for node in ast.parse(source).body
        if isinstance(node, ast.Assign)
        for t in node.targets
        if isinstance(t, ast.Name)
    }
    swept = {knob for sweep, knob in SWEPT.items() if sweep in values}
    out: list[str] = []
    at = None
    for line in source.splitlines():
        name = line.split("=", 1)[0].strip() if "=" in line else None
        if name in names or line in GENERATED:
            at = len(out) if at is None else at
            continue
        out.append(line)
    blocks = []
    for cls in classes:
        title = GENERATED[cls is EngineParams]
        blocks.append(title)
        for line in flags.parameters_lines(cls):
            name = line.split(" = ", 1)[0]
            if name in swept:
                continue
            if name in OWN_VALUES and name in values:
                line = f"{name} = {values[name]}" + (f"  #{line.split('  #', 1)[1]}" if "  #" in line else "")
            blocks.append(line)
    at = len(out) if at is None else at
    return "\n".join(out[:at] + blocks + out[at:]) + "\n"


def generated_classes(cell: dict) -> tuple[type, ...]:
    """What a notebook's parameters cell holds every field of: the knobs where it has any, the engine parameters
    where it builds vLLM engines (it names tensor_parallel_size)."""
    knobs = any(f.name in cell for f in dataclasses.fields(SpecPrefillConfig))
    return ((SpecPrefillConfig,) if knobs else ()) + ((EngineParams,) if "tensor_parallel_size" in cell else ())


def sync_parameters(path: Path) -> bool:
    """Rewrite a notebook's parameters cell to `parameters_source` (`generated_classes`); True when it changed."""
    nb = json.loads(path.read_text())
    cell = next(c for c in nb["cells"] if c["cell_type"] == "code")
    old = "".join(cell["source"])
    classes = generated_classes(parameters_cell(path))
    new = parameters_source(old, classes) if classes else old
    if new == old:
        return False
    cell["source"] = new.splitlines(keepends=True)
    write_text(path, json.dumps(nb, indent=1, ensure_ascii=False) + "\n")
    return True


def _yaml(path: Path, root: Path) -> dict:
    data = yaml.safe_load(path.read_text()) or {}
    if not isinstance(data, dict):
        raise SpecPrefillError(f"{path.relative_to(root)}: expected a mapping of parameter names to values")
    return data


def shared_params(root: Path, profile: str) -> dict:
    """The profile's shared keys (empty without a _profile.yaml); each must be a parameter of some notebook."""
    path = root / "params" / profile / f"{SHARED}.yaml"
    if not path.exists():
        return {}
    shared = {k: v for k, v in _yaml(path, root).items() if k not in (EXECUTOR, SKIP)}
    known = set().union(*(parameters_cell(root / "notebooks" / f"{n}.ipynb") for n in notebooks(root)))
    unknown = sorted(set(shared) - known)
    if unknown:
        raise SpecPrefillError(f"{path.relative_to(root)}: keys {unknown} are no notebook's parameter: remove them")
    return shared


def executor_block(root: Path, profile: str) -> dict:
    """The `executor:` block of the profile's _profile.yaml ({} without one)."""
    path = root / "params" / profile / f"{SHARED}.yaml"
    block = _yaml(path, root).get(EXECUTOR) if path.exists() else None
    if block is not None and not isinstance(block, dict):
        raise SpecPrefillError(f"{path.relative_to(root)}: executor: is a mapping (executor: {{partition: gpu}})")
    return block or {}


def skipped(root: Path, profile: str) -> dict[str, str]:
    """The `skip:` block of the profile's _profile.yaml: {notebook: why a run of the profile leaves it out}."""
    path = root / "params" / profile / f"{SHARED}.yaml"
    block = _yaml(path, root).get(SKIP) if path.exists() else None
    if block is not None and not (isinstance(block, dict) and all(isinstance(v, str) for v in block.values())):
        raise SpecPrefillError(f"{path.relative_to(root)}: skip: maps notebooks to a reason ({{10_x: in cpu-large}})")
    unknown = sorted(set(block or {}) - set(notebooks(root)))
    if unknown:
        raise SpecPrefillError(f"{path.relative_to(root)}: skip: {unknown} are no notebooks: use names from notebooks/")
    return dict(block or {})


def run_names(root: Path, profile: str, only: list[str] | None) -> list[str]:
    """The notebooks a run of the profile executes: `only` as asked (a skipped one too: named), else every notebook
    but the profile's `skip:` ones."""
    return list(only) if only else [n for n in notebooks(root) if n not in skipped(root, profile)]


def units_cells(path: Path) -> list[int]:
    """Indices (among all cells) of the notebook's cells tagged `units`: those that compute its units of work."""
    nb = json.loads(path.read_text())
    return [i for i, c in enumerate(nb["cells"]) if UNITS_TAG in c.get("metadata", {}).get("tags", [])]


def load_params(root: Path, profile: str, name: str) -> dict:
    """The notebook's parameters for a profile: the shared keys it has, overridden by its own file."""
    path = root / "params" / profile / f"{name}.yaml"
    if not path.exists():
        raise SpecPrefillError(
            f"profile {profile!r} has no {path.relative_to(root)}: add it (copy params/cpu/{name}.yaml)"
        )
    own = _yaml(path, root)
    allowed = parameters_cell(root / "notebooks" / f"{name}.ipynb")
    unknown = sorted(set(own) - set(allowed))
    swept = [f"{knob} (this notebook sweeps {sweep}: set that)" for sweep, knob in SWEPT.items() if knob in unknown]
    if swept:
        raise SpecPrefillError(f"{path.relative_to(root)}: {', '.join(swept)}")
    if unknown:
        raise SpecPrefillError(f"{path.relative_to(root)}: keys {unknown} are not in the notebook's parameters cell")
    return {**{k: v for k, v in shared_params(root, profile).items() if k in allowed}, **own}


def validate_params(root: Path, name: str, params: dict) -> list[str]:
    """What --prepare-only checks beyond papermill's injection: the SpecPrefill knobs, for notebooks that build
    vLLM engines every engine parameter (model names, sizes, vLLM argument names), and lm-eval task names, all without
    loading a model or data. Returns the notebook's lm-eval tasks."""
    merged = {**parameters_cell(root / "notebooks" / f"{name}.ipynb"), **params}
    knobs = {k: merged[k] for k in ("look_ahead", "chunk_size", "pool_kernel") if k in merged}
    rates = [merged[k] for k in ("keep_rate", "baseline_keep_rate") if k in merged] + list(merged.get("keep_rates", []))
    for rate in rates or [SpecPrefillConfig().keep_rate]:
        SpecPrefillConfig(keep_rate=rate, **knobs)
    if "tensor_parallel_size" in merged:
        checks.validate(EngineParams.pick(merged))
        for name in merged.get("speculators") or []:  # the speculators a notebook compares, each with the base
            checks.validate(EngineParams.pick({**merged, "speculator": name}))
    if "groups" in merged:  # the leaderboard: its groups and entries (methods of several kinds), the GemFilter cut
        _check_board(merged)
    else:
        for method in merged.get("methods") or []:  # the baselines: known, and able to run here
            selectors.selector(method).check()
    tasks = list(merged.get("lm_eval_tasks") or [])
    harness.check_task_args(tasks, merged.get("lm_eval_task_args"))
    if tasks:
        harness.check_truncation(merged.get("lm_eval_truncation", "left"))
    unknown = sorted(set(tasks) - _lm_eval_task_names()) if tasks else []
    if unknown:
        raise SpecPrefillError(
            f"lm_eval_tasks {', '.join(unknown)}: lm-eval has no such task (`lm-eval ls tasks` lists them)"
        )
    return tasks


def _check_board(merged: dict) -> None:
    """Notebook 11's parameters: groups, entries (`leaderboard.entries`: unknown or repeated names, a method that
    cannot run here) and the GemFilter-style speculator with the base."""
    from specprefill.workbench import board  # lazy: pandas, the selectors' data

    limit = int(merged["max_tokens"]) if isinstance(merged.get("max_tokens"), int) else 0
    board.check_groups(merged["groups"], merged.get("keep_rates") or [], merged.get("max_model_len"), limit)
    settings = board.settings_of(merged)
    entries = board.entries(settings["methods"], settings["speculators"], settings["speculator_rule"],
                            settings["gemfilter_layer"])  # fmt: skip
    for e in entries:
        if e.speculator is not None and e.speculator not in (merged.get("speculators") or []):
            checks.validate(EngineParams.pick({**merged, "speculator": e.speculator}))


def memory_plan(merged: dict, gpu_gib: float) -> list[str]:
    """An engine notebook's memory per GPU of `gpu_gib` GiB (`gpu_plan.gpu_memory_plan`) as lines; a plan whose KV
    cache cannot hold the notebook's longest request (or, batched TTFT, its whole batch) is printed, then refused."""
    if "tensor_parallel_size" not in merged or not merged.get("base"):
        return []
    params = EngineParams.pick(merged)
    base_kwargs, spec_kwargs = planning.engine_kwargs(params)
    base = models.resolve(merged["base"], materialize_missing=False)
    speculator = models.resolve_speculator(merged["speculator"], merged["base"], materialize_missing=False)
    needs = max(int(merged.get("max_model_len") or 0), int(merged.get("token_budget") or 0))
    plan = gpu_plan.gpu_memory_plan(base, speculator, base_kwargs, spec_kwargs, gpu_gib, needs)
    lines = gpu_plan.plan_lines(plan, gpu_gib)
    if not all(e.fits for e in plan):
        print("\n".join(lines), file=sys.stderr)
        gpu_plan.check_gpu_plan(plan, gpu_gib)
    return lines


@functools.lru_cache(maxsize=1)
def _lm_eval_task_names() -> set[str]:
    from lm_eval.tasks import TaskManager

    harness.index_stock_tasks_once()
    return set(TaskManager(include_path=harness.include_paths()).all_tasks)


def with_groups(params: dict, groups: list[str] | dict, name: str) -> dict:
    """A notebook's parameters with its task groups chosen: a list keeps those groups (`some_groups`); a dict
    replaces them, a user's own prompts (`data.userprompts.board_groups`), written to a folder of their own below
    the notebook's."""
    if not isinstance(groups, dict):
        return {**params, "groups": some_groups(params.get("groups"), groups, name)}
    if not isinstance(params.get("groups"), dict):
        raise SpecPrefillError(f"--prompts: {name} has no task groups to replace")
    stems = sorted({Path(userprompts.parse(t)[2]).stem for g in groups.values() for t in g["tasks"]})
    return {**params, "groups": groups, "output_dir": str(Path(params["output_dir"]) / f"prompts-{'-'.join(stems)}")}


def some_groups(defined, wanted: list[str], name: str) -> dict:
    """Those of a notebook's task groups named in `wanted` (one line naming the groups there are otherwise)."""
    if not isinstance(defined, dict):
        raise SpecPrefillError(f"--groups: {name} has no task groups in this profile: leave --groups out")
    unknown = [g for g in wanted if g not in defined]
    if unknown or not wanted:
        raise SpecPrefillError(f"--groups {','.join(wanted)}: {name}'s groups are {', '.join(defined)}; name some")
    return {g: v for g, v in defined.items() if g in wanted}
