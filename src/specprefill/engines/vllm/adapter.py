"""`VLLMEngine`: the vLLM engines behind `common.Engine` (the CLI's engine, as `hf.HFEngine` is)."""

from __future__ import annotations

import time
from collections.abc import Sequence

from specprefill import core
from specprefill.config import EngineParams, SpecPrefillConfig
from specprefill.engines.common import GenerationResult, SamplingConfig
from specprefill.engines.vllm import builder
from specprefill.engines.vllm.pair import SpecPrefillLLM
from specprefill.engines.vllm.speculator import VLLMSpeculator


class VLLMEngine:
    """A SpecPrefillLLM, or a speculator alone (importance only), as a `common.Engine`."""

    def __init__(
        self, config: SpecPrefillConfig, llm: SpecPrefillLLM | None = None, speculator: VLLMSpeculator | None = None
    ) -> None:
        self.config, self.llm = config, llm
        spec = llm.speculator if llm is not None else speculator
        assert spec is not None, "give llm or speculator"
        self.spec: VLLMSpeculator = spec
        self.tokenizer = llm.tokenizer if llm is not None else self.spec.tokenizer  # prompts are in base tokens
        self.last_timings: dict = {}

    @classmethod
    def from_params(cls, params: EngineParams, config: SpecPrefillConfig) -> VLLMEngine:
        """The pair `params` name, or the speculator alone when they name no base."""
        if params.base is None:
            return cls(config, speculator=builder.build_speculator(params))
        return cls(config, llm=SpecPrefillLLM.from_params(params, config))

    def speculate(self, prompts: Sequence[list[int]], configs: Sequence[SpecPrefillConfig]) -> list[core.PrunedPrompt]:
        """`Engine.speculate`; `last_timings`: the speculator's parts and `speculation_s`, the whole call."""
        t0 = time.perf_counter()
        pruned = self.spec.speculate(prompts, configs)
        self.last_timings = {**self.spec.last_timings, "speculation_s": time.perf_counter() - t0}
        return pruned

    def answer_fits(
        self,
        prompts: Sequence[list[int]],
        answers: Sequence[list[int]],
        kept: Sequence[list[int] | None],
        restore_positions: bool = True,
    ) -> list[core.AnswerFit]:
        """`Engine.answer_fits` (`SpecPrefillLLM.answer_fits`)."""
        if self.llm is None:
            raise ValueError("this engine was built without a base model")
        return self.llm.answer_fits(list(prompts), list(answers), list(kept), restore_positions)

    def generate(
        self,
        prompts: list[list[int]],
        max_tokens: int = 32,
        sampling: SamplingConfig | None = None,
        configs: list[SpecPrefillConfig] | None = None,
    ) -> list[GenerationResult]:
        from vllm import SamplingParams

        if self.llm is None:
            raise ValueError("this engine was built without a base model")
        sampling = sampling or SamplingConfig()
        params = SamplingParams(
            max_tokens=max_tokens, temperature=sampling.temperature, top_p=sampling.top_p, seed=sampling.seed
        )
        results: list[GenerationResult] = []
        for out in self.llm.generate(
            [{"prompt_token_ids": p} for p in prompts], params, config=configs, use_tqdm=False
        ):
            record, tokens = out.specprefill, list(out.outputs[0].token_ids)
            t = record.timings
            results.append(
                GenerationResult.build(
                    self.tokenizer,
                    out.prompt_token_ids,
                    record.kept_indices if record.kept_indices is not None else list(range(record.n_prompt_tokens)),
                    record.importance or [],
                    tokens,
                    configs[len(results)] if configs else self.config,
                    t["speculation_s"],
                    t["base_ttft_s"],
                    t["total_s"],
                )
            )
        return results
