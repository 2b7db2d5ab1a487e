"""Serving state without a model (a stand-in base and speculator): the speculator's prefix cache is salted
by the whole tenant key, `cache_salt` and LoRA adapter, as the base's cache is (vLLM hashes the adapter into the
base's blocks; the speculator runs no adapter, so the adapter must be in its salt); a request the speculator
declined reports no reuse."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from types import SimpleNamespace

import numpy as np

from specprefill.config import SpecPrefillConfig
from specprefill.engines.vllm.async_engine import SpecPrefillEngineClient
from specprefill.engines.vllm.payloads import speculator_salt


@dataclass
class Lora:
    lora_name: str
    lora_int_id: int


@dataclass
class Speculator:
    """Records the salt each speculation ran under; declines every prompt (the base runs it whole)."""

    salts: list = field(default_factory=list)
    pair: SimpleNamespace = field(default_factory=lambda: SimpleNamespace(cross=False))

    async def speculate(self, ids, config, tmap=None, cache_salt=None, record=None):
        self.salts.append(cache_salt)
        return None


class Base:
    async def generate(self, prompt, params, request_id, **kwargs):
        choice = SimpleNamespace(index=0, token_ids=[7])
        yield SimpleNamespace(outputs=[choice], finished=True, num_cached_tokens=0, prompt_token_ids=None)


def test_the_speculators_cache_is_salted_by_the_whole_tenant():
    from vllm import SamplingParams

    speculator = Speculator()
    engine = SpecPrefillEngineClient(Base(), speculator, SpecPrefillConfig(keep_rate=0.3))

    async def ask(salt, lora):
        prompt = {"prompt_token_ids": list(range(40)), **({"cache_salt": salt} if salt else {})}
        async for _ in engine.generate(prompt, SamplingParams(max_tokens=1), "r", lora_request=lora):
            pass

    for salt, lora in [("a", Lora("x", 1)), ("a", Lora("y", 2)), ("a", Lora("x", 1)), ("a", None), (None, None)]:
        asyncio.run(ask(salt, lora))
    x, y, x_again, plain, none = speculator.salts
    assert x != y and x == x_again  # two adapters of one salt: two caches; the same adapter: one
    assert plain == "a" and none is None  # no adapter: the request's own salt, as vLLM's base cache keys it
    assert len({x, y, plain}) == 3
    assert speculator_salt(None, Lora("x", 1)) != speculator_salt(None, Lora("y", 2)) is not None


def test_a_request_the_speculator_declined_reports_no_reuse():
    """A follow-up planned as "speculate" (an earlier request held, speculated afresh) that the speculator declines
    (longer than it reads) runs whole on the base: it reports no reuse, not "speculate"."""
    from specprefill.engines.vllm.request import Record

    declined = Record(40, reuse="speculate").kept(None, 0.3, speculated=True)
    assert declined.reuse is None and declined.n_kept_tokens == 40 and declined.keep_rate == 1.0
    continued = Record(40, reuse="extend").kept(None, 0.3)  # not from the speculator: the plan's own
    assert continued.reuse == "extend"


class Metrics:
    def __init__(self) -> None:
        self.observed, self.background_runs = [], []

    def observe(self, record) -> None:
        self.observed.append(record)

    def background(self, tokens: int, seconds: float, outcome: str) -> None:
        self.background_runs.append((tokens, outcome))


@dataclass
class Pruning(Speculator):
    """Keeps every third token, as a speculation would."""

    async def speculate(self, ids, config, tmap=None, cache_salt=None, record=None):
        from specprefill import core

        self.salts.append(cache_salt)
        kept = list(range(0, len(ids), 3))
        return core.PrunedPrompt([ids[i] for i in kept], kept, kept, len(ids), len(ids))


class CachingBase(Base):
    """Reports as cached the longest start a prompt shares with an earlier one (a prefix cache without eviction)."""

    vllm_config = SimpleNamespace(cache_config=SimpleNamespace(enable_prefix_caching=True))

    def __init__(self) -> None:
        self.prompts, self.seen = [], []

    async def generate(self, prompt, params, request_id, **kwargs):
        ids = list(prompt["prompt_token_ids"])
        self.prompts.append((request_id, len(ids)))
        cached = max(
            (next((i for i, (a, b) in enumerate(zip(ids, s)) if a != b), min(len(ids), len(s))) for s in self.seen),
            default=0,
        )
        self.seen.append(ids)
        async for out in super().generate(prompt, params, request_id, **kwargs):
            out.num_cached_tokens = cached
            yield out


def test_background_prefill_is_a_flag_and_counted_apart():
    """`background_prefill="idle"`: after a pruned request, the idle server prefills its prompt and answer whole on
    the base in steps (`warm_steps`), counted in the background metrics (tokens, outcome), not in the requests';
    "off": nothing runs."""
    from vllm import SamplingParams

    for mode in ("idle", "off"):
        base, metrics = CachingBase(), Metrics()
        engine = SpecPrefillEngineClient(
            base, Pruning(), SpecPrefillConfig(keep_rate=0.3), metrics=metrics, warm=mode == "idle"
        )

        async def ask(engine=engine):
            prompt = {"prompt_token_ids": list(range(300))}
            async for _ in engine.generate(prompt, SamplingParams(max_tokens=1), "r"):
                pass
            while engine.background:
                await asyncio.sleep(0.01)

        asyncio.run(ask())
        requests = [n for rid, n in base.prompts if rid == "r"]
        warm = [n for rid, n in base.prompts if rid != "r"]
        assert requests == [100] and len(metrics.observed) == 1  # the request: its kept tokens
        if mode == "idle":  # prompt + answer whole, in steps of 256 tokens; token 0 (kept) was held already
            assert warm == [256, 301] and metrics.background_runs == [(300, "finished")]
        else:
            assert warm == [] and metrics.background_runs == []


def test_an_unknown_background_mode_is_refused_in_one_line():
    import pytest

    from specprefill.config import EngineParams
    from specprefill.engines.vllm import checks
    from specprefill.errors import SpecPrefillError

    with pytest.raises(SpecPrefillError, match="background_prefill 'sometimes' is unknown: use one of idle, off"):
        checks.validate(EngineParams(speculator="smollm2-135m", base="smollm2-135m", background_prefill="sometimes"))


def test_one_tenants_backlog_of_background_work_does_not_drop_anothers():
    """Pending background prefills are bounded (WARM_PENDING): a tenant with many waiting loses its own oldest, not
    another tenant's one."""
    from specprefill import core
    from specprefill.engines.vllm.background import WARM_PENDING

    engine = SpecPrefillEngineClient(CachingBase(), Pruning(), SpecPrefillConfig(keep_rate=0.3))

    def pruned(ids):
        kept = list(range(0, len(ids), 3))
        return core.PrunedPrompt([ids[i] for i in kept], kept, kept, len(ids), len(ids))

    quiet = list(range(1000, 1300))
    engine._remember(quiet, pruned(quiet), {0: [5]}, "quiet", None, None)
    for i in range(3 * WARM_PENDING):
        ids = [2000 + i] * 300
        engine._remember(ids, pruned(ids), {0: [5]}, "busy", None, None)
    tenants = [held.tenant for held, _, _ in engine.warm_ups.pending.values()]
    assert len(tenants) == WARM_PENDING and tenants.count("quiet") == 1


