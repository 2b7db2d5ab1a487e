"""Prompt compression with a SpecPrefill speculator: the kept text and indices, for users of LLMLingua-style
`compress_prompt` or kvpress who send the result elsewhere (another server, an API) instead of to a base model here.

    from specprefill import prune
    short = prune(long_text, keep_rate=0.2, speculator="qwen2.5-coder-0.5b")
    short.text, short.kept_indices, short.importance

`Pruner` keeps the speculator loaded for many texts. Unlike SpecPrefill proper, the kept tokens lose their original
positions once they are text: a model reading `text` sees them contiguous (the paper's "without position
restoration" setting, `restore_positions=False`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from specprefill.config import SELECTION_RULES, SERVING_RULE, EngineParams, SpecPrefillConfig
from specprefill.errors import SpecPrefillError

ENGINES = ("vllm", "hf")


@dataclass
class PrunedText:
    text: str  # the kept tokens decoded in prompt order
    kept_indices: list[int]  # into `token_ids`
    token_ids: list[int]  # the whole text's tokens (the base's tokenizer when a base is named, else the speculator's)
    importance: list[float] = field(repr=False)  # one score per token of `token_ids`
    rule: str = "chunks"  # the selection rule that kept them (`SpecPrefillConfig.rule`)

    @property
    def keep_rate(self) -> float:
        return len(self.kept_indices) / max(1, len(self.token_ids))


class Pruner:
    """A speculator loaded once (`engine` vllm, or hf: the transformers reference) that prunes texts.

    `base`: the model the text is for, when its tokenizer differs (importance is projected onto its tokens) or for
    `self:K`; only its tokenizer is loaded (its config too, for self:K). `engine_kwargs`: the speculator's
    `EngineParams` fields (e.g. `max_model_len`, `dtype`). `config`: the knobs (`keep_rate` is overridden per call
    when given)."""

    def __init__(
        self,
        speculator: str,
        base: str | None = None,
        config: SpecPrefillConfig | None = None,
        engine: str = "vllm",
        **engine_kwargs: Any,
    ) -> None:
        from specprefill import hardware, models  # lazy: torch, transformers

        if engine not in ENGINES:
            raise SpecPrefillError(f"engine {engine!r}: use one of {', '.join(ENGINES)}")
        spec_path = models.resolve_speculator(speculator, base)
        base_path = models.resolve(base) if base is not None else None
        # the library's default selection, as `SpecPrefillLLM` and the CLI (config.SERVING_RULE); pass
        # SpecPrefillConfig() for the original's chunks
        self.config = config or SpecPrefillConfig(
            look_ahead=models.default_look_ahead(spec_path), **SELECTION_RULES[SERVING_RULE]
        )
        self._speculator: Any  # a VLLMSpeculator or an HFEngine: both `speculate(prompts, configs)`
        if engine == "vllm":
            from specprefill.engines.vllm import builder  # lazy: vLLM

            params = EngineParams(speculator=speculator, base=base, kv_sequences=1, **engine_kwargs)
            self._speculator = builder.build_speculator(params)
            self.tokenizer = self._speculator.tokenizer  # the base's when it has its own
            self._close = lambda: builder.shutdown_llm(self._speculator.llm)
        else:
            from specprefill.engines.common import load_tokenizer  # lazy: torch
            from specprefill.engines.hf import HFEngine  # lazy: transformers

            dtype = hardware.torch_dtype(hardware.resolve_dtype(engine_kwargs.pop("dtype", "auto")))
            if engine_kwargs:
                raise SpecPrefillError(f"engine hf takes no engine arguments but dtype (got {sorted(engine_kwargs)})")
            hf = HFEngine(spec_path, None, self.config, dtype)
            if base_path is not None and base_path != spec_path:  # scores projected onto the base's tokens
                from specprefill import tokenmap  # lazy: torch

                hf.tokenizer = load_tokenizer(base_path)
                hf.pair = tokenmap.Pair(hf.spec_tokenizer, hf.tokenizer)
            self._speculator, self.tokenizer = hf, hf.tokenizer
            self._close = lambda: None

    def __call__(
        self, text: str, keep_rate: float | None = None, config: SpecPrefillConfig | None = None
    ) -> PrunedText:
        from specprefill.engines.common import require_text, tokenize_prompt  # lazy: torch

        config = config or self.config
        if keep_rate is not None:
            config = config.replace(keep_rate=keep_rate)
        require_text(text)
        ids = tokenize_prompt(self.tokenizer, text, chat=False)
        pruned = self._speculator.speculate([ids], [config])[0]
        kept = list(pruned.kept_indices)
        return PrunedText(
            text=self.tokenizer.decode([ids[i] for i in kept], skip_special_tokens=True),
            kept_indices=kept,
            token_ids=ids,
            importance=[float(x) for x in pruned.importance],
            rule=config.rule,
        )

    def close(self) -> None:
        """Stop the engine (vLLM: its engine core)."""
        self._close()

    def __enter__(self) -> Pruner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def prune(
    text: str,
    keep_rate: float | None = None,
    speculator: str = "qwen2.5-coder-0.5b",
    base: str | None = None,
    config: SpecPrefillConfig | None = None,
    engine: str = "vllm",
    **engine_kwargs: Any,
) -> PrunedText:
    """One text pruned to `keep_rate` (default: `config`'s, else 0.1) by `speculator` (a `Pruner` started and
    stopped for it: for many texts, keep a `Pruner`), with the library's default selection (`SERVING_RULE`) unless
    `config` names another; `.rule` says which ran."""
    with Pruner(speculator, base, config, engine, **engine_kwargs) as pruner:
        return pruner(text, keep_rate)
