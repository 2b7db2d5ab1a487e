"""How a profile's units are split for a sharded run (`workbench.cluster`): which notebooks shard, their units and
prompt tokens estimated from the profile's own numbers (no model loaded), shards packed into at most `--jobs` jobs,
each job's GPUs or cores, and the plan `reproduce --prepare-only --executor ...` prints."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from specprefill.settings import ExecutorSettings
from specprefill.workbench import parameters, protocol, runner

JOBS = "_jobs"  # outputs/<profile>/_jobs/: the jobs' logs, their copies of the notebooks, the shared-folder check
# rows per task where a profile runs all of a benchmark (`n_samples: null`): the benchmarks' published sizes, for the
# plan's token estimate only (LongBench: 200 per task but multifieldqa_en 150, lcc and repobench-p 500)
ROWS = {
    "longbench_multifieldqa_en": 150, "longbench_lcc": 500, "longbench_repobench-p": 500, "longbench": 200,
    "gsm8k": 1319, "mmlu": 14042, "arc_challenge": 1172, "gpqa_main": 448, "leaderboard_ifeval": 541,
    "evalplus_humaneval": 164, "evalplus_mbpp": 378,
}  # fmt: skip


ROWS_UNKNOWN = 200


@dataclass(frozen=True)
class Shard:
    notebook: str
    index: int
    of: int


@dataclass
class Job:
    """One job of a sharded run: its shards, the GPUs it asks for, and (local) the devices or cores it runs on."""

    index: int
    shards: list[Shard] = field(default_factory=list)
    gpus: int = 0
    units: float = 0.0  # estimated: the notebooks' units over their shard counts
    tokens: float = 0.0  # estimated prompt tokens, at most
    devices: list[str] = field(default_factory=list)  # local, GPU: its CUDA_VISIBLE_DEVICES entries
    cpus: list[int] = field(default_factory=list)  # local, CPU: the cores it is bound to


def sharded(root: Path, names: list[str]) -> list[str]:
    """The notebooks of `names` whose units jobs compute (a cell tagged `units`)."""
    return [n for n in names if parameters.units_cells(root / "notebooks" / f"{n}.ipynb")]


def merged_params(root: Path, profile: str, name: str) -> dict:
    return {
        **parameters.parameters_cell(root / "notebooks" / f"{name}.ipynb"),
        **parameters.load_params(root, profile, name),
    }


def _rows(task: str) -> int:
    for prefix in sorted(ROWS, key=len, reverse=True):
        if task.removesuffix("_e").startswith(prefix):
            return ROWS[prefix]
    return ROWS_UNKNOWN


def estimate(merged: dict) -> tuple[int, int]:
    """A notebook's units and an upper bound of the prompt tokens they prefill, from its parameters alone: variants
    (full, every family or method at every keep rate, the fixed-rate baselines, or the ablations) x its own tasks,
    plus one lm-eval unit per variant; tokens = rows x variants x the longest prompt it allows."""
    if isinstance(merged.get("groups"), dict):  # the leaderboard: every group's tasks x entries x its keep rates
        return _board_estimate(merged)
    proto = protocol.protocol(merged)
    lm_tasks = list(merged.get("lm_eval_tasks") or [])
    own = [t for t in proto["tasks"] if t not in lm_tasks]
    rates = proto["keep_rates"]
    if merged.get("speculators") and "scorer" in merged:  # agreement: one unit per speculator over every prompt
        n = len(merged["speculators"])
        return n, n * len(own) * int(merged.get("n_samples") or 0) * int(merged.get("length") or 0)
    if merged.get("ablations"):
        variants = len(merged["ablations"])
    else:
        methods = list(merged.get("methods") or ["specprefill"])
        per_rate = sum(max(1, len(merged.get("families") or [])) if m == "specprefill" else 1 for m in methods)
        variants = 1 + per_rate * len(rates) + len(merged.get("baselines") or [])
    units = variants * (len(own) + len(lm_tasks))  # lm-eval: one unit per variant and task
    longest = int(merged.get("max_model_len") or merged.get("length") or 0)
    samples = merged.get("n_samples")
    own_tokens = variants * len(own) * int(samples or 0) * int(merged.get("length") or longest)
    limit = merged.get("lm_eval_limit") or samples
    lm_rows = sum(int(limit) if limit else _rows(t) for t in lm_tasks)
    return units, own_tokens + variants * lm_rows * longest


def _board_estimate(merged: dict) -> tuple[int, int]:
    """Notebook 11's quality units (full prefill and each entry at each of a group's keep rates, per task) and their
    prompt tokens (tokens at a keep rate counted whole: an upper bound, as above)."""
    entries = len(merged.get("methods") or []) + len(merged.get("speculators") or [])
    units = tokens = 0
    for g in merged["groups"].values():
        g = g if isinstance(g, dict) else {}
        variants = 1 + entries * len(g.get("keep_rates") or merged.get("keep_rates") or [])
        tasks = len(g.get("tasks") or [])
        units += variants * tasks
        tokens += variants * tasks * int(g.get("n") or 0) * int(g.get("length") or 0)
    return units, tokens


def _gpus(merged: dict) -> int:
    """GPUs a notebook's engines use on a GPU machine: its widest tensor-parallel engine (both share the GPUs)."""
    return max(int(merged.get("tensor_parallel_size") or 1), int(merged.get("speculator_tensor_parallel_size") or 1))


