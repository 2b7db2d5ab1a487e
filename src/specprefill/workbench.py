"""Run the experiment notebooks with papermill: params profiles, resume, atomic outputs, failure list.

Layout: notebooks/<name>.ipynb, params/<profile>/<name>.yaml, outputs/<profile>/<name>/ (executed notebook and
the notebook's own results). A notebook whose executed copy exists is skipped unless forced.
"""
from __future__ import annotations

import ast
import json
import os
import shutil
import sys
import time
from pathlib import Path

from specprefill.errors import SpecPrefillError

ROOT_MARKERS = ("notebooks", "params")


def project_root(start: str | os.PathLike | None = None) -> Path:
    here = Path(start or os.getcwd()).resolve()
    for d in [here, *here.parents]:
        if all((d / m).is_dir() for m in ROOT_MARKERS):
            return d
    raise SpecPrefillError(f"no notebooks/ and params/ above {here}: run from the specprefill checkout")


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
    return {t.id: ast.literal_eval(node.value) for node in tree.body if isinstance(node, ast.Assign)
            for t in node.targets if isinstance(t, ast.Name)}


def load_params(root: Path, profile: str, name: str) -> dict:
    import yaml

    path = root / "params" / profile / f"{name}.yaml"
    if not path.exists():
        raise SpecPrefillError(f"profile {profile!r} has no {path.relative_to(root)}: add it (copy params/cpu/{name}.yaml)")
    params = yaml.safe_load(path.read_text()) or {}
    allowed = parameters_cell(root / "notebooks" / f"{name}.ipynb")
    unknown = sorted(set(params) - set(allowed))
    if unknown:
        raise SpecPrefillError(f"{path.relative_to(root)}: keys {unknown} are not in the notebook's parameters cell")
    return params


def output_dir(root: Path, profile: str, name: str) -> Path:
    return root / "outputs" / profile / name


def run_notebook(root: Path, profile: str, name: str, force: bool = False, prepare_only: bool = False) -> str:
    """Execute one notebook; returns "done", "skipped" or "prepared". The executed copy appears atomically."""
    import papermill as pm

    params = {**load_params(root, profile, name), "profile": profile,
              "output_dir": str(output_dir(root, profile, name).relative_to(root))}
    out_dir = output_dir(root, profile, name)
    final = out_dir / f"{name}.ipynb"
    if final.exists() and not force and not prepare_only:
        return "skipped"
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = out_dir / f".{name}.running.ipynb"
    pm.execute_notebook(str(root / "notebooks" / f"{name}.ipynb"), str(tmp), parameters=params,
                        prepare_only=prepare_only, cwd=str(root), kernel_name="python3",
                        progress_bar=not prepare_only and sys.stderr.isatty(),
                        log_output=False)
    if prepare_only:
        tmp.unlink()
        validate_params(root, name, params)
        return "prepared"
    tmp.replace(final)
    return "done"


def validate_params(root: Path, name: str, params: dict) -> None:
    """What --prepare-only checks beyond papermill's injection: the SpecPrefill knobs and, for notebooks that build
    vLLM engines, every engine parameter (model names, sizes, vLLM argument names), all without loading a model."""
    from specprefill.core import SpecPrefillConfig
    from specprefill.engines.vllm.builder import EngineParams

    merged = {**parameters_cell(root / "notebooks" / f"{name}.ipynb"), **params}
    knobs = {k: merged[k] for k in ("look_ahead", "chunk_size", "pool_kernel") if k in merged}
    rates = [merged[k] for k in ("keep_rate", "baseline_keep_rate") if k in merged] + list(merged.get("keep_rates", []))
    for rate in rates or [0.1]:
        SpecPrefillConfig(keep_rate=rate, **knobs)
    if "tensor_parallel_size" in merged:
        EngineParams.pick(merged).validate()


def run_profile(profile: str, only: list[str] | None = None, force: bool = False, prepare_only: bool = False,
                root: Path | None = None) -> list[tuple[str, str]]:
    """Every notebook (report last), continuing past failures. Returns [(name, error)] of the failures."""
    root = root or project_root()
    if profile not in profiles(root):
        raise SpecPrefillError(f"unknown profile {profile!r}: use one of {', '.join(profiles(root))}")
    names = only or notebooks(root)
    failures = []
    for name in names:
        t0 = time.perf_counter()
        print(f"[reproduce] {profile}/{name} ...", file=sys.stderr, flush=True)
        try:
            status = run_notebook(root, profile, name, force, prepare_only)
        except Exception as exc:  # a failing notebook must not stop the others
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[-1]
            failures.append((name, first[:300]))
            status = f"FAILED: {first[:200]}"
        print(f"[reproduce] {profile}/{name}: {status} ({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
    return failures


def clean(profile: str, root: Path | None = None) -> None:
    root = root or project_root()
    shutil.rmtree(root / "outputs" / profile, ignore_errors=True)
