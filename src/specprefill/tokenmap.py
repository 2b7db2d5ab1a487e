"""Cross-tokenizer pairs: the speculator reads the same text in its own tokens, and its importance moves to the
base's tokens through character spans (`core.project_importance`). Engine-free: tokenizers and strings only.

`TokenMap.build(spec_tok, base_tok, base_ids)`: the base prompt's text, the speculator's tokens of it, and both
tokenizations' character spans in that text. When each model renders its own chat template, the two texts differ
(`TokenMap.from_texts`): the speculator's spans are moved onto the base text through a character alignment, and
characters only one side has (template markup) map nowhere.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from specprefill import core, structure
from specprefill.config import SpecPrefillConfig
from specprefill.errors import SpecPrefillError
from specprefill.structure import token_spans


def same_tokenizer(a: Any, b: Any) -> bool:
    """Same vocabulary (token -> id) and same special tokens: ids can pass from one model to the other."""
    same: bool = a.get_vocab() == b.get_vocab() and a.all_special_ids == b.all_special_ids
    return same


def encode_with_spans(
    tokenizer: Any, text: str, add_special_tokens: bool = True
) -> tuple[list[int], list[tuple[int, int]]]:
    """`text` in a model's own tokens (its BOS included when it adds one) with character spans (added tokens: empty)."""
    enc = tokenizer(text, add_special_tokens=add_special_tokens, return_offsets_mapping=True)
    return list(enc["input_ids"]), [(int(s), int(e)) for s, e in enc["offset_mapping"]]


def move_spans(spans: list[tuple[int, int]], src: str, dst: str) -> list[tuple[int, int]]:
    """Spans in `src` -> spans in `dst` through the characters the two texts share (an LCS alignment): a span covers
    the destination characters its own shared characters map to; a span with none becomes empty."""
    if src == dst:
        return list(spans)
    from rapidfuzz.distance import Indel  # only for texts that differ (per-model chat templates)

    where = torch.full((len(src) + 1,), -1, dtype=torch.long)
    for op in Indel.opcodes(src, dst):
        if op.tag == "equal":
            where[op.src_start : op.src_end] = torch.arange(op.dest_start, op.dest_end)
    out = []
    for s, e in spans:
        hit = where[s:e]
        hit = hit[hit >= 0]
        out.append((int(hit.min()), int(hit.max()) + 1) if hit.numel() else (0, 0))
    # keep text order for the overlap search: a span mapped out of order (moved text) is dropped
    last, ordered = 0, []
    for s, e in out:
        ordered.append((s, e) if e > s and s >= last else (0, 0))
        last = max(last, ordered[-1][1])
    return ordered


@dataclass
class TokenMap:
    """One prompt of a cross-tokenizer pair: the speculator's ids, and both sides' spans in the base's text."""

    spec_ids: list[int]
    spec_spans: list[tuple[int, int]]
    base_spans: list[tuple[int, int]]

    @classmethod
    def build(cls, spec_tok: Any, base_tok: Any, base_ids: list[int]) -> TokenMap:
        """The speculator reads the text the base ids spell (with its own BOS when its tokenizer adds one)."""
        text, base_spans = token_spans(base_tok, base_ids)
        spec_ids, spec_spans = encode_with_spans(spec_tok, text)
        return cls._checked(spec_ids, spec_spans, base_spans)

    @classmethod
    def from_texts(
        cls, spec_tok: Any, spec_text: str, base_tok: Any, base_ids: list[int], base_text: str | None = None
    ) -> TokenMap:
        """Each model's own rendering of the same messages (chat templates): spans aligned by shared characters."""
        text, base_spans = token_spans(base_tok, base_ids, base_text)
        spec_ids, spec_spans = encode_with_spans(spec_tok, spec_text, add_special_tokens=False)
        return cls._checked(spec_ids, move_spans(spec_spans, spec_text, text), base_spans)

    @classmethod
    def _checked(
        cls, spec_ids: list[int], spec_spans: list[tuple[int, int]], base_spans: list[tuple[int, int]]
    ) -> TokenMap:
        if not spec_ids:
            raise SpecPrefillError(
                "the speculator's tokenizer produced no tokens for this prompt: give a non-empty prompt"
            )
        return cls(spec_ids, spec_spans, base_spans)

    def project(self, importance: torch.Tensor, agg: str = "max") -> torch.Tensor:
        """Speculator-token importance [len(spec_ids)] -> base-token importance [len(base_spans)]."""
        return core.project_importance(
            importance,
            torch.tensor(self.spec_spans, dtype=torch.long).reshape(-1, 2),
            torch.tensor(self.base_spans, dtype=torch.long).reshape(-1, 2),
            agg,
        )


