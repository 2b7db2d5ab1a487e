"""Attacks on the sandbox for model-written code, each with what containment means. Standard library only, and the
sandbox module is passed in, so the same attacks run in the test process (as whoever runs the tests: root here) and,
copied to a scratch folder, under the system's Python as the uid `nobody` (bubblewrap's unprivileged path):

    python sandbox_attacks.py <folder holding sandbox/>    # prints one JSON object: attack -> failure or null

An attack's check returns None when contained, else what went wrong.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import uuid
from collections.abc import Callable


class Context:
    """What the checks look at: a folder anybody may write (so only the sandbox can stop a write there), a listening
    socket, the caller's pid."""

    def __init__(self, scratch: str):
        self.scratch = scratch
        os.chmod(scratch, 0o777)
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(8)
        self.listener.settimeout(0.5)
        self.port = self.listener.getsockname()[1]

    def accepted(self) -> bool:
        try:
            conn, _ = self.listener.accept()
            conn.close()
            return True
        except (TimeoutError, BlockingIOError):
            return False

    def close(self) -> None:
        self.listener.close()


def leftovers(token: str) -> list[int]:
    """Processes anywhere on the machine whose command line carries `token` (sandboxed ones included: their pids
    differ inside, but the host's /proc lists them)."""
    out = []
    for pid in os.listdir("/proc"):
        if pid.isdigit() and int(pid) != os.getpid():
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if token.encode() in f.read():
                        out.append(int(pid))
            except OSError:
                pass
    return out


WRITES = [
    "open({path!r}, 'w').write('pwned')",
    "import os; os.system('echo pwned > {path}')",
    "import os; os.posix_spawn('/bin/sh', ['sh', '-c', 'echo pwned > {path}'], {{}}); os.wait()",
    "import ctypes; ctypes.CDLL(None).system(b'echo pwned > {path}')",
    "import posix; pid = posix.fork()\nif pid == 0:\n    open({path!r}, 'w').write('pwned')\n"
    "    posix._exit(0)\nposix.waitpid(pid, 0)",
]

NETWORK = [
    "import socket; s = socket.socket(); s.connect(('127.0.0.1', {port}))",
    "import _socket; s = _socket.socket(); s.connect(('127.0.0.1', {port}))",
    "import importlib, socket; importlib.reload(socket); socket.create_connection(('127.0.0.1', {port}))",
    "import os; os.system('python3 -c \"import socket; socket.create_connection((\\'127.0.0.1\\', {port}))\"')",
]

KILLS = [
    "import os; os.kill(os.getppid(), 9)",
    "import os; os.killpg(0, 9)",
    "import os, signal\nfor pid in range(1, 400):\n    try: os.kill(pid, signal.SIGKILL)\n    except OSError: pass",
    "import os; os.kill({me}, 9)",
]

# a process that outlives the program, its command line carrying {token} so the host can look for it
_SLEEPER = (
    "import os, sys, time\nif os.fork() == 0:\n    os.setsid()\n"
    "    os.execv(sys.executable, [sys.executable, '-c', 'import time; time.sleep(120)', {token!r}])\n"
)
LEFT_BEHIND = {
    "returns": (_SLEEPER, False),  # the program returns at once: ok, and the sleeper must still be gone
    "times_out": (_SLEEPER + "time.sleep(120)\n", True),  # the program itself is killed at the timeout
}

# a few hundred small files where nothing may be written: the root and /dev/shm of the sandbox
FILL = """
import os
made = 0
for where in ({where!r},):
    for i in range(200):
        try:
            with open(os.path.join(where, 'fill%d' % i), 'wb') as f:
                f.write(b'x' * 65536)
            made += 1
        except OSError:
            break
print('made', made)
"""


def _writes(run, ctx: Context, how: str) -> str | None:
    target = os.path.join(ctx.scratch, "outside-" + uuid.uuid4().hex)
    run(how.format(path=target), timeout_s=5)
    return f"wrote {target}" if os.path.exists(target) else None


def _network(run, ctx: Context, how: str) -> str | None:
    run(how.format(port=ctx.port), timeout_s=5)
    return "a connection reached the host" if ctx.accepted() else None


def _kill(run, ctx: Context, how: str) -> str | None:
    token = "sp-" + uuid.uuid4().hex
    run(_SLEEPER.format(token=token) + how.format(me=os.getpid()), timeout_s=5)
    left = leftovers(token)  # and this process is alive to look
    return f"processes left: {left}" if left else None


def _left_behind(run, ctx: Context, program: str, times_out: bool) -> str | None:
    token = "sp-" + uuid.uuid4().hex
    r = run(program.format(token=token), timeout_s=2)
    if times_out != r.timed_out or (not times_out and not r.ok):
        return f"unexpected result {r}"
    left = leftovers(token)
    return f"processes left: {left}" if left else None


