"""What a score selects when the selection follows the prompt's structure (`selection_unit` "lines" or "records"), keeps
protected spans or adds the query signal; the original's fixed chunks stay in `selection.select`.

A `Layout` is one prompt's text, each token's character span in it, the token ranges always kept (`protected`) and
the question's tokens. From it:
- units: runs of at most `chunk_size` tokens that start where a line or a sentence starts (a longer line is cut
  every `chunk_size` tokens), and never straddle the start of a record;
- records: a line's record starts at the first line of its run of sibling lines (same indentation, deeper lines
  in between, no blank line) - a paragraph's first line, a JSON object's first field - or, for an indented run
  under a line that names something ("Crate 4:" above its fields), at that line. Under "records" a kept unit brings
  the first unit of its line and of its record, where the key of what it holds usually is; of a run over
  `RECORD_UNITS` units of sibling lines (a list of one-line entries: log lines, CSV rows), its first line only when
  it is a header (`_names_columns`: field names over values), not the list's first entry;
- the query signal: the question's words weighted by their rarity across units (inverse document frequency), the
  share of that weight a unit holds (under "records", the most any unit of its record holds: the question names a
  record by its key, and the value it asks for is in another unit of it; of its line in a run too long to be one
  record), added to the unit's attention score (scaled to a maximum of 1) times `query_weight`. Under "records" a
  kept unit also brings the unit of its record that holds that most (the key the question names, wherever in the
  record it sits: a 17-field JSON object's "name" in its middle).
Budget: ceil(M x keep_rate) tokens, protected ones included, within one unit; the protected spans take at most
`protect_share` of it (questions first, each span from its end; logged once when the cap binds). A question asked
before most of the document (`asked_first`: the base reads it far from where it answers) that names records (under
"records", with the query signal and protection: the best record holds at least `NAMED` of its weighted words) keeps
those records (and those within `NEAR` of the best) and the protected spans only, within the budget and usually far
under it (what the protection cap cut of the questions comes back in what the document left): there the
speculator's other picks are its answer candidates, and the base, given the named record among a few of them,
answers with one of those (docs/measurements.md, "Selection on document shapes")."""

from __future__ import annotations

import bisect
import logging
import math
from collections import Counter
from dataclasses import dataclass
from functools import cached_property

import torch

from specprefill.config import SpecPrefillConfig
from specprefill.core.text import (
    BREAKS,
    FULL_STOPS,
    SENTENCE_END,
    STOPWORDS,
    WORD,
    breaks,
    normalize_breaks,
    words_of,
)
from specprefill.errors import SpecPrefillError

RECORD_UNITS = 8  # the most units a record spans for the query signal to lift all of it
MARKER_TOKENS = 16  # a protected span this short is a template marker: kept before the questions
NAMED = 0.4  # a record holding this share of the question's weighted words is named (tune half: 0.46-0.97)
NEAR = 0.5  # ... and the records holding at least this share of what the best one holds (a partial name's match)
LONG_LINE = 256  # characters: a line longer than this is cut where its structure breaks (`text.breaks`)
log = logging.getLogger("specprefill")
_cap_logged = False


