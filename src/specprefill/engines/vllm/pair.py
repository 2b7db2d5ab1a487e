"""SpecPrefill on vLLM, offline: `SpecPrefillLLM`, a speculator `LLM` (`speculator.VLLMSpeculator`) and a base `LLM`
whose runner (patched by the `positions` plugin) gives kept tokens their original position ids, both built by
`builder` from one `EngineParams`. Both may run in any vLLM mode: multiprocess, tensor parallel, in-process.
"""

from __future__ import annotations

import time
from typing import Any

from specprefill import core, tokenmap
from specprefill.config import SELECTION_RULES, SERVING_RULE, EngineParams, SpecPrefillConfig
from specprefill.engines.common import require_chat_template, require_tokens
from specprefill.engines.vllm import builder, request
from specprefill.engines.vllm.payloads import Turns, base_request, salted, speculator_salt
from specprefill.errors import SpecPrefillError
from specprefill.models import default_look_ahead


def params_of(model: str, speculator: str, engine_kwargs: dict, speculator_kwargs: dict, **pair) -> EngineParams:
    """`EngineParams` from `vllm.LLM`-style keyword arguments: those named like a field go to it (the speculator's
    with the `speculator_` prefix), any other engine argument to `engine_args` / `speculator_engine_args`."""
    fields = set(EngineParams.names())
    named = {k: v for k, v in engine_kwargs.items() if k in fields and k not in ("speculator", "base")}
    named.update({f"speculator_{k}": v for k, v in speculator_kwargs.items() if f"speculator_{k}" in fields})
    return EngineParams(
        speculator=speculator,
        base=model,
        **named,
        **pair,
        engine_args={k: v for k, v in engine_kwargs.items() if k not in fields},
        speculator_engine_args={k: v for k, v in speculator_kwargs.items() if f"speculator_{k}" not in fields},
    )


def _with_max_tokens(params, max_tokens: int):
    params = params.clone()
    params.max_tokens = max(1, max_tokens)
    return params


def greedy(max_tokens: int):
    """vLLM's greedy `SamplingParams` for `max_tokens` new tokens (vLLM is imported here, when an engine runs)."""
    from vllm import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0)