def plan(
    root: Path,
    profile: str,
    names: list[str],
    settings: ExecutorSettings,
    visible_gpus: list[str] | None = None,
    cpus: list[int] | None = None,
    data_dir: str | None = None,
    force: bool = False,
) -> list[Job]:
    """The jobs of a sharded run, deterministic: each sharded notebook split into shards in proportion to its
    estimated tokens (at least one, at most its units), at most `settings.jobs` jobs in all (or as many as
    `units_per_job` asks); fewer jobs than notebooks: whole notebooks packed, largest first, into the least loaded
    job. `local` also caps the jobs at the disjoint GPU sets (`visible_gpus`) or cores (`cpus`) there are and assigns
    them; `slurm` asks each job's GPUs of the scheduler. A notebook already finished with the same inputs gets no job
    (unless `force`)."""
    todo = [n for n in sharded(root, names) if force or not runner.finished(root, profile, n, data_dir)]
    if not todo:
        return []
    merged = {n: merged_params(root, profile, n) for n in todo}
    cost = {n: estimate(merged[n]) for n in todo}
    uses_gpus = bool(visible_gpus) or settings.executor == "slurm"
    given = settings.gpus_per_job
    width = {n: (_gpus(merged[n]) if given is None else given) if uses_gpus else 0 for n in todo}
    by_units = {n: math.ceil(max(1, cost[n][0]) / (settings.units_per_job or 1)) for n in todo}
    if settings.units_per_job:
        wanted = sum(by_units.values())
    else:
        wanted = settings.jobs
    if settings.executor == "local":
        if visible_gpus:
            wanted = min(wanted, max(1, len(visible_gpus) // max(1, *width.values())))
        else:
            share = settings.cpus_per_job or max(1, len(cpus or [0]) // max(1, wanted))
            wanted = min(wanted, max(1, len(cpus or [0]) // share))
    jobs: list[Job] = []
    if wanted >= len(todo):
        if settings.units_per_job and wanted == sum(by_units.values()):  # not capped by the machine: as asked
            counts = by_units
        else:
            counts = _shares({n: max(1, cost[n][1]) for n in todo}, {n: max(1, cost[n][0]) for n in todo}, wanted)
        for n in todo:
            for i in range(counts[n]):
                units, tokens = cost[n]
                job = Job(len(jobs), [Shard(n, i, counts[n])], width[n], units / counts[n], tokens / counts[n])
                jobs.append(job)
    else:
        jobs = [Job(i) for i in range(wanted)]
        for n in sorted(todo, key=lambda n: (-cost[n][1], n)):
            job = min(jobs, key=lambda j: (j.tokens, j.index))
            job.shards.append(Shard(n, 0, 1))
            job.units, job.tokens, job.gpus = job.units + cost[n][0], job.tokens + cost[n][1], max(job.gpus, width[n])
    if settings.executor == "local":
        _assign(jobs, visible_gpus or [], cpus or [], settings.cpus_per_job)
    return jobs


def _shares(weights: dict[str, int], caps: dict[str, int], total: int) -> dict[str, int]:
    """`total` shards over the notebooks in proportion to `weights` (largest remainders), each at least one and at
    most its cap (its units)."""
    counts = {n: 1 for n in weights}
    spare = total - len(weights)
    whole = sum(weights.values())
    exact = {n: spare * w / whole for n, w in weights.items()}
    for n in weights:
        counts[n] = min(caps[n], 1 + int(exact[n]))
    left = total - sum(counts.values())
    for n in sorted(weights, key=lambda n: (-(exact[n] - int(exact[n])), n)):
        if left <= 0:
            break
        if counts[n] < caps[n]:
            counts[n] += 1
            left -= 1
    return counts


def _assign(jobs: list[Job], visible_gpus: list[str], cpus: list[int], cpus_per_job: int | None) -> None:
    """Disjoint GPU sets (by each job's width) or core sets (equal shares, or `cpus_per_job`) for local jobs."""
    if visible_gpus:
        free = list(visible_gpus)
        for job in jobs:
            job.devices, free = free[: max(1, job.gpus)], free[max(1, job.gpus) :]
        return
    share = cpus_per_job or max(1, len(cpus) // max(1, len(jobs)))
    for job in jobs:
        job.cpus = cpus[job.index * share : (job.index + 1) * share] or cpus[-share:]


def plan_lines(
    root: Path, profile: str, jobs: list[Job], settings: ExecutorSettings, gpu_memory_gib: float | None = None
) -> list[str]:
    """The job plan `--prepare-only` prints: each job's shards, GPUs (or cores), estimated units and prompt tokens,
    and with `gpu_memory_gib` the memory plan of each notebook's engines under the first job that starts them."""
    total_gpus = sum(j.gpus for j in jobs)
    array = f", {settings.array_parallelism} at once (Slurm array)" if settings.executor == "slurm" else ""
    out = [
        f"job plan ({settings.executor}): {len(jobs)} job(s), {total_gpus} GPU(s) in all{array}; "
        f"logs under outputs/{profile}/{JOBS}/"
    ]
    planned: set[str] = set()
    for job in jobs:
        if job.devices:
            where = f"GPUs {','.join(map(str, job.devices))}"
        elif job.cpus:
            where = f"cores {','.join(map(str, job.cpus))}"
        else:
            where = f"{job.gpus} GPU(s)"
        shards = ", ".join(f"{s.notebook} [shard {s.index + 1}/{s.of}]" for s in job.shards)
        out.append(f"  job {job.index}: {shards}; {where}; ~{job.units:.0f} units, ")
        out[-1] += f"at most {_tokens(job.tokens)} prompt tokens"
        for s in job.shards:
            if gpu_memory_gib is not None and s.notebook not in planned:
                planned.add(s.notebook)
                out += [
                    f"    {line}"
                    for line in parameters.memory_plan(merged_params(root, profile, s.notebook), gpu_memory_gib)
                ]
    out.append("  then: the sharded notebooks read every unit back; the timed notebooks (TTFT, QPS), the explorer")
    out[-1] += " and the report run alone"
    return out


def _tokens(n: float) -> str:
    for unit, size in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return f"{n:.0f}"
