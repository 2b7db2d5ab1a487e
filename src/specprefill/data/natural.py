"""Natural-text multi-document QA: real SQuAD paragraphs (from the offline evaluation package) assembled into one
document of about `length` tokens, several questions asked of each document, one prompt per question.

Each document holds `questions` answer paragraphs (distinct), each at its own random depth among distractor
paragraphs; every question's prompt is the same document followed by that question, in RULER's qa wording. Scored
as RULER's qa_1 ("part": any reference answer found in the answer).

The prompts of one document share everything up to the question, so an engine with prefix caching computes the
document once per document (speculator and base): n questions cost about n / questions documents' prefills. The
questions of one document are not independent samples (one document's difficulty is shared): each record carries
`doc`, and `workbench.stats.summarize` scores per document (the mean over its questions) before any interval.
"""

from __future__ import annotations

import random

from specprefill.data.ruler import fit, qa_prompt
from specprefill.data.tasks import squad
from specprefill.errors import SpecPrefillError

TASK = "natural_qa"
POOL = 300  # SQuAD rows each document draws its distractor paragraphs from (~270 distinct, ~45k tokens)


def _golds(rows: list[dict], n_docs: int, questions: int, seed: int) -> list[list[dict]]:
    """Per document, `questions` SQuAD rows with distinct paragraphs; no question used twice across documents."""
    order = list(range(len(rows)))
    random.Random(f"{TASK}-golds-{seed}").shuffle(order)
    docs, used_q = [], 0
    for _ in range(n_docs):
        picked: list[dict] = []
        contexts: set[str] = set()
        while len(picked) < questions:
            if used_q >= len(order):
                raise SpecPrefillError(
                    f"SQuAD's {len(rows)} questions run out before {n_docs} documents x {questions} questions (each "
                    "document's questions on distinct paragraphs): lower n_samples or questions_per_document"
                )
            row = rows[order[used_q]]
            used_q += 1
            if row["context"] not in contexts:
                picked.append(row)
                contexts.add(row["context"])
        docs.append(picked)
    return docs


def _document(golds: list[dict], others: list[str], depths: list[float], n: int) -> str:
    """The answer paragraphs at their depths among the first n distractors, numbered as RULER's qa numbers them."""
    docs = list(others[:n])
    for gold, depth in sorted(zip(golds, depths), key=lambda p: p[1]):
        docs.insert(int(len(docs) * depth), gold["context"])
    return "\n\n".join(f"Document {i + 1}:\n{d}" for i, d in enumerate(docs))


def _fitted(tokenizer, rows: list[dict], golds: list[dict], length: int, rng: random.Random) -> str:
    """The document of `golds` with as many distractors as keep every question's prompt within `length` tokens."""
    taken = {g["context"] for g in golds}
    others = [c for c in dict.fromkeys(r["context"] for r in rng.sample(rows, min(len(rows), POOL))) if c not in taken]
    depths = [rng.random() for _ in golds]
    longest = max(golds, key=lambda g: len(tokenizer(g["question"])["input_ids"]))["question"]
    count: dict[str, int] = {}

    def build(n: int) -> str:  # sized on the longest question; each question's prompt is checked below
        text = qa_prompt(_document(golds, others, depths, n), longest)
        count[text] = n
        return text

    hi = len(others)
    while True:
        text, tokens = fit(tokenizer, build, length, hi)
        n = count[text]
        if n == len(others) and tokens < 0.9 * length:
            raise SpecPrefillError(
                f"{TASK}'s distractor paragraphs fill about {tokens} tokens, short of length {length}: use a length "
                f"of at most {tokens}"
            )
        body = _document(golds, others, depths, n)
        if all(len(tokenizer(qa_prompt(body, g["question"]))["input_ids"]) <= length for g in golds):
            return body
        hi = n - 1  # a question that counts one token more in its prompt than alone: one distractor fewer


def generate(tokenizer, length: int, n_docs: int, questions: int = 1, seed: int = 0) -> list[dict]:
    """`n_docs` documents x `questions` prompts (records `task`, `index`, `doc`, `input`, `outputs`, `length`,
    `metric`), every prompt at most `length` tokens; `index` numbers the prompts, `doc` the document."""
    if n_docs < 1 or questions < 1:
        raise SpecPrefillError(f"{TASK} needs at least one document and one question each (got {n_docs} x {questions})")
    rows = squad()
    out: list[dict] = []
    for d, golds in enumerate(_golds(rows, n_docs, questions, seed)):
        body = _fitted(tokenizer, rows, golds, length, random.Random(f"{TASK}-{length}-{seed}-{d}"))
        for gold in golds:
            text = qa_prompt(body, gold["question"])
            out.append(
                {
                    "task": TASK,
                    "index": len(out),
                    "doc": d,
                    "target_length": length,
                    "input": text,
                    "outputs": gold["answers"],
                    "length": len(tokenizer(text)["input_ids"]),
                    "metric": "part",
                }
            )
    return out