@dataclass(frozen=True)
class Layout:
    """One prompt's structure: its text, each token's (start, end) in it, token ranges [start, end) always kept,
    and the question's token range (None: no question known)."""

    text: str
    spans: tuple[tuple[int, int], ...]
    protected: tuple[tuple[int, int], ...] = ()
    questions: tuple[tuple[int, int], ...] = ()
    query: tuple[tuple[int, int], ...] = ()  # the questions' asking sentences: the query signal's words (default: all)

    def __post_init__(self) -> None:
        n = len(self.spans)
        for s, e in (*self.protected, *self.questions, *self.query):
            if not 0 <= s <= e <= n:
                raise ValueError(f"token range ({s}, {e}) is outside the prompt's {n} tokens")
        if any(c in self.text for c in BREAKS):
            object.__setattr__(self, "text", normalize_breaks(self.text))

    @cached_property
    def _virtual(self) -> list[tuple[int, int, int]]:
        """The text's lines as (first char, end char, indent): each text line, and a line over `LONG_LINE` characters
        (minified JSON or XML, a paragraph or a list on one line) cut where its structure breaks (`text.breaks`), its
        pieces indented by their nesting depth as a pretty-printer would."""
        out, at = [], 0
        for line in self.text.split("\n"):
            indent = len(line) - len(line.lstrip(" \t"))
            if len(line) > LONG_LINE:
                out += [(at + a, at + b, indent + d) for a, b, d in breaks(line)]
            else:
                out.append((at, at + len(line), indent))
            at += len(line) + 1
        return out

    @cached_property
    def _lines(self) -> tuple[list[int], list[int]]:
        """Per line (`_virtual`): its first character and the token holding it (a token may also hold the newline
        before)."""
        offsets = [a for a, _, _ in self._virtual]
        return offsets, [self.token_of(c) for c in offsets]

    @cached_property
    def line_starts(self) -> list[int]:
        """Tokens that hold the first character of a line, token 0 included."""
        return sorted(set(self._lines[1]) | {0}) if self.spans else []

    @cached_property
    def sentence_starts(self) -> list[int]:
        """Tokens that start with white space right after a token ending a sentence (".", "!" or "?")."""
        text, spans = self.text, self.spans
        return [
            i
            for i in range(1, len(spans))
            if (
                text[spans[i][0] : spans[i][0] + 1].isspace()
                and text[spans[i - 1][0] : spans[i - 1][1]].rstrip(" \t").endswith(SENTENCE_END)
            )
            or text[spans[i - 1][0] : spans[i - 1][1]].rstrip(" \t").endswith(FULL_STOPS)
        ]

    def token_of(self, char: int) -> int:
        """The token holding character `char` (the last token for a character past the end)."""
        return min(bisect.bisect_right(self._ends, char), len(self.spans) - 1)

    @cached_property
    def _ends(self) -> list[int]:
        return [e for _, e in self.spans]

    @cached_property
    def _indents(self) -> dict[int, int]:
        """Line-start token -> the indentation of the first non-blank line it starts."""
        out: dict[int, int] = {}
        for (a, b, indent), token in zip(self._virtual, self._lines[1]):
            if self.text[a:b].strip():
                out.setdefault(token, indent)
        return out

    def indent(self, line: int) -> int:
        """The indentation of line `line` (index into `line_starts`; 0 for a blank one)."""
        return self._indents.get(self.line_starts[line], 0)

    @cached_property
    def record_of_line(self) -> list[int]:
        """For each line (index into `line_starts`), the line its record starts at (read in characters, so a blank
        line inside one token still separates records)."""
        _, tokens = self._lines
        heads_at: list[int] = []  # per text line: the line its record starts at
        stack: list[tuple[int, int]] = []  # (indent, record start line) of the open runs
        last = (0, "")  # the last non-blank line: (index, text)
        content = {}  # line-start token -> the last non-blank line it starts
        for j, (a, b, indent) in enumerate(self._virtual):
            line = self.text[a:b]
            if not line.strip():
                stack = []
                heads_at.append(j)
                continue
            while stack and stack[-1][0] > indent:
                stack.pop()
            if not stack or stack[-1][0] < indent:
                # a new run: its record starts at the line above it when that line names something (a key
                # with its fields below), else (a bracket, a first line) at its own first line
                keyed = bool(stack) and WORD.search(last[1]) is not None
                stack.append((indent, last[0] if keyed else j))
            heads_at.append(stack[-1][1])
            last = (j, line)
            content[tokens[j]] = j
        where = {t: i for i, t in enumerate(self.line_starts)}
        out: list[int] = []
        for t in self.line_starts:
            at = content.get(t)
            # a token holding only blank lines belongs to the record before it
            out.append(where[tokens[heads_at[at]]] if at is not None else (out[-1] if out else 0))
        return out


@dataclass(frozen=True)
class Units:
    """A prompt cut into selection units: unit u holds tokens [starts[u], starts[u+1]); `heads[u]`: the units a kept
    unit brings along (its line's first unit and its record's - its line's again in a list of entries - and, with the
    query signal, its record's key unit; empty but under "records")."""

    starts: list[int]
    n: int
    heads: list[tuple[int, ...]]

    def span(self, u: int) -> tuple[int, int]:
        return self.starts[u], self.starts[u + 1] if u + 1 < len(self.starts) else self.n

    def index(self) -> torch.Tensor:
        """Unit of every token (int64 [n])."""
        sizes = [self.span(u)[1] - self.span(u)[0] for u in range(len(self.starts))]
        return torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes))


