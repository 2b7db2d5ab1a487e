"""The sandbox for model-written code, attacked: every attack must be contained (nothing written outside the sandbox,
no connection accepted, the caller alive, no process left, the caller's memory flat), and pass@1 counts only a
program that ran its tests to the end. Sizes and timeouts are small so the file runs in seconds."""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from specprefill.data import metrics, sandbox
from specprefill.data.sandbox import run_python

sys.path.insert(0, str(Path(__file__).parent))
import sandbox_attacks  # noqa: E402  (beside this file; stdlib only, so it also runs as `nobody`)

# Skipped only when this machine will not let bubblewrap make namespaces at all (a minimal sandbox fails); then the
# reason is the machine's. As root `make setup` installs bubblewrap, so a missing bwrap fails here. When namespaces
# work, a sandbox that cannot be built (our own arguments wrong) fails every test below.
needs_namespaces = pytest.mark.skipif(
    sandbox.namespaces_problem() is not None and (os.getuid() != 0 or shutil.which("bwrap") is not None),
    reason=f"{sandbox.namespaces_problem()} (make setup installs bubblewrap when run as root)",
)


@pytest.fixture(scope="module")
def ctx(tmp_path_factory):
    c = sandbox_attacks.Context(str(tmp_path_factory.mktemp("scratch")))
    yield c
    c.close()


@needs_namespaces
def test_the_sandbox_builds_here():
    assert sandbox.bwrap_problem() is None


@needs_namespaces
def test_runs_plain_programs():
    r = run_python("import math\nprint(math.factorial(5))")
    assert (r.ok, r.stdout.strip(), r.boundary, r.started) == (True, "120", "bubblewrap", True)
    assert not run_python("raise ValueError('x')").ok
    assert run_python("from __future__ import annotations\nx: int = 1\nprint(x)").ok
    # the project and the interpreter are read-only or absent
    src = os.path.join(os.path.dirname(sandbox.__file__), "pwned.py")
    run_python(f"open({src!r}, 'w').write('x')\nopen({sys.base_prefix + '/pwned'!r}, 'w').write('x')", timeout_s=5)
    assert not os.path.exists(src) and not os.path.exists(sys.base_prefix + "/pwned")


@needs_namespaces
@pytest.mark.parametrize("name", list(sandbox_attacks.attacks()))
def test_attack_is_contained(ctx, name):
    """Each attack of `sandbox_attacks` as the uid running the tests (root: bubblewrap without a user namespace, the
    launcher drops to `nobody`); this process must be alive afterwards to report."""
    assert sandbox_attacks.attacks()[name](run_python, ctx) is None


@needs_namespaces
def test_the_process_limit_counts_this_program_alone():
    """As root the program runs under a uid no other process has: tasks of a shared uid elsewhere on the machine (six
    sleepers as `nobody`, more than the limit) do not refuse its forks."""
    if os.getuid() != 0:
        pytest.skip("not root: the program keeps the caller's uid inside its own user namespace")
    sleepers = [
        subprocess.Popen(
            ["setpriv", f"--reuid={sandbox.NOBODY}", f"--regid={sandbox.NOBODY}", "--clear-groups", "sleep", "60"]
        )
        for _ in range(6)
    ]
    try:
        program = "import os\nif os.fork() == 0:\n    os._exit(0)\nos.wait()\nprint('forked')"
        r = run_python(program, max_processes=4)
        assert (r.ok, r.stdout.strip()) == (True, "forked"), r.stderr[-500:]
    finally:
        for p in sleepers:
            p.kill()
            p.wait()


def _nobody_python() -> str | None:
    """An interpreter the uid `nobody` can run: the system's (the tests' own may live under root's private home)."""
    for candidate in ("/usr/bin/python3", os.path.realpath(sys.executable)):
        cmd = ["setpriv", f"--reuid={sandbox.NOBODY}", f"--regid={sandbox.NOBODY}", "--clear-groups", candidate]
        if os.path.exists(candidate) and subprocess.run([*cmd, "-c", "pass"], capture_output=True).returncode == 0:
            return candidate
    return None


