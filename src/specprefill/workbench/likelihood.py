"""The paired fidelity measure beside exact match, in the same pass (`quality(..., fidelity=True)`): per prompt, the
gold answer's log-likelihood per token under the variant's prefill (`loglik`), its difference to full prefill's
(`delta_loglik`) and KL(full || variant) of the first answer token (`kl`), from `core.likelihood`; `table` puts an
interval and a verdict on each cell.

Verdicts, with their margins (written where a verdict is shown, `MARGIN_NOTE`):
  delta_loglik  the paired difference's interval (BCa bootstrap over prompts, or documents where questions share
                one) read by `stats.verdict`: "lower" below 0, "higher" above, "no difference found" within
                +-MARGIN_NATS, else "too few samples to separate"
  kl            "same" when the interval's upper end is at most MARGIN_NATS, "differs" when its lower end is above
                it, else "too few samples to separate"."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import pandas as pd

from specprefill import core
from specprefill.workbench import stats

VERSION = 1  # in a unit's key: bump when the measure's rows change
MARGIN_NATS = stats.MARGIN / stats.SCALE  # 0.1 nats per answer token: the gold answer's probability within ~10%
MARGIN_NOTE = (
    f"fidelity, paired per prompt: delta_loglik = the gold answer's log-likelihood per token, variant - full prefill "
    f"(nats, BCa 95%; 'no difference found' = interval within +-{MARGIN_NATS:g}); kl = KL(full || variant) of the "
    f"first answer token (nats; 'same' = upper end <= {MARGIN_NATS:g})"
)


def gold_ids(tokenizer, record: dict) -> list[int] | None:
    """The record's gold answer in the base's tokens as it would follow the prompt: after a space where the prompt
    ends in a word or a colon ("... are", "Answer:"), directly after a chat template's line break; every reference
    of an "all" metric, comma-separated, else the first. None for a record without one (code scored by tests)."""
    outputs = record.get("outputs") or []
    if record.get("metric") == "pass@1" or not outputs:
        return None
    text = (", ".join(map(str, outputs)) if record.get("metric") == "all" else str(outputs[0])).strip()
    prompt = str(record.get("input") or "")
    space = " " if prompt and not prompt[-1].isspace() else ""
    ids = list(tokenizer(space + text, add_special_tokens=False)["input_ids"]) if text else []
    return ids or None


def fit_columns(
    llm,
    prompts: list[list[int]],
    answers: list[list[int] | None],
    kept: list[list[int] | None],
    restore_positions: bool,
    full: Callable[[], list[core.AnswerFit | None]],
) -> list[dict]:
    """Per prompt, the variant's `loglik`, `delta_loglik` and `kl` against full prefill's fits (`full()`, computed
    once per task by the caller); a prompt without a gold answer gets none."""
    todo = [i for i, a in enumerate(answers) if a is not None and fits_context(llm, prompts[i], a)]
    reference = full()
    whole = all(k is None for k in kept)
    mine = (
        [reference[i] for i in todo]
        if whole
        else llm.answer_fits(
            [prompts[i] for i in todo], [answers[i] for i in todo], [kept[i] for i in todo], restore_positions
        )
    )
    out: list[dict] = [{} for _ in prompts]
    for i, fit in zip(todo, mine):
        ref = reference[i]
        assert ref is not None and fit is not None
        out[i] = {"loglik": fit.mean_logprob, **core.compare_fits(ref, fit)}
    return out


def fits_context(llm, prompt: list[int], answer: list[int]) -> bool:
    """Whether the prompt and its gold answer fit in one request of the engine (`max_model_len`, when it has one)."""
    limit = getattr(llm, "max_model_len", None)
    return not isinstance(limit, int) or len(prompt) + len(answer) <= limit


def full_fits(llm, prompts: list[list[int]], answers: list[list[int] | None]) -> list[core.AnswerFit | None]:
    """Full prefill's fit of every prompt that has a gold answer and room for it in the engine's context (None for
    the others: no measure, counted out of the cell's n)."""
    todo = [i for i, a in enumerate(answers) if a is not None and fits_context(llm, prompts[i], a)]
    got = llm.answer_fits([prompts[i] for i in todo], [answers[i] for i in todo], [None] * len(todo))
    out: list[core.AnswerFit | None] = [None] * len(prompts)
    for i, fit in zip(todo, got):
        out[i] = fit
    return out


def lazy_full_fits(llm, prompts: dict[str, list[list[int]]], records: dict[str, list[dict]]) -> dict[str, Callable]:
    """Per task, full prefill's fits computed on the first call only (a resumed run whose units are all done
    computes none)."""

    def one(task: str) -> Callable[[], list[core.AnswerFit | None]]:
        return functools.cache(
            lambda: full_fits(llm, prompts[task], [gold_ids(llm.tokenizer, r) for r in records[task]])
        )

    return {task: one(task) for task in records}


def kl_verdict(high: float, low: float) -> str:
    if not math.isnan(high) and high <= MARGIN_NATS:
        return "same"
    if not math.isnan(low) and low > MARGIN_NATS:
        return "differs"
    return "too few samples to separate"


def table(rows: list[dict], by: tuple[str, ...] = ("task", "label", "keep_rate")) -> pd.DataFrame:
    """One row per cell other than full prefill: the mean paired difference of the gold answer's log-likelihood per
    token with its interval and verdict, and the mean first-token KL with its interval and verdict (module
    docstring); empty when no row carries the measure."""
    have = [r for r in rows if r.get("loglik") is not None and math.isfinite(r["loglik"])]
    if not have or not any(r.get("label") == "full" for r in have):
        return pd.DataFrame()
    ll = stats.summarize(have, by, value="loglik", scale=1.0)
    ll = ll[ll["label"] != "full"] if "label" in ll else ll
    keep = {"diff_vs_full": "delta_loglik", "diff_low": "dl_low", "diff_high": "dl_high", "verdict": "loglik_verdict"}
    ll = ll[[*by, "n", *keep]].rename(columns=keep)
    pruned = [r for r in have if r.get("label") != "full"]
    kl = stats.summarize(pruned, by, value="kl", scale=1.0)[[*by, "kl", "ci_low", "ci_high"]]
    kl = kl.rename(columns={"ci_low": "kl_low", "ci_high": "kl_high"})
    zero = kl["kl"] == 0  # every prompt the same distribution: nothing for the bootstrap to spread
    kl.loc[zero, ["kl_low", "kl_high"]] = 0.0
    kl["kl_verdict"] = [kl_verdict(h, lo) for h, lo in zip(kl["kl_high"], kl["kl_low"])]
    return ll.merge(kl, on=list(by), how="left")
