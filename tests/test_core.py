"""The core algorithm against a deliberately naive loop implementation (python floats, no vectorization)."""

import math
import random

import pytest
import torch
import torch.nn.functional as F

from specprefill import core
from specprefill.config import SpecPrefillConfig
from specprefill.errors import SpecPrefillError

# ---------------------------------------------------------------- naive reference


def naive_importance(queries, keys, cfg, rules=None, scored=None):
    """Rules per layer: (scale or None, soft cap or None, window or None); queries sit at positions M-1, M, ...
    `scored`: the (layer, head) pairs that count (default all)."""
    n_layers, n_heads, n_steps, dim = queries.shape
    n_kv, m = keys.shape[1], keys.shape[2]
    group = n_heads // n_kv
    q, k = queries.double().tolist(), keys.double().tolist()
    rows = []  # rows[li][h][n] = list of M scores
    for li in range(n_layers):
        scale, cap, window = rules[li] if rules else (None, None, None)
        per_head = []
        for h in range(n_heads):
            per_step = []
            for n in range(n_steps):
                logits = []
                for j in range(m):
                    x = sum(q[li][h][n][d] * k[li][h // group][j][d] for d in range(dim))
                    x *= scale if scale is not None else 1 / math.sqrt(dim)
                    if cap is not None:
                        x = cap * math.tanh(x / cap)
                    seen = window is None or (m - 1 + n) - j < window
                    logits.append(x if seen else None)
                seen_logits = [x for x in logits if x is not None]
                if not seen_logits:  # past the window: this query scores nothing
                    s = [0.0] * m
                else:
                    top = max(seen_logits)
                    total = sum(math.exp(x - top) for x in seen_logits)
                    s = [0.0 if x is None else math.exp(x - top) / total for x in logits]
                if cfg.pool_kernel > 1:
                    half = cfg.pool_kernel // 2
                    s = [
                        sum(s[i] for i in range(j - half, j + half + 1) if 0 <= i < m) / cfg.pool_kernel
                        for j in range(m)
                    ]
                per_step.append(s)
            per_head.append(per_step)
        rows.append(per_head)
    result = []
    for j in range(m):
        steps = []
        for n in range(n_steps):
            vals = [
                rows[li][h][n][j]
                for li in range(n_layers)
                for h in range(n_heads)
                if scored is None or (li, h) in scored
            ]
            steps.append(max(vals) if cfg.layer_head_agg == "max" else sum(vals) / len(vals))
        result.append(max(steps) if cfg.step_agg == "max" else sum(steps) / len(steps))
    return result


def naive_select(scores, cfg):
    m = len(scores)
    size = cfg.chunk_size or 1
    chunks = [list(range(s, min(s + size, m))) for s in range(0, m, size)]
    chunk_score = [sum(scores[i] for i in c) / len(c) for c in chunks]
    want = min(max(1, math.ceil(round(len(chunks) * cfg.keep_rate, 9))), len(chunks))
    order = sorted(range(len(chunks)), key=lambda c: (-chunk_score[c], c))
    return sorted(i for c in order[:want] for i in chunks[c])


def rand_qk(layers, heads, kv, steps, m, dim, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(layers, heads, steps, dim, generator=g) * 2, torch.randn(layers, kv, m, dim, generator=g) * 2)


# ---------------------------------------------------------------- importance


@pytest.mark.parametrize("heads,kv", [(4, 4), (6, 2), (8, 1)])
@pytest.mark.parametrize("steps", [1, 3])
def test_importance_matches_naive_gqa(heads, kv, steps):
    cfg = SpecPrefillConfig(pool_kernel=0)
    q, k = rand_qk(3, heads, kv, steps, 17, 8, seed=heads * 10 + steps)
    got = core.token_importance(q, k, cfg)
    assert got.shape == (17,) and got.dtype == torch.float32
    assert torch.allclose(got.double(), torch.tensor(naive_importance(q, k, cfg), dtype=torch.double), atol=1e-6)


@pytest.mark.parametrize(
    "spec,scored",
    [
        ("layers:1-2", {(la, h) for la in (1, 2) for h in range(6)}),
        ("layers:2", {(2, h) for h in range(6)}),
        ("0.1, 2.5,2.4", {(0, 1), (2, 5), (2, 4)}),
        ("3.0", {(3, 0)}),
        ("all", None),
    ],
)
@pytest.mark.parametrize("layer_head_agg,steps", [("max", 1), ("mean", 2)])
def test_head_set_scoring_equals_the_oracle_restricted(spec, scored, layer_head_agg, steps):
    """score_heads: importance from a set of (layer, head) pairs equals the naive importance over those pairs only
    (grouped-query attention: 6 query heads over 2 KV heads), in `token_importance` and in `ScoreCache` alike."""
    cfg = SpecPrefillConfig(pool_kernel=3, score_heads=spec, layer_head_agg=layer_head_agg, look_ahead=steps)
    q, k = rand_qk(4, 6, 2, steps, 11, 8, seed=len(spec))
    want = torch.tensor(naive_importance(q, k, cfg, scored=scored), dtype=torch.double)
    assert torch.allclose(core.token_importance(q, k, cfg).double(), want, atol=1e-6)
    assert torch.allclose(core.ScoreCache.from_capture(range(11), q, k).importance(cfg).double(), want, atol=1e-6)


@pytest.mark.parametrize("spec", ["layers:3-1", "1:2", "heads", "0.1,", "", "layers:-1"])
def test_bad_score_heads_are_one_line_errors(spec):
    with pytest.raises(SpecPrefillError, match="score_heads") as err:
        SpecPrefillConfig(score_heads=spec)
    assert "\n" not in str(err.value)


def test_score_heads_outside_the_model_name_the_range():
    q, k = rand_qk(2, 4, 2, 1, 5, 8, seed=0)
    for spec in ("layers:0-2", "1.4"):
        with pytest.raises(SpecPrefillError, match="layers 0-1 and heads 0-3"):
            core.token_importance(q, k, SpecPrefillConfig(score_heads=spec))
    assert SpecPrefillConfig().with_heads("1.2").score_heads == "1.2"  # auto takes a calibrated speculator's set
    assert SpecPrefillConfig().with_heads(None).score_heads == "all"
    assert SpecPrefillConfig(score_heads=" auto").with_heads("1.2").score_heads == "1.2"
    assert SpecPrefillConfig(score_heads="layers:0").with_heads("1.2").score_heads == "layers:0"  # given wins


@pytest.mark.parametrize("kernel,m", [(13, 40), (13, 5), (13, 1), (3, 9), (1, 9)])
@pytest.mark.parametrize("layer_head_agg,step_agg", [("max", "mean"), ("mean", "max")])
def test_importance_pooling_edges_and_aggregations(kernel, m, layer_head_agg, step_agg):
    cfg = SpecPrefillConfig(pool_kernel=kernel, layer_head_agg=layer_head_agg, step_agg=step_agg)
    q, k = rand_qk(2, 4, 2, 2, m, 8, seed=m + kernel)
    got = core.token_importance(q, k, cfg)
    assert torch.allclose(got.double(), torch.tensor(naive_importance(q, k, cfg), dtype=torch.double), atol=1e-6)


RULES = [(0.5, None, None), (None, 1.5, None), (None, None, 4), (0.9, 2.0, 2)]


@pytest.mark.parametrize("steps", [1, 3])
@pytest.mark.parametrize("layer_head_agg", ["max", "mean"])
def test_importance_follows_each_layers_attention_rules(steps, layer_head_agg):
    """Scale, soft-cap and sliding window per layer (the last layer's window of 2 leaves its 3rd look-ahead query no
    prompt key at all)."""
    cfg = SpecPrefillConfig(pool_kernel=3, layer_head_agg=layer_head_agg)
    q, k = rand_qk(4, 4, 2, steps, 13, 8, seed=40 + steps)
    rules = [core.AttentionRules(*r) for r in RULES]
    got = core.token_importance(q, k, cfg, rules)
    want = torch.tensor(naive_importance(q, k, cfg, RULES), dtype=torch.double)
    assert torch.allclose(got.double(), want, atol=1e-6)
    plain = core.token_importance(q, k, cfg)
    assert not torch.allclose(got, plain, atol=1e-3)  # the rules matter for these inputs
    scores = core.attention_scores(q, k, rules)  # the explorer's path: same rules, same numbers
    cache = core.ScoreCache([0] * 13, scores)
    assert torch.allclose(cache.importance(cfg.replace(look_ahead=steps)), got, atol=1e-6)


def test_window_leaves_tokens_outside_unscored():
    q, k = rand_qk(1, 2, 1, 1, 10, 8, seed=9)
    got = core.token_importance(q, k, SpecPrefillConfig(pool_kernel=0), [core.AttentionRules(window=3)])
    assert got[:7].abs().max() == 0 and got[7:].min() > 0


def test_scoring_in_key_chunks_equals_one_block(monkeypatch):
    cfg = SpecPrefillConfig(pool_kernel=5)
    q, k = rand_qk(2, 6, 2, 2, 37, 8, seed=11)
    rules = [core.AttentionRules(0.3, 3.0, 20), core.DEFAULT_RULES]
    whole = core.token_importance(q, k, cfg, rules)
    monkeypatch.setattr(core, "SCORE_CHUNK", 5)
    assert torch.allclose(core.token_importance(q, k, cfg, rules), whole, atol=1e-6)


@pytest.mark.parametrize("values,want", [((0.25, 0, -1), (0.25, None, None)), ((1, 30.0, 4096), (1.0, 30.0, 4096))])
def test_rules_from_engine_values(values, want):
    """vLLM's CPU impl stores "no soft-cap" as 0 and "no window" as -1."""
    assert core.AttentionRules.of(*values) == core.AttentionRules(*want)


def test_pooling_counts_zero_padding():
    scores = torch.ones(1, 1, 1, 20)
    pooled = core.pool(scores, 13)[0, 0, 0]
    assert pooled[0].item() == pytest.approx(7 / 13)  # 6 padded zeros + 7 real ones
    assert pooled[10].item() == pytest.approx(1.0)


def test_scores_are_probabilities_over_prompt():
    q, k = rand_qk(2, 4, 2, 3, 11, 8, seed=1)
    s = core.attention_scores(q, k)
    assert s.shape == (2, 4, 3, 11)
    assert torch.allclose(s.sum(-1), torch.ones(2, 4, 3))


def test_bf16_inputs_are_scored_in_fp32():
    q, k = rand_qk(2, 4, 2, 1, 9, 8, seed=2)
    got = core.token_importance(q.bfloat16(), k.bfloat16(), SpecPrefillConfig(pool_kernel=0))
    ref = naive_importance(q.bfloat16().float(), k.bfloat16().float(), SpecPrefillConfig(pool_kernel=0))
    assert got.dtype == torch.float32
    assert torch.allclose(got.double(), torch.tensor(ref, dtype=torch.double), atol=1e-6)


def test_mismatched_shapes_are_rejected():
    q, k = rand_qk(2, 6, 4, 1, 9, 8, seed=3)  # 6 heads cannot share 4 kv heads
    with pytest.raises(ValueError):
        core.attention_scores(q, k)


# ---------------------------------------------------------------- selection


@pytest.mark.parametrize("m", [1, 7, 31, 32, 33, 100, 257])
@pytest.mark.parametrize("chunk", [0, 1, 32, 5])
@pytest.mark.parametrize("rate", [1e-6, 0.1, 0.3, 0.7, 1.0])
def test_select_matches_naive(m, chunk, rate):
    rng = random.Random(m * 1000 + chunk)
    scores = [rng.random() for _ in range(m)]
    cfg = SpecPrefillConfig(keep_rate=rate, chunk_size=chunk)
    got = core.select(torch.tensor(scores), cfg).tolist()
    assert got == naive_select(scores, cfg)
    assert got == sorted(set(got)) and all(0 <= i < m for i in got)


def test_keep_rate_one_keeps_everything_and_tiny_keeps_one_chunk():
    scores = torch.rand(70)
    assert core.select(scores, SpecPrefillConfig(keep_rate=1.0, chunk_size=32)).tolist() == list(range(70))
    assert len(core.select(scores, SpecPrefillConfig(keep_rate=1e-9, chunk_size=0))) == 1
    tiny = core.select(scores, SpecPrefillConfig(keep_rate=1e-9, chunk_size=32)).tolist()
    assert tiny in (list(range(32)), list(range(32, 64)), list(range(64, 70)))


def test_last_partial_chunk_scored_by_its_own_mean():
    # 32 tokens of 0.5 then a partial chunk of 2 tokens at 0.6: the partial chunk wins on its mean
    scores = torch.tensor([0.5] * 32 + [0.6, 0.6])
    assert core.select(scores, SpecPrefillConfig(keep_rate=0.5, chunk_size=32)).tolist() == [32, 33]


def test_keep_rate_float_noise():
    assert core.n_to_keep(10, 0.7) == 7
    assert core.n_to_keep(3, 0.1) == 1
    assert core.n_to_keep(1000, 0.1) == 100


def test_ties_go_to_lower_index():
    assert core.select(torch.zeros(10), SpecPrefillConfig(keep_rate=0.3, chunk_size=0)).tolist() == [0, 1, 2]


# ---------------------------------------------------------------- positions and batches


def test_prune_restores_or_compacts_positions():
    ids = list(range(100, 110))
    kept = torch.tensor([1, 4, 5, 9])
    on = core.prune(ids, kept, SpecPrefillConfig())
    assert on.token_ids == [101, 104, 105, 109] and on.positions == [1, 4, 5, 9]
    assert [on.decode_position(i) for i in range(3)] == [10, 11, 12]
    off = core.prune(ids, kept, SpecPrefillConfig(restore_positions=False))
    assert off.positions == [0, 1, 2, 3] and off.decode_position(0) == 4


def test_remap_rows_matches_pruned_prompts_for_a_mixed_step():
    """One engine step: a whole prompt in one chunk then decoding, a prefill chunk crossing into generated positions,
    a later prompt chunk, a decoding request; every row's position is what `prune` and `decode_position` give."""
    a = core.prune(list(range(50)), torch.tensor([0, 3, 4, 20, 49]), SpecPrefillConfig())
    b = core.prune(list(range(30)), torch.tensor([2, 5, 6, 7, 8, 9, 29]), SpecPrefillConfig())

    def oracle(p, cache_pos):  # cache index -> position, from the pruned prompt alone
        k = len(p.kept_indices)
        return p.positions[cache_pos] if cache_pos < k else p.decode_position(cache_pos - k)

    spans = [(a, 0, 9), (b, 5, 3), (b, 0, 4), (a, 7, 1)]  # (prompt, first cache position, rows)
    row_spans, row, expected = [], 3, []  # rows 0-2 belong to an unpruned request
    for p, cache_start, count in spans:
        kept = torch.tensor(p.kept_indices)
        row_spans.append(core.RowSpan(row, count, cache_start, kept, p.n_original))
        expected += [(row + j, cache_start + j, oracle(p, cache_start + j)) for j in range(count)]
        row += count + 1  # another unpruned row between requests
    rows, cache, got = core.remap_rows(row_spans)
    assert list(zip(rows.tolist(), cache.tolist(), got.tolist())) == expected
    assert core.remap_rows([core.RowSpan(0, 2, 3, torch.tensor([7, 9]), 10)])[2].tolist() == [11, 12]


def test_ragged_batch_with_per_prompt_configs_and_steps():
    lengths, steps = [5, 40, 77], [1, 8, 3]  # steps < N models a look-ahead stopped early at EOS
    prompts, qs, ks = [], [], []
    for i, (m, n) in enumerate(zip(lengths, steps)):
        q, k = rand_qk(2, 4, 2, n, m, 8, seed=i)
        prompts.append(list(range(m)))
        qs.append(q)
        ks.append(k)
    cfgs = [SpecPrefillConfig(keep_rate=r, chunk_size=c, look_ahead=8) for r, c in [(0.5, 0), (0.1, 8), (0.3, 32)]]
    out = [core.speculate(p, q, k, c) for p, q, k, c in zip(prompts, qs, ks, cfgs)]
    for p, q, k, c, o in zip(prompts, qs, ks, cfgs, out):
        ref = naive_importance(q, k, c)
        assert torch.allclose(
            torch.tensor(o.importance, dtype=torch.double), torch.tensor(ref, dtype=torch.double), atol=1e-6
        )
        assert o.kept_indices == naive_select(torch.tensor(ref).float().tolist(), c)
        assert o.n_original == len(p) and o.positions == o.kept_indices


def test_speculate_rejects_keys_of_wrong_length():
    q, k = rand_qk(1, 2, 2, 1, 5, 4, seed=0)
    with pytest.raises(ValueError):
        core.speculate(list(range(6)), q, k, SpecPrefillConfig())


# ---------------------------------------------------------------- config


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(keep_rate=0),
        dict(keep_rate=1.5),
        dict(keep_rate=-0.1),
        dict(chunk_size=-1),
        dict(look_ahead=0),
        dict(pool_kernel=4),
        dict(layer_head_agg="median"),
    ],
)
def test_bad_config_is_one_line_error(kwargs):
    with pytest.raises(SpecPrefillError) as err:
        SpecPrefillConfig(**kwargs)
    assert "\n" not in str(err.value)


