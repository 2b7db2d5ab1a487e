"""The test suite's guard against code that depends on the order a filesystem lists a folder (ext4 lists by a
per-filesystem hash, tmpfs by creation: the same code can pass on one machine and fail on another).

With SPECPREFILL_LISTING_SEED set, `os.scandir` and `os.listdir` (and so `Path.glob`/`iterdir`/`rglob`, `glob.glob`,
`os.walk`) return the entries of every folder outside the Python installation in a shuffled order drawn from the
seed and the names listed: the same order on every machine and filesystem for the same seed, neither the sorted order
nor the filesystem's. Code that reads "the first file" of a listing, or writes results in listing order, then fails
(or passes) alike on every machine, reproducibly with the printed seed, instead of on some machines only.
`tests/conftest.py` installs it in the test process and, through this file on PYTHONPATH, in every Python subprocess
a test starts (kernels, engines, servers, CLIs). Sorted listings are unaffected: `sorted(p.glob(...))` is the fix.
"""

import importlib.machinery
import importlib.util
import os
import random
import sys
import sysconfig

ENV = "SPECPREFILL_LISTING_SEED"
_INSTALL_TREES = tuple(
    {os.path.realpath(p) + os.sep for p in (sys.prefix, sys.base_prefix, *sysconfig.get_paths().values()) if p}
)
# the unguarded functions, also where this file was loaded before (a subprocess, then conftest)
_scandir = getattr(os.scandir, "unguarded", os.scandir)
_listdir = getattr(os.listdir, "unguarded", os.listdir)


def _guarded(path) -> bool:
    if isinstance(path, int):  # a descriptor: no name to decide by
        return False
    try:
        where = os.path.realpath(os.fsdecode(path if path is not None else ".")) + os.sep
    except (TypeError, ValueError):
        return False
    return not where.startswith(_INSTALL_TREES)


def reorder(entries: list, names: list[str], seed: str) -> list:
    """`entries` (named `names`) in an order drawn from `seed` and the names alone, so the same on every machine and
    in every folder that holds the same names: a shuffle whose first and last entries are not the sorted order's
    wherever there are enough entries (never the sorted order itself, nor the filesystem's where that can be)."""
    n = len(entries)
    if n < 2:
        return list(entries)
    by_name = sorted(range(n), key=lambda i: names[i])
    rng = random.Random(f"{seed}:" + "/".join(names[i] for i in by_name))
    order = list(by_name)
    for _ in range(64):
        rng.shuffle(order)
        if n < 4 or (order[0] not in (by_name[0], by_name[-1]) and order[-1] not in (by_name[0], by_name[-1])):
            break
    natural = list(range(n))
    for candidate in (order, by_name[::-1], natural[::-1]):
        if candidate not in (natural, by_name):
            order = candidate
            break
    return [entries[i] for i in order]


class _Listing:
    """What `os.scandir` returns (an iterator and a context manager), over entries already read."""

    def __init__(self, entries: list) -> None:
        self._it = iter(entries)

    def __iter__(self):
        return self

    def __next__(self):
        return next(self._it)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._it = iter(())


def install(seed: str) -> None:
    def scandir(path="."):
        if not _guarded(path):
            return _scandir(path)
        with _scandir(path) as it:
            entries = list(it)
        return _Listing(reorder(entries, [e.name for e in entries], seed))

    def listdir(path="."):
        names = _listdir(path)
        if not _guarded(path):
            return names
        return reorder(names, [os.fsdecode(n) for n in names], seed)

    scandir.unguarded, listdir.unguarded = _scandir, _listdir  # type: ignore[attr-defined]
    os.scandir, os.listdir = scandir, listdir


def _chain() -> None:
    """Run the sitecustomize this file shadows on sys.path, if there is one (a distribution's or an environment's)."""
    here = os.path.dirname(os.path.abspath(__file__))
    rest = [p for p in sys.path if os.path.abspath(p or ".") != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is not None and spec.loader is not None and os.path.abspath(spec.origin or "") != os.path.abspath(__file__):
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)


if __name__ == "sitecustomize":
    if os.environ.get(ENV):
        install(os.environ[ENV])
    _chain()
