"""Sharded runs: `reproduce --executor local|slurm` (workbench.cluster) and the unit store's shards."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from specprefill.errors import SpecPrefillError
from specprefill.settings import ExecutorSettings
from specprefill.workbench import cluster, parameters, shards, store

ROOT = Path(__file__).resolve().parents[1]


def test_unit_shards_split_the_work_and_the_read_pass_names_what_is_missing(tmp_path, monkeypatch):
    """Under SHARD_ENV each unit is computed by exactly one of the n shards (the others defer it); the pass after
    the jobs (UNITS_ENV=read) computes nothing, reads every finished unit back, also one written on another share of
    the same kind of machine (another core count), and notes the unfinished one as missing; a unit of other engines
    (context) or another kind of CPU is not this run's."""
    specs = [{"task": f"t{i}", "keep_rate": 0.1 * i} for i in range(12)]
    computed: list[str] = []

    def unit(spec, context=None):
        return store.run_unit(
            tmp_path, "q", spec, lambda: computed.append(spec["task"]) or [{"score": 1}], context=context
        )

    for shard in range(3):
        monkeypatch.setenv(store.SHARD_ENV, f"{shard}/3")
        for spec in specs:
            unit(spec)
    assert sorted(computed) == sorted(s["task"] for s in specs)  # each exactly once over the shards
    assert {store.unit_shard(s, 3) for s in specs} == {0, 1, 2}
    monkeypatch.delenv(store.SHARD_ENV)
    lost = next(store.unit_path(tmp_path, "q", s) for s in specs if s["task"] == "t5")
    lost.unlink()  # a job killed before it finished this unit
    other = {"task": "t99", "keep_rate": 0.0}  # finished on another share of the machine
    context = {"engine": {"seed": 0}}
    key = store.unit_key(other, context)
    key["machine"]["cpus"] = 1
    foreign = store.unit_path(tmp_path, "q", other).with_name(
        f"{store.unit_path(tmp_path, 'q', other).stem[:-3]}xyz.json"
    )
    foreign.write_text(json.dumps({"key": key, "rows": [{**other, "score": 7}]}))
    monkeypatch.setenv(store.UNITS_ENV, "read")
    store._indexes.clear()  # the reading pass is a new process: it sees the folder as the jobs left it
    computed.clear()
    rows = [r for s in [*specs, other] for r in unit(s, context if s is other else None)]
    assert (
        computed == []
        and len(rows) == 12
        and {"score": 7, "task": "t99", "keep_rate": 0.0}
        in [{k: r[k] for k in ("score", "task", "keep_rate")} for r in rows]
    )
    assert store.missing_units(tmp_path) == [str(lost.relative_to(tmp_path))]
    assert unit(other, {"engine": {"seed": 1}}) == [] and len(store.missing_units(tmp_path)) == 2  # other engines
    kind = dict(key["machine"], cpu_model="another CPU")  # another kind of machine is not this run's
    foreign.write_text(json.dumps({"key": {**key, "machine": kind}, "rows": [{**other, "score": 7}]}))
    store._indexes.clear()  # a new process's view of the folder
    assert unit(other, context) == [] and len(store.missing_units(tmp_path)) == 3


