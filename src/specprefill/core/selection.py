"""Importance -> the base's input: the kept chunks (`select`, the one top-k) and the pruned prompt with its position
ids (`prune`, `keep`, `speculate`)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from specprefill.config import AGGREGATIONS as AGGREGATIONS  # explicit re-export: `core.AGGREGATIONS`
from specprefill.config import SpecPrefillConfig
from specprefill.core.scoring import AttentionRules, token_importance
from specprefill.core.units import Layout, select_units
from specprefill.errors import SpecPrefillError


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
