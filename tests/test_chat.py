"""The multi-turn chat benchmark without servers (`workbench.chat`, `data.synthetic.conversation`): the conversations,
the per-turn table (paired ratios), the accuracy intervals, the checks, the settings' errors. The servers' replay runs
in the smoke profile's notebook 05 (`smoke_run`)."""

import re

import pytest
from test_cli import assert_one_line_error, main

from specprefill.data import synthetic
from specprefill.errors import SpecPrefillError
from specprefill.settings import ChatSettings
from specprefill.workbench import chat, chat_tables


def test_conversations_are_seeded_and_ask_for_facts_at_several_depths_and_for_the_first_answer():
    conv = synthetic.conversation(6000, 4, seed=3)
    assert conv == synthetic.conversation(6000, 4, seed=3) and conv != synthetic.conversation(6000, 4, seed=4)
    assert len(conv.questions) == len(conv.answers) == 4
    assert conv.questions[2] == synthetic.FIRST_ANSWER and conv.answers[2] == conv.answers[0]
    depths = []
    for t in (0, 1, 3):
        subject = re.search(r"code word of (.+)\?", conv.questions[t]).group(1)
        fact = f"The code word of {subject} is {conv.answers[t]}."
        assert conv.document.count(fact) == 1
        depths.append(conv.document.index(fact) / len(conv.document))
    assert max(depths) > 0.5 and len(set(conv.answers[i] for i in (0, 1, 3))) == 3
    assert conv.message(0).startswith(conv.document) and conv.message(1) == conv.questions[1]
    assert synthetic.conversation(2000, 2).questions[1] != synthetic.FIRST_ANSWER
    shared = synthetic.conversation(6000, 4, seed=3, recall_first=False)  # other users: a fact each
    assert synthetic.FIRST_ANSWER not in shared.questions and len(set(shared.answers)) == 4


def test_an_agent_turn_appends_new_material_that_holds_its_answer():
    conv = synthetic.agent_conversation(4000, 1500, 4, seed=2)
    assert conv == synthetic.agent_conversation(4000, 1500, 4, seed=2) != synthetic.agent_conversation(4000, 1500, 4, 3)
    assert len(conv.materials) == 3 and len(set(conv.answers)) == 4
    subjects = [re.search(r"code word of (.+)\?", q).group(1) for q in conv.questions]
    assert len(set(subjects)) == 4  # no turn asks about a subject another turn's material names with another word
    for t in range(4):
        message = conv.message(t)
        fact = f"The code word of {subjects[t]} is {conv.answers[t]}."
        assert message.count(fact) == 1 and message.endswith(conv.questions[t])
        elsewhere = [conv.document, *conv.materials]
        del elsewhere[t]
        assert not any(f"code word of {subjects[t]}" in text for text in elsewhere)  # only this turn's material
    assert 1400 <= len(conv.materials[0]) - len("Tool output 1:\n") <= 1700 and len(conv.document) >= 4000
    plain = synthetic.conversation(4000, 4, seed=2)  # another workload's document of the same seed shares no start
    assert conv.document[:100] != plain.document[:100]
    with pytest.raises(ValueError, match="turns 0 must be in 1.."):
        synthetic.agent_conversation(100, 100, 0)


def test_settings_list_think_times_and_modes_and_size_an_agent_context():
    settings = ChatSettings(chat_think_times="0, 2,10,30", chat_modes="conversation,agent", chat_turns=4)
    assert settings.think_times() == [0.0, 2.0, 10.0, 30.0] and settings.modes() == ["conversation", "agent"]
    plain = ChatSettings(chat_modes="conversation", chat_turns=4)
    assert chat.max_model_len(settings) - chat.max_model_len(plain) == 3 * settings.chat_agent_tokens


