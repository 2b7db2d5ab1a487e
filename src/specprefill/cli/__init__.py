"""`specprefill` command line: one module per command (`add` builds its parser, `run` runs it, `human` prints its
result for a person), assembled here.

Heavy modules (torch, transformers, vLLM and the parts of this package built on them) are imported inside the
command that needs them, so `--help`, `--version` and argument errors answer at once; those imports say so.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys

from specprefill import quiet
from specprefill.cli import bench, calibrate, common, leaderboard, models, reproduce, run, serve
from specprefill.errors import SpecPrefillError

COMMANDS = {
    "models": models,
    "importance": run,
    "generate": run,
    "serve": serve,
    "reproduce": reproduce,
    "calibrate": calibrate,
    "bench": bench,
    "leaderboard": leaderboard,
}


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("specprefill")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown"


def parser() -> argparse.ArgumentParser:
    top = common.Parser(
        prog="specprefill", description="Speculative Prefill: prune prompts with a small speculator model."
    )
    top.add_argument("--version", action="version", version=f"specprefill {_version()}")
    top.add_argument(
        "--log-level",
        default="WARNING",
        type=str.upper,
        choices=("DEBUG", "INFO", "WARNING", "ERROR"),
        help="level of specprefill's and vLLM's logs (stderr)",
    )
    sub = top.add_subparsers(dest="command", required=True, parser_class=common.Parser)
    for module in dict.fromkeys(COMMANDS.values()):  # each once, in the order listed
        module.add(sub)
    return top


def error(exc: SpecPrefillError, log_level: str) -> int:
    """One line naming the fix; with --log-level DEBUG also the trace of what vLLM/transformers raised."""
    if log_level == "DEBUG" and exc.__cause__ is not None:
        import traceback

        traceback.print_exception(exc.__cause__, file=sys.stderr)
    print(f"specprefill: error: {exc}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # stdout carries only the result
    top = parser()
    args, rest = top.parse_known_args(argv)
    logging.basicConfig(level=args.log_level, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    if "VLLM_LOGGING_LEVEL" not in os.environ or args.log_level != "WARNING":
        os.environ["VLLM_LOGGING_LEVEL"] = args.log_level
    quiet.install(debug=args.log_level == "DEBUG")
    if rest and args.command != "serve":
        top.error(f"unrecognized arguments: {' '.join(rest)}")
    args.vllm_flags = rest
    from transformers.utils import logging as hf_logging  # lazy: after parsing, so --help answers at once

    hf_logging.disable_progress_bar()  # keeps stderr to the one line an error needs
    command = COMMANDS[args.command]
    try:
        if command is serve:  # runs until interrupted; standard output is the server's log
            serve.run(args)
            return 0
        with contextlib.redirect_stdout(sys.stderr):  # library chatter must not mix with the result on stdout
            result = command.run(args)
    except SpecPrefillError as exc:
        return error(exc, args.log_level)
    print(json.dumps(result) if args.json else command.human(result))
    return 0
