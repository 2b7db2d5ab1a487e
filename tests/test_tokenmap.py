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
    for i in range(len(out)):  # nearest known on the left, else the first known
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
    tok.train_from_iterator(
        corpus,
        trainers.BpeTrainer(
            vocab_size=400,
            special_tokens=["<|im_start|>", "<|im_end|>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        ),
    )
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
        k = rng.randrange(len(a))
        a.insert(k, a[k])  # two tokens over the same characters (byte pieces of one character)
        a.insert(0, (0, 0))  # the speculator's own BOS
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
    """Each model renders the same message with its own template: the speculator's tokens of the message land on
    the same characters of the base's text; the projection follows them."""
    spec_tok, base_tok = pair
    content = "Remember 7421. What number did I say?"
    base_text = f"### User:\n{content}\n### Assistant:\n"  # another family's template
    spec_text = (
        "<|im_start|>system\nYou are a helpful assistant named SmolLM.<|im_end|>\n"
        f"<|im_start|>user\n{content}<|im_end|>\n<|im_start|>assistant\n"
    )
    base_ids = base_tok(base_text, add_special_tokens=False)["input_ids"]
    m = tokenmap.TokenMap.from_texts(spec_tok, spec_text, base_tok, base_ids, base_text)
    _, own = tokenmap.encode_with_spans(spec_tok, spec_text, add_special_tokens=False)
    c0, b0 = spec_text.index(content), base_text.index(content)
    inside = [i for i, (s, e) in enumerate(own) if c0 <= s and e <= c0 + len(content) and e > s]
    assert len(inside) >= 8
    for i in inside:  # same characters, shifted by where the message starts in each text
        assert m.spec_spans[i] == (own[i][0] - c0 + b0, own[i][1] - c0 + b0)
    digits = [
        i
        for i in inside
        if spec_text[own[i][0] : own[i][1]].strip() and set(spec_text[own[i][0] : own[i][1]].strip()) <= set("7421")
    ]
    imp = torch.zeros(len(m.spec_ids))
    imp[digits] = 1.0
    hot = torch.nonzero(m.project(imp) == 1.0).flatten().tolist()
    s, e = m.base_spans[hot[0]][0], m.base_spans[hot[-1]][1]
    assert hot and "7421" in base_text[s:e] and len(base_text[s:e].strip()) <= 6


def test_edge_cases():
    with pytest.raises(SpecPrefillError, match="cross_token_agg"):
        core.project_importance(torch.ones(1), torch.tensor([[0, 1]]), torch.tensor([[0, 1]]), "median")
    with pytest.raises(SpecPrefillError, match="no base token overlaps"):
        core.project_importance(torch.ones(1), torch.tensor([[0, 1]]), torch.tensor([[5, 6]]))
    with pytest.raises(ValueError, match="text order"):
        core.span_overlaps(torch.tensor([[0, 1]]), torch.tensor([[3, 4], [0, 2]]))
    assert tokenmap.move_spans([(0, 3), (3, 6)], "abcdef", "xxabcyyydef") == [(2, 5), (8, 11)]
    assert tokenmap.move_spans([(0, 2)], "zz", "abc") == [(0, 0)]


def test_chat_map_renders_the_speculators_own_template_or_reads_the_base_text(pair):
    """A speculator with a chat template renders the messages itself; one without reads the base's rendered text."""
    smol, bpe = pair
    messages = [{"role": "user", "content": "Remember 7421. What number did I say?"}]
    base_text = f"### User:\n{messages[0]['content']}\n### Assistant:\n"
    base_ids = bpe(base_text, add_special_tokens=False)["input_ids"]
    own = tokenmap.Pair(smol, bpe).chat_map(messages, base_ids, base_text)
    spec_text = smol.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert list(own.spec_ids) == smol(spec_text, add_special_tokens=False)["input_ids"]
    smol_ids = smol(base_text, add_special_tokens=False)["input_ids"]
    reads_base = tokenmap.Pair(bpe, smol).chat_map(messages, smol_ids, base_text)  # bpe has no template
    assert list(reads_base.spec_ids) == list(tokenmap.Pair(bpe, smol).map(smol_ids).spec_ids)


def test_text_messages():
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    got = tokenmap.text_messages([{"role": "user", "content": parts}, {"role": "assistant", "content": None}])
    assert got == [{"role": "user", "content": "a\nb"}, {"role": "assistant", "content": ""}]
    with pytest.raises(SpecPrefillError, match="image_url"):
        tokenmap.text_messages([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])
