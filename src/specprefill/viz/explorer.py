"""The ipywidgets token-importance explorer: the speculator runs once per prompt, every knob afterwards only
re-aggregates its cached attention scores with `core`'s own pooling, aggregation and selection."""

from __future__ import annotations

import html
import os
from collections.abc import Callable
from pathlib import Path

import ipywidgets as w
import torch
from IPython.display import display

from specprefill import core, models, structure, tokenmap
from specprefill.atomic import write_text
from specprefill.config import UNITS, EngineParams, SpecPrefillConfig
from specprefill.engines import scoring
from specprefill.engines.common import tokenize_prompt
from specprefill.errors import SpecPrefillError
from specprefill.models import resolve
from specprefill.project import project_root
from specprefill.viz.heatmap import SCALES, page, render_html, token_strings


def amdahl_speedup(keep_fraction: float, speculator_cost: float) -> float:
    """TTFT speedup bound when the speculator's prefill costs `speculator_cost` of the base's (prefill ~ linear)."""
    return 1.0 / (speculator_cost + keep_fraction)


def _scores(capture: Callable, token_ids: list[int]) -> core.ScoreCache:
    got = capture(token_ids)
    return got if isinstance(got, core.ScoreCache) else core.ScoreCache.from_capture(token_ids, *got)


