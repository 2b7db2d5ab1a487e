"""Serving benchmark: `specprefill serve` against plain vLLM serving of the same base, one server at a time on the
same machine, each driven by vLLM's own load generator (`vllm bench serve`'s `vllm.benchmarks.serve`, Poisson
arrivals of random-token prompts) at the same rates. Reports p50/p90 TTFT per rate and the highest rate whose
p90 TTFT meets the SLO.

Plain vLLM runs as `python -m vllm.entrypoints.openai.api_server` (the `vllm` console script of the CPU wheel
looks up a distribution named "vllm" and fails) with the engine arguments `specprefill serve` gives its base.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import time

from specprefill import flags
from specprefill.config import EngineParams, SpecPrefillConfig
from specprefill.engines.vllm import builder, sizing
from specprefill.errors import SpecPrefillError
from specprefill.models import resolve

KINDS = ("vllm", "specprefill")
START_TIMEOUT_S = 900


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_command(kind: str, params: EngineParams, config: SpecPrefillConfig, port: int) -> list[str]:
    """The command line of one server, both from the same `params`: SpecPrefill (every field of `params` and
    `config` as its flag; every prompt of the benchmark is speculated) or plain vLLM with exactly the engine
    arguments SpecPrefill's base gets (`builder.plain_server_flags`)."""
    if kind == "specprefill":
        return [
            sys.executable,
            "-m",
            "specprefill",
            "serve",
            *flags.to_argv(params),
            *flags.to_argv(config),
            "--port",
            str(port),
        ]
    if kind != "vllm":
        raise SpecPrefillError(f"unknown server kind {kind!r}: use one of {', '.join(KINDS)}")
    if params.base is None:
        raise SpecPrefillError("no base model given: a load test serves the base (pass base=)")
    return [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        resolve(params.base),
        "--served-model-name",
        params.base,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        *builder.plain_server_flags(params),
    ]