def test_job_plan_for_gpu_nodes_cores_and_packing():
    """The plan from the profile alone: paper-70b on 8-GPU Slurm nodes (every sharded notebook in shards sized by
    its estimated tokens, never more shards than units, at most --jobs jobs, each asking its notebooks' widest
    tensor-parallel engine); fewer jobs than notebooks pack whole notebooks; local jobs get disjoint GPU sets (one
    TP-8 job on 8 GPUs, eight TP-1 jobs) or cores (2 cores, --jobs 2: one each)."""
    names = parameters.notebooks(ROOT)
    sharded = shards.sharded(ROOT, names)
    assert {"01_long_context_quality", "02_ruler", "03_short_tasks", "06_ablations", "07_baselines"} <= set(sharded)
    assert not {"04_ttft", "05_qps", "09_token_importance_explorer", "10_speculator_choice", "99_report"} & set(sharded)
    slurm = ExecutorSettings(executor="slurm", jobs=24, partition="gpu")
    jobs = shards.plan(ROOT, "paper-70b", names, slurm)
    assert len(jobs) <= 24 and all(j.gpus == 8 and len(j.shards) == 1 for j in jobs)
    for name in sharded:
        held = [s for j in jobs for s in j.shards if s.notebook == name]
        units, tokens = shards.estimate(shards.merged_params(ROOT, "paper-70b", name))
        assert sorted(s.index for s in held) == list(range(held[0].of)) and 1 <= held[0].of <= units, name
    lb = shards.merged_params(ROOT, "paper-70b", "01_long_context_quality")
    assert shards.estimate(lb)[0] == (1 + 5) * 34  # full + 5 keep rates of p_full_lah8, per LongBench task
    packed = shards.plan(ROOT, "paper-70b", names, ExecutorSettings(executor="slurm", jobs=3))
    assert len(packed) == 3 and sorted(s.notebook for j in packed for s in j.shards) == sorted(sharded)
    per = shards.plan(ROOT, "paper-70b", names, ExecutorSettings(executor="slurm", units_per_job=100))
    assert all(j.units <= 100 for j in per)
    local = ExecutorSettings(executor="local", jobs=8)
    (tp8,) = shards.plan(ROOT, "paper-70b", ["07_baselines"], local, visible_gpus=list(range(8)))
    assert tp8.devices == list(range(8))
    tp1 = shards.plan(ROOT, "cpu-large", ["02_ruler"], local, visible_gpus=list(range(8)))  # 24 units
    assert len(tp1) == 8 and sorted(d for j in tp1 for d in j.devices) == list(range(8))
    cores = shards.plan(ROOT, "smoke", ["01_long_context_quality"], ExecutorSettings("local", jobs=2), cpus=[0, 1])
    assert [j.cpus for j in cores] == [[0], [1]] and [j.shards[0].of for j in cores] == [2, 2]
    lines = "\n".join(shards.plan_lines(ROOT, "paper-70b", jobs, slurm))
    assert "job plan (slurm)" in lines and "8 GPU(s)" in lines and "prompt tokens" in lines
    with pytest.raises(SpecPrefillError, match="executor: keys"):
        ExecutorSettings.of({"partitions": "gpu"}, {})
    with pytest.raises(SpecPrefillError, match="--jobs 0"):
        ExecutorSettings.of({}, {"jobs": 0})


def test_prepare_only_prints_the_job_plan_for_paper_70b(capsys):
    """`reproduce --profile paper-70b --prepare-only --executor slurm` checks every notebook and prints the job
    plan with each job's GPUs, units, tokens and (with --gpu-memory-gib) the memory plan; nothing is submitted."""
    from specprefill.cli import main

    code = main(["reproduce", "--profile", "paper-70b", "--prepare-only", "--executor", "slurm", "--jobs", "16",
                 "--gpu-memory-gib", "141", "--only", "01_long_context_quality,07_baselines,04_ttft"])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 0, err[-2000:]
    plan = err[err.index("job plan (slurm)") :]
    assert "01_long_context_quality [shard 1/" in plan and "07_baselines [shard 1/" in plan and "04_ttft" not in plan
    assert "8 GPU(s)" in plan and "memory per GPU (141 GiB" in plan
    assert not (ROOT / "outputs" / "paper-70b" / shards.JOBS / "shared.json").exists()


