"""Files appear whole or not at all: write to a temp file beside the target, fsync it, rename it into place, fsync
the folder (so a crash or power loss leaves either the old file or the new one, never a torn one). Directories
likewise (`build_dir`): built in a temp folder beside the target under a file lock, renamed into place when done."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from filelock import FileLock


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _read_umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


UMASK = _read_umask()  # once, at import: os.umask can only be read by setting it, which races between threads


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike):
    """Yields a fresh temp path (`.name.<random>.tmp<suffix>`, same folder) to write; fsynced and renamed onto `path`
    only if the block succeeds, removed otherwise. Concurrent writers of one path never share a temp file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}.", suffix=f".tmp{path.suffix}")
    os.close(fd)
    tmp = Path(name)
    os.chmod(tmp, 0o666 & ~UMASK)  # what a plain open() would give, not mkstemp's 0600
    try:
        yield tmp
        publish(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def publish(tmp: str | os.PathLike, path: str | os.PathLike) -> Path:
    """Put a finished temp file (same folder) in place: fsync it, rename it onto `path`, fsync the folder."""
    tmp, path = Path(tmp), Path(path)
    _fsync(tmp)
    tmp.replace(path)
    _fsync(path.parent)
    return path


def temp_beside(path: str | os.PathLike, tag: str = "tmp") -> Path:
    """A fresh, empty temp file beside `path` (`.name.<tag>.<random><suffix>`): dot-named, so no glob of the
    folder's results picks it up."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}.{tag}.", suffix=path.suffix)
    os.close(fd)
    os.chmod(name, 0o666 & ~UMASK)
    return Path(name)


def write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)
    return Path(path)


def write_text(path: str | os.PathLike, text: str) -> Path:
    return write_bytes(path, text.encode("utf-8"))


def build_dir(
    target: str | os.PathLike, build: Callable[[Path], object], ready: Callable[[Path], bool] = Path.exists
) -> Path:
    """Make directory `target` whole, once: unless `ready(target)`, take the lock `.<name>.lock` beside it (others
    wait), check again, call `build(out)` and rename `out` onto `target` (replacing a stale one). `out` does not exist
    yet; it lies in a private temp folder (`.<name>-<random>`, beside the target) that `build` may use for scratch
    files and that is removed afterwards, also when `build` raises."""
    target = Path(target)
    if ready(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target.parent / f".{target.name}.lock")):
        if ready(target):  # another process finished it while this one waited
            return target
        with tempfile.TemporaryDirectory(dir=target.parent, prefix=f".{target.name}-") as tmp:
            out = Path(tmp) / target.name
            build(out)
            if target.exists():  # a half-written or stale directory
                shutil.rmtree(target)
            out.rename(target)
    return target
