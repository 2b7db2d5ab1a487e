"""The sandbox for model-written code, attacked: every attack must be contained (nothing written outside the sandbox,
no connection accepted, the caller alive, no process left, the caller's memory flat), and pass@1 counts only a
program that ran its tests to the end. Sizes and timeouts are small so the file runs in seconds."""

from __future__ import annotations

import os
import resource
import shutil
import socket
import sys
import uuid

import pytest

from specprefill.data import metrics, sandbox
from specprefill.data.sandbox import run_python

# As root `make setup` installs bubblewrap, so a missing bwrap fails here; a bwrap the kernel will not let build a
# sandbox (no user/mount namespaces in this container) skips, naming why.
pytestmark = pytest.mark.skipif(
    sandbox.bwrap_problem() is not None and (os.getuid() != 0 or shutil.which("bwrap") is not None),
    reason=f"{sandbox.bwrap_problem()} (make setup installs bubblewrap when run as root)",
)


def _leftovers(token: str) -> list[int]:
    """Processes anywhere on the machine whose command line carries `token`."""
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


@pytest.fixture
def listener():
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    srv.settimeout(0.5)
    yield srv
    srv.close()


def _accepted(srv) -> bool:
    try:
        conn, _ = srv.accept()
        conn.close()
        return True
    except (TimeoutError, BlockingIOError):
        return False


def test_runs_plain_programs():
    r = run_python("import math\nprint(math.factorial(5))")
    assert (r.ok, r.stdout.strip(), r.boundary) == (True, "120", "bubblewrap")
    assert not run_python("raise ValueError('x')").ok
    assert run_python("from __future__ import annotations\nx: int = 1\nprint(x)").ok


@pytest.mark.parametrize(
    "how",
    [
        "open({path!r}, 'w').write('pwned')",
        "import os; os.system('echo pwned > {path}')",
        "import os; os.posix_spawn('/bin/sh', ['sh', '-c', 'echo pwned > {path}'], {{}}); os.wait()",
        "import ctypes; ctypes.CDLL(None).system(b'echo pwned > {path}')",
        "import posix; pid = posix.fork()\nif pid == 0:\n    open({path!r}, 'w').write('pwned')\n"
        "    posix._exit(0)\nposix.waitpid(pid, 0)",
    ],
)
def test_writes_outside_are_contained(tmp_path, how):
    target = tmp_path / "outside.txt"
    run_python(how.format(path=str(target)), timeout_s=5)
    assert not target.exists()
    # the project and the interpreter are read-only or absent
    src = os.path.join(os.path.dirname(sandbox.__file__), "pwned.py")
    run_python(f"open({src!r}, 'w').write('x')\nopen({sys.base_prefix + '/pwned'!r}, 'w').write('x')", timeout_s=5)
    assert not os.path.exists(src) and not os.path.exists(sys.base_prefix + "/pwned")


def test_no_secrets_visible(monkeypatch):
    secret = "sp-secret-" + uuid.uuid4().hex
    monkeypatch.setenv("SPECPREFILL_TEST_SECRET", secret)
    program = """
import os, glob
print(dict(os.environ))
for p in glob.glob('/proc/*/environ') + ['/proc/%d/environ' % os.getppid()]:
    try: print(open(p, 'rb').read())
    except OSError as e: print('denied', p)
for p in ('/etc/passwd', '/etc/shadow', os.path.expanduser('~root/.bash_history')):
    try: print(open(p).read())
    except OSError as e: print('denied', p)
print(os.listdir('/'))
"""
    r = run_python(program, timeout_s=5)
    assert r.ok and secret not in r.stdout and "root:x:0" not in r.stdout
    assert "'etc'" not in r.stdout and "'work'" not in r.stdout


@pytest.mark.parametrize(
    "how",
    [
        "import socket; s = socket.socket(); s.connect(('127.0.0.1', {port}))",
        "import _socket; s = _socket.socket(); s.connect(('127.0.0.1', {port}))",
        "import importlib, socket; importlib.reload(socket); socket.create_connection(('127.0.0.1', {port}))",
        "import os; os.system('python3 -c \"import socket; socket.create_connection((\\'127.0.0.1\\', {port}))\"')",
    ],
)
def test_no_network(listener, how):
    run_python(how.format(port=listener.getsockname()[1]), timeout_s=5)
    assert not _accepted(listener)


