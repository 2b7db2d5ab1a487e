"""`specprefill models`: the offline model registry, and materializing it."""

from __future__ import annotations

from specprefill.errors import SpecPrefillError


def add(sub) -> None:
    p = sub.add_parser("models", help="list (and materialize) the offline model registry")
    p.add_argument(
        "--materialize",
        nargs="*",
        default=None,
        metavar="NAME",
        help="build the named registry models (no name: every one that is missing)",
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")


def run(args) -> dict:
    from specprefill import models  # lazy: transformers

    if args.materialize is not None:
        unknown = sorted(set(args.materialize) - set(models.MODELS))
        if unknown:
            raise SpecPrefillError(f"unknown model(s) {', '.join(unknown)}: `specprefill models` lists the registry")
        for name in args.materialize or models.MODELS:
            models.materialize(name)
    return {"models": models.list_models()}


def human(result: dict) -> str:
    return "\n".join(
        f"{m['name']:<22} {'ready' if m['materialized'] else 'missing':<8} {m['path']}" for m in result["models"]
    )
