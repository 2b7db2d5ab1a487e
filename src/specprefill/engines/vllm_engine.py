"""SpecPrefill on vLLM: a speculator `LLM` whose attention layers are hooked while it speculates, and a base `LLM`
whose runner (patched by the `vllm_runner` plugin) gives kept tokens their original position ids.

The speculator must run in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0, set here if unset) so its hooks can reach
the capture; the base engine may run in any mode, the plugin loads in its engine process through the entry point.
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from specprefill import core
from specprefill.engines import vllm_runner
from specprefill.engines.common import (GenerationResult, SamplingConfig, check_same_tokenizer, eos_ids_of,
                                        load_tokenizer)
from specprefill.errors import SpecPrefillError


def _prepare_vllm() -> None:
    if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "0") != "0":
        raise SpecPrefillError("the speculator must run in-process: set VLLM_ENABLE_V1_MULTIPROCESSING=0")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    vllm_runner.check_vllm_version()
    vllm_runner.register()  # the entry point does this too; in-process it may not have run yet


@dataclass
class _Capture:
    """Post-RoPE q/k of the prompts being speculated, filled by the attention hooks, routed by the step layout."""

    lengths: list[int]
    look_ahead: list[int]
    layout: list = field(default_factory=list)  # (prompt index, first row, rows, first position) for this step
    keys: dict = field(default_factory=dict)  # prompt -> [L, KV, M, D]
    queries: dict = field(default_factory=dict)  # prompt -> [L, H, N, D]
    steps: dict = field(default_factory=dict)  # prompt -> look-ahead steps seen

    def hook(self, layer: int, n_layers: int, module, q: torch.Tensor, k: torch.Tensor) -> None:
        heads, kv, dim = module.num_heads, module.num_kv_heads, module.head_size
        for idx, row, n, pos in self.layout:
            m, steps = self.lengths[idx], self.look_ahead[idx]
            if idx not in self.keys:
                self.keys[idx] = k.new_zeros(n_layers, kv, m, dim)
                self.queries[idx] = q.new_zeros(n_layers, heads, steps, dim)
            if pos < m:  # prompt rows (a prefill, or one chunk of it)
                count = min(n, m - pos)
                self.keys[idx][layer, :, pos:pos + count] = k[row:row + count].view(count, kv, dim).transpose(0, 1)
            first = max(pos, m - 1)  # rows at the last prompt token and after carry the queries we keep
            last = min(pos + n, m - 1 + steps)
            if first < last:
                rows = slice(row + first - pos, row + last - pos)
                self.queries[idx][layer, :, first - m + 1:last - m + 1] = (
                    q[rows].view(last - first, heads, dim).transpose(0, 1))
                self.steps[idx] = max(self.steps.get(idx, 0), last - m + 1)

    def result(self, idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.queries[idx][:, :, :self.steps[idx]], self.keys[idx]


def _attention_layers(model) -> list:
    from vllm.model_executor.layers.attention import Attention

    return [m for m in model.modules() if isinstance(m, Attention)]


class VLLMSpeculator:
    """A vLLM `LLM` (eager, no prefix caching) that captures q/k while it speculates."""

    def __init__(self, model: str, **engine_kwargs: Any) -> None:
        from vllm import LLM

        _prepare_vllm()
        kwargs = {"enforce_eager": True, **engine_kwargs, "enable_prefix_caching": False}
        if not kwargs["enforce_eager"]:
            raise SpecPrefillError("the speculator needs enforce_eager=True (its attention hooks run in eager mode)")
        self.llm = LLM(model=model, **kwargs)
        self.model = model
        self.tokenizer = self.llm.get_tokenizer()
        hf = self.llm.llm_engine.model_config.hf_config
        generation = self.llm.llm_engine.model_config.try_get_generation_config() or {}
        self.eos_ids = eos_ids_of(self.tokenizer, generation.get("eos_token_id"))
        n = self.llm.apply_model(lambda m: len(_attention_layers(m)))[0]
        if n == 0:
            raise SpecPrefillError(
                f"speculator {model!r} ({getattr(hf, 'architectures', None)}) has no vLLM Attention layers to hook: "
                "use a decoder model whose layers call vllm's Attention (e.g. Llama, Qwen2, Mistral, Gemma)")

    @contextlib.contextmanager
    def _hooks(self, capture: _Capture):
        def install(model):
            layers = _attention_layers(model)
            handles = []
            for i, layer in enumerate(layers):
                def pre_hook(module, args, kwargs, i=i, n=len(layers)):
                    q = args[0] if args else kwargs["query"]
                    k = args[1] if len(args) > 1 else kwargs["key"]
                    capture.hook(i, n, module, q, k)
                handles.append(layer.register_forward_pre_hook(pre_hook, with_kwargs=True))
            return handles

        handles = self.llm.apply_model(install)[0]
        vllm_runner.ACTIVE_CAPTURE[0] = capture
        try:
            yield capture
        finally:
            vllm_runner.ACTIVE_CAPTURE[0] = None
            for h in handles:
                h.remove()

    def speculate(self, prompts: Sequence[list[int]], configs: Sequence[core.SpecPrefillConfig]) -> list[core.PrunedPrompt]:
        """Prefill all prompts as one batch plus up to N-1 greedy look-ahead steps each (EOS-aware)."""
        from vllm import SamplingParams, TokensPrompt

        if not prompts:
            return []
        capture = _Capture([len(p) for p in prompts], [c.look_ahead for c in configs])
        params = [SamplingParams(max_tokens=c.look_ahead, temperature=0.0, stop_token_ids=sorted(self.eos_ids),
                                 ignore_eos=False, detokenize=False, extra_args={vllm_runner.CAPTURE_KEY: i})
                  for i, c in enumerate(configs)]
        t0 = time.perf_counter()
        with self._hooks(capture):
            self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params, use_tqdm=False)
        t1 = time.perf_counter()
        pruned = [core.speculate(p, *capture.result(i), c) for i, (p, c) in enumerate(zip(prompts, configs))]
        self.last_timings = {"speculator_s": t1 - t0, "scoring_s": time.perf_counter() - t1}
        return pruned


def positions_payload(pruned: core.PrunedPrompt) -> dict:
    return {vllm_runner.POSITIONS_KEY: {"kept": pruned.kept_indices, "n": pruned.n_original}}


def cache_salt(pruned: core.PrunedPrompt) -> str:
    """Prefix-cache salt: KV blocks are only shared between prompts pruned to the same position map."""
    return "specprefill-" + hashlib.sha256(str(pruned.kept_indices + [pruned.n_original]).encode()).hexdigest()[:32]


def base_request(token_ids: list[int], pruned: core.PrunedPrompt | None, config: core.SpecPrefillConfig, params):
    """The base engine's prompt and sampling params for one request (pruned or whole)."""
    from vllm import TokensPrompt

    if pruned is None:
        return TokensPrompt(prompt_token_ids=token_ids), params
    if not config.restore_positions:  # contiguous positions: an ordinary prompt of the kept tokens
        return TokensPrompt(prompt_token_ids=pruned.token_ids), params
    params = params.clone()
    params.extra_args = {**(params.extra_args or {}), **positions_payload(pruned)}
    # the salt keeps prefix caching from sharing KV computed under other positions
    return TokensPrompt(prompt_token_ids=pruned.token_ids, cache_salt=cache_salt(pruned)), params


