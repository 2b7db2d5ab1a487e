"""One request's path before the base sees it, the same for the offline pair (`pair.SpecPrefillLLM.generate`) and the
server's engine client (`async_engine.SpecPrefillEngineClient`): run whole (short prompt, keep rate 1, or what the
sampling asks of the whole prompt, `budgets.runs_whole`), continue an earlier selection of the same tenant where
`core.turns` allows it (`extend`; or whole, once held whole), or be speculated afresh."""

from __future__ import annotations

from dataclasses import dataclass

from specprefill import core
from specprefill.config import SpecPrefillConfig
from specprefill.engines.vllm.budgets import runs_whole
from specprefill.engines.vllm.payloads import Turns, extended, tenant_of


@dataclass
class Plan:
    """What a request does: `speculate`, or go to the base with `pruned` (None: whole). `reuse`: what it may use of
    earlier requests of its `tenant` (None when nothing is remembered)."""

    tenant: str
    reuse: core.Reuse | None = None
    pruned: core.PrunedPrompt | None = None
    speculate: bool = False


def plan(
    ids: list[int],
    config: SpecPrefillConfig,
    params,
    min_prompt_tokens: int,
    turns: Turns | None,
    salt: str | None = None,
    lora=None,
) -> Plan:
    """The request's plan from its tokens, knobs, sampling parameters and tenant (cache salt, LoRA adapter)."""
    tenant = tenant_of(config, salt, lora)
    if runs_whole(len(ids), config.keep_rate, min_prompt_tokens, params):
        return Plan(tenant)
    reuse = turns.plan(ids, tenant) if turns is not None else None
    if reuse is not None and reuse.kind != "speculate":
        return Plan(tenant, reuse, extended(ids, reuse, config))
    return Plan(tenant, reuse, speculate=True)