def rows_of(ttft: dict, correct: dict | None = None, mode: str = "conversation") -> list[dict]:
    """Rows as `replay` makes them: ttft[(server, conversation, turn)] = seconds."""
    out = []
    for (server, conv, turn), t in ttft.items():
        ok = (correct or {}).get((server, conv, turn), True)
        out.append(
            {
                "mode": mode,
                "server": server,
                "conversation": conv,
                "turn": turn,
                "ttft_s": t,
                "prompt_tokens": 1000,
                "base_received_tokens": 300,
                "base_prefilled_tokens": 300 if turn == 1 else 10,
                "speculator_prefilled_tokens": 1000 if turn == 1 else 20,
                "speculation_ms": 0.0,
                "base_hit_rate": 0.0 if turn == 1 else 0.9,
                "reuse": "" if turn == 1 else "whole",
                "correct": ok,
            }
        )
    return out


def test_turn_table_pairs_ratios_by_conversation_and_checks_name_what_holds():
    ttft = {}
    for c, (plain1, ours1, before1) in enumerate([(30.0, 10.0, 10.5), (40.0, 12.0, 11.0), (35.0, 11.0, 11.0)]):
        ttft |= {("vllm", c, 1): plain1, ("specprefill", c, 1): ours1, ("specprefill-no-reuse", c, 1): before1}
        ttft |= {("vllm", c, 2): 1.0 + c, ("specprefill", c, 2): 0.5 + c, ("specprefill-no-reuse", c, 2): 12.0}
    wrong = {("specprefill", 0, 2): False}
    table = chat_tables.turn_table(rows_of(ttft, wrong))
    ours = table[table["server"] == "specprefill"].set_index("turn")
    # turn 1: ratios to before 1.05, 0.917, 1.0 -> median 1.0; turn 2: vLLM / ours 2.0, 1.33, 1.2 -> 1.33
    assert ours.loc[1, "speedup_vs_before"] == pytest.approx(1.0)
    assert ours.loc[2, "speedup_vs_vllm"] == pytest.approx(2.0 / 1.5)
    assert ours.loc[2, "ttft_s"] == pytest.approx(1.5) and ours.loc[2, "correct"] == 2 and ours.loc[2, "n"] == 3
    assert list(table["server"].unique()) == ["vllm", "specprefill", "specprefill-no-reuse"]
    acc = chat_tables.accuracy(rows_of(ttft, wrong)).set_index(["server", "turns"])
    assert acc.loc[("specprefill", "later turns"), "correct"] == 2
    assert acc.loc[("vllm", "later turns"), "low"] == pytest.approx(0.438503, abs=1e-5)  # Wilson, 3 of 3
    rows = rows_of(ttft, wrong)
    spent = (("vllm", 100.0), ("specprefill", 120.0), ("specprefill-no-reuse", 90.0))
    cpu = [
        {"server": k, "mode": "conversation", "think_s": 0.0, "conversation": c, "cpu_s": s}
        for c in range(3)
        for k, s in spent
    ]
    lines = chat_tables.checks(table, chat_tables.accuracy(rows), rows, cpu)
    assert lines == [
        "conversation, think 0 s: later turns correct: as served 2/3 vs fresh 3/3, vLLM 3/3 (fails)",
        "conversation, think 0 s: later turns correct: as served 2/3 vs vLLM 3/3 (>= vLLM's - 1: holds)",
        "conversation, think 0 s: total TTFT per document <= vLLM + prefix caching in 3/3 (as served 37.5 s vs "
        "111.0 s) (holds)",
        "conversation, think 0 s: CPU-seconds, background included: as served 360 vs vLLM 300 (1.20x; <= 1.15x: fails)",
        "conversation, think 0 s: turn 1 median speedup 3.18x (>= 1.5x: holds)",  # 3.0, 3.33, 3.18
        "conversation, think 0 s: later turns median ratio vLLM/as served 1.33x (no bar below think 10 s)",
    ]
    for r in rows:  # the same turns at think 10 s, where a later turn has a bar, and as an agent (its own bar)
        r["think_s"] = 10.0
    lines = chat_tables.checks(table, chat_tables.accuracy(rows), rows)
    assert lines[-1] == "conversation, think 10 s: later turns median ratio vLLM/as served 1.33x (>= 0.9x: holds)"
    assert not any("CPU-seconds" in line for line in lines)  # none measured
    for r in rows:
        r["mode"] = "agent"
    lines = chat_tables.checks(table, chat_tables.accuracy(rows), rows)
    assert lines[-1] == "agent, think 10 s: later turns median ratio vLLM/as served 1.33x (>= 1.2x: holds)"
    one_turn = [r for r in rows_of(ttft) if r["turn"] == 1]  # no later turn: no verdict on later turns
    lines = chat_tables.checks(chat_tables.turn_table(one_turn), chat_tables.accuracy(one_turn), one_turn)
    assert not any("later turns median" in line for line in lines) and any("turn 1 median" in line for line in lines)
    by_think = chat_tables.turn_table([{**r, "think_s": t} for t in (0.0, 2.0) for r in rows_of(ttft)])
    assert sorted(set(by_think["think_s"])) == [0.0, 2.0] and len(by_think) == 2 * len(table)


