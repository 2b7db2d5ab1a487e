"""Importance between two tokenizations of one text: a base token takes the importance of the speculator tokens
whose characters it overlaps (`project_importance`)."""

from __future__ import annotations

import math

import torch

from specprefill.config import AGGREGATIONS as AGGREGATIONS  # explicit re-export: `core.AGGREGATIONS`
from specprefill.errors import SpecPrefillError


def span_overlaps(spans_a: torch.Tensor, spans_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """All pairs (i, j) with spans_a[i] and spans_b[j] sharing a character: spans [n, 2] of (start, end), each
    sequence in text order; empty spans overlap nothing. Found per span of `a` by binary search, O(n log n)."""
    a, b = spans_a.long().reshape(-1, 2), spans_b.long().reshape(-1, 2)
    b_live = torch.nonzero(b[:, 1] > b[:, 0]).flatten()
    lb = b[b_live]
    if lb.numel() and not (bool((lb[1:, 0] >= lb[:-1, 0]).all()) and bool((lb[1:, 1] >= lb[:-1, 1]).all())):
        raise ValueError("token spans must be in text order")
    lo = torch.searchsorted(lb[:, 1].contiguous(), a[:, 0].contiguous(), right=True)  # first with end > start_a
    hi = torch.searchsorted(lb[:, 0].contiguous(), a[:, 1].contiguous(), right=False)  # first with start >= end_a
    counts = torch.where(a[:, 1] > a[:, 0], (hi - lo).clamp(min=0), torch.zeros_like(lo))
    rows = torch.repeat_interleave(torch.arange(a.shape[0]), counts)
    starts = torch.repeat_interleave(lo, counts)
    offsets = torch.arange(int(counts.sum())) - torch.repeat_interleave(torch.cumsum(counts, 0) - counts, counts)
    return rows, b_live[starts + offsets]


def fill_gaps(values: torch.Tensor) -> torch.Tensor:
    """NaN entries take the nearest value on their left (at the start: on their right)."""
    idx = torch.arange(values.numel())
    known = ~torch.isnan(values)
    if not bool(known.any()):
        raise SpecPrefillError(
            "no base token overlaps any speculator token: the two tokenizations cover different "
            "text (check that both models read the same prompt)"
        )
    left = torch.cummax(torch.where(known, idx, torch.full_like(idx, -1)), 0).values
    first = int(idx[known][0])
    return values[torch.where(left >= 0, left, torch.full_like(left, first))]


def project_importance(
    importance: torch.Tensor, spec_spans: torch.Tensor, base_spans: torch.Tensor, agg: str = "max"
) -> torch.Tensor:
    """Speculator-token importance -> base-token importance through character spans of one text: each base token
    takes the max (or mean) of the speculator tokens whose characters overlap it. Base tokens that overlap none
    (special tokens, text only one side has) take their nearest left neighbour's value."""
    if agg not in AGGREGATIONS:
        raise SpecPrefillError(f"cross_token_agg {agg!r} is unknown: use one of {', '.join(AGGREGATIONS)}")
    if importance.shape[-1] != spec_spans.shape[0]:
        raise ValueError(f"{importance.shape[-1]} scores for {spec_spans.shape[0]} speculator spans")
    base, spec = span_overlaps(base_spans, spec_spans)
    out = torch.full((base_spans.shape[0],), math.nan)
    out.scatter_reduce_(
        0, base, importance.float()[spec], reduce="amax" if agg == "max" else "mean", include_self=False
    )
    return fill_gaps(out)
