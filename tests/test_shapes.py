"""Selection on the prompts users send (`data.shapes`): the question found before, after or on both sides of the
document, in the system message, or not at all; line ends normalized; units and records on one-line documents
(minified JSON and XML, prose, CJK); a lexical signal that does not reward incidental matches; and with the
speculator's score flat, the default rule keeps the asked record on every shape, where the structure alone decides.
No model: the tests' tokenizer (test_units)."""

from __future__ import annotations

import random
import re

import pytest
import torch
from test_units import chat_ids, text_of, tokenizer

from specprefill import core, structure
from specprefill.config import SELECTION_RULES, SERVING_RULE, SpecPrefillConfig
from specprefill.core import query as core_query
from specprefill.core import selection as core_selection
from specprefill.data import shapes
from specprefill.errors import SpecPrefillError

LENGTH = 2000
DEFAULT = SpecPrefillConfig(keep_rate=0.3, **SELECTION_RULES[SERVING_RULE])


def layout_of(task: str, index: int = 0):
    rec = shapes.generate(task, tokenizer(), LENGTH, index + 1, seed=3)[index]
    ids = tokenizer()(rec["input"], add_special_tokens=False)["input_ids"]
    return rec, ids, structure.layout(tokenizer(), ids)


def chars_of(layout, span: tuple[int, int]) -> str:
    """The text of a token range (byte-level tokens of one CJK character share its span: read the text once)."""
    return layout.text[layout.spans[span[0]][0] : layout.spans[span[1] - 1][1]]


def test_the_shape_family_covers_what_the_issue_lists():
    assert len(shapes.REPORT_SHAPES) >= 8 and not set(shapes.REPORT_SHAPES) & set(shapes.TUNE_SHAPES)
    cells = [shapes.parse(c) for c in shapes.REPORT_CELLS]
    assert sum(p == "after" for _, p, _, _ in cells) >= 8
    assert sum(p == "before" for _, p, _, _ in cells) >= 2 and sum(p == "both" for _, p, _, _ in cells) >= 2
    assert sum(e == "crlf" for _, _, e, _ in cells) >= 2
    assert not {s for s, *_ in cells} & set(shapes.TUNE_SHAPES)  # report cells: shapes nobody tuned on
    with pytest.raises(SpecPrefillError, match="unknown shape task 'shape:yaml/middle/lf/chat'"):
        shapes.parse("shape:yaml/middle/lf/chat")
    with pytest.raises(SpecPrefillError, match="needs kind chat"):
        shapes.parse("shape:yaml/system/lf/completion")


@pytest.mark.parametrize("kind", shapes.KINDS)
@pytest.mark.parametrize("ends", shapes.LINE_ENDS)
@pytest.mark.parametrize("position", shapes.POSITIONS)
def test_the_question_is_found_where_the_user_put_it(position, ends, kind):
    if position == "system" and kind == "completion":
        return
    for shape in ("json_minified", "prose_wrapped", "cjk"):
        rec, ids, layout = layout_of(f"shape:{shape}/{position}/{ends}/{kind}")
        # the request: after the document where it is asked there (a question above it too is kept, not read)
        asked = [chars_of(layout, q) for q in (layout.query if position == "system" else layout.questions)]
        assert len(asked) == (2 if position == "system" else 1), (shape, asked)
        code = rec["outputs"][0]
        if position == "system":  # the user's message holds the lead line above its document; the system asks
            assert "registry" in asked[0] or "登记表" in asked[0], asked
            asked = asked[1:]
        if position == "both":  # the question above the document is kept beside the request
            above = layout.text.find(chars_of(layout, layout.questions[0]).split("\n")[0])
            assert any(layout.spans[a][0] <= above < layout.spans[b - 1][1] for a, b in layout.context), shape
        for q in asked:
            assert ("access code" in q or "code of the entry" in q or "访问代码" in q) and code not in q, (shape, q)
            assert len(q) < 200, q  # the question, not the document