def test_one_tenants_background_work_is_bounded_in_tokens():
    """A tenant's waiting background prefills add up to at most its token budget (what is left to prefill of
    each): over it, its own oldest are dropped (counted as "dropped"), another tenant's stay; a request over the
    budget alone is not queued. The default budget is the base's max_model_len."""
    from specprefill import core

    dropped = []
    metrics = SimpleNamespace(background=lambda tokens, seconds, outcome: dropped.append(outcome))
    engine = SpecPrefillEngineClient(
        CachingBase(), Pruning(), SpecPrefillConfig(keep_rate=0.3), metrics=metrics, background_tokens_per_tenant=1000
    )

    def remember(first, n, tenant):
        ids = list(range(first, first + n))
        kept = list(range(0, n, 3))
        engine._remember(ids, core.PrunedPrompt([ids[i] for i in kept], kept, kept, n, n), {0: [5]}, tenant, None, None)

    remember(50_000, 300, "quiet")
    for i in range(5):  # 5 x 301 tokens (prompt and answer) of one tenant: 3 fit in 1,000
        remember(10_000 * (i + 1), 300, "busy")
    waiting = [(h.tenant, int(h.sequence[0])) for h, _, _ in engine.warm_ups.pending.values()]
    assert waiting == [("quiet", 50_000), ("busy", 30_000), ("busy", 40_000), ("busy", 50_000)]
    assert dropped == ["dropped", "dropped"]
    remember(90_000, 2_000, "busy")  # over the budget alone: not queued, and the tenant's others are gone with it
    assert [h.tenant for h, _, _ in engine.warm_ups.pending.values()] == ["quiet"]
    base = CachingBase()
    base.vllm_config = SimpleNamespace(
        cache_config=base.vllm_config.cache_config, model_config=SimpleNamespace(max_model_len=4096)
    )
    assert SpecPrefillEngineClient(base, Pruning(), SpecPrefillConfig(keep_rate=0.3)).warm_ups.tenant_budget == 4096


