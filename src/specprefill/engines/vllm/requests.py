"""What the offline (`speculator`, `pair`) and async (`async_engine`) vLLM engines share: the speculator's engine
arguments and checks, each speculated request's params and importance, and the base's request for a pruned prompt.
"""

from __future__ import annotations

import hashlib

from specprefill import core
from specprefill.config import SpecPrefillConfig
from specprefill.engines.common import eos_ids_of
from specprefill.engines.vllm import capture, positions
from specprefill.errors import SpecPrefillError

DEFAULT_MAX_SPECULATION_TOKENS = 32768


def speculator_engine_kwargs(engine_kwargs: dict) -> dict:
    """The speculator's engine arguments: eager (the hooks run in eager mode), no prefix caching (every prompt token
    must pass the hooks), the capture extension in every worker."""
    kwargs = {
        "enforce_eager": True,
        **engine_kwargs,
        "enable_prefix_caching": False,
        "worker_extension_cls": capture.EXTENSION,
    }
    if not kwargs["enforce_eager"]:
        raise SpecPrefillError("the speculator needs enforce_eager=True (its attention hooks run in eager mode)")
    if kwargs.get("pipeline_parallel_size", 1) > 1:
        raise SpecPrefillError(
            "the speculator cannot run pipeline parallel (each stage would score only its "
            "layers): use speculator tensor_parallel_size instead"
        )
    return kwargs


def check_installed(hooked_per_rank: list[int], model: str, model_config) -> None:
    if min(hooked_per_rank) == 0:
        raise SpecPrefillError(
            f"speculator {model!r} ({getattr(model_config.hf_config, 'architectures', None)}) has no vLLM "
            "Attention layers to hook: use a decoder model whose layers call vllm's Attention (e.g. Llama, Qwen2, "
            "Mistral, Gemma)"
        )


def model_eos_ids(tokenizer, model_config) -> set[int]:
    generation = model_config.try_get_generation_config() or {}
    return eos_ids_of(tokenizer, generation.get("eos_token_id"))


def check_look_ahead(n_prompt: int, config: SpecPrefillConfig, max_model_len: int) -> None:
    if n_prompt + config.look_ahead > max_model_len:
        raise SpecPrefillError(
            f"prompt of {n_prompt} tokens + {config.look_ahead} look-ahead tokens exceeds the speculator's "
            f"max_model_len {max_model_len}: raise max_model_len (for the speculator alone: speculator_kwargs / "
            "--speculator-engine-arg max_model_len=N) or shorten the prompt"
        )


def capture_payload(uid: str, n_prompt: int, config: SpecPrefillConfig) -> dict:
    return {
        "uid": uid,
        "n": n_prompt,
        "steps": config.look_ahead,
        "pool": config.pool_kernel,
        "agg": config.layer_head_agg,
    }


def speculation_params(uid: str, n_prompt: int, config: SpecPrefillConfig, eos_ids):
    """Greedy look-ahead of up to N-1 tokens after the prompt (EOS ends it), tagged for the workers' capture."""
    from vllm import SamplingParams

    return SamplingParams(
        max_tokens=config.look_ahead,
        temperature=0.0,
        stop_token_ids=sorted(eos_ids),
        ignore_eos=False,
        detokenize=False,
        extra_args={positions.CAPTURE_KEY: capture_payload(uid, n_prompt, config)},
    )


def combine_ranks(parts: list) -> core.StepScores:
    """Per-rank scores of one request (each rank saw its own heads) -> one StepScores."""
    seen = [core.StepScores.from_wire(p) for p in parts if p is not None]
    if not seen:
        raise SpecPrefillError(
            "the speculator's workers captured nothing for a request: its attention layers did "
            "not run through the hooks (run the speculator with enforce_eager=True)"
        )
    out = seen[0]
    for p in seen[1:]:
        out = out.merge(p)
    return out


def look_ahead_steps(n_generated: int, look_ahead: int) -> int:
    """Queries that count: the last prompt token's, then one per generated token that was fed back (EOS ends it).
    A step a scheduler runs after the request already finished (async scheduling) is not counted."""
    return max(1, min(look_ahead, n_generated))


def importance_from_scores(config: SpecPrefillConfig, n_generated: int, per_rank: list):
    """One speculated request's per-rank scores -> importance of its (speculator) prompt tokens."""
    return combine_ranks(per_rank).importance(look_ahead_steps(n_generated, config.look_ahead), config.step_agg)


def positions_payload(pruned: core.PrunedPrompt) -> dict:
    return {positions.POSITIONS_KEY: {"kept": pruned.kept_indices, "n": pruned.n_original}}


def cache_salt(pruned: core.PrunedPrompt) -> str:
    """Prefix-cache salt: KV blocks are only shared between prompts pruned to the same position map."""
    return "specprefill-" + hashlib.sha256(str(pruned.kept_indices + [pruned.n_original]).encode()).hexdigest()[:32]


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
    params.extra_args = {**(params.extra_args or {}), **positions_payload(pruned)}
    # keeps prefix caching from sharing KV computed under other positions (a client's own salt stays part of it)
    prompt["cache_salt"] = "|".join(filter(None, [prompt.get("cache_salt"), cache_salt(pruned)]))
    return prompt, params
