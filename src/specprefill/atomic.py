"""Files appear whole or not at all: write to a temp file beside the target, fsync it, rename it into place, fsync
the folder (so a crash or power loss leaves either the old file or the new one, never a torn one)."""
from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path


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
        _fsync(tmp)
        tmp.replace(path)
        _fsync(path.parent)
    finally:
        if tmp.exists():
            tmp.unlink()


def write_text(path: str | os.PathLike, text: str) -> Path:
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")
    return Path(path)
