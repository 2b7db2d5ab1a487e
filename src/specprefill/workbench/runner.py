"""Run the experiment notebooks with papermill: params profiles, resume, atomic outputs, failure list.

Layout: notebooks/<name>.ipynb, params/<profile>/<name>.yaml, outputs/<profile>/<name>/ (executed notebook and
the notebook's own results). `params/<profile>/_profile.yaml`, if present, holds what the profile's notebooks share
(the engine block: models, dtype, sizes, parallelism); each notebook gets the keys of it that its parameters cell
has, and its own file overrides them. A notebook whose executed copy exists is skipped unless forced.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import functools
import hashlib
import json
import math
import os
import sys
import time
from pathlib import Path

import yaml
from tqdm.auto import tqdm

from specprefill import flags, models, selectors
from specprefill.atomic import publish, temp_beside, write_text
from specprefill.config import EngineParams, SpecPrefillConfig
from specprefill.engines.vllm import checks, gpu_plan, planning, sizing
from specprefill.errors import SpecPrefillError
from specprefill.project import project_root
from specprefill.workbench import fidelity, harness, power, protocol, store

SHARED = "_profile"  # params/<profile>/_profile.yaml: keys every notebook of the profile shares
EXECUTOR = "executor"  # ... and under this key where `reproduce` computes its units (`settings.ExecutorSettings`)
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
    shared = {k: v for k, v in _yaml(path, root).items() if k != EXECUTOR}
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


def output_dir(root: Path, profile: str, name: str) -> Path:
    return root / "outputs" / profile / name


@contextlib.contextmanager
def _kernel_env(recompute: bool | str):
    """The environment the notebook's kernel (a child process) inherits: `store.RECOMPUTE_ENV` when every unit is to be
    computed again; on CPU, vLLM engine cores inside the kernel (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, unless set): a
    notebook is one job, like the CLI's one-prompt run, and an engine then starts ~3x faster than with its own process
    pair (SmolLM2 pair: 13 s vs 40 s) with less memory; `builder.share_parallel_state` keeps engines started one after
    another in a kernel independent. The servers of a QPS run keep vLLM's processes (`serve.loadtest`)."""
    wanted = {store.RECOMPUTE_ENV: recompute if isinstance(recompute, str) else "1"} if recompute else {}
    if "VLLM_ENABLE_V1_MULTIPROCESSING" not in os.environ and sizing.is_cpu():
        wanted["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    with environment(wanted):
        yield


@contextlib.contextmanager
def environment(wanted: dict[str, str]):
    """`wanted` in this process's environment (and its children's) within the block, the values before restored."""
    before = {k: os.environ.get(k) for k in wanted}
    os.environ.update(wanted)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def run_notebook(
    root: Path,
    profile: str,
    name: str,
    force: bool = False,
    prepare_only: bool = False,
    recompute: bool = False,
    data_dir: str | None = None,
    gpu_memory_gib: float | None = None,
) -> str:
    """Execute one notebook; returns "done", "skipped" or "prepared". The executed copy appears atomically (fsynced),
    with `<name>.inputs.json` beside it (its parameters and a hash of them, of the notebook and of the package's
    code): a notebook is skipped only when all are unchanged. `force` executes it again (finished units are read
    back); `recompute` also computes every unit again. A failed run leaves `<name>.failed.ipynb` (the partly
    executed copy). `data_dir` replaces the `data_dir` parameter of notebooks that have one. Cell progress goes to
    stderr."""
    params = notebook_params(root, profile, name, data_dir)
    out_dir = output_dir(root, profile, name)
    final, stamp = out_dir / f"{name}.ipynb", out_dir / f"{name}.inputs.json"
    inputs = {"params": params, "code": store.code_identity()}
    key = _inputs_key(root, name, inputs)
    if final.exists() and not (force or recompute or prepare_only) and _stamped(stamp) == key:
        if not final.with_suffix(".html").exists():  # run by a version that exported none
            export_html(final)
        return "skipped"
    reading = os.environ.get(store.UNITS_ENV) == "read"
    try:
        tmp = _execute(root, profile, name, params, prepare_only, recompute)
    except Exception:
        if reading and store.missing_units(out_dir):  # a later cell failed on the short rows: name the cause
            _missing(out_dir)
        raise
    if reading and store.missing_units(out_dir):  # a unit no job finished: the notebook stays unfinished
        publish(tmp, out_dir / f"{name}.failed.ipynb")
        _missing(out_dir)
    merged = {**parameters_cell(root / "notebooks" / f"{name}.ipynb"), **params}
    differs = fidelity.lines(fidelity.differences(profile, name, merged))
    if prepare_only:
        tmp.unlink()
        validate_params(root, name, params)
        lines = protocol.lines(name, protocol.protocol(merged))[1:]
        lines += [f"  differs from the original: {line}" for line in differs]
        planned = power.plan_line("power", merged)
        lines += [f"  {planned}"] if planned else []
        if gpu_memory_gib is not None:
            lines += memory_plan(merged, gpu_memory_gib)
        return "prepared\n" + "\n".join(lines)
    proto = {**protocol.protocol(merged), **({"differs_from_original": differs} if differs else {})}
    write_text(out_dir / "protocol.json", json.dumps(proto, indent=1, default=str))
    publish(tmp, final)
    export_html(final)
    (out_dir / f"{name}.failed.ipynb").unlink(missing_ok=True)
    write_text(stamp, json.dumps({"inputs_sha256": key, **inputs}, indent=1, default=str))
    return "done"


def _inputs_key(root: Path, name: str, inputs: dict) -> str:
    source = root / "notebooks" / f"{name}.ipynb"
    return hashlib.sha256(source.read_bytes() + json.dumps(inputs, sort_keys=True, default=str).encode()).hexdigest()


def finished(root: Path, profile: str, name: str, data_dir: str | None = None) -> bool:
    """Whether the notebook's executed copy is there with unchanged inputs (a run would skip it)."""
    out_dir = output_dir(root, profile, name)
    inputs = {"params": notebook_params(root, profile, name, data_dir), "code": store.code_identity()}
    key = _inputs_key(root, name, inputs)
    return (out_dir / f"{name}.ipynb").exists() and _stamped(out_dir / f"{name}.inputs.json") == key


def _missing(out_dir: Path) -> None:
    """A sharded run's reading pass found units no job finished: the notebook is not finished (its stamp goes, so
    the next run gives it jobs again), one line naming them."""
    missing = store.missing_units(out_dir)
    for stamp in sorted(out_dir.glob("*.inputs.json")):  # every one goes: sorted only so no run depends on order
        stamp.unlink(missing_ok=True)
    raise SpecPrefillError(
        f"{len(missing)} unit(s) missing (first: {missing[0]}): a job did not finish them (the failed jobs and their "
        "logs are listed above); rerun the same command to compute only these"
    )


def notebook_params(root: Path, profile: str, name: str, data_dir: str | None = None) -> dict:
    """What papermill injects: the profile's parameters, its name and the notebook's output folder (and `data_dir`
    to notebooks that have one)."""
    params = {
        **load_params(root, profile, name),
        "profile": profile,
        "output_dir": str(output_dir(root, profile, name).relative_to(root)),
    }
    if data_dir is not None and "data_dir" in parameters_cell(root / "notebooks" / f"{name}.ipynb"):
        params["data_dir"] = str(Path(data_dir).resolve())
    return params


def run_units(
    root: Path,
    profile: str,
    name: str,
    shard: int,
    shards: int,
    record: Path,
    data_dir: str | None = None,
    recompute: bool | str = False,
) -> None:
    """A sharded run's share of a notebook: its cells up to the last one tagged `units`, with `store.SHARD_ENV` =
    "shard/shards" (units of other shards are left to their jobs), executed into `record` (the job's copy; the
    notebook's own outputs are written by the pass after the jobs); `recompute`: its units computed again (a time:
    those written before it, `store._forced`)."""
    import papermill as pm  # lazy, as in _execute

    source = root / "notebooks" / f"{name}.ipynb"
    cells = units_cells(source)
    if not cells:
        raise SpecPrefillError(f"{name} has no cell tagged {UNITS_TAG!r}: it runs after the jobs, not in one")
    nb = json.loads(source.read_text())
    nb["cells"] = nb["cells"][: cells[-1] + 1]
    record.parent.mkdir(parents=True, exist_ok=True)
    head, tmp = temp_beside(record, "source"), temp_beside(record, "running")
    write_text(head, json.dumps(nb))
    try:
        with environment({store.SHARD_ENV: f"{shard}/{shards}"}), _kernel_env(recompute):
            pm.execute_notebook(
                str(head), str(tmp), parameters=notebook_params(root, profile, name, data_dir), cwd=str(root),
                kernel_name="python3", progress_bar=False, log_output=True,
            )  # fmt: skip
        publish(tmp, record)
    finally:
        head.unlink(missing_ok=True)
        tmp.unlink(missing_ok=True)


def _execute(root: Path, profile: str, name: str, params: dict, prepare_only: bool, recompute: bool) -> Path:
    """papermill on the notebook with `params`, into a temporary file beside the executed copy (returned); a failed
    run publishes the partly executed copy as `<name>.failed.ipynb` and raises."""
    out_dir = output_dir(root, profile, name)
    tmp = temp_beside(out_dir / f"{name}.ipynb", "running")
    import papermill as pm  # lazy: its import (~3 s, nbformat's schema validators) is paid only by a notebook run

    try:
        with contextlib.nullcontext() if prepare_only else _kernel_env(recompute):  # prepare-only starts no kernel
            pm.execute_notebook(
                str(root / "notebooks" / f"{name}.ipynb"),
                str(tmp),
                parameters=params,
                prepare_only=prepare_only,
                cwd=str(root),
                kernel_name="python3",
                progress_bar=not prepare_only and {"desc": f"{profile}/{name}", "leave": False, "disable": None},
                log_output=False,
            )
    except BaseException:
        if not prepare_only and tmp.exists() and tmp.stat().st_size:
            publish(tmp, out_dir / f"{name}.failed.ipynb")  # the partly executed copy, to open
        tmp.unlink(missing_ok=True)
        raise
    return tmp


def export_html(notebook: Path) -> Path:
    """The executed notebook as HTML beside it (same stem), outputs and figures included, written atomically: what
    the report links to for readers without Jupyter."""
    import nbconvert  # lazy: only executed notebooks are exported; importing it costs ~1 s

    body, _ = nbconvert.HTMLExporter().from_filename(str(notebook))
    return write_text(notebook.with_suffix(".html"), body)


def _stamped(path: Path) -> str | None:
    try:
        return json.loads(path.read_text()).get("inputs_sha256")
    except (OSError, ValueError, AttributeError):
        return None


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


def run_profile(
    profile: str,
    only: list[str] | None = None,
    force: bool = False,
    prepare_only: bool = False,
    root: Path | None = None,
    recompute: bool = False,
    data_dir: str | None = None,
    gpu_memory_gib: float | None = None,
) -> list[tuple[str, str]]:
    """Every notebook (report last), continuing past failures. Returns [(name, error)] of the failures. `force`:
    execute finished notebooks again (reading finished units back); `recompute`: compute every unit again too."""
    root = root or project_root()
    if profile not in profiles(root):
        raise SpecPrefillError(f"unknown profile {profile!r}: use one of {', '.join(profiles(root))}")
    names = only or notebooks(root)
    unknown = sorted(set(names) - set(notebooks(root)))
    if unknown:
        raise SpecPrefillError(
            f"--only {','.join(unknown)}: no such notebook; use names from notebooks/, e.g. "
            f"{', '.join(notebooks(root)[:3])}"
        )
    if gpu_memory_gib is not None and not prepare_only:
        raise SpecPrefillError("--gpu-memory-gib plans memory before a GPU job: use it with --prepare-only")
    if gpu_memory_gib is not None and not (math.isfinite(gpu_memory_gib) and gpu_memory_gib > 0):
        raise SpecPrefillError(f"--gpu-memory-gib {gpu_memory_gib:g} must be positive: e.g. 80 (H100) or 141 (H200)")
    if data_dir is not None and not Path(data_dir).is_dir():
        raise SpecPrefillError(f"--data-dir {data_dir}: no such directory (it holds longbench/<config>.jsonl, ...)")
    failures = []
    bar = tqdm(names, desc=f"reproduce {profile}", unit="notebook", file=sys.stderr, disable=None)
    for name in bar:
        bar.set_postfix_str(name)
        t0 = time.perf_counter()
        try:
            status = run_notebook(root, profile, name, force, prepare_only, recompute, data_dir, gpu_memory_gib)
        except Exception as exc:  # a failing notebook must not stop the others
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[-1]
            failures.append((name, first[:300]))
            status = f"FAILED: {first[:200]}"
        head, _, protocol_lines = status.partition("\n")  # --prepare-only: the notebook's protocol below
        bar.write(f"[reproduce] {profile}/{name}: {head} ({time.perf_counter() - t0:.0f} s)", file=sys.stderr)
        if protocol_lines:
            bar.write(protocol_lines, file=sys.stderr)
    return failures
