"""The query signal: where the request's words occur in the document (`matches`, one pass of one regular expression),
each unit's share of their weight (`query_scores`: inverse document frequency over the document's lines), added to
the unit's attention score (scaled to a maximum of 1) times `query_weight`. Under "records" a unit takes the most any
unit of its record holds (`_by_record`: the request names a record by its key, and the value it asks for is in
another unit of it; of its line in a run too long to be one record), and a kept unit brings the unit of its record
holding that most (the key the request names, wherever in the record it sits: a 17-field JSON object's "name" in its
middle). `_names_one`: whether the request names one record alone, for `selection.select_units`'s question-first
rule."""

from __future__ import annotations

import bisect
import math
import re
from dataclasses import dataclass

import numpy as np
import torch

from specprefill.core.text import CJK, STOPWORDS, words_of
from specprefill.core.units import RECORD_UNITS, Layout, Units

NAMED = 0.4  # a record holding this share of the request's weighted words is named (tune half: 0.46-0.97)
NEAR = 0.5  # ... and the records holding at least this share of what the best one holds (a partial name's match)
_SENTENCES = re.compile(r"(?<=[.?!;\u3002\uff1f\uff01\uff1b\u061f])\s+|(?<=[\u3002\uff1f\uff01\uff1b])|\n")


@dataclass(frozen=True)
class Matches:
    """Where the request's words occur in the document: the words asked (stopwords aside), per word the units
    outside the requests and protected spans that hold it and the lines it occurs on, and how many lines the
    document has."""

    asked: frozenset[str]
    units: dict[str, set[int]]
    lines: dict[str, set[int]]
    n_lines: int
    inside: torch.Tensor  # bool per unit: holds a request's or a protected span's token
    sentences: list[frozenset[str]]  # the words of each of the request's sentences


def matches(layout: Layout, units: Units) -> Matches:
    """The request's words found in the document: one pass of one regular expression over the text (the asked
    words only), so linear in the prompt's length; a word is matched whole (a hyphenated key is one word), a pair
    of characters in a script written without spaces anywhere in its run."""
    covered: np.ndarray = np.zeros(len(layout.spans) + 1, dtype=np.int64)  # numpy: per-element reads below cost ~0.1 us
    for q0, q1 in (*layout.questions, *layout.protected, *layout.context):
        covered[q0] += 1
        covered[q1] -= 1
    mask = np.cumsum(covered)[:-1] > 0
    sums = np.concatenate([[0], np.cumsum(mask)])
    bounds = np.array([*units.starts, units.n])
    inside = torch.from_numpy((sums[bounds[1:]] - sums[bounds[:-1]]) > 0)
    sentences = [
        words
        for q0, q1 in layout.query or layout.questions
        for piece in _SENTENCES.split(layout.text[layout.spans[q0][0] : layout.spans[q1 - 1][1]])
        if (words := frozenset(w for _, w in words_of(piece) if w not in STOPWORDS))
    ]
    asked = frozenset().union(*sentences)
    lines = [layout.spans[t][0] for t in layout.line_starts]
    text = layout.text
    ends = [*lines[1:], len(text)]
    outside = [t for t, a, b in zip(layout.line_starts, lines, ends) if not mask[t] and not text[a:b].isspace()]
    found: dict[str, set[int]] = {w: set() for w in asked}
    on: dict[str, set[int]] = {w: set() for w in asked}
    if asked:
        spaced = sorted((w for w in asked if not CJK.search(w)), key=len, reverse=True)
        pairs = sorted(w for w in asked if CJK.search(w))
        parts = [rf"(?<![\w-])(?<!\w-)(?:{'|'.join(map(re.escape, spaced))})(?![\w])(?!-\w)"] if spaced else []
        parts += [f"(?:{'|'.join(map(re.escape, pairs))})"] if pairs else []
        for m in re.finditer("|".join(parts), layout.text, re.IGNORECASE):
            token = layout.token_of(m.start())
            word = m[0].lower()
            if word in found and not mask[token]:
                found[word].add(bisect.bisect_right(units.starts, token) - 1)
                on[word].add(bisect.bisect_right(lines, m.start()) - 1)
    return Matches(asked, found, on, max(1, len(outside)), inside, sentences)


def query_scores(layout: Layout, units: Units, found: Matches | None = None) -> torch.Tensor:
    """Per unit, the share of the request's word weight it holds (0 for units inside a request or protected span). A
    word's weight is its inverse document frequency over the document's lines; stopwords and prompt-template words
    weigh nothing. The share is over every weighted word of the request's sentences that name something in the
    document, those the document never holds included (weighted as the rarest): one incidental match of one word of
    a long question is a small share, the asked key with the words around it a large one; a sentence that names
    nothing in the document (an instruction beside the question) takes no weight. No request: zeros (the speculator
    decides)."""
    if not layout.questions:
        return torch.zeros(len(units.starts))
    found = found or matches(layout, units)
    if not found.asked:
        return torch.zeros(len(units.starts))
    idf = weights(found)
    # sentences whose words the document never holds (instructions beside the question: "You answer questions
    # about the registry.") weigh nothing; the others' words all count, those the document never holds included
    # sorted: a sum's order fixed, so one prompt and one set of scores select alike in every process (string hashes
    # differ between processes, and with them a set's order)
    read = sorted({w for sentence in found.sentences if any(found.units[w] for w in sentence) for w in sentence})
    total = sum(idf[w] for w in read) or 1.0
    out = torch.zeros(len(units.starts), dtype=torch.float64)
    for w in read:
        if found.units[w]:
            out[sorted(found.units[w])] += idf[w] / total
    out[found.inside] = 0.0
    return out.float()


