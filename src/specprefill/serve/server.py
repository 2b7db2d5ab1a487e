"""`specprefill serve`: vLLM's OpenAI-compatible server (its app, protocol models, chat templates, streaming,
`/metrics`, `/health`, API key) with `async_engine.SpecPrefillEngineClient` in place of the base engine.

What SpecPrefill adds to vLLM's serving: the per-request keep rate (`vllm_xargs: {"specprefill_keep_rate": r}`),
checked before vLLM sees the request; a top-level `specprefill` field on every response (streaming: on each
choice's final chunk and on the usage chunk); SpecPrefill counters in `/metrics`.
"""

from __future__ import annotations

import json
from http import HTTPStatus

from specprefill.config import EngineParams, SpecPrefillConfig
from specprefill.engines.vllm import builder
from specprefill.engines.vllm.async_engine import REQUEST_STATS, SpecPrefillEngineClient, keep_rate_of, summarize
from specprefill.errors import SpecPrefillError
from specprefill.serve.metrics import ServerMetrics

DEFAULT_HOST = "127.0.0.1"
HANDLERS = (("openai_serving_completion", "create_completion"), ("openai_serving_chat", "create_chat_completion"))


def vllm_server_args(base_path: str, served_name: str, host: str, port: int, api_key: str | None, extra: list[str]):
    """vLLM's own server arguments (its parser and checks); `extra` = any other `vllm serve` flag."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    argv = [
        "--model",
        base_path,
        "--served-model-name",
        served_name,
        "--host",
        host,
        "--port",
        str(port),
        *(["--api-key", api_key] if api_key else []),
        *extra,
    ]
    args = make_arg_parser(FlexibleArgumentParser(prog="specprefill serve")).parse_args(argv)
    validate_parsed_serve_args(args)
    return args


def check_request(handler, request) -> str | None:
    """What SpecPrefill checks before vLLM's serving code sees a request: the model name, the keep rate and that no
    reserved key is sent. A message for a 400, or None."""
    if request.model and not handler._is_model_supported(request.model):
        names = ", ".join(m.name for m in handler.models.base_model_paths)
        return f"unknown model {request.model!r}: this server serves {names}"
    if getattr(request, "use_beam_search", False):
        return (
            "beam search is not supported by specprefill serve (each beam step would be pruned anew): send "
            "use_beam_search false"
        )
    try:
        keep_rate_of(request.vllm_xargs, 1.0)
    except ValueError as exc:
        return str(exc)
    return None


def with_stats_in_stream(chunks, stats: list):
    """SSE chunks as vLLM yields them; `specprefill` added to each final chunk of a choice and to the usage chunk."""

    async def stream():
        async for chunk in chunks:
            if chunk.startswith("data: {") and '"finish_reason":null' not in chunk:
                body = json.loads(chunk[len("data: ") :])
                choices = body.get("choices")
                if choices is not None and (body.get("usage") or any(c.get("finish_reason") for c in choices)):
                    body["specprefill"] = summarize(stats)
                    chunk = f"data: {json.dumps(body, separators=(',', ':'))}\n\n"
            yield chunk

    return stream()


def add_specprefill(handler, method: str) -> None:
    """Wrap one of vLLM's serving methods: check the request, collect its SpecPrefill stats, add them to the reply."""
    from vllm.entrypoints.serve.engine.protocol import ErrorResponse

    inner = getattr(handler, method)

    async def wrapped(request, raw_request=None):
        problem = check_request(handler, request)
        if problem is not None:
            return handler.create_error_response(problem, status_code=HTTPStatus.BAD_REQUEST)
        stats: list = []
        REQUEST_STATS.set(stats)  # read by the engine client when the serving code calls generate
        result = await inner(request, raw_request)
        if isinstance(result, ErrorResponse):
            return result
        if hasattr(result, "model_dump"):
            result.specprefill = summarize(stats)
            return result
        return with_stats_in_stream(result, stats)

    setattr(handler, method, wrapped)


async def serve(
    params: EngineParams,
    config: SpecPrefillConfig,
    host: str = DEFAULT_HOST,
    port: int = 8000,
    api_key: str | None = None,
    served_model_name: str | None = None,
    vllm_flags: list[str] | None = None,
) -> None:
    """Start both engines and serve until interrupted."""
    import vllm.envs as envs
    from vllm.entrypoints.launchers.api_server.app_state import init_app_state
    from vllm.entrypoints.launchers.app import build_app
    from vllm.entrypoints.launchers.launcher import serve_http, setup_server

    builder.validate(params)
    if params.base is None:
        raise SpecPrefillError("no base model given: pass base= (registry name, directory or hub id)")
    plan = builder.plan(params)
    assert plan.base is not None  # resolved from params.base
    args = vllm_server_args(plan.base, served_model_name or params.base, host, port, api_key, vllm_flags or [])
    listen_address, sock = setup_server(args, reuse_port=False)  # the port is ours before the engines load
    try:
        base, speculator = await builder.start_async_pair(plan, args)
    except BaseException:
        sock.close()
        raise
    client = SpecPrefillEngineClient(base, speculator, config, params.min_prompt_tokens, ServerMetrics.get())
    try:
        tasks = await base.get_supported_tasks()
        app = build_app(args, tasks, base.model_config)
        await init_app_state(client, app.state, args, tasks)
        for state_name, method in HANDLERS:
            if getattr(app.state, state_name, None) is not None:
                add_specprefill(getattr(app.state, state_name), method)
        print(
            f"specprefill serve: {params.base} (speculator {params.speculator}, keep rate {config.keep_rate}, "
            f"dtype {plan.base_kwargs['dtype']}) on {listen_address}",
            flush=True,
        )
        shutdown = await serve_http(
            app,
            sock=sock,
            host=args.host,
            port=args.port,
            log_level=args.uvicorn_log_level,
            access_log=not args.disable_uvicorn_access_log,
            timeout_keep_alive=envs.VLLM_HTTP_TIMEOUT_KEEP_ALIVE,
            ssl_keyfile=args.ssl_keyfile,
            ssl_certfile=args.ssl_certfile,
            ssl_ca_certs=args.ssl_ca_certs,
            ssl_cert_reqs=args.ssl_cert_reqs,
        )
        await shutdown
    finally:
        sock.close()
        client.shutdown()
