"""Where the project keeps what it downloads and builds: wheels, materialized models, datasets."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """SPECPREFILL_CACHE, else $XDG_CACHE_HOME/specprefill, else ~/.cache/specprefill."""
    if os.environ.get("SPECPREFILL_CACHE"):
        return Path(os.environ["SPECPREFILL_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "specprefill"