def wait_healthy(proc: subprocess.Popen, url: str, what: str, log_path: str, timeout_s: float = START_TIMEOUT_S):
    """Until `url`/health answers 200; a one-line error naming the log if the process dies or time runs out."""
    import httpx

    deadline = time.time() + timeout_s
    while True:
        if proc.poll() is not None:
            raise SpecPrefillError(f"{what} exited while starting: see {log_path}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return
        if time.time() > deadline:
            raise SpecPrefillError(f"{what} was not healthy after {timeout_s:.0f} s: see {log_path}")
        time.sleep(1)


def stop(proc: subprocess.Popen, grace_s: float = 120) -> None:
    """SIGTERM (the server shuts its engines down), then SIGKILL after `grace_s`."""
    proc.terminate()
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()


@contextlib.contextmanager
def running(kind: str, params: EngineParams, config: SpecPrefillConfig, log_dir: str):
    """A server of `kind` on a free port of 127.0.0.1 until the block ends; yields its URL."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    with sizing.cpu_threads_env(params.tensor_parallel_size):  # plain vLLM gets the threads ours would
        env.update({k: os.environ[k] for k in ("OMP_NUM_THREADS", "VLLM_CPU_OMP_THREADS_BIND") if k in os.environ})
    os.makedirs(log_dir, exist_ok=True)
    log_path = os.path.join(log_dir, f"{kind}-server.log")
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            server_command(kind, params, config, port), stdout=log, stderr=subprocess.STDOUT, env=env
        )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, url, f"the {kind} server", log_path)
        yield url
    finally:
        stop(proc)


def load(
    url: str, model: str, tokenizer: str, length: int, n_requests: int, rate: float, max_tokens: int, seed: int = 0
) -> dict:
    """One run of vLLM's load generator: `n_requests` random-token prompts of `length` tokens, Poisson arrivals at
    `rate` per second (inf: all at once). Its result dict (TTFT percentiles in ms, duration, throughput)."""
    from vllm.benchmarks.serve import add_cli_args, main_async
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    args = parser.parse_args(
        [
            "--backend",
            "openai",
            "--base-url",
            url,
            "--endpoint",
            "/v1/completions",
            "--model",
            model,
            "--tokenizer",
            tokenizer,
            "--dataset-name",
            "random",
            "--random-input-len",
            str(length),
            "--random-output-len",
            str(max_tokens),
            "--random-range-ratio",
            "0",
            "--num-prompts",
            str(n_requests),
            "--request-rate",
            str(rate),
            "--seed",
            str(seed),
            "--ignore-eos",
            "--temperature",
            "0",
            "--percentile-metrics",
            "ttft,e2el",
            "--metric-percentiles",
            "50,90",
            "--disable-tqdm",
            "--num-warmups",
            "1",
            "--ready-check-timeout-sec",
            "60",
        ]
    )
    with concurrent.futures.ThreadPoolExecutor(1) as pool, contextlib.redirect_stdout(sys.stderr):
        return pool.submit(asyncio.run, main_async(args)).result()  # its own event loop (a notebook kernel runs one)


def row(kind: str, rate: float, result: dict, slo_s: float) -> dict:
    """Plain Python numbers (the generator's may be numpy scalars, which JSON refuses)."""
    p90 = float(result["p90_ttft_ms"]) / 1000
    return {
        "mode": kind,
        "rate": rate,
        "ttft_p50": float(result["p50_ttft_ms"]) / 1000,
        "ttft_p90": p90,
        "e2e_p50": float(result["p50_e2el_ms"]) / 1000,
        "e2e_p90": float(result["p90_e2el_ms"]) / 1000,
        "throughput_rps": float(result["request_throughput"]),
        "duration_s": float(result["duration"]),
        "completed": int(result["completed"]),
        "within_slo": bool(p90 <= slo_s and result["completed"] > 0),
    }


def sweep(
    kind: str,
    params: EngineParams,
    config: SpecPrefillConfig,
    length: int,
    n_requests: int,
    rates: list[float],
    max_tokens: int,
    slo_s: float,
    seed: int = 0,
    burst: int = 0,
    log_dir: str | None = None,
    on_row=None,
) -> list[dict]:
    """One server of `kind` over the rates (and, with `burst`, that many requests at once)."""
    if params.base is None:
        raise SpecPrefillError("no base model given: a load test serves the base (pass base=)")
    log_dir = log_dir or tempfile.mkdtemp(prefix="specprefill-serve-")
    tokenizer = resolve(params.base)
    rows = []
    with running(kind, params, config, log_dir) as url:
        for rate in list(rates) + ([float("inf")] if burst else []):
            n = burst if rate == float("inf") else n_requests
            result = load(url, params.base, tokenizer, length, n, rate, max_tokens, seed)
            rows.append({**row(kind, rate, result, slo_s), "requests": n, "length": length})
            if on_row:
                on_row(rows[-1])
    return rows


def compare(
    params: EngineParams,
    config: SpecPrefillConfig,
    length: int,
    n_requests: int,
    rates: list[float],
    max_tokens: int,
    slo_s: float,
    seed: int = 0,
    burst: int = 0,
    log_dir: str | None = None,
    on_row=None,
) -> list[dict]:
    """Plain vLLM, then SpecPrefill, over the same load: one run, one server at a time."""
    builder.validate(params)
    return [
        r
        for kind in KINDS
        for r in sweep(kind, params, config, length, n_requests, rates, max_tokens, slo_s, seed, burst, log_dir, on_row)
    ]


def max_qps(rows: list[dict], mode: str) -> float:
    """Highest offered rate whose p90 TTFT met the SLO (0 if none did; bursts are not offered rates)."""
    ok = [r["rate"] for r in rows if r["mode"] == mode and r["within_slo"] and r["rate"] != float("inf")]
    return max(ok, default=0.0)


def max_qps_by_mode(rows: list[dict]) -> dict[str, float]:
    return {mode: max_qps(rows, mode) for mode in KINDS}
