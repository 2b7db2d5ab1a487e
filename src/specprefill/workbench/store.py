"""Results on disk: one file per unit of work, named by its config, written atomically; tidy tables beside them.

A unit is read back instead of recomputed only when a file for exactly the same spec exists; the spec names
everything that shapes its rows (models, dtype, knobs, sizes), so changing any of them runs the unit again.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Callable

import pandas as pd

from specprefill.atomic import write_text

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
