"""`specprefill` command line: models, importance, generate, serve, reproduce, bench.

Heavy modules (torch, transformers, vLLM and the parts of this package built on them) are imported inside the
command that needs them, so `--help`, `--version` and argument errors answer at once; those imports say so.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import os
import sys
import time
from collections.abc import Callable
from typing import NoReturn, cast

from specprefill import flags
from specprefill.atomic import write_text
from specprefill.config import CalibrationSettings, EngineParams, SpecPrefillConfig
from specprefill.errors import SpecPrefillError

ENGINES = ("hf", "vllm")
SERVE_MIN_PROMPT_TOKENS = 1024  # a server runs short prompts whole unless told otherwise
DEFAULT_PAIR = {"speculator": "qwen2.5-coder-0.5b", "base": "qwen2.5-coder-1.5b"}  # the benchmarks' pair
BASE_ONLY = tuple(f.name for f in dataclasses.fields(EngineParams) if f.metadata["role"] == "base")


def _engine_flags(p: argparse.ArgumentParser, required: tuple[str, ...] = (), **defaults) -> None:
    """Every `EngineParams` field as a flag: vLLM's own names for the base, a --speculator- prefix for the
    speculator (`flags.add_flags`); `defaults`: the command's own defaults, shown in the help."""
    g = p.add_argument_group("models and vLLM engines (generated from EngineParams)")
    flags.add_flags(g, EngineParams, required=required, defaults=defaults)


