"""Selection that follows the prompt's structure (`core.units`, `structure`): units, record keys, protected spans,
the budget and the query signal, on a real byte-level BPE tokenizer trained here with chat templates of two
families (no model)."""

from __future__ import annotations

import functools
import random

import pytest
import torch

from specprefill import core, structure, tokenmap
from specprefill.config import QUESTION_TOKENS, SpecPrefillConfig
from specprefill.core import selection as core_selection
from specprefill.data import keyed
from specprefill.errors import SpecPrefillError

CHATML = (
    "{% if tools %}<|im_start|>system\n{% if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
    "# Tools\n<tools>\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}</tools><|im_end|>\n"
    "{% elif messages[0].role != 'system' %}<|im_start|>system\nYou are helpful.<|im_end|>\n{% endif %}"
    "{% for m in messages %}{% if not (tools and loop.first and m.role == 'system') %}"
    "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# a Llama-3-like template: headers, tools written into the last user message, no default system message
HEADERS = (
    "<|begin|>{% for m in messages %}{% if loop.last and tools %}<|head|>{{ m.role }}<|end_head|>\n\nTools:\n"
    "{% for t in tools %}{{ t | tojson }}\n{% endfor %}End of tools.\n\n{{ m.content }}<|eot|>"
    "{% else %}<|head|>{{ m.role }}<|end_head|>\n\n{{ m.content }}<|eot|>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|head|>assistant<|end_head|>\n\n{% endif %}"
)
SPECIALS = ["<|im_start|>", "<|im_end|>", "<|begin|>", "<|head|>", "<|end_head|>", "<|eot|>"]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "lookup_crate",
            "description": "Find a crate by its number",
            "parameters": {"type": "object", "properties": {"crate": {"type": "integer"}}},
        },
    }
]


