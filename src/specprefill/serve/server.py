"""`specprefill serve`: vLLM's OpenAI-compatible server (its app, protocol models, chat templates, streaming,
`/metrics`, `/health`, API key) with `async_engine.SpecPrefillEngineClient` in place of the base engine.

What SpecPrefill adds to vLLM's serving: the per-request keep rate (`vllm_xargs: {"specprefill_keep_rate": r}`),
checked before vLLM sees the request; a top-level `specprefill` field on every response (streaming: on each
choice's final chunk and on the usage chunk); SpecPrefill counters in `/metrics`; `GET /v1/specprefill/engines`, the
settings each running engine's workers report.

Endpoints (`PRUNED`): `/v1/completions`, `/v1/chat/completions` and `/v1/chat/completions/batch` speculate and prune.
Every other endpoint vLLM serves (`/v1/responses`, `/v1/messages`, tokenize, pooling, ...) runs the whole prompt on the
base: the engine client prunes only requests that came through a wrapped handler (`REQUEST_STATS` set).

Flags: every `vllm serve` flag is accepted; the flags a user gives win over the project's defaults (dtype from the
CPU, eager on CPU, memory sized for two engines), which apply only to what was left unset (`vllm_server_args`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from http import HTTPStatus

from specprefill import tokenmap
from specprefill.config import EngineParams, SpecPrefillConfig
from specprefill.engines.vllm import builder, checks, planning
from specprefill.engines.vllm.async_engine import (
    CHAT,
    REQUEST_STATS,
    SpecPrefillEngineClient,
    keep_rate_of,
    summarize,
)
from specprefill.errors import SpecPrefillError
from specprefill.serve.metrics import ServerMetrics

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
# (app.state attribute, method): the endpoints that speculate; every other one runs the whole prompt
PRUNED = (
    ("openai_serving_completion", "create_completion"),
    ("openai_serving_chat", "create_chat_completion"),
    ("openai_serving_chat_batch", "create_batch_chat_completion"),
)
# `vllm serve` flags a SpecPrefill server cannot honour: dest -> (refused value?, why); the engine arguments a pair
# cannot run with (speculative decoding or prefill context parallel on the base) are refused by `checks.base_refusal`
REFUSED_FLAGS = {
    "headless": (bool, "a headless engine has no API server to speculate in"),
    "grpc": (bool, "the gRPC server bypasses the OpenAI handlers SpecPrefill wraps"),
    "api_server_count": (lambda n: n is not None and n != 1, "the speculator runs inside the one API server process"),
}


def vllm_parser(prog: str = "specprefill serve"):
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    return make_arg_parser(FlexibleArgumentParser(prog=prog))


def given_flags(argv: list[str]) -> dict:
    """The `vllm serve` settings `argv` sets (whatever the spelling: -tp, --max_num_seqs, --x=y, --config FILE), by
    vLLM's destination names; what is left to its defaults is absent."""
    parser = vllm_parser()
    parser._defaults.clear()
    for action in parser._actions:
        action.default = argparse.SUPPRESS  # an unset flag then leaves no attribute (argparse does not convert it)
    return vars(parser.parse_args(argv))


def vllm_server_args(argv: list[str], host: str | None, port: int | None, api_key: str | None):
    """(vLLM's parsed server arguments, the settings the user gave, the model as given). `argv`: every `vllm serve`
    flag and the positional MODEL; vLLM's own parser and checks. Host, port and API key are this command's."""
    from vllm.entrypoints.launchers.cli_args import validate_parsed_serve_args

    given = given_flags(argv)
    for dest, (refused, why) in REFUSED_FLAGS.items():
        if dest in given and refused(given[dest]):
            raise SpecPrefillError(f"--{dest.replace('_', '-')} is not supported by specprefill serve ({why}): drop it")
    model = given.pop("model_tag", None) or given.pop("model", None)
    ours = [  # this command's flags when given; else what --config set; else the defaults
        *(["--host", host or DEFAULT_HOST] if host is not None or "host" not in given else []),
        *(["--port", str(port or DEFAULT_PORT)] if port is not None or "port" not in given else []),
        *(["--api-key", api_key] if api_key else []),
    ]
    args = vllm_parser().parse_args([*argv, *ours])
    try:
        validate_parsed_serve_args(args)
    except Exception as exc:  # vLLM's own check of its flags (VLLMValidationError, ValueError): names the flag
        raise SpecPrefillError(f"{str(exc).splitlines()[0]}: fix that vllm serve flag") from exc
    return args, given, model


def engine_settings(given: dict) -> dict:
    """The given `vllm serve` settings that are engine arguments, as `EngineParams` fields: a field by its name,
    any other engine argument into `engine_args` (the model, its served names and LoRA modules stay vLLM's)."""
    from vllm.engine.arg_utils import EngineArgs

    # EngineArgs' fields: AsyncEngineArgs' own (e.g. enable_log_requests) reach the base from vLLM's parse
    engine = {f.name for f in dataclasses.fields(EngineArgs)} - {"model", "served_model_name"}
    fields = {f.name: f.metadata["role"] for f in dataclasses.fields(EngineParams)}
    out: dict = {"engine_args": {}}
    for name, value in given.items():
        if name in fields and fields[name] in ("base", "both"):
            out[name] = value
        elif name in engine:
            out["engine_args"][name] = value
    return out


