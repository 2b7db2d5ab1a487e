"""Interfaces generated from the fields of `SpecPrefillConfig` and `EngineParams` (name, type, default, help): the
CLI's flags, a server's command line, lm-eval's model arguments and the notebooks' parameters cells. Every knob is
reachable everywhere and nothing is listed twice; a field added to either dataclass appears in all of them.
No torch or vLLM here (the CLI's help stays fast)."""

from __future__ import annotations

import argparse
import dataclasses
import typing
from typing import Any

import yaml

from specprefill.errors import SpecPrefillError


def flag(f: dataclasses.Field) -> str:
    return "--" + f.metadata.get("flag", f.name.replace("_", "-"))


def field_type(cls: type, f: dataclasses.Field) -> type:
    """The field's type without `None` (int for `int | None`)."""
    hint = typing.get_type_hints(cls)[f.name]
    if typing.get_origin(hint) is dict:  # `dict[str, Any]`: its arguments are not a union's members
        return dict
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if args else hint


def default_of(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else None


def key_values(items: list[str] | None, name: str) -> dict:
    """KEY=VALUE items (VALUE read as YAML) -> a dict; a one-line error naming the form."""
    out = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise SpecPrefillError(f"{name} {item!r} is not KEY=VALUE: e.g. {name} max_num_seqs=8")
        out[key.strip().replace("-", "_")] = yaml.safe_load(value)
    return out


def add_flags(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    cls: type,
    skip: tuple[str, ...] = (),
    required: tuple[str, ...] = (),
    defaults: dict | None = None,
) -> None:
    """One flag per field of `cls` (a dataclass), named after the field (or its `flag` metadata). The parsed value
    is None when the flag is not given (`given` then leaves the field to its default); `defaults` shows other
    defaults a command applies itself; dict fields are repeatable KEY=VALUE flags."""
    defaults = defaults or {}
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        kind, default = field_type(cls, f), defaults.get(f.name, default_of(f))
        text = f.metadata.get("help", "")
        if default not in (None, {}, dataclasses.MISSING) and f.name not in required:
            text = f"{text} (default: {default})"
        names = [flag(f)]
        if kind is dict:
            parser.add_argument(
                *names,
                dest=f.name,
                action="append",
                default=None,
                metavar="KEY=VALUE",
                help=f"{text} (repeatable; VALUE read as YAML)",
            )
        elif kind is bool:
            parser.add_argument(*names, dest=f.name, action=argparse.BooleanOptionalAction, default=None, help=text)
        else:
            parser.add_argument(
                *names,
                dest=f.name,
                type=kind,
                default=None,
                required=f.name in required,
                help=text,
                choices=f.metadata.get("choices"),
            )


def given(args: argparse.Namespace, cls: type) -> dict:
    """The fields of `cls` whose flags were given (dict fields parsed from their KEY=VALUE items)."""
    out = {}
    for f in dataclasses.fields(cls):
        value = getattr(args, f.name, None)
        if value is None:
            continue
        out[f.name] = key_values(value, flag(f)) if field_type(cls, f) is dict else value
    return out


def to_argv(obj: Any, skip: tuple[str, ...] = ()) -> list[str]:
    """Flags that give back `obj` (a dataclass instance) when parsed by `add_flags` + `given`: every field whose
    value is not None, so the receiver's own defaults play no part."""
    argv: list[str] = []
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if f.name in skip or value is None:
            continue
        if isinstance(value, bool):
            argv.append(flag(f) if value else "--no-" + flag(f)[2:])
        elif isinstance(value, dict):
            argv += [f"{flag(f)}={k}={yaml.safe_dump(v, default_flow_style=True).strip()}" for k, v in value.items()]
        else:
            argv.append(f"{flag(f)}={value}")
    return argv


def parameters_lines(cls: type, skip: tuple[str, ...] = ()) -> list[str]:
    """A notebook parameters cell's lines for the fields of `cls`: `name = default  # help`."""
    return [  # papermill's parameter parser cannot read a comment holding "=" or ";"
        f"{f.name} = {default_of(f)!r}  # {f.metadata.get('help', '').replace(';', ',').replace('=', ':')}"
        for f in dataclasses.fields(cls)
        if f.name not in skip
    ]


def split_kwargs(kwargs: dict, *classes: type) -> tuple[list[dict], dict]:
    """Keyword arguments (e.g. lm-eval's model_args) -> one dict per dataclass, by field name, and the rest."""
    rest = dict(kwargs)
    parts = []
    for cls in classes:
        names = {f.name for f in dataclasses.fields(cls)}
        parts.append({k: rest.pop(k) for k in list(rest) if k in names})
    return parts, rest
