"""Run the experiment notebooks with papermill: params profiles, resume, atomic outputs, failure list.

Layout: notebooks/<name>.ipynb, params/<profile>/<name>.yaml, outputs/<profile>/<name>/ (executed notebook and
the notebook's own results). `params/<profile>/_profile.yaml`, if present, holds what the profile's notebooks share
(the engine block: models, dtype, sizes, parallelism); each notebook gets the keys of it that its parameters cell
has, and its own file overrides them. A notebook whose executed copy exists is skipped unless forced.
"""

from __future__ import annotations

import contextlib
import hashlib
import html
import json
import math
import os
import sys
import tempfile
import time
import uuid
from pathlib import Path

from tqdm.auto import tqdm

from specprefill.atomic import publish, temp_beside, write_text
from specprefill.engines.vllm import sizing
from specprefill.errors import SpecPrefillError
from specprefill.project import project_root
from specprefill.workbench import eta, fidelity, power, protocol, store, timing
from specprefill.workbench.parameters import (
    UNITS_TAG,
    load_params,
    memory_plan,
    notebooks,
    parameters_cell,
    profiles,
    run_names,
    skipped,
    units_cells,
    validate_params,
    with_groups,
)


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
    groups: list[str] | dict | None = None,
) -> str:
    """Execute one notebook; returns "done", "skipped" or "prepared". The executed copy appears atomically (fsynced),
    with `<name>.inputs.json` beside it (its parameters and a hash of them, of the notebook and of the package's
    code): a notebook is skipped only when all are unchanged. `force` executes it again (finished units are read
    back); `recompute` also computes every unit again. A failed run leaves `<name>.failed.ipynb` (the partly
    executed copy). `data_dir` replaces the `data_dir` parameter of notebooks that have one, `groups` keeps those of
    a notebook's task groups (`notebook_params`). Cell progress goes to stderr."""
    params = notebook_params(root, profile, name, data_dir, groups)
    out_dir = output_dir(root, profile, name)
    final, stamp = out_dir / f"{name}.ipynb", out_dir / f"{name}.inputs.json"
    inputs = {"params": params, "code": store.code_identity()}
    key = _inputs_key(root, name, inputs)
    if final.exists() and not (force or recompute or prepare_only) and _stamped(stamp) == key:
        if not final.with_suffix(".html").exists():  # run by a version that exported none
            export_html(final)
        return "skipped"
    reading = os.environ.get(store.UNITS_ENV) == "read"
    timing = eta.start(out_dir, stamp, bool(recompute), params)  # what `eta` predicts from
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
    write_text(stamp, json.dumps({"inputs_sha256": key, **timing(), **inputs}, indent=1, default=str))
    return "done"


def _inputs_key(root: Path, name: str, inputs: dict) -> str:
    source = root / "notebooks" / f"{name}.ipynb"
    return hashlib.sha256(source.read_bytes() + json.dumps(inputs, sort_keys=True, default=str).encode()).hexdigest()


def finished(
    root: Path, profile: str, name: str, data_dir: str | None = None, groups: list[str] | dict | None = None
) -> bool:
    """Whether the notebook's executed copy is there with unchanged inputs (a run would skip it)."""
    out_dir = output_dir(root, profile, name)
    inputs = {"params": notebook_params(root, profile, name, data_dir, groups), "code": store.code_identity()}
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


def notebook_params(
    root: Path, profile: str, name: str, data_dir: str | None = None, groups: list[str] | dict | None = None
) -> dict:
    """What papermill injects: the profile's parameters, its name and the notebook's output folder (and `data_dir`
    to notebooks that have one; `groups`: `parameters.with_groups`)."""
    params = {
        **load_params(root, profile, name),
        "profile": profile,
        "output_dir": str(output_dir(root, profile, name).relative_to(root)),
    }
    if data_dir is not None and "data_dir" in parameters_cell(root / "notebooks" / f"{name}.ipynb"):
        params["data_dir"] = str(Path(data_dir).resolve())
    if groups is not None:
        params = with_groups(params, groups, name)
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
    if prepare_only:  # nothing under outputs/: a check writes no folder where a user's results live
        fd, path = tempfile.mkstemp(prefix=f"{name}.", suffix=".prepared.ipynb")
        os.close(fd)
        tmp = Path(path)
    else:
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
                kernel_manager_class=kernel_manager(),
            )
    except BaseException:
        if not prepare_only and tmp.exists() and tmp.stat().st_size:
            publish(tmp, out_dir / f"{name}.failed.ipynb")  # the partly executed copy, to open
        tmp.unlink(missing_ok=True)
        raise
    return tmp


