"""LongBench and the other hub-only datasets (GPQA, IFEval) through HF `datasets` when reachable, or from local JSONL
files with the same fields (how the tests exercise the loaders), and LongBench's offline analogue. The hub data is
never used silently in place of the analogue, nor the analogue in place of the hub data."""

from __future__ import annotations

import functools
import json
import os
import random
from pathlib import Path
from typing import cast

from specprefill.data import ruler
from specprefill.data.tasks import ifeval_record, squad
from specprefill.engines.common import require_chat_template
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


# LongBench's task categories, in the paper's table layout
CATEGORIES = {
    "single-doc QA": ("narrativeqa", "qasper", "multifieldqa_en"),
    "multi-doc QA": ("hotpotqa", "2wikimqa", "musique"),
    "summarization": ("gov_report", "qmsum", "multi_news"),
    "few-shot": ("trec", "triviaqa", "samsum"),
    "synthetic": ("passage_count", "passage_retrieval_en"),
    "code": ("lcc", "repobench-p"),
}
# LongBench's Chinese tasks and the category each belongs to (LongBench's own 21-task table; the original runs them):
# read through lm-eval's task definitions, not worded here, so a load test sends the English tasks of a category
CHINESE = {
    "multifieldqa_zh": "single-doc QA", "dureader": "multi-doc QA", "vcsum": "summarization", "lsht": "few-shot",
    "passage_retrieval_zh": "synthetic",
}  # fmt: skip
# the original's load test (eval/qps_client.py): four LongBench tasks per category, the Chinese one included
QPS_TASKS = {
    "multi-doc QA": ("dureader", "2wikimqa", "musique", "hotpotqa"),
    "few-shot": ("triviaqa", "lsht", "trec", "samsum"),
    "summarization": ("gov_report", "qmsum", "multi_news", "vcsum"),
}


ORIGINAL_ROWS = 200  # rows of each QPS task's LongBench test split


def original_qps_rows(per_task: int = 32, n_rows: int = ORIGINAL_ROWS, seed: int = 227) -> dict[str, list[int]]:
    """The rows of each `QPS_TASKS` task the original's load test sent, as indices into LongBench's test split (of
    `n_rows` rows), in the order drawn. Each category ran in a fresh client process that seeded NumPy with `seed`,
    then per task (in `QPS_TASKS`' order, the client's) called `datasets` 2.21's seedless `Dataset.shuffle`, which
    seeds a PCG64 generator from NumPy's global MT19937 state and advances that state by one draw."""
    import numpy as np

    out = {}
    for tasks in QPS_TASKS.values():
        state = np.random.RandomState(seed)  # np.random.seed(seed) in a fresh process
        for task in tasks:
            _, key, pos, *_ = cast(tuple, state.get_state())  # legacy form: (name, key, pos, ...)
            draw = key[pos] if pos < 624 else key[0]
            state.random_sample()  # shuffle's one step of the global generator
            out[task] = np.random.default_rng(draw).permutation(n_rows)[:per_task].tolist()
    return out


def qps_rows(task: str, rows: list[dict], n: int) -> list[dict]:
    """`n` rows of a task for the load test: on LongBench's test split (its 200 rows) the original's, in the order it
    drew them (`original_qps_rows`); on other data (a data directory with fewer rows) the first n."""
    if len(rows) != ORIGINAL_ROWS:
        return rows[:n]
    return [rows[i] for i in original_qps_rows(min(n, ORIGINAL_ROWS), ORIGINAL_ROWS)[task]]


# tasks LongBench prompts without the chat template (its prediction script's list)
UNTEMPLATED = ("trec", "triviaqa", "samsum", "lsht", "lcc", "repobench-p")
# LongBench's answer lengths (its dataset2maxlen): the max_tokens a request of the task asks for
ANSWER_TOKENS = {
    "narrativeqa": 128, "qasper": 128, "multifieldqa_en": 64, "hotpotqa": 32, "2wikimqa": 32, "musique": 32,
    "gov_report": 512, "qmsum": 512, "multi_news": 512, "trec": 64, "triviaqa": 32, "samsum": 128,
    "passage_count": 32, "passage_retrieval_en": 32, "lcc": 64, "repobench-p": 64,
}  # fmt: skip


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