def test_a_request_that_names_nothing_is_kept_whole_and_gives_no_query_signal():
    """Any mood: a summary request, thanks, a code stub are requests by where they sit (the end of the message),
    kept whole; their words name no line of the document, so the query signal is flat and the speculator decides."""
    tok = tokenizer()
    body = "\n\n".join(f"Crate {i} holds figs and was weighed on the quay at dawn." for i in range(40))
    for text, ask in (
        (body + "\n\nSummary of the manifest above in three sentences:", "Summary of the manifest"),
        ("def total(crates):\n    weights = [c.weight for c in crates]\n    return", "def total"),
        (
            tok.apply_chat_template(
                [{"role": "user", "content": body + "\n\nThanks, that is all for today."}],
                tokenize=False,
                add_generation_prompt=True,
            ),
            "Thanks, that is all",
        ),
    ):
        ids = tok(text, add_special_tokens=False)["input_ids"]
        layout = structure.layout(tok, ids)
        (request,) = [chars_of(layout, q) for q in layout.questions]
        assert request.startswith(ask) and "Crate" not in request, request
        units = core.cut(layout, len(ids), DEFAULT)
        assert not core.query_scores(layout, units).any()
        for s, e in layout.protected:
            assert "Crate" not in chars_of(layout, (s, e))


@pytest.mark.parametrize("brk", ["\r\n", "\r", "\u2028", "\u2029", "\x85"])
def test_line_breaks_read_as_newlines(brk):
    tok = tokenizer()
    lf = shapes.generate("shape:yaml/after/lf/completion", tok, LENGTH, 1)[0]["input"]
    other = lf.replace("\n", brk)
    a = structure.layout(tok, tok(lf)["input_ids"])
    b = structure.layout(tok, tok(other)["input_ids"])
    assert core.normalize_breaks(other).count("\n") == lf.count("\n") and len(core.normalize_breaks(other)) == len(
        other
    )
    # the same records and the same question (tokens differ where the break's bytes do; compare by text)
    assert len(a.record_of_line) == len(b.record_of_line) and len(set(a.record_of_line)) == len(set(b.record_of_line))
    assert [" ".join(chars_of(a, q).split()) for q in a.questions] == [
        " ".join(chars_of(b, q).split()) for q in b.questions
    ]


@pytest.mark.parametrize("shape", ["json_minified", "xml_minified"])
def test_a_one_line_document_is_cut_into_records(shape):
    """Minified JSON/XML: one line, yet each entry is its own record (as pretty-printed), so the query signal lifts
    the asked entry and not the whole document (today's rule lifted every unit: the line was one record)."""
    rec, ids, layout = layout_of(f"shape:{shape}/after/lf/chat")
    config = DEFAULT.replace(query_weight=1.0)
    units = core.cut(layout, len(ids), config)
    records = {h[1] for h in units.heads}
    assert len(records) >= rec["records"]
    asked, _, _ = core_query._by_record(core.query_scores(layout, units), units)
    lifted = (asked >= asked.max() * 0.5).sum()
    assert 0 < lifted <= 12, int(lifted)


def test_cjk_sentences_are_units_and_words_are_character_pairs():
    rec, ids, layout = layout_of("shape:cjk/after/lf/chat")
    assert len(layout.sentence_starts) >= rec["records"]
    words = [w for _, w in core.words_of("条目 calm-anchor 的访问代码是什么？")]
    assert "calm-anchor" in words and "访问" in words and "代码" in words and "条目" in words


def test_the_lexical_signal_weighs_no_stopword_and_no_lone_incidental_match():
    tok = tokenizer()
    lines = [f"Crate {i}: figs from Cadiz, handled with care, sealed." for i in range(30)]
    lines[7] = "Crate 7: the answer to the question is in the document, said the passage."
    lines[12] = "Crate 12: brass from Izmir, quay seven."
    lines[20] = "Crate 20: copper wire to Tromso, Halifax and Izmir, quay seven, routing noted."
    text = "\n".join(lines) + "\n\nQuestion: which crate went from Izmir to Halifax by Tromso routing?\nAnswer:"
    ids = tok(text)["input_ids"]
    layout = structure.layout(tok, ids)
    units = core.cut(layout, len(ids), SpecPrefillConfig(selection_unit="lines", chunk_size=32))
    q = core.query_scores(layout, units)

    def unit_of(s: str) -> int:
        at = layout.token_of(layout.text.index(s))
        return int(torch.searchsorted(torch.tensor(units.starts), at, right=True)) - 1

    assert q[unit_of("Crate 7:")] == 0  # template words only: "answer", "question", "document", "passage"
    # every rare word asked against one of them: one incidental match is a small share
    assert q[unit_of("Crate 20:")] > 0.7 and 0 < q[unit_of("Crate 12:")] < 0.35
    assert q[unit_of("Crate 3:")] == 0


