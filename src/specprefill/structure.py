"""A prompt's `core.Layout` from its tokens and its tokenizer: the text (line breaks normalized: `\r\n`, `\r`, U+0085,
U+2028 and U+2029 read as `\n`), each token's span (each token decoded alone, in one batched call: linear in the
prompt's length), the spans `protect` keeps and the requests the query signal reads (`roles`).

The markers are learned once per tokenizer by rendering a probe conversation whose contents are unique words
(`chat_format`): the text before the system content, the text between a system and a user message, between an
assistant and a user message, after the last user message (the generation prompt), and what a tool definition adds
around itself. A prompt that ends with the generation prompt is a chat: `roles.asked` reads its messages by role and
position. Any other prompt is a completion: the whole text is one message. Engine-free: tokenizers and strings only.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import itertools
import weakref
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from specprefill import core, roles
from specprefill.config import SpecPrefillConfig
from specprefill.errors import SpecPrefillError

_PROBE = {"system": "qqzsysqq", "u1": "qqzoneqq", "a1": "qqzansqq", "u2": "qqztwoqq", "tool": "qqztoolqq"}
_TOOL = {
    "type": "function",
    "function": {
        "name": _PROBE["tool"],
        "description": _PROBE["tool"],
        "parameters": {"type": "object", "properties": {}},
    },
}


def _decode(tokenizer: Any, ids: Iterable[int]) -> str:
    backend = getattr(tokenizer, "backend_tokenizer", None)  # a fast tokenizer: its own decode, no per-id checks
    if backend is not None:
        decoded: str = backend.decode(list(ids), skip_special_tokens=False)
        return decoded
    text: str = tokenizer.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)
    return text


def token_spans(tokenizer: Any, ids: list[int], text: str | None = None) -> tuple[str, list[tuple[int, int]]]:
    """The text `ids` spell and each token's (start, end) in it. Re-encoding the text gives the offsets when it
    reproduces `ids`; otherwise (a non-canonical tokenization of the decoded text) each token's span is the text
    it adds to a short window of the tokens before it, which must add up to the decoded text."""
    given = text is not None
    text = _decode(tokenizer, ids) if text is None else text
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    if list(enc["input_ids"]) == list(ids):
        return text, [(int(s), int(e)) for s, e in enc["offset_mapping"]]
    if given:
        raise SpecPrefillError(
            "the base's tokens are not its tokenizer's encoding of the rendered prompt: render "
            "and tokenize the prompt with the base's tokenizer (add_special_tokens=False)"
        )
    spans, prev = [], 0
    for i in range(len(ids)):
        window = list(ids[max(0, i - 6) : i])
        added = len(_decode(tokenizer, window + [ids[i]])) - len(_decode(tokenizer, window))
        spans.append((prev, prev + max(0, added)))
        prev += max(0, added)
    if prev != len(text):  # decoding is not additive for this tokenizer: no spans to trust
        raise SpecPrefillError(
            "cannot locate the base's tokens in their decoded text (a tokenizer whose decoding "
            "is not additive): give the speculator the base's tokenizer family"
        )
    return text, spans


@dataclass(frozen=True)
class ChatFormat:
    """The texts a chat template writes around messages (None: not learned for this template)."""

    system_open: str | None  # everything before the system content
    after_system: str | None  # system close + user open
    user_open: str  # assistant close + user open
    first_user_open: str  # everything before the content of a first user message (no system message given)
    generation: str  # user close + the assistant's opening
    tools_open: str | None  # template text before a tool definition, where tools are written outside the system
    tools_close: str | None


def _render(tokenizer: Any, messages: list[dict], **kw: Any) -> str:
    text: str = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kw)
    return text


def _between(text: str, a: str, b: str) -> str:
    return text[text.index(a) + len(a) : text.index(b)]


@functools.lru_cache(maxsize=16)
def _format_of(template: str, tokenizer: Any) -> ChatFormat | None:
    p = _PROBE
    try:
        plain = _render(tokenizer, [{"role": "user", "content": p["u1"]}])
        turns = [
            {"role": "user", "content": p["u1"]},
            {"role": "assistant", "content": p["a1"]},
            {"role": "user", "content": p["u2"]},
        ]
        talk = _render(tokenizer, turns)
        user_open = _between(talk, p["a1"], p["u2"])
        generation = talk[talk.index(p["u2"]) + len(p["u2"]) :]
    except Exception:  # a template that renders no such conversation: no chat markers
        return None
    system_open = after_system = None
    try:
        with_system = _render(tokenizer, [{"role": "system", "content": p["system"]}, *turns[:1]])
        system_open = with_system[: with_system.index(p["system"])]
        after_system = _between(with_system, p["system"], p["u1"])
    except Exception:  # the template has no system role
        pass
    tools_open = tools_close = None
    try:
        with_tool = _render(tokenizer, turns[:1], tools=[_TOOL])
        first, last = with_tool.find(p["tool"]), with_tool.rfind(p["tool"])
        if first >= 0:  # outside the system block or inside it (then kept, while the system text may be pruned)
            head = with_tool[:first]
            tools_open = head[head.rfind("\n", 0, max(0, len(head) - 1)) + 1 :] or None
            tail = with_tool[last:]
            tools_close = tail[tail.find("\n") + 1 :].split(p["u1"])[0].strip("\n")[:64] or None
    except Exception:  # no tools in this template
        pass
    first_user_open = plain[: plain.index(p["u1"])]
    return ChatFormat(system_open, after_system, user_open, first_user_open, generation, tools_open, tools_close)


def chat_format(tokenizer: Any) -> ChatFormat | None:
    """What the tokenizer's chat template writes around messages; None without a template."""
    template = getattr(tokenizer, "chat_template", None)
    return _format_of(template, tokenizer) if isinstance(template, str) and template else None


