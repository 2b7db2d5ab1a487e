"""Calibrated speculators: `specprefill calibrate` (module `specprefill.calibrate`) picks, for one (speculator, base)
pair, how many of the speculator's layers to run and which (layer, head) pairs score; the choice is a small JSON in
the cache keyed by both models' fingerprints. `calibrated:S` names the speculator S cut after its last scored layer
and carrying that head set (`self_speculation.self_speculator`)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from specprefill.cache import cache_dir
from specprefill.errors import SpecPrefillError
from specprefill.models.registry import fingerprint

CALIBRATED_PREFIX = "calibrated:"


def calibration_path(speculator_path: str, base_path: str) -> Path:
    """Where the calibration of this pair lives: one file per (speculator, base) fingerprint pair."""
    key = hashlib.sha256(f"{fingerprint(speculator_path)}|{fingerprint(base_path)}".encode()).hexdigest()[:16]
    return cache_dir() / "calibrated" / f"{Path(speculator_path).name}-{key}.json"


def load_calibration(speculator: str, speculator_path: str, base: str, base_path: str) -> dict:
    """The saved calibration of this pair: {"layers": K, "score_heads": "L.H,...", ...}; a one-line error naming the
    command that makes it when there is none."""
    path = calibration_path(speculator_path, base_path)
    if not path.is_file():
        raise SpecPrefillError(
            f"speculator {CALIBRATED_PREFIX}{speculator} has no calibration for base {base}: run `specprefill "
            f"calibrate --speculator {speculator} --base {base}` first"
        )
    data = json.loads(path.read_text())
    if not isinstance(data.get("layers"), int) or not data.get("score_heads"):
        raise SpecPrefillError(f"calibration {path} is incomplete: run `specprefill calibrate` again")
    return data
