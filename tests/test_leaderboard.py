"""The leaderboard (`workbench.leaderboard`, `workbench.board`, `workbench.board_page`, `specprefill leaderboard`):
entries of every kind, task groups, the follow-up turn, TTFT arithmetic on a counting clock, board rows against a
hand count, merging boards of two machines and refusing others, the page's data; the smoke profile's notebook 11
end to end (`smoke_run`)."""

from __future__ import annotations

import json
import math
import re

import pandas as pd
import pytest

from specprefill.config import SELECTION_RULES, SpecPrefillConfig
from specprefill.data import followup
from specprefill.errors import SpecPrefillError
from specprefill.workbench import board, board_page, leaderboard, records, stats


def test_entries_spell_out_every_kind_and_refuse_unknown_or_repeated_names():
    got = board.entries(["chunks", "records+protect+query", "gemfilter", "rag_bm25"], ["smollm2-135m"],
                              "records+protect+query", 11)  # fmt: skip
    assert [e.label for e in got] == [
        "full",
        "chunks",
        "records+protect+query",
        "gemfilter",
        "rag_bm25",
        "smollm2-135m",
    ]
    by = {e.label: e for e in got}
    assert by["chunks"].method == "specprefill" and by["chunks"].overrides == SELECTION_RULES["chunks"]
    assert by["records+protect+query"].overrides == SELECTION_RULES["records+protect+query"]
    assert by["rag_bm25"].method == "rag_bm25" and by["rag_bm25"].speculator is None
    assert by["smollm2-135m"].speculator == "smollm2-135m"
    assert by["smollm2-135m"].overrides == SELECTION_RULES["records+protect+query"]
    pairs = board.by_pair(got, "qwen2.5-coder-0.5b")
    assert list(pairs) == ["qwen2.5-coder-0.5b", "self:12", "smollm2-135m"]  # the notebook's pair first: full's
    assert [e.label for e in pairs["self:12"]] == ["gemfilter"]
    with pytest.raises(SpecPrefillError, match=r"method 'nope' is unknown: use chunks, .*gemfilter.*rag_bm25"):
        board.entries(["nope"], [], "records+protect+query", 11)
    with pytest.raises(SpecPrefillError, match=r"\['chunks'\] are listed twice"):
        board.entries(["chunks", "chunks"], [], "records+protect+query", 11)
    with pytest.raises(SpecPrefillError, match="speculator_rule 'x'"):
        board.entries([], [], "x", 11)


def test_gemfilter_is_one_early_layer_of_the_base_selecting_tokens_renumbered():
    e = board.gemfilter_entry(13)
    assert e.speculator == "self:14" and e.method == "specprefill"  # layers 0..13 of the base
    config = SpecPrefillConfig().replace(**e.overrides)
    assert config.score_heads == "layers:13-13" and config.look_ahead == 1
    assert config.chunk_size == 0 and config.pool_kernel == 0  # single tokens, no pooling
    assert config.restore_positions is False and not config.needs_layout
    for bad in (-1, 2.5, True, "13"):
        with pytest.raises(SpecPrefillError, match="gemfilter_layer"):
            board.gemfilter_entry(bad)


def test_groups_are_checked_and_each_length_is_timed_at_its_groups_keep_rates():
    groups = board.check_groups(
        {"a": {"tasks": ["vt"], "length": 1024, "n": 3},
         "b": {"tasks": ["cwe"], "length": 1024, "n": 2, "keep_rates": [0.05]},
         "c": {"tasks": ["fwe"], "length": 4096, "n": 1}}, [0.1, 0.3])  # fmt: skip
    assert groups["a"]["keep_rates"] == [0.1, 0.3] and groups["b"]["keep_rates"] == [0.05]
    by_group = {"a": {"vt": [{"i": 0}, {"i": 1}, {"i": 2}]}, "b": {"cwe": [{"i": 9}]}, "c": {"fwe": [{"i": 5}]}}
    got = leaderboard.ttft_prompts(by_group, groups, 2)
    assert got == {1024: ([{"i": 0}, {"i": 1}], [0.05, 0.1, 0.3]), 4096: ([{"i": 5}], [0.1, 0.3])}
    for bad, message in (({}, "groups is empty"), ({"g": {"tasks": "t", "length": 512, "n": 1}}, "tasks as a list"),
                         ({"g": {"tasks": ["vt"], "length": 64, "n": 1}}, "length"),
                         ({"g": {"tasks": ["vt"], "length": 512, "n": 1, "keep_rates": [0]}}, "keep_rates"),
                         ):  # fmt: skip
        with pytest.raises(SpecPrefillError, match=message):
            board.check_groups(bad, [0.1])


