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


BLOCKED = ("vllm", "gguf", "lm_eval", "papermill")


def _blocked_env(tmp_path) -> dict:
    """PYTHONPATH=src, with vLLM, gguf, lm-eval and papermill unimportable (a module of each name that raises)."""
    import os

    from conftest import plain_env

    block = tmp_path / "blocked"
    block.mkdir()
    for name in BLOCKED:
        (block / f"{name}.py").write_text(f"raise ImportError('{name} is not installed on this GPU node')\n")
    return plain_env(PYTHONPATH=os.pathsep.join([str(block), str(ROOT / "src")]))


def test_the_reference_check_runs_from_a_checkout_with_torch_and_transformers_only(tmp_path):
    """`scripts/gpu_check.py --engine hf --tiny` in a subprocess with PYTHONPATH=src and vLLM, gguf, lm-eval and
    papermill unimportable: every check runs (the CPU standing in for the device, tiny shapes), the report holds each
    check's result and the TTFT rows; every project file it imported is in the manifest, under 32 MiB together."""
    import json
    import subprocess
    import sys

    env = _blocked_env(tmp_path)
    runner = tmp_path / "runner.py"  # the command, then the files of every module it imported
    runner.write_text(
        "import json, runpy, sys\n"
        f"sys.argv = ['gpu_check.py', '--engine', 'hf', '--tiny', '--out', {str(tmp_path)!r}]\n"
        "code = 0\n"
        "try:\n"
        f"    runpy.run_path({str(ROOT / 'scripts' / 'gpu_check.py')!r}, run_name='__main__')\n"
        "except SystemExit as end:\n"
        "    code = end.code\n"
        "files = sorted(getattr(m, '__file__', None) or '' for m in list(sys.modules.values()))\n"
        f"open({str(tmp_path / 'modules.json')!r}, 'w').write(json.dumps(files))\n"
        "sys.exit(code)\n"
    )
    out = subprocess.run([sys.executable, str(runner)], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "ran      families" in out.stdout and "ran      ttft" in out.stdout
    report = json.loads((tmp_path / "report.json").read_text())
    assert {k: c["result"] for k, c in report["checks"].items()} == {"families": "ran", "core": "ran", "ttft": "ran"}
    assert {r["family"] for r in report["checks"]["families"]["rows"]} == set(_families())
    rows = report["checks"]["ttft"]["rows"]
    assert {(r["tokens"], r["keep_rate"]) for r in rows} == {(m, p) for m in (128, 256) for p in (0.1, 0.3)}
    assert all(r["bound"] > 0 and r["full_s"] > 0 and r["kept"] < r["tokens"] for r in rows)
    imported = json.loads((tmp_path / "modules.json").read_text())
    from specprefill.refcheck import run

    files = dict(run.manifest(ROOT))
    ours = {str(Path(m).relative_to(ROOT)) for m in imported if m.startswith((f"{ROOT}/src/", f"{ROOT}/scripts/"))}
    assert ours <= set(files), ours - set(files)
    assert sum(files.values()) < 32 * 2**20


def _families():
    from specprefill.models.tiny import FAMILIES

    return FAMILIES


def test_a_position_off_by_one_fails_the_families_check(tmp_path, monkeypatch):
    """A planted fault: decoding one position too far (`PrunedPrompt.decode_position`)."""
    from specprefill.core import selection
    from specprefill.refcheck import checks

    right = selection.PrunedPrompt.decode_position
    monkeypatch.setattr(selection.PrunedPrompt, "decode_position", lambda self, step: right(self, step) + 1)
    found = checks.check_families("cpu", tmp_path, ["llama"], 1)
    assert found["failures"] and "explicit positions" in found["failures"][0]


def test_the_reference_check_lists_its_checks_and_refuses_what_its_budget_cannot_hold(capsys, tmp_path, monkeypatch):
    from specprefill.refcheck import checks, run

    assert _gpu_check().main(["--engine", "hf", "--list"]) == 0
    assert [line.split(":")[0] for line in capsys.readouterr().out.strip().splitlines()] == list(checks.CHECKS)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert _gpu_check().main(["--engine", "hf", "--out", str(tmp_path)]) == 0
    assert len(capsys.readouterr().out.strip().splitlines()) == 1
    report = run.run(checks.TINY, "cpu", 0.0, tmp_path)  # no time: every check refused, with why
    assert {c["result"] for c in report["checks"].values()} == {"refused"}, report["checks"]
    assert "of --budget-s left" in report["checks"]["families"]["reason"]
