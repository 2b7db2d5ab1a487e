"""A prompt's `core.Layout` from its tokens and its tokenizer: the text (line breaks normalized: `\r\n`, `\r`, U+0085,
U+2028 and U+2029 read as `\n`) and each token's span (`tokenmap`), the spans `protect` keeps and the questions the
query signal reads.

The markers are learned once per tokenizer by rendering a probe conversation whose contents are unique words
(`chat_format`): the text before the system content, the text between a system and a user message, between an
assistant and a user message, after the last user message (the generation prompt), and what a tool definition adds
around itself. A prompt that ends with the generation prompt is a chat: the questions are looked for in the last user
message and in the system message, and a tool block is protected. Any other prompt is a completion: the whole text.

A question is found where users put it: at the end of its region (after the document), at its start (before the
document), or both (LongBench's templates). From each end, pieces (paragraphs; a paragraph over `QUESTION_TOKENS`
tokens: its lines) are taken until one that asks (`asks`: a question mark in any script, "Question:", or an opening
interrogative or imperative word) - within `QUESTION_TOKENS` tokens, more than one question where they follow each
other. An end with no such piece has no question: a summarization or code-completion prompt gets none, so neither
protection nor the query signal acts and the speculator alone decides. A system message of at most `QUESTION_TOKENS`
tokens is protected whole; a longer one is a document like any (its markers protected, its questions found).
Engine-free: tokenizers and strings only.
"""

from __future__ import annotations

import functools
import itertools
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from specprefill import core
from specprefill.config import QUESTION_TOKENS, SpecPrefillConfig
from specprefill.core.text import breaks
from specprefill.core.units import LONG_LINE
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


# an interrogative or imperative opening word counts when a word follows it ("name: x" and "name,code" are keys)
_OPENERS = (
    "what|which|who|whom|whose|when|where|why|how|is|are|was|were|do|does|did|can|could|should|would|will|"
    "find|give|list|name|return|tell|identify|extract|state|quote|summari[sz]e|answer|according|please|explain|"
    "describe|translate|compare|count|compute|calculate|look|show|write|determine|check|provide|based|using|"
    "wer|wie|welche[rsmn]?|quel(?:le)?s?|comment|cu[aá]l(?:es)?|qu[eé]|d[oó]nde|qual|quem|как|что|где|какой"
)
_LABEL = re.compile(r"^\W*(?:question|query|q|问题|質問|질문)\W{0,3}\d*\s*[:\uff1a.]", re.IGNORECASE | re.MULTILINE)
# a sentence ending with a question mark: at a line's end or before the next sentence (closing quotes or brackets
# after it); not "?b=1", "x()?;" or a quoted question inside a sentence ('"Why?" she asked'); CJK's ？ anywhere
_ASKED_LINE = re.compile(
    r"[^\W_][?\u061f\u037e\u2e2e][\"'\u201d\u2019)\]*]*(?:[ \t]+(?=[^\W\d_](?<=[^\W\da-z_]))|[ \t]*$)|\uff1f",
    re.MULTILINE,
)
_OPENER = re.compile(rf"^[^\w\"'<]*(?:{_OPENERS})[ \t]+[^\W\d_]", re.IGNORECASE)
_CJK_ASKS = re.compile(
    r"什么|哪里|哪个|哪些|哪儿|哪一|哪位|哪家|哪天|哪年|谁|多少|如何|为什么|怎么|是否|[吗呢][。？?]?\s*$|"
    r"ですか|ますか|だれ|どこ|무엇|어디|누구|언제",
    re.MULTILINE,
)
_ENDS = (".", ":", "?", "!", "\u3002", "\uff1a", "\uff1f", "\uff01")


def asks(text: str, head: bool = False) -> bool:
    """Whether a piece of text asks something: a "Question:" label at a line's start, a line ending with a question
    mark (any script), a CJK question word, or (`head`: only a piece that ends a sentence, so a title such as
    "List of items" is not one) an opening interrogative or imperative word followed by a word."""
    text = text.strip()
    if _LABEL.search(text) or _ASKED_LINE.search(text) or _CJK_ASKS.search(text):
        return True
    return bool(_OPENER.search(text)) and (not head or text.endswith(_ENDS))


_BLANK = re.compile(r"\n[^\S\n]*\n")


