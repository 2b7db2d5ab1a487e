"""Attention scores -> per-token importance: a speculator's captured queries and keys of one prompt, one layer at
a time, pooled and combined over heads, layers and look-ahead steps (`token_importance`, `ScoreCache`)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from specprefill.config import AGGREGATIONS as AGGREGATIONS  # explicit re-export: `core.AGGREGATIONS`
from specprefill.config import HeadSet, SpecPrefillConfig, parse_score_heads
from specprefill.errors import SpecPrefillError


def check_shapes(queries: torch.Tensor, keys: torch.Tensor) -> None:
    if queries.dim() != 4 or keys.dim() != 4:
        raise ValueError(
            f"expected queries [L,H,N,D] and keys [L,KV,M,D], got {tuple(queries.shape)} and {tuple(keys.shape)}"
        )
    n_layers, n_heads, _, dim = queries.shape
    if keys.shape[0] != n_layers or keys.shape[3] != dim or n_heads % keys.shape[1] != 0:
        raise ValueError(f"queries {tuple(queries.shape)} and keys {tuple(keys.shape)} do not match")


@dataclass(frozen=True)
class AttentionRules:
    """How one attention layer turns q.k into weights, read from the model (vLLM's `Attention.impl`, the arguments a
    transformers model hands its attention function), never derived from the family's name.

    scale: logits = q.k * scale (None: 1/sqrt(D)); soft_cap: logits -> soft_cap * tanh(logits / soft_cap) (Gemma-2);
    window: a query at position p sees only keys at positions j with p - j < window (sliding-window layers), so a
    token outside a layer's window gets no score from that layer."""

    scale: float | None = None
    soft_cap: float | None = None
    window: int | None = None

    @classmethod
    def of(cls, scale: float | None = None, soft_cap: float | None = None, window: int | None = None) -> AttentionRules:
        """From engine values where 0, -1 or None mean "none" (vLLM's CPU impl stores no window as -1)."""
        return cls(
            float(scale) if scale is not None else None,
            float(soft_cap) if soft_cap else None,
            int(window) if window is not None and window > 0 else None,
        )


DEFAULT_RULES = AttentionRules()
# Keys are scored this many prompt tokens at a time, so no fp32 copy of a whole layer's keys [KV, M, D] ever exists
# (the temporaries are one [G, n, M] block of logits per key head, plus one chunk of keys).
SCORE_CHUNK = 4096


def group_logits(
    queries: torch.Tensor, keys: torch.Tensor, rules: AttentionRules, first_position: int, chunk: int = SCORE_CHUNK
) -> torch.Tensor:
    """Logits [G, n, M] fp32 of queries [G, n, D] (the heads sharing one key head) against keys [M, D], the keys
    converted to fp32 one chunk of `chunk` tokens at a time; query i sits at position first_position + i. Masked
    (sliding window) entries are -inf."""
    g, n, dim = queries.shape
    m = keys.shape[0]
    scale = rules.scale if rules.scale is not None else 1 / math.sqrt(dim)
    q = queries.float() * scale
    out = torch.empty(g, n, m, dtype=torch.float32, device=queries.device)
    for start in range(0, m, chunk):
        end = min(m, start + chunk)
        torch.matmul(q, keys[start:end].float().T, out=out[:, :, start:end])
    if rules.soft_cap is not None:
        out.div_(rules.soft_cap).tanh_().mul_(rules.soft_cap)
    if rules.window is not None:
        q_pos = torch.arange(first_position, first_position + n, device=out.device)[:, None]
        k_pos = torch.arange(m, device=out.device)[None, :]
        out.masked_fill_(q_pos - k_pos >= rules.window, -math.inf)
    return out


def group_probs(queries: torch.Tensor, keys: torch.Tensor, rules: AttentionRules, first_position: int) -> torch.Tensor:
    """Softmax over the prompt keys of `group_logits`; a query that sees no prompt key (past a sliding window) gives
    none a score (zeros, not NaN)."""
    probs = group_logits(queries, keys, rules, first_position).softmax(-1)
    return probs.nan_to_num_(0.0) if rules.window is not None else probs


