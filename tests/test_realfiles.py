"""The real-file corpus (`data.realfiles`): records read by each file kind's parser from files the installed
packages ship, every answer in its record's text and in the prompt, the halves apart, bad names refused. No model:
the tests' tokenizer (test_units)."""

from __future__ import annotations

import pytest
from test_units import tokenizer

from specprefill.data import filefacts, realfiles
from specprefill.errors import SpecPrefillError

LENGTH = 4096  # the tests' tokenizer spends ~3x Qwen's tokens on real text
PACKAGED = [k for k in realfiles.KINDS if k != "xml_mime"]  # the MIME database is Debian's: tested on a file below


@pytest.mark.parametrize("kind", PACKAGED)
def test_each_kind_reads_records_whose_answer_is_in_their_text(kind):
    facts = realfiles.KINDS[kind].facts()
    assert len(facts) >= 10, kind
    assert len({f.key for f in facts}) == len(facts)  # a key names one record
    for f in facts:
        assert f.answer and f.answer in f.text, (kind, f.key)


@pytest.mark.parametrize("task", [t for t in realfiles.TUNE_CELLS + realfiles.REPORT_CELLS if "xml_mime" not in t])
def test_every_cell_builds_prompts_that_hold_their_answers(task):
    tok = tokenizer()
    rows = realfiles.generate(task, tok, LENGTH, 1, seed=5)
    if task == realfiles.REPORT_CELLS[0]:
        assert rows == realfiles.generate(task, tok, LENGTH, 1, seed=5)  # deterministic
    for r in rows:
        assert r["length"] <= LENGTH and r["records"] >= realfiles.MIN_RECORDS
        assert all(a in r["input"] for a in r["outputs"]), task
        assert r["input"].endswith("<|im_start|>assistant\n")  # a chat prompt, rendered with the template


def test_the_halves_are_apart_and_the_report_half_has_six_formats():
    assert not set(realfiles.TUNE_KINDS) & set(realfiles.REPORT_KINDS)
    assert len(realfiles.REPORT_KINDS) >= 6 and set(realfiles.TUNE_KINDS) | set(realfiles.REPORT_KINDS) == set(
        realfiles.KINDS
    )
    assert {m for m in realfiles.MOODS} >= {"de", "es", "zh", "imperative"}


def test_the_mime_database_is_read_by_an_xml_parser(tmp_path, monkeypatch):
    ns = "http://www.freedesktop.org/standards/shared-mime-info"
    types = "".join(
        f'<mime-type type="application/x-t{i}"><comment>T {i}</comment><comment xml:lang="de">T {i} de</comment>'
        f'<glob pattern="*.t{i}"/></mime-type>'
        for i in range(12)
    )
    path = tmp_path / "mime.xml"
    path.write_text(f'<?xml version="1.0"?><mime-info xmlns="{ns}">{types}</mime-info>')
    monkeypatch.setattr(filefacts, "MIME_DATABASE", path)
    filefacts.mime_facts.cache_clear()
    try:
        facts = filefacts.mime_facts()
        assert [(f.key, f.answer) for f in facts[:2]] == [("application/x-t0", "*.t0"), ("application/x-t1", "*.t1")]
        assert "T 0 de" not in facts[0].text and "*.t0" in facts[0].text  # translations left out
        monkeypatch.setattr(filefacts, "MIME_DATABASE", tmp_path / "missing.xml")
        filefacts.mime_facts.cache_clear()
        with pytest.raises(SpecPrefillError, match="apt-get install shared-mime-info"):
            filefacts.mime_facts()
    finally:
        filefacts.mime_facts.cache_clear()


@pytest.mark.parametrize(
    "bad", ["file:nope", "file:sbom_json@fr", "file:sbom_json/middle", "file:chat_earlier@de", "x"]
)
def test_bad_task_names_are_refused_naming_the_kinds(bad):
    with pytest.raises(SpecPrefillError, match="file:<kind>"):
        realfiles.parse(bad)
