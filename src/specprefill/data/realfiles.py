"""Documents and questions from real files nobody on this project wrote: what installed packages ship (package
metadata, wheel RECORD files, entry points, SBOMs, lm-eval's task configs and READMEs, Python source, a CSV) and
Debian's MIME database, their records and answers read by each format's parser (`data.filefacts`); the prompt is
the real text, whole records of it.

A task is named `file:<kind>` (the question after the document), `file:<kind>/before` (before it), `file:<kind>@<mood>`
(the question in German, Spanish, Chinese or the imperative mood) or `file:chat_<shape>` (chat transcripts over the
SBOM components: the answer in an earlier assistant message, a correction after the question, two questions at
once). `TUNE_KINDS` and `REPORT_KINDS` split the file kinds in two halves: rules are designed on the first and
reported once on the second (`TUNE_CELLS`, `REPORT_CELLS`). Every record: {"task", "index", "input", "outputs",
"length", "metric": "all", "target_length", "records"}; deterministic per (task, length, seed, index) for one set
of installed packages (the project pins them)."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

from specprefill.data.filefacts import (
    Fact,
    code_facts,
    entry_point_facts,
    metadata_facts,
    mime_facts,
    readme_facts,
    record_facts,
    sbom_facts,
    stocks_facts,
    task_config_facts,
)
from specprefill.data.ruler import fit, seeded_records
from specprefill.errors import SpecPrefillError

PREFIX = "file:"
MIN_RECORDS = 3


@dataclass(frozen=True)
class Kind:
    """A file kind: where its records come from, how they are joined into one document, what is asked."""

    facts: Callable[[], list[Fact]]
    joiner: str
    ask: str  # English question; {key}
    head: str = ""  # text before the records (a CSV header, a JSON opening)
    foot: str = ""


KINDS: dict[str, Kind] = {
    "metadata": Kind(metadata_facts, "\n\n", "What is the version of the package {key}? Answer with the version only."),
    "task_yaml": Kind(
        task_config_facts, "\n---\n", "Which dataset path does the task {key} use? Answer with the path only."
    ),
    "stocks_csv": Kind(
        stocks_facts,
        "\n",
        "What was the AAPL value on {key}? Answer with the number only.",
        head="Date,IBM,AAPL,MSFT,XRX,AMZN,DELL,GOOGL,ADBE,^GSPC,^IXIC\n",
    ),
    "sbom_json": Kind(
        sbom_facts,
        ",\n",
        "What is the version of the component {key}? Answer with the version only.",
        '{"components": [\n',
        "\n]}",
    ),
    "record_csv": Kind(record_facts, "\n", "What is the size in bytes of the file {key}? Answer with the number only."),
    "entry_points_ini": Kind(
        entry_point_facts, "\n\n", "Which object does the entry point {key} refer to? Answer with the object only."
    ),
    "readme_md": Kind(readme_facts, "\n\n", "What is the homepage of {key}? Answer with the URL only."),
    "code_py": Kind(
        code_facts, "\n\n\n", "What is the default value of the parameter {key}? Answer with the value only."
    ),
    "xml_mime": Kind(
        mime_facts,
        "\n",
        "Which file name pattern does the MIME type {key} use? Answer with the pattern only.",
        "<mime-info>\n",
        "\n</mime-info>",
    ),
}
TUNE_KINDS = ("metadata", "task_yaml", "stocks_csv")
REPORT_KINDS = ("sbom_json", "record_csv", "entry_points_ini", "readme_md", "code_py", "xml_mime")
MOODS = {
    "de": "Welche Version hat die Komponente {key}? Antworte nur mit der Version.",
    "es": "¿Qué versión tiene el componente {key}? Responde solo con la versión.",
    "zh": "组件 {key} 的版本号是多少？只回答版本号。",
    "imperative": "Give me the version of the component {key}, nothing else.",
}
CHATS = ("chat_earlier", "chat_correction", "chat_several")
TUNE_CELLS = [f"{PREFIX}{k}" for k in TUNE_KINDS] + [f"{PREFIX}{k}/before" for k in TUNE_KINDS]
REPORT_FORMATS = [f"{PREFIX}{k}" for k in REPORT_KINDS]
REPORT_TURNS = (
    [f"{PREFIX}sbom_json@{m}" for m in MOODS] + [f"{PREFIX}record_csv/before"] + [f"{PREFIX}{c}" for c in CHATS]
)
REPORT_CELLS = REPORT_FORMATS + REPORT_TURNS


def parse(task: str) -> tuple[str, str, str]:
    """(kind, position "after"/"before", mood "" or a `MOODS` key) of a task name, or a chat shape."""
    if not task.startswith(PREFIX):
        raise SpecPrefillError(f"{task!r} is no real-file task: name one file:<kind>[/before][@mood]")
    body = task[len(PREFIX) :]
    body, _, mood = body.partition("@")
    kind, _, position = body.partition("/")
    if kind in CHATS and not position and not mood:
        return kind, "after", ""
    if kind not in KINDS or position not in ("", "before") or (mood and mood not in MOODS):
        raise SpecPrefillError(
            f"{task!r}: use file:<kind>[/before][@mood] with a kind of {', '.join(KINDS)} and a mood of "
            f"{', '.join(MOODS)}, or file:<{'|'.join(CHATS)}>"
        )
    return kind, position or "after", mood


def _document(kind: Kind, picked: list[Fact]) -> str:
    """The records' texts joined as the file kind joins them (a block that holds several facts once)."""
    return kind.head + kind.joiner.join(dict.fromkeys(f.text for f in picked)) + kind.foot


