"""One request's path before the base sees it, the same for the offline pair (`pair.SpecPrefillLLM.generate`) and the
server's engine client (`async_engine.SpecPrefillEngineClient`): `core.decide` chooses (run whole, continue an
earlier selection of the same tenant, or speculate afresh, on top of a prefix the base holds or not, with its reasons
in words); `plan` turns the decision into what the engines run, and `Record` is the one record of what it did, which
both report (`RequestOutput.specprefill`, the server's reply and metrics)."""

from __future__ import annotations

from dataclasses import dataclass, field

from specprefill import core
from specprefill.config import SpecPrefillConfig
from specprefill.engines.vllm.payloads import Turns, extended, tenant_of


@dataclass
class Plan:
    """What a request does: `speculate`, or go to the base with `pruned` (None: whole). `reuse`: what it may use of
    earlier requests of its `tenant` (None when nothing is remembered)."""

    tenant: str
    reuse: core.Reuse | None = None
    pruned: core.PrunedPrompt | None = None
    speculate: bool = False
    predicted: dict[str, float] | None = None  # seconds per path open to it, where the paths were weighed
    reasons: tuple[str, ...] = ()  # `core.Decision.reasons`: why this path

    def selected(
        self, ids: list[int], pruned: core.PrunedPrompt | None, config: SpecPrefillConfig
    ) -> core.PrunedPrompt | None:
        """The speculator's selection as the base gets it: on top of the prefix the base holds, whole (`prefix`) or
        as the earlier request left it (`append`)."""
        if pruned is None or self.reuse is None or self.reuse.kind not in ("prefix", "append"):
            return pruned
        return core.on_held(pruned, ids, self.reuse.length, config, self.reuse.kept)


def plan(
    ids: list[int],
    config: SpecPrefillConfig,
    params,
    min_prompt_tokens: int,
    turns: Turns | None,
    salt: str | None = None,
    lora=None,
    times: core.PairTimes | None = None,
) -> Plan:
    """The request's plan from its tokens, knobs, sampling parameters and tenant (cache salt, LoRA adapter):
    `core.decide` on what `turns` remembers of the tenant and the `times` a server measured."""
    tenant = tenant_of(config, salt, lora)
    memory, max_new = (turns.memory, turns.max_new) if turns is not None else (None, 0)
    d = core.decide(ids, config.keep_rate, params, min_prompt_tokens, memory, tenant, max_new, times)
    if d.speculate or d.reuse is None:
        return Plan(tenant, d.reuse, speculate=d.speculate, predicted=d.predicted, reasons=d.reasons)
    return Plan(tenant, d.reuse, extended(ids, d.reuse, config), predicted=d.predicted, reasons=d.reasons)


@dataclass
class Record:
    """What one request did, the same record offline (`RequestOutput.specprefill`) and in the server (its reply's
    `specprefill` field, `async_engine.summarize`, and its metrics)."""

    n_prompt_tokens: int
    kept_indices: list[int] | None = None  # None: the prompt ran whole (too short, keep rate 1, not readable)
    importance: list[float] | None = None  # None: not speculated (ran whole, or continued an earlier selection)
    keep_rate: float = 1.0  # the request's keep rate where it was pruned; 1 where it ran whole
    timings: dict = field(default_factory=dict)  # seconds: speculation_s (its plan included), base_ttft_s, ...
    reuse: str | None = None  # extend / whole / prefix / append / speculate: what it used of earlier requests
    speculator_prefilled_tokens: int = 0  # prompt tokens the speculator computed (its prefix cache held the rest)
    base_cached_tokens: int | None = None  # of the tokens the base received, those its prefix cache held
    asked_keep_rate: float | None = None  # the keep rate the request asked for (its own or the server's)
    predicted: dict[str, float] | None = None  # seconds per path where the server chose between paths (`Plan`)
    reasons: tuple[str, ...] = ()  # why its path (`core.Decision.reasons`)

    @classmethod
    def of(cls, ids: list[int], todo: Plan, keep_rate: float) -> Record:
        """A request's record before it runs: whole, or the selection its plan already holds."""
        kind = todo.reuse.kind if todo.reuse is not None else None
        record = cls(len(ids), reuse=kind, asked_keep_rate=keep_rate, predicted=todo.predicted, reasons=todo.reasons)
        return record.kept(todo.pruned, keep_rate)

    def kept(self, pruned: core.PrunedPrompt | None, keep_rate: float, speculated: bool = False) -> Record:
        """The selection the base receives (None: the whole prompt); `speculated`: it came from the speculator (its
        importance is kept too; None from it: the speculator declined, the base ran the prompt whole, reusing
        nothing)."""
        if pruned is None and speculated:
            self.reuse = None
        if pruned is not None:
            self.kept_indices, self.keep_rate = list(pruned.kept_indices), keep_rate
            if speculated:
                self.importance = pruned.importance
        return self

    @property
    def n_kept_tokens(self) -> int:
        return self.n_prompt_tokens if self.kept_indices is None else len(self.kept_indices)

    @property
    def base_prefilled_tokens(self) -> int | None:
        """Of the tokens the base received, those it computed (None: not reported yet)."""
        return None if self.base_cached_tokens is None else self.n_kept_tokens - self.base_cached_tokens

    @property
    def speculation_ms(self) -> float:
        return self.timings.get("speculation_s", 0.0) * 1000
