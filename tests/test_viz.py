"""The heatmap renderer and the explorer widget (headless, no kernel)."""

import math
import re

import pytest
import torch

from specprefill import core
from specprefill.config import SpecPrefillConfig
from specprefill.viz import explorer as widget
from specprefill.viz import heatmap


def spans(page):
    """(index, style, title, aria-label, text) of every token; each must be focusable, a list item and named."""
    return re.findall(
        r'<span class="sp-tok[^"]*" data-i="(\d+)" style="([^"]*)" title="([^"]*)" tabindex="0" role="listitem" '
        r'aria-label="([^"]*)">(.*?)</span>',
        page,
        flags=re.S,
    )


def rgb(style, prop="background"):
    """The colour a style gives `prop` (background or color) as (r, g, b)."""
    return tuple(int(x, 16) for x in re.search(rf"(?:^|;){prop}:#(..)(..)(..)", style).groups())


def test_one_element_per_token_with_hover_and_marking():
    tokens = ["The", " cat", " sat", "\n", "  on", " mat"]
    scores = [0.1, 0.5, 0.2, 0.0, 0.9, 0.3]
    page = heatmap.render_html(tokens, scores, kept=[1, 4], positions=[0, 1, 2, 3, 4, 5])
    found = spans(page)
    assert [int(i) for i, *_ in found] == list(range(6))
    assert "".join(t for *_, t in found) == "".join(tokens)  # whitespace and newlines kept verbatim
    assert "white-space:pre-wrap" in page
    dimmed = f"color:{heatmap.hex_colour(heatmap.DROPPED_TEXT)}"
    for i, style, title, *_ in found:
        i = int(i)
        assert ("outline" in style) == (i in (1, 4)) and (dimmed in style) == (i not in (1, 4))
        assert f"index {i} | position {i}" in title and f"score {scores[i]:.4g}" in title
    assert "kept 2 of 6 tokens" in page


@pytest.mark.parametrize("scale", ["linear", "log"])
def test_colour_monotonic_in_score(scale):
    scores = [0.0005, 0.3, 0.001, 0.9, 0.02, 0.5, 1e-6]
    found = spans(heatmap.render_html([f"t{i}" for i in range(7)], scores, kept=[], scale=scale))
    darkness = {scores[int(i)]: -sum(rgb(style)) for i, style, *_ in found}
    ordered = [darkness[s] for s in sorted(scores)]
    assert ordered == sorted(ordered) and ordered[0] < ordered[-1]
    assert f"({scale} scale)" in heatmap.render_html(["a"], [1.0], kept=[0], scale=scale)


def test_hostile_text_is_escaped():
    tokens = ["<script>alert(1)</script>", " & ", '"quoted"', "'single'", "\n<b>"]
    page = heatmap.render_html(tokens, [1, 2, 3, 4, 5], kept=[0])
    assert "<script" not in page and "<b>" not in page
    assert (
        "&lt;script&gt;" in page and "&amp;" in page and "&quot;quoted&quot;" in page and "&#x27;single&#x27;" in page
    )


def test_no_scripts_or_network_references():
    page = heatmap.render_html(["a", "b"], [0.1, 0.2], kept=[1], title="t")
    low = page.lower()
    for bad in ("<script", "http:", "https:", "src=", "url(", "@import", "<link", "//"):
        assert bad not in low


def test_mismatched_lengths_rejected():
    with pytest.raises(ValueError):
        heatmap.render_html(["a"], [0.1, 0.2], kept=[])


def test_non_finite_scores_render_as_no_score():
    page = heatmap.render_html(["a", "b", "c", "d"], [0.1, float("nan"), 0.9, float("inf")], kept=[2])
    found = spans(page)
    assert [t for *_, t in found] == ["a", "b", "c", "d"]
    assert "no score" in found[1][2] and "no score" in found[3][2]
    assert found[1][1] == heatmap.token_style(math.nan, False)  # grey, dimmed as it was dropped
    assert rgb(found[2][1]) == heatmap.HEAT_RGB and rgb(found[0][1]) == (255, 255, 255)  # finite ones span the scale
    assert len(spans(heatmap.render_html(["x"], [float("nan")], kept=[]))) == 1


def test_every_token_is_focusable_and_named_with_its_score_and_state():
    """Keyboard and screen-reader users get what the hover title gives mouse users: the token, its score, kept or
    dropped (whitespace tokens said as escapes, no score said as such)."""
    tokens = ["The", " cat", "\n", "<b>", " x"]
    scores = [0.125, 0.5, 0.0, 1.0, float("nan")]
    page = heatmap.render_html(tokens, scores, kept=[1, 3])
    found = spans(page)
    assert len(found) == len(tokens) == page.count('tabindex="0"') == page.count('role="listitem"')
    assert 'class="sp-tokens" role="list"' in page
    labels = [label for _, _, _, label, _ in found]
    assert labels == [
        "The, score 0.125, dropped",
        "cat, score 0.5, kept",
        "&#x27;\\n&#x27;, score 0, dropped",
        "&lt;b&gt;, score 1, kept",
        "x, no score, dropped",
    ]
    assert ":focus-visible" in page  # kept tokens' own outline must not hide where the focus is


