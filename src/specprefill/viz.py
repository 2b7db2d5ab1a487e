"""Token-importance views: a pure HTML heatmap renderer and an ipywidgets explorer.

`render_html` output is self-contained: inline styles only, no scripts, no external references, so it works
offline, inside a notebook and in exported HTML.
"""
from __future__ import annotations

import html
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Sequence

import torch

from specprefill import core

HEAT_RGB = (214, 39, 40)  # the colour of the highest score; lower scores blend toward white
SCALES = ("linear", "log")


def intensity(scores: Sequence[float], scale: str = "linear") -> list[float]:
    """Scores -> [0, 1], monotonic non-decreasing in the score. Log scale spreads out small attention values."""
    if scale not in SCALES:
        raise ValueError(f"scale {scale!r} is unknown: use one of {SCALES}")
    if not scores:
        return []
    values = [float(s) for s in scores]
    if scale == "log":
        floor = max(min((v for v in values if v > 0), default=1e-12), 1e-12)
        values = [math.log(max(v, floor)) for v in values]
    lo, hi = min(values), max(values)
    return [0.0 if hi == lo else (v - lo) / (hi - lo) for v in values]


def heat_colour(level: float) -> str:
    r, g, b = (round(255 - level * (255 - c)) for c in HEAT_RGB)
    return f"rgb({r},{g},{b})"


def _legend(scores: Sequence[float], scale: str) -> str:
    stops = ", ".join(heat_colour(x / 4) for x in range(5))
    lo, hi = (min(scores), max(scores)) if scores else (0.0, 0.0)
    return (
        '<div class="sp-legend" style="display:flex;align-items:center;gap:8px;margin:6px 0;font:12px sans-serif">'
        f'<span>{lo:.3g}</span><span style="display:inline-block;width:160px;height:12px;'
        f'background:linear-gradient(to right, {stops});border:1px solid #999"></span><span>{hi:.3g}</span>'
        f'<span>({html.escape(scale)} scale)</span>'
        '<span style="outline:2px solid #1f77b4;padding:0 3px">kept</span>'
        '<span style="opacity:0.4;padding:0 3px">dropped</span></div>'
    )


def render_html(tokens: Sequence[str], scores: Sequence[float], kept: Iterable[int], *,
                positions: Sequence[int] | None = None, scale: str = "linear", title: str | None = None) -> str:
    """One <span> per token: background from the score, kept tokens outlined, dropped ones dimmed, text escaped,
    whitespace kept; a hover title gives index, original position and score."""
    if len(tokens) != len(scores):
        raise ValueError(f"{len(tokens)} tokens but {len(scores)} scores")
    kept = set(int(i) for i in kept)
    positions = list(range(len(tokens))) if positions is None else list(positions)
    levels = intensity(list(scores), scale)
    spans = []
    for i, (tok, score, level) in enumerate(zip(tokens, scores, levels)):
        is_kept = i in kept
        style = f"background-color:{heat_colour(level)};" + (
            "outline:1px solid #1f77b4;" if is_kept else "opacity:0.4;")
        tip = f"index {i} | position {positions[i]} | score {float(score):.4g} | {'kept' if is_kept else 'dropped'}"
        spans.append(f'<span class="sp-tok{" sp-kept" if is_kept else ""}" data-i="{i}" style="{style}" '
                     f'title="{html.escape(tip, quote=True)}">{html.escape(tok, quote=True)}</span>')
    head = f'<div class="sp-title" style="font:bold 13px sans-serif">{html.escape(title)}</div>' if title else ""
    summary = (f'<div class="sp-summary" style="font:12px sans-serif">kept {len(kept)} of {len(tokens)} tokens '
               f'({len(kept) / max(1, len(tokens)):.1%})</div>')
    body = ('<div class="sp-tokens" style="white-space:pre-wrap;font:13px/1.7 monospace;word-break:break-word">'
            + "".join(spans) + "</div>")
    return f'<div class="sp-heatmap">{head}{_legend(list(scores), scale)}{summary}{body}</div>'


def token_strings(tokenizer, token_ids: Sequence[int]) -> list[str]:
    """Each token's own text (decoded one by one, so the spans concatenate back to the prompt)."""
    return [tokenizer.decode([t]) for t in token_ids]


def amdahl_speedup(keep_fraction: float, speculator_cost: float) -> float:
    """TTFT speedup bound when the speculator's prefill costs `speculator_cost` of the base's (prefill ~ linear)."""
    return 1.0 / (speculator_cost + keep_fraction)


# ---------------------------------------------------------------- explorer


