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
import dataclasses
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence

from specprefill import flags
from specprefill.config import EngineParams, SpecPrefillConfig
from specprefill.engines.vllm import checks, planning, sizing
from specprefill.engines.vllm.async_engine import KEEP_RATE_KEY
from specprefill.errors import SpecPrefillError
from specprefill.models import resolve

KINDS = ("vllm", "specprefill")
STARTED: dict[str, int] = {}  # url -> pid of each server `running` holds up now
START_TIMEOUT_S = 900


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_command(kind: str, params: EngineParams, config: SpecPrefillConfig, port: int) -> list[str]:
    """The command line of one server, both from the same `params`: SpecPrefill (every field of `params` and
    `config` as its flag; every prompt of the benchmark is speculated) or plain vLLM with exactly the engine
    arguments SpecPrefill's base gets (`plain_server_flags`)."""
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
        *plain_server_flags(params),
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
def running(
    kind: str,
    params: EngineParams,
    config: SpecPrefillConfig,
    log_dir: str,
    extra_flags: Sequence[str] = (),
    name: str | None = None,
    side_by_side: bool = False,
):
    """A server of `kind` on a free port of 127.0.0.1 until the block ends; yields its URL. `extra_flags`: more
    `vllm serve` flags (both kinds take them); `name`: of its log file (default: the kind); `side_by_side`: other
    servers stay up on the same cores (idle OpenMP threads then sleep, as in SpecPrefill's own two engines)."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    with sizing.cpu_threads_env(params.tensor_parallel_size, side_by_side):  # plain vLLM gets the threads ours would
        names = ("OMP_NUM_THREADS", "VLLM_CPU_OMP_THREADS_BIND", "OMP_WAIT_POLICY")
        env.update({k: os.environ[k] for k in names if k in os.environ})
    os.makedirs(log_dir, exist_ok=True)
    log_path = os.path.join(log_dir, f"{name or kind}-server.log")
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            server_command(kind, params, config, port) + list(extra_flags),
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, url, f"the {name or kind} server", log_path)
        STARTED[url] = proc.pid
        yield url
    finally:
        STARTED.pop(url, None)
        stop(proc)


def cpu_seconds(url: str) -> float | None:
    """CPU-seconds used so far by the server `running` started at `url` and every process under it (None: a server
    this process did not start, or gone)."""
    import psutil

    pid = STARTED.get(url)
    if pid is None:
        return None
    try:
        root = psutil.Process(pid)
        total = 0.0
        for p in [root, *root.children(recursive=True)]:
            with contextlib.suppress(psutil.Error):
                t = p.cpu_times()
                total += t.user + t.system
        return total
    except psutil.Error:
        return None


def _generator(url: str, model: str, tokenizer: str, n_requests: int, rate: float, seed: int, argv: list[str]) -> dict:
    """One run of vLLM's load generator (`vllm bench serve`) against `url`'s completions endpoint: greedy, TTFT and
    end-to-end percentiles; `argv` adds the dataset and what else the caller needs. Its result dict."""
    from vllm.benchmarks.serve import add_cli_args, main_async
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    common = ["--backend", "openai", "--base-url", url, "--endpoint", "/v1/completions", "--model", model]
    common += ["--tokenizer", tokenizer, "--num-prompts", str(n_requests), "--request-rate", str(rate)]
    common += ["--seed", str(seed), "--temperature", "0", "--percentile-metrics", "ttft,e2el"]
    common += ["--metric-percentiles", "50,90", "--disable-tqdm", "--ready-check-timeout-sec", "60"]
    args = parser.parse_args(common + argv)
    with concurrent.futures.ThreadPoolExecutor(1) as pool, contextlib.redirect_stdout(sys.stderr):
        return pool.submit(asyncio.run, main_async(args)).result()  # its own event loop (a notebook kernel runs one)


def load(
    url: str, model: str, tokenizer: str, length: int, n_requests: int, rate: float, max_tokens: int, seed: int = 0
) -> dict:
    """`n_requests` random-token prompts of `length` tokens, Poisson arrivals at `rate` per second (inf: all at
    once), `max_tokens` each (EOS ignored). The generator's result dict (TTFT percentiles in ms, duration, ...)."""
    argv = ["--dataset-name", "random", "--random-input-len", str(length), "--random-output-len", str(max_tokens)]
    argv += ["--random-range-ratio", "0", "--ignore-eos", "--num-warmups", "1"]
    return _generator(url, model, tokenizer, n_requests, rate, seed, argv)


