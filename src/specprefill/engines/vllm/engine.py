"""SpecPrefill on vLLM: a speculator `LLM` whose workers score prompt tokens as their attention layers run
(`capture.CaptureExtension`), and a base `LLM` whose runner (patched by the `positions` plugin) gives kept tokens
their original position ids. Both may run in any vLLM mode: multiprocess, tensor parallel, in-process.
"""
from __future__ import annotations

import hashlib
import time
import uuid
from dataclasses import dataclass
from typing import Any, Sequence

from specprefill import core, hardware, tokenmap
from specprefill.engines.common import (GenerationResult, SamplingConfig, eos_ids_of, load_tokenizer, model_context,
                                        require_tokens)
from specprefill.config import SELF_LOOK_AHEAD, SELF_PREFIX
from specprefill.engines.vllm import capture, positions, sizing
from specprefill.errors import SpecPrefillError
from specprefill.models import is_self_speculator, resolve_speculator

DEFAULT_MAX_SPECULATION_TOKENS = 32768


def _prepare_vllm() -> None:
    positions.check_vllm_version()
    positions.register()  # the entry point does this too; in-process it may not have run yet


def microbatches(lengths: Sequence[int], budget: int) -> list[list[int]]:
    """Consecutive groups of prompt indices whose total length stays within `budget` (a longer prompt goes alone):
    the extra memory of speculation is bounded by the budget, not by the batch."""
    groups: list[list[int]] = []
    total = 0
    for i, n in enumerate(lengths):
        if groups and total + n <= budget:
            groups[-1].append(i)
            total += n
        else:
            groups.append([i])
            total = n
    return groups


def combine_ranks(parts: list) -> core.StepScores:
    """Per-rank scores of one request (each rank saw its own heads) -> one StepScores."""
    seen = [core.StepScores.from_wire(p) for p in parts if p is not None]
    if not seen:
        raise SpecPrefillError("the speculator's workers captured nothing for a request: its attention layers did "
                               "not run through the hooks (run the speculator with enforce_eager=True)")
    out = seen[0]
    for p in seen[1:]:
        out = out.merge(p)
    return out


def speculator_engine_kwargs(engine_kwargs: dict) -> dict:
    """The speculator's engine arguments: eager (the hooks run in eager mode), no prefix caching (every prompt token
    must pass the hooks), the capture extension in every worker."""
    kwargs = {"enforce_eager": True, **engine_kwargs, "enable_prefix_caching": False,
              "worker_extension_cls": capture.EXTENSION}
    if not kwargs["enforce_eager"]:
        raise SpecPrefillError("the speculator needs enforce_eager=True (its attention hooks run in eager mode)")
    if kwargs.get("pipeline_parallel_size", 1) > 1:
        raise SpecPrefillError("the speculator cannot run pipeline parallel (each stage would score only its "
                               "layers): use speculator tensor_parallel_size instead")
    return kwargs


def check_installed(hooked_per_rank: list[int], model: str, model_config) -> None:
    if min(hooked_per_rank) == 0:
        raise SpecPrefillError(
            f"speculator {model!r} ({getattr(model_config.hf_config, 'architectures', None)}) has no vLLM "
            "Attention layers to hook: use a decoder model whose layers call vllm's Attention (e.g. Llama, Qwen2, "
            "Mistral, Gemma)")


def model_eos_ids(tokenizer, model_config) -> set[int]:
    generation = model_config.try_get_generation_config() or {}
    return eos_ids_of(tokenizer, generation.get("eos_token_id"))


def check_look_ahead(n_prompt: int, config: core.SpecPrefillConfig, max_model_len: int) -> None:
    if n_prompt + config.look_ahead > max_model_len:
        raise SpecPrefillError(
            f"prompt of {n_prompt} tokens + {config.look_ahead} look-ahead tokens exceeds the speculator's "
            f"max_model_len {max_model_len}: raise max_model_len (for the speculator alone: speculator_kwargs / "
            "--speculator-engine-arg max_model_len=N) or shorten the prompt")


def speculation_params(uid: str, n_prompt: int, config: core.SpecPrefillConfig, eos_ids):
    """Greedy look-ahead of up to N-1 tokens after the prompt (EOS ends it), tagged for the workers' capture."""
    from vllm import SamplingParams

    return SamplingParams(max_tokens=config.look_ahead, temperature=0.0, stop_token_ids=sorted(eos_ids),
                          ignore_eos=False, detokenize=False,
                          extra_args={positions.CAPTURE_KEY: capture_payload(uid, n_prompt, config)})


def importance_from_scores(config: core.SpecPrefillConfig, n_generated: int, per_rank: list):
    """One speculated request's per-rank scores -> importance of its (speculator) prompt tokens."""
    return combine_ranks(per_rank).importance(look_ahead_steps(n_generated, config.look_ahead), config.step_agg)