@dataclass
class SpecPrefillInfo:
    kept_indices: list[int] | None  # None: the prompt ran whole (too short, or keep rate 1)
    importance: list[float] | None
    n_prompt_tokens: int
    timings: dict


class SpecPrefillLLM:
    """Drop-in for `vllm.LLM` generation with Speculative Prefill.

    `model` is the base; `speculator` the small model (same tokenizer). Engine arguments go to the base; those in
    `shared_kwargs` (dtype, max_model_len, seed, ...) go to both; `speculator_kwargs` only to the speculator (e.g.
    tensor_parallel_size=1, gpu_memory_utilization=0.2). Each `RequestOutput` gains `.specprefill`.
    """

    SHARED = ("dtype", "max_model_len", "seed", "trust_remote_code", "tokenizer_mode", "download_dir")

    def __init__(self, model: str, speculator: str, config: core.SpecPrefillConfig | None = None, *,
                 min_prompt_tokens: int = 0, speculator_kwargs: dict | None = None, **engine_kwargs: Any) -> None:
        from vllm import LLM

        _prepare_vllm()
        if speculator != model:  # before any engine is built
            check_same_tokenizer(load_tokenizer(speculator), load_tokenizer(model), speculator, model)
        self.config = config or core.SpecPrefillConfig()
        self.min_prompt_tokens = min_prompt_tokens
        shared = {k: engine_kwargs[k] for k in self.SHARED if k in engine_kwargs}
        self.speculator = VLLMSpeculator(speculator, **shared, **(speculator_kwargs or {}))
        self.llm = LLM(model=model, **{"disable_log_stats": False, **engine_kwargs})  # stats give per-request TTFT
        self.tokenizer = self.llm.get_tokenizer()

    def get_tokenizer(self):
        return self.tokenizer

    def _token_ids(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            return list(self.tokenizer(prompt)["input_ids"])
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            return list(prompt["prompt_token_ids"])
        if isinstance(prompt, dict) and "prompt" in prompt:
            return list(self.tokenizer(prompt["prompt"])["input_ids"])
        raise SpecPrefillError(f"unsupported prompt type {type(prompt).__name__}: pass a string or a TokensPrompt dict")

    def _configs(self, n: int, keep_rate) -> list[core.SpecPrefillConfig]:
        if keep_rate is None:
            return [self.config] * n
        rates = list(keep_rate) if isinstance(keep_rate, (list, tuple)) else [keep_rate] * n
        if len(rates) != n:
            raise SpecPrefillError(f"{len(rates)} keep rates for {n} prompts: pass one per prompt or a single float")
        return [self.config.replace(keep_rate=r) for r in rates]

    def generate(self, prompts, sampling_params=None, keep_rate=None, use_tqdm: bool = False):
        from vllm import SamplingParams

        single = isinstance(prompts, (str, dict))
        prompts = [prompts] if single else list(prompts)
        ids = [self._token_ids(p) for p in prompts]
        if any(len(i) == 0 for i in ids):
            raise SpecPrefillError("a prompt is empty: give at least one token per prompt")
        configs = self._configs(len(ids), keep_rate)
        params = sampling_params if isinstance(sampling_params, (list, tuple)) else [sampling_params] * len(ids)
        params = [p if p is not None else SamplingParams() for p in params]
        todo = [i for i, (t, c) in enumerate(zip(ids, configs)) if len(t) >= self.min_prompt_tokens and c.keep_rate < 1]

        t0 = time.perf_counter()
        pruned = dict(zip(todo, self.speculator.speculate([ids[i] for i in todo], [configs[i] for i in todo])))
        spec_s = time.perf_counter() - t0
        t1 = time.perf_counter()
        outputs = self._base_generate(ids, [pruned.get(i) for i in range(len(ids))], configs, params, use_tqdm)
        base_s = time.perf_counter() - t1
        for i, out in enumerate(outputs):
            p = pruned.get(i)
            out.specprefill = SpecPrefillInfo(
                kept_indices=p.kept_indices if p else None, importance=p.importance if p else None,
                n_prompt_tokens=len(ids[i]),
                timings={"speculation_s": spec_s if p else 0.0,
                         "base_ttft_s": out.metrics.first_token_latency if out.metrics is not None else None,
                         "base_s": base_s, "total_s": (spec_s if p else 0.0) + base_s})
        return outputs

    def _base_generate(self, ids, pruned, configs, params, use_tqdm=False):
        inputs, base_params = zip(*[base_request(t, p, c, sp) for t, p, c, sp in zip(ids, pruned, configs, params)])
        outputs = self.llm.generate(list(inputs), list(base_params), use_tqdm=use_tqdm)
        for token_ids, out in zip(ids, outputs):
            out.prompt_token_ids = token_ids
        return outputs

    def generate_kept(self, prompt_ids: list[list[int]], kept: list[list[int] | None], sampling_params,
                      restore_positions: bool = True, use_tqdm: bool = False):
        """The base model on given kept indices (None = whole prompt): for baselines that select tokens otherwise."""
        config = self.config.replace(restore_positions=restore_positions)
        pruned = [None if k is None else core.prune(t, k, config) for t, k in zip(prompt_ids, kept)]
        params = sampling_params if isinstance(sampling_params, (list, tuple)) else [sampling_params] * len(prompt_ids)
        return self._base_generate(prompt_ids, pruned, [config] * len(prompt_ids), params, use_tqdm)

    def prompt_logprobs(self, prompt_ids: list[list[int]]) -> list[list[float]]:
        """The speculator's log-probability of every prompt token given its prefix (first token: 0)."""
        from vllm import SamplingParams

        outs = self.speculator.llm.generate([{"prompt_token_ids": t} for t in prompt_ids],
                                            SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False),
                                            use_tqdm=False)
        result = []
        for t, out in zip(prompt_ids, outs):
            lps = [0.0] + [float(d[tok].logprob) for tok, d in zip(t[1:], out.prompt_logprobs[1:])]
            result.append(lps)
        return result

    def chat(self, messages, sampling_params=None, keep_rate=None, use_tqdm: bool = False, **template_kwargs):
        """One conversation (a list of {"role", "content"}) or a list of them, through the base's chat template."""
        batch = messages if messages and isinstance(messages[0], list) else [messages]
        ids = [list(self.tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=True,
                                                        return_dict=False, **template_kwargs)) for m in batch]
        return self.generate([{"prompt_token_ids": i} for i in ids], sampling_params, keep_rate, use_tqdm)


