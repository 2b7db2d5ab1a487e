"""The transformers reference engine against plain transformers, on SmolLM2-135M's real weights and tokenizer cut to
its first layers (`smollm2_cut`, fp32)."""

import pytest
import torch

from specprefill import core
from specprefill.config import SpecPrefillConfig
from specprefill.engines.common import SamplingConfig, tokenize_prompt
from specprefill.engines.hf import capture_speculator

MAX_NEW = 12


@pytest.fixture(scope="module")
def engine(hf_smollm2):
    return hf_smollm2


@pytest.fixture(scope="module")
def plain(smollm2_cut):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(smollm2_cut, dtype=torch.float32, attn_implementation="sdpa").eval()


@pytest.fixture(scope="module")
def token_prompts(engine, prompts):
    return [tokenize_prompt(engine.tokenizer, p) for p in prompts]


@torch.no_grad()
def oracle_greedy(model, token_ids, positions, next_position, max_new, eos_ids):
    """No KV cache: recompute the whole sequence each step with explicit position_ids."""
    ids, pos, out = list(token_ids), list(positions), []
    for step in range(max_new):
        x = torch.tensor([ids])
        logits = model(input_ids=x, position_ids=torch.tensor([pos]), attention_mask=torch.ones_like(x)).logits
        tok = int(logits[0, -1].argmax())
        out.append(tok)
        if tok in eos_ids:
            break
        ids.append(tok)
        pos.append(next_position + step)
    return out


def test_keep_rate_one_equals_plain_generate(engine, plain, token_prompts):
    results = engine.generate(token_prompts[:2], max_tokens=MAX_NEW, configs=[SpecPrefillConfig(keep_rate=1.0)] * 2)
    for ids, r in zip(token_prompts, results):
        with torch.no_grad():
            ref = plain.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=MAX_NEW,
                do_sample=False,
            )[0, len(ids) :].tolist()
        assert r.kept_indices == list(range(len(ids)))
        assert r.output_token_ids == ref


def test_pruned_equals_oracle_with_explicit_positions_and_restore_is_live(engine, plain, token_prompts):
    differs = 0
    for ids in token_prompts:
        cfg = SpecPrefillConfig(keep_rate=0.1, chunk_size=16, look_ahead=4)
        r = engine.generate([ids], max_tokens=MAX_NEW, configs=[cfg])[0]
        kept = r.kept_indices
        assert 0 < len(kept) < len(ids)
        kept_ids = [ids[i] for i in kept]
        restored = oracle_greedy(plain, kept_ids, kept, len(ids), MAX_NEW, engine.base_eos_ids)
        assert r.output_token_ids == restored
        contiguous = oracle_greedy(plain, kept_ids, list(range(len(kept))), len(kept), MAX_NEW, engine.base_eos_ids)
        differs += contiguous != restored
        off = engine.generate([ids], max_tokens=MAX_NEW, configs=[cfg.replace(restore_positions=False)])[0]
        assert off.kept_indices == kept and off.output_token_ids == contiguous
    assert differs >= 1, "original position ids made no difference on any prompt"


def test_importance_equals_core_on_independently_captured_qk(engine, plain, token_prompts):
    """Recompute post-RoPE q/k by hand from the plain model's hidden states and compare."""
    ids = token_prompts[2]
    cfg = SpecPrefillConfig(keep_rate=0.2, look_ahead=1)
    pruned = engine.speculate([ids], [cfg])[0]
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    with torch.no_grad():
        x = torch.tensor([ids])
        hidden = plain(input_ids=x, output_hidden_states=True).hidden_states  # input of each layer
        pos = torch.arange(len(ids))[None]
        cos, sin = plain.model.rotary_emb(hidden[0], pos)
        qs, ks = [], []
        for i, layer in enumerate(plain.model.layers):
            h = layer.input_layernorm(hidden[i])
            att = layer.self_attn
            d = att.head_dim
            q = att.q_proj(h).view(1, len(ids), -1, d).transpose(1, 2)
            k = att.k_proj(h).view(1, len(ids), -1, d).transpose(1, 2)
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
            qs.append(q[0, :, -1:])
            ks.append(k[0])
    ref = core.token_importance(torch.stack(qs), torch.stack(ks), cfg)
    assert torch.allclose(torch.tensor(pruned.importance), ref, atol=1e-5)
    assert pruned.kept_indices == core.select(ref, cfg).tolist()


def test_look_ahead_stops_at_eos(engine, token_prompts):
    ids = token_prompts[0]
    q, k, _ = capture_speculator(engine.speculator, ids, 4, eos_ids=set())
    assert q.shape[2] == 4 and k.shape[2] == len(ids)
    greedy = oracle_greedy(engine.speculator, ids, list(range(len(ids))), len(ids), 3, set())
    q1, _, _ = capture_speculator(engine.speculator, ids, 4, eos_ids={greedy[0]})
    assert q1.shape[2] == 1
    q2, _, _ = capture_speculator(engine.speculator, ids, 4, eos_ids={greedy[1]})
    assert q2.shape[2] == 2 and torch.equal(q2, q[:, :, :2])


def test_ragged_batch_equals_one_by_one(engine, token_prompts):
    cfgs = [SpecPrefillConfig(keep_rate=r) for r in (0.1, 1.0, 0.5)]
    batch = engine.generate(token_prompts, max_tokens=6, configs=cfgs)
    for ids, cfg, r in zip(token_prompts, cfgs, batch):
        alone = engine.generate([ids], max_tokens=6, configs=[cfg])[0]
        assert (alone.kept_indices, alone.output_token_ids) == (r.kept_indices, r.output_token_ids)


def test_sampling_is_seeded(engine, token_prompts):
    s = SamplingConfig(temperature=0.8, top_p=0.9, seed=7)
    a = engine.generate([token_prompts[2]], max_tokens=8, sampling=s)[0].output_token_ids
    b = engine.generate([token_prompts[2]], max_tokens=8, sampling=s)[0].output_token_ids
    assert a == b and len(a) >= 1


def test_prune_function_on_the_reference_engine(smollm2_cut, engine, prompts):
    """`specprefill.prune` with the transformers engine: the engine's own kept tokens, as text; bad input refused."""
    from specprefill import SpecPrefillError, prune

    cfg = SpecPrefillConfig(keep_rate=0.3, look_ahead=2)
    got = prune(prompts[0], speculator=smollm2_cut, config=cfg, engine="hf", dtype="float32")
    ids = tokenize_prompt(engine.tokenizer, prompts[0])
    ref = engine.speculate([ids], [cfg])[0]
    assert got.token_ids == ids and got.kept_indices == ref.kept_indices and 0 < got.keep_rate < 0.5
    assert got.text == engine.tokenizer.decode([ids[i] for i in ref.kept_indices], skip_special_tokens=True)
    with pytest.raises(SpecPrefillError, match="engine 'tgi'"):
        prune(prompts[0], speculator=smollm2_cut, engine="tgi")
    with pytest.raises(SpecPrefillError, match="empty"):
        prune("  ", speculator=smollm2_cut, engine="hf")