def test_reset_prefix_cache_reaches_both_engines_and_forgets_what_the_base_held():
    """vLLM's /reset_prefix_cache on the server empties both engines' caches (before, it reached the base alone,
    through attribute passthrough) and the memory of what the base holds whole: a follow-up is not planned as
    `whole` on a cache that is gone, and no background prefill of a forgotten request runs."""
    from vllm import SamplingParams

    calls = []

    class ResettingBase(CachingBase):
        async def reset_prefix_cache(self, running=False, connector=False):
            calls.append("base")
            return True

    speculator = Pruning()
    speculator.llm = SimpleNamespace(reset_prefix_cache=None)

    async def speculator_reset(running=False, connector=False):
        calls.append("speculator")
        return True

    speculator.llm.reset_prefix_cache = speculator_reset
    base = ResettingBase()
    engine = SpecPrefillEngineClient(base, speculator, SpecPrefillConfig(keep_rate=0.3), warm=False)
    ids = list(range(300))

    async def go():
        async for _ in engine.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=1), "r"):
            pass
        held = engine.turns.memory.find(ids, engine.turns.memory._items[0][0].tenant)
        assert held is not None
        held[0].whole = True  # as a background prefill would have marked it
        assert await engine.reset_prefix_cache() is True
        assert calls == ["base", "speculator"] and len(engine.turns.memory) == 0 and not engine.warm_ups.pending

    asyncio.run(go())


class SlowBase(CachingBase):
    """Each background step takes a while, so a request can arrive between two."""

    async def generate(self, prompt, params, request_id, **kwargs):
        if request_id.startswith("specprefill-warm"):
            await asyncio.sleep(0.05)
        async for out in super().generate(prompt, params, request_id, **kwargs):
            yield out


async def _ask(engine, ids: list[int], request_id: str):
    """One request of one token through the engine client, as the server's wrapped endpoints make it: its record."""
    from vllm import SamplingParams

    from specprefill.engines.vllm.async_engine import REQUEST_STATS

    stats: list = []
    token = REQUEST_STATS.set(stats)
    try:
        async for _ in engine.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=1), request_id):
            pass
    finally:
        REQUEST_STATS.reset(token)
    return stats[0]


