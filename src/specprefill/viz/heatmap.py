"""The token-importance heatmap as HTML: pure rendering, no model, no widget.

`render_html` output is self-contained: inline styles only, no scripts, no external references, so it works
offline, inside a notebook, in exported HTML and as a file (`page`).
"""

from __future__ import annotations

import html
import math
from collections.abc import Iterable, Sequence

HEAT_RGB = (214, 39, 40)  # the colour of the highest score; lower scores blend toward white
SCALES = ("linear", "log")
NO_SCORE = "rgb(200,200,200)"  # a token whose score is NaN or infinite


def intensity(scores: Sequence[float], scale: str = "linear") -> list[float]:
    """Scores -> [0, 1], monotonic non-decreasing in the score; NaN/inf (no score) -> NaN. Log scale spreads out
    small attention values."""
    if scale not in SCALES:
        raise ValueError(f"scale {scale!r} is unknown: use one of {SCALES}")
    values = [float(s) for s in scores]
    finite = [v for v in values if math.isfinite(v)]
    if scale == "log":
        floor = max(min((v for v in finite if v > 0), default=1e-12), 1e-12)
        values = [math.log(max(v, floor)) if math.isfinite(v) else v for v in values]
        finite = [v for v in values if math.isfinite(v)]
    if not finite:
        return [math.nan] * len(values)
    lo, hi = min(finite), max(finite)
    return [math.nan if not math.isfinite(v) else 0.0 if hi == lo else (v - lo) / (hi - lo) for v in values]


def heat_colour(level: float) -> str:
    r, g, b = (round(255 - level * (255 - c)) for c in HEAT_RGB)
    return f"rgb({r},{g},{b})"


def _legend(scores: Sequence[float], scale: str) -> str:
    stops = ", ".join(heat_colour(x / 4) for x in range(5))
    finite = [float(s) for s in scores if math.isfinite(float(s))]
    lo, hi = (min(finite), max(finite)) if finite else (0.0, 0.0)
    return (
        '<div class="sp-legend" style="display:flex;align-items:center;gap:8px;margin:6px 0;font:12px sans-serif">'
        f'<span>{lo:.3g}</span><span style="display:inline-block;width:160px;height:12px;'
        f'background:linear-gradient(to right, {stops});border:1px solid #999"></span><span>{hi:.3g}</span>'
        f"<span>({html.escape(scale)} scale)</span>"
        '<span style="outline:2px solid #1f77b4;padding:0 3px">kept</span>'
        '<span style="opacity:0.4;padding:0 3px">dropped</span></div>'
    )


def render_html(
    tokens: Sequence[str],
    scores: Sequence[float],
    kept: Iterable[int],
    *,
    positions: Sequence[int] | None = None,
    scale: str = "linear",
    title: str | None = None,
    hovers: Sequence[str] | None = None,
) -> str:
    """One <span> per token: background from the score, kept tokens outlined, dropped ones dimmed, text escaped,
    whitespace kept; a hover title gives index, original position and score (plus `hovers[i]` when given)."""
    if len(tokens) != len(scores):
        raise ValueError(f"{len(tokens)} tokens but {len(scores)} scores")
    kept = set(int(i) for i in kept)
    positions = list(range(len(tokens))) if positions is None else list(positions)
    levels = intensity(list(scores), scale)
    spans = []
    for i, (tok, score, level) in enumerate(zip(tokens, scores, levels)):
        is_kept = i in kept
        scored = math.isfinite(level)
        style = f"background-color:{heat_colour(level) if scored else NO_SCORE};" + (
            "outline:1px solid #1f77b4;" if is_kept else "opacity:0.4;"
        )
        shown = f"{float(score):.4g}" if scored else "no score"
        tip = f"index {i} | position {positions[i]} | score {shown} | {'kept' if is_kept else 'dropped'}"
        if hovers is not None:
            tip += f" | {hovers[i]}"
        spans.append(
            f'<span class="sp-tok{" sp-kept" if is_kept else ""}" data-i="{i}" style="{style}" '
            f'title="{html.escape(tip, quote=True)}">{html.escape(tok, quote=True)}</span>'
        )
    head = f'<div class="sp-title" style="font:bold 13px sans-serif">{html.escape(title)}</div>' if title else ""
    summary = (
        f'<div class="sp-summary" style="font:12px sans-serif">kept {len(kept)} of {len(tokens)} tokens '
        f"({len(kept) / max(1, len(tokens)):.1%})</div>"
    )
    body = (
        '<div class="sp-tokens" style="white-space:pre-wrap;font:13px/1.7 monospace;word-break:break-word">'
        + "".join(spans)
        + "</div>"
    )
    return f'<div class="sp-heatmap">{head}{_legend(list(scores), scale)}{summary}{body}</div>'


def token_strings(tokenizer, token_ids: Sequence[int]) -> list[str]:
    """Each token's own text (decoded one by one, so the spans concatenate back to the prompt)."""
    return [tokenizer.decode([t]) for t in token_ids]


def page(*parts: str, title: str = "specprefill token importance") -> str:
    """A standalone HTML document around rendered parts (what `importance --html` and the explorer's save write)."""
    return (
        f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title></head>"
        f"<body>{''.join(parts)}</body></html>"
    )
