"""The paired fidelity measure of a pruned prefill against the full one, on the same prompt: how likely the gold
answer stays (teacher-forced, per answer token) and how far the first answer token's distribution moves.

An engine gives, per prompt and per prefill (full or pruned), an `AnswerFit`: the log-probability of every gold
answer token given the prompt and the answer tokens before it, and the log-probabilities of the whole vocabulary at
the first answer position. `compare_fits` turns a full and a pruned fit into the two per-prompt numbers:
  delta_loglik  mean over answer tokens of log p_pruned(token) - log p_full(token), nats (0: as likely; < 0: less)
  kl            KL(full || pruned) of the first answer token, nats (0: the same distribution; no gold needed)
Both are continuous, so a paired interval over tens of prompts separates what a 0/1 exact match cannot."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specprefill.core.agreement import kl_divergence


@dataclass(frozen=True)
class AnswerFit:
    """One prompt's gold answer under one prefill: `token_logprobs[j]` = log p(answer[j] | prompt, answer[:j]);
    `first` = log-probabilities over the vocabulary at the first answer position (float32 [V])."""

    token_logprobs: tuple[float, ...]
    first: torch.Tensor

    @property
    def mean_logprob(self) -> float:
        """The gold answer's log-likelihood per token (nats)."""
        return sum(self.token_logprobs) / len(self.token_logprobs)


def fit_from_logits(logits: torch.Tensor, answer: Sequence[int]) -> AnswerFit:
    """An `AnswerFit` from the logits [m, V] at the m rows that predict the m answer tokens (row 0: the last prompt
    token's, predicting answer[0]; row j: answer[j-1]'s)."""
    if len(answer) == 0:
        raise ValueError("the gold answer has no tokens: a fidelity measure needs at least one")
    if logits.shape[0] != len(answer):
        raise ValueError(f"{logits.shape[0]} rows of logits for {len(answer)} answer tokens")
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    picked = logprobs.gather(1, torch.as_tensor(list(answer), dtype=torch.long).view(-1, 1)).view(-1)
    return AnswerFit(tuple(picked.tolist()), logprobs[0].clone())


def compare_fits(full: AnswerFit, pruned: AnswerFit) -> dict[str, float]:
    """The two paired numbers of one prompt (module docstring)."""
    if len(full.token_logprobs) != len(pruned.token_logprobs):
        raise ValueError("the full and the pruned fit score different answers")
    if full.first.shape != pruned.first.shape:
        raise ValueError(f"first-token distributions over {full.first.numel()} and {pruned.first.numel()} tokens")
    return {
        "delta_loglik": pruned.mean_logprob - full.mean_logprob,
        "kl": max(0.0, kl_divergence(full.first.double().exp(), pruned.first.double().exp())),
    }
