"""The SpecPrefill algorithm, engine-free (pure torch): one package every engine calls.

An engine captures, for one prompt of M tokens:
  queries  [L, H, N, D]   post-RoPE query of the last prompt token and of N-1 look-ahead tokens, per layer
  keys     [L, KV, M, D]  post-RoPE keys of the prompt tokens, per layer (KV may divide H: grouped-query attention)
and these modules turn them into a per-token importance [M] (`scoring`), a sorted set of kept indices and the
position ids the base model must see for them (`selection`); `tokens` moves importance between two tokenizers,
`agreement` compares two importances, `turns` reuses what an earlier request of a conversation left in the
base's prefix cache. Callers use the names re-exported here (`core.select`, `core.ScoreCache`).
"""

from specprefill.config import AGGREGATIONS
from specprefill.core.agreement import (
    LAYER_METRICS,
    kendall_tau,
    kl_divergence,
    layer_agreement,
    ordering_tau,
    top_k_jaccard,
    top_k_overlap,
)
from specprefill.core.decision import Decision, cheapest, decide, plan_reuse, predict_paths
from specprefill.core.likelihood import AnswerFit, compare_fits, fit_from_logits
from specprefill.core.query import query_scores
from specprefill.core.scoring import (
    DEFAULT_RULES,
    SCORE_CHUNK,
    AttentionRules,
    Captured,
    ScoreCache,
    StepScores,
    attention_scores,
    check_shapes,
    group_logits,
    group_probs,
    head_scores,
    head_set,
    layer_scores,
    pool,
    reduce_heads,
    rules_of,
    score_temporaries,
    token_importance,
)
from specprefill.core.selection import (
    PrunedPrompt,
    RowSpan,
    keep,
    n_to_keep,
    prune,
    remap_rows,
    select,
    select_units,
    speculate,
    top_k_indices,
)
from specprefill.core.text import normalize_breaks, words_of
from specprefill.core.tokens import fill_gaps, project_importance, span_overlaps
from specprefill.core.turns import (
    Held,
    PairTimes,
    PrefillTime,
    Reuse,
    TurnMemory,
    on_held,
)
from specprefill.core.units import Layout, Units, cut

__all__ = [
    "AnswerFit",
    "compare_fits",
    "fit_from_logits",
    "AGGREGATIONS",
    "PairTimes",
    "PrefillTime",
    "cheapest",
    "Decision",
    "decide",
    "predict_paths",
    "top_k_overlap",
    "top_k_jaccard",
    "kl_divergence",
    "kendall_tau",
    "layer_agreement",
    "LAYER_METRICS",
    "ordering_tau",
    "check_shapes",
    "AttentionRules",
    "DEFAULT_RULES",
    "SCORE_CHUNK",
    "group_logits",
    "group_probs",
    "attention_scores",
    "head_scores",
    "pool",
    "reduce_heads",
    "head_set",
    "layer_scores",
    "score_temporaries",
    "StepScores",
    "rules_of",
    "token_importance",
    "Captured",
    "ScoreCache",
    "n_to_keep",
    "top_k_indices",
    "select",
    "PrunedPrompt",
    "RowSpan",
    "remap_rows",
    "prune",
    "keep",
    "speculate",
    "span_overlaps",
    "fill_gaps",
    "project_importance",
    "Layout",
    "Units",
    "cut",
    "query_scores",
    "normalize_breaks",
    "words_of",
    "select_units",
    "Held",
    "Reuse",
    "TurnMemory",
    "plan_reuse",
    "on_held",
]  # what `core.NAME` offers