def test_shared_mode_counts_every_request_and_any_state_another_tenant_left():
    ttft = {}
    for c in range(2):
        for turn in (1, 2):
            ttft |= {("vllm", c, turn): 5.0, ("specprefill", c, turn): 2.0, ("specprefill-no-reuse", c, turn): 2.5}
    one = rows_of(ttft, mode="shared")
    apart = rows_of(ttft, mode="shared-tenants")
    for r in apart:  # a tenant per user: nothing reused, every token computed
        r.update(reuse="", speculator_prefilled_tokens=1000, base_prefilled_tokens=300)
    assert chat_tables.shared_leaks(one + apart) == 0
    apart[1]["speculator_prefilled_tokens"] = 990  # the speculator's cache held another tenant's tokens
    assert chat_tables.shared_leaks(one + apart) == 1
    rows = one + apart
    lines = chat_tables.checks(chat_tables.turn_table(rows), chat_tables.accuracy(rows), rows)
    assert "shared, think 0 s: all requests correct: as served 4/4 vs fresh 4/4, vLLM 4/4 (holds)" in lines
    assert lines[-1] == "shared-tenants: requests reusing another tenant's state: 1 (fails)"
    table = chat_tables.turn_table(rows)
    assert list(table["mode"].unique()) == ["shared", "shared-tenants"]


def test_server_params_differ_only_in_prefix_caching_and_block_size():
    from specprefill.config import EngineParams

    params = EngineParams("s", base="b", engine_args={"max_num_seqs": 2})
    before = chat.server_params("specprefill-no-reuse", params, 32)
    ours = chat.server_params("specprefill", params, 32)
    assert ours.enable_prefix_caching and not before.enable_prefix_caching
    assert ours.engine_args == before.engine_args == {"max_num_seqs": 2, "block_size": 32}
    assert chat.server_params("vllm", params, None).engine_args == {"max_num_seqs": 2}
    assert ours.kv_sequences == chat.KV_SEQUENCES  # one request at a time
    assert chat.server_params("vllm", params.replace(kv_sequences=8)).kv_sequences == 8


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"chat_turns": 0}, "chat_turns 0: give an integer >= 1"),
        ({"chat_doc_tokens": 10}, "chat_doc_tokens 10: give at least 64"),
        ({"chat_servers": "vllm,nope"}, "chat_servers 'vllm,nope': name some of"),
        ({"chat_think_times": "0,soon"}, "chat_think_times '0,soon': give seconds >= 0, e.g. 0,2,10,30"),
        ({"chat_think_times": "-1"}, "chat_think_times '-1': give seconds >= 0"),
        ({"chat_think_times": ""}, "chat_think_times '': give seconds >= 0"),
        ({"chat_modes": "conversation,talk"}, "chat_modes 'conversation,talk': name some of conversation, agent"),
        ({"chat_agent_tokens": 3}, "chat_agent_tokens 3: give an integer >= 64"),
    ],
)
def test_chat_settings_errors_name_the_fix(kwargs, message):
    with pytest.raises(SpecPrefillError, match=re.escape(message)):
        ChatSettings(**kwargs)


