"""The server's background work: a pruned request's prompt and answer prefilled whole on the base while no request
is in flight (`Warmups`), so that a later request adding a few tokens to them runs whole, as plain vLLM with prefix
caching answers it. Bounded and fair: at most `WARM_PENDING` wait, each tenant's within its token budget; tenants
take turns, each its oldest first; an entry the memory forgot is dropped; a reset cancels first and queues nothing
again. Used by `async_engine.SpecPrefillEngineClient`."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
import uuid
from collections.abc import Callable

from specprefill.engines.vllm.logs import Throttled
from specprefill.engines.vllm.payloads import Turns, salted
from specprefill.errors import SpecPrefillError

WARM_PENDING = 16  # pruned requests waiting to be prefilled whole (the oldest of the tenant with the most is dropped)
# tokens per background prefill step, rounded up to the base's block size: a request arriving waits at most for the
# step in flight (measured on a 2-core AVX-512 CPU, Qwen2.5 1.5B bf16: ~2-3 s per 256 tokens; far less on a GPU)
WARM_STEP_TOKENS = 256
warn = Throttled(logging.getLogger("specprefill"))  # per cause, once a minute


class Warmups:
    """The waiting and running background prefills of one engine client. `turns()`: the client's memory of what
    the base holds (replaced on a reset); `idle()`: whether no request is in flight (a warm-up starts only then, and
    any request arriving cancels the one running: it waits at most for the step in flight)."""

    def __init__(
        self,
        base,
        turns: Callable[[], Turns | None],
        idle: Callable[[], bool],
        metrics=None,
        tenant_budget: int = 2**31,
        block_size: int = 16,
    ) -> None:
        self.base, self.turns, self.idle, self.metrics, self.tenant_budget = base, turns, idle, metrics, tenant_budget
        self.step = -(-WARM_STEP_TOKENS // block_size) * block_size
        self.pending: collections.OrderedDict[int, tuple] = (
            collections.OrderedDict()
        )  # (Held, salt, LoRA), oldest first
        self.task: asyncio.Task | None = None
        self.running: tuple | None = None  # (Held, cache_salt, LoRA) of the warm-up running
        self.superseded = False  # a newer request (or a reset) covers the warm-up running: cancelled, not re-queued
        self.paused = False  # a reset under way: nothing starts (`stop` ... `resume`)
        self._served: dict[str, int] = {}  # tenant -> the turn its last warm-up started in (`next_entry`)
        self._turn = 0

    @property
    def count(self) -> int:
        """Warm-ups running or waiting, every tenant's (the operator's count)."""
        return len(self.pending) + (self.task is not None)

    def count_of(self, salt: str | None) -> int:
        """The warm-ups running or waiting of the requests sent with `cache_salt` `salt` (None: without one)."""
        waiting = sum(s == salt for _, s, _ in self.pending.values())
        return waiting + (self.task is not None and self.running is not None and self.running[1] == salt)

    def offer(self, held, salt, lora, queue: bool) -> None:
        """A finished request of `held.tenant`: the waiting warm-ups it covers are dropped (prefilling it covers
        them: an earlier turn), the running one is not queued again if it covers it; `queue`: it waits itself."""
        for key in [k for k, (h, _, _) in self.pending.items() if covers(held, h)]:
            del self.pending[key]
        self.superseded |= self.running is not None and covers(held, self.running[0])
        if queue:
            self.pending[id(held)] = (held, salt, lora)
            self.bound(held.tenant)

    def bound(self, tenant: str) -> None:
        """Keep the waiting warm-ups within bounds: `tenant`'s within its token budget (what is left to prefill of
        each; its oldest dropped first, a request over the budget alone too), all within `WARM_PENDING` (the
        oldest of the tenant waiting with the most dropped first)."""
        mine = [k for k, (h, _, _) in self.pending.items() if h.tenant == tenant]  # oldest first
        left = {k: len(self.pending[k][0].sequence) - self.pending[k][0].held_whole for k in mine}
        while mine and sum(left[k] for k in mine) > self.tenant_budget:
            self.drop(mine.pop(0))
        while len(self.pending) > WARM_PENDING:
            count = collections.Counter(h.tenant for h, _, _ in self.pending.values())
            most = max(count.values())
            self.drop(next(k for k, (h, _, _) in self.pending.items() if count[h.tenant] == most))

    def drop(self, key: int) -> None:
        """A waiting warm-up given up (bounds, a forgotten entry): counted as "dropped" with no tokens."""
        del self.pending[key]
        if self.metrics is not None:
            self.metrics.background(0, 0.0, "dropped")

    def start(self) -> None:
        """Start the next warm-up (`next_entry`), if the client is idle and none is running."""
        if self.task is None and self.pending and not self.paused and self.idle():
            self.task = asyncio.get_running_loop().create_task(self._run())
            self.task.add_done_callback(self._done)

    def interrupt(self) -> None:
        """A request arrived: the running warm-up is cancelled (its finished steps stay cached; it resumes later)."""
        if self.task is not None:
            self.task.cancel()

    async def stop(self) -> None:
        """Before a reset: nothing starts until `resume`; the running one cancelled (not queued again) and awaited,
        every waiting one dropped."""
        self.paused = True
        task = self.task
        if task is not None:
            self.superseded = True
            task.cancel()
            await asyncio.wait({task})
        self.pending.clear()

    def resume(self) -> None:
        """After a reset: what was queued meanwhile was planned on what the reset forgot: dropped; then running as
        before."""
        self.pending.clear()
        self.paused = False

    def shutdown(self) -> None:
        self.pending.clear()
        self.interrupt()

    def next_entry(self) -> int | None:
        """The waiting warm-up to run next: tenants take turns (the one served longest ago, or never, first), each
        its oldest first; an entry the memory has forgotten since (evicted: nothing is planned on it) is dropped."""
        turns = self.turns()
        for key in [k for k, (h, _, _) in self.pending.items() if turns is None or not turns.memory.holds(h)]:
            self.drop(key)
        first: dict[str, int] = {}  # tenant -> its oldest waiting entry
        for key, (held, _, _) in self.pending.items():
            first.setdefault(held.tenant, key)
        if not first:
            return None
        tenant = min(first, key=lambda t: self._served.get(t, -1))
        self._served[tenant], self._turn = self._turn, self._turn + 1
        if len(self._served) > 4 * WARM_PENDING:  # only tenants with entries waiting need their turn remembered
            self._served = {t: n for t, n in self._served.items() if t in first}
        return first[tenant]

    def _done(self, task: asyncio.Task) -> None:
        """A warm-up ended: finished, failed, or cancelled (also before its first step, when its body never ran)."""
        if self.task is task:
            self.task, self.running = None, None
        self.start()

    async def _run(self) -> None:
        """Prefill one pruned request's prompt and answer whole on the base, from what it holds whole already, in
        steps of `step` tokens (each a request of one token: the leading tokens so far, read from the prefix
        cache, plus the step's), marking after each step how far the base holds them whole (`Held.whole_upto`: a
        later request takes that prefix whole and selects only the rest). Cancelled by a request arriving, it is
        queued again as the oldest, and resumes at the next idle moment where it stopped."""
        from vllm import SamplingParams

        key = self.next_entry()
        if key is None:
            return
        held, salt, lora = self.pending.pop(key)
        self.running, self.superseded = (held, salt, lora), False
        t0, outcome, done = time.perf_counter(), "failed", 0
        try:
            params = SamplingParams(max_tokens=1, detokenize=False)
            for end in warm_steps(held.held_whole, len(held.sequence), self.step):
                turns = self.turns()
                if turns is None or not turns.memory.holds(held):  # evicted or reset: nothing is planned on it
                    outcome = "dropped"
                    return
                uid = f"specprefill-warm-{uuid.uuid4().hex}"
                prompt = salted({"prompt_token_ids": held.sequence[:end].tolist()}, salt)
                finished = False
                async with contextlib.aclosing(self.base.generate(prompt, params, uid, lora_request=lora)) as outs:
                    async for out in outs:
                        if out.finished:  # what the step computed: all but what the cache held (evicted: more)
                            cached = getattr(out, "num_cached_tokens", None)
                            done += end - (held.held_whole if cached is None else min(cached, end))
                            held.whole_upto, finished = max(held.whole_upto, end), True
                if not finished:
                    raise SpecPrefillError(f"a background prefill step of {end} tokens ended unfinished")
            held.whole = True
            outcome = "finished"
        except asyncio.CancelledError:
            outcome = "cancelled"
            if not held.whole and not self.superseded:
                self.pending[key] = (held, salt, lora)
                self.pending.move_to_end(key, last=False)  # its tenant's oldest again
            raise
        except Exception as exc:  # noqa: BLE001 - a failed warm-up costs a recomputation, never an answer
            warn.warning("warm-up failed", "specprefill: prefilling an earlier request whole failed: %s", exc)
        finally:
            if self.metrics is not None:  # what background work cost, apart from the requests' own counters
                self.metrics.background(done, time.perf_counter() - t0, outcome)


def covers(new, old) -> bool:
    """Whether prefilling `new` whole also prefills `old` (one tenant's `core.Held`s): old's tokens start new's."""
    n = len(old.sequence)
    return new.tenant == old.tenant and len(new.sequence) >= n and bool((new.sequence[:n] == old.sequence).all())


def warm_steps(start: int, end: int, step: int) -> list[int]:
    """The prefix lengths a warm-up prefills, from `start` tokens held whole to `end`: each a multiple of `step` (a
    multiple of the base's block size, so every finished step leaves whole blocks in the cache), the last `end`."""
    first = (start // step + 1) * step
    return [*range(first, end, step), end] if start < end else []
