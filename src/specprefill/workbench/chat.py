"""Multi-turn chat benchmark (`specprefill bench chat`, notebook 05's chat section): conversations — a long document,
then questions about facts at several depths and one about an earlier answer — replayed turn by turn through the
OpenAI chat API against servers built from the same base arguments, all running side by side: plain vLLM with prefix
caching, SpecPrefill with prefix caching (later turns reuse both engines' caches, `core.turns`) and SpecPrefill
without it (every turn speculated and prefilled anew, the behaviour before reuse). Turn by turn the servers take
turns (the order rotates), so each turn is compared under the same conditions.

Per turn: time to the first token (streamed), the tokens each engine computed (the base: what its prefix cache did
not hold of what it received; the speculator: of its prompt), the base's cache hit rate and whether the answer holds
the expected code word.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time

import pandas as pd

from specprefill.config import ChatSettings, EngineParams, SpecPrefillConfig
from specprefill.data import synthetic
from specprefill.errors import SpecPrefillError
from specprefill.workbench import stats, store

LABELS = {
    "vllm": "vLLM + prefix caching",
    "specprefill": "SpecPrefill + prefix caching (reuse)",
    "specprefill-no-reuse": "SpecPrefill, no prefix caching (before)",
}
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
        synthetic.conversation(n_chars, settings.chat_turns, settings.chat_seed + seed_offset + c)
        for c in range(settings.chat_conversations)
    ]


def max_model_len(settings: ChatSettings) -> int:
    """Context for a whole conversation: the document, every question and answer, the chat template's tokens."""
    return settings.chat_doc_tokens + settings.chat_turns * (settings.chat_answer_tokens + 64) + 256


def server_params(kind: str, params: EngineParams, block_size: int | None = None) -> EngineParams:
    """One server's engine parameters: the same base arguments for every kind, prefix caching but for the
    SpecPrefill-before server, the chat's block size for the base."""
    engine_args = {**params.engine_args, **({"block_size": block_size} if block_size else {})}
    return params.replace(enable_prefix_caching=kind != "specprefill-no-reuse", engine_args=engine_args)


def ask(client, model: str, messages: list[dict], max_tokens: int) -> dict:
    """One streamed, greedy chat completion: TTFT (to the first chunk carrying text or a finish), the answer, the
    usage and SpecPrefill's per-request fields (None from plain vLLM)."""
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


def replay(clients: dict, model: str, index: int, conv: synthetic.Conversation, max_tokens: int, on_turn=None):
    """One conversation on every server: turn by turn, each server in its turn (the order rotates with the turn and
    the conversation, so no server always follows the same one); each server's history holds the answers it gave.
    Rows as `turn_row`."""
    kinds = list(clients)
    history: dict[str, list[dict]] = {kind: [] for kind in kinds}
    rows = []
    for t, expected in enumerate(conv.answers):
        shift = (index + t) % len(kinds)
        for kind in kinds[shift:] + kinds[:shift]:
            messages = history[kind]
            messages.append({"role": "user", "content": conv.message(t)})
            time.sleep(SETTLE_S)
            reply = ask(clients[kind], model, messages, max_tokens)
            messages.append({"role": "assistant", "content": reply["answer"]})
            rows.append(turn_row(kind, index, t + 1, reply, expected))
            if on_turn is not None:
                on_turn(rows[-1])
    return rows


def openai_client(url: str):
    import openai

    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", timeout=3600, max_retries=0)


