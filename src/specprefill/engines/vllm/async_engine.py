"""SpecPrefill on vLLM's async engine (`AsyncLLM`), for serving: an async speculator and an engine client that
prunes each request before the base sees it. The OpenAI-compatible server (`specprefill.serve`) hands this client
to vLLM's own serving code in place of the base engine.

Concurrent requests reach the speculator engine together, so its scheduler runs them in the same steps (one
speculator batch); the base is a separate engine and keeps running other requests' steps meanwhile. Nothing here
blocks the event loop: the engines run in their own processes and the scoring left on the driver is [N, M].
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import math
import time
from contextvars import ContextVar

from specprefill import core
from specprefill.config import SpecPrefillConfig, is_keep_rate
from specprefill.engines.vllm import request
from specprefill.engines.vllm.async_speculator import AsyncSpeculator
from specprefill.engines.vllm.background import Warmups
from specprefill.engines.vllm.payloads import (
    Turns,
    base_request,
    speculator_salt,
)
from specprefill.engines.vllm.positions import CAPTURE_KEY, POSITIONS_KEY
from specprefill.engines.vllm.request import Record
from specprefill.errors import SpecPrefillError

KEEP_RATE_KEY = "specprefill_keep_rate"  # per request, in SamplingParams.extra_args (`vllm_xargs` in a server)
RESERVED_KEYS = (POSITIONS_KEY, CAPTURE_KEY)  # set by SpecPrefill only, never by a client
WHOLE_INPUTS = ("prompt_embeds", "multi_modal_data", "mm_kwargs")  # inputs pruning cannot read: they run whole
log = logging.getLogger("specprefill")


def summarize(stats: list[Record], details: bool = False) -> dict | None:
    """One response's `specprefill` field (several prompts in one completion request: token counts summed): the
    prompt's tokens and the keep rate asked for. What ran and what the caches held (tokens kept, speculation time,
    `reuse`, the prefilled-token counts) only with `details`, as vLLM shows cached tokens only under
    --enable-prompt-tokens-details: without it a request that reused another's state reads as one that did not."""
    if not stats:
        return None
    asked = {s.keep_rate if s.asked_keep_rate is None else s.asked_keep_rate for s in stats}
    out: dict[str, object] = {
        "n_prompt_tokens": sum(s.n_prompt_tokens for s in stats),
        "keep_rate": asked.pop() if len(asked) == 1 else None,
    }
    if details:
        base = [s.base_prefilled_tokens for s in stats]
        out["n_kept_tokens"] = sum(s.n_kept_tokens for s in stats)
        out["speculation_ms"] = round(max(s.speculation_ms for s in stats), 3)
        out["reuse"] = stats[0].reuse if len({s.reuse for s in stats}) == 1 else "mixed"
        out["speculator_prefilled_tokens"] = sum(s.speculator_prefilled_tokens for s in stats)
        out["base_prefilled_tokens"] = None if None in base else sum(b or 0 for b in base)
        predicted = stats[0].predicted if len(stats) == 1 else None  # the paths weighed, where the server chose
        out["predicted_ms"] = None if predicted is None else {k: round(v * 1000, 1) for k, v in predicted.items()}
        out["reasons"] = list(stats[0].reasons) if len(stats) == 1 else None  # why its path (`core.decide`)
    return out


# The stats of the requests one HTTP request makes; set by the server around each call into vLLM's serving code.
REQUEST_STATS: ContextVar[list | None] = ContextVar("specprefill_request_stats", default=None)
# A chat request's (text messages, template arguments), set by the server around the chat handler: a speculator with
# another tokenizer renders the conversation with its own chat template (`tokenmap.Pair.chat_map`)
CHAT: ContextVar[tuple[list, dict] | None] = ContextVar("specprefill_chat", default=None)


