"""Importance -> the base's input: the kept chunks (`select`, the one top-k) or the kept units (`select_units`, the
structured rule over a `units.Layout`), and the pruned prompt with its position ids (`prune`, `keep`, `speculate`).

`select_units`' budget: ceil(M x keep_rate) tokens, protected ones included, within one unit; the protected spans take
at most `protect_share` of it (template markers, then the requests, then the other protected spans, then the
context: earlier turns, instructions; each span from its end; logged once when the cap binds). A request asked
before most of the document (`asked_first`: the base reads it far from where it answers) that names one record alone
(`query._names_one`; under "records", with the query signal and protection: the record holds at least `NAMED` of its
weighted words) keeps that record (and those within `NEAR` of it) and the protected spans only, within the budget
and usually far under it (what the protection cap cut of the requests comes back in what the document left): there
the speculator's other picks are its answer candidates, and the base, given the named record among a few of them,
answers with one of those (docs/measurements.md, "Selection on document shapes"). Where names are shared by several
records, or the matched record only names (its values elsewhere), the speculator's scores decide."""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from specprefill.config import AGGREGATIONS as AGGREGATIONS  # explicit re-export: `core.AGGREGATIONS`
from specprefill.config import SpecPrefillConfig
from specprefill.core.query import (
    NAMED,
    NEAR,
    _by_record,
    _names_one,
    best_named,
    lookalikes,
    matches,
    query_scores,
)
from specprefill.core.scoring import AttentionRules, token_importance
from specprefill.core.units import Layout, Units, cut
from specprefill.errors import SpecPrefillError

MARKER_TOKENS = 16  # a protected span this short is a template marker: kept before the questions
log = logging.getLogger("specprefill")
_cap_logged = False


def n_to_keep(n: int, keep_rate: float) -> int:
    """ceil(n * keep_rate), robust to float noise (0.7 * 10 keeps 7, not 8), at least 1."""
    return max(1, min(n, math.ceil(n * keep_rate - 1e-9)))