class SpecPrefillLLM:
    """Drop-in for `vllm.LLM` generation with Speculative Prefill.

    `model` is the base; `speculator` the small model (registry name, directory, hub id or self:K): same tokenizer,
    or another (its importance reaches base tokens through character spans, `tokenmap`). Engine arguments go to the
    base; those in `planning.SHARED_ENGINE_ARGS` (dtype, max_model_len, seed, ...) go to both; `speculator_kwargs`
    only to the speculator (e.g. tensor_parallel_size=2). Arguments left out take `EngineParams`' defaults (eager on
    CPU, prefix caching off; `enable_prefix_caching=True` turns it on for both engines, and a request that extends an
    earlier one — a later turn of a conversation — reuses both caches: `core.turns`, `min_new_tokens`). `dtype`
    defaults to "auto" = `hardware.auto_dtype()` (bf16 only where the CPU has it
    natively). Memory left open is sized by `sizing.plan` so both engines start side by side; `kv_sequences` is how
    many `max_model_len` sequences each CPU engine's KV cache holds. Each `RequestOutput` gains `.specprefill`
    (a `request.Record`).
    """

    def __init__(
        self,
        model: str,
        speculator: str,
        config: SpecPrefillConfig | None = None,
        *,
        min_prompt_tokens: int = 0,
        speculator_kwargs: dict | None = None,
        max_speculation_tokens: int | None = None,
        kv_sequences: int = EngineParams.kv_sequences,
        **engine_kwargs: Any,
    ) -> None:
        self._start(
            params_of(
                model,
                speculator,
                engine_kwargs,
                speculator_kwargs or {},
                kv_sequences=kv_sequences,
                min_prompt_tokens=min_prompt_tokens,
                max_speculation_tokens=max_speculation_tokens,
            ),
            config,
        )

    @classmethod
    def from_params(
        cls, params: EngineParams, config: SpecPrefillConfig | None = None, knobs: dict | None = None
    ) -> SpecPrefillLLM:
        """The pair `params` describe (the CLI, notebooks, benchmarks and lm-eval build it this way). `knobs`: config
        fields to set when no `config` is given (the others take their defaults)."""
        llm = cls.__new__(cls)
        llm._start(params, config, knobs)
        return llm

    def _start(self, params: EngineParams, config: SpecPrefillConfig | None, knobs: dict | None = None) -> None:
        plan, self.llm, self.speculator = builder.start_pair(params)
        self.plan = plan  # models and both engines' arguments as built (result keys record them)
        # decided on the resolved speculator: a self-speculator looks ahead 1 token unless the config says otherwise
        self.config = config or SpecPrefillConfig(
            **{"look_ahead": default_look_ahead(plan.speculator), **SELECTION_RULES[SERVING_RULE], **(knobs or {})}
        )
        self.params, self.min_prompt_tokens = params, params.min_prompt_tokens
        self.base_path, self.speculator_path = plan.base, plan.speculator
        self.dtype = plan.base_kwargs["dtype"]
        self.tokenizer = self.llm.get_tokenizer()
        self.max_model_len = self.llm.llm_engine.model_config.max_model_len
        # with the base's prefix caching only
        self.turns = Turns.of(getattr(self.llm.llm_engine, "vllm_config", None), params.min_new_tokens)

    def get_tokenizer(self):
        return self.tokenizer

    def shutdown(self) -> None:
        """Stop both engines (their engine-core processes), e.g. before building the next pair in a notebook."""
        for llm in (self.speculator.llm, self.llm):
            builder.shutdown_llm(llm)

    @property
    def llm_engine(self):
        """The base's engine, as on `vllm.LLM` (its model config, stats)."""
        return self.llm.llm_engine

    def _token_ids(self, prompt, tokenization_kwargs: dict | None = None) -> list[int]:
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            return list(prompt["prompt_token_ids"])
        text = prompt["prompt"] if isinstance(prompt, dict) and "prompt" in prompt else prompt
        if isinstance(text, str):
            return list(self.tokenizer(text, **(tokenization_kwargs or {}))["input_ids"])
        raise SpecPrefillError(f"unsupported prompt type {type(prompt).__name__}: pass a string or a TokensPrompt dict")

    def _configs(self, n: int, keep_rate, config) -> list[SpecPrefillConfig]:
        """One config per prompt: `config` (one or a list; default self.config), its keep rate replaced by
        `keep_rate` (one or a list) when given."""
        configs = list(config) if isinstance(config, (list, tuple)) else [config or self.config] * n
        if len(configs) != n:
            raise SpecPrefillError(f"{len(configs)} configs for {n} prompts: pass one per prompt or a single config")
        if keep_rate is None:
            return configs
        rates = list(keep_rate) if isinstance(keep_rate, (list, tuple)) else [keep_rate] * n
        if len(rates) != n:
            raise SpecPrefillError(f"{len(rates)} keep rates for {n} prompts: pass one per prompt or a single float")
        return [c.replace(keep_rate=r) for c, r in zip(configs, rates)]

    def generate(
        self,
        prompts,
        sampling_params=None,
        *,
        use_tqdm=True,
        lora_request=None,
        priority=None,
        tokenization_kwargs: dict | None = None,
        mm_processor_kwargs: dict | None = None,
        keep_rate=None,
        config=None,
        _maps=None,
    ):
        """`vllm.LLM.generate` with SpecPrefill: the same arguments, plus `keep_rate` (one or one per prompt) and
        `config` (one `SpecPrefillConfig` or one per prompt). `lora_request` and `priority` go to the base (the
        speculator scores the prompt without the adapter); multimodal inputs are refused."""
        if mm_processor_kwargs is not None:
            raise SpecPrefillError("mm_processor_kwargs: SpecPrefill prunes text prompts only; use vllm.LLM for these")
        single = isinstance(prompts, (str, dict))
        prompts = [prompts] if single else list(prompts)
        ids = [self._token_ids(p, tokenization_kwargs) for p in prompts]
        require_tokens(ids)
        configs = self._configs(len(ids), keep_rate, config)
        params = self._sampling_params(ids, sampling_params)
        salts = [p.get("cache_salt") if isinstance(p, dict) else None for p in prompts]
        plans = [
            request.plan(t, c, p, self.min_prompt_tokens, self.turns, salt, lora_request)
            for t, c, p, salt in zip(ids, configs, params, salts)
        ]
        todo = [i for i, plan in enumerate(plans) if plan.speculate]
        t0 = time.perf_counter()
        maps = None if _maps is None else [_maps[i] for i in todo]
        pruned = {i: plan.pruned for i, plan in enumerate(plans)}
        pruned.update(
            zip(todo, self.speculator.speculate([ids[i] for i in todo], [configs[i] for i in todo], maps,
                                                [speculator_salt(salts[i], lora_request) for i in todo]))
        )  # fmt: skip
        pruned.update({i: plans[i].selected(ids[i], pruned[i], configs[i]) for i in todo})
        spec_s = time.perf_counter() - t0
        t1 = time.perf_counter()
        outputs = self._base_generate(
            ids, [pruned[i] for i in range(len(ids))], configs, params, use_tqdm, lora_request, priority, salts
        )
        base_s = time.perf_counter() - t1
        prefilled = dict(zip(todo, self.speculator.last_prefilled))
        for i, out in enumerate(outputs):
            out.specprefill = self._record(ids[i], pruned[i], plans[i], configs[i], out, spec_s, base_s)
            out.specprefill.speculator_prefilled_tokens = prefilled.get(i, 0)
            if self.turns is not None:
                answers = {c.index: list(c.token_ids) for c in out.outputs}  # a later turn may follow any of them
                self.turns.remember_choices(ids[i], pruned[i], answers, plans[i].tenant)
        return outputs

    @staticmethod
    def _record(ids: list[int], pruned, plan: request.Plan, config, out, spec_s: float, base_s: float):
        """What one finished request reports (`RequestOutput.specprefill`, a `request.Record`)."""
        spec_s = spec_s if plan.speculate else 0.0
        record = request.Record.of(ids, plan, config.keep_rate).kept(pruned, config.keep_rate, plan.speculate)
        record.timings = {
            "speculation_s": spec_s,
            "base_ttft_s": out.metrics.first_token_latency if out.metrics is not None else None,
            "base_s": base_s,
            "total_s": spec_s + base_s,
        }
        record.base_cached_tokens = out.num_cached_tokens
        return record

    def _sampling_params(self, ids: list[list[int]], sampling_params) -> list:
        """One `SamplingParams` per prompt, max_tokens counted from the original length M (decode positions continue
        from M, not from the kept K): None takes what is left of max_model_len, more is refused."""
        from vllm import SamplingParams

        params = sampling_params if isinstance(sampling_params, (list, tuple)) else [sampling_params] * len(ids)
        params = [p if p is not None else SamplingParams() for p in params]
        params = [
            p if p.max_tokens is not None else _with_max_tokens(p, self.max_model_len - len(t))
            for t, p in zip(ids, params)
        ]
        for t, p in zip(ids, params):
            if len(t) + p.max_tokens > self.max_model_len:
                raise SpecPrefillError(
                    f"prompt of {len(t)} tokens + max_tokens {p.max_tokens} exceeds max_model_len "
                    f"{self.max_model_len} (decoding continues at position {len(t)}): raise "
                    "max_model_len or lower max_tokens"
                )
        return params

    def _base_generate(
        self, ids, pruned, configs, params, use_tqdm=False, lora_request=None, priority=None, salts=None
    ):
        salts = salts or [None] * len(ids)  # each request's cache_salt reaches the base as given
        inputs, base_params = zip(
            *[
                base_request(t, p, c, sp, salted({"prompt_token_ids": t}, salt))
                for t, p, c, sp, salt in zip(ids, pruned, configs, params, salts)
            ]
        )
        outputs = self.llm.generate(
            list(inputs), list(base_params), use_tqdm=use_tqdm, lora_request=lora_request, priority=priority
        )
        for token_ids, out in zip(ids, outputs):
            out.prompt_token_ids = token_ids
        return outputs

    def generate_kept(
        self,
        prompt_ids: list[list[int]],
        kept: list[list[int] | None],
        sampling_params,
        restore_positions: bool = True,
        use_tqdm: bool = False,
    ):
        """The base model on given kept indices (None = whole prompt): for baselines that select tokens otherwise."""
        config = self.config.replace(restore_positions=restore_positions)
        pruned = [None if k is None else core.prune(t, k, config) for t, k in zip(prompt_ids, kept)]
        params = sampling_params if isinstance(sampling_params, (list, tuple)) else [sampling_params] * len(prompt_ids)
        return self._base_generate(prompt_ids, pruned, [config] * len(prompt_ids), params, use_tqdm)

    def answer_fits(
        self,
        prompt_ids: list[list[int]],
        answers: list[list[int]],
        kept: list[list[int] | None],
        restore_positions: bool = True,
    ) -> list[core.AnswerFit]:
        """Each gold answer teacher-forced after its prompt, whole (None) or on the kept indices (`core.likelihood`):
        the prompt and the answer go to the base as one prompt (the answer's tokens kept, at the positions decoding
        gives them) with its prompt log-probs, and the prompt alone for one token with the whole vocabulary's
        log-probs (the base engine needs `max_logprobs=-1`)."""
        import torch
        from vllm import SamplingParams

        model_config = self.llm.llm_engine.model_config
        vocab = model_config.get_vocab_size()
        if model_config.max_logprobs != -1 and model_config.max_logprobs < vocab:
            raise SpecPrefillError(
                "the first answer token's distribution needs every token's log-prob: build the pair with the base "
                "engine argument max_logprobs=-1 (--engine-arg max_logprobs=-1)"
            )
        if any(len(a) == 0 for a in answers):
            raise SpecPrefillError("a gold answer has no tokens: the fidelity measure needs at least one")
        joined = [[*t, *a] for t, a in zip(prompt_ids, answers, strict=True)]
        kept_joined = [
            None if k is None else [*k, *range(len(t), len(t) + len(a))] for t, a, k in zip(prompt_ids, answers, kept)
        ]
        forced = self.generate_kept(
            joined, kept_joined, SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False), restore_positions
        )
        first = self.generate_kept(
            prompt_ids,
            list(kept),
            SamplingParams(max_tokens=1, logprobs=-1, flat_logprobs=True, detokenize=False),
            restore_positions,
        )
        fits = []
        for a, f, o in zip(answers, forced, first, strict=True):
            rows = f.prompt_logprobs[-len(a) :]
            token_logprobs = tuple(float(row[tok].logprob) for tok, row in zip(a, rows, strict=True))
            flat = o.outputs[0].logprobs
            dist = torch.full((vocab,), float("-inf"))
            dist[torch.as_tensor(flat.token_ids[flat.start_indices[0] : flat.end_indices[0]])] = torch.as_tensor(
                flat.logprobs[flat.start_indices[0] : flat.end_indices[0]], dtype=torch.float32
            )
            fits.append(core.AnswerFit(token_logprobs, dist))
        return fits

    def prompt_logprobs(self, prompt_ids: list[list[int]]) -> list[list[float]]:
        """The speculator's log-probability of every prompt token given its prefix (first token: 0)."""
        from vllm import SamplingParams

        if self.speculator.pair.cross:
            raise SpecPrefillError(
                "self-information scores are the speculator's log-probabilities of the base's own "
                "tokens: use a speculator that shares the base's tokenizer for this baseline"
            )

        outs = self.speculator.llm.generate(
            [{"prompt_token_ids": t} for t in prompt_ids],
            SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False),
            use_tqdm=False,
        )
        result = []
        for t, out in zip(prompt_ids, outs):
            lps = [0.0] + [float(d[tok].logprob) for tok, d in zip(t[1:], out.prompt_logprobs[1:])]
            result.append(lps)
        return result

    def chat(
        self,
        messages,
        sampling_params=None,
        use_tqdm=True,
        lora_request=None,
        priority=None,
        chat_template: str | None = None,
        chat_template_content_format: str = "auto",
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        tokenization_kwargs: dict | None = None,
        mm_processor_kwargs: dict | None = None,
        *,
        keep_rate=None,
        config=None,
    ):
        """`vllm.LLM.chat` with SpecPrefill: one conversation (a list of {"role", "content"}) or a list of them,
        rendered with the base's chat template; a speculator with another tokenizer renders the same messages with
        its own template. Text content only (`chat_template_content_format` "auto"/"string"/"openai" all read text)."""
        if chat_template_content_format not in ("auto", "string", "openai"):
            raise SpecPrefillError(
                f"chat_template_content_format {chat_template_content_format!r}: use auto, string or openai"
            )
        batch = messages if messages and isinstance(messages[0], list) else [messages]
        batch = [tokenmap.text_messages(conv) for conv in batch]
        template = {
            **(chat_template_kwargs or {}),
            "add_generation_prompt": add_generation_prompt,
            "continue_final_message": continue_final_message,
            **({"chat_template": chat_template} if chat_template is not None else {}),
            **({"tools": tools} if tools is not None else {}),
        }
        if chat_template is None:
            require_chat_template(self.tokenizer, f"base model {self.base_path!r}")
        texts = [self.tokenizer.apply_chat_template(m, tokenize=False, **template) for m in batch]
        tokenize = {"add_special_tokens": False, **(tokenization_kwargs or {})}  # the template holds the specials
        ids = [list(self.tokenizer(t, **tokenize)["input_ids"]) for t in texts]
        pair = self.speculator.pair  # a cross-tokenizer speculator renders the messages with its own template
        maps = [pair.chat_map(m, i, t, **template) for m, i, t in zip(batch, ids, texts)]
        return self.generate(
            [{"prompt_token_ids": i} for i in ids],
            sampling_params,
            use_tqdm=use_tqdm,
            lora_request=lora_request,
            priority=priority,
            mm_processor_kwargs=mm_processor_kwargs,
            keep_rate=keep_rate,
            config=config,
            _maps=maps,
        )
