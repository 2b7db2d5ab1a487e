"""Scoring functions (0-100 unless noted). LongBench's protocol: QA-F1, ROUGE-L (`rouge-score`),
classification, retrieval, count, code edit similarity (`rapidfuzz`, the same ratio as LongBench's `fuzzywuzzy`),
with the answer cut at its first line only for the tasks where LongBench cuts it. RULER string matching, GSM8K and
letter extraction, pass@1 through the sandbox, IFEval's instructions through lm-eval's checker."""

from __future__ import annotations

import ast
import contextlib
import functools
import io
import re
import string
import sys
from collections import Counter

from rapidfuzz import fuzz

from specprefill.data.sandbox import run_python
from specprefill.errors import SpecPrefillError

METRIC_VERSION = 2  # 2: rouge-score, rapidfuzz, first-line cut only for LONGBENCH_FIRST_LINE (1: whitespace
#                        ROUGE-L, difflib, first line of every QA answer)
# LongBench's evaluation keeps only the first line of the prediction for these datasets, and for no others
LONGBENCH_FIRST_LINE = frozenset({"trec", "triviaqa", "samsum", "lsht"})


def normalize_answer(text: str) -> str:
    """Lower case, no punctuation, no articles, single spaces."""
    text = "".join(ch for ch in text.lower() if ch not in set(string.punctuation))
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def _f1(pred_tokens: list[str], ref_tokens: list[str]) -> float:
    common = Counter(pred_tokens) & Counter(ref_tokens)
    same = sum(common.values())
    if same == 0:
        return 0.0
    precision, recall = same / len(pred_tokens), same / len(ref_tokens)
    return 2 * precision * recall / (precision + recall)


def first_line(text: str) -> str:
    """LongBench's cut for its few-shot datasets: the prediction up to its first line break."""
    return text.lstrip("\n").split("\n")[0]


def qa_f1(prediction: str, references: list[str]) -> float:
    """Best token F1 of the (normalized) answer against any reference."""
    pred = normalize_answer(prediction).split()
    return 100.0 * max((_f1(pred, normalize_answer(r).split()) for r in references), default=0.0)


@functools.cache
def _rouge():
    # rouge-score imports absl, whose logging handler keeps the sys.stderr of that moment and closes it when logging
    # shuts its handlers down (vLLM's logging set-up does, through logging.config) unless it is the process's own: a
    # notebook's or a test's capture stream would be closed under its owner. Imported with the process's stderr.
    with contextlib.redirect_stderr(sys.__stderr__):
        from rouge_score import rouge_scorer  # lazy: it imports nltk and scipy (~2.5 s), needed only for ROUGE

    return rouge_scorer.RougeScorer(["rougeL"])


def rouge_l(prediction: str, references: list[str]) -> float:
    """ROUGE-L F-measure, best over references. LongBench calls the `rouge` package; this is `rouge-score`, the
    maintained reimplementation of ROUGE-1.5.5 (its tokenizer: lower case, alphanumeric tokens)."""
    return 100.0 * max((_rouge().score(r, prediction)["rougeL"].fmeasure for r in references), default=0.0)


def classification(prediction: str, references: list[str], classes: list[str]) -> float:
    """Fraction of the classes named in the prediction that are the reference (LongBench style)."""
    named = [c for c in classes if c in prediction]
    named = [c for c in named if not any(c != o and c in o for o in named)]  # keep the longest overlapping names
    return 100.0 * (sum(1 for c in named if c in references) / len(named) if named else 0.0)


def retrieval(prediction: str, references: list[str]) -> float:
    """'Paragraph N' retrieval: share of numbers in the prediction equal to the reference's number."""
    want = re.findall(r"\d+", references[0])
    got = re.findall(r"\d+", prediction)
    return 100.0 * (sum(1 for g in got if want and g == want[0]) / len(got) if got else 0.0)


def count(prediction: str, references: list[str]) -> float:
    got = re.findall(r"\d+", prediction)
    return 100.0 * (sum(1 for g in got if g == str(references[0])) / len(got) if got else 0.0)


def code_sim(prediction: str, references: list[str]) -> float:
    """LongBench code completion: edit similarity of the first line holding no backtick, `#` or `//` (the whole
    prediction when no line qualifies), best over references."""
    lines = prediction.lstrip("\n").split("\n")
    first = next((x for x in lines if "`" not in x and "#" not in x and "//" not in x), prediction)
    return max(fuzz.ratio(first, r) for r in references)


def string_match_all(prediction: str, references: list[str]) -> float:
    """RULER: share of the references found in the prediction (case-insensitive)."""
    return 100.0 * sum(r.lower() in prediction.lower() for r in references) / len(references)


def string_match_part(prediction: str, references: list[str]) -> float:
    """RULER: 100 if any reference is found in the prediction (case-insensitive)."""
    return 100.0 * float(any(r.lower() in prediction.lower() for r in references))


def extract_gsm8k(text: str) -> str | None:
    """The answer after 'the answer is', else the last number in the text; commas and $ removed."""
    text = text.replace(",", "").replace("$", "")
    m = re.search(r"answer is\s*:?\s*(-?\d+(?:\.\d+)?)", text, flags=re.I)
    if m is None:
        nums = re.findall(r"-?\d+(?:\.\d+)?", text.split("\n\nQuestion:")[0])
        if not nums:
            return None
        value = nums[-1]
    else:
        value = m.group(1)
    return value[:-2] if value.endswith(".0") else value.rstrip(".")