def attention_scores(
    queries: torch.Tensor,
    keys: torch.Tensor,
    rules: Sequence[AttentionRules] | None = None,
    first_position: int | None = None,
) -> torch.Tensor:
    """Attention weights over the prompt keys, fp32: queries [L,H,N,D], keys [L,KV,M,D] -> [L,H,N,M]. `rules`: one
    per layer (default 1/sqrt(D), no cap, no window); the queries sit at positions first_position.. (default M-1:
    the last prompt token, then the look-ahead tokens)."""
    check_shapes(queries, keys)
    n_layers = queries.shape[0]
    return torch.stack(
        [
            head_scores(queries[layer], keys[layer], rule, first_position).cpu()
            for layer, rule in enumerate(rules_of(rules, n_layers))
        ]
    )


def head_scores(
    queries: torch.Tensor, keys: torch.Tensor, rules: AttentionRules | None = None, first_position: int | None = None
) -> torch.Tensor:
    """One layer, every head kept: queries [H,n,D], keys [KV,M,D] -> attention weights [H,n,M] fp32 (query head h
    uses key head h // (H/KV)); queries at positions first_position.. (default M-1)."""
    n_heads, n, _ = queries.shape
    n_kv, m = keys.shape[0], keys.shape[1]
    group = n_heads // n_kv
    first = m - 1 if first_position is None else first_position
    rules = rules or DEFAULT_RULES
    out = torch.empty(n_heads, n, m, device=queries.device)
    for kv in range(n_kv):
        out[kv * group : (kv + 1) * group] = group_probs(queries[kv * group : (kv + 1) * group], keys[kv], rules, first)
    return out