CASES = [
    "shape:prose_wrapped/before/lf/chat",  # question first
    "shape:logs/after/crlf/chat",  # CRLF
    "shape:json_minified/after/lf/chat",  # one line
    "shape:cjk/after/lf/chat",  # CJK
    "shape:yaml/system/lf/chat",  # the question in the system message, the document in the user's
    "shape:markdown_table/both/crlf/completion",
]


@pytest.mark.parametrize("task", CASES)
def test_the_default_keeps_the_asked_record_where_structure_alone_decides(task):
    """The speculator's scores flat: what the default rule keeps is its structure and query signal alone. On every
    shape it keeps the asked entry's code and the question, at keep 0.3."""
    for index in range(3):
        rec, ids, layout = layout_of(task, index)
        kept = core.select(torch.ones(len(ids)), DEFAULT, layout).tolist()
        sent = text_of(layout, kept)
        assert rec["outputs"][0] in sent, (task, index)
        assert len(kept) <= core.n_to_keep(len(ids), 0.3) + DEFAULT.chunk_size
        for q in layout.questions:
            assert set(range(*q)) <= set(kept)


def test_a_document_in_the_system_message_is_pruned_like_any():
    tok = tokenizer()
    rec = shapes.generate("shape:csv/after/lf/completion", tok, LENGTH, 1)[0]
    doc, question = rec["input"].rsplit("\n\n", 1)
    ids = chat_ids(tok, [{"role": "system", "content": doc}, {"role": "user", "content": question}])
    layout = structure.layout(tok, ids)
    protected = {i for s, e in (*layout.protected, *layout.questions) for i in range(s, e)}
    assert len(protected) < 0.1 * len(ids)  # markers and the question: the document is not protected
    kept = core.select(torch.ones(len(ids)), DEFAULT.replace(keep_rate=0.1), layout).tolist()
    assert len(kept) <= core.n_to_keep(len(ids), 0.1) + DEFAULT.chunk_size
    assert rec["outputs"][0] in text_of(layout, kept)


