"""Token-selection methods: which prompt tokens the base model receives, SpecPrefill and the baselines it is
compared with.

Each method is a small class that writes only its `score()` (per-token importance; the one shared top-k,
`core.select`, turns scores into kept chunks at the keep rate) or, when it is not score-based, its `kept()`.
`METHODS` is the registry by name; `Selection` caches each method's scores for one set of prompts, so a sweep over
keep rates runs the speculator once.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Sequence

import torch

from specprefill import core
from specprefill.errors import SpecPrefillError

Prompts = Sequence[Sequence[int]]


class Method:
    """Scores -> the shared top-k. `uses`: the config fields its scores depend on (with the seed if `seeded`)."""

    name: ClassVar[str] = ""
    uses: ClassVar[tuple[str, ...]] = ()
    seeded: ClassVar[bool] = False

    def score(self, llm, prompts: Prompts, config: core.SpecPrefillConfig, seed: int) -> list[torch.Tensor]:
        raise NotImplementedError

    def score_key(self, config: core.SpecPrefillConfig, seed: int) -> tuple:
        return (self.name, seed if self.seeded else None, *(getattr(config, f) for f in self.uses))

    def kept(self, scores: list[torch.Tensor] | None, prompts: Prompts,
             config: core.SpecPrefillConfig) -> list[list[int] | None]:
        return [core.select(s, config).tolist() for s in scores]


class Full(Method):
    """The whole prompt (no pruning): None per prompt."""

    name = "full"

    def score(self, llm, prompts, config, seed):
        return None

    def kept(self, scores, prompts, config):
        return [None] * len(prompts)


class SpecPrefill(Method):
    """The speculator's attention of its last prompt token and look-ahead tokens over the prompt."""

    name = "specprefill"
    uses = ("look_ahead", "pool_kernel", "layer_head_agg", "step_agg", "cross_token_agg")

    def score(self, llm, prompts, config, seed):
        pruned = llm.speculator.speculate([list(p) for p in prompts], [config] * len(prompts))
        return [torch.tensor(p.importance) for p in pruned]


class RandomChunks(Method):
    """Uniformly random chunks at the same budget (seeded per prompt)."""

    name = "random"
    seeded = True

    def score(self, llm, prompts, config, seed):
        return [torch.rand(len(p), generator=torch.Generator().manual_seed(seed * 100003 + i))
                for i, p in enumerate(prompts)]


class TruncateMiddle(Method):
    """The first and last halves of the token budget, the middle dropped (token level, whatever the chunk size)."""

    name = "truncate_middle"

    def score(self, llm, prompts, config, seed):
        return None

    def kept(self, scores, prompts, config):
        out = []
        for p in prompts:
            m, k = len(p), core.n_to_keep(len(p), config.keep_rate)
            out.append(list(range(k // 2)) + list(range(m - (k - k // 2), m)))
        return out


class SelfInformation(Method):
    """Selective-context style: the surprisal -log p(token | prefix) of each prompt token under the speculator."""

    name = "self_info"

    def score(self, llm, prompts, config, seed):
        return [-torch.tensor(lp) for lp in llm.prompt_logprobs([list(p) for p in prompts])]


METHODS: dict[str, type[Method]] = {cls.name: cls for cls in (Full, SpecPrefill, RandomChunks, TruncateMiddle,
                                                               SelfInformation)}


def method(name: str) -> Method:
    if name not in METHODS:
        raise SpecPrefillError(f"unknown method {name!r}: use one of {', '.join(METHODS)}")
    return METHODS[name]()


@dataclass
class Selection:
    """Kept indices per prompt for any method and config; each method's scores are computed once per key.

    `llm`: a `SpecPrefillLLM` (its speculator scores SpecPrefill and the self-information baseline)."""

    llm: object
    prompts: list[list[int]]
    _scores: dict = field(default_factory=dict)

    def scores(self, name: str, config: core.SpecPrefillConfig, seed: int = 0) -> list[torch.Tensor] | None:
        m = method(name)
        key = m.score_key(config, seed)
        if key not in self._scores:
            self._scores[key] = m.score(self.llm, self.prompts, config, seed)
        return self._scores[key]

    def kept(self, name: str, config: core.SpecPrefillConfig, seed: int = 0) -> list[list[int] | None]:
        return method(name).kept(self.scores(name, config, seed), self.prompts, config)
