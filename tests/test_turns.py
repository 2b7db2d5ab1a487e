"""Multi-turn reuse, engine-free (`core.turns`): which earlier request a prompt extends, what the base holds of it,
and the kept set of the next turn."""

import numpy as np
import torch

from specprefill import core
from specprefill.config import SpecPrefillConfig


def test_a_later_turn_finds_the_earlier_prompt_and_answer():
    memory = core.TurnMemory()
    prompt = list(range(100, 300))
    kept = list(range(0, 40)) + list(range(120, 200))
    answer = [7, 8, 9, 10]
    memory.remember(prompt, kept, answer)
    memory.remember([5] * 50, None, [1])  # another conversation
    turn2 = prompt + answer + [11, 12, 13]
    held, length = memory.find(turn2)
    assert length == 204 and list(held.kept) == kept
    reuse = core.plan_reuse(turn2, memory, min_new=16)
    # the earlier kept set, its answer at indices 200..203 (the base decoded them at positions M + j), then all new
    assert reuse.kind == "extend" and reuse.length == 204 and not reuse.whole
    assert reuse.kept.tolist() == kept + [200, 201, 202, 203] + [204, 205, 206]
    assert core.plan_reuse(turn2, memory, min_new=3).kind == "speculate"
    assert core.plan_reuse(list(range(1, 300)), memory, min_new=16) is None  # nothing shares its start
    assert core.plan_reuse(prompt[:10], memory, min_new=16) is None  # shorter than the probe
    assert core.plan_reuse(prompt[:100] + [1] * 300, memory, min_new=16) is None  # 100 shared: a fresh request


def test_a_prompt_that_diverges_inside_an_earlier_one_keeps_its_cached_part():
    memory = core.TurnMemory()
    prompt = list(range(1000, 1300))
    memory.remember(prompt, list(range(0, 300, 2)), [1, 2])
    other = prompt[:150] + [9] * 20  # same document start, another question
    reuse = core.plan_reuse(other, memory, min_new=64)
    assert reuse.length == 150 and reuse.cached.tolist() == list(range(0, 150, 2))
    assert reuse.kept.tolist() == list(range(0, 150, 2)) + list(range(150, 170))


def test_an_unpruned_earlier_turn_extends_to_a_whole_prompt_and_a_repeated_prompt_keeps_its_set():
    memory = core.TurnMemory()
    prompt = list(range(50, 250))
    memory.remember(prompt, None, [3, 4])
    reuse = core.plan_reuse(prompt + [3, 4, 5], memory, min_new=8)
    assert reuse.whole and reuse.kept.tolist() == list(range(203))
    again = core.plan_reuse(prompt, memory, min_new=8)
    assert again.length == 200 and again.whole
    memory.remember(prompt, list(range(0, 200, 3)), [3, 4], tag="keep 0.3")
    assert core.plan_reuse(prompt, memory, 8, tag="keep 0.3").kept.tolist() == list(range(0, 200, 3))
    assert core.plan_reuse(prompt, memory, 8, tag="keep 0.5") is None  # other knobs: selected anew


def test_the_newest_longest_match_wins_and_memory_is_bounded():
    memory = core.TurnMemory(capacity=3)
    base = list(range(20, 220))
    memory.remember(base, list(range(50)), [])
    memory.remember(base + [1, 2, 3], list(range(60)), [])
    assert core.plan_reuse(base + [1, 2, 3, 4], memory, 100).cached.tolist() == list(range(60))
    for i in range(3):
        memory.remember([i] * 40, None, [])
    assert len(memory) == 3 and memory.find(base + [1]) is None


def test_stable_selection_keeps_the_cached_set_and_selects_new_chunks_by_their_scores():
    cfg = SpecPrefillConfig(keep_rate=0.25, chunk_size=4, keep_last_chunk=True)
    m, length = 96, 64
    cached = np.array(list(range(0, 16)) + list(range(40, 48)), dtype=np.int64)
    reuse = core.Reuse("speculate", length, cached)
    importance = torch.rand(m)
    importance[:length] = 100.0  # the old region scores highest: it still stays as cached
    importance[72:76] = 50.0
    kept = core.select_stable(importance, cfg, reuse).tolist()
    assert kept == cached.tolist() + list(range(72, 76)) + list(range(92, 96))  # 2 of 8 new chunks, the last forced
    pruned = core.prune(list(range(m)), kept, cfg)
    assert pruned.positions == kept and pruned.next_position == m
