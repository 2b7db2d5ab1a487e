"""The speculator on vLLM's async engine (`AsyncLLM`), for serving: concurrent requests reach it together, so its
scheduler runs them in the same steps, within a token budget of what it may hold at once (`TokenBudget`); each
request's scores are collected from the workers once it finishes (`Collector`) and turned into the base's kept set
(`AsyncSpeculator.speculate`). Nothing here blocks the event loop."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from http import HTTPStatus

from specprefill import core, tokenmap
from specprefill.config import SpecPrefillConfig
from specprefill.engines.common import require_tokens
from specprefill.engines.vllm.budgets import PastWindow
from specprefill.engines.vllm.logs import Throttled
from specprefill.engines.vllm.payloads import salted
from specprefill.engines.vllm.request import Record
from specprefill.engines.vllm.speculation import Speculator
from specprefill.errors import SpecPrefillError

log = logging.getLogger("specprefill")
warn = Throttled(log)  # one line per cause and minute: a client cannot flood the log with unreadable prompts
OFF_LOOP_TOKENS = 2048  # prompts longer than this read their structure and select off the event loop


class TokenBudget:
    """At most `total` prompt tokens under speculation at once (a longer prompt waits for the whole budget and then
    runs alone): bounds the prompt keys the speculator's workers hold, however many requests arrive. First come,
    first served: a waiting request is never overtaken by later ones, so a prompt needing the whole budget cannot
    starve under a steady stream of short ones."""

    def __init__(self, total: int, max_waiting: int | None = None) -> None:
        self.total = self.free = total
        self.max_waiting = max_waiting  # requests waiting beyond this are refused (`busy`); None: no limit
        self._queue: collections.deque[tuple[int, asyncio.Future]] = collections.deque()

    @property
    def waiting(self) -> int:
        return len(self._queue)

    @property
    def queued_tokens(self) -> int:
        return sum(n for n, _ in self._queue)

    def admit(self) -> None:
        """Refuse a request (`Busy`: HTTP 503) while `max_waiting` requests already wait."""
        if self.max_waiting is not None and len(self._queue) >= self.max_waiting:
            raise busy(len(self._queue))

    def _wake(self) -> None:
        while self._queue and self._queue[0][0] <= self.free:
            n, waiter = self._queue.popleft()
            if not waiter.done():  # a cancelled waiter left nothing to grant
                self.free -= n
                waiter.set_result(None)

    @contextlib.asynccontextmanager
    async def hold(self, n: int):
        n = min(n, self.total)
        if self._queue or self.free < n:
            self.admit()
            waiter = asyncio.get_running_loop().create_future()
            entry = (n, waiter)
            self._queue.append(entry)
            try:
                await waiter
            except BaseException:
                if waiter.done() and not waiter.cancelled():  # granted, then cancelled before resuming
                    self.free += n
                elif entry in self._queue:
                    self._queue.remove(entry)
                self._wake()
                raise
        else:
            self.free -= n
        try:
            yield
        finally:  # synchronous: a cancelled request always gives its tokens back
            self.free += n
            self._wake()


def busy(waiting: int):
    """vLLM's admission-control error (its server answers HTTP 503; `serve.server` adds Retry-After)."""
    from vllm.exceptions import GracefulHTTPError

    return GracefulHTTPError(
        f"specprefill: {waiting} requests are waiting for the speculator, the server's --speculation-queue: "
        "retry later (see the Retry-After header)",
        HTTPStatus.SERVICE_UNAVAILABLE,
    )


class Collector:
    """The workers' scores of finished speculations, fetched in one RPC for every request that finished in the same
    event-loop turn instead of one each."""

    def __init__(self, llm) -> None:
        self.llm = llm
        self._pending: dict[str, asyncio.Future] = {}
        self._flush: asyncio.Task | None = None

    async def collect(self, uid: str) -> list:
        """Per rank, this request's wire scores (None where the rank saw nothing)."""
        future = asyncio.get_running_loop().create_future()
        self._pending[uid] = future
        if self._flush is None:
            self._flush = asyncio.ensure_future(self._run())
        return await future

    async def _run(self) -> None:
        await asyncio.sleep(0)  # let every request finishing in this turn join
        batch, self._pending, self._flush = self._pending, {}, None
        try:
            per_rank = await self.llm.collective_rpc("specprefill_collect", args=(list(batch),))
        except BaseException as exc:
            for future in batch.values():
                if not future.done():
                    future.set_exception(exc)
            return
        for uid, future in batch.items():
            if not future.done():
                future.set_result([rank[uid] for rank in per_rank])


