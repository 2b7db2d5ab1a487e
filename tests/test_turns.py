"""Multi-turn and shared-prefix reuse, engine-free (`core.turns`): which requests may skip speculation (a repeated
prompt, a continuation of the same answer, a few tokens added to a prefix the base holds whole), and that every
other request sharing a start with an earlier one is speculated afresh; tenants apart; lookup cost."""

import numpy as np
import pytest

from specprefill import core
from specprefill.core import turns

PROMPT = list(range(100, 300))
KEPT = list(range(0, 40)) + list(range(120, 200))
ANSWER = [7, 8, 9, 10]


def _memory(**kwargs) -> core.TurnMemory:
    memory = core.TurnMemory(**kwargs)
    memory.remember(PROMPT, KEPT, ANSWER, "a")
    memory.remember([5] * 50, None, [1], "a")  # another conversation
    return memory


def test_a_repeated_prompt_and_a_continuation_of_the_same_answer_extend_the_earlier_selection():
    memory = _memory()
    again = core.plan_reuse(PROMPT, memory, "a")
    assert again.kind == "extend" and again.kept.tolist() == KEPT  # the selection it would get again
    continued = core.plan_reuse(PROMPT + ANSWER[:3], memory, "a")
    # the earlier kept set, then its own answer at indices 200.. (the base decoded them at positions M + j)
    assert continued.kind == "extend" and continued.kept.tolist() == KEPT + [200, 201, 202]
    assert not continued.plain


@pytest.mark.parametrize(
    "later",
    [
        PROMPT + ANSWER + [11, 12, 13],  # a follow-up: a few new tokens after the answer
        PROMPT + [11, 12],  # another question right after the same document
        PROMPT[:150] + [9] * 20,  # the same document start, another question
        PROMPT[:170],  # a strict prefix of the earlier prompt (a regenerated turn, a cut prompt)
    ],
)
def test_any_other_request_sharing_the_start_is_speculated_afresh(later):
    reuse = core.plan_reuse(later, _memory(), "a", max_new=512)
    assert reuse.kind == "speculate" and reuse.kept is None
    assert reuse.length == turns.common_prefix(np.array(PROMPT + ANSWER), np.array(later))


def test_nothing_shared_short_or_of_another_tenant_is_not_reused():
    memory = _memory()
    assert core.plan_reuse(list(range(1, 300)), memory, "a") is None  # nothing shares its start
    assert core.plan_reuse(PROMPT[:10], memory, "a") is None  # shorter than a block
    assert core.plan_reuse(PROMPT[:100] + [1] * 300, memory, "a") is None  # 100 shared: a fresh request
    assert core.plan_reuse(PROMPT, memory, "b") is None  # another tenant (cache_salt, adapter or knobs)
    assert memory.find(PROMPT, "b") is None


def test_a_prefix_held_whole_serves_a_few_new_tokens_whole_and_more_are_speculated():
    memory = core.TurnMemory()
    held = memory.remember(PROMPT, KEPT, ANSWER, "a")
    assert core.plan_reuse(PROMPT + ANSWER + [1, 2, 3], memory, "a", max_new=8).kind == "speculate"
    held.whole = True  # prefilled whole on the base (in idle time, or the request ran whole)
    reuse = core.plan_reuse(PROMPT + ANSWER + [1, 2, 3], memory, "a", max_new=8)
    assert reuse.kind == "whole" and reuse.plain and reuse.kept.tolist() == list(range(207))
    other_question = PROMPT[:150] + list(range(5000, 5007))
    assert core.plan_reuse(other_question, memory, "a", max_new=8).kind == "whole"
    more = core.plan_reuse(PROMPT + list(range(5000, 5008)), memory, "a", max_new=8)  # more than max_new added
    assert (more.kind, more.length, more.kept) == ("prefix", 200, None)  # the held 200 whole, the rest selected
    again = core.plan_reuse(PROMPT, memory, "a", max_new=8)  # a repeat: its own selection, the answer it got
    assert again.kind == "extend" and again.kept.tolist() == KEPT
    memory.remember(PROMPT[:180], None, [4], "a", whole=True)  # a request that ran whole extends whole
    assert core.plan_reuse(PROMPT[:180], memory, "a").plain


