"""How much one speculator engine may take on: prompt tokens speculation may hold at once (`fit_budget`, from each
rank's free memory) and the refusal of a prompt beyond it or beyond the look-ahead's room. Shared by the offline and
async engines."""

from __future__ import annotations

from specprefill import core
from specprefill.config import SpecPrefillConfig
from specprefill.engines.vllm import capture
from specprefill.errors import SpecPrefillError
from specprefill.models.registry import speculators_for


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


class PastWindow(SpecPrefillError):
    """A prompt longer than the speculator's own window: refused everywhere (the server answers 400), since no
    setting of this speculator can read it."""


def model_window(model_config) -> int | None:
    """The longest context the model's own config allows, as vLLM derives it (its position limit, rope scaling
    applied, `vllm.config.model._get_and_verify_max_len`); past it, raising max_model_len cannot help. Where that
    function cannot read the config: its stated `max_position_embeddings`, else None (the refusal then names
    max_model_len alone)."""
    try:
        from vllm.config.model import _get_and_verify_max_len  # lazy: vLLM; a private function, guarded below

        config, arch = model_config.hf_config, model_config.model_arch_config
        return int(_get_and_verify_max_len(config, arch, None, None, False, None))
    except (ImportError, AttributeError, TypeError, ValueError, KeyError):
        limit = getattr(getattr(model_config, "hf_text_config", None), "max_position_embeddings", None)
        return int(limit) if isinstance(limit, int) else None


def check_look_ahead(n_prompt: int, config: SpecPrefillConfig, max_model_len: int, context: int | None = None) -> None:
    """Refuse a prompt whose look-ahead runs past the speculator's max_model_len; when it is past the speculator's own
    context (`context`, its position limit) too, the message names speculators whose window holds it."""
    need = n_prompt + config.look_ahead
    if need <= max_model_len:
        return
    if context is not None and need > context:
        raise PastWindow(
            f"a prompt of {n_prompt} tokens + {config.look_ahead} look-ahead tokens is longer than the speculator's "
            f"window ({context} positions): pick a speculator that reads {need} tokens: {speculators_for(need)}"
        )
    raise SpecPrefillError(
        f"prompt of {n_prompt} tokens + {config.look_ahead} look-ahead tokens exceeds the speculator's "
        f"max_model_len {max_model_len}: raise max_model_len (for the speculator alone: speculator_kwargs / "
        "--speculator-engine-arg max_model_len=N) or shorten the prompt"
    )
