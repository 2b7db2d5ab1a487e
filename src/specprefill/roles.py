"""What a prompt asks, read from where it sits, not from its words: chat roles and the position within a message.

- A chat prompt (it ends with the template's generation prompt): the request is in the last user message. A message
  of at most `QUESTION_TOKENS` tokens is the request whole, whatever its language or mood ("Give me ...", "请告诉我
  ...", "¿Cuál ...?"). A longer one holds a document: its request is the text around the document (`ends_of`).
  Where the last user message holds no request (a document alone), the system message is read the same way.
  A short system message is kept whole; earlier turns of at most `QUESTION_TOKENS` tokens (an assistant's answer
  the last question refers to, an earlier question) are kept too, the latest first, after the request.
- A completion prompt: the whole text is one message.

Around a document, a request is what differs from the document in form. At each end of the message: its pieces
(paragraphs; in a paragraph over `QUESTION_TOKENS` tokens its lines; in a line over `LONG_LINE` characters its
structural pieces) that do not repeat the form of the `WINDOW` pieces inward from them (`form`: the punctuation of
each of their lines; records, list items and table rows share it, a question does not), within `QUESTION_TOKENS`
tokens. Where both ends hold one, `ends_of` decides which is the document's own; else (an instruction above the
document, a question below it) both are kept and the request is the one after the document, where the base answers.
No list of words in any language decides. Engine-free: strings and token offsets only."""

from __future__ import annotations

import bisect
import re
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

from specprefill.config import QUESTION_TOKENS
from specprefill.core.text import breaks
from specprefill.core.units import LONG_LINE

REACH = 16384  # characters read at each end of a long message: far more than a request and `WINDOW` pieces
WINDOW = 16  # pieces inward whose forms a request's piece must not repeat: a record of up to this many lines
_BLANK = re.compile(r"\n[^\S\n]*\n")
_FORM = re.compile(r"[\w\s]+")


@dataclass(frozen=True)
class Offsets:
    """Each token's (start, end) character span, with its token lookups in logarithmic time."""

    spans: Sequence[tuple[int, int]]
    _starts: list[int] = field(init=False, repr=False)
    _ends: list[int] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_starts", [s for s, _ in self.spans])
        object.__setattr__(self, "_ends", [e for _, e in self.spans])

    def tokens(self, start: int, end: int) -> tuple[int, int]:
        """The token range [a, b) whose characters overlap [start, end); (0, 0) when none does."""
        a = bisect.bisect_right(self._ends, start)
        b = bisect.bisect_left(self._starts, end)
        while b > a and self._ends[b - 1] <= start:  # zero-length tokens at the edge
            b -= 1
        return (a, b) if b > a else (0, 0)

    def count(self, start: int, end: int) -> int:
        a, b = self.tokens(start, end)
        return b - a


@dataclass(frozen=True)
class Asked:
    """A prompt's request spans (characters); the spans always kept (template markers, a short system message,
    tools); the context kept after them (an instruction beside the document, short earlier turns, latest first);
    and what the query reads (default: the requests)."""

    requests: list[tuple[int, int]]
    kept: list[tuple[int, int]]
    context: list[tuple[int, int]] = field(default_factory=list)
    query: list[tuple[int, int]] = field(default_factory=list)


def form(text: str) -> tuple[str, ...]:
    """A piece's form: the punctuation of each of its lines, letters, digits and spaces dropped."""
    return tuple(_FORM.sub("", line) for line in text.split("\n"))


def pieces(text: str, start: int, end: int, offsets: Offsets) -> list[tuple[int, int, int]]:
    """The message's paragraphs (blank-line separated, trimmed), a paragraph over `QUESTION_TOKENS` tokens split
    into its lines and a line over `LONG_LINE` characters into its structural pieces (`text.breaks`), as (first
    char, end char, paragraph number): a paragraph's pieces share its number, -1 - number where it was split."""
    out = []
    at = start
    for n, m in enumerate([*_BLANK.finditer(text, start, end), None]):
        stop = m.start() if m else end
        if text[at:stop].strip():
            if offsets.count(at, stop) > QUESTION_TOKENS:
                line_at = at
                for line in text[at:stop].split("\n"):
                    if line.strip() and len(line) > LONG_LINE:
                        out += [(line_at + p, line_at + q, -1 - n) for p, q, _ in breaks(line) if line[p:q].strip()]
                    elif line.strip():
                        out.append((line_at, line_at + len(line), -1 - n))
                    line_at += len(line) + 1
            else:
                out.append((at, stop, n))
        at = m.end() if m else end
    return [(a + len(text[a:b]) - len(text[a:b].lstrip()), a + len(text[a:b].rstrip()), n) for a, b, n in out]


def _end(text: str, parts: list[tuple[int, int, int]], sizes: list[int], tail: bool):
    """The request at one end of a message's pieces as (first char, end char, tokens, whole paragraph); None where
    that end holds the document: its piece repeats the form of one of the `WINDOW` pieces inward. It goes on inward in
    the same split paragraph while the pieces do not repeat and are shorter than the typical piece (the median), or
    are the last before pieces that repeat (a long question line above "Answer:", under records)."""
    order = list(range(len(parts)))[::-1] if tail else list(range(len(parts)))
    order = order[:-1]  # the other end's first piece is not the document (a question asked on both sides)
    order = order[: QUESTION_TOKENS + WINDOW]
    forms: dict[int, tuple[str, ...]] = {}  # read as needed: a request stops within a few pieces

    def form_at(k: int) -> tuple[str, ...]:
        if k not in forms:
            forms[k] = form(text[parts[order[k]][0] : parts[order[k]][1]])
        return forms[k]

    def repeats(k: int) -> bool:
        return k + 1 < len(order) and form_at(k) in [form_at(j) for j in range(k + 1, min(len(order), k + 1 + WINDOW))]

    typical = statistics.median(sizes)
    taken, total = 0, 0
    for k, i in enumerate(order[: max(0, len(order) - 2)]):
        if repeats(k) or total + sizes[i] > QUESTION_TOKENS:
            break
        # inward in the same split paragraph: a short piece, or the last before the document's repeating pieces
        if k and (parts[i][2] != parts[order[0]][2] or parts[i][2] >= 0 or sizes[i] >= typical and not repeats(k + 1)):
            break
        taken, total = k + 1, total + sizes[i]
    if not taken:
        return None
    chosen = [parts[i] for i in order[:taken]]
    return min(a for a, _, _ in chosen), max(b for _, b, _ in chosen), total, chosen[0][2] >= 0