def run(
    params: EngineParams, config: SpecPrefillConfig, settings: ChatSettings, log_dir: str, on_turn=None
) -> list[dict]:
    """Every conversation on every server (all started first, one at a time, then left running side by side), after
    one unrecorded warm-up conversation. Rows as `turn_row`."""
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
    rows: list[dict] = []
    with contextlib.ExitStack() as stack:
        clients = {}
        for kind in kinds:
            server = "vllm" if kind == "vllm" else "specprefill"
            url = stack.enter_context(
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
            clients[kind] = openai_client(url)
        replay(clients, model, -1, warm, settings.chat_answer_tokens)
        for c, conv in enumerate(convs):
            rows += replay(clients, model, c, conv, settings.chat_answer_tokens, on_turn)
    return rows


def _ratio(rows: pd.DataFrame, kind: str, over: str) -> pd.Series:
    """Per turn: the median over conversations of TTFT(`over`) / TTFT(`kind`), paired by conversation."""
    wide = rows.pivot_table(index=["conversation", "turn"], columns="server", values="ttft_s")
    if kind not in wide or over not in wide:
        return pd.Series(dtype=float)
    return (wide[over] / wide[kind]).groupby(level="turn").median()


def turn_table(rows: list[dict]) -> pd.DataFrame:
    """Per server and turn: median TTFT, its ratio to plain vLLM's (> 1: faster) and to SpecPrefill-before's, median
    tokens computed by the base and by the speculator, the base's median hit rate, answers correct (k/n)."""
    df = pd.DataFrame(rows)
    g = df.groupby(["server", "turn"])
    out = g.agg(
        ttft_s=("ttft_s", "median"),
        base_prefilled=("base_prefilled_tokens", "median"),
        speculator_prefilled=("speculator_prefilled_tokens", "median"),
        speculation_ms=("speculation_ms", "median"),
        base_hit_rate=("base_hit_rate", "median"),
        correct=("correct", "sum"),
        n=("correct", "size"),
    ).reset_index()
    for over, column in (("vllm", "speedup_vs_vllm"), ("specprefill-no-reuse", "speedup_vs_before")):
        ratios = {k: _ratio(df, k, over) for k in out["server"].unique()}
        out[column] = [ratios[k].get(t, float("nan")) for k, t in zip(out["server"], out["turn"])]
    order = {k: i for i, k in enumerate(LABELS)}
    return out.sort_values(["server", "turn"], key=lambda s: s.map(order) if s.name == "server" else s)


def accuracy(rows: list[dict]) -> pd.DataFrame:
    """Per server: answers correct on turn 1 and on the later turns, with Wilson 95% intervals."""
    df = pd.DataFrame(rows)
    out = []
    for kind, group in df.groupby("server", sort=False):
        for part, sel in (("turn 1", group["turn"] == 1), ("later turns", group["turn"] > 1)):
            k, n = int(group.loc[sel, "correct"].sum()), int(sel.sum())
            low, high = stats.wilson(k, n)
            out.append({"server": kind, "turns": part, "correct": k, "n": n, "low": low, "high": high})
    return pd.DataFrame(out)


def checks(table: pd.DataFrame, acc: pd.DataFrame) -> list[str]:
    """The multi-turn claims, each "holds" or "fails" with its numbers: turn 1 of SpecPrefill with reuse at least as
    fast as before (median ratio >= 1), every later turn no slower than plain vLLM with prefix caching (>= 1), later
    answers correct at least as often as plain vLLM's."""
    lines: list[str] = []
    ours = table[table["server"] == "specprefill"]
    if ours.empty:
        return lines
    first = ours[ours["turn"] == 1]["speedup_vs_before"].iloc[0]
    if first == first:  # the before-server ran
        lines.append(f"turn 1 vs SpecPrefill before: {first:.2f}x ({'holds' if first >= 1 else 'fails'})")
    later = ours[ours["turn"] > 1]
    for turn, ratio in zip(later["turn"], later["speedup_vs_vllm"]):
        if ratio == ratio:
            lines.append(f"turn {turn} vs vLLM + prefix caching: {ratio:.2f}x ({'holds' if ratio >= 1 else 'fails'})")
    later_acc = acc[acc["turns"] == "later turns"].set_index("server")
    if {"specprefill", "vllm"} <= set(later_acc.index):
        a, b = later_acc.loc["specprefill"], later_acc.loc["vllm"]
        verdict = "holds" if a["correct"] / a["n"] >= b["correct"] / b["n"] else "fails"
        lines.append(
            f"later answers correct: SpecPrefill {a['correct']}/{a['n']} [{a['low']:.2f}, {a['high']:.2f}] vs vLLM "
            f"{b['correct']}/{b['n']} [{b['low']:.2f}, {b['high']:.2f}] ({verdict})"
        )
    return lines


def section(engine: EngineParams, config: SpecPrefillConfig, settings: ChatSettings, output_dir) -> pd.DataFrame | None:
    """Notebook 05's chat section: `run` with a context that holds a whole conversation, the rows, the per-turn
    table and the answers' accuracy saved beside the notebook's other tables (`chat_rows`, `chat_turns`,
    `chat_accuracy`), the checks printed. None when the settings ask for no conversation."""
    if settings.chat_conversations == 0:
        return None
    engine = engine.replace(max_model_len=max(engine.max_model_len or 0, max_model_len(settings)))
    rows = run(engine, config, settings, f"{output_dir}/chat_logs")
    meta = {"engine": engine.to_dict(), "specprefill": config.to_dict(), "chat": dataclasses.asdict(settings)}
    store.save_table(rows, output_dir, "chat_rows", meta)
    table = store.save_table(turn_table(rows).to_dict("records"), output_dir, "chat_turns", meta)
    acc = accuracy(rows)
    store.save_table(acc.to_dict("records"), output_dir, "chat_accuracy", meta)
    for line in checks(table, acc):
        print(line)
    return table