@dataclass
class ScoreCache:
    """softmax scores [L, H, N, M] of one prompt under one model, computed once."""

    token_ids: list[int]
    scores: torch.Tensor

    @classmethod
    def from_capture(cls, token_ids: list[int], queries: torch.Tensor, keys: torch.Tensor) -> "ScoreCache":
        return cls(list(token_ids), core.attention_scores(queries, keys))

    def importance(self, config: core.SpecPrefillConfig, layer: int = -1, head: int = -1) -> torch.Tensor:
        s = self.scores[:, :, : config.look_ahead]
        if layer >= 0:
            s = s[layer:layer + 1]
        if head >= 0:
            s = s[:, head:head + 1]
        return core.aggregate(core.pool(s, config.pool_kernel), config.layer_head_agg, config.step_agg)


def hf_capture(model_path: str, look_ahead: int = 8, dtype=torch.float32) -> tuple[Callable, object]:
    """A capture function (token ids -> q, k) on the transformers engine, and its tokenizer."""
    from specprefill.engines.common import eos_ids_of, load_tokenizer
    from specprefill.engines.hf import capture_speculator, load_model

    tokenizer = load_tokenizer(model_path)
    model = load_model(model_path, dtype, capture=True)
    eos = eos_ids_of(tokenizer, model.generation_config.eos_token_id)
    return (lambda ids: capture_speculator(model, ids, look_ahead, eos)), tokenizer


