"""The checkout the workbench runs in (notebooks/ and params/), found from any folder inside it. Below both the
workbench and the explorer: neither imports the other to find it."""

from __future__ import annotations

import os
from pathlib import Path

from specprefill.errors import SpecPrefillError

ROOT_MARKERS = ("notebooks", "params")


def project_root(start: str | os.PathLike | None = None) -> Path:
    """The first folder at or above `start` (default: the working directory) that holds notebooks/ and params/."""
    here = Path(start or os.getcwd()).resolve()
    for d in [here, *here.parents]:
        if all((d / m).is_dir() for m in ROOT_MARKERS):
            return d
    raise SpecPrefillError(f"no notebooks/ and params/ above {here}: run from the specprefill checkout")
