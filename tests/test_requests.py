"""The held-out failures of the default selection, one test of each kind on prompts of this file's own (issue 81's
list): the question first over one-record-a-line people whose first and last names recur, the question first over
markdown sections (the value under the heading that names it), CRLF records, a correction after the question, the
answer in an earlier assistant message, a request in another language or mood. The speculator's scores are
adversarial where it matters (the asked record the least attended), so the structure alone must keep the answer.
No model: the tests' tokenizer (test_units)."""

from __future__ import annotations

import random

import torch
from test_units import chat_ids, text_of, tokenizer

from specprefill import core, structure
from specprefill.config import SELECTION_RULES, SERVING_RULE, SpecPrefillConfig

DEFAULT = SpecPrefillConfig(keep_rate=0.3, **SELECTION_RULES[SERVING_RULE])
FIRST = ["Jane", "John", "Ada", "Omar", "Nora", "Luca", "Ines", "Asha"]
LAST = ["Smith", "Doe", "Lind", "Petit", "Sato", "Brandt", "Varga", "Okafor"]


def _people(seed: int, n: int = 48) -> list[tuple[str, str]]:
    """(name, code) of n people whose first and last names recur across records, each full name once."""
    rng = random.Random(seed)
    names = [f"{f} {s}" for f in FIRST for s in LAST]
    rng.shuffle(names)
    return [(name, f"{rng.choice('KMPRT')}{rng.randint(1000, 9999)}") for name in names[:n]]


def _kept_text(ids: list[int], at_answer: str, layout, config=DEFAULT, seed: int = 0) -> str:
    """The text the default keeps when the speculator attends to everything but the answer's neighbourhood."""
    importance = torch.rand(len(ids), generator=torch.Generator().manual_seed(seed)) * 0.5 + 0.5
    at = layout.token_of(layout.text.rindex(at_answer))
    importance[max(0, at - 24) : at + 24] = 0.0
    return text_of(layout, core.select(importance, config, layout).tolist())


def test_the_question_first_over_records_whose_names_recur_keeps_the_asked_persons_record():
    tok = tokenizer()
    for seed in range(4):
        people = _people(seed)
        name, code = people[seed * 7 % len(people)]
        doc = "\n".join(f"{n}, office {i % 9}, badge code {c}" for i, (n, c) in enumerate(people))
        ids = chat_ids(tok, [{"role": "user", "content": f"What is the badge code of {name}?\n\n{doc}"}])
        layout = structure.layout(tok, ids)
        sent = _kept_text(ids, code, layout, seed=seed)
        assert f"{name}, office {people.index((name, code)) % 9}, badge code {code}" in sent, seed
        # not a set of look-alikes (today's rule kept only records sharing a first or last name with the asked one:
        # the base answered with one of them)
        kept = [n for n, c in people if c in sent and n != name]
        alike = [n for n in kept if set(n.split()) & set(name.split())]
        assert len(alike) <= len(kept) / 2, (seed, alike, kept)


def test_the_question_first_over_markdown_sections_keeps_the_value_under_the_named_heading():
    """The heading names the record, a blank line, then bullets with the value: the heading owns its section."""
    tok = tokenizer()
    for seed in range(4):
        people = _people(seed, 30)
        name, code = people[seed * 5 + 3]
        doc = "\n\n".join(f"## {n}\n\n- office: {i % 9}\n- badge code: {c}" for i, (n, c) in enumerate(people))
        ids = chat_ids(tok, [{"role": "user", "content": f"Give me the badge code of {name}.\n\n{doc}"}])
        layout = structure.layout(tok, ids)
        assert code in _kept_text(ids, code, layout, seed=seed), (seed, name)


def test_crlf_records_select_what_lf_records_select():
    tok = tokenizer()
    people = _people(3)
    name, code = people[20]
    doc = "\n".join(f"{n}: office {i % 9}, badge code {c}" for i, (n, c) in enumerate(people))
    sent = []
    for brk in ("\n", "\r\n"):
        content = (
            f"Here is the staff register.{brk}{brk}{doc.replace(chr(10), brk)}{brk}{brk}Which badge code has {name}?"
        )
        ids = chat_ids(tok, [{"role": "user", "content": content}])
        layout = structure.layout(tok, ids)
        assert [text_of(layout, range(*q)).strip() for q in layout.questions] == [f"Which badge code has {name}?"]
        sent.append(_kept_text(ids, code, layout, DEFAULT.replace(keep_rate=0.1)).replace("\r", ""))
    assert code in sent[0] and code in sent[1]


def test_a_correction_after_the_question_keeps_the_corrected_record():
    tok = tokenizer()
    for seed in range(4):
        people = _people(seed + 10)
        (first, _), (meant, code) = people[5], people[30 - seed]
        doc = "\n".join(f"{n}: office {i % 9}, badge code {c}" for i, (n, c) in enumerate(people))
        ask = f"What is the badge code of {first}? Sorry, I meant {meant}."
        ids = chat_ids(tok, [{"role": "user", "content": f"{doc}\n\n{ask}"}])
        layout = structure.layout(tok, ids)
        assert code in _kept_text(ids, code, layout, DEFAULT.replace(keep_rate=0.1), seed), (seed, meant)


def test_the_answer_in_an_earlier_assistant_message_is_kept():
    tok = tokenizer()
    people = _people(21, 8)
    name, code = people[3]
    listing = "\n".join(f"- {n}: {c}" for n, c in people)
    filler = "\n".join(f"Note {i}: the register was checked on day {i} by the clerk on duty." for i in range(80))
    messages = [
        {"role": "user", "content": f"{filler}\n\nWhich badge codes do the new staff have?"},
        {"role": "assistant", "content": f"The new staff's badge codes:\n{listing}"},
        {"role": "user", "content": f"Thanks. Which code did you give for {name}?"},
    ]
    ids = chat_ids(tok, messages)
    layout = structure.layout(tok, ids)
    for keep in (0.3, 0.1):
        assert code in _kept_text(ids, code, layout, DEFAULT.replace(keep_rate=keep)), keep


def test_a_request_in_any_language_or_mood_keeps_the_asked_record():
    tok = tokenizer()
    people = _people(5)
    name, code = people[17]
    doc = "\n".join(f"{n}: office {i % 9}, badge code {c}" for i, (n, c) in enumerate(people))
    for ask in (
        f"Gib mir den Ausweiscode von {name}",
        f"Necesito el código de {name}",
        f"请告诉我 {name} 的代码",
        f"I need the badge code of {name}",
        f"Badge code of {name}, please",
    ):
        ids = chat_ids(tok, [{"role": "user", "content": f"{doc}\n\n{ask}"}])
        layout = structure.layout(tok, ids)
        assert [text_of(layout, range(*q)).strip() for q in layout.questions] == [ask]
        assert code in _kept_text(ids, code, layout, DEFAULT.replace(keep_rate=0.1)), ask
