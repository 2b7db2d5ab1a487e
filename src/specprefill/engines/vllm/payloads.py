"""What a request carries to the engines: the speculator's look-ahead request tagged for the workers' capture
(`speculation_params`, `capture_payload`, the speculator's head set) and the base's request for a pruned prompt
(`base_request`: kept tokens + their original positions). Shared by the offline and async engines."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from specprefill import core, tokenmap
from specprefill.config import SpecPrefillConfig, parse_score_heads
from specprefill.core.turns import block_hashes
from specprefill.engines.common import eos_ids_of
from specprefill.engines.vllm import positions
from specprefill.errors import SpecPrefillError
from specprefill.models.self_speculation import carried_heads


def model_eos_ids(tokenizer, model_config) -> set[int]:
    generation = model_config.try_get_generation_config() or {}
    return eos_ids_of(tokenizer, generation.get("eos_token_id"))


@dataclass(frozen=True)
class SpeculatorHeads:
    """What `score_heads` may name on a speculator engine, and the set a calibrated speculator carries."""

    n_layers: int
    n_heads: int
    carried: str | None

    @classmethod
    def of(cls, model: str, model_config) -> SpeculatorHeads:
        text = model_config.hf_text_config
        return cls(int(text.num_hidden_layers), int(text.num_attention_heads), carried_heads(model))

    def speculation(self, pair: tokenmap.Pair, base_ids: list[int], config: SpecPrefillConfig, tmap=None):
        """`pair.speculation` on this speculator engine: its carried heads, checked against its layers and heads."""
        return pair.speculation(base_ids, config, self.carried, tmap, (self.n_layers, self.n_heads))


def capture_payload(uid: str, n_prompt: int, config: SpecPrefillConfig, raw: bool = False) -> dict:
    """What the workers need to score one request. `heads`: the scored (layer, [global query heads] or None) pairs,
    None for every one; the workers check them against the model (`core.head_set`)."""
    heads = parse_score_heads(config.score_heads)
    return {
        "uid": uid,
        "n": n_prompt,
        "steps": config.look_ahead,
        "pool": config.pool_kernel,
        "agg": config.layer_head_agg,
        "heads": None if heads is None or raw else [[layer, h if h is None else list(h)] for layer, h in heads.items()],
        **({"raw": True} if raw else {}),
    }


def speculation_params(uid: str, n_prompt: int, config: SpecPrefillConfig, eos_ids, raw: bool = False):
    """Greedy look-ahead of up to N-1 tokens after the prompt (EOS ends it), tagged for the workers' capture
    (`raw`: every head's attention weights kept, see `raw_scores`)."""
    from vllm import SamplingParams

    return SamplingParams(
        max_tokens=config.look_ahead,
        temperature=0.0,
        stop_token_ids=sorted(eos_ids),
        ignore_eos=False,
        detokenize=False,
        extra_args={positions.CAPTURE_KEY: capture_payload(uid, n_prompt, config, raw)},
    )


def positions_payload(pruned: core.PrunedPrompt) -> dict:
    return {positions.POSITIONS_KEY: {"kept": pruned.kept_indices, "n": pruned.n_original}}


def salted(prompt: dict, salt: str | None) -> dict:
    """`prompt` with the request's `cache_salt` (its tenant in vLLM's prefix cache), when it has one."""
    return prompt if salt is None else {**prompt, "cache_salt": salt}


def speculator_salt(cache_salt: str | None, lora_request=None) -> str | None:
    """The speculator request's `cache_salt`: the whole tenant key of its prefix cache (`cache_salt` and LoRA
    adapter), as the base's cache separates them (vLLM hashes the adapter into the base's blocks; the speculator runs
    no adapter, so it needs it in the salt); None (vLLM's shared cache) for a request with neither."""
    return cache_salt if lora_request is None else repr((cache_salt, _lora_key(lora_request)))


def _lora_key(lora_request) -> tuple | None:
    """A LoRA adapter's identity (name, id); None for none."""
    return None if lora_request is None else (getattr(lora_request, "lora_name", None), lora_request.lora_int_id)


def tenant_of(config: SpecPrefillConfig, cache_salt: str | None = None, lora_request=None) -> str:
    """Who may share an earlier request's state: the same `cache_salt`, the same LoRA adapter (the base's cache
    holds that adapter's KV) and the same selection knobs (another keep rate selects anew)."""
    return repr((cache_salt, _lora_key(lora_request), sorted(config.to_dict().items())))


class Turns:
    """Multi-turn and shared-prefix reuse for a pair whose base caches prefixes (`core.turns`): the base requests
    it ran, per tenant, and per new request whether it may skip speculation. Shared by the offline and async
    engines. `max_new`: the most tokens a request may add to a prefix the base holds whole and still run whole."""

    def __init__(self, max_new: int) -> None:
        if max_new < 1:
            raise SpecPrefillError(f"min_new_tokens {max_new}: must be >= 1 (a count of new tokens)")
        self.max_new = max_new
        self.memory = core.TurnMemory()

    @classmethod
    def of(cls, base_vllm_config, max_new: int) -> Turns | None:
        """None when the base does not cache prefixes (nothing to reuse)."""
        cache = getattr(base_vllm_config, "cache_config", None)
        return cls(max_new) if getattr(cache, "enable_prefix_caching", False) else None

    def remember(
        self, ids: list[int], pruned: core.PrunedPrompt | None, generated, tenant: str, prompt_hashes=()
    ) -> core.Held | None:
        """A finished base request; one that ran whole leaves its prompt and answer whole in the base's cache."""
        kept = pruned.kept_indices if pruned is not None else None
        return self.memory.remember(ids, kept, list(generated), tenant, pruned is None, prompt_hashes)

    def remember_choices(
        self, ids: list[int], pruned: core.PrunedPrompt | None, answers: dict, tenant: str
    ) -> list[core.Held | None]:
        """Every choice of one finished request, in index order: the prompt converted and hashed once, each choice
        hashing only its answer (n choices of a long prompt cost one prompt, not n)."""
        prompt = np.asarray(ids, dtype=np.int32)
        hashes = block_hashes(prompt, tenant) if len(answers) > 1 else ()
        return [self.remember(prompt, pruned, answers[i], tenant, hashes) for i in sorted(answers)]


def extended(ids: list[int], reuse: core.Reuse, config: SpecPrefillConfig) -> core.PrunedPrompt | None:
    """The base's input for a request that runs on what the base holds, without speculation (None: the whole
    prompt)."""
    assert reuse.kept is not None
    return None if reuse.plain else core.prune(ids, reuse.kept.tolist(), config)


def base_request(
    token_ids: list[int],
    pruned: core.PrunedPrompt | None,
    config: SpecPrefillConfig,
    params,
    prompt: dict | None = None,
):
    """The base engine's prompt and sampling params for one request (pruned or whole). `prompt`: the request's own
    prompt dict (a vLLM TokensPrompt / engine input) to keep its other fields; default a plain TokensPrompt."""
    from vllm import TokensPrompt

    prompt = dict(prompt) if prompt is not None else TokensPrompt(prompt_token_ids=token_ids)
    if pruned is None:
        return prompt, params
    prompt["prompt_token_ids"] = pruned.token_ids
    prompt.pop("prompt_token_offsets", None)  # per-token offsets of the whole prompt
    if not config.restore_positions:  # contiguous positions: an ordinary prompt of the kept tokens
        return prompt, params
    params = params.clone()
    # the positions plugin tells cached KV blocks apart by these positions (`positions.position_key`)
    params.extra_args = {**(params.extra_args or {}), **positions_payload(pruned)}
    return prompt, params
