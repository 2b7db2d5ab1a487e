"""A prompt's `core.Layout` from its tokens and its tokenizer: the text and each token's span (`tokenmap`), and the
spans `protect` keeps, found in the text by the markers the tokenizer's chat template writes.

The markers are learned once per tokenizer by rendering a probe conversation whose contents are unique words
(`chat_format`): the text before the system content, the text between a system and a user message, between an
assistant and a user message, after the last user message (the generation prompt), and what a tool definition adds
around itself. A prompt that ends with the generation prompt is a chat: its protected spans are the system block
(tools included where the template writes them there), the tool block where the template writes it elsewhere, and
the last user message's final paragraph. Any other prompt is a completion: its last paragraph. A question over
`config.QUESTION_TOKENS` tokens (a document that runs into it with no blank line between) is its last lines, at least
`QUESTION_LINE_TOKENS` tokens of them where they fit, and never over the cap. Engine-free: tokenizers and strings only.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from specprefill import core
from specprefill.config import QUESTION_TOKENS, SpecPrefillConfig
from specprefill.errors import SpecPrefillError

QUESTION_LINE_TOKENS = 16  # a question's last line shorter than this ("Answer:") brings the lines above it
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
        if first >= 0 and system_open is not None and not with_tool.startswith(system_open):
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


def protected_chars(text: str, fmt: ChatFormat | None) -> tuple[list[tuple[int, int]], tuple[int, int]]:
    """Character spans always kept (system, tools) and the question's span, for a chat or a completion prompt."""
    if fmt is None or not fmt.generation or not text.endswith(fmt.generation):
        end = len(text.rstrip())
        blank = text.rfind("\n\n", 0, end)
        return [], (blank + 2 if blank >= 0 else 0, end)  # a completion: its last paragraph
    end = len(text) - len(fmt.generation)
    opens = [fmt.user_open, fmt.after_system or "", fmt.first_user_open]
    found = [text.rfind(o, 0, end) + len(o) for o in opens if o and text.rfind(o, 0, end) >= 0]
    start = max(found, default=0)
    paragraph = text.rfind("\n\n", start, len(text[:end].rstrip()))
    question = (paragraph + 2 if paragraph >= 0 else start, end)
    spans = []
    if fmt.system_open is not None and fmt.after_system and text.startswith(fmt.system_open):
        close = text.find(fmt.after_system, len(fmt.system_open))
        if close >= 0:
            spans.append((0, close + len(fmt.after_system)))
    if fmt.tools_open and fmt.tools_close and (at := text.find(fmt.tools_open)) >= 0:
        close = text.find(fmt.tools_close, at)
        if close >= 0:
            spans.append((at, close + len(fmt.tools_close)))
    return spans, question


def tokens_of(spans: list[tuple[int, int]], start: int, end: int) -> tuple[int, int]:
    """The token range [a, b) whose characters overlap [start, end)."""
    inside = [i for i, (s, e) in enumerate(spans) if s < end and e > start]
    return (inside[0], inside[-1] + 1) if inside else (0, 0)


def _text_and_spans(tokenizer: Any, ids: list[int]) -> tuple[str, list[tuple[int, int]]]:
    """The prompt's text and each token's span in it (`token_spans`); where the tokenizer cannot place its tokens
    in their decoded text (ids no encoding of a text gives, decoding that is not additive), the text each token
    decodes to alone, one after the other: lines, sentences and words read the same from it."""
    try:
        return token_spans(tokenizer, ids)
    except SpecPrefillError:
        pieces = [_decode(tokenizer, [i]) for i in ids]
        ends = list(itertools.accumulate(len(p) for p in pieces))
        return "".join(pieces), [(e - len(p), e) for p, e in zip(pieces, ends)]


def _last_lines(text: str, spans: list[tuple[int, int]], start: int, end: int) -> int:
    """The first token of the span's last lines: whole lines from its end until they hold `QUESTION_LINE_TOKENS`
    tokens (a short "Answer:" line brings the question line above it), none past `QUESTION_TOKENS` but the last."""
    b = tokens_of(spans, start, end)[1]  # the caller's end: its cap counts from the same token
    end = start + len(text[start:end].rstrip())
    first, at = b, end
    while at > start and b - first < QUESTION_LINE_TOKENS:
        line = text.rfind("\n", start, at - 1) + 1 or start
        a = tokens_of(spans, line, end)[0]
        if first < b and b - a > QUESTION_TOKENS:
            break
        first, at = a, line
    return first


def layout(tokenizer: Any, ids: list[int], config: SpecPrefillConfig | None = None) -> core.Layout | None:
    """The prompt's layout when `config` needs one (`needs_layout`), else None (given no config: always)."""
    if config is not None and not config.needs_layout:
        return None
    text, spans = _text_and_spans(tokenizer, list(ids))
    char_spans, (q0, q1) = protected_chars(text, chat_format(tokenizer))
    a, b = tokens_of(spans, q0, q1)
    if b - a > QUESTION_TOKENS:  # a document running into its question (no blank line between): its last lines
        a = _last_lines(text, spans, q0, q1)
    question = (max(a, b - QUESTION_TOKENS), b)
    protected = [tokens_of(spans, s, e) for s, e in char_spans] + ([question] if b > a else [])
    return core.Layout(text, tuple(spans), tuple(r for r in protected if r[1] > r[0]), question if b > a else None)