def test_yaml_roundtrip_and_unknown_keys(tmp_path):
    cfg = SpecPrefillConfig(keep_rate=0.3, chunk_size=0, look_ahead=1, pool_kernel=0, restore_positions=False)
    cfg.save(tmp_path / "c.yaml")
    assert SpecPrefillConfig.load(tmp_path / "c.yaml") == cfg
    (tmp_path / "bad.yaml").write_text("keep_rate: 0.1\nkeep_ratio: 0.2\n")
    with pytest.raises(SpecPrefillError, match="keep_ratio"):
        SpecPrefillConfig.load(tmp_path / "bad.yaml")


def test_core_is_engine_free():
    import ast
    import inspect

    tree = ast.parse(inspect.getsource(core))
    imported = {n.names[0].name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import)}
    imported |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert not imported & {"transformers", "vllm"}


def test_agreement_metrics_against_hand_computed_values():
    """Top-k Jaccard, KL(p || q) over normalised importance and Kendall's tau-b, each against values computed by
    hand (tau-b by counting concordant and discordant pairs)."""
    a = torch.tensor([0.9, 0.1, 0.5, 0.3, 0.7])
    b = torch.tensor([0.8, 0.6, 0.1, 0.2, 0.9])
    assert core.top_k_jaccard(a, b, 2) == 1.0  # top-2 of a: {0, 4}; of b: {4, 0}
    assert core.top_k_jaccard(a, b, 3) == 2 / 4  # {0, 4, 2} vs {4, 0, 1}: 2 shared of 4
    p, q = torch.tensor([1.0, 1.0, 2.0]), torch.tensor([2.0, 1.0, 1.0])
    want = 0.25 * math.log(0.25 / 0.5) + 0.25 * math.log(1.0) + 0.5 * math.log(0.5 / 0.25)
    assert abs(core.kl_divergence(p, q) - want) < 1e-9 and abs(core.kl_divergence(p, p)) < 1e-12
    pairs = [(i, j) for i in range(5) for j in range(i + 1, 5)]
    sign = [float(torch.sign((a[i] - a[j]) * (b[i] - b[j]))) for i, j in pairs]
    assert abs(core.kendall_tau(a, b) - sum(sign) / len(pairs)) < 1e-12  # no ties: tau-b = (C - D) / pairs
    m = core.layer_agreement(torch.stack([a, b]), torch.stack([b, a, a]))
    assert set(m) == set(core.LAYER_METRICS) and all(x.shape == (2, 3) for x in m.values())
    kl, tau = m["kl_importance"], m["tau_values"]
    assert abs(tau[0, 1] - 1) < 1e-12 and abs(kl[1, 0]) < 1e-12 and abs(tau[0, 0] - tau[1, 1]) < 1e-12
    assert abs(kl[0, 0] - core.kl_divergence(b, a)) < 1e-12  # KL(base || speculator)
    # the original's definitions: torch's kl_div(log_softmax(speculator), softmax(base)) averaged over the tokens ...
    original = F.kl_div(F.log_softmax(a.double(), -1), F.softmax(b.double(), -1), reduction="none").mean()
    assert abs(m["kl"][0, 0] - original) < 1e-12 and abs(m["kl"][0, 1]) < 1e-12
    # ... and Kendall's tau of the two orderings: argsort(a) = [1, 3, 2, 4, 0], argsort(b) = [2, 3, 1, 0, 4]
    oa, ob = [1, 3, 2, 4, 0], [2, 3, 1, 0, 4]
    sign = [(oa[i] - oa[j]) * (ob[i] - ob[j]) > 0 for i, j in pairs]
    assert abs(m["tau"][0, 0] - (2 * sum(sign) - len(pairs)) / len(pairs)) < 1e-12
    with pytest.raises(ValueError, match="tokens"):
        core.layer_agreement(torch.ones(2, 4), torch.ones(2, 5))