def _fill(run, ctx: Context, where: str) -> str | None:
    r = run(FILL.format(where=where), timeout_s=10)
    if not r.ok:
        return f"the program failed: {r.stderr[-300:]}"
    return None if r.stdout.split() == ["made", "0"] else f"{where}: {r.stdout.strip()}"


def _secrets(run, ctx: Context) -> str | None:
    secret = "sp-secret-" + uuid.uuid4().hex
    os.environ["SPECPREFILL_TEST_SECRET"] = secret
    try:
        r = run(
            "import os, glob\nprint(dict(os.environ))\n"
            "for p in glob.glob('/proc/*/environ') + ['/proc/%d/environ' % os.getppid()]:\n"
            "    try: print(open(p, 'rb').read())\n    except OSError: print('denied', p)\n"
            "for p in ('/etc/passwd', '/etc/shadow', os.path.expanduser('~root/.bash_history')):\n"
            "    try: print(open(p).read())\n    except OSError: print('denied', p)\n"
            "print(os.listdir('/'))\n",
            timeout_s=5,
        )
    finally:
        del os.environ["SPECPREFILL_TEST_SECRET"]
    if not r.ok:
        return f"the program failed: {r.stderr[-300:]}"
    seen = [s for s in (secret, "root:x:0", "'etc'", "'work'", "'home'") if s in r.stdout]
    return f"visible inside: {seen}" if seen else None


def _limits(run, ctx: Context) -> str | None:
    forks = run(
        "import os\nkids = []\nfor i in range(6):\n    try:\n        pid = os.fork()\n"
        "    except OSError:\n        print('fork refused'); break\n    if pid == 0:\n        try:\n"
        "            b = bytearray(200 << 20); print('allocated', flush=True)\n"
        "        except MemoryError:\n            print('refused', flush=True)\n        os._exit(0)\n"
        "    kids.append(pid)\nfor pid in kids:\n    os.waitpid(pid, 0)\n",
        timeout_s=10,
        memory_mb=512,
        max_processes=4,
    )
    if forks.stdout.count("allocated") * 200 > 512 or "fork refused" not in forks.stdout:
        return f"process/memory limits not applied: {forks.stdout!r}"
    if run("x = bytearray(1 << 30)", memory_mb=256).ok:
        return "1 GiB allocated under a 256 MiB limit"
    if run("open('big', 'wb').write(b'x' * (64 << 20))", max_file_mb=4).ok:
        return "a 64 MiB file written under a 4 MiB limit"
    if not run("while True: pass", timeout_s=1).timed_out:
        return "a busy loop was not stopped"
    return None


def attacks() -> dict[str, Callable]:
    """name -> check(run_python, ctx)."""
    out: dict[str, Callable] = {}
    for i, how in enumerate(WRITES):
        out[f"write_outside_{i}"] = lambda run, ctx, how=how: _writes(run, ctx, how)
    for i, how in enumerate(NETWORK):
        out[f"network_{i}"] = lambda run, ctx, how=how: _network(run, ctx, how)
    for i, how in enumerate(KILLS):
        out[f"kill_{i}"] = lambda run, ctx, how=how: _kill(run, ctx, how)
    for name, (program, times_out) in LEFT_BEHIND.items():
        out[f"left_behind_{name}"] = lambda run, ctx, p=program, t=times_out: _left_behind(run, ctx, p, t)
    for where in ("/", "/dev/shm", "/dev"):
        out[f"fill_{where.strip('/').replace('/', '_') or 'root'}"] = lambda run, ctx, w=where: _fill(run, ctx, w)
    out["secrets"] = _secrets
    out["limits"] = _limits
    return out


def main(folder: str) -> int:
    import importlib.util
    import tempfile

    package = os.path.join(folder, "sandbox")  # the sandbox package, copied here on its own
    spec = importlib.util.spec_from_file_location(
        "sandbox", os.path.join(package, "__init__.py"), submodule_search_locations=[package]
    )
    assert spec is not None and spec.loader is not None
    sandbox = importlib.util.module_from_spec(spec)
    sys.modules["sandbox"] = sandbox  # dataclasses look their module up
    spec.loader.exec_module(sandbox)
    problem = sandbox.bwrap_problem()
    if problem is not None:
        print(json.dumps({"_sandbox": problem}))
        return 1
    results = {}
    with tempfile.TemporaryDirectory() as scratch:
        ctx = Context(scratch)
        try:
            for name, check in attacks().items():
                try:
                    results[name] = check(sandbox.run_python, ctx)
                except Exception as exc:  # a check that crashes is a failure to report, not to hide
                    results[name] = f"{type(exc).__name__}: {exc}"
        finally:
            ctx.close()
    print(json.dumps({"uid": os.getuid(), **results}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1]))