def test_slurm_array_is_submititits_own_script_with_the_settings(tmp_path, monkeypatch):
    """The Slurm path without a cluster: submitit's SlurmExecutor renders the array's sbatch script and calls
    `sbatch` (a stand-in that records it): one array of all jobs with the parallelism, partition, account, GPUs per
    node, CPUs, time limit and set-up lines given; logs in outputs/<profile>/_jobs/."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    sbatch = bin_dir / "sbatch"
    sbatch.write_text(f'#!/bin/sh\ncp "$1" {tmp_path}/submitted.sh\necho "Submitted batch job 4242"\n')
    sbatch.chmod(sbatch.stat().st_mode | stat.S_IEXEC)
    (bin_dir / "srun").write_text("#!/bin/sh\nexit 0\n")  # submitit looks for it before submitting
    (bin_dir / "srun").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    mounts = tmp_path / "mounts"  # the outputs on a shared disk, wherever this test's folder is (a tmpfs basetemp)
    mounts.write_text(f"/dev/vda / ext4 rw 0 0\nnfs:/home {tmp_path} nfs rw 0 0\n")
    monkeypatch.setattr(cluster, "MOUNTS", str(mounts))
    root = tmp_path / "w"
    for d in ("notebooks", "params"):
        shutil.copytree(ROOT / d, root / d)
    settings = ExecutorSettings.of(
        {"partition": "gpu", "setup": ["module load cuda/12.4", "source ~/venv/bin/activate"]},
        {"executor": "slurm", "jobs": 12, "account": "lab", "array_parallelism": 4, "timeout_min": 600},
    )
    jobs = shards.plan(root, "paper-70b", parameters.notebooks(root), settings)
    submitted = cluster.submit(root, "paper-70b", jobs, settings)
    script = (tmp_path / "submitted.sh").read_text()
    assert len(submitted) == len(jobs) == 12 and submitted[0].job_id == "4242_0"
    assert f"#SBATCH --array=0-{len(jobs) - 1}%4" in script
    for line in ("--partition=gpu", "--account=lab", "--gpus-per-node=8", "--cpus-per-task=64", "--time=600",
                 "--nodes=1", "--ntasks-per-node=1"):  # fmt: skip
        assert f"#SBATCH {line}" in script, line
    assert script.index("module load cuda/12.4") < script.index("source ~/venv/bin/activate") < script.index("srun")
    assert f"{root}/outputs/paper-70b/_jobs" in script  # logs beside the outputs
    mounts.write_text(f"/dev/vda / ext4 rw 0 0\ntmpfs {tmp_path} tmpfs rw 0 0\n")
    with pytest.raises(SpecPrefillError, match="must be on a filesystem every"):
        cluster._refuse_local_only(root)


@pytest.mark.model
def test_a_failing_job_is_one_line_naming_its_log(tmp_path):
    """A job that raises (here: a notebook with no units cell given to it) reaches the user as one line with the
    job, the reason and its log file; the other job is unaffected."""
    root = tmp_path / "w"
    for d in ("notebooks", "params"):
        shutil.copytree(ROOT / d, root / d)
    settings = ExecutorSettings(executor="local", jobs=1)
    jobs = [shards.Job(0, [shards.Shard("04_ttft", 0, 1)], cpus=[0]), shards.Job(1, [], cpus=[0])]
    submitted = cluster.submit(root, "smoke", jobs, settings)
    ((who, line),) = cluster.wait(submitted, jobs)
    assert who == "job 0 (04_ttft)" and "has no cell tagged 'units'" in line and "\n" not in line
    assert submitted[1].result() == {"job": 1, "shards": []}
    log = Path(line.split("log: ")[1])
    assert log.exists() and log.is_relative_to(root / "outputs" / "smoke" / shards.JOBS)


def _units(out: Path) -> dict[str, list]:
    """A notebook's units by the key that does not depend on the share of the machine a job had."""
    found = {}
    for f in sorted((out / "units").rglob("*.json")):
        data = json.loads(f.read_text())
        found[json.dumps(store._share_free(data["key"]), sort_keys=True)] = data["rows"]
    return found


SHARDED_CMD = ["reproduce", "--profile", "smoke", "--only", "01_long_context_quality", "--executor", "local",
               "--jobs", "2"]  # fmt: skip


