"""`specprefill reproduce`: a params profile's notebooks through papermill."""

from __future__ import annotations

from specprefill.errors import SpecPrefillError


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


def run(args) -> dict:
    from specprefill.workbench import runner  # lazy: papermill

    only = [x.strip() for x in args.only.split(",")] if args.only else None
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


def human(result: dict) -> str:
    if result.get("prepare_only"):  # nothing ran: every notebook's parameters and plans were checked
        return f"profile {result['profile']}: every notebook's parameters checked (nothing run)"
    return f"profile {result['profile']}: all notebooks done"
