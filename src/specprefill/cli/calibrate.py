"""`specprefill calibrate`: a speculator's layers and scoring heads for a base."""

from __future__ import annotations

from specprefill import flags
from specprefill.cli import common
from specprefill.errors import SpecPrefillError
from specprefill.settings import CalibrationSettings


def add(sub) -> None:
    p = sub.add_parser(
        "calibrate", help="choose a speculator's layers and scoring heads for a base (then: --speculator calibrated:S)"
    )
    p.add_argument("--engine", choices=common.ENGINES, default="vllm", help="vllm: the product; hf: the reference")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    flags.add_flags(p.add_argument_group("calibration (generated from CalibrationSettings)"), CalibrationSettings)
    common.engine_flags(p, required=("speculator", "base"))


def run(args) -> dict:
    from specprefill import calibrate  # lazy: torch, transformers

    if args.base is None:
        raise SpecPrefillError("calibrate needs the base the speculator serves: add --base MODEL")
    settings = CalibrationSettings(**flags.given(args, CalibrationSettings))
    result = calibrate.calibrate(args.speculator, args.base, settings, args.engine, common.engine_params(args))
    return {**result, "table": calibrate.summary(result)}


def human(result: dict) -> str:
    return result["table"]
