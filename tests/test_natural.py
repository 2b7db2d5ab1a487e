"""Natural-text multi-document QA (`data.natural`): several questions per document, and intervals that count
documents, not questions (`workbench.stats.per_document`)."""

from __future__ import annotations

import random

import pandas as pd
import pytest

from specprefill.data import natural
from specprefill.data.tasks import squad
from specprefill.errors import SpecPrefillError
from specprefill.workbench import cost, power, records, stats


@pytest.fixture(scope="module")
def tok(smollm2):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2)


def test_each_document_is_asked_its_questions_over_one_shared_text(tok):
    recs = natural.generate(tok, 1600, 3, 3, seed=2)
    assert recs == natural.generate(tok, 1600, 3, 3, seed=2)  # deterministic
    assert [r["doc"] for r in recs] == [d for d in range(3) for _ in range(3)]
    assert [r["index"] for r in recs] == list(range(9))  # a prompt's index is its own, the document its doc
    by_question = {r["question"]: r for r in squad()}
    asked = []
    for d in range(3):
        doc = [r for r in recs if r["doc"] == d]
        heads = {r["input"][: r["input"].rindex("Question: ") + len("Question: ")] for r in doc}
        assert len(heads) == 1  # the prompts differ in their question only
        (shared,) = heads
        contexts = set()
        for r in doc:
            assert r["length"] == len(tok(r["input"])["input_ids"]) <= 1600 and r["length"] > 1000
            question = r["input"][len(shared) :].removesuffix(" Answer:")
            gold = by_question[question]
            assert gold["answers"] == r["outputs"] and gold["context"] in shared  # its paragraph is in the document
            contexts.add(gold["context"])
            asked.append(question)
        assert len(contexts) == 3  # three distinct answer paragraphs, each a distractor for the other questions
    assert len(set(asked)) == 9  # no question asked twice


def test_answer_paragraphs_sit_at_varied_depths(tok):
    depths = []
    for r in natural.generate(tok, 1200, 6, 2, seed=0):
        gold = next(g for g in squad() if r["input"].endswith(f"Question: {g['question']} Answer:"))
        depths.append(r["input"].index(gold["context"]) / len(r["input"]))
    assert min(depths) < 0.35 and max(depths) > 0.65


def test_bad_requests_name_the_fix(tok):
    with pytest.raises(SpecPrefillError, match="at least one document"):
        natural.generate(tok, 900, 0, 3)
    with pytest.raises(SpecPrefillError, match="lower n_samples or questions_per_document"):
        natural.generate(tok, 1200, 400, 3)
    with pytest.raises(SpecPrefillError, match="distractor paragraphs fill about .* use a length of at most"):
        natural.generate(tok, 200_000, 1, 1)
    with pytest.raises(SpecPrefillError, match="questions_per_document applies to natural_qa only"):
        records.long_context_records("analogue", tok, 900, 2, [], questions_per_document=3)
    assert list(records.long_context_records("natural_qa", tok, 1200, 1, [], questions_per_document=2)) == [
        "natural_qa"
    ]


def _rows(n_docs: int, per_doc: int, seed: int = 0) -> list[dict]:
    """Paired rows where each document's questions all share one outcome (the extreme of dependence)."""
    rng, rows = random.Random(seed), []
    for d in range(n_docs):
        full = 100.0 if rng.random() < 0.6 else 0.0
        pruned = full if rng.random() < 0.75 else 100.0 - full
        for q in range(per_doc):
            for label, rate, value, kept in (("full", 1.0, full, 900), ("x", 0.1, pruned, 90)):
                row = {"task": "t", "label": label, "keep_rate": rate, "index": d * per_doc + q, "doc": d}
                rows.append(row | {"score": value, "n_prompt": 900, "n_kept": kept})
    return rows


def test_questions_of_one_document_count_once():
    """Copies of one answer per document add no evidence: the interval is the one of a question per document, and
    n counts documents; without `doc` each question would count (a narrower interval)."""
    one = stats.summarize(_rows(30, 1)).set_index("label")
    five = stats.summarize(_rows(30, 5)).set_index("label")
    for column in ("score", "n", "diff_vs_full", "n_paired", "verdict", "kept_fraction"):
        assert five.loc["x", column] == one.loc["x", column], column
    assert five.loc["x", "diff_low"] == pytest.approx(one.loc["x", "diff_low"], abs=3)
    assert five.loc["x", "n"] == 30 and five.loc["x", "questions"] == 150
    flat = stats.summarize([{k: v for k, v in r.items() if k != "doc"} for r in _rows(30, 5)]).set_index("label")
    assert flat.loc["x", "n"] == 150
    assert (
        flat.loc["x", "diff_high"] - flat.loc["x", "diff_low"] < five.loc["x", "diff_high"] - five.loc["x", "diff_low"]
    )


