"""Chat benchmark (`specprefill bench chat`, notebook 05's chat section), against servers built from the same base
arguments, all running side by side: plain vLLM with prefix caching, SpecPrefill as served (prefix caching: earlier
requests of a tenant reused as `core.turns` allows, pruned ones prefilled whole in idle time) and SpecPrefill fresh
(no prefix caching: every request speculated and prefilled anew). Request by request the servers take turns (the
order rotates), so each is compared under the same conditions, and before each timed request every server's
background work is done (the wait beyond the think time is reported). Two workloads:
  - conversations (multi-turn): a long document, then questions about facts at several depths — later turns ask
    about other parts of the document — and one about an earlier answer;
  - shared (`chat_shared`, SCBench's multi-request mode): each document asked by several users, one question each
    about another fact; once as one tenant (no `cache_salt`) and once with a tenant per user (a `cache_salt` each:
    nothing may be shared, which is counted).

Per request: time to the first token (streamed), the tokens each engine computed (the base: what its prefix cache
did not hold of what it received; the speculator: of its prompt), the base's cache hit rate and whether the answer
holds the expected code word. Per server: the CPU-seconds its processes used over the whole run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Iterable

import pandas as pd

from specprefill.config import EngineParams, SpecPrefillConfig
from specprefill.data import synthetic
from specprefill.errors import SpecPrefillError
from specprefill.settings import ChatSettings
from specprefill.workbench import store
from specprefill.workbench.chat_tables import MODES, accuracy, checks, turn_table

EXTRA_FLAGS = ["--enable-prompt-tokens-details"]  # usage.prompt_tokens_details.cached_tokens from plain vLLM
# before each request: the servers idle this long, so what one server still does after its reply (freeing memory, its
# API process's bookkeeping) is not timed against the next one (measured: a short turn right after another server's
# long one took ~0.1-0.2 s more); a chat's user takes longer than this to read and answer
SETTLE_S = 1.0


def conversations(tokenizer, settings: ChatSettings, seed_offset: int = 0) -> list[synthetic.Conversation]:
    """The seeded conversations, each document about `doc_tokens` tokens of `tokenizer`."""
    sample = synthetic.filler_text(4000, 0)
    chars_per_token = len(sample) / len(tokenizer(sample)["input_ids"])
    n_chars = int(settings.chat_doc_tokens * chars_per_token)
    return [
        synthetic.conversation(
            n_chars, settings.chat_turns, settings.chat_seed + seed_offset + c, recall_first=not settings.chat_shared
        )
        for c in range(settings.chat_conversations)
    ]


def max_model_len(settings: ChatSettings) -> int:
    """Context for a whole conversation: the document, every question and answer, the chat template's tokens."""
    return settings.chat_doc_tokens + settings.chat_turns * (settings.chat_answer_tokens + 64) + 256


KV_SEQUENCES = 2  # each server's KV cache: one request at a time, and a warm-up it cancels


def server_params(kind: str, params: EngineParams, block_size: int | None = None) -> EngineParams:
    """One server's engine parameters: the same base arguments for every kind, prefix caching but for the
    SpecPrefill-fresh server, the chat's block size for the base, KV for `KV_SEQUENCES` (requests come one at a
    time) unless the caller sized it."""
    engine_args = {**params.engine_args, **({"block_size": block_size} if block_size else {})}
    sequences = params.kv_sequences if params.kv_sequences != EngineParams.kv_sequences else KV_SEQUENCES
    return params.replace(
        enable_prefix_caching=kind != "specprefill-no-reuse", engine_args=engine_args, kv_sequences=sequences
    )


def check_side_by_side(kinds: list[str], params: EngineParams, block_size: int | None) -> None:
    """The servers kept up side by side fit together in the memory free now (each is otherwise sized on its own at
    its start, and a later one can push an earlier one's engine into the OOM killer): a one-line error naming the
    fix before any starts."""
    from specprefill.engines.vllm import planning, sizing  # lazy: vLLM's config

    items: list[tuple[str, dict]] = []
    processes = 0
    for kind in kinds:
        plan = planning.plan(server_params(kind, params, block_size))
        assert plan.base is not None
        items.append((plan.base, plan.base_kwargs))
        processes += 2  # the API server and the base's engine core
        if kind != "vllm":
            items.append((plan.speculator, plan.speculator_kwargs))
            processes += 1
    sizing.check_cpu_memory(
        items,
        processes,
        f"the {len(kinds)} chat servers side by side ({', '.join(kinds)}; drop some with chat_servers)",
    )


