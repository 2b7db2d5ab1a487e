"""The workers' scores of one speculated request, merged: each tensor-parallel rank scored its own query heads
(`combine_ranks`, or `raw_scores` for every head's weights), over the look-ahead steps that ran
(`look_ahead_steps`), into the importance of the speculator's prompt tokens."""

from __future__ import annotations

import torch

from specprefill import core
from specprefill.config import SpecPrefillConfig
from specprefill.errors import SpecPrefillError


def raw_scores(per_rank: list, n_generated: int, look_ahead: int) -> torch.Tensor:
    """One request's unreduced weights from every rank -> [L, H, N, M] fp32 on the CPU: ranks hold consecutive query
    heads (tensor parallel splits them in rank order), steps past the generated ones are cut."""
    parts = [p for p in per_rank if p is not None]
    if not parts:
        raise SpecPrefillError(
            "the workers captured nothing for a request: its attention layers did not run through the hooks "
            "(run the engine with enforce_eager=True)"
        )
    steps = look_ahead_steps(n_generated, look_ahead)
    for p in parts:
        missing = [i for i, row in enumerate(p.get("done") or []) if not all(row[:steps])]
        if missing:
            raise SpecPrefillError(
                f"the workers captured no attention for layer(s) {missing[:5]} of this model (layers that reuse "
                "another layer's KV cache are not hooked): score it with engine hf"
            )
    tensors = [torch.frombuffer(bytearray(p["raw"]), dtype=torch.float32).reshape(p["shape"]) for p in parts]
    return torch.cat(tensors, dim=1)[:, :, :steps]


def combine_ranks(parts: list) -> core.StepScores:
    """Per-rank scores of one request (each rank saw its own heads) -> one StepScores."""
    seen = [core.StepScores.from_wire(p) for p in parts if p is not None]
    if not seen:
        raise SpecPrefillError(
            "the speculator's workers captured nothing for a request: its attention layers did "
            "not run through the hooks (run the speculator with enforce_eager=True)"
        )
    out = seen[0]
    for p in seen[1:]:
        out = out.merge(p)
    return out


def look_ahead_steps(n_generated: int, look_ahead: int) -> int:
    """Queries that count: the last prompt token's, then one per generated token that was fed back (EOS ends it).
    A step a scheduler runs after the request already finished (async scheduling) is not counted."""
    return max(1, min(look_ahead, n_generated))


def importance_from_scores(config: SpecPrefillConfig, n_generated: int, per_rank: list):
    """One speculated request's per-rank scores -> importance of its (speculator) prompt tokens."""
    return combine_ranks(per_rank).importance(look_ahead_steps(n_generated, config.look_ahead), config.step_agg)
