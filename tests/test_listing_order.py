"""The suite's guard against folder-order dependence (tests/listing_order/sitecustomize.py, installed by conftest):
listings come back shuffled by the printed seed, in the test process and in its Python subprocesses, so code that
reads "the first file" fails on every machine; and a static check for the shape that failed before."""

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import _listing_guard, plain_env

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(
    os.environ.get("SPECPREFILL_LISTING_GUARD") == "off", reason="SPECPREFILL_LISTING_GUARD=off: the guard is not on"
)
NAMES = [f"unit-{c}.json" for c in "qwertyuiop"]


def _folder(tmp_path: Path) -> Path:
    for name in NAMES:  # created in this order: what a tmpfs lists back (ext4 lists by a hash)
        (tmp_path / name).write_text(name)
    return tmp_path


@pytest.mark.parametrize(
    "listing",
    [
        lambda p: [q.name for q in p.glob("*.json")],
        lambda p: [q.name for q in p.iterdir()],
        lambda p: os.listdir(p),
        lambda p: [e.name for e in os.scandir(p)],
        lambda p: next(os.walk(p))[2],
    ],
)
def test_every_listing_is_shuffled_the_same_way_on_every_machine(tmp_path, listing):
    folder = _folder(tmp_path)
    got = listing(folder)
    assert sorted(got) == sorted(NAMES)
    natural = os.listdir.unguarded(folder)  # the filesystem's order (a tmpfs: creation; ext4: a hash)
    assert got not in (natural, sorted(NAMES))
    assert got[0] != sorted(NAMES)[0] and got[-1] != sorted(NAMES)[-1]
    assert got == listing(folder)  # the same order within a run
    seed = os.environ["SPECPREFILL_LISTING_SEED"]
    assert got == _listing_guard().reorder(NAMES[::-1], NAMES[::-1], seed)  # ... whatever order the disk gives
    assert [p.name for p in sorted(folder.glob("*.json"))] == sorted(NAMES)  # sorting is the fix


def test_a_subprocess_lists_in_the_same_shuffled_order(tmp_path):
    folder = _folder(tmp_path)
    code = "import os, sys; print(' '.join(os.listdir(sys.argv[1])))"
    out = subprocess.run([sys.executable, "-c", code, str(folder)], env=plain_env(), capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == os.listdir(folder) != os.listdir.unguarded(folder)


def test_the_shuffle_edge_cases():
    guard = _listing_guard()
    assert guard.reorder([], [], "1") == [] and guard.reorder(["a"], ["a"], "1") == ["a"]
    assert guard.reorder(["a", "b"], ["a", "b"], "1") == ["b", "a"]
    for seed in range(50):
        names = ["c", "a", "b"]  # three entries: never the filesystem's order nor the sorted one
        got = guard.reorder(names, names, str(seed))
        assert sorted(got) == ["a", "b", "c"] and got not in (names, ["a", "b", "c"])
        many = [f"f{i}" for i in range(7)]
        got = guard.reorder(many[::-1], many[::-1], str(seed))
        assert {got[0], got[-1]}.isdisjoint({"f0", "f6"}) and got == guard.reorder(many, many, str(seed))
    firsts = {guard.reorder(many, many, str(seed))[0] for seed in range(50)}
    assert len(firsts) == 5  # any of the inner entries can come first: a dependence fails for some seed


def test_the_python_installation_is_listed_as_the_filesystem_lists_it():
    """Only the project's and the tests' folders are guarded: a library's listing of its own files is left alone."""
    guard = _listing_guard()
    assert not guard._guarded(os.path.dirname(os.__file__)) and not guard._guarded(3)
    assert guard._guarded(str(ROOT))


ORDER_BLIND = {"glob", "rglob", "iterdir", "listdir", "scandir"}


def _listing_call(node) -> bool:
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, (ast.Attribute, ast.Name))
        and (node.func.attr if isinstance(node.func, ast.Attribute) else node.func.id) in ORDER_BLIND
    )


def test_no_code_takes_the_first_or_last_entry_of_an_unsorted_listing():
    """The shape that failed on one machine: `next(p.glob(...))`, `list(p.iterdir())[0]`, `os.listdir(d)[-1]`. The
    shuffled listings catch what runs; this catches what a test run may not reach."""
    found = []
    files = [*sorted((ROOT / "src").rglob("*.py")), *sorted((ROOT / "tests").glob("*.py"))]
    files += sorted(ROOT.glob("*/*.py"))  # scripts/, notebooks' helpers
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "next" and node.args:
                arg = node.args[0]
                if _listing_call(arg) or (isinstance(arg, ast.Call) and arg.args and _listing_call(arg.args[0])):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
            if isinstance(node, ast.Subscript) and isinstance(node.slice, (ast.Constant, ast.UnaryOp)):
                value = node.value
                if _listing_call(value) or (
                    isinstance(value, ast.Call) and value.args and _listing_call(value.args[0])
                    and isinstance(value.func, ast.Name) and value.func.id == "list"
                ):  # fmt: skip
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    found = sorted(set(found))
    assert not found, f"the first/last entry of an unsorted listing (sort it, or pick by name): {found}"
