"""MMLU scored as the original repository's patched task scored it (eval/lm_eval_patch/mmlu_generative)."""

from __future__ import annotations

import re

_FIRST_LETTER = re.compile(r"\s*([A-Za-z])")


def first_letter_match(doc: dict, results: list[str]) -> dict:
    """MMLU: a hit when the answer's first letter (after any spaces, either case) is the right choice's letter."""
    found = _FIRST_LETTER.match(results[0])
    target = "ABCD"[doc["answer"]]
    return {"exact_match": float(found is not None and found.group(1).upper() == target)}
