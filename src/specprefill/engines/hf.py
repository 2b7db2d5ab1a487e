"""Transformers reference engine: the oracle the vLLM engine is tested against.

Capture: a registered attention function records post-RoPE queries/keys, then delegates to sdpa.
Speculator: prefill + up to N-1 greedy look-ahead steps (stopping at EOS), one prompt at a time.
Base: prefill of the kept tokens with their position ids, then decoding from the original prompt length.
"""

from __future__ import annotations

import contextlib
import contextvars
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from specprefill import core, tokenmap
from specprefill.config import SpecPrefillConfig
from specprefill.engines.common import (
    GenerationResult,
    SamplingConfig,
    eos_ids_of,
    load_tokenizer,
    model_errors,
    pick_token,
)
from specprefill.models.self_speculation import carried_heads

CAPTURE_ATTENTION = "specprefill_capture"
# the same capture with sdpa's mask: None for a plain causal prompt (sdpa then runs causal, no dense [M, M] mask), for
# long prompts of models without a soft-cap (soft-capping falls back to eager attention, which needs the dense mask)
CAPTURE_CAUSAL = "specprefill_capture_causal"
_RECORDER: contextvars.ContextVar[_Recorder | None] = contextvars.ContextVar("specprefill_recorder", default=None)


class _Recorder:
    """Per layer: keys of the prefill step, the last query of every step, and the layer's attention rules as the
    model hands them to its attention function (`scaling`, `softcap`, `sliding_window`)."""

    def __init__(self) -> None:
        self.keys: dict[int, torch.Tensor] = {}
        self.queries: dict[int, list[torch.Tensor]] = {}
        self.rules: dict[int, core.AttentionRules] = {}

    def record(self, layer: int, query: torch.Tensor, key: torch.Tensor, kwargs: dict) -> None:
        if layer not in self.keys:  # the prefill step: key holds exactly the prompt keys
            self.keys[layer] = key[0].detach().clone()
            self.rules[layer] = core.AttentionRules.of(
                kwargs.get("scaling"), kwargs.get("softcap"), kwargs.get("sliding_window")
            )
        self.queries.setdefault(layer, []).append(query[0, :, -1:].detach().clone())

    def tensors(self) -> core.Captured:
        layers = sorted(self.keys)
        queries = torch.stack([torch.cat(self.queries[i], dim=1) for i in layers])  # [L, H, N, D]
        keys = torch.stack([self.keys[i] for i in layers])  # [L, KV, M, D]
        return core.Captured(queries, keys, [self.rules[i] for i in layers])


def _capture_attention(module, query, key, value, attention_mask, **kwargs):
    """Records q/k while a recorder is active, then attends as the model says: sdpa, or the model's own eager
    attention when it soft-caps its logits (sdpa has no soft-cap). The mask is the additive (eager) one, which both
    accept, so the choice can be made per call."""
    import sys

    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    recorder = _RECORDER.get()
    if recorder is not None:
        recorder.record(module.layer_idx, query, key, kwargs)
    if kwargs.get("softcap"):
        eager = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
        if eager is None:
            raise NotImplementedError(f"{type(module).__name__} soft-caps its logits but has no eager attention")
        return eager(module, query, key, value, attention_mask, **kwargs)
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def _register_capture() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    if CAPTURE_ATTENTION not in AttentionInterface._global_mapping:
        AttentionInterface.register(CAPTURE_ATTENTION, _capture_attention)
        AttentionMaskInterface.register(CAPTURE_ATTENTION, ALL_MASK_ATTENTION_FUNCTIONS["eager"])
        AttentionInterface.register(CAPTURE_CAUSAL, _capture_attention)
        AttentionMaskInterface.register(CAPTURE_CAUSAL, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])


@contextlib.contextmanager
def recording():
    recorder = _Recorder()
    token = _RECORDER.set(recorder)
    try:
        yield recorder
    finally:
        _RECORDER.reset(token)


