"""Run model-written code only here.

The boundary is bubblewrap (`bwrap`, >= 0.7): a read-only view of the system's libraries and the interpreter and nothing
else (no home, no project, no `/etc`), the sandbox's own root and `/dev` remounted read-only, a private size-limited
tmpfs as the only writable place, no network namespace, a new PID namespace (the program cannot see or signal the
caller), no environment from the caller, and death with the caller. Whether the sandbox started is read from
bubblewrap's own status channel (`--json-status-fd`), never from the program's output. Inside it a launcher sets
rlimits (address space per process, process count, CPU seconds, file size), drops to a fresh unprivileged uid of its own
when started as root (so the process count is this program's alone), and runs the program. The caller reads output in
bounded pieces (at most `max_output` bytes of each stream), then ends the sandbox's PID namespace and waits until it is
empty, and kills the launcher's process group.

Where bubblewrap cannot run, `run_python` refuses with `SandboxUnavailable` (one line, naming the fix), unless the
caller opts in to the weaker guard (`weak_ok=True`, or SPECPREFILL_WEAK_SANDBOX=1): the same launcher, rlimits,
process-group kill and output cap in a plain child process, without the filesystem/network/PID boundary and without
the uid drop (so no process-count limit for root). Each result says which boundary it ran under.

Two files, `__init__` (running a program: limits, uid, output, teardown) and `bubblewrap` (the boundary), that import
nothing from the rest of the package: the attack suite (`tests/sandbox_attacks.py`) loads this folder on its own, as
the uid `nobody` too, and what guards model code is audited in one place.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import secrets
import select
import selectors
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, cast

from .bubblewrap import (  # noqa: F401  (bwrap_version, namespaces_problem: the sandbox's API, used by the tests)
    MIN_BWRAP,
    SITE,
    THREADS,
    WORKDIR,
    _bwrap_argv,
    _python,
    bwrap_version,
    namespaces_problem,
)

WEAK_ENV = "SPECPREFILL_WEAK_SANDBOX"
NOBODY = 65534
# As root the launcher drops to a uid of its own for each run, drawn from a span no account or container map uses:
# RLIMIT_NPROC counts every task of a uid machine-wide, so a shared uid (`nobody`) would count other programs' processes
# (another sandbox's zombies not yet reaped, a daemon) and refuse this program's forks.
RUN_UIDS = (2_100_000_000, 2_140_000_000)
FIX = (
    "install bubblewrap >= 0.7 (apt-get install bubblewrap) so model-written code runs in a sandbox, "
    f"or set {WEAK_ENV}=1 to accept the weaker guard (results are labelled 'weak')"
)

# Runs first in the child (as `python -I -S -c`): limits, uid drop, then the program; the marker (a fresh secret on
# stdin) is written only if the program returns normally, so `sys.exit(0)` / `os._exit(0)` before the tests finish do
# not count as success. Code that walks the interpreter's frames could still find it: the marker guards against
# premature exits, not against a program written to forge a pass.
_LAUNCHER = """
import os, resource, runpy, sys
mem, nproc, cpu, fsize, uid, path, site = sys.argv[1:8]
result_fd = os.dup(1)  # the marker goes here: a program that replaces or closes sys.stdout still passes
marker = sys.stdin.readline().strip()  # not in argv or environ, where the program could read it from /proc
sys.stdin.close(); os.close(0); os.open(os.devnull, os.O_RDONLY); sys.stdin = open(0)
for lim, val in ((resource.RLIMIT_AS, int(mem)), (resource.RLIMIT_NPROC, int(nproc)),
                 (resource.RLIMIT_CPU, int(cpu)), (resource.RLIMIT_FSIZE, int(fsize)), (resource.RLIMIT_CORE, 0)):
    resource.setrlimit(lim, (val, val))
if os.getuid() == 0 and int(uid) >= 0:
    os.setgroups([]); os.setgid(int(uid)); os.setuid(int(uid))
sys.argv = [path]
sys.path.insert(0, os.path.dirname(path))
if site:
    sys.path.append(site)
runpy.run_path(path, run_name="__main__")
try:
    sys.stdout.flush()
except Exception:
    pass
