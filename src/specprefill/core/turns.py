"""Multi-turn reuse, engine-free: what the base's prefix cache already holds of earlier requests, and what a request
that extends one of them sends to the base.

A turn of a conversation repeats the earlier turn's prompt and answer and adds a little. The base cached the earlier
turn's kept tokens at their original positions and its generated tokens right after (position M + j), block by
block, identified by tokens and positions (the `positions` plugin). A request whose first L tokens equal an earlier
request's prompt + answer therefore finds in the cache exactly `Held.cached(L)`: the earlier kept indices below L and
the generated ones. `plan_reuse` decides per request:
  - nothing earlier shares its start: speculate and select as usual;
  - fewer than `min_new` tokens are new: `extend` — no speculation, the base gets the cached kept set plus every new
    token (its cache holds the rest, so it prefills only what is new);
  - otherwise `speculate` the whole prompt (the speculator's own prefix cache reads only the new tokens) and
    `select_stable`: the cached kept set stays as it is, the new tokens are selected by the new scores.
"""

from __future__ import annotations

import collections
import functools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from specprefill.config import SpecPrefillConfig
from specprefill.core.selection import select

PROBE = 16  # leading tokens that index earlier requests
MIN_SHARED = 128  # fewer shared leading tokens (a chat template's system prompt) are not reused: a fresh request


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """How many leading entries two int arrays share."""
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n


@dataclass(frozen=True)
class Held:
    """One earlier base request: its whole prompt (base tokens), the indices the base received (None: all of them)
    and the tokens it generated."""

    prompt: np.ndarray
    kept: np.ndarray | None
    generated: np.ndarray
    tag: str = ""  # what else must match for reuse (the selection's knobs: another keep rate selects anew)

    @functools.cached_property
    def sequence(self) -> np.ndarray:  # once per entry: every lookup compares against it
        out: np.ndarray = np.concatenate([self.prompt, self.generated])
        return out

    def cached(self, upto: int) -> np.ndarray:
        """Indices, below `upto`, of the tokens whose KV this request left at their original positions: its kept
        prompt tokens, then its generated ones (index M + j)."""
        m = len(self.prompt)
        kept = np.arange(m) if self.kept is None else self.kept
        out: np.ndarray = np.concatenate([kept[kept < upto], np.arange(m, max(m, upto))]).astype(np.int64)
        return out


@dataclass(frozen=True)
class Reuse:
    """What a request that extends an earlier one does: `extend` (kept = `kept`, no speculation) or `speculate`
    (then `select_stable` with `cached` below `length`)."""

    kind: str  # "extend" | "speculate"
    length: int  # L: leading tokens shared with the earlier request
    cached: np.ndarray  # indices below L the base holds
    kept: np.ndarray | None = None  # extend: every index the base receives

    @property
    def whole(self) -> bool:
        """The base receives every token (an extended request that was never pruned): send it as a plain prompt."""
        return self.kept is not None and len(self.kept) > 0 and int(self.kept[-1]) == len(self.kept) - 1


class TurnMemory:
    """The last `capacity` base requests (at most `max_tokens` prompt and generated tokens in all, ~8 bytes each),
    looked up by their first `PROBE` tokens. Only what is remembered is reused: an entry vLLM evicted from its cache
    costs a recomputation, never a wrong answer (the cache matches tokens and positions, not this memory)."""

    def __init__(self, capacity: int = 256, max_tokens: int = 1 << 22) -> None:
        self.capacity, self.max_tokens = capacity, max_tokens
        self._items: collections.OrderedDict[int, Held] = collections.OrderedDict()
        self._by_probe: dict[bytes, set[int]] = {}
        self._next = 0
        self._tokens = 0

    def __len__(self) -> int:
        return len(self._items)

    @staticmethod
    def _probe(ids: np.ndarray) -> bytes | None:
        return ids[:PROBE].astype(np.int32).tobytes() if len(ids) >= PROBE else None

    def remember(
        self, prompt: Sequence[int], kept: Sequence[int] | None, generated: Sequence[int], tag: str = ""
    ) -> None:
        held = Held(
            np.asarray(prompt, dtype=np.int32),
            None if kept is None else np.asarray(kept, dtype=np.int32),
            np.asarray(generated, dtype=np.int32),
            tag,
        )
        probe = self._probe(held.prompt)
        if probe is None or len(held.sequence) > self.max_tokens:
            return
        key, self._next = self._next, self._next + 1
        self._items[key] = held
        self._by_probe.setdefault(probe, set()).add(key)
        self._tokens += len(held.sequence)
        while len(self._items) > self.capacity or self._tokens > self.max_tokens:
            old, gone = self._items.popitem(last=False)
            self._tokens -= len(gone.sequence)
            keys = self._by_probe[self._probe(gone.prompt)]  # type: ignore[index]
            keys.discard(old)
            if not keys:
                del self._by_probe[self._probe(gone.prompt)]  # type: ignore[arg-type]

    def find(self, ids: Sequence[int], tag: str = "") -> tuple[Held, int] | None:
        """The remembered request with the same `tag` sharing the most leading tokens with `ids`, and how many (the
        newest wins a tie)."""
        arr = np.asarray(ids, dtype=np.int32)
        probe = self._probe(arr)
        best: tuple[Held, int] | None = None
        for key in sorted(self._by_probe.get(probe, ()) if probe is not None else (), reverse=True):
            held = self._items[key]
            if held.tag != tag:
                continue
            length = common_prefix(held.sequence, arr)
            if best is None or length > best[1]:
                best = (held, length)
        return best


def plan_reuse(ids: Sequence[int], memory: TurnMemory, min_new: int, tag: str = "") -> Reuse | None:
    """How a request reuses what the base holds (None: it shares nothing remembered with the same `tag`). A prompt
    the earlier request's prompt and answer hold entirely (a repeated prompt) gets the earlier kept set as it was."""
    found = memory.find(ids, tag)
    if found is None:
        return None
    held, length = found
    length = min(length, len(ids))
    if length < MIN_SHARED:
        return None
    cached = held.cached(length)
    if len(ids) - length < min_new:
        return Reuse("extend", length, cached, np.concatenate([cached, np.arange(length, len(ids))]))
    return Reuse("speculate", length, cached)


def select_stable(importance: torch.Tensor, config: SpecPrefillConfig, reuse: Reuse) -> torch.Tensor:
    """The kept indices of a request extending an earlier one: the cached kept set as it is (the base prefills
    none of it again), and the new tokens [L, M) selected by their own scores at the keep rate, on chunks counted
    from L (the first chunk is not forced: the cached set holds the prompt's start)."""
    new = select(importance[reuse.length :], config.replace(keep_first_chunk=False))
    return torch.cat([torch.from_numpy(reuse.cached), new + reuse.length]).long()
