"""Run model-written code only here: a separate Python process with time and memory limits, no network, and an
empty temporary working directory that is removed afterwards."""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass

# installed in the child before the program runs: no sockets, no subprocesses
_GUARD = """
import socket, subprocess, os, resource
resource.setrlimit(resource.RLIMIT_AS, ({mem}, {mem}))
resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 24, 1 << 24))
def _blocked(*a, **k):
    raise PermissionError("network and process creation are disabled in the sandbox")
socket.socket = _blocked
socket.create_connection = _blocked
subprocess.Popen = _blocked
os.system = _blocked
for _name in ("fork", "forkpty", "execv", "execve", "spawnv", "kill"):
    if hasattr(os, _name):
        setattr(os, _name, _blocked)
"""


@dataclass
class RunResult:
    ok: bool
    returncode: int | None
    stdout: str
    stderr: str
    timed_out: bool


def run_python(program: str, timeout_s: float = 10.0, memory_mb: int = 1024) -> RunResult:
    with tempfile.TemporaryDirectory(prefix="specprefill-sandbox-") as tmp:
        path = os.path.join(tmp, "program.py")
        with open(path, "w") as f:
            f.write(_GUARD.format(mem=memory_mb << 20) + "\n" + program)
        env = {"PATH": "/usr/bin:/bin", "HOME": tmp, "PYTHONDONTWRITEBYTECODE": "1", "no_proxy": "*",
               "http_proxy": "http://0.0.0.0:9", "https_proxy": "http://0.0.0.0:9"}
        try:
            proc = subprocess.run([sys.executable, "-I", path], cwd=tmp, env=env, capture_output=True, text=True,
                                  timeout=timeout_s, stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired as exc:
            return RunResult(False, None, exc.stdout or "", exc.stderr or "", True)
        return RunResult(proc.returncode == 0, proc.returncode, proc.stdout[-5000:], proc.stderr[-5000:], False)
