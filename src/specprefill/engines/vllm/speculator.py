"""The offline speculator on vLLM: an `LLM` whose workers score prompt tokens as their attention layers run
(`workers.CaptureExtension`), in any vLLM mode (multiprocess, tensor parallel, in-process)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence

import torch

from specprefill import core, tokenmap
from specprefill.config import SpecPrefillConfig
from specprefill.engines.common import require_tokens
from specprefill.engines.vllm.budgets import check_look_ahead
from specprefill.engines.vllm.payloads import salted, speculation_params
from specprefill.engines.vllm.ranks import raw_scores
from specprefill.engines.vllm.speculation import Speculator


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


class VLLMSpeculator(Speculator):
    """A vLLM `LLM` (eager; prefix caching as the pair's, on CPU) whose workers score the prompt while it speculates.

    `max_speculation_tokens`: prompts are speculated in consecutive groups of at most this many prompt tokens, so
    the extra memory (prompt keys held between steps, per rank) does not grow with the batch; None: sized from the
    memory free once every engine started (`fit_budget`, which the builder calls). `base_tokenizer`: the
    base's, when it differs (a cross-tokenizer pair): prompts come in base tokens, the speculator reads their text
    in its own, and the kept chunks come back in base tokens (`tokenmap.Pair`)."""

    def __init__(self, llm, model: str, max_speculation_tokens: int | None = None, base_tokenizer=None) -> None:
        """`llm`: the speculator's started `vllm.LLM` (`builder.start_speculator` builds it)."""
        super().__init__(
            llm.get_tokenizer(), llm.llm_engine.model_config, model, max_speculation_tokens, base_tokenizer
        )
        self.llm = llm
        self.last_timings: dict = {}
        self.last_cached_tokens = 0  # of the last call's prompt tokens, how many the speculator's prefix cache held
        self.last_prefilled: list[int] = []  # per prompt of the last call, the tokens the speculator computed

    def fit_budget(self) -> None:
        """Size the speculation budget from the memory free now (after both engines are profiled), unless given."""
        if self.budget_from_memory:
            self.fit(self.llm.collective_rpc("specprefill_memory"))

    def speculate(
        self,
        prompts: Sequence[list[int]],
        configs: Sequence[SpecPrefillConfig],
        maps: Sequence[tokenmap.TokenMap | None] | None = None,
        salts: Sequence[str | None] | None = None,
    ) -> list[core.PrunedPrompt]:
        """Prefill the prompts plus up to N-1 greedy look-ahead steps each (EOS-aware), in bounded groups, and keep
        each prompt's top chunks. `maps`: precomputed token maps of a cross-tokenizer pair (e.g. per-model chat
        templates); `salts`: per prompt, the request's `cache_salt` (its tenant: the speculator's prefix cache is
        shared only within it)."""
        specs, importance = self._speculations(prompts, configs, maps, salts)
        t1 = time.perf_counter()
        pruned = [s.prune(imp) for s, imp in zip(specs, importance)]
        self.last_timings["scoring_s"] += time.perf_counter() - t1
        return pruned

    def importance(
        self, prompts: Sequence[list[int]], configs: Sequence[SpecPrefillConfig], salts=None
    ) -> list[torch.Tensor]:
        """Each prompt's importance in base tokens, nothing selected (what `selectors.SpecPrefill` scores with)."""
        specs, importance = self._speculations(prompts, configs, None, salts)
        return [s.base_importance(imp) for s, imp in zip(specs, importance)]

    def _speculations(self, prompts, configs, maps, salts) -> tuple[list[tokenmap.Speculation], list]:
        t0 = time.perf_counter()
        require_tokens(prompts)
        maps = list(maps) if maps is not None else [None] * len(prompts)
        specs = [self.prepare(p, c, m) for p, c, m in zip(prompts, configs, maps)]
        timings = {"speculator_s": 0.0, "scoring_s": time.perf_counter() - t0}
        self.last_cached_tokens, self.last_prefilled = 0, []
        importance: list = []
        for group in microbatches([len(s.spec_ids) for s in specs], self.max_speculation_tokens):
            group_salts = [salts[i] for i in group] if salts is not None else [None] * len(group)
            importance += self._score_group([specs[i] for i in group], timings, group_salts)
        self.last_timings = timings
        return specs, importance

    def _score_group(self, specs: list[tokenmap.Speculation], timings: dict, salts: Sequence[str | None]) -> list:
        from vllm import TokensPrompt

        uids, params = zip(*[self.request(s) for s in specs])
        t0 = time.perf_counter()
        try:
            inputs = [salted(TokensPrompt(prompt_token_ids=list(s.spec_ids)), salt) for s, salt in zip(specs, salts)]
            outs = self.llm.generate(inputs, list(params), use_tqdm=False)
        finally:  # the workers forget these requests even when generation failed
            per_rank = self.llm.collective_rpc("specprefill_collect", args=(list(uids),))
        t1 = time.perf_counter()
        result = [
            self.importance_of(s, len(out.outputs[0].token_ids), [rank[uid] for rank in per_rank])
            for uid, s, out in zip(uids, specs, outs)
        ]
        timings["speculator_s"] += t1 - t0
        timings["scoring_s"] += time.perf_counter() - t1
        cached = [o.num_cached_tokens or 0 for o in outs]
        self.last_cached_tokens += sum(cached)
        self.last_prefilled += [len(s.spec_ids) - c for s, c in zip(specs, cached)]
        return result

    def score_caches(self, prompts: Sequence[list[int]], look_ahead: int = 1) -> list[core.ScoreCache]:
        """Every head's attention weights over each prompt (in the speculator's own tokens), unreduced, from the
        workers' capture: `core.ScoreCache`s that give importance for any knob, layer or head, as the transformers
        capture does, for a model of any size and tensor-parallel width. One prompt at a time: the weights kept,
        L x H x N x M fp32 per prompt spread over the ranks, are not bounded by the speculation budget."""
        from vllm import TokensPrompt

        config = SpecPrefillConfig(look_ahead=look_ahead)
        require_tokens(prompts)
        for p in prompts:
            check_look_ahead(len(p), config, self.max_model_len, self.context)
        out: list[core.ScoreCache] = []
        for prompt in prompts:
            ids = [list(prompt)]
            uids = [uuid.uuid4().hex for _ in ids]
            params = [speculation_params(uid, len(p), config, self.eos_ids, raw=True) for uid, p in zip(uids, ids)]
            try:
                outs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in ids], params, use_tqdm=False)
            finally:
                per_rank = self.llm.collective_rpc("specprefill_collect", args=(uids,))
            out += [
                core.ScoreCache(
                    p, raw_scores([rank[uid] for rank in per_rank], len(o.outputs[0].token_ids), look_ahead)
                )
                for p, uid, o in zip(ids, uids, outs)
            ]
        return out

    def peak_extra_bytes(self, reset: bool = False) -> list[int]:
        """Per rank: the most memory speculation held at once (prompt keys + running scores) since the last reset;
        `bench` records it beside every TTFT."""
        return self.llm.collective_rpc("specprefill_peak_bytes", args=(reset,))
