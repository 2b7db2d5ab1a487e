"""`specprefill serve`: vLLM's OpenAI-compatible server with SpecPrefill; every `vllm serve` flag is accepted."""

from __future__ import annotations

import argparse
from typing import NoReturn

from specprefill import flags
from specprefill.cli import common
from specprefill.config import EngineParams
from specprefill.errors import SpecPrefillError

SERVE_MIN_PROMPT_TOKENS = 1024  # a server runs short prompts whole unless told otherwise


class ServeHelp(argparse.Action):
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


def add(sub) -> None:
    p = sub.add_parser(
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
    p.add_argument(
        "-h", "--help", action=ServeHelp, nargs="?", help="this help, then vLLM's (--help=all, a group or a keyword)"
    )
    p.add_argument("--host", default=None, help="address to bind (default: 127.0.0.1, this machine only)")
    p.add_argument("--port", type=int, default=None, help="(default: 8000)")
    p.add_argument("--api-key", default=None, help="require this bearer token")
    p.add_argument("--served-model-name", default=None, help="model name clients send (default: MODEL as given)")
    common.knob_flags(p)
    # MODEL is vLLM's positional (or --base); vLLM's spellings of the base's fields (-tp, --max_num_seqs) work too
    common.engine_flags(
        p, required=("speculator",), min_prompt_tokens=SERVE_MIN_PROMPT_TOKENS, enable_prefix_caching="vLLM's"
    )


def params(args) -> tuple[EngineParams, argparse.Namespace, str]:
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
    p = EngineParams(**{"min_prompt_tokens": SERVE_MIN_PROMPT_TOKENS, "enable_prefix_caching": None, **ours})
    return p, vllm_args, args.served_model_name or ours["base"]


def run(args) -> None:
    """Runs until interrupted; stdout is the server's log (there is no result)."""
    import asyncio

    from specprefill.serve.server import serve  # lazy: vLLM

    p, vllm_args, served_name = params(args)
    try:
        asyncio.run(serve(p, common.config(args, args.speculator), vllm_args, served_name))
    except KeyboardInterrupt:
        pass