def test_a_follow_up_during_background_prefill_takes_the_prefix_held_so_far_whole():
    """A follow-up arriving after the first background step (256 of 301 tokens held whole) cancels the warm-up and
    gets those 256 tokens whole (read from the cache) plus its own selection of the rest (`prefix`): the base
    receives 256 + the kept tokens after them, not a fresh selection of the whole prompt. Steps are multiples of
    the base's block size; the follow-up's own warm-up, which covers the first's, takes over from there."""
    from specprefill.engines.vllm.background import warm_steps

    assert warm_steps(0, 301, 256) == [256, 301] and warm_steps(40, 600, 256) == [256, 512, 600]
    assert warm_steps(256, 301, 256) == [301] and warm_steps(301, 301, 256) == []
    base, metrics = SlowBase(), Metrics()
    engine = SpecPrefillEngineClient(base, Pruning(), SpecPrefillConfig(keep_rate=0.3), metrics=metrics)

    async def run():
        await _ask(engine, list(range(300)), "r1")
        (held,) = [h for h, _ in engine.turns.memory._items.values()]
        while held.whole_upto < 256:
            await asyncio.sleep(0.005)
        record = await _ask(engine, list(held.sequence) + list(range(5000, 5020)), "r2")
        while engine.background:
            await asyncio.sleep(0.01)
        return record, held, max(engine.turns.memory._items.items())[1][0]  # the newest entry: r2

    record, held, later = asyncio.run(run())
    assert record.reuse == "prefix"
    kept = [n for rid, n in base.prompts if rid == "r2"]
    assert kept == [256 + len([i for i in range(0, 321, 3) if i >= 256])]
    assert record.kept_indices[:256] == list(range(256))
    # the cancelled warm-up of r1 is not resumed: r2 covers it, and r2's is prefilled whole from where r1's stopped
    assert "cancelled" in [o for _, o in metrics.background_runs] and not held.whole and later.whole
    warm = [n for rid, n in base.prompts if rid.startswith("specprefill-warm")]
    assert warm[0] == 256 and warm[-1] == len(later.sequence) and warm == sorted(warm)


def test_a_follow_up_on_a_prefix_held_whole_so_far_runs_whole_where_the_measured_rates_predict_it_faster():
    """The same follow-up as above (256 of 301 tokens held whole), on a server whose measured rates make the base's
    computing the 65 remaining tokens whole faster than the speculator's pass plus the kept rest: it runs whole (the
    base receives the whole prompt, its cache serving the held part; nothing speculated), and the paths it weighed
    are in its `specprefill` field under details only."""
    from specprefill import core
    from specprefill.engines.vllm.async_engine import summarize

    base, speculator = SlowBase(), Pruning()
    engine = SpecPrefillEngineClient(base, speculator, SpecPrefillConfig(keep_rate=0.3))

    def rates(fixed, per_token):  # as measured on two requests (r2's plan is made before r2 is measured)
        out = core.PrefillTime()
        for tokens in (100, 1000):
            out.observe(tokens, fixed + per_token * tokens)
        return out

    async def run():
        await _ask(engine, list(range(300)), "r1")
        engine.times = core.PairTimes(rates(0.01, 0.001), rates(2.0, 0.01))  # a quick base, a slow speculator
        (held,) = [h for h, _ in engine.turns.memory._items.values()]
        while held.whole_upto < 256:
            await asyncio.sleep(0.005)
        calls = len(speculator.salts)
        record = await _ask(engine, list(held.sequence) + list(range(5000, 5020)), "r2")
        await asyncio.sleep(0.2)  # r1's cancelled warm-up is covered by r2, held whole: it is not queued again
        return record, calls, engine.background

    record, calls, left = asyncio.run(run())
    assert record.reuse == "whole" and record.n_kept_tokens == 321 and len(speculator.salts) == calls
    assert left == 0 and base.prompts[-1] == ("r2", 321)  # no background step after it
    assert [n for rid, n in base.prompts if rid == "r2"] == [321]
    details = summarize([record], details=True)["predicted_ms"]
    assert set(details) == {"prefix", "whole"} and details["whole"] < details["prefix"]
    assert "predicted_ms" not in summarize([record])