@pytest.mark.parametrize(
    "how",
    [
        "import os; os.kill(os.getppid(), 9)",
        "import os; os.killpg(0, 9)",
        "import os, signal\nfor pid in range(1, 400):\n    try: os.kill(pid, signal.SIGKILL)\n    except OSError: pass",
        "import os; os.kill({me}, 9)",
    ],
)
def test_caller_survives_kill_attempts(how):
    r = run_python(how.format(me=os.getpid()), timeout_s=5)
    assert not r.ok  # and this test process is still here to say so


@pytest.mark.parametrize(
    "how",
    [
        # leave a detached sleeper behind and return
        "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(120)\n",
        # and the same while the program itself times out
        "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(120)\ntime.sleep(120)\n",
        # a grandchild still writing into the sandbox's directory when the program returns
        "import os\nif os.fork() == 0:\n    os.setsid()\n    while True:\n"
        "        open('f%d' % (os.getpid() % 7), 'a').write('x' * 4096)\n",
    ],
)
def test_no_process_left(how):
    token = "sp-" + uuid.uuid4().hex
    r = run_python(f"# {token}\n" + how, timeout_s=2)
    assert not r.ok or r.returncode == 0
    assert _leftovers(token) == [] and _leftovers("specprefill-sandbox") == []


def test_process_and_memory_limits():
    # several processes cannot add up past the memory budget: each gets memory_mb / max_processes
    program = """
import os
kids = []
for i in range(6):
    try:
        pid = os.fork()
    except OSError:
        print('fork refused'); break
    if pid == 0:
        try:
            b = bytearray(200 << 20); print('allocated', flush=True)
        except MemoryError:
            print('refused', flush=True)
        os._exit(0)
    kids.append(pid)
for pid in kids:
    os.waitpid(pid, 0)
"""
    r = run_python(program, timeout_s=10, memory_mb=512, max_processes=4)
    assert r.stdout.count("allocated") * 200 <= 512
    assert "fork refused" in r.stdout
    assert not run_python("x = bytearray(1 << 30)", memory_mb=256).ok
    # file size and CPU time
    big = run_python("open('big', 'wb').write(b'x' * (64 << 20))", max_file_mb=4)
    assert not big.ok
    assert run_python("while True: pass", timeout_s=1).timed_out


def test_output_flood_is_capped_and_memory_flat():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    r = run_python(
        "import sys\nfor _ in range(64):\n    sys.stdout.write('x' * (1 << 20))\nprint('end')",
        timeout_s=20,
        max_output=1 << 16,
    )
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    assert r.truncated and r.ok and len(r.stdout) <= (1 << 16) + 64
    assert (after - before) < 32 << 10  # KiB: a 64 MiB flood moves the peak by less than 32 MiB
    r = run_python("import sys\nwhile True:\n    sys.stdout.write('y' * 65536)", timeout_s=1, max_output=1000)
    assert r.timed_out and isinstance(r.stdout, str) and len(r.stdout) <= 1100


def test_pass_at_1_needs_the_tests_to_finish():
    tests = "def check(f):\n    assert f(1, 2) == 3\ncheck(add)\n"
    assert metrics.pass_at_1("def add(a, b):\n    return a + b\n", tests) == 100.0
    assert metrics.pass_at_1("def add(a, b):\n    return a - b\nraise SystemExit(0)\n", tests) == 0.0
    assert metrics.pass_at_1("def add(a, b):\n    return a - b\nimport os; os._exit(0)\n", tests) == 0.0
    assert (
        metrics.pass_at_1(
            "def add(a, b):\n    return a - b\nimport atexit, os\natexit.register(os._exit, 0)\n"
            "import sys; sys.excepthook = lambda *a: None\n",
            tests,
        )
        == 0.0
    )
    rec = {"metric": "pass@1", "input": "def add(a, b):\n", "entry_point": "add", "tests": tests}
    fenced = "```python\nfrom __future__ import annotations\n\ndef add(a: int, b: int) -> int:\n    return a + b\n```"
    assert metrics.score(rec, fenced) == 100.0


def test_refuses_without_bubblewrap_unless_opted_in(monkeypatch):
    monkeypatch.setattr(sandbox, "bwrap_problem", lambda: "bubblewrap (bwrap) is not installed")
    monkeypatch.delenv(sandbox.WEAK_ENV, raising=False)
    with pytest.raises(sandbox.SandboxUnavailable, match="apt-get install bubblewrap"):
        run_python("print(1)")
    r = run_python("print(1)", weak_ok=True)
    assert (r.ok, r.stdout.strip(), r.boundary) == (True, "1", "weak")
    monkeypatch.setenv(sandbox.WEAK_ENV, "1")
    assert sandbox.boundary() == "weak"
    assert not run_python("raise SystemExit(0)").ok