def pool(scores: torch.Tensor, kernel: int) -> torch.Tensor:
    """Average pooling along the last (prompt) axis, stride 1, zero padding kernel//2 counted in the mean."""
    if kernel <= 1:
        return scores
    flat = scores.reshape(-1, 1, scores.shape[-1])
    out = F.avg_pool1d(flat, kernel_size=kernel, stride=1, padding=kernel // 2, count_include_pad=True)
    return out.reshape(scores.shape)


def reduce_heads(scores: torch.Tensor, layer_head_agg: str) -> torch.Tensor:
    """[H,n,M] -> [n,M]: max over heads, or their sum (divided by the head count later, in `StepScores`)."""
    return scores.amax(0) if layer_head_agg == "max" else scores.sum(0)


def head_set(spec: str, n_layers: int, n_heads: int) -> HeadSet | None:
    """`parse_score_heads`, checked against a model of n_layers x n_heads (query heads)."""
    heads = parse_score_heads(spec)
    if heads is None:
        return None
    bad = [f"{layer}" for layer in heads if layer >= n_layers] + [
        f"{layer}.{h}" for layer, hs in heads.items() for h in hs or () if h >= n_heads
    ]
    if bad:
        raise SpecPrefillError(
            f"score_heads {spec!r} names {', '.join(bad[:4])}, outside the speculator's {n_layers} layers x "
            f"{n_heads} heads: name layers 0-{n_layers - 1} and heads 0-{n_heads - 1}"
        )
    return heads


def layer_scores(
    queries: torch.Tensor,
    keys: torch.Tensor,
    pool_kernel: int,
    layer_head_agg: str,
    rules: AttentionRules = DEFAULT_RULES,
    first_position: int | None = None,
    heads: Sequence[int] | None = None,
) -> torch.Tensor:
    """One layer, reduced over its heads: queries [H,n,D], keys [KV,M,D] -> [n,M] fp32 (max, or sum for "mean").
    Queries at positions first_position.. (default M-1). `heads`: only these query heads (indices into H) are
    scored; default all.

    Memory, besides the [n, M] result: one key head's group of logits [H/KV, n, M] fp32 and its pooled copy, and one
    fp32 chunk of keys [SCORE_CHUNK, D] - never a whole layer's [H, n, M] or an fp32 copy of [KV, M, D]. This is what
    a worker computes as each attention layer runs (`score_temporaries` counts it)."""
    n_heads, n, _ = queries.shape
    n_kv, m = keys.shape[0], keys.shape[1]
    group = n_heads // n_kv
    first = m - 1 if first_position is None else first_position
    wanted = set(range(n_heads)) if heads is None else set(heads)
    out: torch.Tensor | None = None
    for kv in range(n_kv):
        mine = [h for h in range(kv * group, (kv + 1) * group) if h in wanted]
        if not mine:
            continue
        group_queries = queries[mine] if len(mine) < group else queries[kv * group : (kv + 1) * group]
        probs = group_probs(group_queries, keys[kv], rules, first)
        probs = reduce_heads(pool(probs, pool_kernel), layer_head_agg)
        if out is None:
            out = probs
        elif layer_head_agg == "max":
            torch.maximum(out, probs, out=out)
        else:
            out.add_(probs)
    if out is None:
        raise ValueError(f"no head of {sorted(wanted)} among this layer's {n_heads}")
    return out


def score_temporaries(n_heads: int, n_kv: int, n: int, m: int, dim: int, pool_kernel: int) -> int:
    """Bytes `layer_scores` holds at its peak besides its inputs: logits of one key head's queries, their softmax
    and pooled copies, the fp32 queries, one fp32 key chunk and the running [n, M] result."""
    group = n_heads // n_kv
    copies = 3 if pool_kernel > 1 else 2
    return 4 * (copies * group * n * m + group * n * dim + min(m, SCORE_CHUNK) * dim + 2 * n * m)


@dataclass
class StepScores:
    """Running reduction over layers x heads for the N look-ahead steps of one prompt (or one rank's heads of it).

    `reduced` [N, M]: running max (layer_head_agg "max") or sum ("mean"); `count` [N]: heads folded in per step;
    `done` [L, N]: which (layer, step) pairs are in, so a step recomputed after a preemption is not counted twice.
    Ranks of a tensor-parallel model each hold their own heads and are merged with `merge`."""

    reduced: torch.Tensor
    count: torch.Tensor
    done: torch.Tensor
    layer_head_agg: str = "max"

    @classmethod
    def empty(
        cls, n_layers: int, steps: int, m: int, layer_head_agg: str = "max", device: torch.device | str | None = None
    ) -> StepScores:
        """`reduced` on `device` (the model's); the bookkeeping (`count`, `done`) on the CPU, so folding a layer in
        never waits for the device."""
        fill = -math.inf if layer_head_agg == "max" else 0.0
        return cls(
            torch.full((steps, m), fill, device=device),
            torch.zeros(steps, dtype=torch.int64),
            torch.zeros(n_layers, steps, dtype=torch.bool),
            layer_head_agg,
        )

    def add(self, layer: int, first_step: int, scores: torch.Tensor, heads: int) -> None:
        """Fold one layer's head-reduced scores [n, M] for steps first_step .. first_step+n-1."""
        end = first_step + scores.shape[0]
        new = ~self.done[layer, first_step:end]
        if not bool(new.any()):
            return
        if bool(new.all()):
            rows: slice | torch.Tensor = slice(first_step, end)
        else:  # a step recomputed after a preemption: only the ones not yet in
            rows = torch.nonzero(new).flatten() + first_step
            scores = scores[rows.to(scores.device) - first_step]
        target = self.reduced[rows]
        if self.layer_head_agg == "max":
            self.reduced[rows] = torch.maximum(target, scores.float())
        else:
            self.reduced[rows] = target + scores.float()
        self.count[rows] += heads
        self.done[layer, rows] = True

    def to_wire(self) -> dict[str, Any]:
        """Plain values for any RPC serializer (vLLM's decodes tensors only where it expects them)."""
        return {
            "reduced": self.reduced.float().cpu().contiguous().numpy().tobytes(),
            "shape": list(self.reduced.shape),
            "count": self.count.tolist(),
            "done": self.done.tolist(),
            "layer_head_agg": self.layer_head_agg,
        }

    @classmethod
    def from_wire(cls, data: dict[str, Any]) -> StepScores:
        reduced = torch.frombuffer(bytearray(data["reduced"]), dtype=torch.float32).reshape(data["shape"])
        return cls(
            reduced,
            torch.tensor(data["count"], dtype=torch.int64),
            torch.tensor(data["done"], dtype=torch.bool),
            str(data["layer_head_agg"]),
        )

    def merge(self, other: StepScores) -> StepScores:
        """Combine two disjoint sets of heads (tensor-parallel ranks)."""
        op = torch.maximum if self.layer_head_agg == "max" else torch.add
        return StepScores(
            op(self.reduced, other.reduced), self.count + other.count, self.done | other.done, self.layer_head_agg
        )

    def importance(self, n_steps: int, step_agg: str = "mean") -> torch.Tensor:
        """[M]: the first n_steps steps (those actually generated), combined over steps."""
        if n_steps < 1 or n_steps > self.reduced.shape[0] or not bool((self.count[:n_steps] > 0).all()):
            raise ValueError(f"importance over {n_steps} steps, but only steps {self.count.tolist()} were captured")
        per_step = self.reduced[:n_steps]
        if self.layer_head_agg == "mean":
            per_step = per_step / self.count[:n_steps, None].to(per_step.device)
        return per_step.amax(0) if step_agg == "max" else per_step.mean(0)


def rules_of(rules: Sequence[AttentionRules] | None, n_layers: int) -> list[AttentionRules]:
    if rules is None:
        return [DEFAULT_RULES] * n_layers
    if len(rules) != n_layers:
        raise ValueError(f"{len(rules)} attention rules for {n_layers} layers")
    return list(rules)


def token_importance(
    queries: torch.Tensor,
    keys: torch.Tensor,
    config: SpecPrefillConfig,
    rules: Sequence[AttentionRules] | None = None,
) -> torch.Tensor:
    """Importance [M] of every prompt token from one prompt's captured queries [L,H,N,D] and keys [L,KV,M,D] under
    each layer's attention `rules` (default 1/sqrt(D), no cap, no window), one layer at a time (the same reduction
    the vLLM workers run as their attention layers fire)."""
    check_shapes(queries, keys)
    n_layers, n_heads, steps, _ = queries.shape
    per_layer = rules_of(rules, n_layers)
    heads = head_set(config.score_heads, n_layers, n_heads)
    return _fold_layers(
        n_layers,
        n_heads,
        steps,
        keys.shape[2],
        config,
        lambda layer, chosen: layer_scores(
            queries[layer], keys[layer], config.pool_kernel, config.layer_head_agg, per_layer[layer], None, chosen
        ),
        heads,
        queries.device,
    )


def _fold_layers(
    n_layers: int,
    n_heads: int,
    steps: int,
    m: int,
    config: SpecPrefillConfig,
    layer_fn: Callable[[int, tuple[int, ...] | None], torch.Tensor],
    heads: HeadSet | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Importance [M] from each scored layer's head-reduced scores [N, M] (`layer_fn(layer, its heads or None)`),
    folded in one layer at a time on `device` (the scores'); `heads`: the scored layers and heads (default every
    one)."""
    acc = StepScores.empty(n_layers, steps, m, config.layer_head_agg, device)
    for layer in range(n_layers) if heads is None else sorted(heads):
        chosen = None if heads is None else heads[layer]
        acc.add(layer, 0, layer_fn(layer, chosen), n_heads if chosen is None else len(chosen))
    return acc.importance(steps, config.step_agg)


class Captured(NamedTuple):
    """What an engine's capture gives for one prompt: queries [L,H,N,D], prompt keys [L,KV,M,D] and each layer's
    attention rules."""

    queries: torch.Tensor
    keys: torch.Tensor
    rules: list[AttentionRules]


@dataclass
class ScoreCache:
    """Softmax scores [L,H,N,M] of one prompt under one model, computed once; importance for any knob setting, over
    all layers and heads or one of each, through the same per-layer reduction as `token_importance`."""

    token_ids: list[int]
    scores: torch.Tensor

    @classmethod
    def from_capture(
        cls,
        token_ids: Sequence[int],
        queries: torch.Tensor,
        keys: torch.Tensor,
        rules: Sequence[AttentionRules] | None = None,
    ) -> ScoreCache:
        return cls(list(token_ids), attention_scores(queries, keys, rules))

    def layer_importance(self, config: SpecPrefillConfig) -> torch.Tensor:
        """[L, M]: each layer's own importance (its heads and steps reduced as `config` says)."""
        return torch.stack([self.importance(config, layer) for layer in range(self.scores.shape[0])])

    def importance(self, config: SpecPrefillConfig, layer: int = -1, head: int = -1) -> torch.Tensor:
        """[M] from the first `config.look_ahead` steps; layer/head -1 = all."""
        s = self.scores[:, :, : config.look_ahead]
        if layer >= 0:
            s = s[layer : layer + 1]
        if head >= 0:
            s = s[:, head : head + 1]
        n_layers, n_heads, steps, m = s.shape
        heads = head_set(config.score_heads, n_layers, n_heads) if layer < 0 and head < 0 else None
        return _fold_layers(
            n_layers,
            n_heads,
            steps,
            m,
            config,
            lambda layer, chosen: reduce_heads(
                pool(s[layer] if chosen is None else s[layer, list(chosen)], config.pool_kernel), config.layer_head_agg
            ),
            heads,
            s.device,
        )