class Pair:
    """How a speculator reads the base's prompts: the base's own ids (same tokenizer), or its own tokens of the same
    text (cross-tokenizer) with importance moved back to base tokens. Selection and positions are in base tokens."""

    def __init__(self, spec_tok: Any, base_tok: Any = None) -> None:
        self.spec_tok, self.base_tok = spec_tok, base_tok
        self.cross = base_tok is not None and not same_tokenizer(spec_tok, base_tok)
        slow = [
            who
            for who, tok in (("speculator", spec_tok), ("base", base_tok))
            if self.cross and not getattr(tok, "is_fast", False)
        ]
        if slow:
            raise SpecPrefillError(
                f"a speculator with another tokenizer needs fast (Rust) tokenizers for character "
                f"offsets; the {' and '.join(slow)}'s is not: use a model with a tokenizer.json"
            )

    def map(self, base_ids: list[int]) -> TokenMap | None:
        return TokenMap.build(self.spec_tok, self.base_tok, base_ids) if self.cross else None

    def chat_map(
        self, messages: list[dict[str, Any]], base_ids: list[int], base_text: str, **template_kwargs: Any
    ) -> TokenMap | None:
        """A conversation the base rendered with its template: the speculator renders the same messages with its own
        (a speculator without a chat template reads the base's rendered text)."""
        if not self.cross:
            return None
        if not getattr(self.spec_tok, "chat_template", None):  # nothing of its own: it reads the base's text
            return self.map(base_ids)
        template_kwargs = {"add_generation_prompt": True, **template_kwargs}
        template_kwargs.pop("chat_template", None)  # a template given for the base is the base's, not ours
        spec_text = self.spec_tok.apply_chat_template(messages, tokenize=False, **template_kwargs)
        return TokenMap.from_texts(self.spec_tok, spec_text, self.base_tok, base_ids, base_text)

    @staticmethod
    def speculator_ids(base_ids: list[int], tmap: TokenMap | None) -> list[int]:
        return list(tmap.spec_ids) if tmap is not None else list(base_ids)

    def speculation(
        self,
        base_ids: list[int],
        config: SpecPrefillConfig,
        carried_heads: str | None = None,
        tmap: TokenMap | None = None,
        layers_heads: tuple[int, int] | None = None,
    ) -> Speculation:
        """One prompt made ready for the speculator, the same way for every engine: what it reads (`tmap`: a map
        built beforehand, e.g. a chat's per-model templates, else built here), and `config` with "auto" heads made
        the speculator's own (`carried_heads`: a calibrated speculator's set), checked against its `layers_heads`."""
        tmap = tmap if tmap is not None else self.map(base_ids)
        config = config.with_heads(carried_heads)
        if layers_heads is not None:
            core.head_set(config.score_heads, *layers_heads)  # one-line error naming the model's sizes
        layout = structure.layout(self.base_tok or self.spec_tok, list(base_ids), config)
        return Speculation(list(base_ids), self.speculator_ids(base_ids, tmap), tmap, config, layout)


def text_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Chat messages with text content: a string, or OpenAI content parts of type text joined (other parts are
    refused by name: SpecPrefill prunes text)."""
    out = []
    for message in messages:
        content = message.get("content")
        if content is not None and not isinstance(content, str):
            kinds = {part.get("type") if isinstance(part, dict) else type(part).__name__ for part in content}
            if kinds - {"text"}:
                raise SpecPrefillError(
                    f"message content part(s) of type {sorted(map(str, kinds - {'text'}))}: SpecPrefill prunes text"
                )
            content = "\n".join(part["text"] for part in content)
        out.append({**message, "content": content if content is not None else ""})
    return out


@dataclass
class Speculation:
    """One prompt on its way through a speculator: the base's tokens, what the speculator reads (its own tokens of
    the same text for a cross-tokenizer pair, mapped by `tmap`) and the config it is scored with. The engine scores
    `spec_ids`; `prune` selects in base tokens. Every engine (transformers, vLLM offline and async) goes this way."""

    base_ids: list[int]
    spec_ids: list[int]
    tmap: TokenMap | None
    config: SpecPrefillConfig
    layout: core.Layout | None = None  # the base prompt's structure, where the selection reads it

    def base_importance(self, importance: torch.Tensor) -> torch.Tensor:
        """Speculator importance -> the base tokens' (cross pairs: projected over the characters they share)."""
        if self.tmap is not None:  # character spans live on the CPU
            return self.tmap.project(importance.cpu(), self.config.cross_token_agg)
        return importance

    def prune(self, importance: torch.Tensor) -> core.PrunedPrompt:
        """Speculator importance -> base importance -> kept chunks of the base prompt (the one selection)."""
        return core.keep(self.base_ids, self.base_importance(importance), self.config, self.layout)