def test_a_prefix_held_whole_so_far_is_kept_whole_and_only_the_rest_selected():
    """Background prefill in steps: the base holds the first `whole_upto` tokens unpruned. A follow-up sharing more
    than that gets them whole and its rest selected afresh (`prefix`); under `MIN_SHARED` held it is speculated as
    before; once the shared part is held whole, a few new tokens run whole. A kept run from the start (positions
    0..r-1) is held whole from the outset: the same KV as the unpruned prompt's."""
    memory = core.TurnMemory()
    held = memory.remember(PROMPT, KEPT, ANSWER, "a")
    assert held.whole_upto == 40 and held.held_whole == 40  # KEPT starts with 0..39
    follow_up = PROMPT + ANSWER + [1, 2, 3]
    assert core.plan_reuse(follow_up, memory, "a", max_new=8).kind == "speculate"  # 40 < MIN_SHARED
    held.whole_upto = 160
    reuse = core.plan_reuse(follow_up, memory, "a", max_new=8)
    assert (reuse.kind, reuse.length, reuse.kept) == ("prefix", 160, None)
    held.whole_upto = 204  # prompt and answer, all of it
    assert core.plan_reuse(follow_up, memory, "a", max_new=8).kind == "whole"
    assert core.plan_reuse(PROMPT[:150] + [9] * 20, memory, "a", max_new=8).kind == "prefix"  # 150 held, 20 new


def test_on_held_keeps_the_prefix_whole_and_the_selection_after_it_at_original_positions():
    import torch

    from specprefill.config import SpecPrefillConfig

    config = SpecPrefillConfig(keep_rate=0.3)
    ids = list(range(1000, 1300))
    importance = [float(i % 7) for i in range(300)]
    selected = core.prune(ids, [3, 4, 5, 150, 151, 260, 299], config, torch.tensor(importance))
    out = core.on_held(selected, ids, 128, config)
    assert out.kept_indices == list(range(128)) + [150, 151, 260, 299]
    assert out.positions == out.kept_indices and out.token_ids == [ids[i] for i in out.kept_indices]
    assert out.importance == selected.importance and out.next_position == 300
    assert core.on_held(selected, ids, 0, config).kept_indices == selected.kept_indices
    assert core.on_held(selected, ids, 10_000, config).kept_indices == list(range(300))


def test_the_newest_longest_match_wins_and_memory_is_bounded():
    memory = core.TurnMemory(capacity=3)
    base = list(range(20, 220))
    memory.remember(base, list(range(50)), [], "t")
    memory.remember(base + [1, 2, 3], list(range(60)), [], "t")
    assert core.plan_reuse(base + [1, 2, 3], memory, "t").kept.tolist() == list(range(60))
    assert core.plan_reuse(base, memory, "t").kind == "speculate"  # a strict prefix of the newest: selected afresh
    for i in range(3):
        memory.remember([i] * 40, None, [], "t")
    assert len(memory) == 3 and memory.find(base + [1], "t") is None
    assert all(memory._index.values()) and len(memory._index) == 3 * 2  # evicted entries left no index


def test_lookup_cost_follows_the_request_not_the_memory(monkeypatch):
    """One hash per block of the request and one token comparison, whether the memory holds one request or 200 that
    share the request's start (the old lookup compared every entry of a bucket in full)."""
    calls = []
    real = turns.common_prefix
    monkeypatch.setattr(turns, "common_prefix", lambda a, b: calls.append(len(a)) or real(a, b))
    doc = list(range(1000, 3000))
    for n in (1, 200):
        memory = core.TurnMemory()
        for i in range(n):
            memory.remember(doc + [i] * 40, None, [1, 2], "t")
        calls.clear()
        held, length = memory.find(doc + [7] * 40, "t")
        assert len(calls) == 1 and (length, held.prompt[-1]) == ((2040, 7) if n > 7 else (2000, 0))