def ask(client, model: str, messages: list[dict], max_tokens: int, salt: str | None = None) -> dict:
    """One streamed, greedy chat completion (`salt`: its `cache_salt`, a tenant): TTFT (to the first chunk carrying
    text or a finish), the answer, the usage and SpecPrefill's per-request fields (None from plain vLLM)."""
    t0 = time.perf_counter()
    first = None
    text, usage, info = [], None, None
    stream = client.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=max_tokens,
        temperature=0.0,
        stream=True,
        stream_options={"include_usage": True},
        **({"extra_body": {"cache_salt": salt}} if salt is not None else {}),
    )
    for chunk in stream:
        for choice in chunk.choices:
            if first is None and (choice.delta.content or choice.finish_reason):
                first = time.perf_counter()
            text.append(choice.delta.content or "")
        info = (chunk.model_extra or {}).get("specprefill") or info
        usage = chunk.usage or usage
    assert usage is not None, "the server sent no usage (stream_options include_usage)"
    details = getattr(usage, "prompt_tokens_details", None)
    return {
        "ttft_s": (first or time.perf_counter()) - t0,
        "answer": "".join(text),
        "prompt_tokens": usage.prompt_tokens,
        "cached_tokens": getattr(details, "cached_tokens", None) or 0,
        "specprefill": info,
    }


