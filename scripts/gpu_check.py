"""`make gpu-check`: run the checks only a CUDA GPU can run (tests/test_gpu.py) and report each one as ran, refused
(with its reason) or failed, in `outputs/gpu-check/report.json` and on one screen. `--list` names every check and
what the GPU-readiness work asks of it, including those not built yet (reported as refused, never skipped
silently). On a machine without a CUDA GPU it says so in one line and runs nothing.

`--engine hf` (`make gpu-check-hf`): the transformers reference engine's checks instead (`specprefill.refcheck`),
with torch and transformers only — no vLLM, no network, no model files — from a source checkout
(`PYTHONPATH=src`, or found beside this script): `--list`, `--budget-s N`, `--tiny` (the CPU, tiny shapes).

    python scripts/gpu_check.py [--engine vllm|hf] [--list] [--out outputs/gpu-check]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests" / "test_gpu.py"
ENGINE_TESTS = [ROOT / "tests" / f for f in ("test_vllm_engine.py", "test_capture.py", "test_families.py")]

# check -> what it covers and, when it cannot run yet, why (reported as refused with this reason)
CHECKS: dict[str, tuple[str, str | None]] = {
    "test_v1_runner_matches_the_oracle": (
        "V1 model runner vs the transformers oracle (selection, importance, tokens)",
        None,
    ),
    "test_v2_runner_async_scheduling_compiled_base": (
        "V2 model runner, async scheduling, compiled base (CUDA graphs) vs the oracle",
        None,
    ),
    "test_tensor_parallel_speculator": ("speculator tensor parallel over 2 GPUs vs the oracle", None),
    "test_fp8_kv_cache_base": ("base with an FP8 KV cache: the oracle's selection, the base generates", None),
    "engine_tests": ("the engine tests (test_vllm_engine.py, test_capture.py, test_families.py) on the GPU", None),
    "test_bf16_default_attention_backend": (
        "bf16 on the default attention backend (FlashAttention/FlashInfer), compiled base, vs the float32 oracle "
        "within the distance of the oracle's own bf16 run",
        None,
    ),
    "test_long_prompt_through_chunked_prefill": (
        "a 16,400-token prompt through 2,048-token chunked prefill on both engines: the one-chunk selection",
        None,
    ),
    "test_server_concurrent_keep_rates": (
        "`specprefill serve` on the GPU: concurrent requests at keep rates 0.1/0.3/1.0 keep what each keeps alone",
        None,
    ),
    "test_peak_memory_within_the_plan": (
        "device memory in use with both engines alive against the plan's shares (+1 GiB), both recorded",
        None,
    ),
    "test_ttft_speedup_offline_pair": (
        "TTFT speedup of the offline pair (Qwen2.5-Coder 0.5B -> 1.5B) at 4k/8k tokens, keep rate 0.1, recorded",
        None,
    ),
}


class _Outcomes:
    """A pytest plugin: each test's outcome (passed, skipped with its reason, failed with the last line)."""

    def __init__(self) -> None:
        self.seen: dict[str, dict] = {}

    def pytest_runtest_logreport(self, report) -> None:
        name = report.nodeid.split("::")[-1]
        if report.when == "call" or report.outcome != "passed":
            if report.skipped:
                reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
                self.seen[name] = {"result": "refused", "reason": reason.removeprefix("Skipped: ")}
            elif report.failed:
                last = str(report.longrepr).strip().splitlines()[-1:] or ["failed"]
                self.seen[name] = {"result": "failed", "reason": last[0], "seconds": round(report.duration, 1)}
            elif report.when == "call":
                measured = {k: v for k, v in report.user_properties if k != "cpu_s"}
                self.seen[name] = {"result": "ran", "seconds": round(report.duration, 1), **measured}


def _write(out: Path, report: dict) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    path = out / "report.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(report, indent=1) + "\n")
    tmp.replace(path)
    return path


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    engine = argparse.ArgumentParser(add_help=False)
    engine.add_argument("--engine", choices=("vllm", "hf"), default="vllm")
    known, argv = engine.parse_known_args(argv)
    if known.engine == "hf":
        sys.path.insert(0, str(ROOT / "src"))  # a source checkout, with or without PYTHONPATH=src
        try:
            from specprefill.refcheck import run
        except ModuleNotFoundError as exc:
            print(f"gpu-check --engine hf needs torch and transformers ({exc}): install them, or run it with a Python "
                  "that has them (make gpu-check-hf HF_PYTHON=...)", file=sys.stderr)  # fmt: skip
            return 2
        return run.main(argv, ROOT)
    parser = argparse.ArgumentParser(prog="gpu_check", description=__doc__.split("\n\n")[0])
    parser.add_argument("--list", action="store_true", help="name every check and what it covers, then exit")
    parser.add_argument("--out", default=str(ROOT / "outputs" / "gpu-check"), help="where report.json goes")
    args = parser.parse_args(argv)
    if args.list:
        for name, (covers, refusal) in CHECKS.items():
            print(f"{name}: {covers}" + (f" [{refusal}]" if refusal else ""))
        return 0
    import torch

    if not torch.cuda.is_available():
        print(
            "gpu-check: no CUDA GPU on this machine (torch.cuda.is_available() is False): nothing was checked; run it "
            "on a GPU machine (`make gpu-check` there installs vLLM's CUDA build)"
        )
        return 0
    import pytest

    outcomes = _Outcomes()
    started = time.time()
    pytest.main(["-q", "-p", "no:randomly", "-p", "no:cacheprovider", str(TESTS)], plugins=[outcomes])
    engine = _Outcomes()
    code = pytest.main(["-q", "-p", "no:cacheprovider", *map(str, ENGINE_TESTS)], plugins=[engine])
    results = [r["result"] for r in engine.seen.values()]
    summary = ", ".join(f"{results.count(k)} {k}" for k in ("ran", "refused", "failed"))
    outcomes.seen["engine_tests"] = {"result": "failed" if code not in (0, 5) else "ran", "reason": summary}
    checks = {}
    for name, (covers, refusal) in CHECKS.items():
        found = outcomes.seen.get(name) or {"result": "refused", "reason": refusal or "did not run"}
        checks[name] = {"covers": covers, **found}
    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    path = _write(Path(args.out), {"gpus": gpus, "seconds": round(time.time() - started), "checks": checks})
    print(f"gpu-check on {len(gpus)} x {gpus[0]}: {path}")
    for name, c in checks.items():
        print(f"  {c['result']:8s} {name}" + (f": {c['reason']}" if c.get("reason") else ""))
    return 1 if any(c["result"] == "failed" for c in checks.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