def _knob_flags(p: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> None:
    """Every `SpecPrefillConfig` knob as a flag (`flags.add_flags`)."""
    flags.add_flags(
        p.add_argument_group("SpecPrefill (generated from SpecPrefillConfig)"), SpecPrefillConfig, skip=skip
    )


def _config(args, speculator: str | None = None, **overrides) -> SpecPrefillConfig:
    """The knobs the flags set, defaults for the rest; the look-ahead's default is the resolved speculator's
    (`models.default_look_ahead`: 1 for self-speculation)."""
    given = flags.given(args, SpecPrefillConfig)
    if "look_ahead" not in given and speculator is not None:
        from specprefill.models import default_look_ahead  # lazy: transformers

        given["look_ahead"] = default_look_ahead(speculator)
    return SpecPrefillConfig(**{**given, **overrides})


def _engine_params(args, **defaults) -> EngineParams:
    """EngineParams from the flags given; flags left unset take `defaults` (the command's), then the fields'."""
    return EngineParams(**{**defaults, **flags.given(args, EngineParams)})


class _Formatter(argparse.ArgumentDefaultsHelpFormatter):
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


class _Parser(argparse.ArgumentParser):
    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", _Formatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:  # one line, non-zero exit
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


class _ServeHelp(argparse.Action):
    """`specprefill serve --help`: this command's flags, then `vllm serve`'s (--help=KEYWORD: vLLM's search)."""

    def __init__(self, option_strings, dest, **kwargs) -> None:
        super().__init__(option_strings, dest, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, namespace, values, option_string=None) -> NoReturn:
        from specprefill.serve.server import vllm_parser  # lazy: vLLM

        vllm = vllm_parser()
        vllm._search_keyword = values or "all"
        # on standard output, as every other command's --help and `vllm serve --help` (argparse's exit message would
        # go to standard error)
        print(parser.format_help() + "\n`vllm serve` flags (all accepted):\n\n" + vllm.format_help())
        parser.exit(0)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("specprefill")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown"


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="specprefill", description="Speculative Prefill: prune prompts with a small speculator model."
    )
    parser.add_argument("--version", action="version", version=f"specprefill {_version()}")
    parser.add_argument(
        "--log-level",
        default="WARNING",
        type=str.upper,
        choices=("DEBUG", "INFO", "WARNING", "ERROR"),
        help="level of specprefill's and vLLM's logs (stderr)",
    )
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    models = sub.add_parser("models", help="list (and materialize) the offline model registry")
    models.add_argument(
        "--materialize",
        nargs="*",
        default=None,
        metavar="NAME",
        help="build the named registry models (no name: every one that is missing)",
    )
    models.add_argument("--json", action="store_true", help="print JSON instead of a table")

    for name in ("importance", "generate"):
        p = sub.add_parser(name, help=f"{name} with SpecPrefill")
        p.add_argument(
            "--engine", choices=ENGINES, default="vllm", help="vllm: the product; hf: the transformers reference"
        )
        p.add_argument("--prompt-file", required=True, help="file with the prompt text, or - for stdin")
        p.add_argument("--chat", action="store_true", help="apply the chat template")
        p.add_argument("--json", action="store_true", help="print the result as JSON")
        p.add_argument(
            "--html",
            default=None,
            metavar="FILE",
            help="also write the token-importance heatmap (kept tokens outlined) as a standalone HTML page",
        )
        if name == "generate":
            p.add_argument("--max-tokens", type=int, default=64)
            p.add_argument("--temperature", type=float, default=0.0)
            p.add_argument("--top-p", type=float, default=1.0)
        _knob_flags(p)
        # importance: --base only names the model whose tokens are scored (self:K, another tokenizer)
        _engine_flags(p, required=("speculator", "base") if name == "generate" else ("speculator",), kv_sequences=1)
    srv = sub.add_parser(
        "serve",
        help="OpenAI-compatible SpecPrefill server on vLLM's async engine: specprefill serve MODEL --speculator S "
        "[any vllm serve flag]",
        description="specprefill serve MODEL --speculator S [flags]: vLLM's OpenAI-compatible server with SpecPrefill. "
        "Every `vllm serve` flag is accepted (listed after this command's own); a flag you give wins over the "
        "project's defaults, which only fill in what you leave unset. The flags listed first are this command's and "
        "take the forms shown there (e.g. --dtype float32, --max-model-len 8192).",
        add_help=False,
        allow_abbrev=False,  # an abbreviation of one of ours must not swallow one of vLLM's flags
    )
    srv.add_argument(
        "-h", "--help", action=_ServeHelp, nargs="?", help="this help, then vLLM's (--help=all, a group or a keyword)"
    )
    srv.add_argument("--host", default=None, help="address to bind (default: 127.0.0.1, this machine only)")
    srv.add_argument("--port", type=int, default=None, help="(default: 8000)")
    srv.add_argument("--api-key", default=None, help="require this bearer token")
    srv.add_argument("--served-model-name", default=None, help="model name clients send (default: MODEL as given)")
    _knob_flags(srv)
    # MODEL is vLLM's positional (or --base); vLLM's spellings of the base's fields (-tp, --max_num_seqs) work too
    _engine_flags(
        srv, required=("speculator",), min_prompt_tokens=SERVE_MIN_PROMPT_TOKENS, enable_prefix_caching="vLLM's"
    )
    rep = sub.add_parser("reproduce", help="run the experiment notebooks of a params profile with papermill")
    rep.add_argument("--profile", default="cpu")
    rep.add_argument("--only", default=None, help="comma-separated notebook names")
    rep.add_argument(
        "--force", action="store_true", help="compute everything again: every notebook and every finished unit"
    )
    rep.add_argument(
        "--force-notebooks",
        action="store_true",
        help="execute finished notebooks again, reading back units whose inputs are unchanged",
    )
    rep.add_argument("--prepare-only", action="store_true", help="inject parameters without executing")
    rep.add_argument(
        "--data-dir",
        default=None,
        help="read hub datasets from this directory in their own schema (DIR/longbench/<config>.jsonl, ...)",
    )
    rep.add_argument(
        "--gpu-memory-gib",
        type=float,
        default=None,
        help="with --prepare-only: each engine notebook's memory per GPU of this size (H100: 80, H200: 141), "
        "refused when the KV cache cannot hold its longest request or batch",
    )
    rep.add_argument("--json", action="store_true", help="print the result as JSON")

    cal = sub.add_parser(
        "calibrate", help="choose a speculator's layers and scoring heads for a base (then: --speculator calibrated:S)"
    )
    cal.add_argument("--engine", choices=ENGINES, default="vllm", help="vllm: the product; hf: the reference")
    cal.add_argument("--json", action="store_true", help="print the result as JSON")
    flags.add_flags(cal.add_argument_group("calibration (generated from CalibrationSettings)"), CalibrationSettings)
    _engine_flags(cal, required=("speculator", "base"))

    bench = sub.add_parser("bench", help="TTFT / QPS benchmarks: full prefill vs SpecPrefill, side by side")
    bench_sub = bench.add_subparsers(dest="bench", required=True, parser_class=_Parser)
    pre = bench_sub.add_parser("prefill", help="prefill tokens/s of each model in each dtype on this machine")
    pre.add_argument("--models", default="qwen2.5-coder-0.5b,qwen2.5-coder-1.5b")
    pre.add_argument("--dtypes", default="float32,bfloat16")
    pre.add_argument("--length", type=int, default=1024)
    pre.add_argument("--reps", type=int, default=3)
    pre.add_argument("--out", default=None, help="directory for prefill.json")
    pre.add_argument("--json", action="store_true", help="print the result as JSON")
    table = bench_sub.add_parser("table", help="`bench ttft` JSON files side by side (e.g. one per speculator)")
    table.add_argument("files", nargs="+", help="ttft.json files written by `bench ttft --out DIR`")
    table.add_argument("--json", action="store_true", help="print the result as JSON")
    for name in ("ttft", "qps"):
        b = bench_sub.add_parser(name)
        b.add_argument("--out", default=None, help="directory for the JSON and the plot")
        b.add_argument("--json", action="store_true", help="print the result as JSON")
        if name == "ttft":
            b.add_argument("--lengths", default="1024,2048,4096")
            b.add_argument(
                "--keep-rates", default=None, help="keep rates to sweep (default: 0.1,0.3,0.5; --keep-rate R: R alone)"
            )
            b.add_argument("--reps", type=int, default=3)
            b.add_argument(
                "--token-budget",
                type=int,
                default=0,
                help="the original's batched regime: tokens per batch, batch = budget / length (e.g. 524288 = "
                "128 x 4096); 0: one request at a time",
            )
            b.add_argument("--warmup", type=int, default=1, help="unrecorded repetitions before the timed ones")
            b.add_argument(
                "--families",
                default="",
                help="configuration families side by side, e.g. p,p_full_lah8 (default: the knobs given here)",
            )
        else:
            b.add_argument("--length", type=int, default=2048)
            b.add_argument("--requests", type=int, default=8, help="requests per rate")
            b.add_argument("--rates", default="0.05,0.1,0.2,0.4", help="offered requests/s")
            b.add_argument("--slo", type=float, default=20.0, help="p90 TTFT limit in seconds")
            b.add_argument("--max-tokens", type=int, default=16)
            b.add_argument(
                "--burst", type=int, default=0, help="also send this many requests at once to each server (0: none)"
            )
        _knob_flags(b)
        _engine_flags(b, required=(), **DEFAULT_PAIR)
    return parser