def ends_of(text: str, start: int, end: int, offsets: Offsets) -> tuple[tuple | None, tuple | None]:
    """(head, tail): the request before and after the document of text[start:end] (None where that end holds
    none); a message of at most `QUESTION_TOKENS` tokens is all request (the tail). Where both ends differ from
    the document in form, a whole paragraph wins over a piece of a split one (the last of a minified document's
    pieces under a question asked first), and an end as long as the document's typical paragraph is the
    document's own (a prose document's last paragraph under a question asked first)."""
    a = start + len(text[start:end]) - len(text[start:end].lstrip())
    b = start + len(text[start:end].rstrip())
    if b <= a:
        return None, None
    if offsets.count(a, b) <= QUESTION_TOKENS:
        return None, (a, b)
    if b - a > 2 * REACH:  # a long message: its two ends only (linear time; the middle is document either way)
        parts = pieces(text, a, a + REACH, offsets) + pieces(text, b - REACH, b, offsets)
    else:
        parts = pieces(text, a, b, offsets)
    if len(parts) < 3:
        return None, None
    sizes = [max(1, offsets.count(p, q)) for p, q, _ in parts]
    head, tail = _end(text, parts, sizes, tail=False), _end(text, parts, sizes, tail=True)
    if head and tail:
        inner = [s for (p, q, n), s in zip(parts, sizes) if head[1] <= p and q <= tail[0] and n >= 0]
        typical = statistics.median(inner) if inner else QUESTION_TOKENS + 1  # the document's whole paragraphs
        if head[3] != tail[3]:
            head, tail = (head, None) if head[3] else (None, tail)
        elif tail[2] >= typical > head[2]:
            tail = None
        elif head[2] >= typical > tail[2]:
            head = None
    return (head[:2] if head else None), (tail[:2] if tail else None)


def _found(head, tail) -> tuple[list, list]:
    """A message's request (after the document where there is one: where the base answers, else before it) and
    the text kept beside it (an instruction above a document that a request follows)."""
    return ([tail] if tail else [head] if head else []), ([head] if head and tail else [])


def _turns(text: str, fmt, first: int, start: int) -> list[tuple[int, int]]:
    """The earlier messages of a chat, latest first: from `first` (the first user message's opening), each user
    message up to a generation prompt and each assistant message after it up to the next user opening, until
    `start` (the last user message's content)."""
    out = []
    at = first + len(fmt.first_user_open) if text.startswith(fmt.first_user_open, first) else first
    while (g := text.find(fmt.generation, at, start)) >= 0:
        out.append((at, g))  # a user message
        a = g + len(fmt.generation)
        b = text.find(fmt.user_open, a, start)
        if b < 0:
            break
        out.append((a, b))  # the assistant's answer
        at = b + len(fmt.user_open)
    return [r for r in reversed(out) if r[1] > r[0]]


def asked(text: str, fmt, offsets: Offsets) -> Asked:
    """The request spans and the spans always kept (template markers and the generation prompt
    first, then a short system message, tools and short earlier turns) of a prompt rendered with `fmt` (None: a
    completion)."""
    if fmt is None or not fmt.generation or not text.endswith(fmt.generation):
        requests, beside = _found(*ends_of(text, 0, len(text), offsets))  # a completion: one message
        return Asked(requests, [], beside)
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
    # the last user message; tools the template writes into it are not part of its text
    head, tail = ends_of(text, max(start, tools[1]) if start <= tools[0] < end else start, end, offsets)
    requests, context = _found(head, tail)
    query: list[tuple[int, int]] = []
    first = 0
    given = not text.startswith(fmt.first_user_open)  # else no system message, or the template's own default
    if given and fmt.system_open is not None and fmt.after_system and text.startswith(fmt.system_open):
        close = text.find(fmt.after_system, len(fmt.system_open))
        if close >= 0:
            first = close + len(fmt.after_system)
            stop = tools[0] if len(fmt.system_open) < tools[0] < close else close
            own = offsets.count(len(fmt.system_open), stop)  # the system text, tool definitions aside
            if own <= QUESTION_TOKENS:  # a short system message: instructions, kept whole
                kept.append((0, first))
                if tail is None:  # nothing asked after the user's document: the system message may ask
                    query = [*requests, (len(fmt.system_open), stop)]
                    requests = requests or query[-1:]
            else:  # a long one holds a document: its markers kept, its requests found, the rest pruned as any
                kept += [(0, len(fmt.system_open)), (close, first)]
                more, beside = _found(*ends_of(text, len(fmt.system_open), stop, offsets))
                context += beside + (more if requests else [])
                requests = requests or more
    for a, b in _turns(text, fmt, first, start):  # short earlier turns, latest first: what the last one refers to
        if offsets.count(a, b) <= QUESTION_TOKENS:
            context.append((a, b))
    return Asked(requests, kept, context, query)
