"""Multi-turn and shared-prefix reuse, engine-free: what the base's prefix cache already holds of earlier requests,
and which later requests may use it without speculating.

The base caches a request's kept tokens at their original positions and its generated tokens right after (position
M + j), block by block, identified by tokens and positions (the `positions` plugin), per tenant (vLLM's
`cache_salt`, the LoRA adapter). Only two kinds of request may skip speculation, because their selection is already
known to be the one they would get:
  - `extend`: the prompt is an earlier prompt again, or that prompt plus the start of its own answer (a client
    continuing the same answer): the earlier kept set, then the answer's tokens (the same answer as before, whether
    or not the base holds the prompt whole by now);
  - `whole`: the base holds the earlier prompt and answer *whole* (prefilled unpruned, e.g. in idle time after the
    pruned answer, `Held.whole`), and what the request adds is at most `max_new` tokens: the whole prompt goes to
    the base, which computes only the new tokens, exactly as plain vLLM with prefix caching answers it.
A request that shares a start the base holds whole (a leading part prefilled unpruned so far, `Held.whole_upto`, or
all of it with more than `max_new` tokens added: an agent appending a tool's output) is speculated afresh, and the
base gets that held prefix whole plus what the new selection keeps of the rest (`prefix`, `on_held`): the prefix is
read from the cache, only the rest's kept tokens are computed. A request adding `max_new` tokens or more to a prefix
the base holds pruned (an agent's tool output after a pruned turn) keeps that prefix as the earlier request left it
and selects only in what it adds (`append`): the base computes the new part's kept tokens, as plain vLLM computes the
new part; a question about the earlier part is answered from the earlier selection. Every other request sharing a
start with an earlier one (a follow-up about another part of a document, another user's question on the same
document, a strict prefix of an earlier prompt) is speculated and selected afresh: its answer never comes from
another request's selection. The speculator's own prefix cache and the base's block-identity cache still spare the
tokens they hold (reported as `speculate`).

Lookup costs time in the request's length, not the memory's: every remembered sequence is indexed by the chained
hashes of its `BLOCK`-token blocks (as vLLM's prefix cache is), per tenant.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch

from specprefill.config import SpecPrefillConfig
from specprefill.core.selection import PrunedPrompt, prune

BLOCK = 16  # tokens per indexed block (the shortest prompt that can be reused)
OUTLIER = 2.0  # `PrefillTime`: a measurement is taken as at most this factor off the prediction
MIN_SHARED = 128  # fewer shared leading tokens (a chat template's system prompt) are not reported as reuse


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """How many leading entries two int arrays share."""
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n


def block_hashes(ids: np.ndarray, tenant: str, known: Sequence[int] = ()) -> list[int]:
    """The chained hash of each whole `BLOCK`-token block of `ids` (block i's hash covers blocks 0..i and the
    tenant): equal hashes mean, up to a collision that the caller's token comparison catches, equal prefixes.
    `known`: the hashes of `ids`' first blocks, computed before (the prompt's, shared by each choice's answer)."""
    out, h = list(known), known[-1] if known else hash(tenant)
    for start in range(len(known) * BLOCK, len(ids) - BLOCK + 1, BLOCK):
        h = hash((h, ids[start : start + BLOCK].tobytes()))
        out.append(h)
    return out


@dataclass
class Held:
    """One earlier base request of one tenant: its whole prompt (base tokens), the indices the base received (None:
    all of them) and every token it generated. `whole`: the base also holds prompt + answer unpruned; `whole_upto`:
    the leading tokens of prompt + answer it holds unpruned so far (prefilled in steps in idle time)."""

    prompt: np.ndarray
    kept: np.ndarray | None
    generated: np.ndarray
    tenant: str = ""
    whole: bool = False
    sequence: np.ndarray = field(init=False, repr=False)
    whole_upto: int = field(default=0, repr=False)

    def __post_init__(self) -> None:
        self.sequence = np.concatenate([self.prompt, self.generated]).astype(np.int32)
        if self.kept is not None:  # a kept run from the start sits at its own positions: the same KV as unpruned
            run = np.flatnonzero(self.kept != np.arange(len(self.kept)))
            self.whole_upto = max(self.whole_upto, int(run[0]) if run.size else len(self.kept))

    @property
    def held_whole(self) -> int:
        """Leading tokens of `sequence` the base holds unpruned, at their own positions."""
        return len(self.sequence) if self.whole else min(self.whole_upto, len(self.sequence))

    def cached(self, upto: int) -> np.ndarray:
        """Indices, below `upto`, of the tokens whose KV this request left at their original positions: its kept
        prompt tokens, then its generated ones (index M + j). Its own selection, also once it is held whole too: a
        repeated request gets the answer it got before."""
        m = len(self.prompt)
        kept = np.arange(m) if self.kept is None else self.kept
        out: np.ndarray = np.concatenate([kept[kept < upto], np.arange(m, max(m, upto))]).astype(np.int64)
        return out