def kernel_manager() -> type:
    """The notebooks' kernel manager: a local kernel reached over IPC sockets (its files in Jupyter's runtime folder),
    so no kernel says it "is running over TCP without encryption"; TCP where that folder's path is too long for a
    socket path (the OS allows ~107 bytes). Either way the kernel and its results are the same."""
    from jupyter_client.manager import AsyncKernelManager  # lazy: with papermill
    from jupyter_core.paths import jupyter_runtime_dir
    from traitlets import CaselessStrEnum, default

    runtime = jupyter_runtime_dir()
    if len(os.fsencode(runtime)) + len("/kernel-00000000-0000-0000-0000-000000000000-ipc-9") > 100:
        return AsyncKernelManager

    class IPCKernelManager(AsyncKernelManager):
        transport = CaselessStrEnum(["tcp", "ipc"], default_value="ipc", config=True)

        @default("connection_file")
        def _connection_file(self) -> str:  # its sockets beside it: <runtime>/kernel-<uuid>-ipc-N, one per kernel
            os.makedirs(runtime, exist_ok=True)
            return os.path.join(runtime, f"kernel-{uuid.uuid4()}.json")

    return IPCKernelManager


def export_html(notebook: Path) -> Path:
    """The executed notebook as HTML beside it (same stem), outputs and figures included, written atomically: what
    the report links to for readers without Jupyter."""
    import nbconvert  # lazy: only executed notebooks are exported; importing it costs ~1 s
    import nbformat  # lazy: with nbconvert

    nb = nbformat.read(str(notebook), as_version=4)
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            png = out.get("data", {}).pop("image/png", None)
            if png is not None:  # the figure with its alt text (nbconvert's own <img> has none)
                alt = out.get("metadata", {}).get("image/png", {}).get("alt") or f"A figure of {notebook.stem}"
                src = f"data:image/png;base64,{''.join(png).strip()}"
                out["data"]["text/html"] = f'<img alt="{html.escape(alt)}" src="{src}" style="max-width:100%">'
    body, _ = nbconvert.HTMLExporter().from_notebook_node(nb)
    return write_text(notebook.with_suffix(".html"), body)


def _stamped(path: Path) -> str | None:
    try:
        return json.loads(path.read_text()).get("inputs_sha256")
    except (OSError, ValueError, AttributeError):
        return None


