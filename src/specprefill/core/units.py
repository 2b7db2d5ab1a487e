"""What a score selects when the selection follows the prompt's structure (`selection_unit` "lines" or "records"), keeps
protected spans or adds the query signal; the original's fixed chunks stay in `selection.select`.

A `Layout` is one prompt's text, each token's character span in it, the token ranges always kept (`protected`) and
the question's tokens. From it:
- units: runs of at most `chunk_size` tokens that start where a line or a sentence starts (a longer line is cut
  every `chunk_size` tokens), and never straddle the start of a record;
- records: a line's record starts at the first line of its run of sibling lines (same indentation, deeper lines
  in between, no blank line) - a paragraph's first line, a JSON object's first field - or, for an indented run
  under a line that names something ("Crate 4:" above its fields), at that line. Under "records" a kept unit brings
  the first unit of its line and of its record, where the key of what it holds usually is;
- the query signal: the question's words weighted by their rarity across units (inverse document frequency), the
  share of that weight a unit holds (under "records", the most any unit of its record holds: the question names a
  record by its key, and the value it asks for is in another unit of it; of its line in a run too long to be one
  record), added to the unit's attention score
  (scaled to a maximum of 1) times `query_weight`.
Budget: ceil(M x keep_rate) tokens, protected ones included, within one unit; when the protected spans alone
exceed it, exactly they are kept.
"""

from __future__ import annotations

import bisect
import math
import re
from collections import Counter
from dataclasses import dataclass
from functools import cached_property

import torch

from specprefill.config import SpecPrefillConfig
from specprefill.errors import SpecPrefillError

RECORD_UNITS = 8  # the most units a record spans for the query signal to lift all of it
_WORD = re.compile(r"\w+(?:-\w+)*")  # a hyphenated key ("upset-zephyr") is one word
_SENTENCE_END = (".", "!", "?")