def test_every_background_comes_with_a_text_colour():
    """A dark notebook theme's light text must never land on the heatmap's light backgrounds."""
    page = heatmap.render_html(["a", "b", "c"], [0.1, 0.9, float("nan")], kept=[1], title="t")
    styles = re.findall(r'style="([^"]*)"', page)
    with_background = [s for s in styles if "background:" in s and "gradient" not in s]  # the scale bar has no text
    assert len(with_background) == 1 + 2 + 3  # the container, the legend's kept and dropped samples, the tokens
    assert all(re.search(r"(?:^|;)color:#", s) for s in with_background)
    assert with_background[0].startswith("background:#fff;color:#000")  # the container


def test_wcag_contrast_formula():
    """The contrast ratio is WCAG 2's: its published end points and the AA grey, #767676 on white, 4.54:1."""
    assert heatmap.contrast((0, 0, 0), (255, 255, 255)) == pytest.approx(21.0)
    assert heatmap.contrast((118, 118, 118), (255, 255, 255)) == pytest.approx(4.54, abs=0.005)
    assert heatmap.contrast((214, 39, 40), (0, 0, 0)) == pytest.approx(4.18, abs=0.01)  # why the hottest text is white
    assert heatmap.contrast((10, 20, 30), (10, 20, 30)) == 1.0


def test_every_token_reads_at_aa_contrast_over_the_whole_scale():
    """Text on background >= 4.5:1 (WCAG AA) for every score from the lowest to the highest, kept or dropped, and
    for tokens without a score, measured on the colours the page renders."""
    scores = [i / 1000 for i in range(1001)] + [float("nan")]
    for kept in ([], range(len(scores))):
        found = spans(heatmap.render_html([f"t{i}" for i in range(len(scores))], scores, kept=kept))
        worst = min(heatmap.contrast(rgb(style), rgb(style, "color")) for _, style, *_ in found)
        assert len(found) == len(scores) and worst >= 4.5, (bool(kept), worst)


def test_legend_marks_kept_and_dropped_as_the_tokens_are():
    """The legend's samples are styled as a top-score token kept and dropped: same outline, same colours."""
    page = heatmap.render_html(["a", "b", "c"], [0.0, 1.0, 1.0], kept=[1])
    legend = re.search(r'class="sp-legend".*?</div>', page, flags=re.S).group(0)
    kept_sample = re.search(r'style="([^"]*)">kept<', legend).group(1)
    dropped_sample = re.search(r'style="([^"]*)">dropped<', legend).group(1)
    (_, kept_token, *_), (_, dropped_token, *_) = spans(page)[1:]
    outline = re.compile(r"outline:[^;]*")
    assert outline.search(kept_sample).group(0) == outline.search(kept_token).group(0) == heatmap.KEPT_OUTLINE
    assert kept_sample.startswith(kept_token) and dropped_sample.startswith(dropped_token)
    assert "outline" not in dropped_token


def test_amdahl_and_overlap():
    assert widget.amdahl_speedup(0.1, 0.2) == pytest.approx(1 / 0.3)
    a, b = torch.tensor([5.0, 4, 3, 2, 1]), torch.tensor([1.0, 4, 3, 2, 5])
    assert core.top_k_overlap(a, b, 2) == 0.5 and core.top_k_overlap(a, a, 3) == 1.0


# ---------------------------------------------------------------- explorer


class FakeTokenizer:
    """One token per character (offsets included, as a fast tokenizer gives them)."""

    def __call__(self, text, add_special_tokens=True, return_offsets_mapping=False):
        out = {"input_ids": [ord(c) for c in text]}
        return out | ({"offset_mapping": [(i, i + 1) for i in range(len(text))]} if return_offsets_mapping else {})

    def decode(self, ids, **kwargs):
        return "".join(chr(i) for i in ids)


class CountingCapture:
    def __init__(self, seed):
        self.calls, self.seed = 0, seed

    def __call__(self, ids):
        self.calls += 1
        g = torch.Generator().manual_seed(self.seed)
        return torch.randn(3, 4, 8, 16, generator=g), torch.randn(3, 2, len(ids), 16, generator=g)


def make_explorer(save_dir):
    """The explorer on synthetic captures (no model), with a base panel and HTML in its prompt: (explorer,
    speculator capture, base capture)."""
    capture, base = CountingCapture(0), CountingCapture(1)
    ex = widget.ImportanceExplorer(
        capture,
        FakeTokenizer(),
        "a <b> prompt & more text " * 8,
        base_capture=base,
        save_dir=save_dir,
        config=SpecPrefillConfig(keep_rate=0.2, chunk_size=8),
    )
    return ex, capture, base


