"""Chat benchmark (`specprefill bench chat`, notebook 05's chat section): servers built from the same base arguments,
each measured alone on the machine (started, run, stopped one after another: two servers on one machine would time
each other's background work): plain vLLM with prefix caching, SpecPrefill as served (prefix caching: earlier
requests of a tenant reused as `core.turns` allows, pruned ones prefilled whole in idle time unless
`--background-prefill off`) and SpecPrefill fresh (no prefix caching: every request speculated and prefilled anew).
A turn is sent its think time after the previous answer ended, whatever the server still does in the background:
nothing waits for it. Workloads (`ChatSettings.chat_modes`), each at every think time:
  - conversation: a long document, then questions about facts at several depths (later turns ask about other parts
    of the document) and one about an earlier answer;
  - agent: each later turn appends new material (a tool's output) and asks about a fact in it;
  - shared / shared-tenants (SCBench's multi-request mode): each document asked by several users, one question each
    about another fact; once as one tenant (no `cache_salt`) and once with a tenant per user (a `cache_salt` each:
    nothing may be shared, which is counted).

Per request: time to the first token (streamed), the tokens each engine computed (the base: what its prefix cache
did not hold of what it received; the speculator: of its prompt), the base's cache hit rate and whether the answer
holds the expected code word. Per conversation: the CPU-seconds the server's processes used from its first request
until the server is quiet after its last (background work included; the quiet wait is not timed against anything).
"""

from __future__ import annotations

import dataclasses
import time

import pandas as pd

from specprefill.config import EngineParams, SpecPrefillConfig
from specprefill.data import synthetic
from specprefill.errors import SpecPrefillError
from specprefill.settings import ChatSettings
from specprefill.workbench import store
from specprefill.workbench.chat_tables import MODES, accuracy, checks, turn_table

EXTRA_FLAGS = ["--enable-prompt-tokens-details"]  # usage.prompt_tokens_details.cached_tokens from plain vLLM


def conversations(tokenizer, settings: ChatSettings, mode: str, seed_offset: int = 0) -> list[synthetic.Conversation]:
    """The seeded conversations of `mode`, each document about `chat_doc_tokens` tokens of `tokenizer` (an agent's
    new material `chat_agent_tokens` a turn)."""
    sample = synthetic.filler_text(4000, 0)
    chars_per_token = len(sample) / len(tokenizer(sample)["input_ids"])
    n_chars = int(settings.chat_doc_tokens * chars_per_token)
    seeds = [settings.chat_seed + seed_offset + c for c in range(settings.chat_conversations)]
    if mode == "agent":
        new_chars = int(settings.chat_agent_tokens * chars_per_token)
        return [synthetic.agent_conversation(n_chars, new_chars, settings.chat_turns, s) for s in seeds]
    return [synthetic.conversation(n_chars, settings.chat_turns, s, recall_first=mode == "conversation") for s in seeds]


def max_model_len(settings: ChatSettings) -> int:
    """Context for a whole conversation: the document, every question and answer, the chat template's tokens."""
    agent = (settings.chat_turns - 1) * settings.chat_agent_tokens if "agent" in settings.modes() else 0
    return settings.chat_doc_tokens + agent + settings.chat_turns * (settings.chat_answer_tokens + 64) + 256


KV_SEQUENCES = 2  # each server's KV cache: one request at a time, and the background work it arrives beside