@pytest.fixture(scope="module")
def tok(smollm2):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2)


def test_follow_up_asks_the_document_again_from_the_last_user_message(tok):
    recs = followup.generate(tok, 900, 3, seed=5)
    assert recs == followup.generate(tok, 900, 3, seed=5)
    assert len({r["input"] for r in recs}) == 3
    for r in recs:
        assert r["length"] == len(tok(r["input"])["input_ids"]) <= 900 and r["length"] > 700
        word = r["outputs"][0]
        first, last = r["input"].split("<|im_start|>user")[1], r["input"].split("<|im_start|>user")[-1]
        assert f"is {word}." in first and word not in last  # the fact in the document, not in the question
        assert "What is the code word of" in last and "<|im_start|>assistant" in r["input"].split(last)[0]
        assert r["metric"] == "all" and r["task"] == followup.TASK
    assert records.task_records(tok, [followup.TASK, "niah_single_1"], 900, 2, seed=5)[followup.TASK] == recs[:2]


def test_task_records_reads_longbench_groups_from_a_data_dir(tok):
    got = records.task_records(tok, ["hotpotqa"], 4096, 1, data_dir="tests/data/paper-mini")
    assert got["hotpotqa"][0]["metric"] == "qa_f1" and got["hotpotqa"][0]["outputs"]


class CountingLLM:
    """A pair stand-in whose clock is the tokens its base prefilled (and a fixed cost per selection)."""

    def __init__(self):
        self.clock = 0.0
        self.tokenizer = None
        self.speculator = self

    def peak_extra_bytes(self, reset=False):
        return [0]

    def generate_kept(self, prompts, kept, params, restore_positions=True):
        self.clock += sum(len(p) if k is None else len(k) for p, k in zip(prompts, kept))


def test_ttft_cells_time_selection_and_the_kept_prefill_beside_full_prefill():
    llm = CountingLLM()
    entries = [board.Entry("full", "full"), board.Entry("truncate_middle", "truncate_middle")]
    prompts = [list(range(1000)), list(range(600))]
    rows = leaderboard.timed_cells(llm, entries, [0.1, 0.5], prompts, SpecPrefillConfig(), reps=2,
                                   clock=lambda: llm.clock)  # fmt: skip
    by = {r["keep_rate"]: r for r in rows}
    assert set(by) == {1.0, 0.1, 0.5} and [r["label"] for r in rows] == ["full"] + ["truncate_middle"] * 2
    assert by[1.0]["t_method_s"] == by[1.0]["t_full_s"] == 1600 and by[1.0]["speedup"] == 1.0
    assert by[0.1]["t_full_s"] == 1600 and by[0.1]["t_kept_s"] == 100 + 60
    assert by[0.1]["speedup"] == pytest.approx(1600 / 160) and by[0.5]["bound"] == pytest.approx(1600 / 800)
    assert by[0.1]["t_select_s"] == 0 and by[0.1]["spec_peak_mib"] == 0  # selecting moved no clock, held nothing


N = 48  # prompts per task: enough concordant pairs for "no difference found"


def quality_rows() -> list[dict]:
    """Two tasks in group g: full right on 5 of 6 prompts, m right on the same ones at keep 0.1 (no difference), on
    2 of 6 at 0.3."""
    out = []
    for task in ("t1", "t2"):
        for i in range(N):
            right = i % 6 != 5
            out += [{"group": "g", "task": task, "index": i, "label": "full", "keep_rate": 1.0, "score": 100.0 * right,
                     "n_prompt": 100, "n_kept": 100},
                    {"group": "g", "task": task, "index": i, "label": "m", "keep_rate": 0.1, "score": 100.0 * right,
                     "n_prompt": 100, "n_kept": 10},
                    {"group": "g", "task": task, "index": i, "label": "m", "keep_rate": 0.3,
                     "score": 100.0 * (i % 6 < 2), "n_prompt": 100, "n_kept": 30}]  # fmt: skip
    return out