class VLLMEngine:
    """The CLI's view of the vLLM engines (same contract as `HFEngine`)."""

    def __init__(self, speculator: str, base: str | None, config: core.SpecPrefillConfig, dtype: torch.dtype,
                 **engine_kwargs: Any) -> None:
        self.config = config
        kwargs = {"dtype": str(dtype).replace("torch.", ""), **engine_kwargs}
        if base is None:
            self.spec = VLLMSpeculator(speculator, **kwargs)
            self.tokenizer = self.spec.tokenizer
            self.llm = None
        else:
            self.llm = SpecPrefillLLM(base, speculator, config, **kwargs)
            self.spec, self.tokenizer = self.llm.speculator, self.llm.tokenizer

    def speculate(self, token_ids: list[int], config: core.SpecPrefillConfig | None = None):
        t0 = time.perf_counter()
        pruned = self.spec.speculate([token_ids], [config or self.config])[0]
        return pruned, time.perf_counter() - t0

    def generate(self, prompts: list[list[int]], max_tokens: int = 32, sampling: SamplingConfig | None = None,
                 configs: list[core.SpecPrefillConfig] | None = None) -> list[GenerationResult]:
        from vllm import SamplingParams

        sampling = sampling or SamplingConfig()
        params = SamplingParams(max_tokens=max_tokens, temperature=sampling.temperature, top_p=sampling.top_p,
                                seed=sampling.seed)
        rates = [c.keep_rate for c in configs] if configs else None
        results = []
        for out in self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, keep_rate=rates):
            info = out.specprefill
            n = info.n_prompt_tokens
            pruned = core.PrunedPrompt([], [], info.kept_indices or list(range(n)), n, n, info.importance or [])
            tokens = list(out.outputs[0].token_ids)
            t = info.timings
            results.append(GenerationResult.build(self.tokenizer, pruned, out.prompt_token_ids, tokens, self.config,
                                                  t["speculation_s"], t["base_ttft_s"], t["total_s"]))
        return results
