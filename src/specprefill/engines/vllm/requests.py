"""What the offline (`speculator`, `pair`) and async (`async_engine`) vLLM engines share: the speculator's engine
arguments and checks, each speculated request's params and importance, and the base's request for a pruned prompt.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specprefill import core, tokenmap
from specprefill.config import SpecPrefillConfig, parse_score_heads
from specprefill.engines.common import eos_ids_of
from specprefill.engines.vllm import capture, positions
from specprefill.errors import SpecPrefillError
from specprefill.models.self_speculation import carried_heads


def speculator_refusal(kwargs: dict) -> str | None:
    """Why a speculator with these engine arguments (or this engine config: `engine_refusal`) would score the wrong
    rows, or None."""
    if (kwargs.get("pipeline_parallel_size") or 1) > 1:
        return "pipeline parallel (each stage would score only its layers): use speculator tensor_parallel_size"
    if (kwargs.get("data_parallel_size") or 1) > 1:
        return "data parallel (each replica's workers would hold only their own requests' scores): use one replica"
    if kwargs.get("enable_dbo") or (kwargs.get("ubatch_size") or 1) > 1:
        return "dual-batch overlap / micro-batching (the hooks would see each micro-batch with the whole step's rows)"
    if kwargs.get("speculative_config"):
        return "speculative decoding (draft rows would be scored as look-ahead steps)"
    if (kwargs.get("prefill_context_parallel_size") or 1) > 1:
        return PCP_REFUSAL
    return None


# vLLM 0.32 (read, not run): with prefill context parallel each rank prefills its own segments of a prompt's tokens
# (`v1/worker/gpu/pcp_manager.py`) and samples from a gathered batch with positions of its own, while the capture
# hooks and the position rewrite take a request's rows as one contiguous run from its first cache position
PCP_REFUSAL = "prefill context parallel (each rank holds token segments, not the contiguous rows the hooks assume)"


def base_refusal(kwargs: dict) -> str | None:
    if kwargs.get("speculative_config"):
        return "speculative decoding (its drafts' positions would not follow the rewritten ones)"
    if (kwargs.get("prefill_context_parallel_size") or 1) > 1:
        return PCP_REFUSAL
    return None


def _refuse(who: str, reason: str | None) -> None:
    if reason is not None:
        raise SpecPrefillError(f"the {who} cannot run with {reason}: remove that engine argument")


def speculator_engine_kwargs(engine_kwargs: dict) -> dict:
    """The speculator's engine arguments: eager (the hooks run in eager mode), no prefix caching (every prompt token
    must pass the hooks), the capture extension in every worker. Modes whose rows the hooks would misread are
    refused (`speculator_refusal`)."""
    kwargs = {
        "enforce_eager": True,
        **engine_kwargs,
        "enable_prefix_caching": False,
        "worker_extension_cls": capture.EXTENSION,
    }
    if not kwargs["enforce_eager"]:
        raise SpecPrefillError("the speculator needs enforce_eager=True (its attention hooks run in eager mode)")
    _refuse("speculator", speculator_refusal(kwargs))
    return kwargs


def check_base_kwargs(kwargs: dict) -> None:
    _refuse("base", base_refusal(kwargs))


def engine_kwargs_of(vllm_config) -> dict:
    """The refusal-relevant engine arguments of a started engine (its config may come from flags or defaults)."""
    parallel = vllm_config.parallel_config
    return {
        "pipeline_parallel_size": parallel.pipeline_parallel_size,
        "data_parallel_size": parallel.data_parallel_size,
        "enable_dbo": getattr(parallel, "enable_dbo", False),
        "ubatch_size": getattr(parallel, "ubatch_size", 1),
        "speculative_config": vllm_config.speculative_config,
        "prefill_context_parallel_size": getattr(parallel, "prefill_context_parallel_size", 1),
    }


def check_started(who: str, vllm_config, model_refusals: list) -> None:
    """After an engine started: its actual config and its workers' attention (`capture.model_refusal`)."""
    kwargs = engine_kwargs_of(vllm_config)
    _refuse(who, speculator_refusal(kwargs) if who == "speculator" else base_refusal(kwargs))
    reason = next((r for r in model_refusals if r), None)
    if reason is None and who == "base":
        reason = positions.unsupported_base(vllm_config)
    if reason is not None:
        raise SpecPrefillError(
            f"the {who} model {vllm_config.model_config.model!r} cannot be used: {reason}; pick another model"
        )