def run_profile(
    profile: str,
    only: list[str] | None = None,
    force: bool = False,
    prepare_only: bool = False,
    root: Path | None = None,
    recompute: bool = False,
    data_dir: str | None = None,
    gpu_memory_gib: float | None = None,
    groups: list[str] | dict | None = None,
) -> list[tuple[str, str]]:
    """Every notebook (report last), continuing past failures. Returns [(name, error)] of the failures. `force`:
    execute finished notebooks again (reading finished units back); `recompute`: compute every unit again too;
    `groups`: run those of a notebook's task groups alone (the leaderboard's)."""
    root = root or project_root()
    if profile not in profiles(root):
        raise SpecPrefillError(f"unknown profile {profile!r}: use one of {', '.join(profiles(root))}")
    skip = skipped(root, profile)
    names = run_names(root, profile, only)
    unknown = sorted(set(names) - set(notebooks(root)))
    if unknown:
        raise SpecPrefillError(
            f"--only {','.join(unknown)}: no such notebook; use names from notebooks/, e.g. "
            f"{', '.join(notebooks(root)[:3])}"
        )
    _check_options(prepare_only, data_dir, gpu_memory_gib)
    failures = []
    predicted = _predicted(root, profile, names, not (force or recompute), data_dir, groups)
    bar = tqdm(names, desc=f"reproduce {profile}", unit="notebook", file=sys.stderr, disable=None)
    for i, name in enumerate(bar):
        left = [predicted[n] for n in names[i:]]  # predicted time left, where every notebook left has one
        bar.set_postfix_str(
            name if prepare_only or None in left else f"{name}, ~{eta.minutes(sum(p[0] for p in left))} left"
        )
        t0 = time.perf_counter()
        try:
            status = run_notebook(root, profile, name, force, prepare_only, recompute, data_dir, gpu_memory_gib, groups)
        except Exception as exc:  # a failing notebook must not stop the others
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[-1]
            failures.append((name, first[:300]))
            status = f"FAILED: {first[:200]}"
        head, _, protocol_lines = status.partition("\n")  # --prepare-only: the notebook's protocol below
        bar.write(f"[reproduce] {profile}/{name}: {head} ({time.perf_counter() - t0:.0f} s)", file=sys.stderr)
        if prepare_only:
            guess = predicted[name]
            said = f"{eta.minutes(guess[0])} ({guess[1]})" if guess else "unknown (no run here, none recorded)"
            bar.write("\n".join([*protocol_lines.splitlines(), f"  predicted time: {said}"]), file=sys.stderr)
    if not only:
        say_skipped(skip, profile, bar.write)
    if prepare_only:
        unknown = [n for n, p in predicted.items() if not p]
        bar.write(
            f"[reproduce] {profile}: predicted total {eta.minutes(sum(p[0] for p in predicted.values() if p))}"
            + (f" (not counting {', '.join(unknown)}: no prediction)" if unknown else ""),
            file=sys.stderr,
        )
    return failures


def _check_options(prepare_only: bool, data_dir: str | None, gpu_memory_gib: float | None) -> None:
    if gpu_memory_gib is not None and not prepare_only:
        raise SpecPrefillError("--gpu-memory-gib plans memory before a GPU job: use it with --prepare-only")
    if gpu_memory_gib is not None and not (math.isfinite(gpu_memory_gib) and gpu_memory_gib > 0):
        raise SpecPrefillError(f"--gpu-memory-gib {gpu_memory_gib:g} must be positive: e.g. 80 (H100) or 141 (H200)")
    if data_dir is not None and not Path(data_dir).is_dir():
        raise SpecPrefillError(f"--data-dir {data_dir}: no such directory (it holds longbench/<config>.jsonl, ...)")


def say_skipped(skip: dict[str, str], profile: str, write=print) -> None:
    for name, why in skip.items():
        write(f"[reproduce] {profile}/{name}: not run in this profile: {why}", file=sys.stderr)


def _predicted(root: Path, profile: str, names: list[str], skips: bool, data_dir, groups=None) -> dict:
    """Per notebook, `eta.predict`'s (seconds, source), none for one a run would skip (`skips`: not forced)."""
    machine, done = eta.here(), set[tuple]()  # done: units earlier notebooks compute (read back by later ones)
    out: dict[str, tuple[float, str] | None] = {}
    measured: dict[tuple, tuple | None] = {}
    for n in names:
        try:  # a notebook whose parameters are wrong fails in its own turn, named, not here
            skipped = skips and finished(root, profile, n, data_dir, groups)
        except Exception:  # noqa: BLE001
            skipped = False
        stamp = output_dir(root, profile, n) / f"{n}.inputs.json"
        try:
            params, cell = (
                notebook_params(root, profile, n, data_dir, groups),
                parameters_cell(root / "notebooks" / f"{n}.ipynb"),
            )
        except Exception:  # noqa: BLE001
            params, cell = None, {}
        if skipped:
            out[n] = (0.0, "finished: skipped")
            continue
        merged = {**cell, **(params or {})}
        pair = (merged.get("base"), merged.get("speculator"))
        if pair not in measured:  # a timing of each pair on this machine (cached: once per machine and code)
            measured[pair] = timing.here(*pair, machine["cpu_class"]) if params is not None else None
        out[n] = eta.predict(profile, n, stamp, machine, params, cell, done, measured[pair])
    return out
