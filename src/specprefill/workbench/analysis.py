"""The time of the prompt analysis (`structure.layout` + the structured selection, the speculator's scores given) per
prompt length and document kind, side by side: what a long prompt costs before and after the models run.

Documents are real text that installed packages ship, tiled to the length: prose (the essays the RULER haystack
uses), records (package metadata headers), code (torch's Python source) and a one-line document (the SBOM components
as minified JSON); each is a chat prompt with a question after the document, rendered with the tokenizer's
template. Times are the median of `reps` runs after one untimed run (the per-tokenizer caches warm, as in a server)."""

from __future__ import annotations

import gc
import json
import statistics
import time

import torch

from specprefill import core, structure
from specprefill.config import SELECTION_RULES, SERVING_RULE, SpecPrefillConfig
from specprefill.data import filefacts, ruler
from specprefill.errors import SpecPrefillError

KINDS = ("prose", "records", "code", "one-line")


def document(kind: str) -> str:
    """One kind's real text (before tiling)."""
    if kind == "prose":
        return ruler._essays()
    if kind == "records":
        return "\n\n".join(f.text for f in filefacts.metadata_facts())
    if kind == "code":
        root = filefacts._package_dir("torch") / "nn" / "modules"
        return "\n\n".join(p.read_text() for p in sorted(root.glob("*.py")))
    if kind == "one-line":
        return json.dumps([json.loads(f.text) for f in filefacts.sbom_facts()], separators=(",", ":"))
    raise SpecPrefillError(f"document kind {kind!r} is unknown: use {', '.join(KINDS)}")


def prompt_ids(tokenizer, kind: str, length: int) -> list[int]:
    """A chat prompt of `length` tokens: the kind's text tiled and cut to fit, a question after it."""
    text = document(kind)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    ids = (ids * (length // max(1, len(ids)) + 1))[:length]
    body = tokenizer.decode(ids)
    messages = [{"role": "user", "content": f"{body}\n\nWhat does the entry above say about its version?"}]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return list(tokenizer(rendered, add_special_tokens=False)["input_ids"])


def analysis_seconds(tokenizer, ids: list[int], config: SpecPrefillConfig, reps: int) -> dict:
    """Median seconds of the layout alone and of the layout plus the selection (random scores), over `reps` runs."""
    importance = torch.rand(len(ids), generator=torch.Generator().manual_seed(0))
    layout_s, total_s = [], []
    for rep in range(reps + 1):
        gc.collect()  # what an earlier run left is not collected inside this one's timing
        t0 = time.perf_counter()
        layout = structure.layout(tokenizer, ids, config)
        t1 = time.perf_counter()
        core.select(importance, config, layout)
        t2 = time.perf_counter()
        if rep:  # the first run warms what a server has warm (the chat format, imports)
            layout_s.append(t1 - t0)
            total_s.append(t2 - t0)
    return {"layout_s": statistics.median(layout_s), "total_s": statistics.median(total_s)}


def run(tokenizer, lengths: list[int], kinds: list[str], reps: int, keep_rate: float = 0.1) -> list[dict]:
    """One row per (kind, length): tokens, median times, ms per 16k tokens and the growth from the previous length."""
    config = SpecPrefillConfig(keep_rate=keep_rate, **SELECTION_RULES[SERVING_RULE])
    rows = []
    for kind in kinds:
        before = None
        for length in lengths:
            ids = prompt_ids(tokenizer, kind, length)
            t = analysis_seconds(tokenizer, ids, config, reps)
            row = {"kind": kind, "tokens": len(ids), **t, "ms_per_16k": 1000 * t["total_s"] * 16384 / len(ids)}
            if before is not None:
                row["growth"] = t["total_s"] / before["total_s"]
                row["length_ratio"] = len(ids) / before["tokens"]
            rows.append(row)
            before = row
    return rows