def check_installed(installed: list[dict], model: str, model_config) -> None:
    """The speculator's workers after `specprefill_install` (one dict per rank)."""
    reason = next((i["refusal"] for i in installed if i["refusal"]), None)
    if reason is not None:
        raise SpecPrefillError(f"speculator {model!r} cannot be used: {reason}; pick another speculator")
    if min(i["layers"] for i in installed) == 0:
        raise SpecPrefillError(
            f"speculator {model!r} ({getattr(model_config.hf_config, 'architectures', None)}) has no vLLM "
            "Attention layers to hook: use a decoder model whose layers call vllm's Attention (e.g. Llama, Qwen2, "
            "Mistral, Gemma)"
        )


def fit_budget(reports: list[dict], max_model_len: int, look_ahead: int = 8) -> int:
    """Prompt tokens speculation may hold at once, from each rank's `specprefill_memory` report taken after both
    engines are profiled: `capture.FREE_MEMORY_SHARE` of the free memory, less the temporaries of scoring one
    max_model_len prompt, over what one held token costs (keys of every layer + its N fp32 scores). At least one
    prompt's worth: a longer prompt is refused (`check_fits_memory`)."""
    budgets = []
    for r in reports:
        temporaries = core.score_temporaries(r["heads"], r["kv_heads"], look_ahead, max_model_len, r["head_size"], 13)
        usable = capture.FREE_MEMORY_SHARE * r["free"] - temporaries
        budgets.append(int(usable // (r["per_token"] + 4 * look_ahead)))
    return max(1, min(budgets))


def check_fits_memory(n_prompt: int, budget: int, from_memory: bool) -> None:
    """A prompt whose captured keys alone exceed what the speculator's free memory holds (`fit_budget`) is refused
    before it runs: out of memory inside a worker's forward ends vLLM's engine core, and every later request with
    it. A budget the user set (`max_speculation_tokens`) only groups prompts: a longer one runs alone."""
    if from_memory and n_prompt > budget:
        raise SpecPrefillError(
            f"a prompt of {n_prompt} speculator tokens needs more memory for its captured keys than the speculator "
            f"has free (room for {budget} tokens): shorten the prompt, give the speculator more memory (a larger "
            "memory share, more tensor-parallel ranks) or pick a smaller speculator"
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


def raw_scores(per_rank: list, n_generated: int, look_ahead: int) -> torch.Tensor:
    """One request's unreduced weights from every rank -> [L, H, N, M] fp32 on the CPU: ranks hold consecutive query
    heads (tensor parallel splits them in rank order), steps past the generated ones are cut."""
    parts = [p for p in per_rank if p is not None]
    if not parts:
        raise SpecPrefillError(
            "the workers captured nothing for a request: its attention layers did not run through the hooks "
            "(run the engine with enforce_eager=True)"
        )
    steps = look_ahead_steps(n_generated, look_ahead)
    for p in parts:
        missing = [i for i, row in enumerate(p.get("done") or []) if not all(row[:steps])]
        if missing:
            raise SpecPrefillError(
                f"the workers captured no attention for layer(s) {missing[:5]} of this model (layers that reuse "
                "another layer's KV cache are not hooked): score it with engine hf"
            )
    tensors = [torch.frombuffer(bytearray(p["raw"]), dtype=torch.float32).reshape(p["shape"]) for p in parts]
    return torch.cat(tensors, dim=1)[:, :, :steps]


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


def runs_whole(n_prompt: int, keep_rate: float, min_prompt_tokens: int, params) -> bool:
    """The one rule for a prompt the base gets whole: empty, shorter than `min_prompt_tokens`, keep rate 1, or asking
    for prompt log-probs (those are per prompt token: echo with logprobs, lm-eval's loglikelihood)."""
    return n_prompt == 0 or n_prompt < min_prompt_tokens or keep_rate >= 1 or params.prompt_logprobs is not None


def positions_payload(pruned: core.PrunedPrompt) -> dict:
    return {positions.POSITIONS_KEY: {"kept": pruned.kept_indices, "n": pruned.n_original}}


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
    # the positions plugin's front end salts the prefix cache with this map (`positions.salt`)
    params.extra_args = {**(params.extra_args or {}), **positions_payload(pruned)}
    return prompt, params
