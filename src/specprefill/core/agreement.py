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


def ordering_tau(a: torch.Tensor, b: torch.Tensor) -> float:
    """The original analysis' Kendall tau: of the two orderings (the token indices sorted by importance, ascending,
    ties by index), not of the values."""
    return kendall_tau(torch.argsort(a.double(), stable=True), torch.argsort(b.double(), stable=True))


# What `layer_agreement` measures for every pair of layers: the original analysis' definitions first (the main figure),
# then the project's variants on the same importances.
LAYER_METRICS = {
    "kl": "KL as the original: kl_div(log_softmax(speculator), softmax(base)), mean over tokens",
    "tau": "Kendall tau of the orderings, as the original",
    "kl_importance": "KL(base || speculator) of the importances normalised to distributions (the project's)",
    "tau_values": "Kendall tau of the importance values, ties as ties (the project's)",
}


def layer_agreement(spec: torch.Tensor, base: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per pair of layers, the two models' per-layer importance over the same tokens, spec [Ls, M] and base
    [Lb, M] -> one [Ls, Lb] matrix per `LAYER_METRICS` key. The original's KL takes a softmax of each importance
    vector (attention probabilities, softmaxed again, as its script does) and averages the pointwise terms over the
    M tokens; the project's normalises each vector by its sum and sums them."""
    if spec.shape[-1] != base.shape[-1]:
        raise ValueError(f"speculator importance over {spec.shape[-1]} tokens, base over {base.shape[-1]}")
    spec, base = spec.double(), base.double()  # converted once, not per pair
    p, q = _distributions(base), _distributions(spec)  # every layer normalised once
    kl_importance = (p * p.log()).sum(-1)[None, :] - q.log() @ p.T  # [Ls, Lb]: sum_t p_j (log p_j - log q_i)
    soft, log_soft = torch.softmax(base, -1), torch.log_softmax(spec, -1)
    kl = ((soft * soft.log()).sum(-1)[None, :] - log_soft @ soft.T) / spec.shape[-1]
    pairs = [(s, b) for s in spec for b in base]
    shape = (spec.shape[0], base.shape[0])
    return {
        "kl": kl,
        "tau": torch.tensor([ordering_tau(s, b) for s, b in pairs], dtype=torch.float64).reshape(shape),
        "kl_importance": kl_importance,
        "tau_values": torch.tensor([kendall_tau(s, b) for s, b in pairs], dtype=torch.float64).reshape(shape),
    }