def load_requests(
    url: str,
    model: str,
    tokenizer: str,
    requests_path: str,
    n_requests: int,
    rate: float,
    seed: int = 0,
    warmup: int = 0,
    burstiness: float = 1.0,
    extra_body: dict | None = None,
) -> dict:
    """The prompts of a JSONL file (`{"prompt": text as sent, "output_tokens": k}` per line, vLLM's custom dataset)
    in the file's order, arrivals at `rate` per second (gamma intervals of shape `burstiness`: 1 is Poisson, large
    is nearly constant), greedy with EOS honoured; `warmup` requests first; `extra_body` goes into every request."""
    argv = ["--dataset-name", "custom", "--dataset-path", requests_path, "--custom-output-len", "-1"]
    argv += ["--skip-chat-template", "--disable-shuffle", "--no-oversample", "--num-warmups", str(warmup)]
    argv += ["--burstiness", str(burstiness), "--save-detailed"]  # per-request latencies and errors kept
    if extra_body:
        argv += ["--extra-body", json.dumps(extra_body)]
    return _generator(url, model, tokenizer, n_requests, rate, seed, argv)


def served_row(result: dict, timeout_s: float, tolerance: int) -> dict:
    """What a rate did for one category, as the original's QPS client counts it: a request is served when it ended
    without error within `timeout_s` of being sent; the rate is sustained when at most `tolerance` were not."""
    latencies = [float(x) for x, err in zip(result["latencies"], result["errors"]) if not err and float(x) < timeout_s]
    missed = len(result["latencies"]) - len(latencies)
    any_ok = any(not err for err in result["errors"])  # the generator's TTFT percentiles cover these only
    return {
        "requests": len(result["latencies"]),
        "served": len(latencies),
        "missed": missed,
        "sustained": missed <= tolerance,
        "latency_mean": sum(latencies) / len(latencies) if latencies else None,
        "ttft_p50": float(result["p50_ttft_ms"]) / 1000 if any_ok else None,
        "ttft_p90": float(result["p90_ttft_ms"]) / 1000 if any_ok else None,
        "duration_s": float(result["duration"]),
    }


def category_sweep(
    kind: str,
    params: EngineParams,
    config: SpecPrefillConfig,
    categories: dict[str, dict],
    requests_paths: dict[str, str],
    n_requests: int,
    tolerance: int,
    warmup: int = 0,
    burstiness: float = 1.0,
    seed: int = 0,
    log_dir: str | None = None,
) -> list[dict]:
    """One server of `kind` over every category: its requests (`requests_paths[category]`) at each of its `rates`
    in increasing order, stopping at the first rate not sustained (as the original's QPS scripts stop);
    SpecPrefill requests carry the category's `keep_rate`. One row per category and rate run. vLLM's generator has no
    per-request timeout: a request past its timeout still runs to the end (counted as missed), a heavier load than
    the original's client put on its server by abandoning it."""
    if params.base is None:
        raise SpecPrefillError("no base model given: a load test serves the base (pass base=)")
    log_dir = log_dir or tempfile.mkdtemp(prefix="specprefill-serve-")
    rows = []
    with running(kind, params, config, log_dir) as url:
        for name, cat in categories.items():
            body = {"vllm_xargs": {KEEP_RATE_KEY: cat["keep_rate"]}} if kind == "specprefill" else None
            for i, rate in enumerate(sorted(cat["rates"])):
                result = load_requests(
                    url, params.base, resolve(params.base), requests_paths[name], n_requests, rate, seed,
                    warmup if i == 0 else 0, burstiness, body,
                )  # fmt: skip
                row = served_row(result, cat["timeout_s"], tolerance)
                rows.append({"mode": kind, "category": name, "keep_rate": cat["keep_rate"] if body else 1.0,
                             "timeout_s": cat["timeout_s"], "rate": rate, **row})  # fmt: skip
                if not row["sustained"]:
                    break
    return rows


def category_max_qps(rows: list[dict]) -> list[dict]:
    """Per category and server: the highest rate sustained before the first one that was not (0: none was)."""
    out: dict[tuple, dict] = {}
    for r in sorted(rows, key=lambda r: r["rate"]):
        key = (r["category"], r["mode"])
        cell = out.setdefault(key, {"category": r["category"], "mode": r["mode"], "max_qps": 0.0, "failed": False})
        if cell["failed"]:
            continue
        if r["sustained"]:
            cell["max_qps"] = r["rate"]
        else:
            cell["failed"] = True
    return [{k: v for k, v in c.items() if k != "failed"} for c in out.values()]


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
    checks.validate(params)
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


def vllm_flags(kwargs: dict) -> list[str]:
    """Engine arguments as `vllm serve` flags. A switch at vLLM's own default is left out: some (e.g.
    --disable-log-stats) have no --no- form."""
    from vllm.engine.arg_utils import AsyncEngineArgs  # lazy: vLLM only where a server is about to start

    defaults = {f.name: f.default for f in dataclasses.fields(AsyncEngineArgs)}
    out = []
    for key, value in kwargs.items():
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            if value != defaults.get(key):
                out.append(flag if value else "--no-" + flag[2:])
        elif isinstance(value, (dict, list)):
            out += [flag, json.dumps(value)]
        elif value is not None:
            out += [flag, str(value)]
    return out


def plain_server_flags(p: EngineParams) -> list[str]:
    """A plain vLLM server's engine flags: exactly the arguments SpecPrefill's base gets from the same params."""
    return vllm_flags(planning.plan(p).base_kwargs)