class VLLMSpeculator:
    """A vLLM `LLM` (eager, no prefix caching) whose workers score the prompt while it speculates.

    `max_speculation_tokens`: prompts are speculated in consecutive groups of at most this many prompt tokens, so
    the extra memory (prompt keys held between steps, per rank) does not grow with the batch. `base_tokenizer`: the
    base's, when it differs (a cross-tokenizer pair): prompts come in base tokens, the speculator reads their text
    in its own, and the kept chunks come back in base tokens (`tokenmap.Pair`)."""

    def __init__(self, model: str, max_speculation_tokens: int | None = None, base_tokenizer=None,
                 **engine_kwargs: Any) -> None:
        from vllm import LLM

        _prepare_vllm()
        kwargs = speculator_engine_kwargs(engine_kwargs)
        with sizing.cpu_threads_env(kwargs.get("tensor_parallel_size", 1)):
            self.llm = LLM(model=model, **kwargs)
        self.model = model
        self.tokenizer = self.llm.get_tokenizer()
        model_config = self.llm.llm_engine.model_config
        self.max_model_len = model_config.max_model_len
        self.max_speculation_tokens = max_speculation_tokens or max(DEFAULT_MAX_SPECULATION_TOKENS, self.max_model_len)
        self.eos_ids = model_eos_ids(self.tokenizer, model_config)
        self.pair = tokenmap.Pair(self.tokenizer, base_tokenizer)
        self.last_timings: dict = {}
        check_installed(self.llm.collective_rpc("specprefill_install"), model, model_config)

    def _check(self, prompts, configs) -> None:
        require_tokens(prompts)
        for p, c in zip(prompts, configs):
            check_look_ahead(len(p), c, self.max_model_len)

    def speculate(self, prompts: Sequence[list[int]], configs: Sequence[core.SpecPrefillConfig],
                  maps: Sequence[tokenmap.TokenMap | None] | None = None) -> list[core.PrunedPrompt]:
        """Prefill the prompts plus up to N-1 greedy look-ahead steps each (EOS-aware), in bounded groups.
        `maps`: precomputed token maps of a cross-tokenizer pair (e.g. per-model chat templates)."""
        t0 = time.perf_counter()
        require_tokens(prompts)
        maps = list(maps) if maps is not None else [self.pair.map(p) for p in prompts]
        spec_prompts = [self.pair.speculator_ids(p, m) for p, m in zip(prompts, maps)]
        self._check(spec_prompts, configs)
        timings = {"speculator_s": 0.0, "scoring_s": time.perf_counter() - t0}
        importance: list = []
        for group in microbatches([len(p) for p in spec_prompts], self.max_speculation_tokens):
            importance += self._score_group([spec_prompts[i] for i in group], [configs[i] for i in group], timings)
        t1 = time.perf_counter()
        pruned = [self.pair.prune(p, imp, m, c) for p, imp, m, c in zip(prompts, importance, maps, configs)]
        timings["scoring_s"] += time.perf_counter() - t1
        self.last_timings = timings
        return pruned

    def _score_group(self, prompts, configs, timings: dict) -> list:
        from vllm import TokensPrompt

        uids = [uuid.uuid4().hex for _ in prompts]
        params = [speculation_params(uid, len(p), c, self.eos_ids) for uid, p, c in zip(uids, prompts, configs)]
        t0 = time.perf_counter()
        try:
            outs = self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params, use_tqdm=False)
        finally:  # the workers forget these requests even when generation failed
            per_rank = self.llm.collective_rpc("specprefill_collect", args=(uids,))
        t1 = time.perf_counter()
        result = [importance_from_scores(c, len(out.outputs[0].token_ids), [rank[uid] for rank in per_rank])
                  for uid, c, out in zip(uids, configs, outs)]
        timings["speculator_s"] += t1 - t0
        timings["scoring_s"] += time.perf_counter() - t1
        return result

    def peak_extra_bytes(self, reset: bool = False) -> list[int]:
        """Per rank: the most memory speculation held at once (prompt keys + running scores)."""
        return self.llm.collective_rpc("specprefill_peak_bytes", args=(reset,))


def _with_max_tokens(params, max_tokens: int):
    params = params.clone()
    params.max_tokens = max(1, max_tokens)
    return params


def capture_payload(uid: str, n_prompt: int, config: core.SpecPrefillConfig) -> dict:
    return {"uid": uid, "n": n_prompt, "steps": config.look_ahead, "pool": config.pool_kernel,
            "agg": config.layer_head_agg}


