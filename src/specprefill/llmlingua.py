"""LLMLingua as a baseline selection method (the `llmlingua` package): its compressor chooses the words of a prompt to
keep, and the base tokens covering them are what the base receives, at their original positions like every method
here (the original fed the compressed text as a new prompt).

- LLMLingua-2 (`use_llmlingua2`): a token classifier (the paper's `microsoft/llmlingua-2-xlm-roberta-large-meetingbank`)
  labels each word, called as the original did (`rate`, force tokens `! . \\n ?`, `drop_consecutive`).
- LLMLingua (causal): a small causal LM's perplexity chooses the tokens (its iterative token-level compression) —
  the offline stand-in, run on the pair's speculator, always labelled `llmlingua`, never LLMLingua-2.

Two adaptations, neither changing LLMLingua's algorithm: its rate counts the words' tokens with the base model's
tokenizer (llmlingua counts GPT-3.5's, through tiktoken, which downloads its tables: here the keep rate is a
fraction of the base's prompt tokens for every method), and its causal model's KV cache goes in and out as
(keys, values) pairs per layer, the form llmlingua 0.2 slices (transformers 5 passes cache objects).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from specprefill.errors import SpecPrefillError

LLMLINGUA2_MODEL = "microsoft/llmlingua-2-xlm-roberta-large-meetingbank"
FORCE_TOKENS = ["!", ".", "\n", "?"]  # the original's compress_prompt call for LLMLingua-2


def check() -> None:
    """That llmlingua is installed; found, not imported (its import loads transformers and nltk: ~3 s)."""
    if importlib.util.find_spec("llmlingua") is None:
        raise SpecPrefillError(
            "the llmlingua baselines need the llmlingua package: pip install 'specprefill[workbench]' "
            "(or pip install llmlingua==0.2.2)"
        )


class TokenCounts:
    """What llmlingua asks of its GPT tokenizer (`encode`, `decode`), answered with the base model's tokenizer."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def encode(self, text: str, **_: Any) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int], **_: Any) -> str:
        return self.tokenizer.decode(list(ids))


class PairCache(torch.nn.Module):
    """A causal LM whose KV cache is passed and returned as [(keys, values)] per layer."""

    def __init__(self, model):
        super().__init__()
        self.model = model
        self.config = model.config

    @property
    def device(self):
        return self.model.device

    def forward(self, input_ids, attention_mask=None, past_key_values=None, use_cache=True, **kwargs):
        from transformers import DynamicCache

        cache = None
        if past_key_values is not None:
            cache = DynamicCache(ddp_cache_data=[(k, v) for k, v in past_key_values], config=self.config)
        out = self.model(
            input_ids=input_ids, attention_mask=attention_mask, past_key_values=cache, use_cache=use_cache, **kwargs
        )
        if out.past_key_values is not None:
            out.past_key_values = [(layer.keys, layer.values) for layer in out.past_key_values.layers]
        return out


@contextlib.contextmanager
def _no_tiktoken() -> Iterator[None]:
    """llmlingua's constructor fetches GPT-3.5's tiktoken tables (a download): replaced right after by TokenCounts."""
    import tiktoken

    original = tiktoken.encoding_for_model
    tiktoken.encoding_for_model = lambda name: None  # type: ignore[assignment,return-value]
    try:
        yield
    finally:
        tiktoken.encoding_for_model = original


@functools.cache
def compressor(model: str, llmlingua2: bool) -> Any:
    """An llmlingua `PromptCompressor` on the CPU in float32 (built once per model): LLMLingua-2 on a token
    classifier, or LLMLingua on a causal LM. A model that cannot be loaded is a one-line error."""
    check()
    from llmlingua import PromptCompressor
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification, AutoTokenizer

    class Compressor(PromptCompressor):
        def load_model(self, model_name, device_map="cpu", model_config=None):
            # as llmlingua loads it, with the model class chosen by the variant rather than by the config's
            # `architectures` (which a converted model may lack)
            tokenizer = AutoTokenizer.from_pretrained(model_name)
            cls = AutoModelForTokenClassification if llmlingua2 else AutoModelForCausalLM
            net = cls.from_pretrained(model_name, dtype=torch.float32).eval()
            if not llmlingua2:
                tokenizer.padding_side = "left"
                tokenizer.pad_token_id = net.config.pad_token_id or tokenizer.eos_token_id
            self.tokenizer, self.model = tokenizer, net if llmlingua2 else PairCache(net)
            self.device, self.context_idxs = "cpu", []
            self.max_position_embeddings = getattr(net.config, "max_position_embeddings", 512)

    try:
        with _no_tiktoken():
            return Compressor(model_name=model, device_map="cpu", use_llmlingua2=llmlingua2)
    except OSError as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:160]
        raise SpecPrefillError(
            f"llmlingua cannot load {model!r} ({first}): the hub model needs hub access (or a local copy's directory)"
        ) from None


def compress(comp: Any, text: str, rate: float, llmlingua2: bool, tokenizer) -> str:
    """The text LLMLingua keeps of `text` at `rate`, its token counts taken with `tokenizer` (the base's)."""
    comp.oai_tokenizer = TokenCounts(tokenizer)
    if llmlingua2:
        out = comp.compress_prompt(text, rate=rate, force_tokens=FORCE_TOKENS, drop_consecutive=True)
    else:
        out = comp.compress_prompt(text, rate=rate)
    return str(out["compressed_prompt"])


def kept_tokens(pieces: Sequence[str], compressed: str, tokenizer) -> list[int]:
    """The indices of the prompt's tokens (`pieces`: each token's text, in order) that the compressed text keeps: the
    compressed text is tokenized with the same `tokenizer` and the two token sequences aligned by their longest
    common subsequence, whitespace aside (LLMLingua rejoins words with its own spacing); a whitespace-only token is
    kept when the token before it is."""
    from rapidfuzz.distance import LCSseq

    where = [i for i, piece in enumerate(pieces) if piece.strip()]
    theirs = [tokenizer.decode([t]).strip() for t in tokenizer.encode(compressed, add_special_tokens=False)]
    kept = set()
    for op in LCSseq.opcodes([pieces[i].strip() for i in where], [t for t in theirs if t]):
        if op.tag == "equal":
            kept.update(where[op.src_start : op.src_end])
    out: list[int] = []
    for i, piece in enumerate(pieces):
        if i in kept or (not piece.strip() and out and out[-1] == i - 1):
            out.append(i)
    return out