os.write(result_fd, ("\\n" + marker + "\\n").encode())
"""


class SandboxUnavailable(RuntimeError):
    pass


@dataclass
class RunResult:
    ok: bool  # exit status 0 and the launcher's marker printed after the program returned
    returncode: int | None
    stdout: str
    stderr: str
    timed_out: bool
    truncated: bool = False  # some output was dropped beyond max_output
    boundary: str = "bubblewrap"  # or "weak"
    started: bool = True  # bubblewrap built the sandbox and started the launcher (its status channel; weak: True)


@functools.lru_cache(maxsize=1)
def bwrap_problem() -> str | None:
    """None when bubblewrap runs here, else why not (one line). The probe is a real run of the full sandbox (every
    mount, namespace and limit), so a container that refuses one of them is found here, not in every pass@1."""
    version = bwrap_version()
    if shutil.which("bwrap") is not None and version is not None and version < MIN_BWRAP:
        need = ".".join(map(str, MIN_BWRAP))
        return f"bubblewrap {'.'.join(map(str, version))} is too old (the sandbox needs >= {need} for --size)"
    problem = namespaces_problem()
    if problem is not None:
        return problem
    try:
        probe = _execute(
            "pass", weak=False, timeout_s=30.0, memory_mb=1024, max_processes=4, max_output=4096, max_file_mb=1
        )
    except OSError as exc:
        return f"bwrap cannot start here: {exc}"
    if not probe.ok:
        last = (probe.stderr.strip().splitlines() or [f"exit status {probe.returncode}"])[-1]
        return f"bwrap cannot create the sandbox here: {last}"
    return None


def boundary(weak_ok: bool | None = None) -> str:
    """The boundary `run_python` uses here: "bubblewrap", or "weak" when bubblewrap cannot run and the caller opted
    in (argument, else the SPECPREFILL_WEAK_SANDBOX variable); otherwise SandboxUnavailable, naming the fix."""
    problem = bwrap_problem()
    if problem is None:
        return "bubblewrap"
    if weak_ok is None:
        weak_ok = os.environ.get(WEAK_ENV, "") not in ("", "0")
    if not weak_ok:
        raise SandboxUnavailable(f"cannot run model-written code: {problem}; {FIX}")
    return "weak"


def module_dirs(modules: tuple[str, ...]) -> list[Path]:
    """The installed directories of `modules` (top-level packages, e.g. "numpy") and their bundled shared libraries
    (`<name>.libs` beside them), which the sandbox mounts read-only so a test program can import them; one line
    naming the fix when one is not installed."""
    dirs = []
    for name in modules:
        spec = importlib.util.find_spec(name)
        if spec is None or not spec.submodule_search_locations:
            raise SandboxUnavailable(
                f"the sandbox cannot offer {name!r}: it is not an installed package here (pip install {name})"
            )
        where = Path(list(spec.submodule_search_locations)[0]).resolve()
        dirs += [d for d in (where, where.with_name(where.name + ".libs")) if d.is_dir()]
    return dirs


def run_uid() -> int:
    """The uid a sandboxed program runs as when the caller is root: fresh for each run, unused on this machine."""
    while True:
        uid = RUN_UIDS[0] + secrets.randbelow(RUN_UIDS[1] - RUN_UIDS[0])
        if not _user_task_count(uid):
            return uid


def _user_task_count(uid: int | None = None) -> int:
    """Threads of `uid` (default: this process's): what RLIMIT_NPROC counts outside a user namespace."""
    uid, n = os.getuid() if uid is None else uid, 0
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                if os.stat(f"/proc/{pid}").st_uid == uid:
                    n += len(os.listdir(f"/proc/{pid}/task"))
            except OSError:
                pass
    return n


def run_python(
    program: str,
    timeout_s: float = 10.0,
    memory_mb: int = 1024,
    max_processes: int = 4,
    max_output: int = 1 << 16,
    max_file_mb: int = 16,
    weak_ok: bool | None = None,
    modules: tuple[str, ...] = (),
) -> RunResult:
    """Run `program` as a Python script. `memory_mb` bounds the address space of all its processes together (each
    gets memory_mb / max_processes); `max_file_mb` bounds each file and the writable tmpfs is 4× that; `modules`:
    installed packages the program may import besides the standard library (mounted read-only, e.g. "numpy" for
    test programs that compare floats with it)."""
    weak = boundary(weak_ok) == "weak"
    dirs = module_dirs(modules)
    result = _execute(program, weak, timeout_s, memory_mb, max_processes, max_output, max_file_mb, dirs)
    if not result.started:  # the sandbox itself failed (bubblewrap's status says so): not a 0 for the program
        why = (result.stderr.strip().splitlines() or [f"exit status {result.returncode}"])[0]
        raise SandboxUnavailable(f"cannot run model-written code: {why}; {FIX}")
    return result


def _execute(
    program: str,
    weak: bool,
    timeout_s: float,
    memory_mb: int,
    max_processes: int,
    max_output: int,
    max_file_mb: int,
    modules: list[Path] | None = None,
) -> RunResult:
    marker = "specprefill-ok-" + secrets.token_hex(16)
    per_proc, nproc = _limits(weak, memory_mb, max_processes)
    with tempfile.TemporaryFile("w+b") as src, tempfile.TemporaryDirectory(prefix="specprefill-sandbox-") as tmp:
        src.write(program.encode())
        src.flush()
        src.seek(0)
        fds: tuple[int, ...]
        status_r, status_w = os.pipe()  # bubblewrap's own status channel (unused by the weak guard)
        os.set_blocking(status_r, False)
        if weak:  # weak guard: same launcher and limits, no namespace boundary
            argv, fds, (path, env, site) = [], (), _weak_files(tmp, program, modules or [])
        else:
            path, env, fds = f"{WORKDIR}/program.py", {}, (src.fileno(), status_w)
            argv = _bwrap_argv(src.fileno(), status_w, 4 * max_file_mb << 20, modules or [])
            site = SITE if modules else ""
        limits = [str(per_proc), str(nproc), str(int(timeout_s) + 1), str(max_file_mb << 20)]
        argv += [_python(), "-I", "-S", "-c", _LAUNCHER, *limits, str(-1 if weak else run_uid()), path, site]
        try:
            proc = subprocess.Popen(
                argv,
                cwd=tmp,
                env=env,
                pass_fds=fds,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,
            )
        except BaseException:
            os.close(status_r)
            raise
        finally:
            os.close(status_w)
        _send(proc, marker.encode() + b"\n")
        status = _Status(None if weak else status_r)
        try:
            out, err, tail, truncated, timed_out = _collect(proc, timeout_s, max_output, status)
        finally:
            os.close(status_r)
        started = weak or status.started
    ok = proc.returncode == 0 and not timed_out and tail.rstrip().endswith(marker.encode())
    text = out.decode(errors="replace").replace("\n" + marker + "\n", "").replace(marker, "")
    boundary_name = "weak" if weak else "bubblewrap"
    code = None if timed_out else proc.returncode
    return RunResult(ok, code, text, err.decode(errors="replace"), timed_out, truncated, boundary_name, started)


def _limits(weak: bool, memory_mb: int, max_processes: int) -> tuple[int, int]:
    """The launcher's rlimits: address space per process, and the process count (RLIMIT_NPROC counts per uid)."""
    per_proc = (memory_mb << 20) // max(1, max_processes)
    if os.getuid() == 0:  # the launcher drops to a uid no other process has (root is exempt from RLIMIT_NPROC)
        return per_proc, max_processes
    if not weak:  # counted per user namespace (Linux >= 5.14): bwrap's init, then the launcher and its children
        return per_proc, max_processes + 1
    return per_proc, _user_task_count() + max_processes  # counted over every thread of this uid


def _weak_files(tmp: str, program: str, modules: list[Path]) -> tuple[str, dict, str]:
    """The weak guard's program file, environment and site folder (the allowed packages by symlink: no mount without
    the namespace boundary), all under the run's temporary folder."""
    path = os.path.join(tmp, "program.py")
    with open(path, "w") as f:
        f.write(program)
    env = {"PATH": "/usr/bin:/bin", "HOME": tmp, "TMPDIR": tmp, "MALLOC_ARENA_MAX": "1", **THREADS}
    site = os.path.join(tmp, "site") if modules else ""
    if modules:
        os.mkdir(site)
        for d in modules:
            os.symlink(d, os.path.join(site, d.name))
    return path, env, site


def _send(proc: subprocess.Popen[bytes], data: bytes) -> None:
    """Write `data` to the launcher's stdin and close it; a sandbox that failed to start (its stderr says why) is
    not an error here."""
    assert proc.stdin is not None  # stdin=PIPE
    try:
        proc.stdin.write(data)
    except BrokenPipeError:
        pass
    finally:
        try:
            proc.stdin.close()
        except BrokenPipeError:
            pass


class _Status:
    """bubblewrap's status channel, read while the sandbox runs: "child-pid" (the host pid of the sandbox's first
    process, init of its PID namespace) arrives once the sandbox is built. A pidfd taken then lets the caller end the
    whole namespace at the end and wait until it is empty: detached processes inside die with it."""

    def __init__(self, fd: int | None):
        self.fd, self.data = fd, b""
        self.pidfd: int | None = None

    def read(self, chunk: bytes) -> None:
        self.data += chunk[: (1 << 16) - len(self.data)]
        if self.pidfd is None:
            for line in self.data.splitlines():
                try:
                    pid = json.loads(line).get("child-pid")
                except ValueError:
                    continue
                if isinstance(pid, int):
                    try:
                        self.pidfd = os.pidfd_open(pid)
                    except OSError:  # already gone: its namespace went with it
                        self.pidfd = -1
                    break

    @property
    def started(self) -> bool:
        return self.pidfd is not None

    def end(self, wait_s: float = 10.0) -> None:
        """Kill the namespace's init (the kernel then kills everything in the namespace) and wait until it has
        exited, which happens only once the namespace is empty."""
        if self.pidfd is None or self.pidfd < 0:
            return
        try:
            signal.pidfd_send_signal(self.pidfd, signal.SIGKILL)
            select.select([self.pidfd], [], [], wait_s)
        except ProcessLookupError:
            pass
        finally:
            os.close(self.pidfd)
            self.pidfd = -1


def _collect(
    proc: subprocess.Popen[bytes], timeout_s: float, cap: int, status: _Status
) -> tuple[bytes, bytes, bytes, bool, bool]:
    """Read both pipes (and bubblewrap's status) in pieces until they close or time runs out; keep the first `cap`
    bytes of each and the last 256 bytes of stdout (where the marker is). The sandbox's namespace and the whole
    process group are killed when this returns."""
    assert proc.stdout is not None and proc.stderr is not None  # stdout=PIPE, stderr=PIPE
    bufs: dict[IO[bytes], bytearray] = {proc.stdout: bytearray(), proc.stderr: bytearray()}
    tails: dict[IO[bytes], bytes] = {proc.stdout: b"", proc.stderr: b""}
    truncated = timed_out = False
    deadline = time.monotonic() + timeout_s
    sel = selectors.DefaultSelector()
    for f in bufs:
        os.set_blocking(f.fileno(), False)
        sel.register(f, selectors.EVENT_READ)
    if status.fd is not None:
        sel.register(status.fd, selectors.EVENT_READ)
    try:
        while sel.get_map():
            left = deadline - time.monotonic()
            if left <= 0:
                timed_out = True
                break
            for key, _ in sel.select(min(left, 0.5)):
                chunk = os.read(key.fd, 1 << 16)
                if not chunk:
                    sel.unregister(key.fileobj)
                    continue
                if key.fd == status.fd:
                    status.read(chunk)
                    continue
                fileobj = cast(IO[bytes], key.fileobj)  # one of the two pipes registered above
                buf = bufs[fileobj]
                room = cap - len(buf)
                if room > 0:
                    buf += chunk[:room]
                truncated |= len(chunk) > room
                tails[fileobj] = (tails[fileobj] + chunk)[-256:]
    finally:
        sel.close()
        status.end()
        _kill_group(proc)
        for f in bufs:
            f.close()
    return bytes(bufs[proc.stdout]), bytes(bufs[proc.stderr]), bytes(tails[proc.stdout]), truncated, timed_out


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()
