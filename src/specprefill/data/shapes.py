"""A family of document shapes for selection: the same registry of entries written as prose (hard-wrapped or one
paragraph a line), JSON (pretty, wide, minified), XML (pretty, minified), CSV, a markdown table, YAML, log lines,
code and Chinese prose; the question (which entry's access code?) after the document, before it, on both sides or in
the system message; LF or CRLF line ends; a completion prompt or a chat prompt rendered with the tokenizer's template.

A task is named `shape:<shape>/<position>/<line ends>/<kind>`, e.g. `shape:json_minified/after/lf/chat`. The shapes
are split in two halves: `TUNE_SHAPES`, the ones selection rules may be designed and tuned on, and `REPORT_SHAPES`,
kept apart for reporting (`TUNE_CELLS`, `REPORT_CELLS`: the cells each half is measured on). Every record:
{"task", "index", "input", "outputs", "length", "metric": "all", "target_length", "records"}. Generated locally,
deterministic per (task, length, seed, index).
"""

from __future__ import annotations

import json
import random
import textwrap
from collections.abc import Callable

from specprefill.data.keyed import COLORS, HANDLERS, PORTS
from specprefill.data.ruler import ADJECTIVES, NOUNS, fit, seeded_records
from specprefill.errors import SpecPrefillError

PREFIX = "shape:"
POSITIONS = ("after", "before", "both", "system")
LINE_ENDS = ("lf", "crlf")
KINDS = ("chat", "completion")
MIN_RECORDS = 5  # json_wide: 17 fields an entry, 5 entries in 1,024 tokens
STATUS = ["active", "paused", "retired", "pending", "audited"]
CITIES_ZH = ["上海", "成都", "西安", "杭州", "青岛", "厦门", "昆明", "大连"]


def _entry(rng: random.Random, name: str) -> dict:
    return {
        "name": name,
        "owner": rng.choice(HANDLERS),
        "city": rng.choice(PORTS),
        "weight_kg": rng.randint(40, 900),
        "status": rng.choice(STATUS),
        "code": f"{rng.choice(COLORS)}-{rng.randint(1000, 9999)}",
        "zh_city": rng.choice(CITIES_ZH),
    }


def _prose(e: dict) -> str:
    return (
        f"{e['name']} is an entry owned by {e['owner']} and stored in {e['city']}. It weighs {e['weight_kg']} kg "
        f"and its status is {e['status']}; it was last inspected on a quiet morning, with nothing unusual noted by "
        f"the staff on duty. The access code of {e['name']} is {e['code']}."
    )


def _wide(e: dict) -> dict:
    """17 fields, the name in the middle."""
    before = {f"f{i}": i * e["weight_kg"] % 97 for i in range(8)}
    after = {f"g{i}": e["weight_kg"] + i for i in range(6)}
    return {**before, "name": e["name"], "owner": e["owner"], "code": e["code"], **after}


FIELDS = ("name", "owner", "city", "weight_kg", "code")


def _xml(e: dict, sep: str) -> str:
    inner = sep.join(f"  <{f}>{e[f]}</{f}>" if sep else f"<{f}>{e[f]}</{f}>" for f in FIELDS)
    return f"<entry>{sep}{inner}{sep}</entry>"


# shape -> (document renderer, how the question names the entry)
SHAPES: dict[str, Callable[[list[dict]], str]] = {
    "prose_wrapped": lambda es: "\n\n".join(textwrap.fill(_prose(e), 72) for e in es),
    "prose_lines": lambda es: "\n".join(_prose(e) for e in es),
    "json_pretty": lambda es: json.dumps([{f: e[f] for f in FIELDS} for e in es], indent=2),
    "json_wide": lambda es: json.dumps([_wide(e) for e in es], indent=2),
    "json_minified": lambda es: json.dumps([{f: e[f] for f in FIELDS} for e in es], separators=(",", ":")),
    "xml_pretty": lambda es: "<registry>\n" + "\n".join(_xml(e, "\n") for e in es) + "\n</registry>",
    "xml_minified": lambda es: "<registry>" + "".join(_xml(e, "") for e in es) + "</registry>",
    "csv": lambda es: ",".join(FIELDS) + "\n" + "\n".join(",".join(str(e[f]) for f in FIELDS) for e in es),
    "markdown_table": lambda es: (
        "| "
        + " | ".join(FIELDS)
        + " |\n|"
        + "---|" * len(FIELDS)
        + "\n"
        + "\n".join("| " + " | ".join(str(e[f]) for f in FIELDS) + " |" for e in es)
    ),
    "yaml": lambda es: "\n".join(
        f"- name: {e['name']}\n  owner: {e['owner']}\n  city: {e['city']}\n  weight_kg: {e['weight_kg']}\n"
        f"  code: {e['code']}"
        for e in es
    ),
    "logs": lambda es: "\n".join(
        f"2026-03-{1 + i % 28:02d}T{i % 24:02d}:{(7 * i) % 60:02d}:{(13 * i) % 60:02d}Z INFO registry: "
        f'stored entry={e["name"]} owner="{e["owner"]}" city={e["city"]} weight={e["weight_kg"]} '
        f"status={e['status']} code={e['code']}"
        for i, e in enumerate(es)
    ),
    "code": lambda es: "\n\n".join(
        f'ENTRIES["{e["name"]}"] = Entry(\n    owner="{e["owner"]}",\n    city="{e["city"]}",\n'
        f'    weight_kg={e["weight_kg"]},\n    status="{e["status"]}",\n    code="{e["code"]}",\n)'
        for e in es
    ),
    "cjk": lambda es: "\n\n".join(
        f"条目 {e['name']} 由 {e['owner']} 负责，存放在{e['zh_city']}的仓库，重量为 {e['weight_kg']} 公斤，"
        f"状态良好，上次检查时一切正常。条目 {e['name']} 的访问代码是 {e['code']}。"
        for e in es
    ),
}
TUNE_SHAPES = ("prose_lines", "json_pretty", "xml_pretty", "csv", "yaml")
REPORT_SHAPES = ("prose_wrapped", "json_wide", "json_minified", "xml_minified", "markdown_table", "logs", "code", "cjk")


