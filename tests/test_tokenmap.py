"""Cross-tokenizer mapping (SmolLM2 speculator tokens -> Qwen2.5 base tokens) against a naive per-character
implementation, plus the span helpers' edge cases."""
import random

import pytest
import torch

from specprefill import core, tokenmap
from specprefill.engines.common import load_tokenizer
from specprefill.errors import SpecPrefillError


def naive_project(importance, spec_spans, base_spans, agg):
    """Per character: a base token collects every speculator token covering one of its characters."""
    out = []
    for bs, be in base_spans:
        hits = set()
        for c in range(bs, be):
            hits |= {j for j, (ss, se) in enumerate(spec_spans) if ss <= c < se}
        vals = [float(importance[j]) for j in sorted(hits)]
        out.append(None if not vals else (max(vals) if agg == "max" else sum(vals) / len(vals)))
    known = [i for i, v in enumerate(out) if v is not None]
    filled = []
    for i, v in enumerate(out):  # nearest known on the left, else the first known
        left = [k for k in known if k <= i]
        filled.append(out[left[-1]] if left else out[known[0]])
    return torch.tensor(filled)


def bpe_tokenizer():
    """A second, different real tokenizer: byte-level BPE trained here (another vocabulary, other merges)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = TEXTS * 20 + ["the quick brown fox jumps over the lazy dog " * 5, "numbers 0123456789 " * 5]
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=400, special_tokens=["<|im_start|>", "<|im_end|>"],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>")


@pytest.fixture(scope="module")
def pair(smollm2):
    return load_tokenizer(smollm2), bpe_tokenizer()


TEXTS = [
    "The needle: the magic number is 7421.  Remember it!\n\nQuestion: what is the magic number?\nAnswer:",
    "def add(a, b):\n    return a + b  # naïve café — 数字 🙂\n\t\tx = [1,2,3]\n",
    "   leading spaces, trailing spaces   \n\n\n",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
]


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("agg", ["max", "mean"])
def test_projection_matches_naive_per_character(pair, text, agg):
    spec_tok, base_tok = pair
    base_ids = base_tok(text, add_special_tokens=False)["input_ids"]
    m = tokenmap.TokenMap.build(spec_tok, base_tok, base_ids)
    assert tokenmap.token_spans(base_tok, base_ids)[0] == text
    imp = torch.rand(len(m.spec_ids), generator=torch.Generator().manual_seed(len(text)))
    got = m.project(imp, agg)
    assert got.shape == (len(base_ids),)
    assert torch.allclose(got, naive_project(imp, m.spec_spans, m.base_spans, agg))


def test_random_spans_match_naive():
    rng = random.Random(0)
    for _ in range(50):
        n = rng.randint(1, 60)
        cuts_a = sorted(rng.sample(range(1, n), rng.randint(0, n - 1))) if n > 1 else []
        cuts_b = sorted(rng.sample(range(1, n), rng.randint(0, n - 1))) if n > 1 else []
        a = list(zip([0] + cuts_a, cuts_a + [n]))
        b = list(zip([0] + cuts_b, cuts_b + [n]))
        b.insert(rng.randint(0, len(b)), (0, 0))  # a special token with no characters
        imp = torch.rand(len(a))
        for agg in ("max", "mean"):
            got = core.project_importance(imp, torch.tensor(a), torch.tensor(b), agg)
            assert torch.allclose(got, naive_project(imp, a, b, agg))


def test_non_canonical_base_ids_use_prefix_lengths(pair):
    _, base_tok = pair
    ids = base_tok("hello", add_special_tokens=False)["input_ids"]
    split = base_tok.convert_tokens_to_ids(list("hello"))  # h e l l o one by one: not how it encodes
    assert split != ids
    text, spans = tokenmap.token_spans(base_tok, split)
    assert text == "hello" and spans == [(0, 1), (1, 2), (2, 3), (3, 4), (4, 5)]


def test_chat_templates_aligned_by_characters(pair):
    spec_tok, base_tok = pair
    messages = [{"role": "user", "content": "Remember 7421. What number did I say?"}]
    base_text = f"### User:\n{messages[0]['content']}\n### Assistant:\n"  # another family's template
    spec_text = "<|im_start|>system\nYou are a helpful assistant named SmolLM.<|im_end|>\n" \
                "<|im_start|>user\nRemember 7421. What number did I say?<|im_end|>\n<|im_start|>assistant\n"
    base_ids = base_tok(base_text, add_special_tokens=False)["input_ids"]
    m = tokenmap.TokenMap.from_texts(spec_tok, spec_text, base_tok, base_ids, base_text)
    # the speculator token "7421" (or its pieces) lands on the base tokens of the same digits
    digits = [i for i, (s, e) in enumerate(m.spec_spans) if e > s and base_text[s:e].strip() and base_text[s:e].strip() in "7421"]
    assert digits and all(base_text[m.spec_spans[i][0]:m.spec_spans[i][1]] in "7421" for i in digits)
    imp = torch.zeros(len(m.spec_ids))
    imp[digits] = 1.0
    got = m.project(imp)
    hot = {base_tok.decode([base_ids[i]]) for i in torch.nonzero(got == 1.0).flatten().tolist()}
    assert "".join(sorted(hot)).strip() and set("".join(hot).strip()) <= set("7421 ")


def test_edge_cases():
    with pytest.raises(SpecPrefillError, match="cross_token_agg"):
        core.project_importance(torch.ones(1), torch.tensor([[0, 1]]), torch.tensor([[0, 1]]), "median")
    with pytest.raises(SpecPrefillError, match="no base token overlaps"):
        core.project_importance(torch.ones(1), torch.tensor([[0, 1]]), torch.tensor([[5, 6]]))
    with pytest.raises(ValueError, match="text order"):
        core.span_overlaps(torch.tensor([[0, 1]]), torch.tensor([[3, 4], [0, 2]]))
    assert tokenmap.move_spans([(0, 3), (3, 6)], "abcdef", "xxabcyyydef") == [(2, 5), (8, 11)]
    assert tokenmap.move_spans([(0, 2)], "zz", "abc") == [(0, 0)]