def cut(layout: Layout | None, n: int, config: SpecPrefillConfig) -> Units:
    """The units `config.selection_unit` names: "chunks" (fixed chunk_size tokens), "lines" or "records"."""
    size = config.chunk_size
    if config.selection_unit == "chunks":
        fixed = list(range(0, n, size if size > 0 else 1))
        return Units(fixed, n, [()] * len(fixed))
    if layout is None or len(layout.spans) != n:
        raise SpecPrefillError(
            f"selection unit {config.selection_unit!r} needs the prompt's text: select through an engine or a Layout"
        )
    if size < 1:
        raise SpecPrefillError(
            f"selection unit {config.selection_unit!r} needs chunk_size >= 1 (token mode has no lines)"
        )
    record_lines = sorted({layout.line_starts[h] for h in layout.record_of_line})
    hard = set(record_lines) | {s for r in (*layout.protected, *layout.questions) for s in r if s < n}
    bounds = sorted(set(layout.line_starts) | set(layout.sentence_starts) | hard | {0}) + [n]
    starts: list[int] = []
    for a, b in zip(bounds, bounds[1:]):
        if starts and a not in hard and b - starts[-1] <= size:
            continue  # the segment [a, b) joins the open unit
        starts += list(range(a, b, size))
    unit_of = torch.searchsorted(torch.tensor(starts), torch.arange(n), right=True) - 1
    heads: list[tuple[int, ...]] = [()] * len(starts)
    if config.selection_unit == "records":
        line_of = (torch.searchsorted(torch.tensor(layout.line_starts), torch.tensor(starts), right=True) - 1).tolist()
        record_unit = [int(unit_of[layout.line_starts[layout.record_of_line[line]]]) for line in line_of]
        units_in = Counter(record_unit)
        header: dict[int, bool] = {}  # a long run's first line -> whether it is the run's header
        heads = []
        for line, record in zip(line_of, record_unit):
            head, first = int(unit_of[layout.line_starts[line]]), layout.record_of_line[line]
            if units_in[record] > RECORD_UNITS and layout.indent(first) == layout.indent(line):  # a sibling run
                if first not in header:
                    header[first] = _names_columns(layout, first)
                if not header[first]:
                    record = head  # log lines, JSON lines: the list's first entry is no other line's head
            heads.append((head, record))
    return Units(starts, n, heads)


def _names_columns(layout: Layout, line: int, look: int = 4) -> bool:
    """Whether line `line` (index into `Layout.line_starts`), the first of a long run of sibling lines, is the run's
    header (field names over values: no digit in it, digits in the `look` lines after it - a CSV or markdown table's
    header) rather than its first entry."""
    at = [layout.spans[t][0] for t in layout.line_starts[line : line + look + 2]] + [len(layout.text)] * (look + 2)
    first, after = layout.text[at[0] : at[1]], layout.text[at[1] : at[look + 1]]
    return not any(c.isdigit() for c in first) and any(c.isdigit() for c in after)


def query_scores(layout: Layout, units: Units) -> torch.Tensor:
    """Per unit, the share of the questions' word weight it holds (0 for units inside a question). A word's weight is
    its inverse document frequency over the lines outside the questions; stopwords and prompt-template words
    ("question", "answer", "document", ...) weigh nothing. The share is over every weighted word asked, those the
    document never holds included (weighted as the rarest): one incidental match of one word of a long question is a
    small share, the asked key with the words around it a large one. No question: zeros (the speculator decides)."""
    if not layout.questions:
        return torch.zeros(len(units.starts))
    words: list[set[str]] = [set() for _ in units.starts]
    asked: set[str] = set()
    # the questions and the other protected spans (template markers: "user", "assistant") are not document: their
    # units are not scored and their words count for no unit; the query's words are the asking sentences'
    inside_q = torch.zeros(len(layout.spans), dtype=torch.bool)
    reading = torch.zeros(len(layout.spans), dtype=torch.bool)
    for q0, q1 in (*layout.questions, *layout.protected):
        inside_q[q0:q1] = True
    for q0, q1 in layout.query or layout.questions:
        reading[q0:q1] = True
    for at, word in words_of(layout.text):
        if word in STOPWORDS:
            continue
        token = layout.token_of(at)
        if reading[token]:
            asked.add(word)
        if not inside_q[token]:
            words[bisect.bisect_right(units.starts, token) - 1].add(word)
    inside = [bool(inside_q[slice(*units.span(u))].any()) for u in range(len(units.starts))]
    # document frequency over lines (`Layout.line_starts`, long lines laid out), not units: a word every entry's
    # line holds ("The access code of ...") tells no entry apart, however the lines are cut into units
    line_of = bisect.bisect_right
    by_line: dict[int, set[str]] = {}
    for u, (ws, inner) in enumerate(zip(words, inside)):
        if not inner:
            by_line.setdefault(line_of(layout.line_starts, units.starts[u]) - 1, set()).update(ws)
    if not asked or not by_line:
        return torch.zeros(len(units.starts))
    df = Counter(w for ws in by_line.values() for w in ws & asked)
    idf = {w: math.log((len(by_line) + 1) / (df[w] + 1)) for w in asked}
    total = sum(idf.values()) or 1.0
    return torch.tensor([0.0 if inner else sum(idf[w] for w in ws & asked) / total for ws, inner in zip(words, inside)])


def _by_record(asked: torch.Tensor, units: Units) -> tuple[torch.Tensor, list[int | None]]:
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
    return torch.maximum(asked.float(), best[group]), [key.get(g) for g in group.tolist()]