def top_k_indices(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k highest scores; ties go to the lower index."""
    order = torch.sort(scores, descending=True, stable=True).indices
    return order[:k]


def select(importance: torch.Tensor, config: SpecPrefillConfig, layout: Layout | None = None) -> torch.Tensor:
    """Sorted indices (int64) of the prompt tokens the base model receives: the original's top chunks, or (units
    "lines"/"records", protected spans, the query signal) `units.select_units` over the prompt's `layout`."""
    m = importance.shape[-1]
    if m == 0:
        raise SpecPrefillError("the prompt is empty: give at least one token")
    if config.needs_layout:
        if layout is None:
            raise SpecPrefillError(
                "this selection (selection_unit, protect, query_weight) reads the prompt's text: pass its core.Layout "
                "(`specprefill.structure.layout`), or select with selection_unit=chunks, protect off, query_weight 0"
            )
        return select_units(importance, config, layout, n_to_keep(m, config.keep_rate))
    size = config.chunk_size if config.chunk_size > 0 else 1
    n_chunks = -(-m // size)
    if size == 1:
        chunk_scores = importance.float().clone()
    else:
        padded = F.pad(importance.float(), (0, n_chunks * size - m))
        counts = torch.full((n_chunks,), float(size), device=importance.device)
        counts[-1] = m - (n_chunks - 1) * size  # the last chunk may be partial: mean over its real tokens
        chunk_scores = padded.reshape(n_chunks, size).sum(-1) / counts
    chunks = torch.sort(top_k_indices(chunk_scores, n_to_keep(n_chunks, config.keep_rate))).values
    if size == 1:
        return chunks.long()
    kept = (chunks[:, None] * size + torch.arange(size, device=chunks.device)[None, :]).flatten()
    return kept[kept < m].long()


@dataclass
class PrunedPrompt:
    """What the base model receives for one prompt."""

    token_ids: list[int]  # kept prompt tokens, in original order
    positions: list[int]  # their position ids
    kept_indices: list[int]  # original indices of the kept tokens
    n_original: int  # M, the original prompt length
    next_position: int  # position id of the first generated token
    importance: list[float] = field(default_factory=list)

    def decode_position(self, step: int) -> int:
        """Position id of the generated token number `step` (0 = first generated token)."""
        return self.next_position + step


@dataclass(frozen=True)
class RowSpan:
    """One pruned request's rows in an engine step: `count` rows from row `row`, at cache positions `cache_start`,
    `cache_start + 1`, ...; `kept` (host int64) its kept original indices, `n_original` its prompt length M."""

    row: int
    count: int
    cache_start: int
    kept: torch.Tensor
    n_original: int


def remap_rows(spans: Sequence[RowSpan]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Engine cache index -> RoPE position for every row of one step's pruned requests at once, on the host:
    p < K -> kept[p] (a prompt token), p >= K (generated) -> p + (M - K). Returns (rows, cache positions, positions),
    int64. One vector op covers every row; a request whose rows are still in its prompt (a prefill chunk) adds one
    slice, a decoding request nothing."""
    counts = torch.tensor([s.count for s in spans], dtype=torch.int64)
    k = torch.tensor([s.kept.shape[0] for s in spans], dtype=torch.int64)
    which = torch.repeat_interleave(torch.arange(len(spans)), counts)
    first = torch.cumsum(counts, 0) - counts
    offset = torch.arange(int(counts.sum())) - first[which]
    rows = torch.tensor([s.row for s in spans], dtype=torch.int64)[which] + offset
    cache = torch.tensor([s.cache_start for s in spans], dtype=torch.int64)[which] + offset
    shift = torch.tensor([s.n_original for s in spans], dtype=torch.int64) - k
    out = cache + shift[which]
    for i, span in enumerate(spans):
        end = min(span.cache_start + span.count, span.kept.shape[0])
        if span.cache_start < end:
            at = int(first[i])
            out[at : at + end - span.cache_start] = span.kept[span.cache_start : end]
    return rows, cache, out


def prune(
    token_ids: Sequence[int],
    kept: torch.Tensor | Sequence[int],
    config: SpecPrefillConfig,
    importance: torch.Tensor | None = None,
) -> PrunedPrompt:
    """Build the base model's input: kept tokens with original (or contiguous) positions."""
    kept = kept.tolist() if isinstance(kept, torch.Tensor) else [int(i) for i in kept]  # one copy off a GPU
    m = len(token_ids)
    if config.restore_positions:
        positions, next_position = kept, m
    else:
        positions, next_position = list(range(len(kept))), len(kept)
    return PrunedPrompt(
        token_ids=[int(token_ids[i]) for i in kept],
        positions=positions,
        kept_indices=kept,
        n_original=m,
        next_position=next_position,
        importance=[] if importance is None else importance.float().tolist(),
    )


def speculate(
    token_ids: Sequence[int],
    queries: torch.Tensor,
    keys: torch.Tensor,
    config: SpecPrefillConfig,
    rules: Sequence[AttentionRules] | None = None,
    layout: Layout | None = None,
) -> PrunedPrompt:
    """One prompt: captured q/k (and each layer's attention rules) -> importance -> selection -> base input."""
    if keys.shape[2] != len(token_ids):
        raise ValueError(f"keys cover {keys.shape[2]} tokens but the prompt has {len(token_ids)}")
    return keep(token_ids, token_importance(queries, keys, config, rules), config, layout)


def keep(
    token_ids: Sequence[int], importance: torch.Tensor, config: SpecPrefillConfig, layout: Layout | None = None
) -> PrunedPrompt:
    """Importance over the prompt -> the selected units -> the base's input: the one select-and-prune step every
    engine takes (`tokenmap.Speculation.prune`, after moving a cross-tokenizer speculator's importance)."""
    return prune(token_ids, select(importance, config, layout), config, importance)


def _order(
    scores: torch.Tensor, config: SpecPrefillConfig, layout: Layout | None, units: Units, m: int
) -> tuple[list[int], Units, bool]:
    """The units in the order they are kept, the units with their key units as heads (under "records" with the query
    signal), and whether the question-first rule keeps the named records alone."""
    if not (config.query_weight > 0 and layout is not None and layout.questions):
        return torch.sort(scores, descending=True, stable=True).indices.tolist(), units, False
    found = matches(layout, units)
    top, asked = scores.max(), query_scores(layout, units, found)
    named = group = None  # under "records": each unit's record's share of the question's words, and its record
    if config.selection_unit == "records":
        asked, keys, group = _by_record(asked, units)
        named = asked
        units = Units(units.starts, units.n, [h if k is None else (*h, k) for h, k in zip(units.heads, keys)])
    scores = (scores / top if top > 0 else scores) + config.query_weight * asked
    order = torch.sort(scores, descending=True, stable=True).indices.tolist()
    if named is None or group is None or not config.protect:
        return order, units, False
    best = float(named.max())
    if best >= NAMED and asked_first(layout, m) and _names_one(layout, units, found, named, group):
        # the named records alone (the speculator's other picks left out): usually far under budget
        wanted = set(torch.nonzero(named >= NEAR * best).flatten().tolist())
        return [u for u in order if u in wanted], units, True
    # the record each sentence names best first, whatever the speculator attends to; records that match a part of
    # its words by the speculator's scores alone
    first = best_named(found, group)
    alike = lookalikes(found, group, first)
    if alike:
        scores[alike] -= config.query_weight * named[alike]
        order = torch.sort(scores, descending=True, stable=True).indices.tolist()
    return first + [u for u in order if u not in set(first)], units, False


def asked_first(layout: Layout, m: int) -> bool:
    """Whether the questions come before most of the document (its tokens outside protected spans and questions):
    asked first, in the system message or above the document, with no question after it."""
    if not layout.questions:
        return False
    document = torch.ones(m, dtype=torch.bool)
    for s, e in (*layout.protected, *layout.context, *layout.questions):
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
    ranges = [*markers, *sorted(layout.questions, key=lambda r: -r[0]), *rest, *layout.context]
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
    order, units, named_only = _order(scores, config, layout, units, m)
    kept = protect(layout, config, budget, m) if config.protect and layout is not None else torch.zeros(m, dtype=bool)
    size = max(1, config.chunk_size)
    count = n_protected = int(kept.sum())
    flags = kept.numpy()  # the same memory: numpy's small slices cost a fraction of torch's per unit
    for with_heads in (True, False):  # heads where they fit; a short remainder filled by units alone
        if named_only and not with_heads and count > n_protected:
            break  # named records kept whole: no fragments of them
        for u in order:
            if count >= budget:
                break
            spans = [units.span(v) for v in dict.fromkeys((u, *units.heads[u]) if with_heads else (u,))]
            new = sum(e - s - int(flags[s:e].sum()) for s, e in spans)
            if new == 0 or (with_heads and count + new > budget + size):
                continue
            for s, e in spans:
                flags[s:e] = True
            count += new
    if named_only and layout is not None:  # the budget left: what the protection cap cut, the questions first
        have = kept.tolist()
        missing = [
            i
            for s, e in (*layout.questions, *layout.protected, *layout.context)
            for i in range(e - 1, s - 1, -1)
            if not have[i]
        ]
        kept[list(dict.fromkeys(missing))[: max(0, budget - count)]] = True
    return torch.nonzero(kept).flatten().to(importance.device)
