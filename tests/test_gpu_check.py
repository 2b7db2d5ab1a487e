"""`make gpu-check` on a machine without a GPU, and what it would check on one."""

import ast
import importlib.util
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def _gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_gpu_test_is_a_listed_check_and_every_check_says_what_it_covers(capsys):
    gpu_check = _gpu_check()
    tests = {
        n.name for n in ast.parse((ROOT / "tests" / "test_gpu.py").read_text()).body if isinstance(n, ast.FunctionDef)
    }
    tests = {t for t in tests if t.startswith("test_")}
    assert tests and tests <= set(gpu_check.CHECKS)
    built = {name for name, (_, refusal) in gpu_check.CHECKS.items() if refusal is None}
    assert built == tests | {"engine_tests"}  # a check not built says why (reported as refused, never skipped)
    assert gpu_check.main(["--list"]) == 0
    listed = capsys.readouterr().out.strip().splitlines()
    assert [line.split(":")[0] for line in listed] == list(gpu_check.CHECKS)


def test_without_a_gpu_it_says_so_in_one_line(capsys, monkeypatch, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert _gpu_check().main(["--out", str(tmp_path)]) == 0
    out = capsys.readouterr()
    assert out.err == "" and len(out.out.strip().splitlines()) == 1 and "no CUDA GPU" in out.out
