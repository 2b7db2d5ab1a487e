"""How two importances agree: top-k overlap and Jaccard, KL divergence and Kendall tau, per pair of layers."""

from __future__ import annotations

import torch

from specprefill.config import AGGREGATIONS as AGGREGATIONS  # explicit re-export: `core.AGGREGATIONS`
from specprefill.core.selection import top_k_indices


def top_k_overlap(a: torch.Tensor, b: torch.Tensor, k: int) -> float:
    """|top-k(a) & top-k(b)| / k, ties to the lower index: how much two importance vectors agree."""
    k = max(1, min(k, a.numel()))
    return len(set(top_k_indices(a.float(), k).tolist()) & set(top_k_indices(b.float(), k).tolist())) / k


def top_k_jaccard(a: torch.Tensor, b: torch.Tensor, k: int) -> float:
    """|top-k(a) & top-k(b)| / |top-k(a) | top-k(b)| (ties to the lower index)."""
    k = max(1, min(k, a.numel()))
    sa, sb = set(top_k_indices(a.float(), k).tolist()), set(top_k_indices(b.float(), k).tolist())
    return len(sa & sb) / len(sa | sb)


def _distributions(importance: torch.Tensor, eps: float = 1e-12) -> torch.Tensor:
    """Importance [..., M] -> distributions over the prompt, fp64 (`eps` keeps a token never attended to finite)."""
    x = importance.double().clamp_min(0) + eps
    return x / x.sum(-1, keepdim=True)


def kl_divergence(p: torch.Tensor, q: torch.Tensor) -> float:
    """KL(p || q) in nats of two importance vectors [M], each normalised to a distribution over the prompt (p: the
    reference, e.g. the base's)."""
    p, q = _distributions(p), _distributions(q)
    return float((p * (p / q).log()).sum())


def kendall_tau(a: torch.Tensor, b: torch.Tensor) -> float:
    """Kendall's tau-b rank correlation of two importance vectors [M] (scipy; ties handled), NaN when one is
    constant."""
    from scipy.stats import kendalltau

    return float(kendalltau(a.double().numpy(), b.double().numpy()).statistic)


def layer_agreement(spec: torch.Tensor, base: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per pair of layers: KL(base layer || speculator layer) and Kendall tau between the two models' per-layer
    importance, spec [Ls, M] and base [Lb, M] over the same tokens -> two [Ls, Lb] matrices."""
    if spec.shape[-1] != base.shape[-1]:
        raise ValueError(f"speculator importance over {spec.shape[-1]} tokens, base over {base.shape[-1]}")
    p, q = _distributions(base), _distributions(spec)  # every layer normalised once
    kl = (p * p.log()).sum(-1)[None, :] - q.log() @ p.T  # [Ls, Lb]: sum_t p_j (log p_j - log q_i)
    spec, base = spec.double(), base.double()  # converted once, not per pair
    tau = torch.tensor([[kendall_tau(s, b) for b in base] for s in spec], dtype=torch.float64)
    return kl, tau
