"""The multi-turn chat benchmark without servers (`workbench.chat`, `data.synthetic.conversation`): the conversations,
the per-turn table (paired ratios), the accuracy intervals, the checks, the settings' errors. The servers' replay runs
in the smoke profile's notebook 05 (`smoke_run`)."""

import re

import pytest
from test_cli import assert_one_line_error, main

from specprefill.config import ChatSettings
from specprefill.data import synthetic
from specprefill.errors import SpecPrefillError
from specprefill.workbench import chat


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


def rows_of(ttft: dict, correct: dict | None = None) -> list[dict]:
    """Rows as `turn_row` makes them: ttft[(server, conversation, turn)] = seconds."""
    out = []
    for (server, conv, turn), t in ttft.items():
        ok = (correct or {}).get((server, conv, turn), True)
        out.append(
            {
                "server": server,
                "conversation": conv,
                "turn": turn,
                "ttft_s": t,
                "base_prefilled_tokens": 100 if turn == 1 else 10,
                "speculator_prefilled_tokens": 0,
                "speculation_ms": 0.0,
                "base_hit_rate": 0.0 if turn == 1 else 0.9,
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
    table = chat.turn_table(rows_of(ttft, wrong))
    ours = table[table["server"] == "specprefill"].set_index("turn")
    # turn 1: ratios to before 1.05, 0.917, 1.0 -> median 1.0; turn 2: vLLM / ours 2.0, 1.33, 1.2 -> 1.33
    assert ours.loc[1, "speedup_vs_before"] == pytest.approx(1.0)
    assert ours.loc[2, "speedup_vs_vllm"] == pytest.approx(2.0 / 1.5)
    assert ours.loc[2, "ttft_s"] == pytest.approx(1.5) and ours.loc[2, "correct"] == 2 and ours.loc[2, "n"] == 3
    assert list(table["server"].unique()) == ["vllm", "specprefill", "specprefill-no-reuse"]
    acc = chat.accuracy(rows_of(ttft, wrong)).set_index(["server", "turns"])
    assert acc.loc[("specprefill", "later turns"), "correct"] == 2
    assert acc.loc[("vllm", "later turns"), "low"] == pytest.approx(0.438503, abs=1e-5)  # Wilson, 3 of 3
    lines = chat.checks(table, chat.accuracy(rows_of(ttft, wrong)))
    assert lines[0] == "turn 1 vs SpecPrefill before: 1.00x (holds)"
    assert lines[1] == "turn 2 vs vLLM + prefix caching: 1.33x (holds)"
    assert lines[2].startswith("later answers correct: SpecPrefill 2/3") and lines[2].endswith("(fails)")


def test_server_params_differ_only_in_prefix_caching_and_block_size():
    from specprefill.config import EngineParams

    params = EngineParams("s", base="b", engine_args={"max_num_seqs": 2})
    before = chat.server_params("specprefill-no-reuse", params, 32)
    ours = chat.server_params("specprefill", params, 32)
    assert ours.enable_prefix_caching and not before.enable_prefix_caching
    assert ours.engine_args == before.engine_args == {"max_num_seqs": 2, "block_size": 32}
    assert chat.server_params("vllm", params, None).engine_args == {"max_num_seqs": 2}


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"chat_turns": 0}, "chat_turns 0: give an integer >= 1"),
        ({"chat_doc_tokens": 10}, "chat_doc_tokens 10: give at least 64"),
        ({"chat_servers": "vllm,nope"}, "chat_servers 'vllm,nope': name some of"),
    ],
)
def test_chat_settings_errors_name_the_fix(kwargs, message):
    with pytest.raises(SpecPrefillError, match=re.escape(message)):
        ChatSettings(**kwargs)


def test_bench_chat_without_conversations_is_one_line_error():
    assert_one_line_error(main("bench", "chat", "--chat-conversations", "0"), "give at least 1 conversation")