def load_model(path: str, dtype: torch.dtype, capture: bool = False, device: str = "cpu", attention: str | None = None):
    """A transformers model on `device` whose attention follows its own rules (soft-cap included) and, `capture`,
    can record q/k (only inside `recording()`). `attention`: another implementation (e.g. "flash_attention_2" or
    `CAPTURE_CAUSAL`) instead of the capture with the eager mask."""
    from transformers import AutoModelForCausalLM

    _register_capture()
    with model_errors(path):
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=dtype, attn_implementation=attention or CAPTURE_ATTENTION
        )
    return model.to(device).eval()


@torch.no_grad()
def capture_speculator(model, token_ids: list[int], look_ahead: int, eos_ids: set[int]) -> core.Captured:
    """Prefill + up to look_ahead-1 greedy steps; returns queries [L,H,N,D], prompt keys [L,KV,M,D] and each
    layer's attention rules."""
    device = model.device
    with recording() as rec:
        ids = torch.tensor([token_ids], device=device)
        out = model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=True, logits_to_keep=1)
        cache = out.past_key_values
        for step in range(look_ahead - 1):
            nxt = int(out.logits[0, -1].argmax())
            if nxt in eos_ids:
                break
            mask = torch.ones(1, len(token_ids) + step + 1, dtype=torch.long, device=device)
            out = model(
                input_ids=torch.tensor([[nxt]], device=device),
                attention_mask=mask,
                past_key_values=cache,
                use_cache=True,
            )
    return rec.tensors()


def hf_capture(model_path: str, look_ahead: int = 8, dtype=torch.float32) -> tuple[Callable, Any]:
    """A capture function (token ids -> q, k) on the transformers engine, and its tokenizer."""
    tokenizer = load_tokenizer(model_path)
    model = load_model(model_path, dtype, capture=True)
    eos = eos_ids_of(tokenizer, model.generation_config.eos_token_id)
    return (lambda ids: capture_speculator(model, ids, look_ahead, eos)), tokenizer


@torch.no_grad()
def decode_pruned(
    model, pruned: core.PrunedPrompt, max_tokens: int, sampling: SamplingConfig, eos_ids: set[int]
) -> tuple[list[int], float]:
    """Prefill the kept tokens at their positions, then decode. Returns tokens and the prefill time (s)."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    generator = sampling.generator()
    device = model.device
    t0 = time.perf_counter()
    ids = torch.tensor([pruned.token_ids], device=device)
    out = model(
        input_ids=ids,
        position_ids=torch.tensor([pruned.positions], device=device),
        attention_mask=torch.ones_like(ids),
        past_key_values=cache,
        use_cache=True,
        logits_to_keep=1,
    )
    tokens = [pick_token(out.logits[0, -1], sampling, generator)]
    prefill_s = time.perf_counter() - t0
    while len(tokens) < max_tokens and tokens[-1] not in eos_ids:
        step = len(tokens) - 1
        mask = torch.ones(1, len(pruned.token_ids) + len(tokens), dtype=torch.long, device=device)
        out = model(
            input_ids=torch.tensor([[tokens[-1]]], device=device),
            position_ids=torch.tensor([[pruned.decode_position(step)]], device=device),
            attention_mask=mask,
            past_key_values=cache,
            use_cache=True,
        )
        tokens.append(pick_token(out.logits[0, -1], sampling, generator))
    return tokens, prefill_s


@torch.no_grad()
def fit_answer(model, pruned: core.PrunedPrompt, answer: list[int]) -> core.AnswerFit:
    """The gold `answer` teacher-forced after the kept tokens at their positions (its tokens at the positions
    decoding would give them): `core.AnswerFit` from the m rows that predict the answer's m tokens."""
    device = model.device
    ids = torch.tensor([[*pruned.token_ids, *answer]], device=device)
    positions = [*pruned.positions, *(pruned.decode_position(j) for j in range(len(answer)))]
    out = model(
        input_ids=ids,
        position_ids=torch.tensor([positions], device=device),
        attention_mask=torch.ones_like(ids),
        use_cache=False,
        logits_to_keep=len(answer) + 1,
    )
    return core.fit_from_logits(out.logits[0, :-1].cpu(), answer)