def background(url: str, api_key: str | None = None) -> int:
    """Warm-ups a SpecPrefill server still runs or holds (0 from a server without them, e.g. plain vLLM)."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    with contextlib.suppress(httpx.HTTPError, ValueError, KeyError):
        r = httpx.get(f"{url}/v1/specprefill/background", headers=headers, timeout=10)
        if r.status_code == 200:
            return int(r.json()["warming"])
    return 0


def before_request(urls: Iterable[str], think_s: float, timeout_s: float = 600, api_key: str | None = None) -> float:
    """The user's think time, then until no server has background work left, then `SETTLE_S`: seconds waited
    beyond the think time for background work."""
    time.sleep(think_s)
    t0 = time.perf_counter()
    deadline = t0 + timeout_s
    while any(background(url, api_key) for url in urls):
        if time.perf_counter() > deadline:
            raise SpecPrefillError(f"servers still busy after {timeout_s:.0f} s of background work: see their logs")
        time.sleep(0.1)
    waited = time.perf_counter() - t0
    time.sleep(SETTLE_S)
    return waited


def turn_row(kind: str, conv: int, turn: int, reply: dict, expected: str) -> dict:
    info = reply["specprefill"]
    if info is None:  # plain vLLM: the base received the whole prompt
        received, base_prefilled, spec_prefilled, reuse = reply["prompt_tokens"], None, 0, None
        base_prefilled = received - reply["cached_tokens"]
    else:
        received, base_prefilled = info["n_kept_tokens"], info["base_prefilled_tokens"]
        spec_prefilled, reuse = info["speculator_prefilled_tokens"], info["reuse"]
    return {
        "server": kind,
        "conversation": conv,
        "turn": turn,
        "ttft_s": reply["ttft_s"],
        "prompt_tokens": reply["prompt_tokens"],
        "base_received_tokens": received,
        "base_prefilled_tokens": base_prefilled,
        "speculator_prefilled_tokens": spec_prefilled,
        "speculation_ms": info["speculation_ms"] if info is not None else 0.0,
        "base_hit_rate": 1 - base_prefilled / received if received else 0.0,
        "reuse": reuse or "",
        "expected": expected,
        "answer": reply["answer"],
        "correct": expected.lower() in reply["answer"].lower(),
    }


def replay(
    clients: dict,
    model: str,
    index: int,
    conv: synthetic.Conversation,
    max_tokens: int,
    on_turn=None,
    mode: str = "conversation",
    think_s: float = 0.0,
    urls: Iterable[str] = (),
):
    """One document on every server, request by request, each server in its turn (the order rotates with the
    request and the document, so no server always follows the same one). `mode` "conversation": one user's turns,
    each server's history holding the answers it gave; "shared": each question from another user (the document and
    that question alone), one tenant; "shared-tenants": the same with a `cache_salt` per user. Before each request,
    `before_request` on `urls`. Rows as `turn_row`, with the mode and the background wait."""
    if mode not in MODES:
        raise SpecPrefillError(f"chat mode {mode!r}: use one of {', '.join(MODES)}")
    kinds = list(clients)
    history: dict[str, list[dict]] = {kind: [] for kind in kinds}
    rows = []
    for t, expected in enumerate(conv.answers):
        shift = (index + t) % len(kinds)
        for kind in kinds[shift:] + kinds[:shift]:
            if mode == "conversation":
                messages = history[kind]
                messages.append({"role": "user", "content": conv.message(t)})
            else:
                messages = [{"role": "user", "content": f"{conv.document}\n\n{conv.questions[t]}"}]
            salt = f"user-{index}-{t}" if mode == "shared-tenants" else None
            waited = before_request(urls, think_s, api_key=getattr(clients[kind], "api_key", None))
            reply = ask(clients[kind], model, messages, max_tokens, salt)
            if mode == "conversation":
                messages.append({"role": "assistant", "content": reply["answer"]})
            rows.append({**turn_row(kind, index, t + 1, reply, expected), "mode": mode, "background_wait_s": waited})
            if on_turn is not None:
                on_turn(rows[-1])
    return rows


def openai_client(url: str):
    import openai

    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", timeout=3600, max_retries=0)


def run(
    params: EngineParams, config: SpecPrefillConfig, settings: ChatSettings, log_dir: str, on_turn=None
) -> tuple[list[dict], dict[str, float | None]]:
    """Every document on every server (all started first, one at a time, then left running side by side), after
    one unrecorded warm-up conversation: rows as `turn_row` (with `mode`), and per server the CPU-seconds its
    processes used from the first recorded request to the last (None where unknown)."""
    from specprefill.engines.common import load_tokenizer  # lazy: transformers
    from specprefill.models import resolve  # lazy: transformers
    from specprefill.serve import loadtest  # lazy: vLLM

    if params.base is None:
        raise SpecPrefillError("the chat benchmark serves a base model: give base=")
    model = params.base
    kinds = settings.server_kinds()
    tokenizer = load_tokenizer(resolve(model))
    convs = conversations(tokenizer, settings)
    warm = conversations(
        tokenizer, ChatSettings(chat_conversations=1, chat_turns=2, chat_doc_tokens=512), seed_offset=10_000
    )[0]
    modes = ["shared", "shared-tenants"] if settings.chat_shared else ["conversation"]
    check_side_by_side(kinds, params, settings.chat_block_size)
    rows: list[dict] = []
    with contextlib.ExitStack() as stack:
        clients, urls = {}, {}
        for kind in kinds:
            server = "vllm" if kind == "vllm" else "specprefill"
            urls[kind] = stack.enter_context(
                loadtest.running(
                    server,
                    server_params(kind, params, settings.chat_block_size),
                    config,
                    log_dir,
                    EXTRA_FLAGS,
                    name=kind,
                    side_by_side=True,
                )
            )
            clients[kind] = openai_client(urls[kind])
        replay(clients, model, -1, warm, settings.chat_answer_tokens, urls=urls.values())
        before = {kind: loadtest.cpu_seconds(url) for kind, url in urls.items()}
        for mode in modes:
            for c, conv in enumerate(convs):
                rows += replay(
                    clients, model, c, conv, settings.chat_answer_tokens, on_turn, mode, settings.chat_think_s,
                    urls.values(),
                )  # fmt: skip
        after = {kind: loadtest.cpu_seconds(url) for kind, url in urls.items()}
    cpu = {k: None if before[k] is None or after[k] is None else after[k] - before[k] for k in kinds}  # type: ignore[operator]
    return rows, cpu


def section(engine: EngineParams, config: SpecPrefillConfig, settings: ChatSettings, output_dir) -> pd.DataFrame | None:
    """Notebook 05's chat section: `run` with a context that holds a whole conversation, the rows, the per-turn
    table, the answers' accuracy and the servers' CPU-seconds saved beside the notebook's other tables (`chat_rows`,
    `chat_turns`, `chat_accuracy`, `chat_cpu`), the checks printed. None when the settings ask for no document."""
    if settings.chat_conversations == 0:
        return None
    engine = engine.replace(max_model_len=max(engine.max_model_len or 0, max_model_len(settings)))
    rows, cpu = run(engine, config, settings, f"{output_dir}/chat_logs")
    from specprefill import hardware  # lazy: torch

    meta = {
        "engine": hardware.engine_record(engine),
        "specprefill": config.to_dict(),
        "chat": dataclasses.asdict(settings),
    }
    store.save_table(rows, output_dir, "chat_rows", meta)
    table = store.save_table(turn_table(rows).to_dict("records"), output_dir, "chat_turns", meta)
    acc = accuracy(rows)
    store.save_table(acc.to_dict("records"), output_dir, "chat_accuracy", meta)
    store.save_table([{"server": k, "cpu_s": v} for k, v in cpu.items()], output_dir, "chat_cpu", meta)
    for line in checks(table, acc, rows):
        print(line)
    return table