TTFT = [
    {
        "length": 512,
        "label": "full",
        "keep_rate": 1.0,
        "speedup": 1.0,
        "bound": 1.0,
        "t_full_s": 2.0,
        "t_method_s": 2.0,
        "t_select_s": 0.0,
        "t_kept_s": 2.0,
        "spec_peak_mib": 0.0,
        "host_peak_mib": 0.0,
    },
    {
        "length": 512,
        "label": "m",
        "keep_rate": 0.1,
        "speedup": 4.0,
        "bound": 6.0,
        "t_full_s": 2.0,
        "t_method_s": 0.5,
        "t_select_s": 0.1,
        "t_kept_s": 0.23,
        "spec_peak_mib": 3.0,
        "host_peak_mib": 0.5,
    },
    {
        "length": 512,
        "label": "m",
        "keep_rate": 0.3,
        "speedup": 2.0,
        "bound": 2.5,
        "t_full_s": 2.0,
        "t_method_s": 1.0,
        "t_select_s": 0.1,
        "t_kept_s": 0.7,
        "spec_peak_mib": float("nan"),
        "host_peak_mib": 1.0,
    },
]
# fmt: skip
GROUPS = {"g": {"tasks": ["t1", "t2"], "length": 512, "n": N, "keep_rates": [0.1, 0.3]}}


def a_board(machine: str = "cpu A", code: str = "1+abc") -> dict:
    rows = board.rows(quality_rows(), TTFT, GROUPS, {"m": "s \u2192 b"}, machine)
    key = {"code": code, "models": {"base": "b", "speculator": "s"}, "engine": {"dtype": "auto"},
           "settings": {"keep_rates": [0.1, 0.3], "groups": GROUPS}, "records": {"g": "d"}}  # fmt: skip
    return {"key": key,
            "machines": {machine: {"cpu_model": machine}}, "rows": rows}  # fmt: skip


def test_board_rows_pool_a_groups_tasks_and_pair_each_prompt_with_full_prefill():
    rows = {(r["method"], r["keep_rate"]): r for r in a_board()["rows"]}
    full, same, worse = rows[("full", 1.0)], rows[("m", 0.1)], rows[("m", 0.3)]
    assert full["n"] == 2 * N and full["accuracy"] == pytest.approx(100 * 5 / 6)  # both tasks' prompts, pooled
    assert full["verdict"] == "reference" and full["speedup"] == 1.0 and full["pair"] == ""
    assert same["diff_vs_full"] == 0 and same["verdict"] == "no difference found" and same["kept_fraction"] == 0.1
    # hand count: per 6 prompts, 3 pairs right/wrong and none wrong/right: -50 points, clearly lower
    assert worse["diff_vs_full"] == pytest.approx(-50.0) and worse["verdict"] == "lower"
    assert same["speedup"] == 4.0 and same["bound"] == 6.0 and worse["spec_peak_mib"] is None  # NaN cleaned
    assert full["t_full_s"] == full["t_method_s"] == 2.0 and same["t_select_s"] == 0.1
    pruned, base = [100.0 * (i % 6 < 2) for i in range(N)] * 2, [100.0 * (i % 6 != 5) for i in range(N)] * 2
    expected = stats.paired_difference(pruned, base)
    assert (worse["diff_low"], worse["diff_high"]) == pytest.approx(expected[1:3])
    assert board.best(list(rows.values()), "g") == same and board.best(list(rows.values()), "other") is None