@dataclass(frozen=True)
class Layout:
    """One prompt's structure: its text, each token's (start, end) in it, token ranges [start, end) always kept,
    and the question's token range (None: no question known)."""

    text: str
    spans: tuple[tuple[int, int], ...]
    protected: tuple[tuple[int, int], ...] = ()
    question: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        n = len(self.spans)
        for s, e in (*self.protected, *([self.question] if self.question else [])):
            if not 0 <= s <= e <= n:
                raise ValueError(f"token range ({s}, {e}) is outside the prompt's {n} tokens")

    @cached_property
    def _lines(self) -> tuple[list[int], list[int]]:
        """Per text line: its first character and the token holding it (a token may also hold the newline before)."""
        offsets = [0] + [m.end() for m in re.finditer("\n", self.text)]
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
            if text[spans[i][0] : spans[i][0] + 1].isspace()
            and text[spans[i - 1][0] : spans[i - 1][1]].rstrip(" \t").endswith(_SENTENCE_END)
        ]

    def token_of(self, char: int) -> int:
        """The token holding character `char` (the last token for a character past the end)."""
        return min(bisect.bisect_right(self._ends, char), len(self.spans) - 1)

    @cached_property
    def _ends(self) -> list[int]:
        return [e for _, e in self.spans]

    @cached_property
    def record_of_line(self) -> list[int]:
        """For each line (index into `line_starts`), the line its record starts at (read in characters, so a blank
        line inside one token still separates records)."""
        _, tokens = self._lines
        heads_at: list[int] = []  # per text line: the line its record starts at
        stack: list[tuple[int, int]] = []  # (indent, record start line) of the open runs
        last = (0, "")  # the last non-blank line: (index, text)
        content = {}  # line-start token -> the last non-blank line it starts
        for j, line in enumerate(self.text.split("\n")):
            if not line.strip():
                stack = []
                heads_at.append(j)
                continue
            indent = len(line) - len(line.lstrip(" \t"))
            while stack and stack[-1][0] > indent:
                stack.pop()
            if not stack or stack[-1][0] < indent:
                # a new run: its record starts at the line above it when that line names something (a key
                # with its fields below), else (a bracket, a first line) at its own first line
                keyed = bool(stack) and _WORD.search(last[1]) is not None
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
    unit brings along (its line's and its record's first unit; empty but under "records")."""

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
    hard = set(record_lines) | {s for r in layout.protected for s in r if s < n}
    bounds = sorted(set(layout.line_starts) | set(layout.sentence_starts) | hard | {0}) + [n]
    starts: list[int] = []
    for a, b in zip(bounds, bounds[1:]):
        if starts and a not in hard and b - starts[-1] <= size:
            continue  # the segment [a, b) joins the open unit
        starts += list(range(a, b, size))
    unit_of = torch.searchsorted(torch.tensor(starts), torch.arange(n), right=True) - 1
    heads: list[tuple[int, ...]] = [()] * len(starts)
    if config.selection_unit == "records":
        line_of = torch.searchsorted(torch.tensor(layout.line_starts), torch.tensor(starts), right=True) - 1
        heads = [
            (
                int(unit_of[layout.line_starts[int(line)]]),
                int(unit_of[layout.line_starts[layout.record_of_line[int(line)]]]),
            )
            for line in line_of
        ]
    return Units(starts, n, heads)


def query_scores(layout: Layout, units: Units) -> torch.Tensor:
    """Per unit, the share of the question's rare-word weight it holds (0 for units inside the question). A word's
    weight is its inverse document frequency over the units outside the question; words found nowhere else carry
    none (they cannot tell units apart)."""
    if layout.question is None:
        return torch.zeros(len(units.starts))
    q0, q1 = layout.question
    words: list[set[str]] = [set() for _ in units.starts]
    asked: set[str] = set()
    for m in _WORD.finditer(layout.text):
        token = layout.token_of(m.start())
        word = m[0].lower()  # whole: lines whose keys share a part with the asked one ("upset-harbor") are not lifted
        if q0 <= token < q1:
            asked.add(word)
        words[bisect.bisect_right(units.starts, token) - 1].add(word)
    inside = [units.span(u)[0] < q1 and units.span(u)[1] > q0 for u in range(len(units.starts))]
    outside = [ws for ws, inner in zip(words, inside) if not inner]
    df = Counter(w for ws in outside for w in ws & asked)
    idf = {w: math.log((len(outside) + 1) / (df[w] + 1)) for w in asked if df[w]}
    total = sum(idf.values()) or 1.0
    return torch.tensor(
        [0.0 if inner else sum(idf.get(w, 0.0) for w in ws) / total for ws, inner in zip(words, inside)]
    )


def _by_record(asked: torch.Tensor, units: Units) -> torch.Tensor:
    """Each unit's query share raised to the most any unit of its record holds (the question names a record by its
    key; the value it asks for is in another unit of it). A run over `RECORD_UNITS` units is a list of one-line
    entries or a long paragraph, not one record: there the most any unit of the same line holds."""
    line, record = (torch.tensor([h[i] for h in units.heads], dtype=torch.long) for i in (0, 1))
    size = torch.bincount(record, minlength=len(units.starts))
    group = torch.where(size[record] <= RECORD_UNITS, record, line)
    best = torch.zeros(len(units.starts)).scatter_reduce_(0, group, asked.float(), "amax")
    return torch.maximum(asked.float(), best[group])


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
    if config.query_weight > 0 and layout is not None:
        top, asked = scores.max(), query_scores(layout, units)
        if config.selection_unit == "records":
            asked = _by_record(asked, units)
        scores = (scores / top if top > 0 else scores) + config.query_weight * asked
    kept = torch.zeros(m, dtype=torch.bool)
    for s, e in layout.protected if (config.protect and layout is not None) else ():
        kept[s:e] = True
    size = max(1, config.chunk_size)
    count = int(kept.sum())
    order = torch.sort(scores, descending=True, stable=True).indices.tolist()
    for with_heads in (True, False):  # heads where they fit; a short remainder filled by units alone
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
    return torch.nonzero(kept).flatten().to(importance.device)