def server_params(kind: str, params: EngineParams, block_size: int | None = None) -> EngineParams:
    """One server's engine parameters: the same base arguments for every kind, prefix caching but for the
    SpecPrefill-fresh server, the chat's block size for the base, KV for `KV_SEQUENCES` (requests come one at a
    time) unless the caller sized it."""
    engine_args = {**params.engine_args, **({"block_size": block_size} if block_size else {})}
    sequences = params.kv_sequences if params.kv_sequences != EngineParams.kv_sequences else KV_SEQUENCES
    return params.replace(
        enable_prefix_caching=kind != "specprefill-no-reuse", engine_args=engine_args, kv_sequences=sequences
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


def quiet(url: str, timeout_s: float = 900.0, window_s: float = 1.0, busy_cpu_s: float = 0.1) -> float:
    """Waits until the server `loadtest.running` started at `url` is quiet (its processes used under `busy_cpu_s`
    CPU-seconds in the last `window_s`: its background work done), so that work is counted with the conversation
    that caused it; seconds waited. Nothing timed waits for this."""
    from specprefill.serve import loadtest  # lazy: vLLM

    t0 = time.perf_counter()
    last = loadtest.cpu_seconds(url)
    while last is not None:
        time.sleep(window_s)
        now = loadtest.cpu_seconds(url)
        if now is None or now - last < busy_cpu_s:
            break
        if time.perf_counter() - t0 > timeout_s:
            raise SpecPrefillError(f"server at {url} still busy after {timeout_s:.0f} s: see its log")
        last = now
    return time.perf_counter() - t0


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
    client,
    kind: str,
    model: str,
    index: int,
    conv: synthetic.Conversation,
    max_tokens: int,
    on_turn=None,
    mode: str = "conversation",
    think_s: float = 0.0,
) -> list[dict]:
    """One document's requests on one server, each sent `think_s` after the previous answer ended (nothing waits for
    the server's background work). `mode` "conversation" and "agent": one user's turns, the history holding the
    answers the server gave; "shared": each question from another user (the document and that question alone), one
    tenant; "shared-tenants": the same with a `cache_salt` per user. Rows as `turn_row`, with mode and think time."""
    if mode not in MODES:
        raise SpecPrefillError(f"chat mode {mode!r}: use one of {', '.join(MODES)}")
    history: list[dict] = []
    rows = []
    for t, expected in enumerate(conv.answers):
        if t:
            time.sleep(think_s)
        if mode in ("conversation", "agent"):
            messages = history
            messages.append({"role": "user", "content": conv.message(t)})
        else:
            messages = [{"role": "user", "content": f"{conv.document}\n\n{conv.questions[t]}"}]
        salt = f"user-{index}-{t}" if mode == "shared-tenants" else None
        reply = ask(client, model, messages, max_tokens, salt)
        if mode in ("conversation", "agent"):
            messages.append({"role": "assistant", "content": reply["answer"]})
        rows.append({**turn_row(kind, index, t + 1, reply, expected), "mode": mode, "think_s": think_s})
        if on_turn is not None:
            on_turn(rows[-1])
    return rows


def openai_client(url: str):
    import openai

    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", timeout=3600, max_retries=0)


def run(
    params: EngineParams, config: SpecPrefillConfig, settings: ChatSettings, log_dir: str, on_turn=None
) -> tuple[list[dict], list[dict]]:
    """Every workload at every think time on each server alone (started, after one unrecorded warm-up conversation
    run, then stopped before the next starts): rows as `turn_row` (with `mode`, `think_s`), and per server, mode,
    think time and conversation the CPU-seconds its processes used (`cpu_s`, None where unknown)."""
    from specprefill.engines.common import load_tokenizer  # lazy: transformers
    from specprefill.models import resolve  # lazy: transformers
    from specprefill.serve import loadtest  # lazy: vLLM

    if params.base is None:
        raise SpecPrefillError("the chat benchmark serves a base model: give base=")
    model = params.base
    tokenizer = load_tokenizer(resolve(model))
    # every think time its own documents (the same on every server), and the shared modes others than a
    # conversation's (an agent's differ by construction): a document asked again would be read from the prefix caches
    # an earlier workload left
    work = {
        (mode, think_s): conversations(
            tokenizer, settings, mode, seed_offset=1000 * k + 100_000 * mode.startswith("shared")
        )
        for mode in settings.modes()
        for k, think_s in enumerate(settings.think_times())
    }
    warm = conversations(
        tokenizer, ChatSettings(chat_conversations=1, chat_turns=2, chat_doc_tokens=512), "conversation", 10_000
    )[0]
    rows: list[dict] = []
    cpu: list[dict] = []
    for kind in settings.server_kinds():
        server = "vllm" if kind == "vllm" else "specprefill"
        with loadtest.running(
            server, server_params(kind, params, settings.chat_block_size), config, log_dir, EXTRA_FLAGS, name=kind
        ) as url:
            client = openai_client(url)
            replay(client, kind, model, -1, warm, settings.chat_answer_tokens)
            quiet(url)
            for (mode, think_s), convs in work.items():
                for c, conv in enumerate(convs):
                    before = loadtest.cpu_seconds(url)
                    rows += replay(client, kind, model, c, conv, settings.chat_answer_tokens, on_turn, mode, think_s)
                    waited = quiet(url)
                    after = loadtest.cpu_seconds(url)
                    used = None if before is None or after is None else after - before
                    cpu.append(
                        {
                            "server": kind,
                            "mode": mode,
                            "think_s": think_s,
                            "conversation": c,
                            "cpu_s": used,
                            "quiet_wait_s": waited,
                        }
                    )
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
    store.save_table(cpu, output_dir, "chat_cpu", meta)
    for line in checks(table, acc, rows, cpu):
        print(line)
    return table