def _question(kind: str, mood: str, fact: Fact) -> str:
    return (MOODS[mood] if mood else KINDS[kind].ask).format(key=fact.key)


def _render(tokenizer, messages: list[dict]) -> str:
    text: str = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return text


def _chat(shape: str, picked: list[Fact], asked: Fact, other: Fact) -> list[dict]:
    kind = KINDS["sbom_json"]
    doc = _document(kind, picked)
    if shape == "chat_earlier":  # the document is the assistant's earlier answer
        listing = "\n".join(f"- {f.key}: {f.answer}" for f in picked)
        return [
            {"role": "user", "content": "Which versions do the components of this SBOM have?"},
            {"role": "assistant", "content": f"Here are the versions:\n{listing}"},
            {"role": "user", "content": f"Thanks. And which version did you give for {asked.key}? Just the version."},
        ]
    if shape == "chat_correction":
        ask = f"What is the version of the component {other.key}? Sorry, I meant {asked.key}. Just the version."
    else:
        ask = f"What are the versions of the components {asked.key} and {other.key}? Just the two versions."
    return [{"role": "user", "content": f"Here is an SBOM:\n\n{doc}\n\n{ask}"}]


def _pair(picked: list[Fact], pick: float, second: float) -> tuple[Fact, Fact]:
    """The asked record and another one (a correction's first name, a second question)."""
    asked = picked[int(pick * len(picked))]
    rest = [f for f in picked if f is not asked] or [asked]
    return asked, rest[int(second * len(rest))]


def _one(task: str, tokenizer, length: int, rng: random.Random) -> dict:
    kind_name, position, mood = parse(task)
    chat = kind_name in CHATS
    kind = KINDS["sbom_json" if chat else kind_name]
    facts = list(kind.facts())
    if len(facts) < MIN_RECORDS:
        raise SpecPrefillError(f"{task!r}: the installed files give {len(facts)} records, fewer than {MIN_RECORDS}")
    rng.shuffle(facts)
    pick, second = rng.random(), rng.random()
    built: dict[str, int] = {}

    def build(count: int) -> str:
        picked = facts[:count]
        asked, other = _pair(picked, pick, second)
        if chat:
            text = _render(tokenizer, _chat(kind_name, picked, asked, other))
        else:
            doc = _document(kind, picked)
            q = _question(kind_name, mood, asked)
            user = f"{q}\n\n{doc}" if position == "before" else f"{doc}\n\n{q}"
            text = _render(tokenizer, [{"role": "user", "content": user}])
        built[text] = count
        return text

    text, tokens = fit(tokenizer, build, length, min(len(facts), 400))
    count = built[text]
    if count < MIN_RECORDS:
        raise SpecPrefillError(f"{length} tokens hold {count} records of {task}, fewer than {MIN_RECORDS}: raise it")
    picked = facts[:count]
    asked, other = _pair(picked, pick, second)
    answers = [asked.answer, other.answer] if kind_name == "chat_several" else [asked.answer]
    return {"input": text, "outputs": answers, "length": tokens, "metric": "all", "records": count}


def generate(task: str, tokenizer, length: int, n: int, seed: int = 0) -> list[dict]:
    """n prompts of `task` within `length` tokens (as the tokenizer counts them), rendered with its chat template."""
    parse(task)
    return seeded_records(task, tokenizer, length, n, seed, _one)