def test_a_later_turn_replaces_the_waiting_background_prefill_it_extends():
    """Deduplicated by prefix: turn 2 (turn 1's prompt and answer, then more) waiting to be prefilled whole replaces
    turn 1's waiting entry of the same tenant; another tenant's entry, or one it does not extend, stays."""

    from specprefill import core
    from specprefill.engines.vllm.background import covers

    def held(ids, tenant="a"):
        return core.Held(np.asarray(ids), np.asarray([0, 2]), np.asarray([9]), tenant)

    one = held(range(100))
    two = held(list(range(100)) + [9] + list(range(500, 540)))
    assert covers(two, one) and not covers(one, two)
    assert not covers(held(list(range(100)) + [9] + [1] * 40, "b"), one)  # another tenant
    assert not covers(held(list(range(50)) + [3] * 91), one)  # not an extension

    engine = SpecPrefillEngineClient(CachingBase(), Pruning(), SpecPrefillConfig(keep_rate=0.3))
    engine._active = 1  # a request in flight: nothing starts
    prompt = list(range(300))
    engine._remember(prompt, None, {0: [7, 8]}, "a", None, None)  # ran whole: nothing waits
    assert not engine.warm_ups.pending
    kept = core.PrunedPrompt([0], [0], [0], 300, 300)
    engine._remember(prompt, kept, {0: [7, 8]}, "a", None, None)
    engine._remember(prompt, kept, {0: [5]}, "b", "b", None)  # another tenant's
    engine._remember(prompt + [7, 8, 11, 12], kept, {0: [4]}, "a", None, None)  # turn 2 of tenant a
    waiting = [(h.tenant, len(h.sequence)) for h, _, _ in engine.warm_ups.pending.values()]
    assert waiting == [("b", 301), ("a", 305)]


def test_a_background_step_that_ends_unfinished_fails_the_warm_up_without_marking_it_whole():
    """A step whose stream ends without a finished output (the engine dropped it): the warm-up is counted failed and
    the request is not marked held whole (a later follow-up is then planned from what is known to be held)."""
    from vllm import SamplingParams

    class Dropping(CachingBase):
        async def generate(self, prompt, params, request_id, **kwargs):
            if request_id.startswith("specprefill-warm"):
                self.prompts.append((request_id, len(prompt["prompt_token_ids"])))
                yield SimpleNamespace(outputs=[], finished=False, num_cached_tokens=0, prompt_token_ids=None)
                return
            async for out in super().generate(prompt, params, request_id, **kwargs):
                yield out

    base, metrics = Dropping(), Metrics()
    engine = SpecPrefillEngineClient(base, Pruning(), SpecPrefillConfig(keep_rate=0.3), metrics=metrics)

    async def run():
        async for _ in engine.generate({"prompt_token_ids": list(range(300))}, SamplingParams(max_tokens=1), "r"):
            pass
        while engine.background:
            await asyncio.sleep(0.01)

    asyncio.run(run())
    (held,) = [h for h, _ in engine.turns.memory._items.values()]
    assert not held.whole and held.whole_upto == 1 and metrics.background_runs == [(0, "failed")]


def test_the_bases_rate_is_learned_from_first_tokens_only():
    """The base's rate is fitted on the time to its first output when that output is the first token (streamed, or
    one token asked); a request whose first output is its whole answer (vLLM's FINAL_ONLY, every non-streamed
    request) is not observed: its time is the answer's, not the prefill's."""
    from vllm import SamplingParams

    class WholeAnswer(Base):
        async def generate(self, prompt, params, request_id, **kwargs):
            choice = SimpleNamespace(index=0, token_ids=[7, 8, 9, 10])
            yield SimpleNamespace(outputs=[choice], finished=True, num_cached_tokens=0, prompt_token_ids=None)

    def fitted(base) -> bool:
        engine = SpecPrefillEngineClient(base, Pruning(), SpecPrefillConfig(keep_rate=0.3))

        async def run():
            for n in (300, 600):
                async for _ in engine.generate({"prompt_token_ids": list(range(n))}, SamplingParams(), f"r{n}"):
                    pass

        asyncio.run(run())
        return engine.times.base.means is not None

    assert fitted(Base()) and not fitted(WholeAnswer())


