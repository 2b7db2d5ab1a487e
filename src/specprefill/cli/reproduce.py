"""`specprefill reproduce`: a params profile's notebooks through papermill."""

from __future__ import annotations

import sys

from specprefill import flags
from specprefill.errors import SpecPrefillError
from specprefill.project import project_root
from specprefill.settings import ExecutorSettings


def add(sub) -> None:
    p = sub.add_parser("reproduce", help="run the experiment notebooks of a params profile with papermill")
    p.add_argument("--profile", default="cpu")
    p.add_argument("--only", default=None, help="comma-separated notebook names")
    p.add_argument(
        "--force", action="store_true", help="compute everything again: every notebook and every finished unit"
    )
    p.add_argument(
        "--force-notebooks",
        action="store_true",
        help="execute finished notebooks again, reading back units whose inputs are unchanged",
    )
    p.add_argument("--prepare-only", action="store_true", help="inject parameters without executing")
    p.add_argument(
        "--data-dir",
        default=None,
        help="read hub datasets from this directory in their own schema (DIR/longbench/<config>.jsonl, ...)",
    )
    p.add_argument(
        "--gpu-memory-gib",
        type=float,
        default=None,
        help="with --prepare-only: each engine notebook's memory per GPU of this size (H100: 80, H200: 141), "
        "refused when the KV cache cannot hold its longest request or batch",
    )
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    group = p.add_argument_group("where the units are computed (generated from ExecutorSettings; a profile's "
                                 "_profile.yaml may set them under executor:)")  # fmt: skip
    flags.add_flags(group, ExecutorSettings)


def run(args) -> dict:
    from specprefill.workbench import parameters, runner  # lazy: papermill

    only = [x.strip() for x in args.only.split(",")] if args.only else None
    root = project_root()
    block = parameters.executor_block(root, args.profile) if args.profile in parameters.profiles(root) else {}
    settings = ExecutorSettings.of(block, flags.given(args, ExecutorSettings))
    if settings.executor != "inline":
        return _sharded(args, root, only, settings)
    failures = runner.run_profile(
        args.profile,
        only,
        args.force or args.force_notebooks,
        args.prepare_only,
        recompute=args.force,
        data_dir=args.data_dir,
        gpu_memory_gib=args.gpu_memory_gib,
    )
    result = {
        "profile": args.profile,
        "prepare_only": bool(args.prepare_only),
        "failures": [{"notebook": n, "error": e} for n, e in failures],
    }
    if failures:
        names = ", ".join(n for n, _ in failures)
        if args.prepare_only:  # nothing executed, nothing written: the reason is the params
            raise SpecPrefillError(f"{len(failures)} notebook(s) refused ({names}): {failures[0][1]}")
        raise SpecPrefillError(
            f"{len(failures)} notebook(s) failed ({names}): open outputs/{args.profile}/<name>/"
            "<name>.failed.ipynb (the partly executed copy), fix, and rerun (finished notebooks are skipped)"
        )
    return result


def _sharded(args, root, only, settings: ExecutorSettings) -> dict:
    """`--executor local|slurm`: with --prepare-only every notebook checked and the job plan printed (nothing
    submitted), else the jobs, then the pass that reads their units back (`workbench.cluster`)."""
    from specprefill.workbench import cluster, parameters, runner, shards  # lazy: papermill, submitit

    unknown = set(only or ()) - set(parameters.notebooks(root))
    if args.profile not in parameters.profiles(root) or unknown:  # the inline runner's one-line refusals
        runner.run_profile(args.profile, only, prepare_only=True, root=root)
    names = parameters.run_names(root, args.profile, only)
    if not only:
        runner.say_skipped(parameters.skipped(root, args.profile), args.profile)
    if args.prepare_only:
        failures = runner.run_profile(args.profile, names, prepare_only=True, root=root, data_dir=args.data_dir,
                                      gpu_memory_gib=args.gpu_memory_gib)  # fmt: skip
        if failures:
            raise SpecPrefillError(f"{len(failures)} notebook(s) refused ({failures[0][0]}): {failures[0][1]}")
        jobs = shards.plan(root, args.profile, names, settings, *cluster.machine(settings))
        lines = shards.plan_lines(root, args.profile, jobs, settings, args.gpu_memory_gib)
        print("\n".join(lines), file=sys.stderr)
        return {"profile": args.profile, "prepare_only": True, "failures": [], "job_plan": lines}
    if args.gpu_memory_gib is not None:
        raise SpecPrefillError("--gpu-memory-gib plans memory before a GPU job: use it with --prepare-only")
    failures = cluster.run(root, args.profile, names, settings, args.data_dir, args.force or args.force_notebooks,
                           args.force)  # fmt: skip
    result = {"profile": args.profile, "failures": [{"notebook": n, "error": e} for n, e in failures]}
    if failures:
        raise SpecPrefillError(
            f"{len(failures)} job(s) or notebook(s) failed: {failures[0][0]}: {failures[0][1]}"
            + (f" (and {len(failures) - 1} more, above)" if len(failures) > 1 else "")
        )
    return result


def human(result: dict) -> str:
    if result.get("prepare_only"):  # nothing ran: every notebook's parameters and plans were checked
        return f"profile {result['profile']}: every notebook's parameters checked (nothing run)"
    return f"profile {result['profile']}: all notebooks done"