def test_bench_chat_without_conversations_is_one_line_error():
    assert_one_line_error(main("bench", "chat", "--chat-conversations", "0"), "give at least 1 conversation")


def test_quiet_waits_while_the_server_works_and_never_for_an_unknown_one(monkeypatch):
    """The CPU-seconds of a conversation include the background work it caused: `quiet` waits until the server's
    processes stop using CPU (readings 0, 1, 2, 2.05: quiet after the third window), at once for a server this
    process did not start, and fails with the fix after its timeout."""
    from specprefill.serve import loadtest

    readings = iter([0.0, 1.0, 2.0, 2.05])
    monkeypatch.setattr(loadtest, "cpu_seconds", lambda url: next(readings))
    monkeypatch.setattr(chat.time, "sleep", lambda s: None)
    chat.quiet("u")
    with pytest.raises(StopIteration):
        next(readings)  # all four read: it waited for the work to end
    monkeypatch.setattr(loadtest, "cpu_seconds", lambda url: None)
    assert chat.quiet("u") < 1.0
    busy = iter(range(10**6))
    monkeypatch.setattr(loadtest, "cpu_seconds", lambda url: float(next(busy)))
    with pytest.raises(SpecPrefillError, match="still busy after 0 s: see its log"):
        chat.quiet("u", timeout_s=0.0)


def test_each_server_runs_alone_and_each_think_time_gets_its_own_documents(monkeypatch):
    """The servers start one after another (each stopped before the next), every workload runs at every think time
    on each, with the same documents on every server and other documents at each think time (a document asked
    again would be read from the caches the previous think time left); CPU-seconds per conversation."""
    import contextlib

    from specprefill import models
    from specprefill.config import EngineParams, SpecPrefillConfig
    from specprefill.engines import common
    from specprefill.serve import loadtest

    events, seen = [], []

    @contextlib.contextmanager
    def running(server, params, config, log_dir, extra_flags=(), name=None, side_by_side=False):
        events.append(("start", name))
        yield f"url-{name}"
        events.append(("stop", name))

    def replay(client, kind, model, index, conv, max_tokens, on_turn=None, mode="conversation", think_s=0.0):
        seen.append((kind, mode, think_s, index, conv.document))
        return [{"server": kind, "mode": mode, "think_s": think_s, "conversation": index, "turn": 1}]

    class Tokenizer:
        def __call__(self, text):
            return {"input_ids": text.split()}

    monkeypatch.setattr(loadtest, "running", running)
    monkeypatch.setattr(loadtest, "cpu_seconds", lambda url: 1.0)
    monkeypatch.setattr(chat, "replay", replay)
    monkeypatch.setattr(chat, "quiet", lambda url: 0.0)
    monkeypatch.setattr(chat, "openai_client", lambda url: url)
    monkeypatch.setattr(common, "load_tokenizer", lambda path: Tokenizer())
    monkeypatch.setattr(models, "resolve", lambda name: name)
    settings = ChatSettings(
        chat_conversations=2, chat_think_times="0,10", chat_modes="conversation,agent", chat_servers="vllm,specprefill"
    )
    rows, cpu = chat.run(EngineParams("s", base="b"), SpecPrefillConfig(), settings, "logs")
    assert events == [("start", "vllm"), ("stop", "vllm"), ("start", "specprefill"), ("stop", "specprefill")]
    recorded = [s for s in seen if s[3] >= 0]  # the warm-up conversation is index -1
    assert len(recorded) == 2 * 2 * 2 * 2 and len(rows) == len(cpu) == 16
    docs = {(kind, mode, think, c): doc for kind, mode, think, c, doc in recorded}
    for mode in ("conversation", "agent"):
        for think in (0.0, 10.0):
            for c in (0, 1):
                assert docs[("vllm", mode, think, c)] == docs[("specprefill", mode, think, c)]
        assert docs[("vllm", mode, 0.0, 0)] != docs[("vllm", mode, 10.0, 0)]
    assert len({doc for doc in docs.values()}) == 8