def keep_rate_of(extra_args: dict | None, default: float) -> float:
    """The request's keep rate from `extra_args` (missing: `default`); ValueError names the fix."""
    extra = extra_args or {}
    for key in RESERVED_KEYS:
        if key in extra:
            raise ValueError(
                f"{key} is set by SpecPrefill, not by clients: send vllm_xargs "
                f'{{"{KEEP_RATE_KEY}": r}} with 0 < r <= 1 instead'
            )
    rate = extra.get(KEEP_RATE_KEY, default)
    if not is_keep_rate(rate):
        raise ValueError(f"{KEEP_RATE_KEY} {rate!r} must be a number in (0, 1] (1 runs the whole prompt)")
    return float(rate)


class SpecPrefillEngineClient:
    """vLLM's `EngineClient` of the base with SpecPrefill in `generate`: everything else is the base `AsyncLLM`'s, and
    its health is both engines' (a dead speculator ends the server as a dead base does: vLLM's watchdog reads
    `errored` and `is_running`).

    Per request: keep rate from `extra_args[KEEP_RATE_KEY]` (default `config.keep_rate`); prompts shorter than
    `min_prompt_tokens`, with keep rate 1, with embeddings or multimodal data run whole. Outputs carry the whole
    prompt's token ids (usage counts M). `only_marked`: prune only requests made inside a context that set
    `REQUEST_STATS` (the server's wrapped endpoints); the rest run whole. With the base's prefix caching, earlier
    requests of the same tenant are remembered (`payloads.Turns`) and, when the engines are idle, a pruned request's
    prompt and answer are prefilled whole on the base (`warm`), so that a later request adding fewer than
    `min_new_tokens` to them runs whole, as plain vLLM with prefix caching answers it; any other request is
    speculated afresh."""

    def __init__(
        self,
        base,
        speculator: AsyncSpeculator,
        config: SpecPrefillConfig,
        min_prompt_tokens: int = 0,
        metrics=None,
        only_marked: bool = False,
        min_new_tokens: int = 512,
        warm: bool = True,
        background_tokens_per_tenant: int | None = None,
    ) -> None:
        self.base, self.speculator, self.config = base, speculator, config
        self.min_prompt_tokens, self.metrics, self.only_marked = min_prompt_tokens, metrics, only_marked
        self.turns = Turns.of(getattr(base, "vllm_config", None), min_new_tokens)  # with prefix caching only
        self.warm = warm and self.turns is not None
        model_config = getattr(getattr(base, "vllm_config", None), "model_config", None)
        block = getattr(getattr(getattr(base, "vllm_config", None), "cache_config", None), "block_size", None) or 16
        self._active = 0  # requests in flight (a warm-up runs only while none is)
        self.warm_ups = Warmups(
            base,
            lambda: self.turns,
            lambda: not self._active,
            metrics,
            background_tokens_per_tenant or getattr(model_config, "max_model_len", None) or 2**31,
            block,
        )
        self.times = core.PairTimes(core.PrefillTime(), core.PrefillTime())  # measured on the requests run

    def __getattr__(self, name):
        return getattr(self.base, name)

    @property
    def errored(self) -> bool:
        return bool(self.base.errored or self.speculator.llm.errored)

    @property
    def is_running(self) -> bool:
        return bool(self.base.is_running and not self.speculator.llm.errored)

    @property
    def is_stopped(self) -> bool:
        return self.errored

    @property
    def dead_error(self) -> BaseException:
        return self.base.dead_error if self.base.errored else self.speculator.llm.dead_error

    @property
    def background(self) -> int:
        """Warm-ups running or waiting for an idle moment, every tenant's (the operator's count; the benchmark waits
        for none before a timed request)."""
        return self.warm_ups.count

    def background_of(self, salt: str | None) -> int:
        """The warm-ups running or waiting of the requests sent with `cache_salt` `salt` (None: without one): what
        one API client may see, never another tenant's."""
        return self.warm_ups.count_of(salt)

    def retry_after_s(self) -> int:
        """Seconds a refused client should wait: the measured speculator time of the tokens waiting for it (1-120;
        1 before anything was measured)."""
        budget = getattr(self.speculator, "budget", None)
        predicted = self.times.speculator.predict(budget.queued_tokens) if budget is not None else None
        return max(1, min(120, math.ceil(predicted or 1)))

    async def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        """vLLM's `/reset_prefix_cache` on both engines; what the memory says the base holds is forgotten with it (a
        follow-up is then planned from what the engines hold: nothing). The background prefills go first: the waiting
        ones dropped, the running one cancelled and awaited (its step's blocks freed: vLLM refuses a reset while
        blocks are in use), queued again never."""
        await self.warm_ups.stop()
        try:
            base = await self.base.reset_prefix_cache(reset_running_requests, reset_connector)
            speculator = await self.speculator.llm.reset_prefix_cache(reset_running_requests, reset_connector)
            if self.turns is not None:
                self.turns = Turns.of(self.base.vllm_config, self.turns.max_new)
        finally:
            self.warm_ups.resume()
        return bool(base and speculator)

    async def check_health(self) -> None:
        await self.base.check_health()
        await self.speculator.llm.check_health()

    def shutdown(self, *args, **kwargs) -> None:
        self.warm_ups.shutdown()
        self.speculator.shutdown()
        self.base.shutdown(*args, **kwargs)

    def generate(self, prompt, sampling_params, request_id: str, **kwargs):
        return self._generate(prompt, sampling_params, request_id, REQUEST_STATS.get(), kwargs, CHAT.get())

    async def _chat_map(self, prompt, ids: list[int], chat: tuple[list, dict] | None):
        """The token map of a chat request for a speculator with another tokenizer (None: built from the text)."""
        pair = self.speculator.pair
        if chat is None or not pair.cross:
            return None
        text = prompt.get("prompt") if isinstance(prompt.get("prompt"), str) else pair.base_tok.decode(ids)
        return await asyncio.to_thread(pair.chat_map, chat[0], ids, text, **chat[1])  # CPU work: off the loop

    async def _generate(self, prompt, sampling_params, request_id, stats: list | None, kwargs, chat=None):
        self.warm_ups.interrupt()  # a request never waits behind a warm-up (its blocks so far stay cached)
        self._active += 1
        try:
            async with contextlib.aclosing(self._run(prompt, sampling_params, request_id, stats, kwargs, chat)) as outs:
                async for out in outs:
                    yield out
        finally:
            self._active -= 1
            self.warm_ups.start()

    async def _run(self, prompt, sampling_params, request_id, stats: list | None, kwargs, chat=None):
        ids = prompt.get("prompt_token_ids") if isinstance(prompt, dict) else None
        unmarked = self.only_marked and stats is None  # an endpoint SpecPrefill does not wrap
        other = isinstance(prompt, dict) and (
            prompt.get("type", "token") != "token" or any(prompt.get(k) is not None for k in WHOLE_INPUTS)
        )  # embeddings (a chat's prompt_embeds parts), multimodal data
        if ids is None or other or not hasattr(sampling_params, "extra_args") or unmarked:  # embeddings, pooling
            run = self._run_whole(prompt, sampling_params, request_id, stats, kwargs)
        else:
            run = self._run_pruned(prompt, list(ids), sampling_params, request_id, stats, kwargs, chat)
        async with contextlib.aclosing(run) as outs:  # closing this generator closes the base request at once
            async for out in outs:
                yield out

    async def _run_whole(self, prompt, sampling_params, request_id, stats: list | None, kwargs):
        """A request pruning cannot read (no token ids, embeddings, pooling, an unwrapped endpoint): the base's."""
        params, extra = sampling_params, getattr(sampling_params, "extra_args", None)
        if extra:  # reserved keys refused here too; the keep rate has nothing to do
            keep_rate_of(extra, self.config.keep_rate)
            params = sampling_params.clone()
            params.extra_args = {k: v for k, v in extra.items() if k != KEEP_RATE_KEY} or None
        if stats is not None:  # a wrapped endpoint: its reply says the prompt ran whole
            ids = prompt.get("prompt_token_ids") if isinstance(prompt, dict) else None
            n = len(ids) if ids is not None else len(prompt.get("prompt_embeds", ()))
            stats.append(Record(n))
        async for out in self.base.generate(prompt, params, request_id, **kwargs):
            yield out

    async def _run_pruned(self, prompt, ids: list[int], sampling_params, request_id, stats, kwargs, chat):
        """A token prompt: its plan (`request.plan`: whole, continued or speculated), then the base on what is kept
        at the original positions; the finished request is remembered for its tenant's later ones."""
        extra = dict(sampling_params.extra_args or {})
        config = self.config.replace(keep_rate=keep_rate_of(extra, self.config.keep_rate))
        extra.pop(KEEP_RATE_KEY, None)
        params = sampling_params.clone()
        params.extra_args = extra or None
        salt, lora = prompt.get("cache_salt"), kwargs.get("lora_request")
        t0 = time.perf_counter()
        todo = request.plan(ids, config, params, self.min_prompt_tokens, self.turns, salt, lora, self.times)
        record = Record.of(ids, todo, config.keep_rate)
        pruned = todo.pruned
        if todo.speculate:
            try:
                tmap = await self._chat_map(prompt, ids, chat)
                pruned = await self.speculator.speculate(ids, config, tmap, speculator_salt(salt, lora), record)
            except SpecPrefillError as exc:
                raise ValueError(str(exc)) from None
            pruned = todo.selected(ids, pruned, config)
            record.kept(pruned, config.keep_rate, speculated=True)
        record.timings["speculation_s"] = time.perf_counter() - t0
        if todo.speculate and pruned is not None and record.speculator_prefilled_tokens:  # the engine's own time
            self.times.speculator.observe(
                record.timings.get("speculator_base_tokens", record.speculator_prefilled_tokens),
                record.timings.get("speculator_engine_s", record.timings["speculation_s"]),
            )
        if stats is not None:
            stats.append(record)
        if self.metrics is not None:
            self.metrics.observe(record)
        base_prompt, params = base_request(ids, pruned, config, params, prompt)
        answers: dict[int, list[int]] = collections.defaultdict(list)  # per choice, every token generated
        delta, t1 = _is_delta(params), time.perf_counter()
        async with contextlib.aclosing(self.base.generate(base_prompt, params, request_id, **kwargs)) as outs:
            async for out in outs:  # closed (the base request aborted) as soon as this generator is
                if record.base_cached_tokens is None and out.num_cached_tokens is not None:
                    record.base_cached_tokens = out.num_cached_tokens
                    if not out.finished or all(len(c.token_ids) <= 1 for c in out.outputs):  # a first token's time
                        record.timings["base_ttft_s"] = time.perf_counter() - t1  # (not a whole answer's: FINAL_ONLY)
                        self.times.base.observe(record.base_prefilled_tokens or 0, record.timings["base_ttft_s"])
                out.prompt_token_ids = ids
                for choice in out.outputs:
                    if delta:
                        answers[choice.index].extend(choice.token_ids)
                    else:
                        answers[choice.index] = list(choice.token_ids)
                if out.finished and self.turns is not None:
                    self._remember(ids, pruned, answers, todo.tenant, salt, lora)
                yield out

    def _remember(self, ids, pruned, answers: dict, tenant: str, salt, lora) -> None:
        """Remember a finished request (each choice's whole answer); a pruned one waits to be prefilled whole, in
        place of the same tenant's waiting ones it extends (an earlier turn: prefilling the later one covers it)."""
        assert self.turns is not None
        for index, held in enumerate(self.turns.remember_choices(ids, pruned, answers, tenant)):
            if held is not None and not index:
                self.warm_ups.offer(held, salt, lora, queue=not held.whole and self.warm)


def _is_delta(params) -> bool:
    from vllm.sampling_params import RequestOutputKind

    return getattr(params, "output_kind", None) == RequestOutputKind.DELTA