@dataclass
class HFEngine:
    """Speculator + base on transformers, a `common.Engine`. `base=None` computes importance only."""

    speculator_path: str
    base_path: str | None = None
    config: SpecPrefillConfig = field(default_factory=SpecPrefillConfig)
    dtype: torch.dtype = torch.float32
    device: str = "cpu"
    base_attention: str | None = None  # the base's attention implementation (default: the capture's, eager mask)

    def __post_init__(self) -> None:
        spec_tok = load_tokenizer(self.speculator_path)
        base_tok = None if self.base_path in (None, self.speculator_path) else load_tokenizer(self.base_path)
        self.pair = tokenmap.Pair(spec_tok, base_tok)  # prompts in base tokens; a cross-tokenizer speculator maps
        self.tokenizer, self.spec_tokenizer = base_tok or spec_tok, spec_tok
        self.speculator = load_model(self.speculator_path, self.dtype, capture=True, device=self.device)
        self.carried_heads = carried_heads(self.speculator_path)  # a calibrated speculator's heads
        self.eos_ids = eos_ids_of(spec_tok, self.speculator.generation_config.eos_token_id)
        self.last_timings: dict = {}
        self.base = None
        if self.base_path is not None:
            same = self.base_path == self.speculator_path and self.base_attention is None
            self.base = (
                self.speculator
                if same
                else load_model(self.base_path, self.dtype, device=self.device, attention=self.base_attention)
            )
            self.base_eos_ids = eos_ids_of(self.tokenizer, self.base.generation_config.eos_token_id)

    def speculate(self, prompts: Sequence[list[int]], configs: Sequence[SpecPrefillConfig]) -> list[core.PrunedPrompt]:
        """`Engine.speculate`, one prompt after another; `last_timings["speculation_s"]`: all of them."""
        t0 = time.perf_counter()
        pruned = [self._speculate_one(p, c) for p, c in zip(prompts, configs)]
        self.last_timings = {"speculation_s": time.perf_counter() - t0}
        return pruned

    def _speculate_one(self, token_ids: list[int], config: SpecPrefillConfig) -> core.PrunedPrompt:
        s = self.pair.speculation(token_ids, config, self.carried_heads)
        queries, keys, rules = capture_speculator(self.speculator, s.spec_ids, s.config.look_ahead, self.eos_ids)
        return s.prune(core.token_importance(queries, keys, s.config, rules))

    def answer_fits(
        self,
        prompts: Sequence[list[int]],
        answers: Sequence[list[int]],
        kept: Sequence[list[int] | None],
        restore_positions: bool = True,
    ) -> list[core.AnswerFit]:
        """`Engine.answer_fits`: each gold answer teacher-forced after its prompt, whole (None) or on the kept
        indices (`core.likelihood`)."""
        if self.base is None:
            raise ValueError("this engine was built without a base model")
        config = self.config.replace(restore_positions=restore_positions)
        return [
            fit_answer(self.base, core.prune(t, range(len(t)) if k is None else k, config), list(a))
            for t, a, k in zip(prompts, answers, kept, strict=True)
        ]

    def generate(
        self,
        prompts: list[list[int]],
        max_tokens: int = 32,
        sampling: SamplingConfig | None = None,
        configs: list[SpecPrefillConfig] | None = None,
    ) -> list[GenerationResult]:
        """A batch of tokenized prompts, run one after another (the reference favours clarity over speed)."""
        if self.base is None:
            raise ValueError("this engine was built without a base model")
        sampling = sampling or SamplingConfig()
        configs = configs or [self.config] * len(prompts)
        results = []
        for token_ids, config in zip(prompts, configs):
            t0 = time.perf_counter()
            pruned = self.speculate([token_ids], [config])[0]
            spec_s = self.last_timings["speculation_s"]
            tokens, prefill_s = decode_pruned(self.base, pruned, max_tokens, sampling, self.base_eos_ids)
            results.append(
                GenerationResult.build(
                    self.tokenizer,
                    token_ids,
                    pruned.kept_indices,
                    pruned.importance,
                    tokens,
                    config,
                    spec_s,
                    prefill_s,
                    time.perf_counter() - t0,
                )
            )
        return results
