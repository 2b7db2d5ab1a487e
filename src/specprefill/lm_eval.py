"""lm-evaluation-harness backend: `python -m specprefill.lm_eval --model specprefill --model_args
pretrained=BASE,speculator=SPEC,keep_rate=0.1 --tasks ...` (any lm-eval flag works; lm-eval 0.4 has no plugin
discovery, so a plain `lm_eval --model specprefill` does not find it), or `lm_eval.simple_evaluate(model=
SpecPrefillLM(...))` / `SpecPrefillLM(llm=pair)` in Python.

`specprefill` is lm-eval's own vLLM backend (its request handling, chat templates, truncation) over a
`SpecPrefillLLM` built by the project's one engine builder. Model arguments, by field name: every `SpecPrefillConfig`
knob (`keep_rate`, `look_ahead`, ...), every `EngineParams` field (`speculator`, `max_model_len`, `kv_sequences`,
`speculator_tensor_parallel_size`, ...; `pretrained` is the base), lm-eval's own arguments of its vLLM backend
(`max_gen_toks`, `max_length`, `add_bos_token`, ...), and any other vLLM engine argument of the base. Registry names
(`qwen2.5-coder-1.5b`) and self:K work as `pretrained` / `speculator`.

- `generate_until` requests get SpecPrefill: the speculator scores each prompt, the base prefills the kept tokens at
  their original positions and generates.
- `loglikelihood` / `loglikelihood_rolling` requests run on the base with the whole prompt: scoring a continuation
  needs the logits of every position, and the paper prunes generation prompts only. Multiple-choice tasks therefore
  measure the base model, not SpecPrefill.
"""

from __future__ import annotations

import sys
from typing import TypeAlias

from specprefill import flags, vllm_dist
from specprefill.config import SELECTION_RULES, EngineParams, SpecPrefillConfig
from specprefill.errors import SpecPrefillError
from specprefill.models import resolve, resolve_speculator
from specprefill.selectors import Selection

try:  # lm-eval's vLLM module asks for the `vllm` distribution's version when imported
    vllm_dist.require_record()
except SpecPrefillError as exc:
    if __name__ != "__main__":
        raise
    sys.exit(f"specprefill.lm_eval: error: {exc}")

from lm_eval.api.model import TemplateLM  # noqa: E402
from lm_eval.api.registry import register_model  # noqa: E402
from lm_eval.models import vllm_causallms  # noqa: E402
from lm_eval.models.utils import configure_pad_token  # noqa: E402

VLLM: TypeAlias = vllm_causallms.VLLM
# lm-eval's own arguments of its vLLM backend, not engine arguments (a test checks them against its signature)
LM_ARGS = (
    "batch_size",
    "max_batch_size",
    "max_gen_toks",
    "max_length",
    "add_bos_token",
    "prefix_token_id",
    "enable_thinking",
    "chat_template_args",
    "think_end_token",
    "truncation_side",
)
UNSUPPORTED = {"lora_local_path": None, "data_parallel_size": 1, "max_lora_rank": 16}  # refused unless default


def split_model_args(
    kwargs: dict, knob_class: type = SpecPrefillConfig, param_class: type = EngineParams
) -> tuple[dict, dict, dict]:
    """lm-eval's model_args -> (SpecPrefill knobs, EngineParams fields, lm-eval's own arguments): by field name;
    any other key is a vLLM engine argument of the base (`engine_args`)."""
    kwargs = dict(kwargs)
    kwargs.pop("device", None)  # lm-eval passes it to every model; vLLM places itself
    for name, default in UNSUPPORTED.items():
        if kwargs.pop(name, default) not in (None, default):
            raise SpecPrefillError(
                f"the specprefill model does not support {name}: drop it from --model_args "
                "(or evaluate with --model vllm)"
            )
    if "pretrained" in kwargs:
        kwargs["base"] = kwargs.pop("pretrained")
    (knobs, params), rest = flags.split_kwargs(kwargs, knob_class, param_class)
    lm_args = {k: rest.pop(k) for k in list(rest) if k in LM_ARGS}
    params["engine_args"] = {**params.get("engine_args", {}), **rest}
    return knobs, params, lm_args


def check_models(params: dict) -> None:
    """The pair's two models are given and each resolves to a model (a registry name is materialized, as the
    engines would): what a user mistyped fails here, before lm-eval reads its task index."""
    if params.get("base") is None or params.get("speculator") is None:
        raise SpecPrefillError(
            "the specprefill model needs pretrained=BASE,speculator=SPECULATOR in "
            "--model_args (registry names, directories or hub ids)"
        )
    resolve(params["base"])
    resolve_speculator(params["speculator"], params["base"])