def test_rows_without_a_document_are_summarized_as_before():
    rows = [r for r in _rows(12, 1)]
    mixed = [r | {"task": "u"} for r in rows] + _rows(12, 3, seed=1)
    alone = stats.summarize([{k: v for k, v in r.items() if k != "doc"} | {"task": "u"} for r in rows])
    both = stats.summarize([{k: v for k, v in r.items() if not (k == "doc" and r["task"] == "u")} for r in mixed])
    got = both[both["task"] == "u"].reset_index(drop=True)[alone.columns]
    pd.testing.assert_frame_equal(got, alone, check_dtype=False)


def test_the_prediction_and_the_power_line_know_documents_share_their_prefill():
    params = {
        "speculator": "qwen2.5-coder-0.5b", "base": "qwen2.5-coder-1.5b", "dataset": "natural_qa", "length": 2048,
        "n_samples": 20, "questions_per_document": 5, "keep_rates": [0.1], "max_tokens": 16,
    }  # fmt: skip
    cached = cost.seconds("01_long_context_quality", {**params, "enable_prefix_caching": True}, "amx")
    uncached = cost.seconds("01_long_context_quality", params, "amx")
    single = cost.seconds("01_long_context_quality", {**params, "questions_per_document": 1}, "amx")
    assert single < cached < uncached
    line = power.plan_line("01", params)
    assert "n = 100 (20 documents x 5 questions" in line


def test_the_claims_table_counts_documents_and_names_their_questions(tmp_path):
    from specprefill.workbench.report import claims

    rows = stats.summarize(_rows(30, 5))
    (tmp_path / "01_long_context_quality").mkdir()
    rows.to_csv(tmp_path / "01_long_context_quality" / "summary.csv", index=False)
    ours, verdict = claims._quality_claim(tmp_path, "01_long_context_quality")
    assert "n = 30–30 documents (150 questions) per cell" in ours
    assert verdict.startswith("too few samples to tell (deciding needs n ≈") and verdict.endswith("documents per cell)")


def test_documents_that_all_score_as_full_prefill_can_read_no_difference():
    """Document means are not 0/1, so the bootstrap is used; where every document's pruned mean equals full's it sees
    no spread, and the cell is read as that many concordant pairs (Newcombe), not left undecided."""
    rows = []
    for d in range(40):
        for q, right in enumerate((100.0, 100.0, 0.0)):
            for label, rate in (("full", 1.0), ("x", 0.1)):
                rows.append(
                    {"task": "t", "label": label, "keep_rate": rate, "index": 3 * d + q, "doc": d, "score": right}
                )
    x = stats.summarize(rows).set_index("label").loc["x"]
    assert x["n"] == 40 and x["diff_vs_full"] == 0 and -10 <= x["diff_low"] < 0 < x["diff_high"] <= 10
    assert x["verdict"] == "no difference found"
    low, high = stats.paired_difference([50.0] * 8, [50.0] * 8)[1:3]
    assert high - low > 20  # eight samples: never a zero-width interval


def test_documents_of_two_tasks_stay_apart_even_when_grouped_by_label_alone():
    rows = _rows(10, 2) + [r | {"task": "u", "score": 100.0 - r["score"]} for r in _rows(10, 2)]
    pooled = stats.summarize(rows, by=("label",)).set_index("label")
    assert pooled.loc["x", "n"] == 20 and pooled.loc["x", "questions"] == 40


def test_a_claim_whose_notebook_the_profile_skips_says_why(tmp_path):
    """The claims table names the skip reason (which states the n a decision would need) beside "not run"."""
    import html

    from specprefill.workbench.report import claims

    (tmp_path / "params" / "p").mkdir(parents=True)
    (tmp_path / "params" / "p" / "_profile.yaml").write_text("skip: {06_ablations: 'deciding needs ~235 per cell'}\n")
    (tmp_path / "notebooks").mkdir()
    (tmp_path / "notebooks" / "06_ablations.ipynb").write_text("{}")
    (tmp_path / "outputs" / "p").mkdir(parents=True)
    page = html.unescape(claims.claims_summary(tmp_path / "outputs" / "p"))
    assert "not run in this profile: deciding needs ~235 per cell" in page