@pytest.fixture
def explorer(tmp_path):
    return make_explorer(tmp_path)


def kept_count(ex):
    return int(re.search(r"kept (\d+) of", ex.stats.value).group(1))


def test_sliders_rerender_without_rerunning_the_model(explorer):
    ex, capture, base = explorer
    assert capture.calls == 1 and base.calls == 1
    n = len(ex.cache.token_ids)
    before_html, before_kept = ex.heatmap.value, kept_count(ex)
    ex.keep_rate.value = 0.6
    assert kept_count(ex) > before_kept and ex.heatmap.value != before_html
    ex.chunk_size.value = 0
    assert kept_count(ex) == core.n_to_keep(n, 0.6)
    for knob, value in [
        (ex.pool_kernel, 5),
        (ex.steps, 3),
        (ex.layer_head_agg, "mean"),
        (ex.step_agg, "max"),
        (ex.layer, 1),
        (ex.head, 2),
        (ex.scale, "log"),
    ]:
        old = ex.heatmap.value
        knob.value = value
        assert ex.heatmap.value != old, knob.description
    assert capture.calls == 1 and base.calls == 1
    assert "overlap with the speculator" in ex.compare.value


def test_explorer_view_matches_core(explorer):
    ex, capture, _ = explorer
    ex.keep_rate.value, ex.chunk_size.value, ex.steps.value = 0.3, 4, 5
    q, k = capture(ex.cache.token_ids)
    cfg = SpecPrefillConfig(keep_rate=0.3, chunk_size=4, look_ahead=5, pool_kernel=ex.pool_kernel.value)
    importance, kept = ex.view()
    ref = core.token_importance(q[:, :, :5], k, cfg)
    assert torch.allclose(importance, ref) and kept.tolist() == core.select(ref, cfg).tolist()


def test_explorer_selects_units_and_protects_as_the_engines_do(explorer):
    from specprefill import structure

    ex, *_ = explorer
    ex.keep_rate.value, ex.chunk_size.value = 0.3, 4
    ex.units.value, ex.protect.value = "records", True
    importance, kept = ex.view()
    cfg = ex.current_config()
    assert cfg.selection_unit == "records" and cfg.protect
    assert kept.tolist() == core.select(importance, cfg, structure.layout(ex.tokenizer, ex.base_ids)).tolist()
    ex.chunk_size.value = 0  # token mode has no lines: said where the numbers were
    assert "pass chunks" in ex.stats.value


def test_save_writes_standalone_html(explorer, tmp_path):
    ex, *_ = explorer
    path = ex.save()
    page = path.read_text()
    assert path.parent == tmp_path and page.startswith("<!doctype html>") and "sp-heatmap" in page
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]  # no temp file (`.name.<random>.tmp<suffix>`) left


def test_cross_tokenizer_explorer_shows_base_tokens_with_speculator_hovers(smollm2, tiny_tp_model, tmp_path):
    """SmolLM2 speculating for a base with another tokenizer: base tokens shown, importance moved onto them, each
    token's hover naming the speculator tokens it overlaps; knobs still re-aggregate without a model call."""
    from specprefill import tokenmap
    from specprefill.engines.common import load_tokenizer
    from specprefill.engines.hf import hf_capture

    capture, spec_tok = hf_capture(smollm2, look_ahead=2)
    calls = []
    base_tok = load_tokenizer(tiny_tp_model)
    prompt = " ".join(f"w{(i * 7) % 60}" for i in range(120))
    ex = widget.ImportanceExplorer(
        lambda ids: calls.append(len(ids)) or capture(ids),
        spec_tok,
        prompt,
        base_tokenizer=base_tok,
        save_dir=tmp_path,
        config=SpecPrefillConfig(keep_rate=0.25, chunk_size=8, look_ahead=2),
    )
    base_ids = base_tok(prompt)["input_ids"]
    found = spans(ex.heatmap.value)
    assert len(found) == len(base_ids) and "moved onto the base" in ex.heatmap.value
    tmap = tokenmap.TokenMap.build(spec_tok, base_tok, base_ids)
    assert calls == [len(tmap.spec_ids)] and len(tmap.spec_ids) != len(base_ids)
    importance, kept = ex.view()
    assert torch.allclose(importance, tmap.project(ex.cache.importance(ex.current_config())))
    word = next(i for i, (*_, t) in enumerate(found) if t.strip().startswith("w"))
    assert "speculator tokens: #" in found[word][2]
    ex.keep_rate.value = 0.5
    assert kept_count(ex) > len(kept) and calls == [len(tmap.spec_ids)]