class HangingBase(CachingBase):
    """A background step runs until cancelled; the base refuses a reset while one is open (as vLLM refuses to reset
    a cache whose blocks a running request uses)."""

    def __init__(self) -> None:
        super().__init__()
        self.open_steps, self.resets = 0, []

    async def generate(self, prompt, params, request_id, **kwargs):
        if request_id.startswith("specprefill-warm"):
            self.open_steps += 1
            try:
                await asyncio.Event().wait()
            finally:
                self.open_steps -= 1
        async for out in super().generate(prompt, params, request_id, **kwargs):
            yield out

    async def reset_prefix_cache(self, running=False, connector=False):
        self.resets.append(self.open_steps)
        return self.open_steps == 0


def _remembered(engine, n: int, tenant: str, salt=None, first: int = 0):
    """A pruned request of `tenant` remembered and waiting to be prefilled whole (as `_remember` queues it)."""
    held = engine.turns.memory.remember(list(range(first, first + n)), list(range(0, n, 3)), [1, 2], tenant)
    engine.warm_ups.pending[id(held)] = (held, salt, None)
    return held


def test_reset_cancels_the_running_background_prefill_first_and_queues_nothing_again():
    """A reset while a background prefill runs: the prefill is cancelled and has ended before either engine resets
    (before, the base was reset first: vLLM refuses that while the step's blocks are in use), and the cancelled
    prefill is not queued again (before, it re-queued itself and prefilled the purged prompt back in)."""
    speculator = Pruning()

    async def speculator_reset(running=False, connector=False):
        return True

    speculator.llm = SimpleNamespace(reset_prefix_cache=speculator_reset)
    base = HangingBase()
    engine = SpecPrefillEngineClient(base, speculator, SpecPrefillConfig(keep_rate=0.3))

    async def go():
        _remembered(engine, 400, "t")
        engine.warm_ups.start()
        await asyncio.sleep(0.01)
        assert base.open_steps == 1
        assert await engine.reset_prefix_cache() is True
        await asyncio.sleep(0.01)
        return base.resets, engine.background, base.open_steps

    assert asyncio.run(go()) == ([0], 0, 0)


def test_background_prefills_take_turns_across_tenants_each_oldest_first():
    """Waiting background prefills run one per tenant in turn, each tenant's oldest first: a tenant sending a steady
    stream cannot starve another's older entry (before: the newest entry of any tenant ran first)."""
    engine = SpecPrefillEngineClient(CachingBase(), Pruning(), SpecPrefillConfig(keep_rate=0.3))
    a1, a2, a3 = (_remembered(engine, 100, "a", first=1000 * i) for i in range(3))
    b1 = _remembered(engine, 100, "b", first=5000)
    order = []
    while engine.warm_ups.pending:
        key = engine.warm_ups.next_entry()
        order.append(engine.warm_ups.pending.pop(key)[0])
    assert order == [a1, b1, a2, a3]


def test_a_background_prefill_whose_entry_was_forgotten_does_not_run():
    """An entry the memory forgot (evicted for room) is dropped from the waiting prefills and counted as dropped:
    nothing will be planned on it, so prefilling it would be work for no one (before, it still ran)."""
    from specprefill import core

    metrics = Metrics()
    base = CachingBase()
    engine = SpecPrefillEngineClient(base, Pruning(), SpecPrefillConfig(keep_rate=0.3), metrics=metrics)
    engine.turns.memory = core.TurnMemory(capacity=1)
    _remembered(engine, 100, "a")
    kept = _remembered(engine, 100, "b", first=500)  # evicts a's entry (capacity 1)

    async def go():
        engine.warm_ups.start()
        for _ in range(50):
            await asyncio.sleep(0.01)
            if not engine.background:
                break

    asyncio.run(go())
    outcomes = [o for _, o in metrics.background_runs]
    assert kept.whole and outcomes.count("dropped") == 1 and outcomes.count("finished") == 1
    assert base.prompts and all(n <= 102 for _, n in base.prompts)  # b's steps only (100 prompt + 2 answer tokens)


