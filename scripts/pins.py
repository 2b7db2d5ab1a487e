"""The constraints' pins against the oldest Python the project admits (the lower bound of `requires-python` in
pyproject.toml, the one place it is stated): every pinned distribution must take that Python, or `make setup` fails
on it before anything runs (as `soupsieve==4.1.2`, Requires-Python >=3.11.5, did on Debian 12's 3.11.2).

    python scripts/pins.py                   check constraints/cpu.txt with the installed distributions' metadata
    python scripts/pins.py FILE              another constraints file
    python scripts/pins.py --oldest          print the oldest admitted Python (for `uv pip compile --python-version`)

Offline: it reads the Requires-Python of the installed distributions (an environment `make setup` built from these
pins holds every one of them). A pin whose version is not installed here is reported too: its metadata cannot be read,
so the check would otherwise pass without looking. Exit 1 names each offending package and the fix."""

from __future__ import annotations

import sys
import tomllib
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
CONSTRAINTS = ROOT / "constraints" / "cpu.txt"


def oldest_python(pyproject: Path = ROOT / "pyproject.toml") -> Version:
    """The lowest version `requires-python` admits (">=3.11" -> 3.11.0); it must have a lower bound."""
    spec = tomllib.loads(pyproject.read_text())["project"]["requires-python"]
    bounds = [Version(s.version) for s in SpecifierSet(spec) if s.operator in (">=", "==", "~=")]
    if not bounds:
        raise SystemExit(f"{pyproject}: requires-python {spec!r} has no lower bound: state the oldest Python (>=3.X.Y)")
    floor = max(bounds)
    return Version(".".join(str(p) for p in (floor.release + (0, 0))[:3]))


def pins(path: Path) -> dict[str, str]:
    """name -> pinned version, for every `name==version` line (comments and other lines skipped)."""
    out = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line or line.startswith("-"):
            continue
        req = Requirement(line)
        exact = [s.version for s in req.specifier if s.operator == "=="]
        if exact:
            out[canonicalize_name(req.name)] = exact[0]
    return out


def installed() -> dict[str, metadata.Distribution]:
    """name -> the distribution Python imports (the first on sys.path)."""
    out: dict[str, metadata.Distribution] = {}
    for dist in metadata.distributions():
        if dist.metadata["Name"]:
            out.setdefault(canonicalize_name(dist.metadata["Name"]), dist)
    return out


def problems(path: Path = CONSTRAINTS, python: Version | None = None) -> list[str]:
    """One line per pin that excludes `python` (default: the oldest admitted) or whose metadata is not installed."""
    python = python or oldest_python()
    have = installed()
    out = []
    for name, version in pins(path).items():
        dist = have.get(name)
        if dist is None or Version(dist.version) != Version(version):
            found = f"{dist.version} is installed" if dist else "it is not installed"
            out.append(f"{name}=={version}: cannot read its Requires-Python ({found}): run `make setup` first")
            continue
        requires = dist.metadata["Requires-Python"]
        if requires and not SpecifierSet(requires).contains(python, prereleases=True):
            out.append(
                f"{name}=={version} requires Python {requires}, which excludes Python {python} (the oldest "
                f"requires-python admits): pin a release that takes {python} in {path.name}"
            )
    return out


def main(argv: list[str]) -> int:
    if argv[:1] == ["--oldest"]:
        print(oldest_python())
        return 0
    path = Path(argv[0]) if argv else CONSTRAINTS
    found = problems(path)
    for line in found:
        print(line, file=sys.stderr)
    if not found:
        print(f"{path.name}: all {len(pins(path))} pins take Python {oldest_python()}")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