def look_ahead_steps(n_generated: int, look_ahead: int) -> int:
    """Queries that count: the last prompt token's, then one per generated token that was fed back (EOS ends it).
    A step a scheduler runs after the request already finished (async scheduling) is not counted."""
    return max(1, min(look_ahead, n_generated))


def positions_payload(pruned: core.PrunedPrompt) -> dict:
    return {positions.POSITIONS_KEY: {"kept": pruned.kept_indices, "n": pruned.n_original}}


def cache_salt(pruned: core.PrunedPrompt) -> str:
    """Prefix-cache salt: KV blocks are only shared between prompts pruned to the same position map."""
    return "specprefill-" + hashlib.sha256(str(pruned.kept_indices + [pruned.n_original]).encode()).hexdigest()[:32]


def base_request(token_ids: list[int], pruned: core.PrunedPrompt | None, config: core.SpecPrefillConfig, params,
                 prompt: dict | None = None):
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


SHARED_ENGINE_ARGS = ("dtype", "max_model_len", "seed", "trust_remote_code", "tokenizer_mode", "download_dir")


def plan_pair(model: str, speculator: str, engine_kwargs: dict, speculator_kwargs: dict,
              kv_sequences: int = sizing.DEFAULT_KV_SEQUENCES) -> tuple[dict, dict]:
    """Base and speculator engine arguments, before either engine is built: dtype resolved
    (`hardware.resolve_dtype`), `SHARED_ENGINE_ARGS` given to both, memory sized by `sizing.plan`. A speculator
    with another tokenizer may need more tokens for the same text: its max_model_len is twice the base's (within
    its own context)."""
    _prepare_vllm()
    engine_kwargs = {**engine_kwargs, "dtype": hardware.resolve_dtype(engine_kwargs.get("dtype"))}
    shared = {k: engine_kwargs[k] for k in SHARED_ENGINE_ARGS if k in engine_kwargs}
    if "max_model_len" in shared and "max_model_len" not in speculator_kwargs and is_cross_pair(speculator, model):
        shared["max_model_len"] = min(2 * shared["max_model_len"], model_context(speculator))
    return sizing.plan(model, speculator, engine_kwargs, {**shared, **speculator_kwargs}, kv_sequences)


def is_cross_pair(speculator: str, model: str) -> bool:
    return speculator != model and not tokenmap.same_tokenizer(load_tokenizer(speculator), load_tokenizer(model))


@dataclass
class SpecPrefillInfo:
    kept_indices: list[int] | None  # None: the prompt ran whole (too short, or keep rate 1)
    importance: list[float] | None
    n_prompt_tokens: int
    timings: dict