class ImportanceExplorer:
    """Interactive heatmap. `capture(token_ids)` runs the speculator: it returns (queries, keys[, rules]) or the
    scores themselves (`core.ScoreCache`, e.g. a `scoring.Scorer`'s); it is called once per prompt, every knob
    afterwards only re-aggregates the cached scores. `base_capture` adds a comparison panel.
    `base_tokenizer` (a base with another tokenizer): the heatmap shows base tokens with the speculator's importance
    moved onto them (`tokenmap`), and each token's hover lists the speculator tokens it overlaps."""

    def __init__(
        self,
        capture: Callable,
        tokenizer,
        prompt: str = "",
        *,
        samples: dict[str, str] | None = None,
        base_capture: Callable | None = None,
        speculator_cost: float = 0.3,
        config: SpecPrefillConfig | None = None,
        save_dir: str | os.PathLike = "outputs/explorer",
        base_tokenizer=None,
    ):
        self.capture, self.base_capture = capture, base_capture
        self.pair = tokenmap.Pair(tokenizer, base_tokenizer)
        self.tokenizer = base_tokenizer if self.pair.cross else tokenizer  # the tokens shown
        self.tmap: tokenmap.TokenMap | None = None
        self.base_ids: list[int] = []
        self.layout: core.Layout | None = None
        self.hovers: list[str] | None = None
        self.speculator_cost, self.save_dir = speculator_cost, Path(save_dir)
        config = config or SpecPrefillConfig()
        self.cache: core.ScoreCache | None = None
        self.base_cache: core.ScoreCache | None = None
        self.samples = samples or {}
        self.prompt = w.Textarea(value=prompt, layout=w.Layout(width="100%", height="120px"), description="prompt")
        self.sample = w.Dropdown(options=["(none)"] + list(self.samples), description="sample")
        self.run_button = w.Button(description="score prompt", button_style="primary")
        knobs = self._knobs(config)
        self.save_button = w.Button(description="save HTML")
        self.stats, self.heatmap, self.compare, self.saved = w.HTML(), w.HTML(), w.HTML(), w.HTML()
        for knob in knobs:
            knob.observe(lambda _change: self.refresh(), names="value")
        self.sample.observe(self._pick_sample, names="value")
        self.run_button.on_click(lambda _b: self.score())
        self.save_button.on_click(lambda _b: self.save())
        self.widget = w.VBox(
            [
                w.HBox([self.sample, self.run_button]),
                self.prompt,
                w.HBox([w.VBox(knobs[:5]), w.VBox(knobs[5:] + [self.save_button])]),
                self.stats,
                self.heatmap,
                self.compare,
                self.saved,
            ]
        )
        if prompt:
            self.score()

    def _knobs(self, config: SpecPrefillConfig) -> list:
        """The knobs' widgets, from `config`'s values: every change re-aggregates the cached scores."""
        self.keep_rate = w.FloatSlider(value=config.keep_rate, min=0.01, max=1.0, step=0.01, description="keep rate")
        self.chunk_size = w.IntSlider(value=config.chunk_size, min=0, max=128, description="chunk (0=tok)")
        self.pool_kernel = w.IntSlider(value=config.pool_kernel, min=1, max=31, step=2, description="pool kernel")
        self.steps = w.IntSlider(value=config.look_ahead, min=1, max=config.look_ahead, description="look-ahead")
        self.layer_head_agg = w.Dropdown(
            options=core.AGGREGATIONS, value=config.layer_head_agg, description="layer×head"
        )
        self.step_agg = w.Dropdown(options=core.AGGREGATIONS, value=config.step_agg, description="steps")
        self.units = w.Dropdown(options=UNITS, value=config.selection_unit, description="units")
        self.protect = w.Checkbox(value=config.protect, description="protect question")
        self.layer = w.IntSlider(value=-1, min=-1, max=0, description="layer (-1=all)")
        self.head = w.IntSlider(value=-1, min=-1, max=0, description="head (-1=all)")
        self.scale = w.ToggleButtons(options=SCALES, value="linear", description="colour")
        return [
            self.keep_rate,
            self.chunk_size,
            self.pool_kernel,
            self.steps,
            self.layer_head_agg,
            self.step_agg,
            self.units,
            self.protect,
            self.layer,
            self.head,
            self.scale,
        ]

    def _ipython_display_(self):
        display(self.widget)

    def _pick_sample(self, change) -> None:
        if change["new"] in self.samples:
            self.prompt.value = self.samples[change["new"]]

    def score(self) -> None:
        """Run the speculator (and the base, if given) once on the current prompt."""
        self.base_ids = ids = tokenize_prompt(self.tokenizer, self.prompt.value)
        self.layout = None  # lines, records and protected spans: read when a knob needs them
        self.tmap = self.pair.map(ids)
        spec_ids = self.pair.speculator_ids(ids, self.tmap)
        self.cache = _scores(self.capture, spec_ids)
        self.base_cache = _scores(self.base_capture, ids) if self.base_capture else None
        self.hovers = speculator_hovers(self.pair.spec_tok, self.tmap) if self.tmap is not None else None
        n_layers, n_heads, n_steps, _ = self.cache.scores.shape
        self.layer.max, self.head.max = n_layers - 1, n_heads - 1
        self.steps.max = max(1, n_steps)
        self.steps.value = min(self.steps.value, n_steps)
        self.refresh()

    def current_config(self) -> SpecPrefillConfig:
        return SpecPrefillConfig(
            keep_rate=self.keep_rate.value,
            chunk_size=self.chunk_size.value,
            look_ahead=self.steps.value,
            pool_kernel=self.pool_kernel.value,
            layer_head_agg=self.layer_head_agg.value,
            step_agg=self.step_agg.value,
            selection_unit=self.units.value,
            protect=self.protect.value,
        )

    def view(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Importance and kept indices of the current setting (no model call)."""
        config = self.current_config()
        assert self.cache is not None, "score a prompt first"
        importance = self.cache.importance(config, self.layer.value, self.head.value)
        if self.tmap is not None:
            importance = self.tmap.project(importance, config.cross_token_agg)
        if config.needs_layout and self.layout is None:
            self.layout = structure.layout(self.tokenizer, self.base_ids)
        return importance, core.select(importance, config, self.layout)

    def refresh(self) -> None:
        if self.cache is None:
            return
        try:
            config = self.current_config()
            importance, kept = self.view()
        except SpecPrefillError as e:  # a combination of knobs that does not go together (units x chunk 0)
            self.stats.value = f"<b>{html.escape(str(e))}</b>"
            return
        n = len(self.base_ids)
        frac = len(kept) / n
        self.stats.value = (
            f"<b>kept {len(kept)} of {n} tokens ({frac:.1%})</b> — Amdahl TTFT bound with speculator "
            f"cost {self.speculator_cost:.2f}: {amdahl_speedup(frac, self.speculator_cost):.2f}×"
        )
        tokens = token_strings(self.tokenizer, self.base_ids)
        title = "speculator importance" + (" (moved onto the base's tokens)" if self.tmap is not None else "")
        self.heatmap.value = render_html(
            tokens, importance.tolist(), kept.tolist(), scale=self.scale.value, title=title, hovers=self.hovers
        )
        if self.base_cache is not None:
            base = self.base_cache.importance(config, -1, -1)
            overlap = core.top_k_overlap(importance, base, len(kept))
            self.compare.value = (
                f"<b>base model's own importance</b> — top-{len(kept)} overlap with the speculator: "
                f"{overlap:.1%}"
                + render_html(
                    tokens, base.tolist(), core.select(base, config, self.layout).tolist(), scale=self.scale.value
                )
            )

    def save(self, name: str | None = None) -> Path:
        """Write the current view as a standalone HTML file (atomically) and return its path."""
        cfg = self.current_config()
        name = (
            name
            or f"importance_keep{cfg.keep_rate:g}_chunk{cfg.chunk_size}_pool{cfg.pool_kernel}_n{cfg.look_ahead}.html"
        )
        path = write_text(self.save_dir / name, page(self.stats.value, self.heatmap.value, self.compare.value))
        self.saved.value = f"saved {html.escape(str(path))}"
        return path


def speculator_hovers(spec_tokenizer, tmap: tokenmap.TokenMap) -> list[str]:
    """Per base token: the speculator tokens whose characters overlap it, as they would be shown on hover."""
    spans = [torch.tensor(x, dtype=torch.long).reshape(-1, 2) for x in (tmap.base_spans, tmap.spec_spans)]
    base, spec = core.span_overlaps(*spans)
    pieces = [repr(t) for t in token_strings(spec_tokenizer, tmap.spec_ids)]
    per_base: list[list[str]] = [[] for _ in tmap.base_spans]
    for b, s in zip(base.tolist(), spec.tolist()):
        per_base[b].append(f"#{s} {pieces[s]}")
    return ["speculator tokens: " + (", ".join(p) if p else "none") for p in per_base]


def open_explorer(
    speculator: str,
    prompt: str,
    config: SpecPrefillConfig,
    base: str | None = None,
    save_dir: str | Path = "outputs/explorer",
    samples: dict[str, str] | None = None,
    scorer: str = "hf",
    params: EngineParams | None = None,
) -> ImportanceExplorer:
    """The explorer on registry models; scores are computed once per prompt, by `scorer` ("hf": transformers on the
    CPU; "vllm": the vLLM workers' capture, each model on its own engine as `params` size it: the base on its
    tensor-parallel ranks, so a 70B or 405B base can be compared on GPUs)."""
    from transformers.utils import logging as hf_logging  # lazy: transformers (~1.3 s) only once a model loads

    hf_logging.disable_progress_bar()
    if not Path(save_dir).is_absolute():  # the same folder whether the kernel runs in notebooks/ or the root
        save_dir = project_root() / save_dir
    params = params or EngineParams(speculator=speculator, base=base)
    spec_path = models.resolve_speculator(speculator, base)
    if scorer == "vllm" and base:  # both engines stay alive: they share each GPU as a pair's do
        params = scoring.concurrent_shares(params, spec_path, resolve(base))
    spec_scorer = scoring.open_scorer(
        spec_path, scorer, config.look_ahead, scoring.capture_params(params, spec_path, "speculator")
    )
    base_scorer = (
        scoring.open_scorer(
            resolve(base), scorer, config.look_ahead, scoring.capture_params(params, resolve(base), "base")
        )
        if base
        else None
    )
    cost = models.param_count(spec_path) / max(1, models.param_count(resolve(base))) if base else 0.3
    return ImportanceExplorer(
        spec_scorer,
        spec_scorer.tokenizer,
        prompt,
        samples=samples,
        base_capture=base_scorer,
        speculator_cost=cost,
        config=config,
        save_dir=save_dir,
        base_tokenizer=base_scorer.tokenizer if base_scorer else None,
    )
