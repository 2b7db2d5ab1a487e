"""What both speculator engines do the same way around their engine's call (the offline `speculator.VLLMSpeculator`
and the serving `async_speculator.AsyncSpeculator` differ only in how they call it: a batch in bounded groups, or
one awaited request): read the model once, prepare a prompt (its speculator tokens and knobs, then the refusals),
tag its request for the workers' capture, size the budget from the workers' memory, turn their scores into
importance."""

from __future__ import annotations

import dataclasses
import uuid

from specprefill import tokenmap
from specprefill.config import SpecPrefillConfig
from specprefill.engines.common import require_tokens
from specprefill.engines.vllm.budgets import check_fits_memory, check_look_ahead, fit_budget, model_window
from specprefill.engines.vllm.payloads import SpeculatorHeads, model_eos_ids, speculation_params
from specprefill.engines.vllm.ranks import importance_from_scores


class Speculator:
    """The model facts and steps both speculator engines share. `max_speculation_tokens`: prompt tokens speculation
    may hold at once (None: sized from the workers' free memory, `fit`); `base_tokenizer`: the base's, when it
    differs (prompts come in base tokens and are read in the speculator's own, `tokenmap.Pair`)."""

    context: int | None = None  # the model's own position limit (`model_window`)

    def __init__(self, tokenizer, model_config, model: str, max_speculation_tokens: int | None, base_tokenizer) -> None:
        self.model, self.tokenizer = model, tokenizer
        self.pair = tokenmap.Pair(tokenizer, base_tokenizer)
        self.max_model_len = model_config.max_model_len
        self.context = model_window(model_config)
        self.eos_ids = model_eos_ids(tokenizer, model_config)
        self.heads = SpeculatorHeads.of(model, model_config)
        self.budget_from_memory = max_speculation_tokens is None
        self.max_speculation_tokens = max_speculation_tokens or self.max_model_len

    def fit(self, reports: list[dict]) -> None:
        """The budget from the workers' `specprefill_memory` reports, taken once every engine started (unless given)."""
        if self.budget_from_memory:
            self.max_speculation_tokens = fit_budget(reports, self.max_model_len)

    def prepare(self, base_prompt: list[int], config: SpecPrefillConfig, tmap=None) -> tokenmap.Speculation:
        """The prompt in the speculator's tokens with its knobs (`tmap`: a precomputed token map), checked."""
        return self.checked(self.heads.speculation(self.pair, base_prompt, config, tmap))

    def checked(self, s: tokenmap.Speculation, shorten: bool = False) -> tokenmap.Speculation:
        """`s`, or SpecPrefillError naming the fix: a prompt whose look-ahead runs past max_model_len (`shorten`: the
        look-ahead is cut to what fits while at least one step does), or whose keys exceed the free memory."""
        require_tokens([s.spec_ids])  # a cross-tokenizer pair's reading of the prompt, too
        n, room = len(s.spec_ids), self.max_model_len - len(s.spec_ids)
        if not shorten or room < 1:
            check_look_ahead(n, s.config, self.max_model_len, self.context)
        check_fits_memory(n, self.max_speculation_tokens, self.budget_from_memory)
        if s.config.look_ahead > room:  # what fits of the look-ahead (vLLM would refuse the request)
            s = dataclasses.replace(s, config=s.config.replace(look_ahead=room))
        return s

    def request(self, s: tokenmap.Speculation):
        """A fresh request id and its sampling parameters: the look-ahead, tagged for the workers' capture."""
        uid = uuid.uuid4().hex
        return uid, speculation_params(uid, len(s.spec_ids), s.config, self.eos_ids)

    @staticmethod
    def importance_of(s: tokenmap.Speculation, n_generated: int, per_rank: list):
        """The prompt's importance (speculator tokens) from each rank's scores of its request."""
        return importance_from_scores(s.config, n_generated, per_rank)