class SpecPrefillLLM:
    """Drop-in for `vllm.LLM` generation with Speculative Prefill.

    `model` is the base; `speculator` the small model: same tokenizer, or another (its importance reaches base
    tokens through character spans, `tokenmap`). Engine arguments go to the base; those in
    `SHARED_ENGINE_ARGS` (dtype, max_model_len, seed, ...) go to both; `speculator_kwargs` only to the speculator (e.g.
    tensor_parallel_size=2). `dtype` defaults to "auto" = `hardware.auto_dtype()` (bf16 only where the CPU has it
    natively). Memory left open is sized by `sizing.plan` so both engines start side by side; `kv_sequences` is how
    many `max_model_len` sequences each CPU engine's KV cache holds. Each `RequestOutput` gains `.specprefill`.
    """

    def __init__(self, model: str, speculator: str, config: core.SpecPrefillConfig | None = None, *,
                 min_prompt_tokens: int = 0, speculator_kwargs: dict | None = None,
                 max_speculation_tokens: int | None = None, kv_sequences: int = sizing.DEFAULT_KV_SEQUENCES,
                 **engine_kwargs: Any) -> None:
        from vllm import LLM

        # a self-speculator (the base's first layers) looks ahead 1 token unless the config says otherwise
        self.config = config or core.SpecPrefillConfig(look_ahead=SELF_LOOK_AHEAD if is_self_speculator(speculator)
                                                       else core.SpecPrefillConfig.look_ahead)
        self.min_prompt_tokens = min_prompt_tokens
        if speculator.startswith(SELF_PREFIX):  # self:K, the base's first K layers
            speculator = resolve_speculator(speculator, model)
        self.base_path, self.speculator_path = model, speculator
        base_kwargs, spec_kwargs = plan_pair(model, speculator, {"disable_log_stats": False, **engine_kwargs},
                                             speculator_kwargs or {}, kv_sequences)
        self.dtype = base_kwargs["dtype"]
        base_tokenizer = load_tokenizer(model) if speculator != model else None
        self.speculator = VLLMSpeculator(speculator, max_speculation_tokens, base_tokenizer, **spec_kwargs)
        with sizing.cpu_threads_env(base_kwargs.get("tensor_parallel_size", 1)):
            self.llm = LLM(model=model, **base_kwargs)  # stats give per-request TTFT
        self.tokenizer = self.llm.get_tokenizer()
        self.max_model_len = self.llm.llm_engine.model_config.max_model_len

    def get_tokenizer(self):
        return self.tokenizer

    def shutdown(self) -> None:
        """Stop both engines (their engine-core processes), e.g. before building the next pair in a notebook."""
        for llm in (self.speculator.llm, self.llm):
            llm.llm_engine.engine_core.shutdown()

    @property
    def llm_engine(self):
        """The base's engine, as on `vllm.LLM` (its model config, stats)."""
        return self.llm.llm_engine

    def _token_ids(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            return list(self.tokenizer(prompt)["input_ids"])
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            return list(prompt["prompt_token_ids"])
        if isinstance(prompt, dict) and "prompt" in prompt:
            return list(self.tokenizer(prompt["prompt"])["input_ids"])
        raise SpecPrefillError(f"unsupported prompt type {type(prompt).__name__}: pass a string or a TokensPrompt dict")

    def _configs(self, n: int, keep_rate, config) -> list[core.SpecPrefillConfig]:
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

    def generate(self, prompts, sampling_params=None, keep_rate=None, use_tqdm: bool = False, config=None,
                 _maps=None):
        from vllm import SamplingParams

        single = isinstance(prompts, (str, dict))
        prompts = [prompts] if single else list(prompts)
        ids = [self._token_ids(p) for p in prompts]
        require_tokens(ids)
        configs = self._configs(len(ids), keep_rate, config)
        params = sampling_params if isinstance(sampling_params, (list, tuple)) else [sampling_params] * len(ids)
        params = [p if p is not None else SamplingParams() for p in params]
        params = [p if p.max_tokens is not None else _with_max_tokens(p, self.max_model_len - len(t))
                  for t, p in zip(ids, params)]  # None: up to max_model_len counted from M, not from the kept K
        for t, p in zip(ids, params):  # decode positions continue from the original length M
            if len(t) + p.max_tokens > self.max_model_len:
                raise SpecPrefillError(f"prompt of {len(t)} tokens + max_tokens {p.max_tokens} exceeds max_model_len "
                                       f"{self.max_model_len} (decoding continues at position {len(t)}): raise "
                                       "max_model_len or lower max_tokens")
        todo = [i for i, (t, c) in enumerate(zip(ids, configs)) if len(t) >= self.min_prompt_tokens and c.keep_rate < 1]

        t0 = time.perf_counter()
        maps = None if _maps is None else [_maps[i] for i in todo]
        pruned = dict(zip(todo, self.speculator.speculate([ids[i] for i in todo], [configs[i] for i in todo], maps)))
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

        if self.speculator.pair.cross:
            raise SpecPrefillError("self-information scores are the speculator's log-probabilities of the base's own "
                                   "tokens: use a speculator that shares the base's tokenizer for this baseline")

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
        texts = [self.tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=False, **template_kwargs)
                 for m in batch]
        ids = [list(self.tokenizer(t, add_special_tokens=False)["input_ids"]) for t in texts]
        pair = self.speculator.pair  # a cross-tokenizer speculator renders the messages with its own template
        maps = [pair.chat_map(m, i, t, **template_kwargs) for m, i, t in zip(batch, ids, texts)]
        return self.generate([{"prompt_token_ids": i} for i in ids], sampling_params, keep_rate, use_tqdm,
                             _maps=maps)


class VLLMEngine:
    """The CLI's view of the vLLM engines (same contract as `HFEngine`): a SpecPrefillLLM, or a speculator alone
    (importance only). Build them with `builder.build` / `builder.build_speculator`."""

    def __init__(self, config: core.SpecPrefillConfig, llm: SpecPrefillLLM | None = None,
                 speculator: VLLMSpeculator | None = None) -> None:
        self.config, self.llm = config, llm
        self.spec = llm.speculator if llm is not None else speculator
        self.tokenizer = llm.tokenizer if llm is not None else self.spec.tokenizer  # prompts are in base tokens

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
        results = []
        for out in self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, config=configs):
            info = out.specprefill
            n = info.n_prompt_tokens
            pruned = core.PrunedPrompt([], [], info.kept_indices or list(range(n)), n, n, info.importance or [])
            tokens = list(out.outputs[0].token_ids)
            t = info.timings
            config = configs[len(results)] if configs else self.config
            results.append(GenerationResult.build(self.tokenizer, pruned, out.prompt_token_ids, tokens, config,
                                                  t["speculation_s"], t["base_ttft_s"], t["total_s"]))
        return results
