"""How long a notebook of a profile is expected to take here, for `reproduce` (`--prepare-only` prints it per notebook
and in total; a run shows what is left): this machine's own last run of it (the seconds its stamp records, with the
machine), else the profile's recorded run (`data/files/notebook_seconds.yaml`: seconds per notebook measured on a
named machine, with its date and command) scaled by the CPU class's speed factor; nothing where neither exists."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path

import yaml

from specprefill import hardware
from specprefill.workbench import cost, store

# a notebook's time relative to the AMX Xeon's, per CPU class: planning factors from whole runs timed on more than one
# class (measurements.md): the AVX-512 bf16 EPYC took 824 s for 04_ttft where the Xeon took 536 s (1.54x; its 1.5B
# prefill alone is 3.4x slower, engine start-up and decoding much less so); an AVX2-only core in float32 runs the
# fresh-clone CI about twice as long as the Xeon. A machine's own last run replaces them (`predict`).
CLASS_FACTOR = {"amx": 1.0, "avx512_bf16": 1.54, "avx2": 2.0}
RECORDED = Path(__file__).resolve().parents[1] / "data" / "files" / "notebook_seconds.yaml"


def cpu_class(flags: frozenset[str] | set[str] | list[str]) -> str:
    """The speed class of a CPU by its flags: "amx", "avx512_bf16" or "avx2" (anything older counts as avx2)."""
    flags = set(flags)
    return "amx" if "amx_bf16" in flags else "avx512_bf16" if "avx512_bf16" in flags else "avx2"


def here() -> dict:
    """This machine as a prediction reads it: its CPU model, class (from the flags the project uses) and cores."""
    flags = hardware.cpu_flags()
    return {"cpu_model": hardware.cpu_model(), "cpu_class": cpu_class(flags), "cpus": len(hardware.allowed_cpus())}


def recorded(profile: str, path: Path | None = None) -> dict | None:
    """The profile's recorded run: {machine: {cpu_model, cpu_class, cpus}, date, command, seconds: {notebook: s},
    failed: [notebooks whose seconds are the time until they failed]}."""
    data = yaml.safe_load((path or RECORDED).read_text()) or {}
    return data.get(profile)


def _stamp(stamp: Path) -> dict:
    try:
        last = json.loads(stamp.read_text())
    except (OSError, ValueError):
        return {}
    return last if isinstance(last, dict) else {}


def predict(
    profile: str,
    name: str,
    stamp: Path,
    machine: dict | None = None,
    params: dict | None = None,
    cell: dict | None = None,
    done: set | None = None,
    measured: tuple | None = None,
) -> tuple[float, str] | None:
    """(seconds, where from) for notebook `name`: its last run on this machine (the stamp beside its outputs, where
    it ran with the same `params`, those papermill injects), else the work its parameters (`cell`'s under `params`)
    ask for at the CPU class's rates (`cost.seconds`; `done`: the units earlier notebooks of the run compute), else
    the profile's recorded run scaled by CPU class; None where none knows the notebook. `measured`: (rates, where
    from) of this machine (`workbench.timing.here`), in place of the class's rates."""
    machine = machine or here()
    last = _stamp(stamp)
    merged = {**(cell or {}), **params} if params is not None else None
    rates, measured_from = measured or (None, None)
    guess = (
        cost.seconds(name, merged, machine["cpu_class"], done, rates) if merged is not None else None
    )  # `done` grows
    if last.get("seconds") is not None and last.get("machine") == machine and _same(last, params):
        return float(last["seconds"]), "its last run here"
    if guess is not None:
        cores = "" if machine["cpus"] == 2 else f"; rates of 2 cores, here {machine['cpus']}"
        rated = measured_from or f"the {machine['cpu_class']} rates of workbench.cost"
        return guess, f"its parameters' work at {rated}{cores}"
    record = recorded(profile)
    if not record or name not in record.get("seconds", {}):
        return None
    ran = record["machine"]
    factor = CLASS_FACTOR[machine["cpu_class"]] / CLASS_FACTOR[ran["cpu_class"]]
    cores = "" if ran["cpus"] == machine["cpus"] else f"; recorded on {ran['cpus']} cores, here {machine['cpus']}"
    failed = "; at least: the recorded run failed there" if name in record.get("failed", []) else ""
    source = f"recorded {record['date']} on {ran['cpu_model']} x{factor:.2f}, a planning factor{cores}{failed}"
    return float(record["seconds"][name]) * factor, source


def _same(stamp: dict, params: dict | None) -> bool:
    """Whether a stamp was written by a run with these injected parameters (None: not asked)."""
    return params is None or stamp.get("params") == json.loads(json.dumps(params, default=str))


def start(out_dir: Path, stamp: Path, recompute: bool, params: dict | None = None) -> Callable[[], dict]:
    """Begin timing a notebook's run; the function returned gives its stamp's timing fields: this run's seconds and
    machine where it computed every unit (none was finished before it, or `recompute`; not a sharded run's reading
    pass), else the last such run's where it had the same `params` (units read back take no time), else none."""
    units = out_dir / "units"
    fresh = os.environ.get(store.UNITS_ENV) != "read" and (recompute or not any(units.rglob("*.json")))
    before, t0 = _stamp(stamp), time.perf_counter()

    def fields() -> dict:
        if fresh:
            return {"seconds": round(time.perf_counter() - t0, 1), "machine": here()}
        return {k: before[k] for k in ("seconds", "machine") if k in before} if _same(before, params) else {}

    return fields


def minutes(seconds: float) -> str:
    return f"{seconds / 60:.1f} min" if seconds >= 60 else f"{seconds:.0f} s"