def chat_template_args(handler, request) -> dict:
    """The template arguments the base renders this chat request with (vLLM's own merge of the server's defaults,
    the request's kwargs, generation prompt, documents), plus its tools: the speculator renders with the same."""
    kwargs = dict(handler._effective_chat_template_kwargs(request))
    if request.tools:
        kwargs["tools"] = [tool.model_dump(exclude_none=True) for tool in request.tools]
    return kwargs


async def check_request(handler, request) -> str | None:
    """What SpecPrefill checks before vLLM's serving code sees a request: the model name (vLLM's own check, so LoRA
    adapters pass), the keep rate and that no reserved key is sent. A message for a 400, or None."""
    problem = await handler._check_model(request)
    if problem is not None:
        names = ", ".join(m.name for m in handler.models.base_model_paths)
        return f"unknown model {request.model!r}: this server serves {names} (and its LoRA adapters)"
    if getattr(request, "use_beam_search", False):
        return (
            "beam search is not supported by specprefill serve (each beam step would be pruned anew): send "
            "use_beam_search false"
        )
    try:
        keep_rate_of(getattr(request, "vllm_xargs", None), 1.0)
    except ValueError as exc:
        return str(exc)
    return None


def may_speculate(request, default_keep_rate: float) -> bool:
    """Whether a (checked) request may reach the speculator: a keep rate under 1 and no log-prob of every prompt
    token asked (those run whole). A follow-up that will run on what the base holds cannot be told apart yet."""
    if keep_rate_of(getattr(request, "vllm_xargs", None), default_keep_rate) >= 1:
        return False
    if getattr(request, "prompt_logprobs", None) is not None:
        return False
    return not (getattr(request, "echo", False) and getattr(request, "logprobs", None) is not None)


def with_stats_in_stream(chunks, stats: list, details: bool = False):
    """SSE chunks as vLLM yields them; `specprefill` added to each final chunk of a choice and to the usage chunk."""

    async def stream():
        async for chunk in chunks:
            if chunk.startswith("data: {") and '"finish_reason":null' not in chunk:
                body = json.loads(chunk[len("data: ") :])
                choices = body.get("choices")
                if choices is not None and (body.get("usage") or any(c.get("finish_reason") for c in choices)):
                    body["specprefill"] = summarize(stats, details)
                    chunk = f"data: {json.dumps(body, separators=(',', ':'))}\n\n"
            yield chunk

    return stream()


def add_specprefill(handler, method: str) -> None:
    """Wrap one of vLLM's serving methods: check the request, collect its SpecPrefill stats, add them to the reply."""
    from vllm.entrypoints.serve.engine.protocol import ErrorResponse

    inner = getattr(handler, method)
    cross = handler.engine_client.speculator.pair.cross  # a speculator with another tokenizer
    details = bool(getattr(handler, "enable_prompt_tokens_details", False))  # what the caches held: only then

    async def wrapped(request, raw_request=None):
        problem = await check_request(handler, request)
        if problem is None and method == "create_chat_completion" and cross:  # each model renders its own template
            try:
                CHAT.set((tokenmap.text_messages(list(request.messages)), chat_template_args(handler, request)))
            except SpecPrefillError as exc:  # content the speculator cannot render
                problem = str(exc)
        if problem is not None:
            return handler.create_error_response(problem, status_code=HTTPStatus.BAD_REQUEST)
        try:  # the speculation queue full: a request that may speculate is refused before anything runs
            if may_speculate(request, handler.engine_client.config.keep_rate):
                handler.engine_client.speculator.budget.admit()
        except Exception as exc:  # noqa: BLE001 - vLLM's GracefulHTTPError: its status (503) and message
            return handler.create_error_response(exc)
        stats: list = []
        REQUEST_STATS.set(stats)  # read by the engine client when the serving code calls generate
        result = await inner(request, raw_request)
        if isinstance(result, ErrorResponse):
            return result
        if hasattr(result, "model_dump"):
            result.specprefill = summarize(stats, details)
            return result
        return with_stats_in_stream(result, stats, details)

    setattr(handler, method, wrapped)


async def engines_report(base, speculator) -> dict:
    """What each running engine's workers report (`workers.worker_settings`), one entry per rank."""
    return {
        "base": await base.collective_rpc("specprefill_settings"),
        "speculator": await speculator.llm.collective_rpc("specprefill_settings"),
    }


