"""Pairwise router statistics of two models on the same tokens (paper §6.1-6.2, Eq. 11-12).

For one MoE layer, p and q [T, E] are the two routers' per-token distributions over all E
experts, π(j) the j-th ranked expert (``torch.topk``) and S the top-k set (k = the deployment
top-k):

- JS_t = ½ KL(p_t‖m_t) + ½ KL(q_t‖m_t), m = ½(p + q) (router divergence);
- D1 counts 1[π^A_t(1) ≠ π^B_t(1)] (Eq. 11), Dk sums 1 − |S^A_t ∩ S^B_t| / k (Eq. 12);
- a reorder is a top-1 change where each model's top-1 lies in the other's top-k set;
- rank retention sums ½(1[π^A_t(j) ∈ S^B_t] + 1[π^B_t(j) ∈ S^A_t]) for ranks j = 1..min(E, k + 2).

Only per-layer sums survive a batch (:class:`PairAccumulator`), never per-token values.
"""

from __future__ import annotations

import math
from typing import Any

import torch

#: ranks past the cutoff kept in the rank-retention curve
RETENTION_EXTRA_RANKS = 2


def js_divergence(p: torch.Tensor, q: torch.Tensor, log_base: float = 2.0) -> torch.Tensor:
    """Per-row Jensen-Shannon divergence [T] of distributions p, q [T, E] (paper §6.1).

    JS(p‖q) = ½ Σ_e p_e log(p_e/m_e) + ½ Σ_e q_e log(q_e/m_e), m = ½(p+q), with 0·log 0 = 0, in
    units of log ``log_base`` (base 2: bits, 0 ≤ JS ≤ 1). Computed in float64; exactly 0 for p = q.
    """
    p, q = p.double(), q.double()
    m = 0.5 * (p + q)
    kl_pm = (torch.special.xlogy(p, p) - torch.special.xlogy(p, m)).sum(-1)
    kl_qm = (torch.special.xlogy(q, q) - torch.special.xlogy(q, m)).sum(-1)
    return (0.5 * (kl_pm + kl_qm) / math.log(log_base)).clamp_min(0.0)


def pair_token_sums(p: torch.Tensor, q: torch.Tensor, k: int, log_base: float = 2.0) -> dict[str, torch.Tensor]:
    """Sums over the T tokens of one layer for one model pair (float64 scalars / vectors).

    Args:
        p, q: [T, E] router distributions of models A and B on the same tokens.
        k: the deployment top-k that defines the sets S (Eq. 12).

    Returns ``tokens``; ``js`` = Σ_t JS_t; ``d1`` = Σ_t 1[argmax p_t ≠ argmax q_t] (Eq. 11);
    ``dk`` = Σ_t (1 − |S^A_t ∩ S^B_t| / k) (Eq. 12); ``reorder`` = Σ_t 1[top-1 differs and each
    top-1 lies in the other's top-k]; ``retention`` [J] = Σ_t ½(1[π^A_t(j) ∈ S^B_t] + 1[π^B_t(j) ∈
    S^A_t]) for ranks j = 1..J, J = min(E, k + 2). Rankings are ``torch.topk`` of the
    distributions, so identical inputs give identical rankings, ties included.
    """
    num_tokens, num_experts = p.shape
    ranks = min(num_experts, k + RETENTION_EXTRA_RANKS)
    ids_p = torch.topk(p, ranks, dim=-1).indices
    ids_q = torch.topk(q, ranks, dim=-1).indices
    in_p = torch.zeros(num_tokens, num_experts, dtype=torch.bool).scatter(1, ids_p[:, :k], True)
    in_q = torch.zeros(num_tokens, num_experts, dtype=torch.bool).scatter(1, ids_q[:, :k], True)
    overlap = (in_p & in_q).sum(-1).double()
    top1_differs = ids_p[:, 0] != ids_q[:, 0]
    reorder = top1_differs & in_q.gather(1, ids_p[:, :1]).squeeze(1) & in_p.gather(1, ids_q[:, :1]).squeeze(1)
    retention = 0.5 * (in_q.gather(1, ids_p).double() + in_p.gather(1, ids_q).double())
    return {
        "tokens": torch.tensor(float(num_tokens), dtype=torch.float64),
        "js": js_divergence(p, q, log_base).sum(),
        "d1": top1_differs.double().sum(),
        "dk": (1.0 - overlap / k).sum(),
        "reorder": reorder.double().sum(),
        "retention": retention.sum(0),
    }


class PairAccumulator:
    """Per-layer running sums of :func:`pair_token_sums` for one model pair and one task."""

    def __init__(self) -> None:
        self.sums: dict[int, dict[str, torch.Tensor]] = {}

    def add(self, layer: int, sums: dict[str, torch.Tensor]) -> None:
        current = self.sums.get(layer)
        if current is None:
            self.sums[layer] = {name: value.clone() for name, value in sums.items()}
        else:
            for name, value in sums.items():
                current[name] += value

    def layer_means(self) -> dict[int, dict[str, Any]]:
        """{layer: tokens, the per-token means js / d1 / dk / retention [J], reorder_count, d1_count}."""
        out = {}
        for layer, sums in sorted(self.sums.items()):
            tokens = float(sums["tokens"])
            d1 = float(sums["d1"])
            out[layer] = {
                "tokens": int(tokens),
                "js": float(sums["js"]) / tokens,
                "d1": d1 / tokens,
                "dk": float(sums["dk"]) / tokens,
                "reorder_count": float(sums["reorder"]),
                "d1_count": d1,
                "retention": (sums["retention"] / tokens).tolist(),
            }
        return out