def asked_first(layout: Layout, m: int) -> bool:
    """Whether the questions come before most of the document (its tokens outside protected spans and questions):
    asked first, in the system message or above the document, with no question after it."""
    if not layout.questions:
        return False
    document = torch.ones(m, dtype=torch.bool)
    for s, e in (*layout.protected, *layout.questions):
        document[s:e] = False
    after = int(document[max(e for _, e in layout.questions) :].sum())
    return after * 2 > int(document.sum())


def protect(layout: Layout, config: SpecPrefillConfig, budget: int, m: int) -> torch.Tensor:
    """The protected tokens (bool [m]): the chat template's markers and generation prompt (spans of at most
    `MARKER_TOKENS`), the questions (the last in the prompt first), then the other protected spans (a short system
    message, tools; shortest first), each from its end, until `protect_share` of the budget; one logged line the first
    time the cap binds."""
    global _cap_logged
    cap = max(1, math.floor(budget * config.protect_share))
    kept = torch.zeros(m, dtype=torch.bool)
    markers = [r for r in layout.protected if r[1] - r[0] <= MARKER_TOKENS]  # template markers, the generation prompt
    rest = sorted((r for r in layout.protected if r[1] - r[0] > MARKER_TOKENS), key=lambda r: r[1] - r[0])
    ranges = [*markers, *sorted(layout.questions, key=lambda r: -r[0]), *rest]
    count = 0
    wanted = len({i for s, e in ranges for i in range(s, e)})
    for s, e in ranges:
        new = (~kept[s:e]).nonzero().flatten() + s
        take = new[max(0, len(new) - (cap - count)) :] if count < cap else new[:0]
        kept[take] = True
        count += len(take)
    if wanted > count and not _cap_logged:
        _cap_logged = True
        log.warning(
            "specprefill: protected spans (questions, system message, tools) hold %d tokens, over protect_share "
            "%.2f of the %d-token budget: %d kept from their ends (raise --protect-share or the keep rate to keep "
            "them whole; later cases are not logged)",
            wanted,
            config.protect_share,
            budget,
            count,
        )
    return kept


def select_units(
    importance: torch.Tensor, config: SpecPrefillConfig, layout: Layout | None, budget: int
) -> torch.Tensor:
    """Sorted kept indices (int64) under the structured rule: protected spans, then units by score (each with its
    heads) until `budget` tokens, within one unit."""
    m = importance.shape[-1]
    units = cut(layout, m, config)
    index = units.index().to(importance.device)
    sums = torch.zeros(len(units.starts), device=importance.device).index_add_(0, index, importance.float())
    scores = (sums / torch.bincount(index, minlength=len(units.starts)).float()).cpu()
    named = None  # under "records" with the query signal: each unit's record's share of the question's words
    if config.query_weight > 0 and layout is not None and layout.questions:
        top, asked = scores.max(), query_scores(layout, units)
        if config.selection_unit == "records":
            asked, keys = _by_record(asked, units)
            named = asked
            heads = [h if k is None else (*h, k) for h, k in zip(units.heads, keys)]
            units = Units(units.starts, units.n, heads)
        scores = (scores / top if top > 0 else scores) + config.query_weight * asked
    kept = protect(layout, config, budget, m) if config.protect and layout is not None else torch.zeros(m, dtype=bool)
    size = max(1, config.chunk_size)
    count = n_protected = int(kept.sum())
    order = torch.sort(scores, descending=True, stable=True).indices.tolist()
    named_only = False
    if named is not None and config.protect and layout is not None:
        best = float(named.max())
        named_only = best >= NAMED and asked_first(layout, m)
        if named_only:  # the named records alone (the speculator's other picks left out): usually far under budget
            wanted = set(torch.nonzero(named >= NEAR * best).flatten().tolist())
            order = [u for u in order if u in wanted]
    for with_heads in (True, False):  # heads where they fit; a short remainder filled by units alone
        if named_only and not with_heads and count > n_protected:
            break  # named records kept whole: no fragments of them
        for u in order:
            if count >= budget:
                break
            spans = [units.span(v) for v in dict.fromkeys((u, *units.heads[u]) if with_heads else (u,))]
            new = sum(int((~kept[s:e]).sum()) for s, e in spans)
            if new == 0 or (with_heads and count + new > budget + size):
                continue
            for s, e in spans:
                kept[s:e] = True
            count += new
    if named_only and layout is not None:  # the budget left: what the protection cap cut, the questions first
        have = kept.tolist()
        missing = [i for s, e in (*layout.questions, *layout.protected) for i in range(e - 1, s - 1, -1) if not have[i]]
        kept[list(dict.fromkeys(missing))[: max(0, budget - count)]] = True
    return torch.nonzero(kept).flatten().to(importance.device)
