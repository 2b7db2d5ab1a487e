"""What a score selects when the selection follows the prompt's structure (`selection_unit` "lines" or "records"):
a prompt's `Layout` and its `Units`; the query signal is `core.query`, the budget and protection `core.selection`,
the original's fixed chunks `selection.select`.

A `Layout` is one prompt's text, each token's character span in it, the token ranges always kept (`protected`, then
`context`), the request's tokens (`questions`) and what the query reads. From it:
- units: runs of at most `chunk_size` tokens that start where a line or a sentence starts (a longer line is cut
  every `chunk_size` tokens), and never straddle the start of a record;
- records: a line's record starts at the first line of its run of sibling lines (same indentation, deeper lines
  in between, no blank line) - a paragraph's first line, a JSON object's first field - or, for an indented run
  under a line that names something ("Crate 4:" above its fields), at that line. Under "records" a kept unit brings
  the first unit of its line and of its record, where the key of what it holds usually is; of a run over
  `RECORD_UNITS` units of sibling lines (a list of one-line entries: log lines, CSV rows), its first line only when
  it is a header (`_names_columns`: field names over values), not the list's first entry."""

from __future__ import annotations

import bisect
import csv
import functools
import re
from collections import Counter
from dataclasses import dataclass
from functools import cached_property
from typing import Any, cast

import numpy as np
import torch

from specprefill.config import SpecPrefillConfig
from specprefill.core.text import (
    BREAKS,
    FULL_STOPS,
    SENTENCE_END,
    WORD,
    breaks,
    normalize_breaks,
)
from specprefill.errors import SpecPrefillError

RECORD_UNITS = 8  # the most units a record spans for the query signal to lift all of it
_SENTENCE_CODES = np.array([ord(c) for c in SENTENCE_END], dtype=np.uint32)
_FULL_STOP_CODES = np.array([ord(c) for c in FULL_STOPS], dtype=np.uint32)
_HEADING = re.compile(r"^ {0,3}(?:#{1,6}[ \t]|(?:=+|-+)[ \t]*$)", re.MULTILINE)  # markdown-it decides
_HEADING_OR_FENCE = re.compile(r" {0,3}(?:#{1,6}(?:[ \t]|$)|=+[ \t]*$|-+[ \t]*$|```|~~~)")
_SPACE_CODES = np.array([c for c in range(0x3001) if chr(c).isspace()], dtype=np.uint32)
DELIMITERS = ",;\t|"  # what a run of rows may be delimited by (`_names_columns`)
LONG_LINE = 256  # characters: a line longer than this is cut where its structure breaks (`text.breaks`)


@dataclass(frozen=True)
class Layout:
    """One prompt's structure: its text, each token's (start, end) in it, token ranges [start, end) always kept,
    and the question's token range (None: no question known)."""

    text: str
    spans: tuple[tuple[int, int], ...]
    protected: tuple[tuple[int, int], ...] = ()
    questions: tuple[tuple[int, int], ...] = ()
    query: tuple[tuple[int, int], ...] = ()  # what the query signal reads (default: the questions)
    context: tuple[tuple[int, int], ...] = ()  # kept after the other protected spans: earlier turns, instructions

    def __post_init__(self) -> None:
        n = len(self.spans)
        for s, e in (*self.protected, *self.questions, *self.query, *self.context):
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
        """Tokens that start with white space right after a token ending a sentence (".", "!" or "?"), or right after
        a token ending with a full stop of a script written without spaces (。！？；); vectorized over the text."""
        n = len(self.spans)
        if n < 2:
            return []
        code = np.frombuffer(self.text.encode("utf-32-le"), dtype=np.uint32)
        first, end = np.asarray(self._starts_np), np.asarray(self._ends, dtype=np.int64)
        index = np.arange(len(code))
        # per character: the last character at or before it that is no space or tab
        solid = np.maximum.accumulate(np.where((code == 32) | (code == 9), -1, index)) if len(code) else index
        last = solid[np.clip(end - 1, 0, max(0, len(code) - 1))] if len(code) else np.full(n, -1)
        valid = (end > first) & (last >= first)
        tail = code[np.clip(last, 0, max(0, len(code) - 1))] if len(code) else np.zeros(n, dtype=np.uint32)
        ends_sentence = valid & np.isin(tail, _SENTENCE_CODES)
        full_stop = valid & np.isin(tail, _FULL_STOP_CODES)
        spaced = np.isin(code[np.clip(first, 0, max(0, len(code) - 1))], _SPACE_CODES) & (first < len(code))
        hit = (spaced[1:] & ends_sentence[:-1]) | full_stop[:-1]
        out: list[int] = (np.nonzero(hit)[0] + 1).tolist()
        return out

    def token_of(self, char: int) -> int:
        """The token holding character `char` (the last token for a character past the end)."""
        return min(bisect.bisect_right(self._ends, char), len(self.spans) - 1)

    @cached_property
    def _ends(self) -> list[int]:
        return [e for _, e in self.spans]

    @cached_property
    def _starts_np(self) -> np.ndarray:
        starts: np.ndarray = np.array([s for s, _ in self.spans], dtype=np.int64).reshape(-1)
        return starts

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
    def _sections(self) -> list[tuple[int, int]]:
        """Markdown sections as [first, end) ranges of `_virtual` lines: each heading's (ATX or setext, as
        markdown-it's block parser reads them, fenced and indented code aside) up to the next heading of its level or
        above."""
        if not _HEADING.search(self.text):
            return []
        tokens: list[Any] = []
        md = _markdown()
        skeleton, where = _skeleton(self.text)
        md.block.parse(skeleton, md, {}, tokens)
        first: list[int] = []  # text line -> its first virtual line
        for j, (a, _, _) in enumerate(self._virtual):
            if a == 0 or self.text[a - 1] == "\n":
                first.append(j)
        heads = [(int(t.tag[1]), where[t.map[0]]) for t in tokens if t.type == "heading_open" and t.map]
        out = []
        for k, (level, line) in enumerate(heads):
            stop = next((at for lv, at in heads[k + 1 :] if lv <= level), len(first))
            if line < len(first):
                out.append((first[line], first[stop] if stop < len(first) else len(self._virtual)))
        return out

    @cached_property
    def record_of_line(self) -> list[int]:
        """For each line (index into `line_starts`), the line its record starts at (read in characters, so a blank
        line inside one token still separates records); in a markdown section, the section's heading for its
        unindented runs."""
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
        for h, e in self._sections:  # a heading owns its section: the runs under it, blank lines aside
            for j in range(h + 1, e):
                if self._virtual[heads_at[j]][2] == 0:
                    heads_at[j] = h
        where = {t: i for i, t in enumerate(self.line_starts)}
        out: list[int] = []
        for t in self.line_starts:
            at = content.get(t)
            # a token holding only blank lines belongs to the record before it
            out.append(where[tokens[heads_at[at]]] if at is not None else (out[-1] if out else 0))
        return out