async def _app(client: SpecPrefillEngineClient, args: argparse.Namespace):
    """vLLM's OpenAI app on the SpecPrefill engine client: its endpoints that generate from a prompt prune it
    (`PRUNED`), and `/v1/specprefill/engines` reports what each engine's workers run with."""
    from vllm.entrypoints.launchers.api_server.app_state import init_app_state
    from vllm.entrypoints.launchers.app import build_app

    base, speculator = client.base, client.speculator
    tasks = await base.get_supported_tasks()
    app = build_app(args, tasks, base.model_config)
    await init_app_state(client, app.state, args, tasks)
    for state_name, method in PRUNED:
        if getattr(app.state, state_name, None) is not None:
            add_specprefill(getattr(app.state, state_name), method)

    # vLLM's app has built its middleware stack by now (adding to it is refused): the header wraps the stack
    app.middleware_stack = RetryAfter(app.middleware_stack or app.build_middleware_stack(), client.retry_after_s)
    report = await engines_report(base, speculator)  # read once: the workers' settings stay
    # process ids are the operator's (the server's log), not every API client's
    pids = {engine: [worker.pop("pid", None) for worker in workers] for engine, workers in report.items()}
    print(f"specprefill serve: engine processes: base {pids['base']}, speculator {pids['speculator']}", flush=True)
    add_routes(app, report, client)
    return app


class RetryAfter:
    """ASGI middleware: a `Retry-After` header (whole seconds, `seconds()`) on every 503 the server sends (the
    speculation queue full, vLLM's own admission control), so clients and load balancers know when to come back."""

    def __init__(self, app, seconds) -> None:
        self.app, self.seconds = app, seconds

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_retry(message) -> None:
            if message["type"] == "http.response.start" and message["status"] == HTTPStatus.SERVICE_UNAVAILABLE:
                headers = [*message.get("headers", []), (b"retry-after", str(int(self.seconds())).encode())]
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_retry)


SALT_HEADER = "X-SpecPrefill-Cache-Salt"  # the tenant's cache salt for `/v1/specprefill/background`: never in a URL


def add_routes(app, report: dict, client) -> None:
    """`GET /v1/specprefill/engines`: what each engine's workers ran with at start (no engine call per request; no
    process ids: the server's log names them);
    `GET /v1/specprefill/background` with the `SALT_HEADER` header: the warm-ups running or waiting of the requests
    sent with that `cache_salt` (no header: those sent without one), never another tenant's
    (`SpecPrefillEngineClient.background_of`); all of them are in `/metrics`' counters and the server's log. Both
    sit under /v1, behind the server's API key. A salt in the query string is refused: access logs write URLs."""
    from fastapi.responses import JSONResponse

    async def engines() -> dict:
        return report

    async def background(request) -> JSONResponse:  # a plain route: the request as it came
        if "cache_salt" in request.query_params:
            return JSONResponse(
                {"error": f"send the cache salt in the {SALT_HEADER} header, not the URL (access logs write URLs)"},
                status_code=HTTPStatus.BAD_REQUEST,
            )
        return JSONResponse({"warming": client.background_of(request.headers.get(SALT_HEADER))})

    app.add_api_route("/v1/specprefill/engines", engines, methods=["GET"])
    app.add_route("/v1/specprefill/background", background, methods=["GET"])


def client_args(params: EngineParams) -> dict:
    """What the server's engine client takes from the pair's parameters (`SpecPrefillEngineClient`)."""
    return {
        "min_prompt_tokens": params.min_prompt_tokens,
        "only_marked": True,
        "min_new_tokens": params.min_new_tokens,
        "warm": params.background_prefill == "idle",
        "background_tokens_per_tenant": params.background_tokens_per_tenant,
    }


async def serve(
    params: EngineParams,
    config: SpecPrefillConfig,
    vllm_args: argparse.Namespace,
    served_model_name: str,
) -> None:
    """Start both engines and serve until interrupted. `vllm_args`: `vllm_server_args`'s parse (its engine
    arguments are the base's where `params` leaves them unset)."""
    import vllm.envs as envs
    from vllm.entrypoints.launchers.launcher import serve_http, setup_server

    checks.validate(params)
    if params.base is None:
        raise SpecPrefillError("no model given: specprefill serve MODEL --speculator S")
    plan = planning.plan(params)
    assert plan.base is not None  # resolved from params.base
    args = argparse.Namespace(**vars(vllm_args))
    args.model, args.model_tag = plan.base, None
    args.served_model_name = args.served_model_name or [served_model_name]
    checks.check_kv_transfer(getattr(args, "kv_transfer_config", None))
    listen_address, sock = setup_server(args, reuse_port=False)  # the port is ours before the engines load
    try:
        base, speculator = await builder.start_async_pair(plan, args)
    except BaseException:
        sock.close()
        raise
    speculator.limit(params.speculation_queue, params.speculation_timeout_s)
    client = SpecPrefillEngineClient(base, speculator, config, metrics=ServerMetrics.get(), **client_args(params))
    try:
        app = await _app(client, args)
        print(
            f"specprefill serve: {served_model_name} (speculator {params.speculator}, keep rate {config.keep_rate}, "
            f"selection {config.rule}, dtype {base.model_config.dtype}) on {listen_address}",
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