def _pieces(text: str, start: int, end: int, spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The region's paragraphs (blank-line separated, trimmed), a paragraph over `QUESTION_TOKENS` tokens split
    into its lines: the steps in which a question is looked for from either end."""
    out = []
    at = start
    for m in [*_BLANK.finditer(text, start, end), None]:
        stop = m.start() if m else end
        if text[at:stop].strip():
            a, b = tokens_of(spans, at, stop)
            if b - a > QUESTION_TOKENS:
                line_at = at
                for line in text[at:stop].split("\n"):
                    if line.strip() and len(line) > LONG_LINE:  # a question may end a one-line document
                        out += [(line_at + p, line_at + q) for p, q, _ in breaks(line) if line[p:q].strip()]
                    elif line.strip():
                        out.append((line_at, line_at + len(line)))
                    line_at += len(line) + 1
            else:
                out.append((at, stop))
        at = m.end() if m else end
    return [(a + len(text[a:b]) - len(text[a:b].lstrip()), a + len(text[a:b].rstrip())) for a, b in out]


def _question_at(text: str, pieces: list[tuple[int, int]], spans: list[tuple[int, int]], tail: bool):
    """The span of the question at one end of the region (None: that end asks nothing): pieces from that end until
    one that asks, then on while the next asks too, within `QUESTION_TOKENS` tokens in all."""
    order = list(reversed(pieces)) if tail else pieces
    found = None
    for i, (a, b) in enumerate(order):
        first, last = (order[i][0], order[0][1]) if tail else (order[0][0], order[i][1])
        t0, t1 = tokens_of(spans, first, last)
        if t1 - t0 > QUESTION_TOKENS:
            break
        if asks(text[a:b], head=not tail):
            found = (first, last)
        elif found is not None:
            break
    return found


def questions_in(text: str, start: int, end: int, spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Character spans of the questions at the start and at the end of text[start:end] (none, one or both)."""
    pieces = _pieces(text, start, end, spans)
    if not pieces:
        return []
    tail = _question_at(text, pieces, spans, tail=True)
    head = _question_at(text, pieces, spans, tail=False)
    if head and tail and head[1] > tail[0]:  # a short region: the two overlap; the shorter is the question
        return [min(head, tail, key=lambda q: q[1] - q[0])]
    return [q for q in (head, tail) if q]


def protected_chars(
    text: str, fmt: ChatFormat | None, spans: list[tuple[int, int]]
) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """Character spans always kept (template markers, a short system message, tools) and the questions' spans."""
    if fmt is None or not fmt.generation or not text.endswith(fmt.generation):
        return [], questions_in(text, 0, len(text), spans)  # a completion
    end = len(text) - len(fmt.generation)
    opens = [fmt.user_open, fmt.after_system or "", fmt.first_user_open]
    found = [text.rfind(o, 0, end) + len(o) for o in opens if o and text.rfind(o, 0, end) >= 0]
    start = max(found, default=0)
    kept = [(end, len(text))]  # the generation prompt: first, `protect` keeps the spans in this order
    kept += [(start - len(o), start) for o in opens if o and text.rfind(o, 0, end) + len(o) == start][:1]
    tools = (0, 0)
    if fmt.tools_open and fmt.tools_close and (at := text.find(fmt.tools_open)) >= 0:
        close = text.find(fmt.tools_close, at)
        if close >= 0:
            tools = (at, close + len(fmt.tools_close))
            kept.append(tools)
    # the last user message's questions; tools the template writes into it are not part of its text
    questions = questions_in(text, max(start, tools[1]) if start <= tools[0] < end else start, end, spans)
    if fmt.system_open is not None and fmt.after_system and text.startswith(fmt.system_open):
        close = text.find(fmt.after_system, len(fmt.system_open))
        if close >= 0:
            a, b = tokens_of(spans, len(fmt.system_open), close)
            t0, t1 = tokens_of(spans, *tools) if tools[1] > tools[0] else (0, 0)
            own = (b - a) - max(0, min(b, t1) - max(a, t0))  # the system text, tool definitions aside
            if own <= QUESTION_TOKENS:  # a short system message: instructions, kept whole (its questions read)
                kept.append((0, close + len(fmt.after_system)))
                stop = tools[0] if len(fmt.system_open) < tools[0] < close else close
                questions += [
                    q for q in questions_in(text, len(fmt.system_open), stop, spans) if asks(text[q[0] : q[1]])
                ]
            else:  # a long one holds a document: its markers kept, its questions found, the rest pruned as any
                kept += [(0, len(fmt.system_open)), (close, close + len(fmt.after_system))]
                stop = tools[0] if len(fmt.system_open) < tools[0] < close else close
                questions += questions_in(text, len(fmt.system_open), stop, spans)
    return kept, questions


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


def layout(tokenizer: Any, ids: list[int], config: SpecPrefillConfig | None = None) -> core.Layout | None:
    """The prompt's layout when `config` needs one (`needs_layout`), else None (given no config: always)."""
    if config is not None and not config.needs_layout:
        return None
    text, spans = _text_and_spans(tokenizer, list(ids))
    text = core.normalize_breaks(text)
    kept, asked = protected_chars(text, chat_format(tokenizer), spans)
    questions = [r for r in (tokens_of(spans, s, e) for s, e in asked) if r[1] > r[0]]
    protected = [r for r in (tokens_of(spans, s, e) for s, e in kept) if r[1] > r[0]]
    query = [r for s, e in asked for a, b in asking_sentences(text, s, e) if (r := tokens_of(spans, a, b))[1] > r[0]]
    return core.Layout(text, tuple(spans), tuple(protected), tuple(questions), tuple(query))


_SENTENCE = re.compile(r"[^\n]*?(?:[.?!\u3002\uff1f\uff01](?=\s|$)|[\u3002\uff1f\uff01]|$)", re.MULTILINE)


def asking_sentences(text: str, start: int, end: int) -> list[tuple[int, int]]:
    """The sentences of a question's span that ask (`asks`): what the query signal reads. The instructions around a
    question ("You answer questions about the registry the user sends.") are protected with it, not searched for."""
    out = [(start + m.start(), start + m.end()) for m in _SENTENCE.finditer(text[start:end]) if asks(m[0])]
    return out or [(start, end)]