@functools.cache
def _markdown() -> Any:
    """markdown-it's block parser with the rules that decide where headings are: headings, fences, indented code."""
    from markdown_it import MarkdownIt  # lazy: only a text with a heading

    return MarkdownIt("zero").enable(["heading", "lheading", "fence", "code"])


def _skeleton(text: str) -> tuple[str, list[int]]:
    """The text as markdown's block structure sees its headings, and each skeleton line's text line: heading and
    fence lines as they are, every other line its indentation (up to 4 columns: indented code) and one character, a
    blank line blank; a run of equal such lines kept as its first and last (a paragraph, a code block or a gap reads
    the same at any length). The parser then reads a few characters per run of lines instead of every character."""
    out: list[str] = []
    where: list[int] = []
    for i, line in enumerate(text.split("\n")):
        if _HEADING_OR_FENCE.match(line):
            out.append(line)
            where.append(i)
            continue
        plain = line[: min(4, len(line) - len(line.lstrip()))] + "x" if line.strip() else ""
        if len(out) > 1 and out[-1] == out[-2] == plain:
            where[-1] = i  # the run's last line so far
        else:
            out.append(plain)
            where.append(i)
    return "\n".join(out), where


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
        sizes = np.diff(np.array([*self.starts, self.n], dtype=np.int64))
        return torch.from_numpy(np.repeat(np.arange(len(self.starts), dtype=np.int64), sizes))


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
    hard = set(record_lines) | {s for r in (*layout.protected, *layout.context, *layout.questions) for s in r if s < n}
    bounds = sorted(set(layout.line_starts) | set(layout.sentence_starts) | hard | {0}) + [n]
    starts: list[int] = []
    for a, b in zip(bounds, bounds[1:]):
        if starts and a not in hard and b - starts[-1] <= size:
            continue  # the segment [a, b) joins the open unit
        starts += list(range(a, b, size))
    unit_of = cast(list[int], (np.searchsorted(np.array(starts), np.arange(n), side="right") - 1).tolist())
    heads: list[tuple[int, ...]] = [()] * len(starts)
    if config.selection_unit == "records":
        line_of = cast(
            list[int], (np.searchsorted(np.array(layout.line_starts), np.array(starts), side="right") - 1).tolist()
        )
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


def _names_columns(layout: Layout, line: int, look: int = 8) -> bool:
    """Whether line `line` (index into `Layout.line_starts`), the first of a long run of sibling lines, is the run's
    header rather than its first entry: a markdown table's header row (markdown-it); where the run reads as delimited
    rows (the csv module's sniffer finds one
    delimiter in the `look` lines after it), its header test (a first row whose cells differ in kind or length from
    the rows below); else field names over values (no digit in it, digits in the lines after it)."""
    at = [layout.spans[t][0] for t in layout.line_starts[line : line + look + 2]] + [len(layout.text)] * (look + 2)
    first, after = layout.text[at[0] : at[1]], layout.text[at[1] : at[look + 1]]
    sample = layout.text[at[0] : at[look + 1]]
    if sample.lstrip().startswith("|"):  # a markdown table: markdown-it reads its header row
        from markdown_it import MarkdownIt  # lazy: only a run that may be a table

        return any(t.type == "thead_open" for t in MarkdownIt("zero").enable("table").parse(sample.strip()))
    try:
        if not _may_be_delimited(sample, DELIMITERS):
            raise csv.Error("no delimiter")  # what the sniffer would find, in a fraction of its time
        csv.Sniffer().sniff(sample, delimiters=DELIMITERS)
        return csv.Sniffer().has_header(sample)
    except csv.Error:  # no delimiter reads the run as rows: log lines, prose, one-line entries
        return not any(c.isdigit() for c in first) and any(c.isdigit() for c in after)


def _may_be_delimited(sample: str, delimiters: str) -> bool:
    """Whether the csv module's sniffer can find a delimiter in `sample` (a necessary condition): a quote character
    (its quoted-field reading), or one of `delimiters` on at least 90% of the non-empty lines (its consistency
    threshold: the delimiter's usual count, above 0, on that share of the rows). Else `sniff` raises csv.Error, after
    counting every ASCII character on every line (~1 ms per run of rows)."""
    if '"' in sample or "'" in sample:
        return True
    lines = [line for line in sample.split("\n") if line]
    return any(sum(d in line for line in lines) >= 0.9 * len(lines) for d in delimiters)
