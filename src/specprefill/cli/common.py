"""What every command shares: the parser classes, the flags generated from the dataclasses, and reading them back."""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn

from specprefill import flags
from specprefill.config import SELECTION_RULES, SERVING_RULE, EngineParams, SpecPrefillConfig
from specprefill.errors import SpecPrefillError

ENGINES = ("hf", "vllm")
DEFAULT_PAIR = {"speculator": "qwen2.5-coder-0.5b", "base": "qwen2.5-coder-1.5b"}  # the benchmarks' pair


class Formatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every flag's help ends in its default (flags without help text get one too)."""

    def _get_help_string(self, action) -> str:
        text = action.help or ""
        if action.default in (None, False, [], argparse.SUPPRESS) or "%(default)" in text or "(default" in text:
            return text
        return f"{text} (default: %(default)s)".lstrip()

    def add_argument(self, action) -> None:
        if action.help is None and action.option_strings and action.default not in (None, False, []):
            action.help = "(default: %(default)s)"
        super().add_argument(action)


class Parser(argparse.ArgumentParser):
    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", Formatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:  # one line, non-zero exit
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def engine_flags(p: argparse.ArgumentParser, required: tuple[str, ...] = (), **defaults) -> None:
    """Every `EngineParams` field as a flag: vLLM's own names for the base, a --speculator- prefix for the
    speculator (`flags.add_flags`); `defaults`: the command's own defaults, shown in the help."""
    g = p.add_argument_group("models and vLLM engines (generated from EngineParams)")
    flags.add_flags(g, EngineParams, required=required, defaults=defaults)


def knob_flags(p: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> None:
    """Every `SpecPrefillConfig` knob as a flag (`flags.add_flags`), the serving rule's selection as defaults."""
    flags.add_flags(
        p.add_argument_group("SpecPrefill (generated from SpecPrefillConfig)"),
        SpecPrefillConfig,
        skip=skip,
        defaults=SELECTION_RULES[SERVING_RULE],
    )


def config(args, speculator: str | None = None, **overrides) -> SpecPrefillConfig:
    """The knobs the flags set, defaults for the rest (the selection: `SERVING_RULE`'s); the look-ahead's default is
    the resolved speculator's (`models.default_look_ahead`: 1 for self-speculation)."""
    given = flags.given(args, SpecPrefillConfig)
    if "look_ahead" not in given and speculator is not None:
        from specprefill.models import default_look_ahead  # lazy: transformers

        given["look_ahead"] = default_look_ahead(speculator)
    return SpecPrefillConfig(**{**SELECTION_RULES[SERVING_RULE], **given, **overrides})


def engine_params(args, **defaults) -> EngineParams:
    """EngineParams from the flags given; flags left unset take `defaults` (the command's), then the fields'."""
    return EngineParams(**{**defaults, **flags.given(args, EngineParams)})


def numbers(text: str, kind, what: str) -> list:
    """A comma-separated list of numbers of `kind` from a flag; one-line error naming the flag."""
    try:
        values = [kind(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SpecPrefillError(f"{what} {text!r} is not a comma-separated list of numbers: e.g. 1024,2048") from None
    if not values:
        raise SpecPrefillError(f"{what} is empty: give at least one value")
    return values


def machine_header(tag: str) -> dict:
    """The machine (CPU, cores, flags, auto dtype, threads), printed once on standard error and returned."""
    from specprefill import hardware  # lazy: torch

    m = hardware.machine()
    print(
        f"[{tag}] {m['cpu_model']} ({m['cpus']} cores; {' '.join(m['cpu_flags'])}), auto dtype {m['auto_dtype']}, "
        f"OMP threads {m['omp_num_threads']}",
        file=sys.stderr,
    )
    return m