def _text_and_spans(tokenizer: Any, ids: list[int]) -> tuple[str, list[tuple[int, int]]]:
    """The prompt's text and each token's span in it, in time linear in the prompt: each token decoded alone (one
    batched call), a run of tokens that decode to a broken character (a byte-level token holding part of one)
    decoded together and held by its first token, checked against the whole decoding. Where they differ (decoders
    that drop or add text between tokens: SentencePiece's leading space), `token_spans`; where that cannot place
    the tokens either, the pieces one after the other: lines, sentences and words read the same from them."""
    pieces = _singles(tokenizer, ids)
    if pieces is not None:
        text = _decode(tokenizer, ids)
        if sum(map(len, pieces)) == len(text) and "".join(pieces) == text:
            sizes = np.fromiter(map(len, pieces), dtype=np.int64, count=len(pieces))
            ends = np.cumsum(sizes)
            return text, list(zip((ends - sizes).tolist(), ends.tolist()))
    try:
        return token_spans(tokenizer, ids)
    except SpecPrefillError:
        pieces = pieces or [_decode(tokenizer, [i]) for i in ids]
        ends = list(itertools.accumulate(len(p) for p in pieces))
        return "".join(pieces), [(e - len(p), e) for p, e in zip(pieces, ends)]


@contextlib.contextmanager
def _no_gc() -> Iterator[None]:
    """The garbage collector paused (if it ran) while many small objects are made that live on."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


_PIECES: weakref.WeakKeyDictionary[Any, dict[int, str]] = weakref.WeakKeyDictionary()


def _singles(tokenizer: Any, ids: list[int]) -> list[str] | None:
    """Each token's text decoded alone (a fast tokenizer's batched decode, remembered per tokenizer and id), a run
    whose pieces hold U+FFFD (a character split across byte-level tokens) decoded as one and given to its first
    token; None for a tokenizer without a batched decode."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or not ids:
        return None
    try:
        known = _PIECES.setdefault(tokenizer, {})  # id -> its text decoded alone: a vocabulary's worth at most
    except TypeError:  # a tokenizer object that takes no weak reference: nothing remembered
        known = {}
    missing = list(dict.fromkeys(i for i in ids if i not in known))
    if missing:
        with _no_gc():  # 100k one-token lists would start full collections of the whole process (7x slower)
            known.update(zip(missing, backend.decode_batch([[i] for i in missing], skip_special_tokens=False)))
    pieces = [known[i] for i in ids]
    broken = [i for i, p in enumerate(pieces) if "\ufffd" in p]
    runs: list[tuple[int, int]] = []  # [a, b) runs of consecutive broken pieces
    for i in broken:
        if runs and runs[-1][1] == i:
            runs[-1] = (runs[-1][0], i + 1)
        else:
            runs.append((i, i + 1))
    for (a, b), run in zip(runs, backend.decode_batch([ids[a:b] for a, b in runs], skip_special_tokens=False)):
        pieces[a:b] = [run] + [""] * (b - a - 1)
    return pieces


def layout(tokenizer: Any, ids: list[int], config: SpecPrefillConfig | None = None) -> core.Layout | None:
    """The prompt's layout when `config` needs one (`needs_layout`), else None (given no config: always)."""
    if config is not None and not config.needs_layout:
        return None
    text, spans = _text_and_spans(tokenizer, list(ids))
    text = core.normalize_breaks(text)
    offsets = roles.Offsets(spans)
    found = roles.asked(text, chat_format(tokenizer), offsets)

    def ranges(chars: list[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
        return tuple(r for r in (offsets.tokens(s, e) for s, e in chars) if r[1] > r[0])

    return core.Layout(
        text, tuple(spans), ranges(found.kept), ranges(found.requests), ranges(found.query), ranges(found.context)
    )