def truncate_middle(tokenizer, text: str, max_tokens: int) -> str:
    """The text cut to `max_tokens` tokens by dropping its middle (its first and last halves kept), as LongBench's
    prediction script cuts prompts longer than the context."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(ids) <= max_tokens:
        return text
    half = max_tokens // 2
    return tokenizer.decode(ids[:half]) + tokenizer.decode(ids[len(ids) - (max_tokens - half) :])


def _request(tokenizer, task: str, text: str, max_tokens: int, chat: bool, answer_tokens: int | None) -> dict:
    """One load-test request: the text cut in the middle to `max_tokens`, through the chat template if `chat`."""
    text = truncate_middle(tokenizer, text, max_tokens)
    if chat:
        require_chat_template(tokenizer, getattr(tokenizer, "name_or_path", None) or "the base")
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
        )
        bos = tokenizer.bos_token
        if bos and text.startswith(bos) and tokenizer("x")["input_ids"][:1] == [tokenizer.bos_token_id]:
            text = text[len(bos) :]  # the server's tokenizer adds it again: one BOS, as the template means
    return {"task": task, "prompt": text, "output_tokens": answer_tokens or ANSWER_TOKENS.get(task, 32)}


@functools.cache
def own_template(task: str) -> tuple[str, int]:
    """LongBench's own prompt template and answer length for `task` (its dataset2prompt and dataset2maxlen), as
    lm-eval's LongBench task definitions carry them (`doc_to_text`, `max_gen_toks`): read from the installed
    lm-eval, not worded here."""
    import importlib.util

    import yaml

    spec = importlib.util.find_spec("lm_eval")
    if spec is None or not spec.submodule_search_locations:
        raise SpecPrefillError("LongBench's own prompts come from lm-eval's task definitions: pip install lm-eval")
    path = Path(list(spec.submodule_search_locations)[0]) / "tasks" / "longbench" / f"{task}.yaml"
    if not path.exists():
        raise SpecPrefillError(f"lm-eval has no LongBench task {task!r} ({path.name}): use a LongBench task name")

    class Tags(yaml.SafeLoader):  # the definitions tag their metric functions (`!function`): not needed here
        pass

    Tags.add_multi_constructor("!", lambda loader, suffix, node: None)
    config = yaml.load(path.read_text(), Loader=Tags)  # noqa: S506 (a SafeLoader that ignores unknown tags)
    return config["doc_to_text"], int(config["generation_kwargs"]["max_gen_toks"])


def category_requests(
    category: str,
    tokenizer,
    n: int,
    max_tokens: int,
    data_dir: str | None = None,
    chat: bool = True,
    answer_tokens: int | None = None,
    seed: int = 0,
) -> list[dict]:
    """Requests of one category for a load test as the original sent them: `n` rows of each of its four tasks (the
    original's rows on LongBench's own split, `qps_rows`)
    (`QPS_TASKS`) in LongBench's own template and answer length (`own_template`), cut to `max_tokens` prompt tokens in
    the middle, through the chat template but for LongBench's untemplated tasks (or `answer_tokens` each); shuffled
    with `seed`. Each is {"task", "prompt" (the text as sent), "output_tokens"}."""
    from lm_eval.utils import apply_template  # lm-eval's own rendering of its templates

    if category not in QPS_TASKS:
        raise SpecPrefillError(f"unknown LongBench category {category!r}: use one of {', '.join(QPS_TASKS)}")
    out = []
    for task in QPS_TASKS[category]:
        template, answer = own_template(task)
        for row in qps_rows(task, _rows("THUDM/LongBench", task, "test", data_dir, "longbench", task), n):
            text = apply_template(template, {**row, "question": row.get("input", "")})
            chat_here = chat and task not in UNTEMPLATED
            out.append(_request(tokenizer, task, text, max_tokens, chat_here, answer_tokens or answer))
    random.Random(seed).shuffle(out)
    return out


def _few_shot_analogue(tokenizer, length: int, rng: random.Random, index: int) -> str:
    """Few-shot QA over SQuAD: solved passage/question/answer examples, then one to answer (TriviaQA's shape)."""
    rows = squad()
    query = rows[index % len(rows)]
    shots = [r for r in rng.sample(rows, min(len(rows), 200)) if r["id"] != query["id"]]

    def build(k: int) -> str:
        examples = "".join(
            f"Passage: {r['context']}\nQuestion: {r['question']}\nAnswer: {r['answers'][0]}\n\n" for r in shots[:k]
        )
        return (
            "Answer the question based on the given passage. Only give me the answer and do not output any other "
            f"words. The following are some examples.\n\n{examples}Passage: {query['context']}\n"
            f"Question: {query['question']}\nAnswer:"
        )

    return ruler.fit(tokenizer, build, length, len(shots))[0]


def _summary_analogue(tokenizer, length: int, rng: random.Random, essays: str) -> str:
    """A stretch of the essay haystack to summarize (gov_report's shape)."""
    words = essays.split()
    start = rng.randrange(max(1, len(words) - 20 * length))

    def build(k: int) -> str:
        report = " ".join(words[start : start + k])
        return (
            "You are given a report. Write a one-page summary of the report.\n\n"
            f"Report:\n{report}\n\nNow, write a one-page summary of the report.\n\nSummary:"
        )

    return ruler.fit(tokenizer, build, length, min(len(words) - start, 4 * length))[0]


# the offline analogue of each category a load test can use: (how its prompts are made, the answer length asked)
ANALOGUES = {
    "multi-doc QA": ("SQuAD multi-document QA (RULER qa_1's construction)", 32),
    "few-shot": ("SQuAD few-shot QA (TriviaQA's shape)", 32),
    "summarization": ("summarize a stretch of the essay haystack (gov_report's shape)", 512),
}


def category_analogue(
    category: str, tokenizer, n: int, length: int, chat: bool = True, answer_tokens: int | None = None, seed: int = 0
) -> list[dict]:
    """Offline requests shaped like a LongBench category (`ANALOGUES`), prompts of at most `length` tokens, labelled
    by their analogue task name; few-shot stays untemplated as LongBench's few-shot tasks are."""
    if category not in ANALOGUES:
        raise SpecPrefillError(
            f"no offline analogue of LongBench category {category!r}: use one of {', '.join(ANALOGUES)}, or LongBench "
            "rows (data_dir or the hub)"
        )
    essays = ruler._essays() if category == "summarization" else ""
    out = []
    for i in range(n):
        rng = random.Random(f"{category}-{length}-{seed}-{i}")
        if category == "multi-doc QA":
            text, task = ruler._qa(tokenizer, length, rng, seed * 1000 + i)["input"], "mdqa_squad_analogue"
        elif category == "few-shot":  # untemplated, as LongBench's few-shot tasks
            text, task = _few_shot_analogue(tokenizer, length, rng, seed * 1000 + i), "fewshot_squad_analogue"
        else:
            text, task = _summary_analogue(tokenizer, length, rng, essays), "summary_essay_analogue"
        chat_here = chat and category != "few-shot"
        out.append(_request(tokenizer, task, text, length, chat_here, answer_tokens or ANALOGUES[category][1]))
    return out