def _cells(shapes: tuple[str, ...], other: list[tuple[str, str, str]]) -> list[str]:
    """Every shape with the question after the document (LF, chat), then the (shape, position, line ends) given."""
    return [f"{PREFIX}{s}/after/lf/chat" for s in shapes] + [f"{PREFIX}{s}/{p}/{e}/chat" for s, p, e in other]


# the cells each half is measured on: every shape with the question after the document, and the other positions and
# line ends on some of them (the report half: 8 shapes; the question before and on both sides on 2 shapes each, one
# of each with CRLF line ends)
TUNE_CELLS = _cells(
    TUNE_SHAPES,
    [
        ("csv", "before", "lf"),
        ("json_pretty", "both", "lf"),
        ("yaml", "after", "crlf"),
        ("prose_lines", "system", "lf"),
    ],
)
REPORT_CELLS = _cells(
    REPORT_SHAPES,
    [
        ("prose_wrapped", "before", "lf"),
        ("logs", "before", "crlf"),
        ("json_wide", "both", "lf"),
        ("code", "both", "crlf"),
    ],
)


def _question(shape: str, name: str) -> str:
    if shape == "cjk":
        return f"条目 {name} 的访问代码是什么？只回答代码。"
    if shape.startswith(("json", "xml", "csv", "markdown", "yaml")):
        return f"What is the code of the entry whose name is {name}? Answer with the code only."
    return f"What is the access code of the entry {name}? Answer with the code only."


def parse(task: str) -> tuple[str, str, str, str]:
    """shape, position, line ends, kind of a task name (one-line error naming the parts otherwise)."""
    parts = task[len(PREFIX) :].split("/") if task.startswith(PREFIX) else []
    if (
        len(parts) != 4
        or parts[0] not in SHAPES
        or parts[1] not in POSITIONS
        or parts[2] not in LINE_ENDS
        or (parts[3] not in KINDS)
    ):
        raise SpecPrefillError(
            f"unknown shape task {task!r}: use {PREFIX}<shape>/<position>/<line ends>/<kind> with shape one of "
            f"{', '.join(SHAPES)}; position {', '.join(POSITIONS)}; line ends {', '.join(LINE_ENDS)}; kind "
            f"{', '.join(KINDS)}"
        )
    if parts[1] == "system" and parts[3] != "chat":
        raise SpecPrefillError(f"{task!r}: a question in the system message needs kind chat")
    return parts[0], parts[1], parts[2], parts[3]


def prompt(tokenizer, task: str, entries: list[dict], asked: dict) -> str:
    """The prompt text of one task over these entries, asking for `asked`'s code."""
    shape, position, ends, kind = parse(task)
    doc = SHAPES[shape](entries)
    question = _question(shape, asked["name"])
    lead = "Here is the registry:" if shape != "cjk" else "以下是登记表："
    if position == "after":
        user = f"{lead}\n\n{doc}\n\n{question}"
    elif position == "before":
        user = f"{question}\n\n{lead}\n\n{doc}"
    elif position == "both":
        user = f"{question}\n\n{lead}\n\n{doc}\n\n{question}"
    else:
        user = f"{lead}\n\n{doc}"
    system = f"You answer questions about the registry the user sends. {question}" if position == "system" else None
    if kind == "completion":
        user = f"{user}\n{'Answer:' if shape != 'cjk' else '答案：'}"
    if ends == "crlf":
        user = user.replace("\n", "\r\n")
    if kind == "completion":
        return user
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]
    text: str = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return text


def _one(task: str, tokenizer, length: int, rng: random.Random) -> dict:
    names = [f"{a}-{n}" for a in ADJECTIVES for n in NOUNS]
    rng.shuffle(names)
    entries = [_entry(rng, name) for name in names[:300]]
    pick = rng.random()
    built: dict[str, int] = {}

    def build(count: int) -> str:
        text = prompt(tokenizer, task, entries[:count], entries[int(pick * count)])
        built[text] = count
        return text

    text, tokens = fit(tokenizer, build, length, len(entries))
    count = built[text]
    if count < MIN_RECORDS:
        raise SpecPrefillError(f"{length} tokens hold {count} entries of {task}, fewer than {MIN_RECORDS}: raise it")
    asked = entries[int(pick * count)]
    return {"input": text, "outputs": [asked["code"]], "length": tokens, "metric": "all", "records": count}


def generate(task: str, tokenizer, length: int, n: int, seed: int = 0) -> list[dict]:
    """n prompts of `task` within `length` tokens (as the tokenizer counts them)."""
    parse(task)
    return seeded_records(task, tokenizer, length, n, seed, _one)