def _numbers(text: str, kind, what: str) -> list:
    try:
        values = [kind(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SpecPrefillError(f"{what} {text!r} is not a comma-separated list of numbers: e.g. 1024,2048") from None
    if not values:
        raise SpecPrefillError(f"{what} is empty: give at least one value")
    return values


def _cmd_bench(args) -> dict:
    if args.bench == "table":  # before the imports below: it reads JSON only
        return _cmd_table(args)
    from tqdm.auto import tqdm  # lazy: with the modules below

    from specprefill import hardware  # lazy: torch
    from specprefill.serve import loadtest  # lazy: vLLM
    from specprefill.workbench import bench, plots, records, store  # lazy: vLLM, seaborn

    if args.bench == "prefill":
        return _cmd_prefill(args)
    config = _config(args, args.speculator or DEFAULT_PAIR["speculator"])
    if args.bench == "ttft":
        if args.keep_rates is not None and args.keep_rate is not None:
            raise SpecPrefillError(
                "--keep-rate and --keep-rates both given: pass one (--keep-rate R is --keep-rates R)"
            )
        rates = (
            [config.keep_rate]
            if args.keep_rate is not None
            else _numbers(args.keep_rates or "0.1,0.3,0.5", float, "--keep-rates")
        )
        lengths = _numbers(args.lengths, int, "--lengths")
        for r in rates:
            config.replace(keep_rate=r)  # validates
        if args.reps < 1:
            raise SpecPrefillError(f"--reps {args.reps} must be >= 1")
        if args.warmup < 0:
            raise SpecPrefillError(f"--warmup {args.warmup} must be >= 0")
        families = [f.strip() for f in args.families.split(",") if f.strip()]
        unknown = sorted(set(families) - set(records.FAMILIES))
        if unknown:
            raise SpecPrefillError(f"--families {','.join(unknown)}: use names from {', '.join(records.FAMILIES)}")
        batches = {n: bench.batch_of(args.token_budget, n) for n in lengths}  # validates the budget
    else:
        rates = _numbers(args.rates, float, "--rates")
        lengths = [args.length]
    max_len = max(lengths) + max(64, config.look_ahead + 16, args.max_tokens if args.bench == "qps" else 0)
    budget = getattr(args, "token_budget", 0)
    engine = _engine_params(
        args,
        **DEFAULT_PAIR,
        max_model_len=max_len,
        **({"kv_sequences": max(4, -(-budget // max_len) + 1)} if budget else {}),  # a whole batch's KV at once
    )
    machine = _bench_header()
    t0 = time.perf_counter()
    if args.bench == "ttft":
        b = bench.Bench(engine, config)
        print(f"[bench] dtype {b.dtype}", file=sys.stderr)
        dtype = b.llm.dtype
        rows = []
        cases = tqdm(
            [(f, n, r) for f in families or [None] for n in lengths for r in rates],
            desc="bench ttft",
            unit="case",
            file=sys.stderr,
            disable=None,
        )
        for family, length, rate in cases:
            overrides = records.FAMILIES[family] if family else {}
            row = b.ttft(length, rate, args.reps, batch=batches[length], warmup=args.warmup, overrides=overrides)
            rows.append({**row, "label": family or "specprefill"})
            cases.write(
                f"[bench] {family + ' ' if family else ''}{batches[length]} x {length} tokens keep {rate}: "
                f"speedup {row['speedup']:.2f}x (bound {row['bound']:.2f}x, efficiency {row['efficiency']:.2f})",
                file=sys.stderr,
            )
    else:
        dtype = hardware.resolve_dtype(engine.dtype)
        print(f"[bench] dtype {dtype}; servers one at a time: {', '.join(loadtest.KINDS)}", file=sys.stderr)
        rows = loadtest.compare(
            engine,
            config,
            args.length,
            args.requests,
            rates,
            args.max_tokens,
            args.slo,
            engine.seed or 0,
            args.burst,
            args.out,
            on_row=lambda r: print(
                f"[bench] {r['mode']} at {r['rate']}/s ({r['requests']} requests): p50/p90 TTFT "
                f"{r['ttft_p50']:.2f}/{r['ttft_p90']:.2f} s, {r['duration_s']:.1f} s in all",
                file=sys.stderr,
            ),
        )
    result = {
        "rows": rows,
        "machine": machine,
        "config": {
            **vars(args),
            "engine": engine.to_dict(),
            "dtype": dtype,
            "specprefill": config.to_dict(),
            "wall_s": time.perf_counter() - t0,
        },
    }
    if args.bench == "qps":
        result["max_qps"] = loadtest.max_qps_by_mode(rows)
    if args.out:
        store.write_json(os.path.join(args.out, f"{args.bench}.json"), result)
        if args.bench == "ttft":
            plots.ttft(rows, os.path.join(args.out, "ttft.png"))
        else:
            plots.qps(rows, args.slo, os.path.join(args.out, "qps.png"))
    return result


def _bench_header() -> dict:
    from specprefill import hardware  # lazy: torch

    m = hardware.machine()
    print(
        f"[bench] {m['cpu_model']} ({m['cpus']} cores; {' '.join(m['cpu_flags'])}), auto dtype {m['auto_dtype']}, "
        f"OMP threads {m['omp_num_threads']}",
        file=sys.stderr,
    )
    return m


def _cmd_prefill(args) -> dict:
    from specprefill import models  # lazy: transformers
    from specprefill.workbench import bench, store  # lazy: vLLM

    if args.reps < 1 or args.length < 1:
        raise SpecPrefillError("--reps and --length must be >= 1")
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    names = [n.strip() for n in args.models.split(",") if n.strip()]
    paths = {n: models.resolve(n) for n in names}  # unknown names fail before any engine starts
    machine, rows = _bench_header(), []
    for name, dtype in [(n, d) for n in names for d in dtypes]:
        rows.append({**bench.prefill_rate(paths[name], dtype, args.length, args.reps), "model": name})
        print(f"[bench] {name} {rows[-1]['dtype']}: {rows[-1]['tokens_per_s']:.0f} tokens/s", file=sys.stderr)
    result = {"rows": rows, "machine": machine, "config": vars(args)}
    if args.out:
        store.write_json(os.path.join(args.out, "prefill.json"), result)
    return result


def _cmd_table(args) -> dict:
    from specprefill.workbench import report  # lazy: pandas

    results = []
    for path in args.files:
        try:
            with open(path, encoding="utf-8") as f:
                results.append(json.load(f))
        except (OSError, ValueError) as exc:
            raise SpecPrefillError(
                f"cannot read {path} ({exc}): pass ttft.json files from `bench ttft --out DIR`"
            ) from None
    return {"table": report.bench_table(results), "files": args.files}


def _cmd_calibrate(args) -> dict:
    from specprefill import calibrate  # lazy: torch, transformers

    if args.base is None:
        raise SpecPrefillError("calibrate needs the base the speculator serves: add --base MODEL")
    settings = CalibrationSettings(**flags.given(args, CalibrationSettings))
    result = calibrate.calibrate(args.speculator, args.base, settings, args.engine, _engine_params(args))
    return {**result, "table": calibrate.summary(result)}


def _cmd_reproduce(args) -> dict:
    from specprefill.workbench import runner  # lazy: papermill, vLLM

    only = [x.strip() for x in args.only.split(",")] if args.only else None
    failures = runner.run_profile(
        args.profile,
        only,
        args.force or args.force_notebooks,
        args.prepare_only,
        recompute=args.force,
        data_dir=args.data_dir,
        gpu_memory_gib=args.gpu_memory_gib,
    )
    result = {"profile": args.profile, "failures": [{"notebook": n, "error": e} for n, e in failures]}
    if failures:
        names = ", ".join(n for n, _ in failures)
        if args.prepare_only:  # nothing executed, nothing written: the reason is the params
            raise SpecPrefillError(f"{len(failures)} notebook(s) refused ({names}): {failures[0][1]}")
        raise SpecPrefillError(
            f"{len(failures)} notebook(s) failed ({names}): open outputs/{args.profile}/<name>/"
            "<name>.failed.ipynb (the partly executed copy), fix, and rerun (finished notebooks are skipped)"
        )
    return result


def _read_prompt(path: str) -> str:
    try:
        if path == "-":
            return sys.stdin.read()
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError as exc:
        raise SpecPrefillError(
            f"cannot read prompt file {path!r} ({exc.strerror}): pass an existing file or - for stdin"
        ) from None
    except UnicodeDecodeError as exc:
        raise SpecPrefillError(
            f"prompt file {path!r} is not UTF-8 (byte {exc.start}): convert it first, e.g. "
            "iconv -f latin1 -t utf-8 FILE"
        ) from None


def _serve_params(args) -> tuple[EngineParams, argparse.Namespace, str]:
    """(params, vLLM's parsed server arguments, served model name) of `serve`. The base's settings: this command's
    flags, then the `vllm serve` flags given (one setting given both ways must agree), then the project's defaults
    (prefix caching: vLLM's)."""
    from specprefill.serve.server import engine_settings, vllm_server_args  # lazy: vLLM

    vllm_args, given, model = vllm_server_args(args.vllm_flags, args.host, args.port, args.api_key)
    ours = flags.given(args, EngineParams)
    if model is not None and ours.setdefault("base", model) != model:
        raise SpecPrefillError(f"two models given ({ours['base']!r} and {model!r}): pass MODEL once")
    if "base" not in ours:
        raise SpecPrefillError("no model given: specprefill serve MODEL --speculator S [vllm serve flags]")
    theirs = engine_settings(given)
    ours["engine_args"] = {**theirs.pop("engine_args"), **ours.get("engine_args", {})}
    for name, value in theirs.items():
        if ours.setdefault(name, value) != value:
            raise SpecPrefillError(f"{name} given twice ({ours[name]!r} and {value!r}): pass it once")
    params = EngineParams(**{"min_prompt_tokens": SERVE_MIN_PROMPT_TOKENS, "enable_prefix_caching": None, **ours})
    return params, vllm_args, args.served_model_name or ours["base"]


def _cmd_serve(args) -> int:
    """Runs until interrupted; stdout is the server's log (there is no JSON result)."""
    import asyncio

    from specprefill.serve.server import serve  # lazy: vLLM

    try:
        params, vllm_args, served_name = _serve_params(args)
        asyncio.run(serve(params, _config(args, args.speculator), vllm_args, served_name))
    except SpecPrefillError as exc:
        return _error(exc, args.log_level)
    except KeyboardInterrupt:
        pass
    return 0


def _cmd_models(args) -> dict:
    from specprefill import models  # lazy: transformers

    if args.materialize is not None:
        unknown = sorted(set(args.materialize) - set(models.MODELS))
        if unknown:
            raise SpecPrefillError(f"unknown model(s) {', '.join(unknown)}: `specprefill models` lists the registry")
        for name in args.materialize or models.MODELS:
            models.materialize(name)
    return {"models": models.list_models()}


def _cmd_run(args) -> dict:
    config = _config(args, args.speculator)  # knobs, flags and prompt file checked before anything heavy is imported
    if args.html and not os.path.isdir(os.path.dirname(os.path.abspath(args.html))):
        raise SpecPrefillError(f"--html {args.html}: its folder does not exist; create it or pick another path")
    if args.command == "generate" and args.max_tokens < 1:
        raise SpecPrefillError(f"--max-tokens {args.max_tokens} must be >= 1")
    if args.command == "importance":  # no base engine starts: its flags would do nothing
        unused = [
            flags.flag(f)
            for f in dataclasses.fields(EngineParams)
            if f.name in BASE_ONLY and getattr(args, f.name, None) is not None
        ]
        if unused:
            raise SpecPrefillError(
                f"{', '.join(unused)} set(s) the base engine, which `importance` does not start: "
                "drop it, or use `generate`"
            )
    text = _read_prompt(args.prompt_file)
    if args.engine == "vllm":
        # one prompt, then exit: vLLM's engine core and worker run in this process (no process pair per engine),
        # which for the float32 Qwen 0.5B + 1.5B pair at 4k tokens takes peak RSS from 13.0 to 11.7 GiB. Set before
        # vLLM reads its environment; a value of your own is kept.
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        # the second engine of a process re-registers vLLM's kernels and asks torch for its thread count again
        # (ignored: the threads are already bound), with a warning each time: noise here, so it is dropped
        for name, noise in (
            ("vllm.v1.worker.cpu_worker", "torch.set_num_threads"),
            ("vllm.triton_utils.dispatcher", "is already registered"),
        ):
            logging.getLogger(name).addFilter(
                cast(Callable[[logging.LogRecord], bool], lambda record, noise=noise: noise not in record.getMessage())
            )

    from specprefill import hardware, models, tokenmap  # lazy: torch, transformers
    from specprefill.engines.common import (
        Engine,
        SamplingConfig,
        check_length,
        load_tokenizer,
        model_context,
        require_text,
        tokenize_prompt,  # lazy: torch
    )

    require_text(text)  # before any model is fetched
    speculator = models.resolve_speculator(args.speculator, args.base)  # --base resolves self:K
    base = models.resolve(args.base) if args.command == "generate" else None
    config = _config(args, speculator)  # the look-ahead default decided on the resolved speculator
    tokenizer = load_tokenizer(base or speculator)  # prompts are in base tokens (a cross-tokenizer speculator maps)
    ids = tokenize_prompt(tokenizer, text, chat=args.chat)
    pair = tokenmap.Pair(load_tokenizer(speculator), tokenizer if base not in (None, speculator) else None)
    max_new = args.max_tokens if args.command == "generate" else 0
    counts = {
        speculator: (args.speculator, len(pair.speculator_ids(ids, pair.map(ids)))),
        **({base: (args.base, len(ids))} if base else {}),
    }
    for path, (name, n_tokens) in counts.items():  # before any weights are loaded
        check_length(n_tokens, max_new + config.look_ahead, model_context(path), name)
    # sized for this prompt: a model's full context would reserve far more memory than needed
    params = _engine_params(args, kv_sequences=1, max_model_len=len(ids) + max_new + config.look_ahead)
    params = params.replace(speculator=speculator, base=base)
    if pair.cross:  # the speculator's own tokens of this text, plus its look-ahead
        params.speculator_engine_args.setdefault("max_model_len", counts[speculator][1] + config.look_ahead)
    dtype = hardware.resolve_dtype(params.dtype)
    engine: Engine
    if args.engine == "vllm":
        try:
            from specprefill.engines.vllm.adapter import VLLMEngine  # lazy: vLLM, only for --engine vllm
        except ModuleNotFoundError as exc:
            raise SpecPrefillError(f"--engine vllm is not available ({exc}): use --engine hf") from None
        engine = VLLMEngine.from_params(params, config)
    else:
        from specprefill.engines.hf import HFEngine  # lazy: transformers

        engine = HFEngine(speculator, base, config, hardware.torch_dtype(dtype))
    if args.command == "importance":
        pruned = engine.speculate([ids], [config])[0]
        spec_s = engine.last_timings["speculation_s"]
        result = {
            "n_prompt_tokens": len(ids),
            "prompt_token_ids": ids,
            "importance": pruned.importance,
            "kept_indices": pruned.kept_indices,
            "config": config.to_dict(),
            "timings": {"speculation_s": spec_s},
            "dtype": dtype,
        }
    else:
        sampling = SamplingConfig(temperature=args.temperature, top_p=args.top_p, seed=params.seed)
        result = {**engine.generate([ids], max_tokens=args.max_tokens, sampling=sampling)[0].to_dict(), "dtype": dtype}
    if args.html:
        if not result["importance"]:
            raise SpecPrefillError(
                "--html: this prompt ran whole (keep rate 1), so it has no importance scores to "
                "draw: pass a keep rate below 1"
            )
        result["html"] = str(_write_heatmap(args.html, tokenizer, result, args.speculator))
    return result


def _write_heatmap(path: str, tokenizer, result: dict, speculator: str):
    from specprefill.viz.heatmap import page, render_html, token_strings  # lazy: only for --html

    n, kept = result["n_prompt_tokens"], result["kept_indices"]
    title = f"{speculator}: kept {len(kept)} of {n} tokens at keep rate {result['config']['keep_rate']}"
    return write_text(
        path,
        page(
            render_html(token_strings(tokenizer, result["prompt_token_ids"]), result["importance"], kept, title=title)
        ),
    )


def _human(result: dict) -> str:
    if "failures" in result:
        return f"profile {result['profile']}: all notebooks done"
    if "table" in result:
        return result["table"]
    if "rows" in result:
        return "\n".join(
            "  ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items() if k != "overhead")
            for row in result["rows"]
        )
    if "models" in result:
        return "\n".join(
            f"{m['name']:<22} {'ready' if m['materialized'] else 'missing':<8} {m['path']}" for m in result["models"]
        )
    n, kept = result["n_prompt_tokens"], result["kept_indices"]
    lines = [f"prompt tokens: {n}", f"kept: {len(kept)} ({len(kept) / n:.1%})"]
    if "output_text" in result:
        t = result["timings"]
        lines += [
            "  ".join(
                f"{k.removesuffix('_s').replace('_', ' ')} {v:.3f}s" for k, v in t.items() if v is not None
            ).replace("ttft", "TTFT"),
            "",
            result["output_text"],
        ]
    return "\n".join(lines)


def _error(exc: SpecPrefillError, log_level: str) -> int:
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
    parser = _parser()
    args, rest = parser.parse_known_args(argv)
    logging.basicConfig(level=args.log_level, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    if "VLLM_LOGGING_LEVEL" not in os.environ or args.log_level != "WARNING":
        os.environ["VLLM_LOGGING_LEVEL"] = args.log_level
    if rest and args.command != "serve":
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    args.vllm_flags = rest
    from transformers.utils import logging as hf_logging  # lazy: after parsing, so --help answers at once

    hf_logging.disable_progress_bar()  # keeps stderr to the one line an error needs
    if args.command == "serve":
        return _cmd_serve(args)
    try:
        commands = {
            "models": _cmd_models,
            "bench": _cmd_bench,
            "reproduce": _cmd_reproduce,
            "calibrate": _cmd_calibrate,
        }
        with contextlib.redirect_stdout(sys.stderr):  # library chatter must not mix with the result on stdout
            result = commands.get(args.command, _cmd_run)(args)
    except SpecPrefillError as exc:
        return _error(exc, args.log_level)
    print(json.dumps(result) if args.json else _human(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