def test_merge_joins_two_machines_and_refuses_other_code_or_a_machine_twice(tmp_path):
    merged = board.merge([a_board("cpu A"), a_board("cpu B")], ["a.json", "b.json"])
    assert set(merged["machines"]) == {"cpu A", "cpu B"} and len(merged["rows"]) == 6
    with pytest.raises(SpecPrefillError, match=r"b.json differs from a.json in code \('2\+def' vs '1\+abc'\)"):
        board.merge([a_board("cpu A"), a_board("cpu B", code="2+def")], ["a.json", "b.json"])
    other = a_board("cpu B")
    other["key"]["settings"]["keep_rates"] = [0.1]
    with pytest.raises(SpecPrefillError, match=r"in settings.keep_rates \(\[0.1\] vs \[0.1, 0.3\]\)"):
        board.merge([a_board("cpu A"), other], ["a.json", "b.json"])
    with pytest.raises(SpecPrefillError, match="repeats the rows of cpu A in group 'g' \\(as board 1\\)"):
        board.merge([a_board("cpu A"), a_board("cpu A")])
    path = board.save(a_board(), tmp_path / "one")
    assert board.load(tmp_path / "one") == json.loads(path.read_text())
    assert list(pd.read_csv(tmp_path / "one" / "board.csv").columns) == list(board.COLUMNS)
    older = a_board()
    older["key"]["records"] = "d"  # one digest of every prompt, as boards were keyed before per-group digests
    board.save(older, tmp_path / "older")
    with pytest.raises(SpecPrefillError, match="a board of an older version .*: run it again"):
        board.load(tmp_path / "older")
    with pytest.raises(SpecPrefillError, match=r"b.json differs from a.json in code"):  # refused before its groups
        board.merge([a_board("cpu A"), {**older, "key": {**older["key"], "code": "0+old"}}], ["a.json", "b.json"])
    (tmp_path / "bad.json").write_text("[1, 2]")
    (tmp_path / "keyless.json").write_text('{"key": [], "rows": [], "machines": {}}')
    for bad in (tmp_path / "bad.json", tmp_path / "keyless.json", tmp_path / "missing.json"):
        with pytest.raises(SpecPrefillError, match="not a leaderboard"):
            board.load(bad)


def a_group_board(machine: str, group: str, definition: dict | None = None, prompts: str = "d") -> dict:
    """`a_board` with its one group renamed (a run of some of a profile's groups)."""
    b = a_board(machine)
    b["key"]["settings"]["groups"] = {group: definition or GROUPS["g"]}
    b["key"]["records"] = {group: prompts}
    b["rows"] = [{**r, "group": group} for r in b["rows"]]
    return b


def test_runs_of_some_groups_merge_and_a_group_in_two_runs_must_match():
    merged = board.merge([a_board("cpu A"), a_group_board("cpu B", "h"), a_group_board("cpu A", "k")])
    assert set(merged["key"]["settings"]["groups"]) == set(merged["key"]["records"]) == {"g", "h", "k"}
    assert {(r["machine"], r["group"]) for r in merged["rows"]} == {("cpu A", "g"), ("cpu B", "h"), ("cpu A", "k")}
    assert set(merged["machines"]) == {"cpu A", "cpu B"} and len(merged["rows"]) == 9
    longer = {**GROUPS["g"], "length": 1024}
    with pytest.raises(SpecPrefillError, match=r"b differs from a in settings.groups.g.length \(1024 vs 512\)"):
        board.merge([a_board("cpu A"), a_group_board("cpu B", "g", longer)], ["a", "b"])
    with pytest.raises(SpecPrefillError, match=r"b differs from a in records.g \('e' vs 'd'\)"):
        board.merge([a_board("cpu A"), a_group_board("cpu B", "g", prompts="e")], ["a", "b"])
    with pytest.raises(SpecPrefillError, match=r"c differs from b in records.h \('e' vs 'd'\)"):  # a group first
        board.merge([a_board("cpu A"), a_group_board("cpu B", "h"), a_group_board("cpu C", "h", prompts="e")],
                    ["a", "b", "c"])  # fmt: skip
    first = a_board("cpu A")
    board.merge([first, a_group_board("cpu B", "h")])
    assert set(first["key"]["settings"]["groups"]) == {"g"}  # the boards merged are left as they were


