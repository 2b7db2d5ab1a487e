"""`specprefill importance` and `specprefill generate`: one prompt through SpecPrefill, on vLLM or the transformers
reference."""

from __future__ import annotations

import dataclasses
import os
import sys

from specprefill import flags
from specprefill.atomic import write_text
from specprefill.cli import common
from specprefill.config import EngineParams
from specprefill.errors import SpecPrefillError

COMMANDS = ("importance", "generate")
BASE_ONLY = tuple(f.name for f in dataclasses.fields(EngineParams) if f.metadata["role"] == "base")


def add(sub) -> None:
    for name in COMMANDS:
        p = sub.add_parser(name, help=f"{name} with SpecPrefill")
        p.add_argument(
            "--engine", choices=common.ENGINES, default="vllm", help="vllm: the product; hf: the transformers reference"
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
        common.knob_flags(p)
        # importance: --base only names the model whose tokens are scored (self:K, another tokenizer)
        required = ("speculator", "base") if name == "generate" else ("speculator",)
        common.engine_flags(p, required=required, kv_sequences=1)


def check_flags(args) -> None:
    """What the flags alone can get wrong, before anything heavy is imported."""
    common.config(args, args.speculator)  # the knobs
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


def read_prompt(path: str) -> str:
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


def in_process_vllm() -> None:
    """One prompt, then exit: vLLM's engine core and worker run in this process (no process pair per engine), which
    for the float32 Qwen 0.5B + 1.5B pair at 4k tokens takes peak RSS from 13.0 to 11.7 GiB. Set before vLLM reads
    its environment; a value of your own is kept."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # its second engine's warnings: `specprefill.quiet`


def prepare(args, text: str) -> dict:
    """The prompt's tokens and both engines' settings, every length checked before any weights are loaded."""
    from specprefill import models, tokenmap  # lazy: torch, transformers
    from specprefill.engines.common import (  # lazy: torch
        check_length,
        load_tokenizer,
        model_context,
        require_text,
        tokenize_prompt,
    )

    require_text(text)  # before any model is fetched
    speculator = models.resolve_speculator(args.speculator, args.base)  # --base resolves self:K
    base = models.resolve(args.base) if args.command == "generate" else None
    config = common.config(args, speculator)  # the look-ahead default decided on the resolved speculator
    tokenizer = load_tokenizer(base or speculator)  # prompts are in base tokens (a cross-tokenizer speculator maps)
    ids = tokenize_prompt(tokenizer, text, chat=args.chat)
    pair = tokenmap.Pair(load_tokenizer(speculator), tokenizer if base not in (None, speculator) else None)
    max_new = args.max_tokens if args.command == "generate" else 0
    counts = {
        speculator: (args.speculator, len(pair.speculator_ids(ids, pair.map(ids)))),
        **({base: (args.base, len(ids))} if base else {}),
    }
    for path, (name, n_tokens) in counts.items():
        check_length(n_tokens, max_new + config.look_ahead, model_context(path), name)
    # sized for this prompt: a model's full context would reserve far more memory than needed
    params = common.engine_params(args, kv_sequences=1, max_model_len=len(ids) + max_new + config.look_ahead)
    params = params.replace(speculator=speculator, base=base)
    if pair.cross:  # the speculator's own tokens of this text, plus its look-ahead
        params.speculator_engine_args.setdefault("max_model_len", counts[speculator][1] + config.look_ahead)
    return {"ids": ids, "tokenizer": tokenizer, "config": config, "params": params}


def open_engine(kind: str, params: EngineParams, config, dtype: str):
    from specprefill import hardware  # lazy: torch

    if kind == "vllm":
        try:
            from specprefill.engines.vllm.adapter import VLLMEngine  # lazy: vLLM, only for --engine vllm
        except ModuleNotFoundError as exc:
            raise SpecPrefillError(f"--engine vllm is not available ({exc}): use --engine hf") from None
        return VLLMEngine.from_params(params, config)
    from specprefill.engines.hf import HFEngine  # lazy: transformers

    return HFEngine(params.speculator, params.base, config, hardware.torch_dtype(dtype))


def run(args) -> dict:
    check_flags(args)
    text = read_prompt(args.prompt_file)
    if args.engine == "vllm":
        in_process_vllm()
    from specprefill import hardware  # lazy: torch
    from specprefill.engines.common import SamplingConfig  # lazy: torch

    job = prepare(args, text)
    ids, config, params = job["ids"], job["config"], job["params"]
    dtype = hardware.resolve_dtype(params.dtype)
    engine = open_engine(args.engine, params, config, dtype)
    if args.command == "importance":
        pruned = engine.speculate([ids], [config])[0]
        result = {
            "n_prompt_tokens": len(ids),
            "prompt_token_ids": ids,
            "importance": pruned.importance,
            "kept_indices": pruned.kept_indices,
            "config": config.to_dict(),
            "timings": {"speculation_s": engine.last_timings["speculation_s"]},
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
        result["html"] = str(write_heatmap(args.html, job["tokenizer"], result, args.speculator))
    return result


def write_heatmap(path: str, tokenizer, result: dict, speculator: str):
    from specprefill.viz.heatmap import page, render_html, token_strings  # lazy: only for --html

    n, kept = result["n_prompt_tokens"], result["kept_indices"]
    title = f"{speculator}: kept {len(kept)} of {n} tokens at keep rate {result['config']['keep_rate']}"
    strings = token_strings(tokenizer, result["prompt_token_ids"])
    return write_text(path, page(render_html(strings, result["importance"], kept, title=title)))


def human(result: dict) -> str:
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