@register_model("specprefill")
class SpecPrefillLM(VLLM):
    def __init__(self, pretrained: str | None = None, speculator: str | None = None, llm=None, **kwargs) -> None:
        """Build the pair from the model arguments, or take `llm`, a pair already built (a notebook's): its
        SpecPrefill config is `llm.config`, which the caller may replace between evaluations."""
        knobs, params, lm_args = split_model_args({"pretrained": pretrained, "speculator": speculator, **kwargs})
        given = sorted(k for k, v in {**knobs, **params}.items() if v not in (None, {}))
        if llm is not None and given:
            raise SpecPrefillError(
                f"{', '.join(given)} would not reach a pair already built: pass them when building "
                "it, or leave out llm="
            )
        if llm is None:
            from specprefill.engines.vllm.pair import SpecPrefillLLM  # lazy: vLLM engines

            check_models(params)
            llm = SpecPrefillLLM.from_params(EngineParams(**params), knobs={**SELECTION_RULES["chunks"], **knobs})
        self._adopt(llm, **lm_args)

    def _adopt(
        self,
        llm,
        batch_size: str | int = "auto",
        max_batch_size=None,
        max_gen_toks: int = 256,
        max_length: int | None = None,
        add_bos_token: bool | None = None,
        prefix_token_id: int | None = None,
        enable_thinking: bool | None = None,
        chat_template_args: dict | None = None,
        think_end_token: str | None = None,
        truncation_side: str = "left",
    ) -> None:
        """The state lm-eval's vLLM backend reads, set from the pair (`LM_ARGS` as lm-eval documents them)."""
        TemplateLM.__init__(self)
        model_config = llm.llm_engine.model_config
        self.model, self._config = llm, model_config.hf_config
        self.tokenizer = configure_pad_token(llm.get_tokenizer(), model_config=self._config)
        self.batch_size = "auto" if isinstance(batch_size, str) and "auto" in batch_size else int(batch_size)
        self._max_length, self._max_gen_toks = max_length or llm.max_model_len, max_gen_toks
        self.add_bos_token, self.custom_prefix_token_id = add_bos_token, prefix_token_id
        self.chat_template_args = dict(chat_template_args or {})
        self.enable_thinking = self.chat_template_args.pop("enable_thinking", enable_thinking)
        self.think_end_token, self.truncation_side = think_end_token, truncation_side
        self.tensor_parallel_size, self.data_parallel_size = llm.params.tensor_parallel_size, 1
        self.lora_request, self.model_args = None, {"model": llm.base_path}
        self.hf_chat_template = vllm_causallms.resolve_hf_chat_template(
            tokenizer=self.tokenizer, chat_template=None, tools=None, model_config=model_config
        )

    # the method that chooses each prompt's kept tokens: SpecPrefill (or full prefill at keep rate 1) through the
    # pair's own path, or a baseline of `selectors.METHODS` at the pair's keep rate (`method_seed` for the random
    # ones); `lm_eval_quality` sets it per variant
    method: str = "specprefill"
    method_seed: int = 0

    def _model_generate(self, requests, generate=False, sampling_params=None):
        if generate and sampling_params is not None and self.method not in ("full", "specprefill"):
            config = self.model.config
            kept = Selection(self.model, [list(r) for r in requests]).kept(self.method, config, self.method_seed)
            return self.model.generate_kept(
                [list(r) for r in requests], kept, sampling_params, config.restore_positions, self.batch_size == "auto"
            )
        if generate and sampling_params is not None:
            from vllm import TokensPrompt

            return self.model.generate(
                [TokensPrompt(prompt_token_ids=r) for r in requests],
                sampling_params,
                use_tqdm=self.batch_size == "auto",
            )
        pair, self.model = self.model, self.model.llm  # log-likelihoods: the base on whole prompts
        try:
            return super()._model_generate(requests, generate, sampling_params)
        finally:
            self.model = pair


def main() -> None:
    """lm-eval's command line; errors a user causes in the specprefill model (model names, arguments) are one line."""
    from lm_eval._cli import HarnessCLI
    from lm_eval.utils import setup_logging

    try:
        setup_logging()  # what lm-eval's own entry point does, with the model checked before the tasks are read
        parser = HarnessCLI()
        args = parser.parse_args()
        if getattr(args, "command", None) == "run" and getattr(args, "model", None) == "specprefill":
            check_models(split_model_args(args.model_args or {})[1])
        parser.execute(args)
    except SpecPrefillError as exc:
        print(f"specprefill.lm_eval: error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