class AsyncSpeculator(Speculator):
    """A speculator `AsyncLLM` (eager, prefix caching as the base's on CPU, capture extension in every worker;
    started by `builder.start_async_pair`)."""

    queue_limit: int | None = None  # `limit`: refused beyond this many waiting
    timeout_s: float | None = None  # `limit`: a speculation running longer is given up (the prompt runs whole)

    def __init__(self, llm, model: str, max_speculation_tokens: int | None = None, base_tokenizer=None) -> None:
        super().__init__(llm.get_tokenizer(), llm.model_config, model, max_speculation_tokens, base_tokenizer)
        self.llm = llm
        self.budget = TokenBudget(self.max_speculation_tokens)
        self.collector = Collector(llm)

    def limit(self, queue: int | None, timeout_s: float | None) -> None:
        """The server's limits: at most `queue` requests wait for the speculator (more are refused, 503); a
        speculation unfinished `timeout_s` after the speculator took it up is given up and its prompt runs whole."""
        self.queue_limit, self.timeout_s = queue, timeout_s or None
        self.budget.max_waiting = queue

    async def fit_budget(self) -> None:
        """Size the speculation budget from the memory free now (after both engines are profiled), unless given."""
        if self.budget_from_memory:
            self.fit(await self.llm.collective_rpc("specprefill_memory"))
            self.budget = TokenBudget(self.max_speculation_tokens, self.queue_limit)

    async def speculate(
        self,
        base_prompt: list[int],
        config: SpecPrefillConfig,
        tmap: tokenmap.TokenMap | None = None,
        cache_salt: str | None = None,
        record: Record | None = None,
    ) -> core.PrunedPrompt | None:
        """Prefill plus up to N-1 greedy look-ahead steps, scored in the workers; the workers forget the request
        however it ends (cancelled included). A cross-tokenizer speculator reads the prompt's text in its own
        tokens (`tmap`, else built here). One prompt, not `common.Engine`'s batch: each server request awaits its
        own, and concurrent ones share the speculator's steps through its scheduler. `cache_salt`: the request's
        tenant (the speculator's prefix cache is shared within it only); `record`: gets the tokens the speculator
        computed. None, with one logged line, for a prompt the speculator cannot read now (longer than its
        max_model_len, or than its memory holds): plain vLLM serves it, so it runs whole. Longer than the
        speculator's own window (`budgets.PastWindow`): refused, naming speculators that read it. Near max_model_len
        the look-ahead is shortened to what fits."""

        require_tokens([base_prompt])
        self.budget.admit()  # a full queue refuses before the prompt's analysis costs anything
        # tokenizing and aligning (a cross-tokenizer pair), reading a long prompt's structure and selecting in it
        # are CPU work: off the event loop, so other requests' streams go on meanwhile (~0.6 s at 41k tokens)
        heavy = config.needs_layout and len(base_prompt) > OFF_LOOP_TOKENS
        if (tmap is None and self.pair.cross) or heavy:
            s = await asyncio.to_thread(self.heads.speculation, self.pair, base_prompt, config, tmap)
        else:
            s = self.heads.speculation(self.pair, base_prompt, config, tmap)
        try:
            s = self.checked(s, shorten=True)
        except PastWindow:
            raise  # no setting of this speculator reads it: the request is refused with the line naming others
        except SpecPrefillError as exc:
            warn.warning("unreadable", "specprefill: running a prompt whole: %s", exc)
            return None
        ran = await self._run(s, cache_salt)
        if ran is None:
            return None
        n_generated, cached, per_rank, engine_s = ran
        if record is not None:
            record.speculator_prefilled_tokens = len(s.spec_ids) - cached
            # in the base's tokens, as the rate is queried (a cross-tokenizer speculator counts its own)
            record.timings["speculator_engine_s"] = engine_s
            record.timings["speculator_base_tokens"] = round(
                record.speculator_prefilled_tokens * len(base_prompt) / max(1, len(s.spec_ids))
            )
        importance = self.importance_of(s, n_generated, per_rank)
        return await asyncio.to_thread(s.prune, importance) if heavy else s.prune(importance)

    async def _run(self, s, cache_salt: str | None) -> tuple[int, int, list, float] | None:
        """One speculation on the engine within the token budget: (look-ahead tokens generated, prompt tokens its
        prefix cache held, each rank's scores, the engine's seconds from taking it up); None, with one logged line,
        when it outran `timeout_s` (aborted: the prompt runs whole)."""
        from vllm import TokensPrompt

        uid, params = self.request(s)
        n_generated = cached = 0
        async with self.budget.hold(len(s.spec_ids)):
            t0 = time.perf_counter()  # the engine's own time: not the layout, not the wait for the budget
            try:
                async with asyncio.timeout(self.timeout_s):  # closing the generator aborts the engine's request
                    async for out in self.llm.generate(
                        salted(TokensPrompt(prompt_token_ids=list(s.spec_ids)), cache_salt),
                        params,
                        request_id=f"specprefill-{uid}",
                    ):
                        n_generated, cached = len(out.outputs[0].token_ids), out.num_cached_tokens or 0
            except TimeoutError:
                warn.warning(
                    "timeout",
                    "specprefill: the speculator did not finish a %d-token prompt in %.0f s (--speculation-timeout-s): "
                    "it runs whole",
                    len(s.spec_ids),
                    self.timeout_s,
                )
                return None
            finally:
                per_rank = await asyncio.shield(self.collector.collect(uid))
            return n_generated, cached, per_rank, time.perf_counter() - t0

    def shutdown(self) -> None:
        self.llm.shutdown()
