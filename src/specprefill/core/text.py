"""Reading a prompt's text for selection (`core.units`), engine-free: line breaks normalized, a long line laid out as a
pretty-printer would (JSON/XML nesting, list separators, sentence ends in any script), and words as the query signal
counts them (hyphenated keys whole, character pairs in scripts written without spaces, no stopwords)."""

from __future__ import annotations

import functools
import re

WORD = re.compile(r"\w+(?:-\w+)*")  # a hyphenated key ("upset-zephyr") is one word
SENTENCE_END = (".", "!", "?")
FULL_STOPS = ("\u3002", "\uff01", "\uff1f", "\uff1b")  # 。！？； : sentence ends with no space after them
_CJK_CHARS = "\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af\uf900-\ufaff"
CJK = re.compile(f"[{_CJK_CHARS}]")
_CJK_RUN = re.compile(f"[{_CJK_CHARS}]+")
BREAKS = ("\r", "\x85", "\u2028", "\u2029")
# words that tell no unit apart: English function words and the words prompt templates put around questions
STOPWORDS = frozenset(
    """a an the and or but nor not no of in on at to for from by with without about into onto over under between
    among through during before after above below up down out off than then so as if is are was were be been being
    am do does did done have has had having can could shall should will would may might must it its it's this that
    these those there here what which who whom whose when where why how i me my we our you your he him his she her
    they them their any all each every some such only own same other more most very just also too again further once
    question questions answer answers answered context document documents passage passages text texts following
    given based above below please provide provided only using use read reading according
    """.split()
)


def normalize_breaks(text: str) -> str:
    """The text with every line break a `\n` and its length kept (each character stays where it was): `\r\n`
    becomes " \n", a lone `\r`, U+0085, U+2028 and U+2029 become `\n`."""
    if not any(c in text for c in BREAKS):
        return text
    text = text.replace("\r\r\n", "  \n").replace("\r\n", " \n")
    for c in BREAKS:
        text = text.replace(c, "\n")
    return text


MAX_STRING = 512  # characters: a quote with no closing one this far is text, not a string
_TAG = re.compile(r"<(/?)([A-Za-z_][\w:.-]*)[^<>]*?(/?)>")
_LEAF = re.compile(r"<([A-Za-z_][\w:.-]*)[^<>]*>[^<]*</\1\s*>")


_SIGNIFICANT = re.compile(r'["<{}\[\],;.!?\u3002\uff01\uff1f\uff1b]')
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.DOTALL)


@functools.lru_cache(maxsize=64)
def breaks(line: str) -> tuple[tuple[int, int, int], ...]:
    """A long line as a pretty-printer would lay it out: (start, end, depth) pieces. JSON/brackets: a piece after
    each opening bracket, before each closing one, after each comma inside brackets (strings inside brackets
    skipped); XML: each element on its own piece (a leaf element with its text whole); anywhere: after ";" and
    after a sentence's end ("." "!" "?" then a space, or 。！？ in CJK text). Linear in the line's length: the
    characters that can cut are found by one regular expression, a closing tag's place is looked up once per name."""
    cuts: list[tuple[int, int]] = [(0, 0)]  # (start char, depth)
    depth, n = 0, len(line)
    closes: dict[str, int] = {}  # tag name -> where its last closing tag starts

    def cut(at: int, d: int) -> None:
        if at > cuts[-1][0] and at < n:
            cuts.append((at, d))
        elif at == cuts[-1][0]:
            cuts[-1] = (at, d)

    m_at = _SIGNIFICANT.search(line, 0)
    while m_at is not None:
        i = m_at.start()
        c = line[i]
        nxt = i + 1
        if c == '"' and depth > 0:  # a string inside brackets: its commas and brackets are text
            if string := _STRING.match(line, i, min(n, i + MAX_STRING + 1)):
                nxt = string.end()  # an unterminated quote is text: the line's structure goes on after it
        elif c == "<" and (m := _TAG.match(line, i)):
            if m[2] not in closes:
                closes[m[2]] = line.rfind(f"</{m[2]}")
            if m[1] or m[3] or closes[m[2]] >= m.end():
                closing, selfclose = m[1] == "/", m[3] == "/"
                if leaf := (not closing and not selfclose and _LEAF.match(line, i)):
                    cut(i, depth)
                    cut(leaf.end(), depth)
                    nxt = leaf.end()
                elif closing:
                    depth = max(0, depth - 1)
                    cut(i, depth)
                    cut(m.end(), depth)
                    nxt = m.end()
                else:
                    cut(i, depth)
                    depth += 0 if selfclose else 1
                    cut(m.end(), depth)
                    nxt = m.end()
        elif c in "{[":
            cut(i, depth)
            depth += 1
            cut(i + 1, depth)
        elif c in "}]":
            depth = max(0, depth - 1)
            cut(i, depth)
        elif c == "," and depth > 0 or c == ";":
            cut(i + 1, depth)
        elif c in FULL_STOPS or (c in SENTENCE_END and i + 1 < n and line[i + 1] == " "):
            cut(i + 1 + (c in SENTENCE_END), depth)
        m_at = _SIGNIFICANT.search(line, nxt)
    ends = [a for a, _ in cuts[1:]] + [n]
    return tuple((a, b, d) for (a, d), b in zip(cuts, ends) if b > a)


def words_of(text: str) -> list[tuple[int, str]]:
    """(first character, word) of each word, lowercased: a run of letters/digits (hyphenated keys whole); in scripts
    written without spaces (Han, kana, Hangul runs), each pair of neighbouring characters (a character alone when
    it has no neighbour), the word unit search engines use there."""
    out = []
    for m in WORD.finditer(text):
        word, at = m[0].lower(), m.start()
        if not CJK.search(word):
            out.append((at, word))
            continue
        for part in re.finditer(r"[^\W_]+", word):  # letters and digits, split at hyphens
            piece, start = part[0], at + part.start()
            runs = [(r.start(), r[0]) for r in _CJK_RUN.finditer(piece)]
            last = 0
            for r0, run in runs:
                if r0 > last:
                    out.append((start + last, piece[last:r0]))
                out += [(start + r0 + k, run[k : k + 2]) for k in range(max(1, len(run) - 1))]
                last = r0 + len(run)
            if last < len(piece):
                out.append((start + last, piece[last:]))
    return out
