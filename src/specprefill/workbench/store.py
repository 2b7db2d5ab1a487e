"""Results on disk: one file per unit of work, keyed by a hash of its spec, written atomically; tidy tables beside.

A unit is read back instead of recomputed only when a complete file for exactly the same spec exists; the spec holds
everything that shapes its rows (model fingerprints, data digest, every knob, sampling, dtype, sizes), so changing
any of them runs the unit again. An empty, cut-off or foreign file is not finished.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Callable
from pathlib import Path

import pandas as pd

from specprefill.atomic import write_text

READABLE = 120  # characters of the file name that show the spec; a hash of the whole spec follows


def digest(value) -> str:
    """A short stable hash of any JSON-able value (canonical: sorted keys)."""
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()[:16]


def unit_path(output_dir: str | os.PathLike, kind: str, spec: dict) -> Path:
    """units/<kind>/<readable prefix>-<hash of the whole spec>.json: the name shows the config, the hash keys it (so
    "a/b" and "a_b", or a cut-off prefix, never share a file)."""
    readable = ",".join(f"{k}={spec[k]}" for k in sorted(spec) if isinstance(spec[k], (str, int, float, bool)))
    readable = re.sub(r"[^A-Za-z0-9=,._+-]", "_", readable)[:READABLE]
    return Path(output_dir) / "units" / kind / f"{readable}-{digest(spec)}.json"


def read_unit(path: Path, spec: dict) -> list[dict] | None:
    """The unit's rows if its file is complete and holds exactly this spec; None (= not finished) otherwise."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("spec") != json.loads(json.dumps(spec, default=str)):
        return None
    return data.get("rows") if isinstance(data.get("rows"), list) else None


def run_unit(output_dir, kind: str, spec: dict, compute: Callable[[], list[dict]], force: bool = False) -> list[dict]:
    """Rows of one unit (each with the spec's fields): read back if finished with the same spec, else computed and
    written atomically together with the spec that produced them."""
    path = unit_path(output_dir, kind, spec)
    done = None if force else read_unit(path, spec)
    if done is not None:
        return done
    rows = [{**spec, **row} for row in compute()]
    write_text(path, json.dumps({"spec": spec, "rows": rows}, default=str))
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