def gsm8k_accuracy(prediction: str, references: list[str]) -> float:
    return 100.0 * float(extract_gsm8k(prediction) == references[0].replace(",", ""))


def extract_letter(text: str, letters: str = "ABCD") -> str | None:
    """The first standalone option letter in the answer."""
    m = re.search(rf"\b([{letters}])\b", text.strip()[:40])
    return m.group(1) if m else None


def letter_accuracy(prediction: str, references: list[str]) -> float:
    return 100.0 * float(extract_letter(prediction) == references[0])


def extract_code(prompt: str, completion: str, entry_point: str | None) -> str:
    """A runnable program: a fenced block from the completion if there is one, else prompt + completion."""
    fenced = re.findall(r"```(?:python)?\n(.*?)(?:```|$)", completion, flags=re.S)
    if fenced and fenced[0].strip():
        return fenced[0]
    return prompt + completion if entry_point else completion


def pass_at_1(
    program: str,
    tests: str,
    timeout_s: float = 10.0,
    modules: tuple[str, ...] = (),
    memory_mb: int = 1024,
    max_processes: int = 4,
) -> float:
    """100 when the program and its tests run to the end in the sandbox (exit status 0 and the sandbox's marker,
    which an early `sys.exit(0)` or `os._exit(0)` never prints), else 0. `modules`: packages the tests import."""
    run = run_python(
        program + "\n\n" + tests, timeout_s=timeout_s, memory_mb=memory_mb, max_processes=max_processes, modules=modules
    )
    return 100.0 * float(run.ok)


_KEPT = (
    ast.Import, ast.ImportFrom, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Assign, ast.AnnAssign, ast.Try,
)  # fmt: skip


def definitions(answer: str) -> str:
    """The program in an answer that continues an opened code block, as EvalPlus scores one: the text before the
    closing fence (or, when the answer opens a block of its own first, that block), keeping only its top-level
    imports, definitions and assignments, so the answer's own demo calls, prints and `if __name__ == "__main__"`
    blocks do not run with the tests. Code that does not parse is cut to its longest start that does (as EvalPlus's
    sanitizer does); none: it stays as it is (and fails)."""
    code = answer.split("```", 1)[0]
    if not code.strip():
        fenced = re.findall(r"```[\w+-]*\n(.*?)(?:```|$)", answer, flags=re.S)
        code = fenced[0] if fenced else ""
    lines = code.splitlines()
    while lines:  # an answer cut short, or with prose after its code: the longest start that parses
        try:
            tree = ast.parse("\n".join(lines))
            break
        except (SyntaxError, ValueError):
            lines.pop()
    else:
        return code
    kept = [
        "\n".join(
            lines[min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])]) - 1 : node.end_lineno]
        )
        for node in tree.body
        if isinstance(node, _KEPT)
    ]
    return "\n\n".join(kept) + "\n"


@functools.lru_cache(maxsize=1)
def ifeval_checker():
    """lm-eval's IFEval checker module (`process_results`, `instructions_registry`). Its import tries to download
    NLTK's punkt_tab (and prints that it did):
    that is kept offline and quiet here; the few instructions that need punkt raise a one-line error when scored.
    langdetect is seeded, as it is random otherwise."""
    import langdetect
    import nltk

    langdetect.DetectorFactory.seed = 0
    download, nltk.download = nltk.download, (lambda *a, **k: False)
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            from lm_eval.tasks.ifeval import utils
    finally:
        nltk.download = download
    return utils


def ifeval(prediction: str, record: dict) -> float:
    """IFEval prompt-level strict accuracy (100 when every instruction of the prompt is followed), lm-eval's checker."""
    doc = {
        "key": record.get("key", record.get("index", 0)),
        "prompt": record["input"],
        "instruction_id_list": record["instruction_id_list"],
        "kwargs": record["kwargs"],
    }
    try:
        result = ifeval_checker().process_results(doc, [prediction])
    except LookupError:
        raise SpecPrefillError(
            f"IFEval instructions {', '.join(doc['instruction_id_list'])} need NLTK's punkt_tab "
            "data: python -m nltk.downloader punkt_tab"
        ) from None
    return 100.0 * float(result["prompt_level_strict_acc"])


METRICS = {
    "all": string_match_all,
    "part": string_match_part,
    "qa_f1": qa_f1,
    "rouge_l": rouge_l,
    "gsm8k": gsm8k_accuracy,
    "letter": letter_accuracy,
    "retrieval": retrieval,
    "count": count,
    "code_sim": code_sim,
}


def score(record: dict, prediction: str) -> float:
    """Score one prediction with the record's metric."""
    metric = record["metric"]
    if record.get("task") in LONGBENCH_FIRST_LINE:
        prediction = first_line(prediction)
    if metric == "pass@1":
        return pass_at_1(extract_code(record["input"], prediction, record.get("entry_point")), record["tests"])
    if metric == "classification":
        return classification(prediction, record["outputs"], record["classes"])
    if metric == "ifeval":
        return ifeval(prediction, record)
    return METRICS[metric](prediction, record["outputs"])