class ImportanceExplorer:
    """Interactive heatmap. `capture(token_ids) -> (queries, keys)` runs the speculator; it is called once per
    prompt, every knob afterwards only re-aggregates the cached scores. `base_capture` adds a comparison panel."""

    def __init__(self, capture: Callable, tokenizer, prompt: str = "", *, samples: dict[str, str] | None = None,
                 base_capture: Callable | None = None, speculator_cost: float = 0.3,
                 config: core.SpecPrefillConfig | None = None, save_dir: str | os.PathLike = "outputs/explorer"):
        import ipywidgets as w

        self.capture, self.base_capture, self.tokenizer = capture, base_capture, tokenizer
        self.speculator_cost, self.save_dir = speculator_cost, Path(save_dir)
        config = config or core.SpecPrefillConfig()
        self.cache: ScoreCache | None = None
        self.base_cache: ScoreCache | None = None
        self.samples = samples or {}
        self.prompt = w.Textarea(value=prompt, layout=w.Layout(width="100%", height="120px"), description="prompt")
        self.sample = w.Dropdown(options=["(none)"] + list(self.samples), description="sample")
        self.run_button = w.Button(description="score prompt", button_style="primary")
        self.keep_rate = w.FloatSlider(value=config.keep_rate, min=0.01, max=1.0, step=0.01, description="keep rate")
        self.chunk_size = w.IntSlider(value=config.chunk_size, min=0, max=128, description="chunk (0=tok)")
        self.pool_kernel = w.IntSlider(value=config.pool_kernel, min=1, max=31, step=2, description="pool kernel")
        self.steps = w.IntSlider(value=config.look_ahead, min=1, max=config.look_ahead, description="look-ahead")
        self.layer_head_agg = w.Dropdown(options=core.AGGREGATIONS, value=config.layer_head_agg, description="layer×head")
        self.step_agg = w.Dropdown(options=core.AGGREGATIONS, value=config.step_agg, description="steps")
        self.layer = w.IntSlider(value=-1, min=-1, max=0, description="layer (-1=all)")
        self.head = w.IntSlider(value=-1, min=-1, max=0, description="head (-1=all)")
        self.scale = w.ToggleButtons(options=SCALES, value="linear", description="colour")
        self.save_button = w.Button(description="save HTML")
        self.stats = w.HTML()
        self.heatmap = w.HTML()
        self.compare = w.HTML()
        self.saved = w.HTML()
        knobs = [self.keep_rate, self.chunk_size, self.pool_kernel, self.steps, self.layer_head_agg, self.step_agg,
                 self.layer, self.head, self.scale]
        for knob in knobs:
            knob.observe(lambda _change: self.refresh(), names="value")
        self.sample.observe(self._pick_sample, names="value")
        self.run_button.on_click(lambda _b: self.score())
        self.save_button.on_click(lambda _b: self.save())
        self.widget = w.VBox([w.HBox([self.sample, self.run_button]), self.prompt,
                              w.HBox([w.VBox(knobs[:5]), w.VBox(knobs[5:] + [self.save_button])]),
                              self.stats, self.heatmap, self.compare, self.saved])
        if prompt:
            self.score()

    def _ipython_display_(self):
        from IPython.display import display

        display(self.widget)

    def _pick_sample(self, change) -> None:
        if change["new"] in self.samples:
            self.prompt.value = self.samples[change["new"]]

    def score(self) -> None:
        """Run the speculator (and the base, if given) once on the current prompt."""
        from specprefill.engines.common import tokenize_prompt

        ids = tokenize_prompt(self.tokenizer, self.prompt.value)
        self.cache = ScoreCache.from_capture(ids, *self.capture(ids))
        self.base_cache = ScoreCache.from_capture(ids, *self.base_capture(ids)) if self.base_capture else None
        n_layers, n_heads, n_steps, _ = self.cache.scores.shape
        self.layer.max, self.head.max = n_layers - 1, n_heads - 1
        self.steps.max = max(1, n_steps)
        self.steps.value = min(self.steps.value, n_steps)
        self.refresh()

    def current_config(self) -> core.SpecPrefillConfig:
        return core.SpecPrefillConfig(keep_rate=self.keep_rate.value, chunk_size=self.chunk_size.value,
                                      look_ahead=self.steps.value, pool_kernel=self.pool_kernel.value,
                                      layer_head_agg=self.layer_head_agg.value, step_agg=self.step_agg.value)

    def view(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Importance and kept indices of the current setting (no model call)."""
        config = self.current_config()
        importance = self.cache.importance(config, self.layer.value, self.head.value)
        return importance, core.select(importance, config)

    def refresh(self) -> None:
        if self.cache is None:
            return
        importance, kept = self.view()
        n = len(self.cache.token_ids)
        frac = len(kept) / n
        self.stats.value = (f"<b>kept {len(kept)} of {n} tokens ({frac:.1%})</b> — Amdahl TTFT bound with speculator "
                            f"cost {self.speculator_cost:.2f}: {amdahl_speedup(frac, self.speculator_cost):.2f}×")
        tokens = token_strings(self.tokenizer, self.cache.token_ids)
        self.heatmap.value = render_html(tokens, importance.tolist(), kept.tolist(), scale=self.scale.value,
                                         title="speculator importance")
        if self.base_cache is not None:
            base = self.base_cache.importance(self.current_config(), -1, -1)
            overlap = core.top_k_overlap(importance, base, len(kept))
            self.compare.value = (f"<b>base model's own importance</b> — top-{len(kept)} overlap with the speculator: "
                                  f"{overlap:.1%}" + render_html(tokens, base.tolist(), core.select(base, self.current_config()).tolist(),
                                                                 scale=self.scale.value))

    def save(self, name: str | None = None) -> Path:
        """Write the current view as a standalone HTML file (atomically) and return its path."""
        cfg = self.current_config()
        name = name or f"importance_keep{cfg.keep_rate:g}_chunk{cfg.chunk_size}_pool{cfg.pool_kernel}_n{cfg.look_ahead}.html"
        from specprefill.atomic import write_text

        page = ("<!doctype html><html><head><meta charset='utf-8'><title>specprefill token importance</title></head>"
                f"<body>{self.stats.value}{self.heatmap.value}{self.compare.value}</body></html>")
        path = write_text(self.save_dir / name, page)
        self.saved.value = f"saved {html.escape(str(path))}"
        return path


def open_explorer(speculator: str, prompt: str, config: core.SpecPrefillConfig, base: str | None = None,
                  save_dir: str = "outputs/explorer", samples: dict[str, str] | None = None) -> ImportanceExplorer:
    """The explorer on registry models (transformers capture; scores are computed once per prompt)."""
    from transformers.utils import logging as hf_logging

    from specprefill.models import resolve
    from specprefill.workbench import project_root

    hf_logging.disable_progress_bar()
    if not Path(save_dir).is_absolute():  # the same folder whether the kernel runs in notebooks/ or the root
        save_dir = project_root() / save_dir
    capture, tokenizer = hf_capture(resolve(speculator), config.look_ahead)
    base_capture = hf_capture(resolve(base), config.look_ahead)[0] if base else None
    cost = _param_ratio(resolve(speculator), resolve(base)) if base else 0.3
    return ImportanceExplorer(capture, tokenizer, prompt, samples=samples, base_capture=base_capture,
                              speculator_cost=cost, config=config, save_dir=save_dir)


def _param_ratio(speculator_path: str, base_path: str) -> float:
    """Speculator/base prefill cost, estimated by the ratio of their parameter counts."""
    from safetensors import safe_open

    def count(path):
        total = 0
        for f in Path(path).glob("*.safetensors"):
            with safe_open(str(f), "pt") as st:
                total += sum(math.prod(st.get_slice(k).get_shape()) for k in st.keys())
        return total

    return count(speculator_path) / max(1, count(base_path))
