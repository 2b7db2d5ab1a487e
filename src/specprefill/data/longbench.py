"""LongBench and the other hub-only datasets (GPQA, IFEval) through HF `datasets` when reachable, or from local JSONL
files with the same fields (how the tests exercise the loaders), and LongBench's offline analogue. The hub data is
never used silently in place of the analogue, nor the analogue in place of the hub data."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

from specprefill.data import ruler
from specprefill.data.tasks import ifeval_record
from specprefill.errors import SpecPrefillError

# LongBench task -> (metric, prompt template), after the LongBench paper's task families
LONGBENCH = {
    "narrativeqa": (
        "qa_f1",
        "You are given a story and a question. Answer as concisely as you can.\n\nStory: {context}\n\nQuestion: {input}\n\nAnswer:",
    ),
    "qasper": (
        "qa_f1",
        "You are given a scientific article and a question. Answer as concisely as you can.\n\nArticle: {context}\n\nQuestion: {input}\n\nAnswer:",
    ),
    "multifieldqa_en": (
        "qa_f1",
        "Read the following text and answer briefly.\n\n{context}\n\nQuestion: {input}\nAnswer:",
    ),
    "hotpotqa": (
        "qa_f1",
        "Answer the question based on the given passages. Only give me the answer and do not output any other words.\n\n{context}\n\nQuestion: {input}\nAnswer:",
    ),
    "2wikimqa": (
        "qa_f1",
        "Answer the question based on the given passages. Only give me the answer and do not output any other words.\n\n{context}\n\nQuestion: {input}\nAnswer:",
    ),
    "musique": (
        "qa_f1",
        "Answer the question based on the given passages. Only give me the answer and do not output any other words.\n\n{context}\n\nQuestion: {input}\nAnswer:",
    ),
    "gov_report": (
        "rouge_l",
        "You are given a report by a government agency. Write a one-page summary of the report.\n\nReport:\n{context}\n\nSummary:",
    ),
    "qmsum": (
        "rouge_l",
        "You are given a meeting transcript and a query. Answer the query in one or more sentences.\n\nTranscript:\n{context}\n\nQuery: {input}\nAnswer:",
    ),
    "multi_news": (
        "rouge_l",
        "You are given several news passages. Write a one-page summary of all news.\n\nNews:\n{context}\n\nSummary:",
    ),
    "trec": ("classification", "Please determine the type of the question below.\n\n{context}\n{input}"),
    "triviaqa": (
        "qa_f1",
        "Answer the question based on the given passage. Only give me the answer.\n\n{context}\n\n{input}",
    ),
    "samsum": ("rouge_l", "Summarize the dialogue into a few short sentences.\n\n{context}\n\n{input}"),
    "passage_count": (
        "count",
        "{context}\n\nHow many unique paragraphs are there after removing duplicates? The answer is: ",
    ),
    "passage_retrieval_en": (
        "retrieval",
        "Here are paragraphs and an abstract. Which paragraph is the abstract from?\n\n{context}\n\nAbstract: {input}\n\nThe answer is: Paragraph ",
    ),
    "lcc": ("code_sim", "Please complete the code given below.\n{context}Next line of code:\n"),
    "repobench-p": ("code_sim", "Please complete the code given below.\n{context}{input}Next line of code:\n"),
}


def local_file(data_dir: str | os.PathLike, source: str, config: str) -> Path:
    """Where a hub dataset's config lives in a data directory: `DIR/<source>/<config>.jsonl`, rows in the hub's own
    schema (e.g. `DIR/longbench/hotpotqa.jsonl` with LongBench's fields)."""
    return Path(data_dir) / source / f"{config}.jsonl"


def read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        raise SpecPrefillError(
            f"no {path}: put {path.name} there (the hub's schema, one row per line) or set data_dir to None for the hub"
        )
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _rows(hub_id: str, config: str | None, split: str, data_dir: str | None, source: str, name: str) -> list[dict]:
    if data_dir:
        return read_jsonl(local_file(data_dir, source, name))
    try:
        import datasets  # optional (hub access only), and slow to import
    except ImportError:
        raise SpecPrefillError(
            f"{hub_id} needs the `datasets` package: pip install datasets (and hub access)"
        ) from None
    try:
        return list(datasets.load_dataset(hub_id, config, split=split))
    except Exception as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:150]
        raise SpecPrefillError(
            f"cannot load {hub_id} ({first}): it is hub-only; use the offline analogue profile "
            "or pass data_dir with local JSONL files"
        ) from None


def longbench(task: str, n: int, data_dir: str | None = None) -> list[dict]:
    if task not in LONGBENCH:
        raise SpecPrefillError(f"unknown LongBench task {task!r}: use one of {', '.join(LONGBENCH)}")
    metric, template = LONGBENCH[task]
    rows = _rows("THUDM/LongBench", task, "test", data_dir, "longbench", task)[:n]
    out = []
    for i, r in enumerate(rows):
        rec = {
            "task": task,
            "index": i,
            "input": template.format(context=r["context"], input=r.get("input", "")),
            "outputs": list(r["answers"]),
            "metric": metric,
        }
        if metric == "classification":
            rec["classes"] = list(r["all_classes"])
        out.append(rec)
    return out


def gpqa(n: int, data_dir: str | None = None, seed: int = 0) -> list[dict]:
    rows = _rows("Idavidrein/gpqa", "gpqa_diamond", "train", data_dir, "gpqa", "gpqa_diamond")[:n]
    out = []
    for i, r in enumerate(rows):
        options = [r["Correct Answer"], r["Incorrect Answer 1"], r["Incorrect Answer 2"], r["Incorrect Answer 3"]]
        order = list(range(4))
        random.Random(seed * 1000 + i).shuffle(order)
        text = "".join(f"\n{'ABCD'[j]}. {options[o].strip()}" for j, o in enumerate(order))
        out.append(
            {
                "task": "gpqa",
                "index": i,
                "input": f"Question: {r['Question'].strip()}{text}\nAnswer:",
                "outputs": ["ABCD"[order.index(0)]],
                "metric": "letter",
            }
        )
    return out


def ifeval(n: int, data_dir: str | None = None) -> list[dict]:
    """IFEval prompts, scored by lm-eval's instruction checker (its sentence-count instructions need NLTK's
    punkt_tab data: `python -m nltk.downloader punkt_tab`)."""
    rows = _rows("google/IFEval", None, "train", data_dir, "ifeval", "ifeval")[:n]
    return [ifeval_record(r, i, "ifeval") for i, r in enumerate(rows)]


def analogue(tokenizer, length: int, n: int, seed: int = 0) -> list[dict]:
    """Offline analogue of LongBench multi-document QA: a SQuAD question over its paragraph hidden among others
    (QA-F1). Labelled as an analogue in every report, never as LongBench."""
    recs = ruler.generate("qa_1", tokenizer, length, n, seed)
    return [{**r, "task": "mdqa_squad_analogue", "metric": "qa_f1"} for r in recs]