@dataclass(frozen=True)
class Reuse:
    """How a request uses an earlier one: `extend` or `whole` (the base gets `kept`, no speculation), `prefix`
    (selected afresh, the first `length` tokens kept whole: the base holds them unpruned), `append` (the earlier
    request's `kept` for the first `length` tokens, what follows selected afresh) or `speculate` (selected afresh;
    the caches spare what they hold of the `length` shared tokens)."""

    kind: str  # "extend" | "whole" | "prefix" | "append" | "speculate"
    length: int  # L: leading tokens shared with the earlier request (`prefix`: those the base holds whole)
    kept: np.ndarray | None = None  # extend / whole: every index the base receives; append: the earlier kept ones
    shared: int = 0  # `prefix`: leading tokens shared with the earlier request's prompt (the speculator's cache holds)

    @property
    def speculates(self) -> bool:
        """The request is speculated afresh (`prefix`, `append`: on top of what the base holds, `on_held`)."""
        return self.kind in ("prefix", "append", "speculate")

    @property
    def plain(self) -> bool:
        """The base receives every token: send it as a plain prompt."""
        return self.kept is not None and len(self.kept) > 0 and int(self.kept[-1]) == len(self.kept) - 1


class TurnMemory:
    """Up to `capacity` base requests (at most `max_tokens` prompt and generated tokens in all, ~8 bytes each plus
    one index entry per block), per tenant. Full, it forgets the oldest entry of the tenant holding the most entries
    (over `capacity`; of those holding as many, the one idle longest) or the most tokens (over `max_tokens`): one
    tenant's many requests (or one request's many choices) evict that tenant's own entries, not another's, and many
    one-entry tenants (a fresh cache salt per request) evict each other before a conversation still in use. Only
    what is remembered is reused: an entry vLLM evicted from its cache costs a recomputation, never a wrong answer
    (the cache matches tokens and positions, not this memory)."""

    def __init__(self, capacity: int = 256, max_tokens: int = 1 << 22) -> None:
        self.capacity, self.max_tokens = capacity, max_tokens
        self._items: dict[int, tuple[Held, list[int]]] = {}
        self._index: dict[int, set[int]] = {}  # chained block hash -> entries holding that prefix
        self._by_tenant: dict[str, collections.OrderedDict[int, None]] = {}  # tenant -> its entries, oldest first
        self._tenant_tokens: collections.Counter[str] = collections.Counter()
        self._next = 0
        self._used: dict[str, int] = {}  # tenant -> when it last remembered or found something (`_next` ticks)
        self._tokens = 0

    def __len__(self) -> int:
        return len(self._items)

    def remember(
        self,
        prompt: Sequence[int],
        kept: Sequence[int] | None,
        generated: Sequence[int],
        tenant: str = "",
        whole: bool = False,
        prompt_hashes: Sequence[int] = (),
    ) -> Held | None:
        """Remember one finished base request (None: too short or too long to index). `prompt_hashes`: the prompt's
        `block_hashes`, where several choices of one prompt are remembered (each then hashes only its answer)."""
        as_array = lambda x: None if x is None else np.asarray(x, dtype=np.int32)  # noqa: E731
        held = Held(as_array(prompt), as_array(kept), as_array(generated), tenant, whole)  # type: ignore[arg-type]
        if len(held.sequence) < BLOCK or len(held.sequence) > self.max_tokens:
            return None
        hashes = block_hashes(held.sequence, tenant, prompt_hashes[: len(held.prompt) // BLOCK])
        key, self._next = self._next, self._next + 1
        self._items[key] = (held, hashes)
        for h in hashes:
            self._index.setdefault(h, set()).add(key)
        self._by_tenant.setdefault(tenant, collections.OrderedDict())[key] = None
        self._used[tenant] = key
        self._tenant_tokens[tenant] += len(held.sequence)
        self._tokens += len(held.sequence)
        while len(self._items) > self.capacity:  # too many entries: the tenant holding the most entries pays
            # ... among tenants holding as many, the one idle longest: a flood of new tenants (one entry each, a
            # fresh cache_salt per request) evicts its own before an active conversation's document
            self._forget(max(self._by_tenant, key=lambda t: (len(self._by_tenant[t]), -self._used.get(t, -1))))
        while self._tokens > self.max_tokens:  # too many tokens: the tenant holding the most tokens pays
            self._forget(max(self._tenant_tokens, key=lambda t: (self._tenant_tokens[t], len(self._by_tenant[t]))))
        return held if key in self._items else None

    def _forget(self, tenant: str) -> None:
        """Drop `tenant`'s oldest entry."""
        entries = self._by_tenant[tenant]
        old, _ = entries.popitem(last=False)
        gone, gone_hashes = self._items.pop(old)
        self._tokens -= len(gone.sequence)
        self._tenant_tokens[tenant] -= len(gone.sequence)
        if not entries:
            del self._by_tenant[tenant], self._tenant_tokens[tenant]
            self._used.pop(tenant, None)
        for h in gone_hashes:
            keys = self._index.get(h)
            if keys is not None:
                keys.discard(old)
                if not keys:
                    del self._index[h]

    def holds(self, held: Held) -> bool:
        """Whether `held` is still remembered (not forgotten to make room)."""
        entries = self._by_tenant.get(held.tenant)
        return entries is not None and any(self._items[k][0] is held for k in entries)

    def find(self, ids: Sequence[int], tenant: str = "") -> tuple[Held, int] | None:
        """The remembered request of `tenant` sharing the most leading tokens with `ids`, and how many (the newest
        wins a tie). Cost: one hash per block of `ids` and one comparison, whatever the memory holds."""
        arr = np.asarray(ids, dtype=np.int32)
        best = None
        for h in block_hashes(arr, tenant):
            keys = self._index.get(h)
            if not keys:
                break
            best = max(keys)
        if best is None:
            return None
        held = self._items[best][0]
        if held.tenant != tenant:  # a hash collision across tenants: never another tenant's state
            return None
        self._used[tenant], self._next = self._next, self._next + 1  # in use: evicted after idler tenants
        return held, common_prefix(held.sequence, arr)


class PrefillTime:
    """One engine's seconds to prefill against the prompt tokens it computes, fitted online as a fixed part plus a
    part per token (least squares over exponentially weighted means of the requests measured, `weight` the newest's
    share, outliers clipped): what the server measured on its own engines, under its own load."""

    def __init__(self, weight: float = 0.2) -> None:
        self.weight = weight
        self.means: np.ndarray | None = None  # weighted means of tokens, seconds, tokens², tokens × seconds

    def observe(self, tokens: int, seconds: float) -> None:
        """One request's measurement; once the fit predicts, one more than `OUTLIER` times off it counts as that far
        (a stall, a burst of another tenant's work: one request moves the fit by a bounded step, many in a row
        follow a real change of rate)."""
        predicted = self.predict(tokens)
        if predicted:
            seconds = min(max(seconds, predicted / OUTLIER), predicted * OUTLIER)
        x, y = float(tokens), float(seconds)
        row = np.array([x, y, x * x, x * y])
        self.means = row if self.means is None else (1 - self.weight) * self.means + self.weight * row

    def predict(self, tokens: int) -> float | None:
        """Seconds to compute `tokens` prompt tokens (None: fewer than two sizes seen, or no rise with size yet)."""
        if self.means is None:
            return None
        mx, my, mxx, mxy = self.means
        spread = mxx - mx * mx
        if spread <= 1e-9 * max(1.0, mxx):
            return None
        slope = (mxy - mx * my) / spread
        return max(0.0, my + slope * (tokens - mx)) if slope > 0 else None


class PairTimes(NamedTuple):
    """The base's and the speculator's `PrefillTime`, as a server measured them."""

    base: PrefillTime
    speculator: PrefillTime


def on_held(
    pruned: PrunedPrompt,
    token_ids: Sequence[int],
    held: int,
    config: SpecPrefillConfig,
    held_kept: Sequence[int] | np.ndarray | None = None,
) -> PrunedPrompt:
    """A fresh selection on top of the first `held` tokens as the base holds them: whole (`held_kept` None: those
    tokens, read from its cache at their own positions) or as an earlier request left them (`held_kept`: its kept
    indices below `held`, its answer's included), then what the selection kept after them (its importance
    unchanged). The base computes only the rest's kept tokens."""
    held = max(0, min(held, len(token_ids)))
    first = list(range(held)) if held_kept is None else [int(i) for i in held_kept if i < held]
    kept = first + [i for i in pruned.kept_indices if i >= held]
    importance = torch.tensor(pruned.importance) if pruned.importance else None
    return prune(token_ids, kept, config, importance)