@pytest.fixture(scope="module")
def sharded_run(tmp_path_factory, smollm2):
    """`reproduce --profile smoke --only 01_long_context_quality --executor local --jobs 2` once, in a copy of the
    workspace: (root, the completed process)."""
    root = tmp_path_factory.mktemp("sharded") / "w"
    for d in ("notebooks", "params"):
        shutil.copytree(ROOT / d, root / d)
    done = subprocess.run([sys.executable, "-m", "specprefill", *SHARDED_CMD], cwd=root, capture_output=True,
                          text=True, timeout=1800)  # fmt: skip
    return root, done


@pytest.mark.e2e
def test_local_jobs_give_the_inline_runs_units_and_tables(sharded_run, smoke_run):
    """Two local jobs (one core each on this machine) compute the notebook's units, the pass after them reads them
    back: the same unit keys and rows, and the same tables, as the inline run of the same notebook."""
    (root, done), (inline_root, returncode, err) = sharded_run, smoke_run
    assert returncode == 0, err[-4000:]
    assert done.returncode == 0, done.stderr[-4000:]
    assert "job plan (local): 2 job(s)" in done.stderr
    name = "01_long_context_quality"
    out, inline = root / "outputs" / "smoke" / name, inline_root / "outputs" / "smoke" / name
    assert _units(out) == _units(inline) and len(_units(out)) >= 2
    for table in ("summary.csv", "results.csv"):
        pd.testing.assert_frame_equal(pd.read_csv(out / table), pd.read_csv(inline / table))
    assert len(list((root / "outputs" / "smoke" / shards.JOBS).glob("job-*/*.shard-*-of-2.ipynb"))) == 2


@pytest.mark.heavy  # two more jobs and a reading pass; the store's shard test covers the logic in the default loop
def test_a_rerun_after_lost_units_computes_only_those(sharded_run):
    """Two unit files removed (a job killed before it wrote them: units are written whole or not at all): the pass
    that reads the units back fails naming them; the same command again computes exactly those two, and the tables
    are what they were."""
    root, done = sharded_run
    assert done.returncode == 0, done.stderr[-4000:]
    name = "01_long_context_quality"
    out = root / "outputs" / "smoke" / name
    summary = pd.read_csv(out / "summary.csv")
    files = sorted((out / "units").rglob("*.json"))
    for f in files[:2]:
        f.unlink()
    failures = cluster.finish(root, "smoke", [name], None, force=False, ran=[name])
    assert len(failures) == 1 and "2 unit(s) missing" in failures[0][1] and not (out / f"{name}.inputs.json").exists()
    before = {f: f.stat().st_mtime_ns for f in files[2:]}
    again = subprocess.run([sys.executable, "-m", "specprefill", *SHARDED_CMD], cwd=root, capture_output=True,
                           text=True, timeout=1800)  # fmt: skip
    assert again.returncode == 0, again.stderr[-4000:]
    after = sorted((out / "units").rglob("*.json"))
    new = [f for f in after if f not in before or f.stat().st_mtime_ns != before[f]]
    assert len(after) == len(files) and len(new) == 2
    pd.testing.assert_frame_equal(pd.read_csv(out / "summary.csv"), summary)


def test_the_report_names_missing_units(tmp_path):
    """A notebook whose sharded run left units missing: its report section names each one and says no mean above
    includes them; a complete run says nothing of the kind."""
    from specprefill.workbench.report import sections

    units = {"computed": [], "reused": ["units/q/a.json"] * 3, "deferred": [], "missing": ["units/q/b-1.json"]}
    ledger = {"code_version": "v", "computed": 0, "reused": 3, "missing": 1, "units": units}
    (tmp_path / "units.json").write_text(json.dumps(ledger))
    line = sections.units_line(tmp_path)
    assert "1 unit(s) missing" in line and "units/q/b-1.json" in line and "no mean above includes them" in line
    ledger["units"]["missing"], ledger["missing"] = [], 0
    (tmp_path / "units.json").write_text(json.dumps(ledger))
    assert "missing" not in sections.units_line(tmp_path) and "3 read back" in sections.units_line(tmp_path)
