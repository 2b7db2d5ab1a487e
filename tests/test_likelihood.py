"""The paired fidelity measure (`core.likelihood`, `HFEngine.answer_fits`) against an independent computation on a
tiny random llama: the gold answer decoded one token at a time through a key-value cache after the kept tokens at
their positions, and torch's own KL divergence."""

import pytest
import torch

from specprefill import core
from specprefill.config import SpecPrefillConfig

CFG = SpecPrefillConfig(keep_rate=0.5, chunk_size=4, look_ahead=2)


@pytest.fixture(scope="module")
def engine(tiny_model):
    from specprefill.engines.hf import HFEngine

    return HFEngine(tiny_model, tiny_model, CFG, torch.float32)


@torch.no_grad()
def stepwise(model, token_ids, positions, answer):
    """log p(answer[j] | kept, answer[:j]) and the full log-distribution of the first answer token, one token at a
    time with a cache (the way decoding reads them), not one forward over the joined sequence."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    out = model(
        input_ids=torch.tensor([token_ids]),
        position_ids=torch.tensor([positions]),
        past_key_values=cache,
        use_cache=True,
    )
    rows, next_position = [out.logits[0, -1]], max(positions) + 1
    for j, tok in enumerate(answer[:-1]):
        out = model(
            input_ids=torch.tensor([[tok]]),
            position_ids=torch.tensor([[next_position + j]]),
            past_key_values=cache,
            use_cache=True,
        )
        rows.append(out.logits[0, -1])
    logprobs = [torch.log_softmax(r.double(), -1) for r in rows]
    return [float(lp[t]) for lp, t in zip(logprobs, answer)], logprobs[0]


def test_answer_fits_equal_stepwise_decoding_whole_and_pruned(engine):
    prompt = [1] + [3 + (7 * i) % 50 for i in range(40)]
    answer = [5, 9, 11, 2]
    kept = [0, 3, 4, 5, 6, 20, 21, 22, 23, 38, 39, 40]
    full, pruned = engine.answer_fits([prompt, prompt], [answer, answer], [None, kept])
    want_full, first_full = stepwise(engine.base, prompt, list(range(len(prompt))), answer)
    want_pruned, first_pruned = stepwise(engine.base, [prompt[i] for i in kept], kept, answer)
    assert full.token_logprobs == pytest.approx(want_full, abs=1e-4)
    assert pruned.token_logprobs == pytest.approx(want_pruned, abs=1e-4)
    assert torch.allclose(full.first.double(), first_full, atol=1e-4)
    paired = core.compare_fits(full, pruned)
    assert paired["delta_loglik"] == pytest.approx(sum(want_pruned) / 4 - sum(want_full) / 4, abs=1e-4)
    reference = torch.nn.functional.kl_div(first_pruned, first_full, log_target=True, reduction="sum")
    assert paired["kl"] == pytest.approx(float(reference), rel=1e-3, abs=1e-6) and paired["kl"] > 0
    assert core.compare_fits(full, full) == {"delta_loglik": 0.0, "kl": pytest.approx(0.0, abs=1e-9)}


def test_contiguous_positions_are_a_different_prefill(engine):
    """restore_positions=False feeds the kept tokens at 0..K-1 and the answer after them: another number."""
    prompt = [1] + [3 + (5 * i) % 50 for i in range(30)]
    kept, answer = [0, 1, 2, 10, 11, 12, 29, 30], [7, 8]
    restored = engine.answer_fits([prompt], [answer], [kept])[0]
    contiguous = engine.answer_fits([prompt], [answer], [kept], restore_positions=False)[0]
    want, _ = stepwise(engine.base, [prompt[i] for i in kept], list(range(len(kept))), answer)
    assert contiguous.token_logprobs == pytest.approx(want, abs=1e-4)
    assert restored.token_logprobs != pytest.approx(contiguous.token_logprobs, abs=1e-4)


def test_bad_inputs_are_refused():
    logits = torch.zeros(2, 8)
    with pytest.raises(ValueError, match="no tokens"):
        core.fit_from_logits(torch.zeros(0, 8), [])
    with pytest.raises(ValueError, match="2 rows of logits for 3 answer tokens"):
        core.fit_from_logits(logits, [1, 2, 3])
    a, b = core.fit_from_logits(logits, [1, 2]), core.fit_from_logits(torch.zeros(1, 8), [1])
    with pytest.raises(ValueError, match="different answers"):
        core.compare_fits(a, b)
    c = core.fit_from_logits(torch.zeros(2, 9), [1, 2])
    with pytest.raises(ValueError, match="over 8 and 9 tokens"):
        core.compare_fits(a, c)


@pytest.mark.parametrize(
    ("prompt", "answer"),
    [
        ("The special magic number for apple mentioned in the provided text is", "7301245"),
        ("Question: what is the seal code of crate 12?\nAnswer:", "QX-77"),
        ("<|im_start|>assistant\n", "0.11.0"),
        ("Welche Version hat numpy? Antworte nur mit der Version.\n", "2.1.3"),
    ],
)
def test_the_gold_answer_is_tokenized_as_it_follows_the_prompt(smollm2, prompt, answer):
    """A completion prompt ending in a word or a colon is followed by a space, a chat template's by nothing: the gold
    ids are the tokens the joined text ends with (the answer the model would write), not the answer tokenized
    alone."""
    from specprefill.engines.common import load_tokenizer
    from specprefill.workbench import likelihood

    tokenizer = load_tokenizer(smollm2)
    ids = likelihood.gold_ids(tokenizer, {"input": prompt, "outputs": [answer], "metric": "all"})
    joined = tokenizer(prompt + (" " if not prompt[-1].isspace() else "") + answer, add_special_tokens=False)
    assert ids == joined["input_ids"][-len(ids) :]
    assert tokenizer.decode(ids).strip() == answer
    assert likelihood.gold_ids(tokenizer, {"input": prompt, "outputs": ["x"], "metric": "pass@1"}) is None
    assert likelihood.gold_ids(tokenizer, {"input": prompt, "outputs": [], "metric": "all"}) is None