@pytest.mark.parametrize("kind", shapes.KINDS)
def test_crlf_reads_the_question_paragraph_as_lf_does(kind):
    """A question paragraph of several lines after a blank line: with CRLF line ends the same paragraph is the
    question as with LF (today's rule looked for "\\n\\n" only and took the last lines: the instruction, not the
    question)."""
    tok = tokenizer()
    doc = shapes.SHAPES["logs"]([shapes._entry(random.Random(i), f"calm-{i}") for i in range(30)])
    ask = (
        "Question: What is the code of the entry calm-17?\nThink about which entry is meant, then answer with the "
        "code only.\nAnswer:"
    )
    found = []
    for brk in ("\n", "\r\n"):
        text = f"{doc}\n\n{ask}".replace("\n", brk)
        if kind == "chat":
            text = tok.apply_chat_template(
                [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
            )
        layout = structure.layout(tok, tok(text, add_special_tokens=False)["input_ids"])
        found.append([" ".join(chars_of(layout, q).split()) for q in layout.questions])
    assert found[0] == found[1] and len(found[0]) == 1 and found[0][0].startswith("Question: What is the code")


@pytest.mark.parametrize(("n", "off_loop"), [(300, False), (3000, True)])
def test_a_long_prompts_structure_is_read_off_the_event_loop(n, off_loop):
    """The server's speculator reads a long prompt's structure (and selects in it) in a worker thread: other
    requests' streams go on meanwhile. A short one stays on the loop (a thread hop costs more than it saves)."""
    import asyncio
    import threading

    from specprefill import tokenmap
    from specprefill.engines.vllm.async_speculator import AsyncSpeculator, TokenBudget

    spec = AsyncSpeculator.__new__(AsyncSpeculator)
    spec.pair, spec.budget = tokenmap.Pair(tokenizer()), TokenBudget(10**6)
    seen = {}

    class Heads:
        def speculation(self, pair, ids, config, tmap=None):
            seen["thread"] = threading.get_ident()
            raise StopAsyncIteration  # stop here: what is asserted is where this ran

    spec.heads = Heads()

    async def run():
        seen["loop"] = threading.get_ident()
        with pytest.raises(StopAsyncIteration):
            await spec.speculate(list(range(3, 3 + n)), DEFAULT)

    asyncio.run(run())
    assert (seen["thread"] != seen["loop"]) is off_loop


def test_the_paper_profiles_and_the_lm_eval_model_run_the_originals_chunks(monkeypatch):
    """What reproduces the paper selects as the original did (fixed chunks, nothing protected, no query signal):
    every notebook under every paper profile, and lm-eval's `specprefill` model built from model arguments. The
    library, the CLI and the server default to the serving rule instead, and say so (`SpecPrefillConfig.rule`)."""
    from pathlib import Path

    from specprefill.workbench import parameters

    root = Path(__file__).resolve().parents[1]
    profiles = [p.name for p in (root / "params").iterdir() if p.name.startswith("paper-")]
    assert {"paper-8b", "paper-70b", "paper-405b", "paper-mini"} <= set(profiles)
    checked = 0
    for profile in profiles:
        for name in parameters.notebooks(root):
            cell = parameters.parameters_cell(root / "notebooks" / f"{name}.ipynb")
            if "selection_unit" not in cell:
                continue
            params = {**cell, **parameters.load_params(root, profile, name)}
            config = SpecPrefillConfig.pick(params)
            assert config.rule == "chunks", (profile, name, config.rule)
            checked += 1
    assert checked >= 20

    from specprefill import lm_eval as lm
    from specprefill.engines.vllm import pair

    built = {}

    def capture(params, knobs=None, **kw):
        built["knobs"] = knobs
        raise RuntimeError("stop")

    monkeypatch.setattr(pair.SpecPrefillLLM, "from_params", staticmethod(capture))
    monkeypatch.setattr(lm, "check_models", lambda params: None)
    with pytest.raises(RuntimeError, match="stop"):
        lm.SpecPrefillLM(pretrained="qwen2.5-coder-1.5b", speculator="qwen2.5-coder-0.5b")
    assert SpecPrefillConfig(**built["knobs"]).rule == "chunks"
    assert (
        SpecPrefillConfig().rule == "chunks" and SpecPrefillConfig(**SELECTION_RULES[SERVING_RULE]).rule == SERVING_RULE
    )
    assert SpecPrefillConfig(protect=True, query_weight=0.2).rule.startswith("custom (selection_unit=chunks")


def test_the_request_is_read_from_where_it_sits_in_any_mood_and_language():
    """No word decides what asks: the text after the document is the request in any mood and language (a question,
    an imperative, a need, German, Spanish, Chinese, no question mark), and a line above the document (a title, an
    instruction) is kept beside it, not read as the request. Today's rule missed the imperatives and the languages
    its word lists lacked, and took "Please use the register below." for the question."""
    tok = tokenizer()
    doc = "\n".join(f"Crate {i}: {i * 3} apples, stored in Cadiz." for i in range(40))
    asked = [
        "Please tell me how many apples crate 7 holds.",
        "Give me the apples of crate 7",
        "I need the apple count of crate 7",
        "**Question**: how many apples does crate 7 hold",
        "Which crate holds 21 apples? Answer with its number.",
        "Wie viele Äpfel enthält Kiste 7",
        "Dime cuántas manzanas tiene la caja 7",
        "请告诉我第7箱有多少个苹果",
        "What does crate 7 hold? Sorry, I meant crate 8.",
    ]
    for head in ("", "Please use the register below.\n\n", "# How to install\n\n", "Name Age City\n\n"):
        for ask in asked:
            layout = structure.layout(tok, tok(f"{head}{doc}\n\n{ask}")["input_ids"])
            assert [chars_of(layout, q) for q in layout.questions] == [ask], (head, ask)
            if head:
                assert [chars_of(layout, q) for q in layout.context] == [head.strip()], (head, ask)
    # asked first: the question above the document is the request, the document's last line is not
    layout = structure.layout(tok, tok(f"Give me the apples of crate 7\n\n{doc}")["input_ids"])
    assert [chars_of(layout, q) for q in layout.questions] == ["Give me the apples of crate 7"]
    # a question on the same line as a one-line document
    one_line = " ".join(f"Crate {i} holds {i * 3} apples." for i in range(80)) + " How many apples does crate 7 hold?"
    layout = structure.layout(tok, tok(one_line)["input_ids"])
    assert [chars_of(layout, q) for q in layout.questions] == ["How many apples does crate 7 hold?"]


def test_protection_keeps_the_generation_prompt_then_the_users_question_first():
    tok = tokenizer()
    doc = "\n".join(
        f"Crate {i}: {i * 3} apples, stored in Cadiz, weighed at dawn by the quay master." for i in range(60)
    )
    messages = [
        {"role": "system", "content": "Which crate has the most pears? " + doc},
        {"role": "user", "content": doc + "\n\nHow many apples does crate 7 hold?"},
    ]
    ids = chat_ids(tok, messages)
    layout = structure.layout(tok, ids)
    (user_q,) = layout.questions  # the user's; the system message's own question is kept beside it
    assert chars_of(layout, user_q) == "How many apples does crate 7 hold?"
    assert any(chars_of(layout, r).startswith("Which crate has the most pears?") for r in layout.context)
    for rate in (0.01, 0.02):
        budget = core.n_to_keep(len(ids), rate)
        keep = set(
            core_selection.protect(layout, DEFAULT.replace(keep_rate=rate), budget, len(ids))
            .nonzero()
            .flatten()
            .tolist()
        )
        assert set(range(*layout.protected[0])) <= keep  # the generation prompt, first
        if budget // 2 >= 60:
            assert set(range(*user_q)) <= keep


def test_unbalanced_quotes_and_angle_brackets_do_not_end_a_lines_structure():
    from specprefill.core.text import breaks

    line = '{"a": "unterminated, ' + ", ".join(f"k{i}: {i}" for i in range(120)) + "}"
    assert len(breaks(line)) > 40
    prose = "When a<b and c>d holds, the rule applies. " + " ".join(f"Sentence {i} ends here." for i in range(30))
    pieces = breaks(prose)
    assert len(pieces) >= 30 and all(d == 0 for _, _, d in pieces)


def test_crlf_completion_prompts_have_single_line_ends():
    rec = shapes.generate("shape:csv/after/crlf/completion", tokenizer(), LENGTH, 1)[0]
    assert "\r\r" not in rec["input"] and rec["input"].count("\r\n") == rec["input"].count("\n")


def test_a_question_in_the_system_message_is_read_beside_its_instructions():
    """The user's message holds the document under a lead line and asks nothing after it; the system message asks
    beside its instructions ("You answer questions about the registry the user sends. What is the access code of the
    entry X?"): the query reads it, and the asked entry's units hold most of the weight, the template's markers none."""
    rec, ids, layout = layout_of("shape:prose_lines/system/lf/chat")
    query = [chars_of(layout, q) for q in layout.query]
    assert any("What is the access code of the entry" in q for q in query)  # the system message, read whole
    units = core.cut(layout, len(ids), DEFAULT)
    share, _, _ = core_query._by_record(core.query_scores(layout, units), units)
    name = rec["input"][rec["input"].index("entry ") + 6 :].split("?")[0]
    at = layout.token_of(layout.text.index(name, layout.text.index("registry:")))  # the name in the document
    holding = int(torch.searchsorted(torch.tensor(units.starts), at, right=True)) - 1
    assert float(share[holding]) == float(share.max()) > 0.6
    assert int((share >= 0.5 * share.max()).sum()) <= 0.1 * len(units.starts)  # the asked entry's units, few others
    own = core.query_scores(layout, units)
    for s, e in layout.protected:  # the template's markers are no unit's words
        assert all(own[u] == 0 for u in range(len(units.starts)) if s <= units.span(u)[0] < e)


def test_a_kept_unit_of_the_asked_record_brings_the_key_the_question_names():
    """A 17-field JSON object whose name sits in its middle, the speculator's score favouring every field but the
    name's: a kept unit of the asked entry brings the unit holding its name, so the base reads whose code it keeps
    (before, the lift kept the entry's other fields and left its name out)."""
    rec, ids, layout = layout_of("shape:json_wide/after/lf/chat")
    units = core.cut(layout, len(ids), DEFAULT)
    name = rec["input"].split("whose name is ")[-1].split("?")[0]
    at_name = layout.token_of(layout.text.index(f'"name": "{name}"'))
    at_code = layout.token_of(layout.text.index(rec["outputs"][0]))
    index = units.index()
    importance = torch.rand(len(ids), generator=torch.Generator().manual_seed(0))
    importance[index == index[at_name]] = 0.0  # the name's unit: the least attended
    for keep in (0.3, 0.1):
        kept = set(core.select(importance, DEFAULT.replace(keep_rate=keep), layout).tolist())
        assert at_code in kept and at_name in kept, keep


def test_a_list_of_entries_brings_its_header_and_not_its_first_entry():
    """One-line entries in a run too long to be one record: a CSV row brings the CSV's header line (the field names);
    a log line does not bring the log's first line (another entry: a distractor that cost budget on every prompt)."""
    for shape, header in (("csv", True), ("markdown_table", True), ("logs", False), ("prose_lines", False)):
        rec, ids, layout = layout_of(f"shape:{shape}/after/lf/chat")
        units = core.cut(layout, len(ids), DEFAULT)
        first = layout.text.index("\n\n", layout.text.index("registry:")) + 2  # the document's first line
        head = int(units.index()[layout.token_of(first)])
        last = int(units.index()[layout.token_of(layout.text.rindex(rec["outputs"][0] if shape != "csv" else ","))])
        second = int(units.index()[layout.token_of(layout.text.index("\n", first) + 1)])  # the line after it
        brought = {v for u in range(second, last) for v in units.heads[u]}
        assert (head in brought) == header, shape


def test_a_header_is_read_from_the_lines_after_it_and_a_keyed_records_name_stays_its_head():
    """A list of names (no digit in it) followed by a question with digits: its first entry is no header (only the
    lines right after a first line decide). A long record under a line naming it ("Crate 4:" above its fields) still
    brings that line, digits in it or not: it is the record's key, not a list's first entry."""
    tok = tokenizer()
    names = "\n".join(
        f"{a} {b}" for a in ("Ada", "Bo", "Cy", "Di", "Ed", "Flo") for b in ("Lind", "Sato", "Reed", "Petit")
    )
    text = chat_ids(tok, [{"role": "user", "content": f"Guests:\n\n{names}\n\nWhich guest sits at table 12 of 40?"}])
    layout = structure.layout(tok, text)
    config = DEFAULT.replace(chunk_size=4)
    units = core.cut(layout, len(text), config)
    first = int(units.index()[layout.token_of(layout.text.index("Ada Lind"))])
    later = int(units.index()[layout.token_of(layout.text.index("Flo Reed"))])
    assert first not in units.heads[later]
    fields = "\n".join(f"  field_{i}: value number {i} of the crate" for i in range(30))
    manifest = f"Manifest:\n\nCrate 4:\n{fields}\n\nWhat is field_27 of crate 4?"
    ids = chat_ids(tok, [{"role": "user", "content": manifest}])
    layout = structure.layout(tok, ids)
    units = core.cut(layout, len(ids), config)
    name = int(units.index()[layout.token_of(layout.text.index("Crate 4:"))])
    deep = int(units.index()[layout.token_of(layout.text.index("field_27: value"))])
    assert name in units.heads[deep]


def test_the_key_unit_is_the_one_holding_the_name():
    rec, ids, layout = layout_of("shape:json_wide/after/lf/chat")
    units = core.cut(layout, len(ids), DEFAULT)
    name = rec["input"].split("whose name is ")[-1].split("?")[0]
    index = units.index()
    at_name = int(index[layout.token_of(layout.text.index(f'"name": "{name}"'))])
    at_code = int(index[layout.token_of(layout.text.index(rec["outputs"][0]))])
    _, keys, _ = core_query._by_record(core.query_scores(layout, units), units)
    assert keys[at_code] == at_name and keys[at_name] == at_name


@pytest.mark.parametrize(
    ("task", "first"),
    [
        ("shape:prose_wrapped/before/lf/chat", True),
        ("shape:logs/before/crlf/completion", True),
        ("shape:yaml/system/lf/chat", True),
        ("shape:prose_wrapped/after/lf/chat", False),
        ("shape:json_wide/both/lf/chat", False),
    ],
)
def test_asked_first_means_the_document_follows_the_question(task, first):
    _, ids, layout = layout_of(task)
    assert core_selection.asked_first(layout, len(ids)) == first


def test_a_document_in_an_earlier_turn_is_not_asked_first():
    """A chat whose document sits in an earlier user turn and whose last turn asks: the question comes after the
    document, whatever the earlier turn asked."""
    tok = tokenizer()
    rec = shapes.generate("shape:prose_wrapped/after/lf/completion", tok, LENGTH, 1, seed=3)[0]
    doc = rec["input"].rsplit("\n\n", 1)[0]
    turns = [
        {"role": "user", "content": f"Can you keep this registry for me?\n\n{doc}"},
        {"role": "assistant", "content": "Yes, I have it."},
        {"role": "user", "content": rec["input"].rsplit("\n\n", 1)[1]},
    ]
    ids = chat_ids(tok, turns)
    layout = structure.layout(tok, ids)
    assert layout.questions and not core_selection.asked_first(layout, len(ids))


def _codes(text: str) -> set[str]:
    return set(re.findall(r"\b[A-Z]+-\d{4}\b", text))


@pytest.mark.parametrize("shape", ["prose_wrapped", "logs", "csv"])
def test_a_question_asked_first_keeps_the_records_it_names_and_not_the_speculators_other_picks(shape):
    """The question before the document: the speculator's scores favour other entries (its answer candidates: with
    the question far from where it answers, the base given the asked entry among a few of them answers with one of
    those). The rule keeps the entries the question names, no other entry's code, and the question whole (what the
    protection cap cut comes back in the budget the document did not take), within the budget, at keep 0.3 far
    under it; at keep 0.05, where the cap binds and no named entry fits whole, a piece of a named entry still goes
    with the question (never the protected spans alone)."""
    for keep in (0.3, 0.1, 0.05):
        config = DEFAULT.replace(keep_rate=keep)
        for index in range(3):
            rec, ids, layout = layout_of(f"shape:{shape}/before/lf/chat", index)
            importance = torch.rand(len(ids), generator=torch.Generator().manual_seed(index))
            at_code = layout.token_of(layout.text.index(rec["outputs"][0]))
            importance[max(0, at_code - 40) : at_code + 40] = 0.0  # the asked entry: the least attended
            kept = core.select(importance, config, layout).tolist()
            budget, sent = core.n_to_keep(len(ids), keep), text_of(layout, kept)
            assert len(kept) <= budget + config.chunk_size, (keep, index)
            protected = {i for s, e in (*layout.protected, *layout.questions) for i in range(s, e)}
            assert set(kept) - protected, (keep, index)  # a document token goes with the question
            if keep == 0.05:
                continue
            # the asked entry's code, and at most those of two entries sharing a word of its name (a partial match)
            assert rec["outputs"][0] in sent and len(_codes(sent)) <= 3, (keep, index, _codes(sent))
            for q in layout.questions:
                assert set(range(*q)) <= set(kept), (keep, index)
            if keep == 0.3:
                assert len(kept) < 0.6 * budget
    # regression guard: the same shape with the question after the document fills the budget as before the rule
    rec, ids, layout = layout_of(f"shape:{shape}/after/lf/chat")
    kept = core.select(torch.rand(len(ids), generator=torch.Generator().manual_seed(0)), DEFAULT, layout).tolist()
    assert len(kept) >= core.n_to_keep(len(ids), DEFAULT.keep_rate) - DEFAULT.chunk_size


def test_a_question_asked_first_that_names_nothing_leaves_the_budget_to_the_speculator():
    """Asked first, but no record holds the question's words (a summary, a question about the whole): the budget is
    filled by the speculator's scores as anywhere."""
    tok = tokenizer()
    rec = shapes.generate("shape:prose_wrapped/after/lf/completion", tok, LENGTH, 1, seed=3)[0]
    doc = rec["input"].rsplit("\n\n", 1)[0]
    ids = chat_ids(tok, [{"role": "user", "content": f"Which cities appear most often below?\n\n{doc}"}])
    layout = structure.layout(tok, ids)
    assert core_selection.asked_first(layout, len(ids))
    kept = core.select(torch.rand(len(ids), generator=torch.Generator().manual_seed(1)), DEFAULT, layout).tolist()
    assert len(kept) >= core.n_to_keep(len(ids), DEFAULT.keep_rate) - DEFAULT.chunk_size
