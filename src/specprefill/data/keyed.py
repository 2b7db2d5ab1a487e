"""Keyed records: a document of many similar records from one template, a question that names one record's key
and asks for a value stated at the other end of it ("What is the seal code of crate 417?").

Why: fixed 32-token chunks cut a record from its key, and a base that sees "Its seal code is OCHRE-8588" without
"Crate 417:" answers with another record's code. Each record puts 25-40 tokens of its own details between its key
and its value, so the two lie in different 32-token chunks. Two tasks, generated locally at a target token length:
- keyed_records: prose paragraphs and (every third record) multi-line records, an indented field per line with the
  key on the line above them, so snapping units to lines alone does not keep the key;
- keyed_json: the same records as a pretty-printed JSON array (a tool result or an API listing).
Every record: {"task", "index", "input", "outputs", "length", "metric": "all", "target_length"}.
"""

from __future__ import annotations

import json
import random

from specprefill.data.ruler import ADJECTIVES, NOUNS, fit
from specprefill.errors import SpecPrefillError

TASKS = ("keyed_records", "keyed_json")
MIN_RECORDS = 40
GOODS = [
    "copper wire",
    "dried figs",
    "ceramic tiles",
    "wool bales",
    "olive oil",
    "tin plates",
    "cedar planks",
    "glass beads",
    "rope coils",
    "salt blocks",
    "linen rolls",
    "brass fittings",
    "tea chests",
    "iron nails",
]
PORTS = ["Valparaiso", "Antwerp", "Mombasa", "Tromso", "Cadiz", "Halifax", "Izmir", "Darwin", "Recife", "Gdansk"]
HANDLERS = ["Ines Varga", "Tomas Reed", "Mei Okafor", "Luca Brandt", "Asha Lind", "Omar Petit", "Nora Sato"]
COLORS = ["OCHRE", "TEAL", "UMBER", "CORAL", "SLATE", "AMBER", "MAUVE", "OLIVE", "CYAN", "RUST", "IVORY", "JADE"]


def _crate(rng: random.Random, key: int) -> dict:
    return {
        "crate": key,
        "goods": rng.choice(GOODS),
        "weight_kg": rng.randint(40, 900),
        "route": f"{rng.choice(PORTS)} to {rng.choice(PORTS)}",
        "handler": rng.choice(HANDLERS),
        "notes": f"keep from the {rng.choice(NOUNS)}, {rng.choice(ADJECTIVES)} lid",
        "seal_code": f"{rng.choice(COLORS)}-{rng.randint(1000, 9999)}",
    }


def _prose(c: dict) -> str:
    return (
        f"Crate {c['crate']}: {c['goods']}, {c['weight_kg']} kg, {c['route']}, handled by {c['handler']} "
        f"({c['notes']}). Its seal code is {c['seal_code']}.\n\n"
    )


def _lines(c: dict) -> str:
    fields = ["goods", "route", "handler", "notes", "seal_code"]
    return f"Crate {c['crate']}:\n" + "".join(f"  {f.replace('_', ' ')}: {c[f]}\n" for f in fields) + "\n"


def _document(task: str, crates: list[dict]) -> str:
    if task == "keyed_json":
        fields = ("crate", "goods", "route", "seal_code")
        return "Cargo manifest (JSON):\n" + json.dumps([{f: c[f] for f in fields} for c in crates], indent=1) + "\n\n"
    return "Cargo manifest:\n\n" + "".join(_lines(c) if i % 3 == 2 else _prose(c) for i, c in enumerate(crates))


def _question(task: str, key: int) -> str:
    if task == "keyed_json":
        return f"What is the seal_code of the crate whose crate field is {key}? Answer with the code only.\nAnswer:"
    return f"What is the seal code of crate {key}? Answer with the code only.\nAnswer:"


def _one(task: str, tokenizer, length: int, rng: random.Random) -> dict:
    """One document: as many records as `length` tokens hold, one of them asked for at a random depth."""
    crates = [_crate(rng, k) for k in rng.sample(range(100, 1000), 400)]
    pick = rng.random()
    built: dict[str, int] = {}

    def build(count: int) -> str:
        text = _document(task, crates[:count]) + _question(task, crates[int(pick * count)]["crate"])
        built[text] = count
        return text

    text, tokens = fit(tokenizer, build, length, len(crates))
    count = built[text]
    if count < MIN_RECORDS:
        fits = -(-length * (MIN_RECORDS + 2) // max(count, 1) // 512) * 512  # with a margin, in steps of 512
        raise SpecPrefillError(
            f"{length} tokens hold {count} {task} records with this tokenizer, fewer than {MIN_RECORDS}: "
            f"use a length >= {fits}"
        )
    asked = crates[int(pick * count)]
    return {"input": text, "outputs": [asked["seal_code"]], "length": tokens, "metric": "all", "records": count}


def generate(task: str, tokenizer, length: int, n: int, seed: int = 0) -> list[dict]:
    """n documents of `task` within `length` tokens (as the tokenizer counts them), each with >= 40 records."""
    if task not in TASKS:
        raise SpecPrefillError(f"unknown keyed-record task {task!r}: use one of {', '.join(TASKS)}")
    return [
        {
            "task": task,
            "index": i,
            "target_length": length,
            **_one(task, tokenizer, length, random.Random(f"{task}-{length}-{seed}-{i}")),
        }
        for i in range(n)
    ]
