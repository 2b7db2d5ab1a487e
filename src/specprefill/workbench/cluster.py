"""A profile's units over jobs (`reproduce --executor local|slurm`), through submitit.

A notebook whose cells tagged `units` compute its units of work (the quality notebooks) is split into shards: a unit
belongs to shard `store.unit_shard(spec, n)` (a hash of its spec), and a job runs the notebook's cells up to its
units with `store.SHARD_ENV` set, so it computes only its shard's units (each one engine start per notebook it
holds). Shards are sized from the profile's own numbers (`estimate`: units and prompt tokens, no model loaded) and
packed into at most `--jobs` jobs. After the jobs, one pass runs every notebook as `reproduce` does inline: the
sharded ones with `store.UNITS_ENV=read` (every unit read back, one no job finished named and failed, never left
out of a mean), then the notebooks that measure time or have no units (TTFT, QPS, the explorer, the report), alone
on the machine so that no job shares it with a measurement.

`local`: submitit's LocalExecutor, one job per disjoint GPU set (CUDA_VISIBLE_DEVICES sized by the notebooks'
tensor-parallel widths) or core set (the job's affinity and threads); `slurm`: one job array (partition, account,
GPUs, CPUs, time limit, array parallelism and set-up lines from flags or `_profile.yaml`'s `executor:` block); a
job that Slurm preempts or times out is requeued and resumes from the units already written. The pass after the
jobs runs here for `local`, as one more job for `slurm` (it starts the notebooks' engines to read units back).
Logs: `outputs/<profile>/_jobs/`. The outputs folder must be one every job sees (a shared filesystem)."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specprefill import hardware
from specprefill.atomic import write_text
from specprefill.errors import SpecPrefillError
from specprefill.settings import ExecutorSettings
from specprefill.workbench import runner, store
from specprefill.workbench.shards import JOBS, Job, Shard, plan, plan_lines, sharded


@dataclass
class ShardJob:
    """What one job runs (pickled by submitit): its shards, one after another, on its devices or cores. A Slurm
    job preempted or timed out is requeued (`checkpoint`) and computes only what its units files still lack."""

    root: str
    profile: str
    shards: list[Shard]
    data_dir: str | None = None
    recompute: str | None = None  # a sharded --force: the time the run began (units written before are redone)
    cpus: list[int] = field(default_factory=list)
    token: str = ""
    index: int = 0
    devices: list[str] = field(default_factory=list)

    def __call__(self) -> dict[str, Any]:
        root = Path(self.root)
        folder = root / "outputs" / self.profile / JOBS
        _check_shared(folder, self.token)
        if self.cpus:  # the job's cores: vLLM's CPU workers bind within the allowed ones (`hardware.allowed_cpus`)
            os.sched_setaffinity(0, self.cpus)
            os.environ["OMP_NUM_THREADS"] = str(len(self.cpus))
        if self.devices:  # before any CUDA use in this process and the notebooks' kernels (they inherit it)
            os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(self.devices)
        for s in self.shards:
            record = folder / f"job-{self.index}" / f"{s.notebook}.shard-{s.index + 1}-of-{s.of}.ipynb"
            runner.run_units(
                root, self.profile, s.notebook, s.index, s.of, record, self.data_dir, self.recompute or False
            )
        return {"job": self.index, "shards": [dataclasses.asdict(s) for s in self.shards]}

    def checkpoint(self, *args: Any, **kwargs: Any) -> Any:
        import submitit

        return submitit.helpers.DelayedSubmission(self, *args, **kwargs)


@dataclass
class FinishJob:
    """The pass after the jobs, as a Slurm job of its own (it starts the notebooks' engines to read units back)."""

    root: str
    profile: str
    names: list[str]
    data_dir: str | None = None
    force: bool = False
    recompute: bool = False
    token: str = ""
    ran: list[str] = field(default_factory=list)

    def __call__(self) -> list[tuple[str, str]]:
        _check_shared(Path(self.root) / "outputs" / self.profile / JOBS, self.token)
        return finish(Path(self.root), self.profile, self.names, self.data_dir, self.force, self.recompute, self.ran)

    def checkpoint(self, *args: Any, **kwargs: Any) -> Any:  # requeued: the pass is run again from the start
        import submitit

        return submitit.helpers.DelayedSubmission(self, *args, **kwargs)


def _check_shared(folder: Path, token: str) -> None:
    """A job sees the outputs folder the command wrote (not a node's own disk)."""
    try:
        seen = json.loads((folder / "shared.json").read_text()).get("token")
    except (OSError, ValueError):
        seen = None
    if token and seen != token:
        raise SpecPrefillError(
            f"this job does not see {folder} as the submitting machine wrote it: the outputs directory must be on "
            "a filesystem every node shares (run from a shared home or project directory)"
        )


MOUNTS = "/proc/mounts"  # the mount table the check below reads


def _refuse_local_only(folder: Path) -> None:
    """Slurm: an outputs folder on a memory filesystem is the submitting node's alone."""
    best, kind = "", ""
    try:
        mounts = Path(MOUNTS).read_text().splitlines()
    except OSError:
        return
    path = str(folder.resolve())
    for line in mounts:
        parts = line.split()
        if (
            len(parts) > 2
            and (path == parts[1] or path.startswith(parts[1].rstrip("/") + "/"))
            and len(parts[1]) > len(best)
        ):
            best, kind = parts[1], parts[2]
    if kind in ("tmpfs", "ramfs"):
        raise SpecPrefillError(
            f"{folder} is on {kind} ({best}), this node's memory: the outputs directory must be on a filesystem "
            "every Slurm node shares (run from a shared home or project directory)"
        )


def executor(settings: ExecutorSettings, folder: Path, gpus: int, cpus: int | None = None) -> Any:
    """submitit's executor for `settings` (Slurm: one array's parameters; local: updated per job)."""
    try:
        import submitit
    except ImportError:
        raise SpecPrefillError(
            f"--executor {settings.executor} needs submitit: pip install 'specprefill[cluster]'"
        ) from None
    if settings.executor == "local":
        return submitit.LocalExecutor(folder=str(folder))
    ex = submitit.SlurmExecutor(folder=str(folder))
    params: dict[str, Any] = {
        "time": settings.timeout_min,
        "nodes": 1,
        "ntasks_per_node": 1,
        "cpus_per_task": settings.cpus_per_job or 8 * max(1, gpus),
        "array_parallelism": settings.array_parallelism,
        "job_name": "specprefill",
        "signal_delay_s": 120,
    }
    if gpus:
        params["gpus_per_node"] = gpus
    if settings.partition:
        params["partition"] = settings.partition
    if settings.account:
        params["account"] = settings.account
    if settings.setup:
        params["setup"] = [line.strip() for line in settings.setup.split(";") if line.strip()]
    ex.update_parameters(**params)
    return ex


def submit(
    root: Path,
    profile: str,
    jobs: list[Job],
    settings: ExecutorSettings,
    data_dir: str | None = None,
    recompute: str | None = None,
) -> list[Any]:
    """Submit the jobs (Slurm: one array per GPU width, so that each job asks what the plan says; local: one
    process per job on its own devices or cores); submitit's jobs, in the order of `jobs`."""
    folder = root / "outputs" / profile / JOBS
    folder.mkdir(parents=True, exist_ok=True)
    if settings.executor == "slurm":
        _refuse_local_only(folder)
    data = str(Path(data_dir).resolve()) if data_dir else None
    token = _token(folder)
    calls = [
        ShardJob(str(root), profile, j.shards, data, recompute, j.cpus, token, j.index, j.devices) for j in jobs
    ]  # fmt: skip
    submitted: dict[int, Any] = {}
    if settings.executor == "slurm":
        for width in sorted({j.gpus for j in jobs}):
            ex = executor(settings, folder, width)
            group = [(j, c) for j, c in zip(jobs, calls) if j.gpus == width]
            with ex.batch():
                pending = [(j.index, ex.submit(c)) for j, c in group]
            submitted.update(pending)  # the batch's jobs are real once the block has submitted them
        return [submitted[j.index] for j in jobs]
    for job, call in zip(jobs, calls):
        ex = executor(settings, folder, 0)
        ex.update_parameters(timeout_min=settings.timeout_min)  # devices: set by the job itself (ids or UUIDs)
        submitted[job.index] = ex.submit(call)
    return [submitted[j.index] for j in jobs]


def _token(folder: Path) -> str:
    """This run's mark in the outputs folder: a job that cannot read it back is not on a shared filesystem."""
    token = uuid.uuid4().hex
    write_text(folder / "shared.json", json.dumps({"token": token}))
    return token


def wait(submitted: list[Any], jobs: list[Job]) -> list[tuple[str, str]]:
    """Each job's end: [(job, one line naming its log)] for those that failed."""
    failures = []
    for sub, job in zip(submitted, jobs):
        try:
            sub.result()
        except Exception as exc:  # a job's import error, OOM, a unit raising: one line and its log
            shards = ", ".join(s.notebook for s in job.shards)
            failures.append((f"job {job.index} ({shards})", f"{reason_of(exc)}; log: {sub.paths.stderr}"))
            print(f"[reproduce] {failures[-1][0]} failed: {failures[-1][1]}", file=sys.stderr)
    return failures


def reason_of(exc: BaseException) -> str:
    """The error a job's traceback ends with (submitit's message wraps it, then lists the log paths), one line."""
    lines = [line.strip() for line in str(exc).splitlines()]
    errors = [line for line in lines if re.match(r"^[\w.]+(Error|Exception|Interrupt|Exit)\b", line)]
    line = errors[-1] if errors else next((x for x in lines if x), type(exc).__name__)
    return re.sub(r"^[\w.]+\.(\w+:)", r"\1", line)[:300]


def finish(
    root: Path,
    profile: str,
    names: list[str],
    data_dir: str | None,
    force: bool,
    recompute: bool = False,
    ran: list[str] | None = None,
) -> list[tuple[str, str]]:
    """After the jobs: the sharded notebooks read every unit back (`store.UNITS_ENV`; those jobs `ran` for are
    executed again, the others only if their inputs changed), then the others run as inline (`recompute`: their
    units computed again)."""
    todo = sharded(root, names)
    failures = []
    with runner.environment({store.UNITS_ENV: "read"}):
        for name in todo:
            again = force or name in (ran or [])
            failures += runner.run_profile(profile, [name], again, root=root, data_dir=data_dir)
    rest = [n for n in names if n not in todo]
    if rest:
        failures += runner.run_profile(profile, rest, force, root=root, recompute=recompute, data_dir=data_dir)
    return failures


def run(
    root: Path,
    profile: str,
    names: list[str],
    settings: ExecutorSettings,
    data_dir: str | None = None,
    force: bool = False,
    recompute: bool = False,
) -> list[tuple[str, str]]:
    """A sharded run: plan, submit, wait, then the pass that reads every unit back. Returns the failures (each also
    printed as it is known)."""
    jobs = plan(root, profile, names, settings, *machine(settings), data_dir=data_dir, force=force or recompute)
    print("\n".join(plan_lines(root, profile, jobs, settings)), file=sys.stderr)
    began = f"{time.time():.6f}" if recompute else None  # a requeued job keeps what it wrote since
    failures = wait(submit(root, profile, jobs, settings, data_dir, began), jobs) if jobs else []
    ran = sorted({s.notebook for j in jobs for s in j.shards})
    if settings.executor == "slurm":
        folder = root / "outputs" / profile / JOBS
        ex = executor(settings, folder, max((j.gpus for j in jobs), default=0))
        call = FinishJob(str(root), profile, names, data_dir, force, recompute, _token(folder), ran)
        last = ex.submit(call)
        try:
            failures += last.result()
        except Exception as exc:
            failures.append(("the pass after the jobs", f"{reason_of(exc)}; log: {last.paths.stderr}"))
        return failures
    return failures + finish(root, profile, names, data_dir, force, recompute, ran)


def machine(settings: ExecutorSettings) -> tuple[list[str] | None, list[int] | None]:
    """Local: this machine's visible GPUs (CUDA_VISIBLE_DEVICES entries, ids or UUIDs; else every device) or its
    allowed cores."""
    if settings.executor != "local":
        return None, None
    import torch

    if torch.cuda.is_available() and torch.cuda.device_count():
        visible = [x.strip() for x in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if x.strip()]
        return visible or [str(i) for i in range(torch.cuda.device_count())], None
    return None, hardware.allowed_cpus()
