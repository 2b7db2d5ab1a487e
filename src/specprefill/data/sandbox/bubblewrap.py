"""The sandbox's boundary: bubblewrap's version and whether it can build namespaces here, and the command line that
builds the sandbox (read-only system directories, a size-capped tmpfs holding the program, the root and /dev remounted
read-only, the namespaces, bubblewrap's status channel). Imports nothing from the package (see `__init__`)."""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
from pathlib import Path

WORKDIR = "/sandbox"


SITE = "/opt/specprefill-site"  # the packages a program may import besides the standard library (read-only)


MIN_BWRAP = (0, 7)  # --size (a size-capped tmpfs) first appeared in bubblewrap 0.7


def bwrap_version() -> tuple[int, ...] | None:
    """bubblewrap's version (e.g. (0, 8, 0)); None when it is not installed or does not say."""
    if shutil.which("bwrap") is None:
        return None
    try:
        out = subprocess.run(["bwrap", "--version"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    numbers = out.split()[-1].split(".") if out.split() else []
    return tuple(int(n) for n in numbers) if numbers and all(n.isdigit() for n in numbers) else None


def _namespaces() -> list[str]:
    # as root: no user namespace, so the launcher's drop to a fresh uid makes RLIMIT_NPROC count (root is exempt)
    if os.getuid() == 0:
        return ["--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts", "--unshare-cgroup-try"]
    return ["--unshare-all"]


@functools.lru_cache(maxsize=1)
def namespaces_problem() -> str | None:
    """None when this machine lets bubblewrap create the namespaces the sandbox uses (a minimal sandbox: the host's
    root read-only, `true`), else why not: a fact about the machine, not about the sandbox's own arguments."""
    if shutil.which("bwrap") is None:
        return "bubblewrap (bwrap) is not installed"
    try:
        run = subprocess.run(
            ["bwrap", "--ro-bind", "/", "/", *_namespaces(), "--die-with-parent", "true"],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.SubprocessError) as exc:
        return f"bwrap cannot start here: {exc}"
    if run.returncode != 0:
        last = (run.stderr.strip().splitlines() or [f"exit status {run.returncode}"])[-1]
        return f"this machine does not let bubblewrap create namespaces: {last}"
    return None


def _python() -> str:
    return os.path.realpath(sys.executable)


def _mounts() -> list[str]:
    """Read-only: the system's library/binary dirs and the interpreter's own prefix; nothing from home or project."""
    args = []
    for top in ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(top):
            args += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            args += ["--ro-bind", top, top]
    prefix = os.path.realpath(sys.base_prefix)
    if not prefix.startswith("/usr/"):
        parents = [d for d in _ancestors(prefix) if d not in ("/", "/usr")]
        for d in parents:  # bwrap would create them 0700, unreadable once the launcher drops root
            args += ["--perms", "0755", "--dir", d]
        args += ["--ro-bind", prefix, prefix]
    return args


def _ancestors(path: str) -> list[str]:
    out: list[str] = []
    while (path := os.path.dirname(path)) not in out:
        out.insert(0, path)
    return out


def _bwrap_argv(fd: int, status_fd: int, tmpfs_bytes: int, modules: list[Path]) -> list[str]:
    """The sandbox: read-only system dirs, a size-capped tmpfs at WORKDIR holding the program (fd), the root and /dev
    remounted read-only once everything is in place (so nothing else can be written, not even /dev/shm), and
    bubblewrap's status on `status_fd` (a "child-pid" record means the sandbox was built and the launcher started)."""
    caps = ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"] if os.getuid() == 0 else []
    env = {"PATH": "/usr/bin:/bin", "HOME": WORKDIR, "TMPDIR": WORKDIR, "PYTHONDONTWRITEBYTECODE": "1", **THREADS}
    site = ["--perms", "0755", "--dir", "/opt", "--perms", "0755", "--dir", SITE] if modules else []
    for d in modules:
        site += ["--ro-bind", str(d), f"{SITE}/{d.name}"]
    return [
        "bwrap",
        *_mounts(),
        *site,
        *_namespaces(),
        *caps,
        "--die-with-parent",
        "--new-session",
        "--clearenv",
        "--json-status-fd",
        str(status_fd),
        "--proc",
        "/proc",
        "--dev",
        "/dev",
        "--perms",
        "1777",
        "--size",
        str(tmpfs_bytes),
        "--tmpfs",
        WORKDIR,
        "--file",
        str(fd),
        f"{WORKDIR}/program.py",
        "--remount-ro",
        "/dev",
        "--remount-ro",
        "/",
        "--chdir",
        WORKDIR,
        *[a for k, v in {**env, "MALLOC_ARENA_MAX": "1"}.items() for a in ("--setenv", k, v)],
        "--",
    ]


THREADS = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}  # numeric libraries: one thread