def test_cli_merges_and_renders_and_refuses_with_one_line(tmp_path, capsys):
    from specprefill.cli import main

    board.save(a_board("cpu A"), tmp_path / "a")
    board.save(a_board("cpu B"), tmp_path / "b")
    assert main(["leaderboard", "merge", str(tmp_path / "a"), str(tmp_path / "b" / "board.json"), "-o",
                 str(tmp_path / "m")]) == 0  # fmt: skip
    assert "6 rows from 2 machine(s)" in capsys.readouterr().out
    assert (tmp_path / "m" / "leaderboard.html").exists() and board.load(tmp_path / "m")["machines"]
    assert (tmp_path / "m" / "board_frontier.png").stat().st_size > 0  # merge redraws the figure too
    assert main(["leaderboard", "render", str(tmp_path / "a"), "-o", str(tmp_path / "p.html")]) == 0
    assert (tmp_path / "p.html").exists()
    board.save(a_board("cpu C", code="2"), tmp_path / "c")
    assert main(["leaderboard", "merge", str(tmp_path / "a"), str(tmp_path / "c"), "-o", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "differs from" in err[0] and "in code" in err[0]


def test_page_carries_every_row_and_reads_without_its_script(tmp_path):
    merged = board.merge([a_board("cpu A"), a_board("cpu B")])
    merged["rows"][3]["acc_low"] = float("nan")  # a board read from elsewhere: still a page whose data parses
    text = board_page.render(merged, tmp_path / "p.html").read_text()
    data = json.loads(re.search(r'id="board-data">(.*?)</script>', text, re.S).group(1))
    assert len(data) == 6 and data[3]["acc_low"] is None
    assert text.count("<tr data-row=") == 6 and "4.00x" in text and "no difference found" in text
    assert '<option value="cpu B">' in text and "s \u2192 b" in text and "the base alone" in text
    assert "cpu A: m at keep 0.1, 4.00x, accuracy 83.3 (n = 96)" in text  # under the margin's lead, n beside
    assert "Fastest with no difference from full prefill found (the paired 95% interval within ±10 points)" in text
    assert "no difference found (within ±10 points, n = 96)" in text and "lower (n = 96)" in text
    assert not re.search(r"\bnan\b", text.split('id="board-data"')[0], re.IGNORECASE)


def smoke_board(smoke_run):
    root, returncode, err = smoke_run
    assert returncode == 0, err[-3000:]
    out = root / "outputs" / "smoke" / "11_leaderboard"
    return out, board.load(out)


def test_smoke_leaderboard_has_every_entry_timed_and_scored(smoke_run):
    out, got = smoke_board(smoke_run)
    rows = pd.DataFrame(got["rows"])
    assert set(rows["group"]) == {"needle", "follow_up"}
    labels = {"full", "chunks", "records+protect+query", "gemfilter", "rag_bm25", "self:0.5"}
    assert set(rows["method"]) == labels
    pruned = rows[rows["method"] != "full"]
    assert (pruned["keep_rate"] == 0.3).all() and (rows["n"] == 2).all()
    assert pruned["speedup"].notna().all() and (rows["t_full_s"] > 0).all() and pruned["verdict"].notna().all()
    assert all(math.isfinite(b) and b > 0 for b in pruned["bound"])
    kept = pruned.set_index(["group", "method"])["kept_fraction"]
    assert (kept > 0.1).all() and (kept < 0.6).all()
    assert set(rows[rows["method"] == "gemfilter"]["pair"]) == {"self:12 \u2192 smollm2-135m"}
    assert (out / "leaderboard.html").exists() and (out / "board_frontier.png").exists()
    assert got["key"]["models"]["speculator"] == "smollm2-135m" and len(got["machines"]) == 1


def test_report_links_the_leaderboards_page(tmp_path):
    from specprefill.workbench import report

    out = tmp_path / "outputs" / "p" / "11_leaderboard"
    got = a_board()
    board.save(got, out)
    board_page.render(got, out / "leaderboard.html")
    text = report.build("p", root=tmp_path).read_text()
    assert '<a href="11_leaderboard/leaderboard.html">the leaderboard' in text
    assert "The leaderboard&#x27;s rows" in text and "no difference found" in text


def test_timed_units_wait_for_the_pass_after_a_sharded_runs_jobs(tmp_path, monkeypatch):
    """A unit that measures time (`alone`) is computed by no job of a sharded run (other jobs share the machine) and
    by the pass after them, which runs alone; a quality unit there is read back, never computed."""
    from specprefill.workbench import store

    computed: list[str] = []

    def unit(name, alone):
        return store.run_unit(tmp_path, "k", {"u": name}, lambda: computed.append(name) or [{"t": 1}], alone=alone)

    for shard in range(2):
        monkeypatch.setenv(store.SHARD_ENV, f"{shard}/2")
        unit("quality", False)
        assert unit("ttft", True) == []
    assert computed == ["quality"]
    monkeypatch.delenv(store.SHARD_ENV)
    monkeypatch.setenv(store.UNITS_ENV, "read")
    store._indexes.clear()
    assert unit("quality", False)[0]["t"] == 1 and unit("ttft", True)[0]["t"] == 1
    assert computed == ["quality", "ttft"]


def test_groups_refuse_unknown_tasks_and_prompts_the_context_cannot_hold():
    with pytest.raises(SpecPrefillError, match="task 'niah_single_9' is unknown: use natural_qa, follow_up"):
        board.check_groups({"g": {"tasks": ["niah_single_9"], "length": 512, "n": 1}}, [0.1])
    with pytest.raises(SpecPrefillError, match="unknown shape task"):
        board.check_groups({"g": {"tasks": ["shape:nope/after/lf/chat"], "length": 512, "n": 1}}, [0.1])
    ok = {"g": {"tasks": ["follow_up", "shapes:report", "hotpotqa", "keyed_json", "vt"], "length": 2048, "n": 1}}
    assert board.check_groups(ok, [0.1], 2064, 16)["g"]["tasks"] == ok["g"]["tasks"]
    with pytest.raises(SpecPrefillError, match="exceed max_model_len 2063: raise max_model_len to 2064"):
        board.check_groups(ok, [0.1], 2063, 16)


def test_the_boards_time_units_and_protocol_are_read_from_its_parameters():
    from pathlib import Path

    from specprefill.workbench import cost, parameters, protocol, shards

    root = Path(__file__).resolve().parents[1]
    merged = {**parameters.parameters_cell(root / "notebooks" / "11_leaderboard.ipynb"),
              **parameters.load_params(root, "cpu", "11_leaderboard")}  # fmt: skip
    rates = cost.RATES["avx512_bf16"]
    one = cost.seconds("11_leaderboard", merged, "avx512_bf16")
    more = dict(merged, groups={**merged["groups"], "x": {"tasks": ["vt"], "length": 1024, "n": 20}})
    assert one is not None and one > rates.start and cost.seconds("11_leaderboard", more, "avx512_bf16") > one
    fewer = dict(merged, speculators=[], methods=["rag_bm25"])
    assert cost.seconds("11_leaderboard", fewer, "avx512_bf16") < one / 3
    units, tokens = shards.estimate(merged)  # 3 groups x (full + 6 entries x 3 keep rates)
    assert units == 3 * (1 + 6 * 3) and tokens == units * 35 * 1024
    lingua = dict(merged, methods=[*merged["methods"], "llmlingua"])  # a selection of several speculator passes
    rule = dict(merged, methods=[*merged["methods"], "records"])  # shares the pair's one speculator pass
    lingua_s, rule_s = (cost.seconds("11_leaderboard", p, "avx512_bf16") - one for p in (lingua, rule))
    assert lingua_s > 3 * rule_s > 0
    line = protocol.protocol(merged)["groups"]
    assert line["natural"] == "natural_qa: n = 35 at 1024 tokens"


def test_a_run_of_some_groups_injects_those_alone_and_names_the_groups_there_are(capsys):
    from pathlib import Path

    from specprefill.cli import main
    from specprefill.workbench import runner

    root = Path(__file__).resolve().parents[1]
    every = runner.notebook_params(root, "cpu", "11_leaderboard")["groups"]
    some = runner.notebook_params(root, "cpu", "11_leaderboard", groups=["follow_up", "needle"])["groups"]
    assert list(some) == ["needle", "follow_up"] and some["needle"] == every["needle"]  # the profile's order
    with pytest.raises(SpecPrefillError, match="--groups needle,nope: 11_leaderboard's groups are needle, natural"):
        runner.notebook_params(root, "cpu", "11_leaderboard", groups=["needle", "nope"])
    with pytest.raises(SpecPrefillError, match="04_ttft has no task groups in this profile: leave --groups out"):
        runner.notebook_params(root, "cpu", "04_ttft", groups=["needle"])
    assert main(["leaderboard", "run", "--profile", "cpu", "--groups", "nope", "--prepare-only"]) == 2
    assert "11_leaderboard's groups are needle" in capsys.readouterr().err


BAD_PROMPT_LINES = [
    ("not json {", "line 2: not JSON"),
    ('["a list"]', "line 2: a JSON object is expected, not list"),
    ('{"prompt": "p", "answers": ["a"], "colour": "red"}', "line 2: unknown field 'colour'"),
    (
        '{"prompt": "p", "messages": [{"role": "user", "content": "m"}], "answers": ["a"]}',
        'line 2: give either "prompt"',
    ),
    ('{"answers": ["a"]}', 'line 2: give either "prompt"'),
    ('{"prompt": "  ", "answers": ["a"]}', 'line 2: "prompt" must be a non-empty string'),
    ('{"messages": [{"role": "user"}], "answers": ["a"]}', 'line 2: "messages" must be a non-empty list'),
    ('{"messages": [], "answers": ["a"]}', 'line 2: "messages" must be a non-empty list'),
    ('{"prompt": "p"}', 'line 2: "answers" must be a non-empty list'),
    ('{"prompt": "p", "answers": "a"}', 'line 2: "answers" must be a non-empty list'),
    ('{"prompt": "p", "answers": [3]}', 'line 2: "answers" must be a non-empty list'),
    ('{"prompt": "p", "answers": ["a"], "metric": "bleu"}', "line 2: \"metric\" 'bleu' is unknown: use one of all"),
    ('{"prompt": "p", "answers": ["a"], "group": "a/b"}', 'line 2: "group" must be a non-empty name'),
]


@pytest.mark.parametrize(("line", "message"), BAD_PROMPT_LINES)
def test_a_prompts_file_is_refused_line_by_line_naming_the_line_and_field(tmp_path, line, message):
    """`leaderboard run --prompts FILE`: the whole file is checked before anything runs; a bad line is refused with
    one line naming its number and field (the good line before it does not run half a board)."""
    from specprefill.data import userprompts

    path = tmp_path / "mine.jsonl"
    path.write_text('{"prompt": "What is 2+2?", "answers": ["4"]}\n' + line + "\n")
    with pytest.raises(SpecPrefillError, match=re.escape(message)):
        userprompts.read(path)


def test_a_prompts_file_with_nothing_in_it_or_unreadable_is_refused(tmp_path):
    from specprefill.data import userprompts

    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(SpecPrefillError, match="no prompts in it"):
        userprompts.read(tmp_path / "empty.jsonl")
    with pytest.raises(SpecPrefillError, match="cannot read it"):
        userprompts.read(tmp_path / "missing.jsonl")


def test_a_users_prompts_become_board_groups_and_records_keyed_by_the_files_content(tmp_path, tok):
    """Groups as the file names them, in order, with their prompt counts and lengths in the base's tokens (at least
    the board's 128); records as the experiments read them (a chat rendered with the template, a prompt as given);
    the tasks pass the board's checks, and a file edited since is refused, not mixed with the earlier run's."""
    from specprefill.data import userprompts
    from specprefill.workbench import runner

    path = tmp_path / "contracts.jsonl"
    long_clause = "The supplier delivers the goods within thirty days of the order. " * 40
    rows = [
        {
            "messages": [{"role": "user", "content": long_clause + "Within how many days?"}],
            "answers": ["thirty"],
            "group": "clauses",
        },  # fmt: skip
        {"prompt": "Q: What colour is the sky?\nA:", "answers": ["blue"], "metric": "all", "group": "trivia"},
        {"prompt": "Q: 2 + 3 =", "answers": ["5"], "group": "trivia"},
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    groups = userprompts.board_groups(path, tok)
    assert list(groups) == ["clauses", "trivia"] and [g["n"] for g in groups.values()] == [1, 2]
    assert groups["clauses"]["length"] > 400 and groups["trivia"]["length"] == userprompts.MIN_LENGTH
    checked = board.check_groups(groups, [0.1, 0.3])
    records.check_tasks([t for g in checked.values() for t in g["tasks"]])
    (task,) = groups["trivia"]["tasks"]
    got = records.task_records(tok, [task], groups["trivia"]["length"], 5)[task]
    assert [r["input"] for r in got] == [rows[1]["prompt"], rows[2]["prompt"]]
    assert [r["metric"] for r in got] == ["all", "part"] and got[0]["outputs"] == ["blue"]
    assert [(r["task"], r["index"], r["line"]) for r in got] == [(task, 0, 2), (task, 1, 3)]  # as every task's
    (chat_task,) = groups["clauses"]["tasks"]
    chat = records.task_records(tok, [chat_task], 2048, 5)[chat_task][0]["input"]
    assert chat.endswith(tok.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False,
                                                 add_generation_prompt=True).split("x")[-1])  # fmt: skip
    params = runner.notebook_params(runner.project_root(), "cpu", "11_leaderboard", groups=groups)
    assert params["groups"] == groups and params["output_dir"].endswith("11_leaderboard/prompts-contracts")
    path.write_text(path.read_text() + json.dumps(rows[2]) + "\n")  # edited after the run was set up
    with pytest.raises(SpecPrefillError, match="changed since this run was set up"):
        records.task_records(tok, [task], 128, 5)


def test_leaderboard_run_refuses_a_bad_prompts_file_before_anything_runs(tmp_path, capsys):
    from specprefill.cli import main

    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "p", "answers": ["a"]}\n{"prompt": "p", "answers": []}\n')
    assert main(["leaderboard", "run", "--profile", "cpu", "--prompts", str(path), "--prepare-only"]) == 2
    assert 'line 2: "answers" must be a non-empty list' in capsys.readouterr().err
    assert main(["leaderboard", "run", "--prompts", str(path), "--groups", "needle"]) == 2
    assert "leave --groups out" in capsys.readouterr().err


def test_the_example_prompts_file_reads_as_two_groups_of_ten():
    """`examples/license_prompts.jsonl`: questions about the Apache License 2.0's text as Debian ships it (a legal
    document's numbered definitions and terms, a shape the built-in groups lack), in chats and completion prompts,
    questions before and after the text, in English, German, Spanish and Chinese; each answer is in its document."""
    from pathlib import Path

    from specprefill.data import userprompts

    rows = userprompts.read(Path(__file__).resolve().parents[1] / "examples" / "license_prompts.jsonl")
    groups = [r["group"] for r in rows]
    assert len(rows) == 20 and groups.count("license_definitions") == groups.count("license_terms") == 10
    for r in rows:
        text = r.get("prompt") or "\n".join(m["content"] for m in r["messages"])
        assert any(a.lower() in text.lower() for a in r["answers"]), r["answers"]


def test_the_frontier_is_drawn_per_machine(tmp_path):
    """Speedups are each machine's own: a fast machine's points never take a slow machine's cells off its frontier
    (the page's script and the figure alike draw one frontier per machine)."""
    from specprefill.workbench import plots

    js = board_page.SCRIPT.read_text()
    assert "q.machine === p.machine" in js  # the page's frontier: dominated only within a machine
    merged = board.merge([a_board("cpu A"), a_board("cpu B")])
    for r in merged["rows"]:
        if r["machine"] == "cpu B" and r["speedup"] is not None:
            r["speedup"] *= 3  # a faster machine
    path = plots.board_frontier(merged["rows"], tmp_path / "f.png")
    assert path.stat().st_size > 0


def test_a_group_whose_full_prefill_scores_below_the_floor_is_not_judged():
    """The one floor (`stats.FLOOR`) for every comparison, the board's groups too: where full prefill answers under
    50, its pruned cells are not judged (before, the board called them "no difference found" or "lower" against a
    base that barely answers), and no cell is the group's fastest without a measurable loss."""
    low = [{**r, "score": 100.0 * (r["index"] % 6 == 0)} for r in quality_rows()]  # every label right on 1 of 6
    rows = {(r["method"], r["keep_rate"]): r for r in board.rows(low, TTFT, GROUPS, {"m": "s"}, "cpu A")}
    assert rows[("full", 1.0)]["accuracy"] < stats.FLOOR and rows[("full", 1.0)]["verdict"] == "reference"
    for rate in (0.1, 0.3):
        assert rows[("m", rate)]["verdict"] == f"{stats.BELOW_FLOOR} (17 < 50)"
    assert board.best(list(rows.values()), "g") is None