@functools.cache
def tokenizer(template: str = CHATML):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = [keyed._document(t, [keyed._crate(random.Random(i), 100 + i) for i in range(30)]) for t in keyed.TASKS]
    trainer = trainers.BpeTrainer(
        vocab_size=3000, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(corpus * 3, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>")
    fast.chat_template = template
    return fast


def chat_ids(tok, messages, tools=None) -> list[int]:
    text = tok.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    return tok(text, add_special_tokens=False)["input_ids"]


def text_of(layout: core.Layout, tokens) -> str:
    return "".join(layout.text[layout.spans[i][0] : layout.spans[i][1]] for i in tokens)


def keyed_document(task: str, seed: int) -> dict:
    return keyed.generate(task, tokenizer(), 2048, 1, seed)[0]


def token_at(layout: core.Layout, char: int) -> int:
    return next(i for i, (s, e) in enumerate(layout.spans) if s <= char < e)


def key_and_value(layout: core.Layout, record: dict, task: str) -> tuple[int, int]:
    value_char = layout.text.index(record["outputs"][0])
    key_text = '"crate": ' if task == "keyed_json" else "Crate "
    return token_at(layout, layout.text.rindex(key_text, 0, value_char)), token_at(layout, value_char)


# ---------------------------------------------------------------- keyed records: the key comes with its value


@pytest.mark.parametrize("task", keyed.TASKS)
def test_records_keep_the_key_of_a_kept_value_where_chunks_do_not(task):
    cut_apart = 0
    for seed in range(6):
        record = keyed_document(task, seed)
        ids = tokenizer()(record["input"])["input_ids"]
        layout = structure.layout(tokenizer(), ids)
        key, value = key_and_value(layout, record, task)
        scores = torch.rand(len(ids), generator=torch.Generator().manual_seed(seed)) * 0.5
        scores[value : value + 3] = 10.0  # the speculator finds the value, not the key
        for rate in (0.1, 0.3):
            kept = set(
                core.select(scores, SpecPrefillConfig(keep_rate=rate, selection_unit="records"), layout).tolist()
            )
            assert {key, value} <= kept, (task, seed, rate)
            chunks = set(core.select(scores, SpecPrefillConfig(keep_rate=rate)).tolist())
            assert value in chunks
            cut_apart += key not in chunks
    assert cut_apart >= 6, "the task must separate key and value across chunks in most documents"


def test_keyed_documents_hold_forty_records_and_multi_line_ones():
    record = keyed_document("keyed_records", 0)
    assert record["records"] >= keyed.MIN_RECORDS and record["length"] <= 2048
    assert "\n  seal code: " in record["input"] and "Its seal code is " in record["input"]
    assert record["input"].rstrip().endswith("Answer:") and record["metric"] == "all"
    json_record = keyed_document("keyed_json", 0)
    assert json_record["records"] >= keyed.MIN_RECORDS and '"seal_code": ' in json_record["input"]
    with pytest.raises(SpecPrefillError, match="fewer than 40") as short:
        keyed.generate("keyed_records", tokenizer(), 1024, 1)
    named = int(str(short.value).rsplit(">= ", 1)[1])  # the length the message names holds them
    assert keyed.generate("keyed_records", tokenizer(), named, 1)[0]["records"] >= keyed.MIN_RECORDS
    with pytest.raises(SpecPrefillError, match="keyed_records, keyed_json"):
        keyed.generate("keyed", tokenizer(), 2048, 1)


def test_record_heads_follow_indentation():
    text = (
        "Manifest.\n\nCrate 5:\n  goods: figs and dates from the south\n  route: Cadiz to Izmir by the long way\n"
        '  seal code: AMBER-1234\n\n[\n {\n  "crate": 7,\n  "goods": "tin plates packed in straw",\n'
        '  "route": "Recife to Darwin",\n  "seal_code": "TEAL-5678"\n }\n]\n\nWhich code?'
    )
    tok = tokenizer()
    ids = tok(text)["input_ids"]
    layout = structure.layout(tok, ids)
    config = SpecPrefillConfig(keep_rate=0.1, selection_unit="records", chunk_size=8)
    for value, key in (("AMBER-1234", "Crate 5:"), ("TEAL-5678", '"crate": 7,')):
        scores = torch.zeros(len(ids))
        at = token_at(layout, text.index(value))
        scores[at] = 1.0
        sent = text_of(layout, core.select(scores, config, layout).tolist())
        assert value[:4] in sent and key in sent, (value, sent)  # fields under a named line / a bracket
        assert "goods" not in sent  # the record's middle stays out


# ---------------------------------------------------------------- budget


@pytest.mark.parametrize("units", ["chunks", "lines", "records"])
@pytest.mark.parametrize("protect", [False, True])
def test_budget_within_one_unit(units, protect):
    record = keyed_document("keyed_records", 1)
    ids = tokenizer()(record["input"])["input_ids"]
    layout = structure.layout(tokenizer(), ids)
    g = torch.Generator().manual_seed(3)
    for rate in (0.02, 0.1, 0.3, 0.7, 1.0):
        config = SpecPrefillConfig(keep_rate=rate, selection_unit=units, protect=protect, chunk_size=32)
        if not config.needs_layout:
            continue
        kept = core.select(torch.rand(len(ids), generator=g), config, layout)
        budget = core.n_to_keep(len(ids), rate)
        assert budget <= len(kept) <= budget + 32, (rate, len(kept), budget)
        assert kept.tolist() == sorted(set(kept.tolist()))


def test_original_chunks_unchanged_without_structure():
    g = torch.Generator().manual_seed(0)
    scores = torch.rand(300, generator=g)
    config = SpecPrefillConfig(keep_rate=0.2, chunk_size=16)
    assert not config.needs_layout
    assert len(core.select(scores, config)) == 16 * core.n_to_keep(19, 0.2) - 0  # 4 chunks of 16


# ---------------------------------------------------------------- protected spans


@pytest.mark.parametrize("template", [CHATML, HEADERS])
@pytest.mark.parametrize("with_system", [True, False])
def test_system_tools_and_question_survive_every_keep_rate(template, with_system):
    tok = tokenizer(template)
    record = keyed_document("keyed_records", 2)
    document, question = record["input"].rsplit("\n\n", 1)
    system = [{"role": "system", "content": "You are the harbour clerk. Quote codes exactly."}] if with_system else []
    messages = system + [
        {"role": "user", "content": "Hello."},
        {"role": "assistant", "content": "Hello, how can I help?"},
        {"role": "user", "content": document + "\n\n" + question},
    ]
    ids = chat_ids(tok, messages, TOOLS)
    layout = structure.layout(tok, ids)
    must = [question.strip()[-200:], '"name": "lookup_crate"', '"description": "Find a crate by its number"']
    must += ["You are the harbour clerk. Quote codes exactly."] if with_system else []
    protected = {i for s, e in (*layout.protected, *layout.questions) for i in range(s, e)}
    g = torch.Generator().manual_seed(1)
    for rate in (0.01, 0.05, 0.1, 0.3, 0.6):
        for units in ("chunks", "records"):
            config = SpecPrefillConfig(keep_rate=rate, selection_unit=units, protect=True, protect_share=1.0)
            scores = torch.rand(len(ids), generator=g)
            for s, e in (*layout.protected, *layout.questions):  # the lowest scores: only protection keeps them
                scores[s:e] = -1.0
            kept = core.select(scores, config, layout).tolist()
            sent = text_of(layout, kept)
            if len(protected) <= core.n_to_keep(len(ids), rate):
                for text in must:
                    assert text in sent, (template, rate, units, text)
            else:  # the budget cannot hold them: the question first, from its end
                assert len(kept) == core.n_to_keep(len(ids), rate) and "Answer:" in sent
    assert len(layout.questions) == 1
    asked = text_of(layout, range(*layout.questions[0]))
    assert asked.strip() == question.strip() and layout.questions[0][1] - layout.questions[0][0] <= QUESTION_TOKENS


def test_a_long_system_message_is_a_document_and_protection_is_capped(caplog, monkeypatch):
    """A document in the system message is pruned like any (its markers and its question kept), and protected
    spans take at most protect_share of the budget: one logged line when the cap binds."""
    tok = tokenizer()
    long_system = "Rules of the harbour. " * 120
    ids = chat_ids(tok, [{"role": "system", "content": long_system}, {"role": "user", "content": "Crate 5? Answer:"}])
    layout = structure.layout(tok, ids)
    protected = {i for s, e in (*layout.protected, *layout.questions) for i in range(s, e)}
    assert len(protected) < 40 and text_of(layout, range(*layout.questions[-1])) == "Crate 5? Answer:"
    for units in ("chunks", "lines", "records"):
        config = SpecPrefillConfig(keep_rate=0.1, selection_unit=units, protect=True)
        kept = core.select(torch.rand(len(ids)), config, layout).tolist()
        assert len(kept) <= core.n_to_keep(len(ids), 0.1) + config.chunk_size and protected <= set(kept)
    # a tight budget: the generation prompt, then the question, at most half of it in all; logged once
    monkeypatch.setattr(core_selection, "_cap_logged", False)
    generation = layout.protected[0]
    assert text_of(layout, range(*generation)) == "<|im_end|>\n<|im_start|>assistant\n"
    with caplog.at_level("WARNING", logger="specprefill"):
        for rate in (0.01, 0.06, 0.02):
            config = SpecPrefillConfig(keep_rate=rate, selection_unit="records", protect=True, query_weight=0.5)
            kept = core.select(torch.rand(len(ids)), config, layout).tolist()
            budget = core.n_to_keep(len(ids), rate)
            keep = core_selection.protect(layout, config, budget, len(ids)).nonzero().flatten().tolist()
            assert len(keep) == min(budget // 2, 32) and set(keep) <= set(kept)
            if rate == 0.01:  # the generation prompt's end
                assert keep == list(range(generation[1] - budget // 2, generation[1]))
            if rate == 0.06:  # and the question whole
                assert set(range(*generation)) | set(range(*layout.questions[0])) <= set(keep)
    assert sum("over protect_share" in r.message for r in caplog.records) == 1


def test_a_completion_protects_its_question_and_nothing_without_one():
    tok = tokenizer()
    long_last = "word " * 400
    text = "Crate 5: figs.\n\nWhat is the seal code of crate 5?\nAnswer:"  # a short prompt: all request
    layout = structure.layout(tok, tok(text)["input_ids"])
    assert layout.protected == () and len(layout.questions) == 1
    assert text_of(layout, range(*layout.questions[0])).strip() == text
    for plain in ("Crate 5: figs.\n" + long_last, "Summary of the manifest:\n\n" + long_last):
        layout = structure.layout(tok, tok(plain)["input_ids"])
        assert layout.questions == () and layout.protected == ()  # no question: the speculator alone decides
        assert not core.query_scores(
            layout, core.cut(layout, len(layout.spans), SpecPrefillConfig(selection_unit="records", chunk_size=8))
        ).any()


def test_a_document_running_into_its_question_protects_the_question_lines():
    """No blank line before the question (RULER's prompts): the question is the last line, or the last lines where
    the last is short ("Answer:"), not the document's last 128 tokens."""
    tok = tokenizer()
    essay = "".join(f"Line {i} of the essay talks about harbours and crates.\n" for i in range(60))
    ask = "What is the seal code of crate upset-zephyr? The seal code of crate upset-zephyr is"
    for tail, want in ((ask, ask), (f"Question: {ask}?\nAnswer:", f"Question: {ask}?\nAnswer:")):
        ids = tok(essay + tail)["input_ids"]
        layout = structure.layout(tok, ids)
        assert text_of(layout, range(*layout.questions[-1])).strip() == want


def test_query_signal_reads_a_hyphenated_key_as_one_word():
    """RULER's multi-key needles: "upset-zephyr" asked among lines for "upset-harbor" and "calm-zephyr"; only the
    asked line holds the whole key."""
    tok = tokenizer()
    firsts, seconds = ("upset", "calm", "proud", "misty"), ("zephyr", "harbor", "falcon", "island")
    keys = [f"{a}-{b}" for a in firsts for b in seconds]
    random.Random(0).shuffle(keys)
    lines = [f"One of the special magic numbers for {k} is: {1000 + i}." for i, k in enumerate(keys)]
    lines.insert(keys.index("upset-zephyr"), "Both upset-harbor and calm-zephyr were counted twice.")  # both parts
    text = "\n".join(lines) + "\n\nWhat is the special magic number for upset-zephyr? The number is"
    ids = tok(text)["input_ids"]
    layout = structure.layout(tok, ids)
    config = SpecPrefillConfig(keep_rate=0.1, selection_unit="lines", query_weight=1.0)
    units = core.cut(layout, len(ids), config)
    q = core.query_scores(layout, units)
    assert "upset-zephyr is" in text_of(layout, range(*units.span(int(q.argmax()))))
    decoy = token_at(layout, layout.text.index("Both upset-harbor"))
    assert float(q[int(torch.searchsorted(torch.tensor(units.starts), decoy, right=True)) - 1]) == 0.0  # no part lifts
    # under "records" the 17 lines are a run too long to be one record: the query lifts the asked line, not all
    target = layout.text.index("upset-zephyr is")
    for unit in ("lines", "records"):
        kept = core.select(torch.ones(len(ids)), config.replace(selection_unit=unit), layout).tolist()
        assert token_at(layout, target) in kept


# ---------------------------------------------------------------- query signal, engines, errors


def test_query_signal_lifts_the_unit_holding_the_questions_rare_word():
    record = keyed_document("keyed_records", 3)
    ids = tokenizer()(record["input"])["input_ids"]
    layout = structure.layout(tokenizer(), ids)
    key, _ = key_and_value(layout, record, "keyed_records")
    config = SpecPrefillConfig(keep_rate=0.05, selection_unit="lines", query_weight=1.0)
    units = core.cut(layout, len(ids), config)
    q = core.query_scores(layout, units)
    holding = int(torch.searchsorted(torch.tensor(units.starts), torch.tensor(key), right=True)) - 1
    assert int(q.argmax()) == holding  # "crate 417": only the asked record's key holds 417
    flat = torch.ones(len(ids))
    assert key in core.select(flat, config, layout).tolist()
    assert key not in core.select(flat, config.replace(query_weight=0.0), layout).tolist()


def test_every_engine_selects_through_the_same_layout():
    """The transformers and vLLM engines prune through `tokenmap.Pair.speculation(...).prune` (the engines' tests
    check they call it): the layout comes from the base tokenizer there, the same as `structure.layout`."""
    tok = tokenizer()
    record = keyed_document("keyed_json", 4)
    ids = tok(record["input"])["input_ids"]
    config = SpecPrefillConfig(keep_rate=0.1, selection_unit="records", protect=True, query_weight=0.5)
    spec = tokenmap.Pair(tok, tok).speculation(ids, config)
    scores = torch.rand(len(ids), generator=torch.Generator().manual_seed(2))
    assert spec.prune(scores).kept_indices == core.select(scores, config, structure.layout(tok, ids)).tolist()
    assert tokenmap.Pair(tok, tok).speculation(ids, SpecPrefillConfig()).layout is None  # the original reads no text


def test_tokens_no_text_gives_are_read_one_by_one():
    """Ids a client sent that are no encoding of their decoded text (split bytes of one character, any order):
    the layout reads each token's own text, and selection still keeps the question."""
    tok = tokenizer()
    ids = tok("Crate 5: figs\n\nWhat is the seal code of crate 5?")["input_ids"]
    odd = [*ids[:3], *tok("é")["input_ids"][::-1], *ids[3:]]
    layout = structure.layout(tok, odd)
    assert len(layout.spans) == len(odd) and layout.questions
    config = SpecPrefillConfig(keep_rate=0.8, selection_unit="records", protect=True, protect_share=1.0)
    kept = core.select(torch.zeros(len(odd)), config, layout)
    assert "crate 5?" in text_of(layout, kept.tolist())


def test_bad_settings_are_one_line_errors():
    with pytest.raises(SpecPrefillError, match="selection unit 'words' is unknown"):
        SpecPrefillConfig(selection_unit="words")
    with pytest.raises(SpecPrefillError, match="chunk_size >= 1 .*pass chunks"):
        SpecPrefillConfig(selection_unit="lines", chunk_size=0)
    with pytest.raises(SpecPrefillError, match="query weight"):
        SpecPrefillConfig(query_weight=-1)
    with pytest.raises(SpecPrefillError, match="reads the prompt's text"):
        core.select(torch.rand(10), SpecPrefillConfig(protect=True))


@pytest.mark.parametrize("package", ["lm_eval", "markdown_it", "torch"])
def test_the_sections_headings_are_those_markdown_it_reads_in_the_whole_text(package):
    """`Layout._sections` parses a shortened skeleton of the text; on real files the packages ship (READMEs, docs,
    Python source with `#` comments) its headings are the lines markdown-it's full parse of the text calls headings."""
    from markdown_it import MarkdownIt

    from specprefill.data import filefacts

    root = filefacts._package_dir(package)
    files = sorted(root.rglob("*.md"))[:60] + sorted(root.rglob("*.py"))[:20]
    parser = MarkdownIt("commonmark")
    checked = 0
    for path in files:
        text = path.read_text(encoding="utf-8", errors="replace").replace("\r\n", "\n").replace("\r", "\n")
        layout = core.Layout(text, ((0, len(text)),))
        found = [text.count("\n", 0, layout._virtual[h][0]) for h, _ in layout._sections]
        whole = [t.map[0] for t in parser.parse(text) if t.type == "heading_open" and t.map and t.level == 0]
        assert found == whole, path
        checked += bool(whole)
    assert checked, f"no file of {package} has a heading"


def test_the_delimiter_precheck_never_skips_a_run_the_csv_sniffer_would_read():
    """`units._may_be_delimited` skips the csv sniffer only where it would raise: over windows of 9 lines of real
    files that installed packages ship (source, metadata, RECORD rows, data files, docs), every window it rejects
    makes `csv.Sniffer().sniff` fail too, and it rejects most windows of text that is no table."""
    import csv
    import itertools
    from pathlib import Path

    from specprefill.core import units
    from specprefill.data import filefacts

    files = []
    for package in ("torch", "markdown_it", "lm_eval", "pandas"):
        root = Path(filefacts._package_dir(package))
        files += sorted(itertools.islice(root.rglob("*.py"), 40)) + sorted(root.parent.glob(f"{package}*/*"))[:10]
        files += sorted(
            itertools.islice((p for p in root.rglob("*") if p.suffix in (".csv", ".tsv", ".md", ".txt")), 20)
        )
    rejected = checked = 0
    for path in files:
        try:
            lines = path.read_text(errors="replace").split("\n")
        except (IsADirectoryError, OSError):
            continue
        for start in range(0, max(1, len(lines) - 9), 7):
            sample = "\n".join(lines[start : start + 9])
            checked += 1
            if units._may_be_delimited(sample, units.DELIMITERS):
                continue
            rejected += 1
            with pytest.raises(csv.Error):
                csv.Sniffer().sniff(sample, delimiters=units.DELIMITERS)
    assert checked > 2000 and rejected > checked / 3, (checked, rejected)