def test_a_hash_collision_costs_no_wrong_reuse(monkeypatch):
    monkeypatch.setattr(turns, "block_hashes", lambda ids, tenant, known=(): list(range(len(ids) // turns.BLOCK)))
    memory = core.TurnMemory()
    memory.remember(PROMPT, KEPT, ANSWER, "a")
    other = list(range(5000, 5300))  # every block "collides": the token comparison decides
    held, length = memory.find(other, "a")
    assert length == 0 and core.plan_reuse(other, memory, "a") is None


def test_a_hash_shared_by_two_tenants_never_reuses_the_other_tenants_state(monkeypatch):
    """The tenant is compared on lookup, not only mixed into the hashes: were two tenants' block hashes equal (here
    forced: the hashes ignore the tenant), another tenant's identical document is still not reused."""
    monkeypatch.setattr(
        turns,
        "block_hashes",
        lambda ids, tenant, known=(): [hash(tuple(ids[: (i + 1) * 16])) for i in range(len(ids) // 16)],
    )
    memory = core.TurnMemory()
    memory.remember(PROMPT, KEPT, ANSWER, "a", whole=True)
    assert memory.find(PROMPT + [9], "b") is None and core.plan_reuse(PROMPT + [9], memory, "b", max_new=8) is None
    assert core.plan_reuse(PROMPT + [9], memory, "a", max_new=8).kind == "whole"


def test_many_small_requests_evict_their_own_entries_not_a_long_document():
    """Over the entry count, the tenant holding the most entries gives way, not the one holding the most tokens: one
    quiet tenant's long document outlives another tenant's stream of small requests (before, the long document was
    evicted first, and the quiet tenant's follow-up then changed with the other's traffic)."""
    memory = core.TurnMemory(capacity=8, max_tokens=1 << 20)
    doc = list(range(1000, 11000))
    memory.remember(doc, list(range(0, 10000, 3)), [7, 8], "quiet", whole=True)
    for i in range(50):
        memory.remember([5000 + i] * 32, None, [1], "busy")
    assert len(memory) == 8 and memory.find(doc + [9], "quiet") is not None
    assert core.plan_reuse(doc + [7, 8, 9], memory, "quiet", max_new=8).kind == "whole"


def test_one_tenants_flood_evicts_its_own_entries_not_anothers():
    """A tenant sending many requests (or one request with many choices) fills the memory: it forgets its own oldest
    entries, and another tenant's earlier request is still reused (before, the globally oldest went first, so a
    follow-up's answer depended on other tenants' traffic)."""
    memory = core.TurnMemory(capacity=8, max_tokens=4000)
    doc = list(range(1000, 1300))
    memory.remember(doc, list(range(0, 300, 3)), [7, 8], "quiet", whole=True)
    for i in range(50):
        memory.remember([5000 + i] * 200, None, [1], "busy")
    assert memory.find(doc + [9], "quiet") is not None
    assert core.plan_reuse(doc + [7, 8, 9], memory, "quiet", max_new=8).kind == "whole"
    assert len(memory) <= 8 and memory._tokens <= 4000
    assert memory.find([5049] * 200, "busy") is not None and memory.find([5000] * 200, "busy") is None
    for i in range(20):  # a third tenant's bigger entries: the largest tenant gives way first
        memory.remember([9000 + i] * 700, None, [1], "big")
    assert len(memory) <= 8 and memory._tokens <= 4000
    assert all(memory._index.values()) and set(memory._by_tenant) <= {"quiet", "busy", "big"}


def test_many_choices_of_one_prompt_hash_the_prompt_once(monkeypatch):
    """`n` choices of one long prompt: the prompt's blocks are hashed once and each choice hashes only its answer's,
    with the same index as hashing each sequence whole (a follow-up after any choice finds it)."""
    from specprefill.engines.vllm.payloads import Turns

    prompt = list(range(1000, 3000))  # 125 blocks
    answers = {i: [7 + i] * 40 for i in range(8)}
    hashed = []
    real = turns.block_hashes

    def counting(ids, tenant, known=()):
        out = real(ids, tenant, known)
        hashed.append(len(out) - len(known))
        return out

    monkeypatch.setattr(turns, "block_hashes", counting)
    import specprefill.engines.vllm.payloads as payloads

    monkeypatch.setattr(payloads, "block_hashes", counting)
    shared = Turns(512)
    held = shared.remember_choices(prompt, None, answers, "t")
    assert sum(hashed) <= 125 + 8 * 3  # the prompt once, then each answer's 2-3 blocks
    assert [h.generated.tolist() for h in held] == [answers[i] for i in range(8)]
    for i in range(8):  # the same index as one choice at a time
        assert real(held[i].sequence, "t") == shared.memory._items[i][1]
        assert shared.memory.find(prompt + answers[i] + [1] * 20, "t")[1] == 2040


def test_a_long_addition_to_a_pruned_prefix_keeps_its_selection_and_selects_only_what_is_new():
    """An agent appending a tool's output (`max_new` tokens or more) after a pruned turn: `append` — the earlier kept
    set and its answer for the shared start (the base holds exactly that KV), the new part selected afresh; held
    whole instead, the prefix goes whole (`prefix`)."""
    import torch

    from specprefill.config import SpecPrefillConfig

    memory = core.TurnMemory()
    held = memory.remember(PROMPT, KEPT, ANSWER, "a")
    later = PROMPT + ANSWER + list(range(6000, 6600))
    reuse = core.plan_reuse(later, memory, "a", max_new=512)
    assert (reuse.kind, reuse.length) == ("append", 204) and reuse.kept.tolist() == KEPT + [200, 201, 202, 203]
    config = SpecPrefillConfig(keep_rate=0.3)
    fresh = core.prune(later, [0, 1, 50, 130, 205, 206, 700, 803], config, torch.ones(804))
    out = core.on_held(fresh, later, reuse.length, config, reuse.kept)
    assert out.kept_indices == KEPT + [200, 201, 202, 203, 205, 206, 700, 803]
    assert out.positions == out.kept_indices and out.importance == fresh.importance
    held.whole = True
    assert core.plan_reuse(later, memory, "a", max_new=512).kind == "prefix"
    assert core.plan_reuse(PROMPT + ANSWER + [1] * 20, memory, "a", max_new=512).kind == "whole"
    held.whole = False  # another user's long question on the same document start: its own selection, not this one's
    other = core.plan_reuse(PROMPT[:180] + list(range(7000, 7600)), memory, "a", max_new=512)
    assert other.kind == "speculate" and other.length == 180


def _rates(fixed: float, per_token: float) -> core.PrefillTime:
    rates = core.PrefillTime()
    for tokens in (100, 1000, 400):
        rates.observe(tokens, fixed + per_token * tokens)
    return rates


def test_rates_fit_a_fixed_part_and_a_part_per_token():
    """An engine's prefill seconds against its computed tokens: the fixed part (a speculation's look-ahead steps
    and scoring) and the per-token part both come back from requests of several sizes; one size, or times that do
    not rise with size, predict nothing (no choice is made on them)."""
    assert _rates(0.5, 0.01).predict(2000) == pytest.approx(20.5)
    assert _rates(0.5, 0.01).predict(0) == pytest.approx(0.5)
    one = core.PrefillTime()
    one.observe(300, 2.0)
    one.observe(300, 2.5)
    assert one.predict(300) is None and core.PrefillTime().predict(10) is None
    falling = core.PrefillTime()
    falling.observe(100, 3.0)
    falling.observe(1000, 1.0)
    assert falling.predict(500) is None


def test_a_request_on_a_prefix_held_whole_so_far_takes_the_path_predicted_faster():
    """`prefix` (the base holds the first `length` tokens whole, part way through an idle-time prefill): selected
    afresh after them, or run whole when the base computing the rest whole is predicted no slower than the
    speculator's pass plus the kept rest (a prefill nearly done: whole, and the whole prompt's answer). Other kinds
    and unmeasured rates keep the rule's path."""
    base, speculator = _rates(0.05, 0.01), _rates(0.5, 0.003)
    early = core.Reuse("prefix", 256, shared=1000)  # 256 of 1,000 shared tokens held whole; 20 new
    paths = core.predict_paths(early, 1020, 0.3, core.PairTimes(base, speculator))
    assert paths["prefix"] == pytest.approx(0.5 + 0.003 * 20 + 0.05 + 0.01 * round(0.3 * 764))
    assert paths["whole"] == pytest.approx(0.05 + 0.01 * 764) and paths["prefix"] < paths["whole"]
    assert core.cheapest(early, 1020, paths) is early
    late = core.Reuse("prefix", 992, shared=1000)  # the idle-time prefill nearly done
    paths = core.predict_paths(late, 1020, 0.3, core.PairTimes(base, speculator))
    chosen = core.cheapest(late, 1020, paths)
    assert paths["whole"] < paths["prefix"] and chosen.kind == "whole" and chosen.plain and len(chosen.kept) == 1020
    assert core.predict_paths(core.Reuse("speculate", 1000), 1020, 0.3, core.PairTimes(base, speculator)) is None
    assert core.predict_paths(late, 1020, 0.3, core.PairTimes(core.PrefillTime(), speculator)) is None


def test_a_prefix_request_counts_only_the_earlier_prompt_as_the_speculators_cache():
    """`prefix` after a turn's answer: the base holds part of prompt + answer whole, while the speculator only ever
    read the earlier prompt (never the base's answer), so the tokens its cache spares (`shared`) stop at the prompt's
    end, and the prediction charges it for the answer's tokens."""
    memory = core.TurnMemory()
    held = memory.remember(PROMPT, KEPT, ANSWER, "a")
    held.whole_upto = 150  # the idle-time prefill part way
    later = PROMPT + ANSWER + [11, 12]
    reuse = core.plan_reuse(later, memory, "a", max_new=8)
    assert reuse.kind == "prefix" and reuse.length == 150 and reuse.shared == len(PROMPT)


def test_every_path_of_the_decision_comes_with_its_reasons():
    """`core.decide`, the one place a request's path is chosen: each path, reached from the request, what the memory
    holds and the measured rates, with the reasons it gives in words (printed: `pytest -s` shows one request's path
    as a reader would follow it)."""
    from types import SimpleNamespace

    plain, logprobs = SimpleNamespace(prompt_logprobs=None), SimpleNamespace(prompt_logprobs=0)
    memory = core.TurnMemory()
    held = memory.remember(PROMPT, KEPT, ANSWER, "a")
    follow_up = PROMPT + ANSWER + [1, 2, 3]

    def rates(fixed, per_token):
        out = core.PrefillTime()
        for tokens in (100, 1000):
            out.observe(tokens, fixed + per_token * tokens)
        return out

    quick_base = core.PairTimes(rates(0.01, 0.001), rates(2.0, 0.01))
    slow_base = core.PairTimes(rates(2.0, 0.05), rates(0.01, 0.0001))
    cases = {}

    def case(name, ids, keep=0.3, params=plain, mem=memory, times=None, min_prompt=0):
        d = core.decide(ids, keep, params, min_prompt, mem, "a", 8, times)
        cases[name] = d
        print(f"{name}: {' | '.join(d.reasons)}")
        return d

    assert case("empty", []).reasons == ("whole: the prompt is empty",)
    assert not case("short", PROMPT, min_prompt=500).speculate
    assert case("keep 1", PROMPT, keep=1.0).reasons == ("whole: keep rate 1",)
    assert "log-probs" in case("prompt log-probs", PROMPT, params=logprobs).reasons[0]
    assert case("no cache", PROMPT, mem=None).speculate
    assert case("new document", list(range(1000, 1300))).speculate
    assert case("repeat", PROMPT).reuse.kind == "extend"
    assert case("follow-up, 40 held", follow_up).reasons[0].startswith("speculate: shares 204")
    held.whole_upto = 160
    unmeasured = core.PairTimes(core.PrefillTime(), core.PrefillTime())
    assert case("follow-up, 160 held, no rates", follow_up, times=unmeasured).reasons[1].startswith("prefix: the rates")
    assert case("follow-up, 160 held, quick base", follow_up, times=quick_base).reuse.kind == "whole"
    assert case("follow-up, 160 held, slow base", follow_up, times=slow_base).reuse.kind == "prefix"
    long_addition = PROMPT + ANSWER + list(range(2000, 2100))
    assert case("tool output after a pruned turn", long_addition).reuse.kind == "append"
    held.whole = True
    assert case("follow-up, all held", follow_up).reuse.kind == "whole"
    for name, d in cases.items():
        path = d.reuse.kind if d.reuse is not None else ("speculate" if d.speculate else "whole")
        assert d.reasons[-1].startswith(path + ":"), (name, d.reasons)  # the last reason names the path taken


def test_a_flood_of_one_entry_tenants_evicts_itself_before_a_conversation_in_use():
    """256 one-entry tenants (a fresh cache_salt per request) fill the memory beside a tenant whose long document is
    in use (found by its follow-ups): the flood's own oldest entries go first (before, a tie on entries went to the
    tenant holding the most tokens: the victim's long document first)."""
    memory = core.TurnMemory(capacity=8)
    document = list(range(10_000, 12_000))
    memory.remember(document, None, [1, 2], "victim")
    for i in range(40):
        memory.remember(list(range(100 * i, 100 * i + 20)), None, [3], f"flood-{i}")
        if i % 4 == 0:  # the victim's follow-ups keep finding its document
            assert memory.find(document + [5, 6], "victim") is not None, i
    assert len(memory) == 8 and memory.find(document, "victim") is not None
