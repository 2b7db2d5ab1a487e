"""The token-importance heatmap as HTML: pure rendering, no model, no widget.

`render_html` output is self-contained: inline styles (plus one focus rule), no scripts, no external references, so it
works offline, inside a notebook, in exported HTML and as a file (`page`). It is readable by everyone: every token is
focusable and named for screen readers, and text colours are set with their backgrounds (a dark notebook theme's light
text never lands on the white heatmap) at a WCAG AA contrast of at least 4.5:1.
"""

from __future__ import annotations

import html
import math
from collections.abc import Iterable, Sequence

RGB = tuple[int, int, int]
HEAT_RGB: RGB = (214, 39, 40)  # the colour of the highest score; lower scores blend toward white
NO_SCORE: RGB = (200, 200, 200)  # a token whose score is NaN or infinite
BLACK: RGB = (0, 0, 0)
WHITE: RGB = (255, 255, 255)
DROPPED_WEIGHT = 0.4  # a dropped token's background keeps this much of its colour, the rest white: dimmed
DROPPED_TEXT: RGB = (68, 68, 68)  # dimmed too, yet >= 4.5:1 on every dropped background (tests/test_viz.py proves it)
KEPT_OUTLINE = "outline:2px solid #1f77b4"  # the kept tokens' mark, in the legend as on the tokens
# inline styles cannot say :focus, and a kept token's own outline would hide the browser's focus ring
FOCUS_CSS = "<style>.sp-heatmap .sp-tok:focus-visible{outline:3px solid #000!important;outline-offset:1px}</style>"
SCALES = ("linear", "log")


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


def _toward_white(rgb: RGB, weight: float) -> RGB:
    r, g, b = (round(255 - weight * (255 - c)) for c in rgb)
    return r, g, b


def hex_colour(rgb: RGB) -> str:
    return "#{:02x}{:02x}{:02x}".format(*rgb)


def heat_colour(level: float) -> str:
    return hex_colour(_toward_white(HEAT_RGB, level))


def luminance(rgb: RGB) -> float:
    """WCAG 2 relative luminance of an sRGB colour: 0 (black) to 1 (white)."""
    r, g, b = ((c / 255 / 12.92) if c / 255 <= 0.04045 else ((c / 255 + 0.055) / 1.055) ** 2.4 for c in rgb)
    return 0.2126 * r + 0.7152 * g + 0.0722 * b


def contrast(a: RGB, b: RGB) -> float:
    """WCAG 2 contrast ratio, 1 to 21 (AA asks at least 4.5 of text)."""
    hi, lo = sorted((luminance(a), luminance(b)), reverse=True)
    return (hi + 0.05) / (lo + 0.05)


def token_colours(level: float, kept: bool) -> tuple[RGB, RGB]:
    """(background, text) of a token at `level` (NaN: no score). A kept token's text is black or white, whichever
    contrasts more with its background: at least 4.58:1 whatever the background, where black alone would be 4.2:1 on
    the hottest red. A dropped token is dimmed: background faded toward white, text dark grey."""
    background = _toward_white(HEAT_RGB, level) if math.isfinite(level) else NO_SCORE
    if not kept:
        return _toward_white(background, DROPPED_WEIGHT), DROPPED_TEXT
    return background, max(BLACK, WHITE, key=lambda text: contrast(background, text))


def token_style(level: float, kept: bool) -> str:
    """A token's inline style; the legend's kept and dropped samples use it too, so they look like the tokens."""
    background, text = token_colours(level, kept)
    return f"background:{hex_colour(background)};color:{hex_colour(text)}" + (f";{KEPT_OUTLINE}" if kept else "")


def _legend(scores: Sequence[float], scale: str) -> str:
    stops = ", ".join(heat_colour(x / 4) for x in range(5))
    finite = [float(s) for s in scores if math.isfinite(float(s))]
    lo, hi = (min(finite), max(finite)) if finite else (0.0, 0.0)
    return (
        '<div class="sp-legend" style="display:flex;align-items:center;gap:8px;margin:6px 0;font:12px sans-serif">'
        f'<span>{lo:.3g}</span><span style="display:inline-block;width:160px;height:12px;'
        f'background:linear-gradient(to right, {stops});border:1px solid #999"></span><span>{hi:.3g}</span>'
        f"<span>({html.escape(scale)} scale)</span>"
        f'<span style="{token_style(1.0, True)};padding:0 3px">kept</span>'
        f'<span style="{token_style(1.0, False)};padding:0 3px">dropped</span></div>'
    )


def _spoken(token: str) -> str:
    """A token as a screen reader should say it: its text without surrounding whitespace, or, when it is all
    whitespace, its escaped form ('\\n')."""
    return token.strip() or repr(token)


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
    whitespace kept. Each token can take the keyboard focus (tabindex) and is a list item named by its text, score and
    whether it was kept (aria-label), which is what a screen reader says; a hover title gives index, original
    position, score and kept or dropped (plus `hovers[i]` when given), and is what the screen reader adds after."""
    if len(tokens) != len(scores):
        raise ValueError(f"{len(tokens)} tokens but {len(scores)} scores")
    kept = set(int(i) for i in kept)
    positions = list(range(len(tokens))) if positions is None else list(positions)
    levels = intensity(list(scores), scale)
    spans = []
    for i, (tok, score, level) in enumerate(zip(tokens, scores, levels)):
        is_kept = i in kept
        scored = f"score {float(score):.4g}" if math.isfinite(level) else "no score"
        state = "kept" if is_kept else "dropped"
        tip = f"index {i} | position {positions[i]} | {scored} | {state}"
        if hovers is not None:
            tip += f" | {hovers[i]}"
        label = html.escape(f"{_spoken(tok)}, {scored}, {state}", quote=True)
        spans.append(
            f'<span class="sp-tok{" sp-kept" if is_kept else ""}" data-i="{i}" style="{token_style(level, is_kept)}" '
            f'title="{html.escape(tip, quote=True)}" tabindex="0" role="listitem" aria-label="{label}">'
            f"{html.escape(tok, quote=True)}</span>"
        )
    head = f'<div class="sp-title" style="font:bold 13px sans-serif">{html.escape(title)}</div>' if title else ""
    summary = (
        f'<div class="sp-summary" style="font:12px sans-serif">kept {len(kept)} of {len(tokens)} tokens '
        f"({len(kept) / max(1, len(tokens)):.1%})</div>"
    )
    body = (
        '<div class="sp-tokens" role="list" aria-label="prompt tokens, coloured by importance" '
        'style="white-space:pre-wrap;font:13px/1.7 monospace;word-break:break-word">' + "".join(spans) + "</div>"
    )
    return (
        f'<div class="sp-heatmap" style="background:#fff;color:#000;padding:4px">{FOCUS_CSS}{head}'
        f"{_legend(list(scores), scale)}{summary}{body}</div>"
    )


def token_strings(tokenizer, token_ids: Sequence[int]) -> list[str]:
    """Each token's own text (decoded one by one, so the spans concatenate back to the prompt)."""
    return [tokenizer.decode([t]) for t in token_ids]


def page(*parts: str, title: str = "specprefill token importance") -> str:
    """A standalone HTML document around rendered parts (what `importance --html` and the explorer's save write),
    with the language and main landmark screen readers look for."""
    return (
        f"<!doctype html><html lang='en'><head><meta charset='utf-8'><title>{html.escape(title)}</title></head>"
        f"<body><main>{''.join(parts)}</main></body></html>"
    )