@needs_namespaces
def test_attacks_are_contained_as_nobody():
    """The same attacks through bubblewrap's unprivileged path (user namespaces), run by `nobody`."""
    if os.getuid() != 0:
        pytest.skip("not root: the attacks above already ran on the unprivileged path")
    if shutil.which("setpriv") is None:
        pytest.fail("setpriv (util-linux) is needed to run the attacks as nobody")
    python = _nobody_python()
    if python is None:
        pytest.skip("no Python interpreter here that the uid nobody may run")
    as_nobody = ["setpriv", f"--reuid={sandbox.NOBODY}", f"--regid={sandbox.NOBODY}", "--clear-groups"]
    probe = subprocess.run([*as_nobody, "bwrap", "--ro-bind", "/", "/", "--unshare-all", "true"], capture_output=True)
    if probe.returncode != 0:  # the machine's rule (e.g. unprivileged user namespaces off), not our arguments
        pytest.skip(f"this machine does not let unprivileged users create namespaces: {probe.stderr.decode()[-200:]}")
    with tempfile.TemporaryDirectory(prefix="specprefill-as-nobody-") as tmp:  # under /tmp: every uid may enter
        folder = Path(tmp)
        os.chmod(folder, 0o755)
        shutil.copytree(Path(sandbox.__file__).parent, folder / "sandbox", ignore=shutil.ignore_patterns("__pycache__"))
        shutil.copy(sandbox_attacks.__file__, folder / "sandbox_attacks.py")
        for d in (folder / "sandbox", *(folder / "sandbox").iterdir()):
            os.chmod(d, 0o755 if d.is_dir() else 0o644)
        run = _as_nobody(python, folder)
    assert run.returncode == 0, run.stdout + run.stderr[-2000:]
    results = json.loads(run.stdout.strip().splitlines()[-1])
    assert results.pop("uid") == sandbox.NOBODY
    assert set(results) == set(sandbox_attacks.attacks())
    assert {k: v for k, v in results.items() if v is not None} == {}


def _as_nobody(python: str, folder: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["setpriv", f"--reuid={sandbox.NOBODY}", f"--regid={sandbox.NOBODY}", "--clear-groups", python]
        + [str(folder / "sandbox_attacks.py"), str(folder)],
        capture_output=True,
        text=True,
        timeout=600,
        env={"PATH": "/usr/bin:/bin"},
        cwd=folder,
    )


@needs_namespaces
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


@needs_namespaces
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


@needs_namespaces
def test_test_programs_may_import_the_packages_offered_read_only():
    """EvalPlus's test programs compare floats with numpy: offered (read-only) only when asked, never a package the
    caller did not name, and a name that is not installed is a one-line error."""
    program = "import numpy as np\nnp.testing.assert_allclose([0.1 + 0.2], [0.3], atol=1e-6)\nprint(np.ones(2).sum())"
    assert not run_python(program).ok  # the standard library only by default
    r = run_python(program, modules=("numpy",))
    assert r.ok and r.stdout.strip() == "2.0", r.stderr[-400:]
    write = "import numpy, os\nopen(os.path.join(os.path.dirname(numpy.__file__), 'x'), 'w')"
    assert not run_python(write, modules=("numpy",)).ok
    assert not run_python("import pandas", modules=("numpy",)).ok
    with pytest.raises(sandbox.SandboxUnavailable, match="pip install no_such_package_here"):
        run_python("pass", modules=("no_such_package_here",))


def test_offered_packages_under_the_weak_guard():
    r = run_python("import numpy\nprint(numpy.__name__)", modules=("numpy",), weak_ok=True)
    assert r.stdout.strip() == "numpy" and r.ok, r.stderr[-400:]


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


def test_old_bubblewrap_is_named(monkeypatch):
    monkeypatch.setattr(sandbox, "bwrap_version", lambda: (0, 6, 1))
    monkeypatch.setattr(shutil, "which", lambda name: "/usr/bin/bwrap")
    problem = sandbox.bwrap_problem.__wrapped__()
    assert problem is not None and "0.6.1 is too old" in problem and ">= 0.7" in problem


@needs_namespaces
def test_program_output_is_not_the_sandbox_signal():
    # a program that says "bwrap:" and fails is the program failing (a 0), not the sandbox
    r = run_python("import sys\nsys.stderr.write('bwrap: Can\\'t mount proc\\n')\nsys.exit(1)")
    assert (r.ok, r.started, r.returncode) == (False, True, 1)


@needs_namespaces
def test_a_sandbox_that_cannot_start_is_refused(monkeypatch):
    # bubblewrap's status channel says the sandbox was never built: no score, a one-line error. The machine's probe
    # runs first with the real arguments (it is cached for the process), so the refusal below is the status channel's
    # and the broken arguments never become what later tests see as this machine's verdict.
    assert sandbox.bwrap_problem() is None
    real = sandbox._bwrap_argv
    monkeypatch.setattr(sandbox, "_bwrap_argv", lambda *a: [*real(*a)[:-1], "--no-such-option", "--"])
    with pytest.raises(sandbox.SandboxUnavailable, match="no-such-option"):
        run_python("print(1)")