def _by_record(asked: torch.Tensor, units: Units) -> tuple[torch.Tensor, list[int | None], torch.Tensor]:
    """Each unit's query share raised to the most any unit of its record holds (the question names a record by its
    key; the value it asks for is in another unit of it), and per unit the unit of its record holding that most (its
    key: what a kept unit of the record brings along, so the base reads whose value it is; None where the record
    holds none). A run over `RECORD_UNITS` units is a list of one-line entries or a long paragraph, not one record:
    there the most any unit of the same line holds (of itself alone where the line is that long too)."""
    line, record = (torch.tensor([h[i] for h in units.heads], dtype=torch.long) for i in (0, 1))
    size = torch.bincount(record, minlength=len(units.starts))
    line_size = torch.bincount(line, minlength=len(units.starts))
    alone = torch.arange(len(units.starts))
    # a record over RECORD_UNITS units: its line; a line that long too (no structure found in it): the unit alone,
    # so the query signal is never lifted over a whole document
    group = torch.where(size[record] <= RECORD_UNITS, record, torch.where(line_size[line] <= RECORD_UNITS, line, alone))
    best = torch.zeros(len(units.starts)).scatter_reduce_(0, group, asked.float(), "amax")
    key: dict[int, int] = {}
    for u in torch.nonzero((asked.float() == best[group]) & (best[group] > 0)).flatten().tolist():
        key.setdefault(int(group[u]), u)  # the first unit holding its record's most
    return torch.maximum(asked.float(), best[group]), [key.get(g) for g in group.tolist()], group


def _names_one(layout: Layout, units: Units, found: Matches, named: torch.Tensor, group: torch.Tensor) -> bool:
    """Whether the request names one record alone, and that record holds more than the name: its rarest matched
    word occurs in no other record (a first or last name that several records share: "Jane" of "Jane Smith" and
    "Jane Doe"), and its text has words the request does not ask (a heading that only names, its values in the
    section below it, is not the record). Elsewhere the speculator's scores decide."""
    top = int(torch.argmax(named))
    record_of = [h[1] if len(h) > 1 else u for u, h in enumerate(units.heads)]
    records = {w: {record_of[u] for u in held} for w, held in found.units.items() if held}
    mine = [w for w, g in records.items() if any(record_of[u] == record_of[top] for u in found.units[w])]
    if not mine:
        return False
    key = min(mine, key=lambda w: (len(found.lines[w]), w))
    if len(records[key]) > 1:
        return False
    best = int(group[top])
    members = torch.nonzero(group == best).flatten().tolist()
    first, last = units.span(members[0])[0], units.span(members[-1])[1] - 1
    text = layout.text[layout.spans[first][0] : layout.spans[last][1]]
    return any(w not in found.asked and w not in STOPWORDS for _, w in words_of(text))


def best_named(found: Matches, group: torch.Tensor, idf: dict[str, float] | None = None, ties: int = 2) -> list[int]:
    """The units of the record each request sentence names best, where it names one (the record holds at least
    `NAMED` of the weight of the sentence's words that the document holds, and at most `ties` records hold that
    much): the asked record of a question in any language, both of "A? Sorry, I meant B.", whatever the speculator
    attends to. A sentence of words every record holds names none."""
    n = len(group)
    idf = idf or weights(found)
    out: list[int] = []
    for sentence in found.sentences:
        words = sorted(sentence)  # a fixed order of the sums, as in `query_scores`
        total = sum(idf[w] for w in words if found.units[w]) or 1.0  # words in another language weigh nothing
        share = torch.zeros(n, dtype=torch.float64)
        for w in words:
            if found.units[w]:
                share[sorted(found.units[w])] += idf[w] / total
        share[found.inside] = 0.0
        per_group = torch.zeros(n, dtype=torch.float64).scatter_reduce_(0, group, share, "amax")
        best = float(per_group.max()) if n else 0.0
        top = torch.nonzero(per_group >= best - 1e-9).flatten().tolist()
        if best >= NAMED and len(top) <= ties:
            out += [int(u) for u in torch.nonzero(torch.isin(group, torch.tensor(top))).flatten()]
    return list(dict.fromkeys(out))


def weights(found: Matches) -> dict[str, float]:
    """Each asked word's inverse document frequency over the document's lines."""
    return {w: math.log((found.n_lines + 1) / (len(found.lines[w]) + 1)) for w in found.asked}


def lookalikes(found: Matches, group: torch.Tensor, named: list[int]) -> list[int]:
    """The units of records whose matched request words are a part of a named record's (`best_named`): "Jane Doe"
    and "Ada Smith" beside the named "Jane Smith". They tell the base nothing the named record does not, and lifted
    by the query they crowd it with look-alikes; their lift is taken back, so the speculator's scores decide them."""
    if not named:
        return []
    held: dict[int, set[str]] = {}
    for w, units in found.units.items():
        for u in units:
            held.setdefault(int(group[u]), set()).add(w)
    chosen = {int(group[u]) for u in named}
    words = [held.get(g, set()) for g in chosen]
    alike = {g for g, ws in held.items() if g not in chosen and any(ws < w for w in words)}
    out: list[int] = torch.nonzero(torch.isin(group, torch.tensor(sorted(alike), dtype=group.dtype))).flatten().tolist()
    return out