def test_a_warning_a_client_can_cause_is_written_once_per_cause_and_interval():
    """A client sending many prompts the speculator cannot read gets one log line per minute, not one per request;
    the next line says how many were held back."""
    import logging

    from specprefill.engines.vllm.logs import Throttled

    now = [0.0]
    lines = []

    class Keep(logging.Handler):
        def emit(self, record):
            lines.append(record.getMessage())

    log = logging.getLogger("specprefill.test_throttle")
    log.addHandler(Keep())
    log.propagate = False
    warn = Throttled(log, interval_s=60, clock=lambda: now[0])
    for _ in range(100):
        warn.warning("unreadable", "running a prompt whole: %s", "too long")
    warn.warning("other cause", "another")
    now[0] = 61.0
    warn.warning("unreadable", "running a prompt whole: %s", "too long")
    assert lines == ["running a prompt whole: too long", "another", lines[2]]
    assert "99 more" in lines[2] and lines[2].startswith("running a prompt whole: too long")


def test_one_slow_measurement_moves_the_fitted_rate_a_bounded_step():
    """The measured rates that choose a request's path: one request timed 100 times slower (a stall, another
    tenant's burst) moves the prediction a bounded step (clipped at `OUTLIER` times the prediction: here under
    1.5x, against over 10x unclipped); a lasting change is still followed."""
    from specprefill import core

    fit = core.PrefillTime()
    for n in (1000, 2000, 3000, 4000) * 5:
        fit.observe(n, 0.001 * n)
    before = fit.predict(4000)
    unclipped = core.PrefillTime()
    unclipped.means = None if fit.means is None else fit.means.copy()
    fit.observe(4000, 400.0)
    unclipped.means = (1 - fit.weight) * unclipped.means + fit.weight * np.array([4000, 400.0, 4000**2, 4000 * 400.0])
    after, wild = fit.predict(4000), unclipped.predict(4000)
    assert before is not None and after is not None and wild is not None
    assert after < 1.5 * before and 10 * before < wild  # unclipped: 100x the stall's share
    for n in (1000, 2000, 3000, 4000) * 10:
        fit.observe(n, 0.004 * n)  # the engine got 4x slower for good
    assert abs(fit.predict(2000) / 8.0 - 1) < 0.05


def test_no_background_prefill_starts_while_a_reset_is_under_way():
    """A request finishing while a reset waits for the cancelled background prefill queues its own: it neither
    starts during the reset (the base would refuse the reset, or prefill a purged prompt back in) nor runs after
    it (it was planned on what the reset forgot)."""
    speculator = Pruning()
    started_during = []
    base = HangingBase()

    async def speculator_reset(running=False, connector=False):
        started_during.append(engine.warm_ups.task is not None)
        return True

    speculator.llm = SimpleNamespace(reset_prefix_cache=speculator_reset)
    engine = SpecPrefillEngineClient(base, speculator, SpecPrefillConfig(keep_rate=0.3))

    async def go():
        _remembered(engine, 400, "t")
        engine.warm_ups.start()
        await asyncio.sleep(0.01)
        reset = asyncio.create_task(engine.reset_prefix_cache())
        await asyncio.sleep(0)
        _remembered(engine, 300, "u", first=2000)  # a request finished meanwhile
        engine.warm_ups.start()
        assert await reset is True
        await asyncio.sleep(0.01)
        return started_during, engine.background, base.resets

    assert asyncio.run(go()) == ([False], 0, [0])
