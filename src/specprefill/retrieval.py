"""What the retrieval baselines (`selectors.RetrievalBM25`, `selectors.RetrievalDense`) read a prompt with: its
sentences from each token's text, BM25 scores of sentences for a query, and the sentence embedder. No torch here."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

from specprefill.errors import SpecPrefillError

SENTENCE_END = (".", "!", "?", "\n")


def sentences(pieces: Sequence[str]) -> list[range]:
    """Token index ranges of the sentences of a prompt given each token's text: a sentence ends after a token whose
    text ends with . ! ? or holds a line break."""
    out, start = [], 0
    for i, piece in enumerate(pieces):
        if piece.rstrip(" ").endswith(SENTENCE_END) or "\n" in piece:
            out.append(range(start, i + 1))
            start = i + 1
    if start < len(pieces):
        out.append(range(start, len(pieces)))
    return [r for r in out if len(r)]


@functools.cache
def embedder(model: str) -> Any:
    """The sentence embedder, loaded once per process (a hub id, or a directory saved by sentence-transformers)."""
    from sentence_transformers import SentenceTransformer

    try:
        return SentenceTransformer(model, device="cpu")
    except OSError as exc:  # the hub unreachable and the model not cached: what the user can change, in one line
        raise SpecPrefillError(
            f"rag_dense's embedder {model} could not be loaded ({str(exc).splitlines()[0][:120]}): reach the hub once "
            "(it is cached), or use rag_bm25 offline"
        ) from None


def _bm25s() -> Any:
    """bm25s with its numpy scorer, imported so that it does not import numba: numba's llvmlite objects in
    `sys.modules` crash the kernel scan of a vLLM engine started later in the same process (vLLM 0.32's CPU worker
    walks every module). The scores are the same; only the JIT backend is skipped."""
    import sys

    if "bm25s" in sys.modules or "numba" in sys.modules:
        import bm25s

        return bm25s
    sys.modules["numba"] = None  # type: ignore[assignment]  # `import numba` raises ImportError while importing bm25s
    try:
        import bm25s
    finally:
        del sys.modules["numba"]
    return bm25s


def bm25_scores(docs: list[str], query: str) -> list[float]:
    """BM25 score of each document for the query (English stopwords removed); all 0 when the query or the documents
    have no indexable word."""
    bm25s = _bm25s()
    words = bm25s.tokenize([query], stopwords="en", return_ids=False, show_progress=False)[0]
    corpus = bm25s.tokenize(docs, stopwords="en", show_progress=False)
    if not words or not corpus.vocab:
        return [0.0] * len(docs)
    retriever = bm25s.BM25()
    retriever.index(corpus, show_progress=False)
    return [float(x) for x in retriever.get_scores(words)]  # query words looked up in the index's own vocabulary
