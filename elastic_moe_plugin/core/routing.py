"""The routing core: which experts a token keeps and the weight each one gets, written once for every door.

Both doors (Megatron-core, transformers) read their framework's router into a :class:`RoutingRule`
and call :func:`route`; each then hands the result back in its framework's contract (Megatron's
dense ``probs`` / ``routing_map`` [T, E], transformers' ``(logits, weights [T, b], ids [T, b])``).
Nothing here imports a framework.

Vocabulary
----------
- ``logits`` z: [T, E], the router's output for T tokens and E experts.
- ``scores`` s: [T, E] in fp32, the rule's score function of z: softmax (p), sigmoid, or
  sqrt(softplus).
- ``selection``: what experts are ranked by: z, or s (plus a selection-only bias, as
  Megatron's ``expert_bias`` and DeepSeek's ``e_score_correction_bias``).
- ``width`` b: candidate slots per token (the schedule's high budget); slot j (0-based) holds the
  expert at router rank j + 1.
- ``budgets`` κ: [T] int64, the experts token t keeps; slot j is *kept* iff j < κ_t (the paper's
  prefix mask m_j = 1[j ≤ κ], Eq. 6, over 0-based slots). Static top-k is κ ≡ k.
- ``weights``: [T, b], exactly 0 in every slot that is not kept.

The algorithm (:func:`route`)
-----------------------------
1. s = score(z) in fp32 (only where the rule reads scores).
2. selection = z, or s (either + a selection-only bias). Group-limited rules keep ``groups_kept``
   of ``num_groups`` equal expert groups, a group scored by the sum of its top ``group_score_topk``
   selection values, and rank only inside them (:func:`_group_limited_topk`).
3. ids [T, b] = the top-b experts by selection, sorted by rank; values [T, b] = what the rule
   weighs: the kept logits (``kept_softmax``), else the scores.
4. kept [T, b] = j < κ_t (κ given, or top-p: the smallest top-ranked set whose full-softmax mass
   reaches p).
5. gate weights by the rule's normalisation over the kept set S_t (``docs/gates.md#gate-conventions``):

   =====================  ==================================================  ====================
   normalisation          weight of slot i ∈ S_t                              gate convention
   =====================  ==================================================  ====================
   none                   s_i (full-softmax p_i, or a sigmoid score)          full_softmax
   kept_softmax           exp(z_i) / Σ_{j∈S} exp(z_j)                         renormalized
   kept_sum               s_i / (Σ_{j∈S} s_j + ε), / max(Σ s_j, floor), or   renormalized
                          / ||s_S||_p
   kept_sum_if_several    s_i / (Σ_{j∈S} s_j + ε) if κ_t > 1, else s_i        sigmoid_auto
   =====================  ==================================================  ====================

   For softmax scores ``kept_sum`` and ``kept_softmax`` are the same weights; which one a rule
   names is the one its framework computes, so that κ ≡ k reproduces it bit for bit (Megatron:
   softmax over the top-k logits; transformers: p / Σ p).
6. weights = gate weights × ``scaling_factor``, cast to the logits' dtype unless the rule keeps
   fp32 (Mixtral, MiniMax).

Precision and synchronisation: scores and gate weights are fp32 whatever the logits' dtype (both
frameworks' policy). Nothing here reads the device (no ``.item()``, ``nonzero`` or data-dependent
shape), so a routing call is safe in overlapped pipelines. κ above b keeps every slot; κ = 0 keeps
nothing (weights 0, except ``kept_softmax``, whose softmax over no slot is NaN: schedules start at
κ = 1 and top-p clamps to 1); neither is checked, because the check would be a host sync.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Literal, NamedTuple

import torch

ScoreFunction = Literal["softmax", "sigmoid", "sqrtsoftplus"]
SelectOn = Literal["logits", "scores"]
Normalization = Literal["none", "kept_softmax", "kept_sum", "kept_sum_if_several"]

SCORE_FUNCTIONS: tuple[str, ...] = ("softmax", "sigmoid", "sqrtsoftplus")
NORMALIZATIONS: tuple[str, ...] = ("none", "kept_softmax", "kept_sum", "kept_sum_if_several")
#: the denominator's ε of sigmoid-style renormalisation, as Megatron and DeepSeek's routers add it
SIGMOID_EPS = 1e-20
#: normalisation -> the gate convention of docs/gates.md it implements
GATE_CONVENTIONS = {
    "none": "full_softmax",
    "kept_softmax": "renormalized",
    "kept_sum": "renormalized",
    "kept_sum_if_several": "sigmoid_auto",
}


@dataclasses.dataclass(frozen=True)
class RoutingRule:
    """How one router family turns logits into kept experts and weights: data, read by a door
    from its framework's router (the steps of the module docstring).

    Attributes:
        score_function: s = softmax(z), sigmoid(z) or sqrt(softplus(z)), in fp32.
        select_on: rank experts by ``"logits"`` z (Megatron post-softmax, GPT-OSS) or by
            ``"scores"`` s plus the selection bias, when the call passes one.
        normalization: the weight rule over the kept set (module docstring, step 5).
        renormalization_eps: ε of ``kept_sum`` / ``kept_sum_if_several`` (1e-20 for sigmoid
            routers; 0 where the framework divides by the plain sum).
        renormalization_min: a floor on the kept sum instead of ε: the denominator is
            max(Σ_{j∈S} s_j, floor) (ERNIE-4.5's ``moe_norm_min``; ``None``: no floor).
        renormalization_p: ``kept_sum`` divides by the p-norm of the kept scores instead,
            (Σ_{j∈S} |s_j|^p)^(1/p), as ``torch.linalg.vector_norm`` computes it (DBRX's
            ``moe_normalize_expert_weights``; its p = 1 is the sum by that kernel); None: the sum.
        num_groups / groups_kept: group-limited selection (``None``: every expert competes).
        group_score_topk: the top selection values summed to score a group (Megatron: k //
            groups_kept with the model's k, so κ = k keeps the groups stock top-k keeps).
        scaling_factor: multiplies the weights (``None``: 1).
        weights_in_logits_dtype: cast the weights to the logits' dtype (False: keep the scores').
        masked_group_value: what group-limited selection writes over the experts of the groups
            it drops: −inf (Megatron, DeepSeek-V3), or 0.0 (DeepSeek-V2, Mistral-4, AXK-2 rank
            non-negative scores against it).
        score_dtype: the dtype of scores and gate weights: fp32, the frameworks' policy (the
            gate lab computes fp64 logits in fp64, so closed forms hold to 1e-12); ``None``: the
            logits' own dtype (routers that never leave it, e.g. Mistral-4, GPT-OSS).
    """

    score_function: ScoreFunction = "softmax"
    select_on: SelectOn = "scores"
    normalization: Normalization = "kept_sum"
    renormalization_eps: float = 0.0
    renormalization_min: float | None = None
    renormalization_p: float | None = None
    num_groups: int | None = None
    groups_kept: int | None = None
    group_score_topk: int | None = None
    scaling_factor: float | None = None
    weights_in_logits_dtype: bool = True
    masked_group_value: float = float("-inf")
    score_dtype: torch.dtype | None = torch.float32

    def __post_init__(self) -> None:
        if self.score_function not in SCORE_FUNCTIONS:
            raise ValueError(
                f"RoutingRule.score_function={self.score_function!r} is not supported: "
                f"expected one of {', '.join(SCORE_FUNCTIONS)}."
            )
        if self.normalization not in NORMALIZATIONS:
            raise ValueError(
                f"RoutingRule.normalization={self.normalization!r} is unknown: "
                f"expected one of {', '.join(NORMALIZATIONS)}."
            )
        if self.normalization == "kept_softmax" and self.score_function != "softmax":
            raise ValueError(
                "RoutingRule.normalization='kept_softmax' weighs a softmax over the kept logits, "
                f"which only a softmax router has, not {self.score_function!r}."
            )
        if self.renormalization_min is not None and self.renormalization_eps:
            raise ValueError("RoutingRule takes renormalization_eps or renormalization_min, not both.")
        if self.renormalization_p is not None and (self.renormalization_min is not None or self.renormalization_eps):
            raise ValueError("RoutingRule's renormalization_p divides by the plain p-norm: no eps, no floor.")
        if self.groups_kept and not (self.num_groups and self.group_score_topk):
            raise ValueError("RoutingRule.groups_kept needs num_groups and group_score_topk.")

    @property
    def gate(self) -> str:
        """The gate convention of ``docs/gates.md`` the rule's normalisation implements."""
        return GATE_CONVENTIONS[self.normalization]


class Routing(NamedTuple):
    """One routing call's result (shapes: T tokens, b slots).

    Attributes:
        ids: int64 [T, b], candidate experts sorted by rank (valid ids in every slot).
        kept: bool [T, b], slot j kept iff j < κ_t.
        budgets: int64 [T], κ (the one given, or top-p's).
        gate_weights: fp32 [T, b], the weights before scaling and casting (what the records keep).
        weights: [T, b], the gate weights × scaling factor, in the rule's dtype.
    """

    ids: torch.Tensor
    kept: torch.Tensor
    budgets: torch.Tensor
    gate_weights: torch.Tensor
    weights: torch.Tensor


def route(
    logits: torch.Tensor,
    rule: RoutingRule,
    width: int,
    *,
    budgets: torch.Tensor | None = None,
    top_p: float | None = None,
    selection_bias: torch.Tensor | None = None,
    probabilities: torch.Tensor | None = None,
) -> Routing:
    """Route T tokens by ``rule`` with budgets κ (steps 1-6 of the module docstring).

    Args:
        logits: z [T, E].
        width: b, the candidate slots per token (>= every κ_t).
        budgets: κ [T] (int64, on the logits' device); or None with ``top_p``.
        top_p: κ_t = the smallest top-ranked set whose full-softmax mass reaches it (the paper's
            top-p budget control), instead of ``budgets``.
        selection_bias: [E], added to what the rule ranks (its scores, or its logits), for selection only.
        probabilities: p = softmax(z) in fp32 [T, E] when the caller already has it: read as the
            softmax scores, and (detached) for top-p's κ.
    """
    ids, values = select(logits, rule, width, selection_bias=selection_bias, probabilities=probabilities)
    if budgets is None:
        if top_p is None:
            raise ValueError("route() needs budgets κ [T] or top_p.")
        if probabilities is None:
            probabilities = score(logits, "softmax", rule.score_dtype or logits.dtype)
        budgets = top_p_budgets(probabilities.detach().gather(1, ids), top_p)
    kept = budget_mask(budgets, width)
    gate_weights = weigh(rule, values, kept, logits=logits, ids=ids)
    weights = gate_weights * rule.scaling_factor if rule.scaling_factor else gate_weights
    weights = weights.to(logits.dtype) if rule.weights_in_logits_dtype else weights
    return Routing(ids, kept, budgets, gate_weights, weights)


def score(logits: torch.Tensor, score_function: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """s [T, E] = softmax(z), sigmoid(z) or sqrt(softplus(z)) over the last dim, computed in ``dtype``."""
    if score_function == "softmax":
        return torch.softmax(logits, dim=-1, dtype=dtype)
    if score_function == "sigmoid":
        return torch.sigmoid(logits.to(dtype))
    if score_function == "sqrtsoftplus":
        return torch.nn.functional.softplus(logits.to(dtype)).sqrt()
    raise ValueError(
        f"score function {score_function!r} is not supported: expected one of {', '.join(SCORE_FUNCTIONS)}."
    )


def balancing_scores(logits: torch.Tensor, score_function: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The full-distribution scores [T, E] load-balancing losses weigh: p = softmax(z) for softmax
    routers, else s / (Σ_e s_e + ε) with s the sigmoid-style score (Megatron's
    ``compute_routing_scores_for_aux_loss``), in ``dtype``."""
    scores = score(logits, score_function, dtype)
    if score_function == "softmax":
        return scores
    return scores / (scores.sum(dim=-1, keepdim=True) + SIGMOID_EPS)


def select(
    logits: torch.Tensor,
    rule: RoutingRule,
    width: int,
    *,
    selection_bias: torch.Tensor | None = None,
    probabilities: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The top-b candidates of ``rule`` (steps 1-3): ``(ids [T, b], values [T, b])``, sorted by rank.

    ``values`` are what :func:`weigh` weighs: the logits of the candidates for ``kept_softmax``,
    else their fp32 scores (unbiased: a selection bias only ranks, added to the logits or the
    scores, whichever the rule ranks: Kolibri-1 ranks z + b). Taken from the top-b values
    themselves when the rule ranks by what it weighs, else gathered.
    """
    ranked = logits if rule.select_on == "logits" else None
    if ranked is not None and rule.normalization == "kept_softmax" and selection_bias is None:
        top, ids = _top(logits, rule, width)  # ranks and weighs the logits
        return ids, top
    if probabilities is not None and rule.score_function == "softmax":
        scores = probabilities
    else:
        scores = score(logits, rule.score_function, rule.score_dtype or logits.dtype)
    ranked = scores if ranked is None else ranked
    # the frameworks add the bias by type promotion: a bf16 score plus an fp32 bias ranks in fp32
    selection = ranked if selection_bias is None else ranked + selection_bias
    top, ids = _top(selection, rule, width)
    if rule.normalization == "kept_softmax":
        return ids, torch.gather(logits, 1, ids)
    return ids, (top if selection is scores else torch.gather(scores, 1, ids))


def _top(selection: torch.Tensor, rule: RoutingRule, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The top-b of ``selection`` [T, E], sorted by rank: among every expert, or inside the kept groups."""
    if rule.num_groups and rule.groups_kept and rule.group_score_topk:
        return _group_limited_topk(
            selection, width, rule.num_groups, rule.groups_kept, rule.group_score_topk, rule.masked_group_value
        )
    return torch.topk(selection, k=width, dim=1, sorted=True)


def _group_limited_topk(
    selection: torch.Tensor, width: int, groups: int, groups_kept: int, group_score_topk: int, masked_value: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-b inside the groups the rule keeps: each of G groups of E / G experts is scored by the
    sum of its top ``group_score_topk`` selection values, the best ``groups_kept`` groups stay, the
    rest are masked to ``masked_value`` (the same ops as Megatron's ``group_limited_topk``). Only the final top
    widens to b, so κ = k routes exactly as the framework's top-k."""
    num_tokens, num_experts = selection.shape
    group_scores = selection.view(num_tokens, groups, -1).topk(group_score_topk, dim=-1)[0].sum(dim=-1)
    group_ids = torch.topk(group_scores, k=groups_kept, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores).scatter_(1, group_ids, 1)
    expert_mask = group_mask.unsqueeze(-1).expand(num_tokens, groups, num_experts // groups).reshape(num_tokens, -1)
    return torch.topk(selection.masked_fill(~expert_mask.bool(), masked_value), k=width, dim=-1)


def budget_mask(budgets: torch.Tensor, width: int) -> torch.Tensor:
    """The kept-slot mask: bool [T, width], slot j kept iff j < κ_t (a broadcast comparison: no host sync).

    Raises:
        ValueError: ``budgets`` is not [T], or ``width`` is not an integer >= 0.
    """
    if not isinstance(budgets, torch.Tensor) or budgets.dim() != 1:
        shape = tuple(budgets.shape) if isinstance(budgets, torch.Tensor) else type(budgets).__name__
        raise ValueError(f"budgets must be a LongTensor of shape [T], got {shape}.")
    if isinstance(width, bool) or not isinstance(width, int) or width < 0:
        raise ValueError(f"width={width!r} is invalid: expected an integer >= 0.")
    return _slot_ranks(width, budgets.device) < budgets[:, None]


def top_p_budgets(sorted_probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """κ [T] of cumulative (nucleus) routing from rank-sorted full-softmax probabilities [T, b]:
    κ_t = min{ j : Σ_{i ≤ j} p_(i) ≥ top_p }, clipped to [1, b] (the paper's top-p control; it
    changes the expected compute, unlike a budget schedule). No host sync."""
    preceding = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
    return (preceding < top_p).sum(dim=-1).clamp(min=1, max=sorted_probs.shape[-1])


# ---------------------------------------------------------------------------------- weighing
def weigh(
    rule: RoutingRule,
    values: torch.Tensor,
    kept: torch.Tensor,
    *,
    logits: torch.Tensor | None = None,
    ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Gate weights [T, b] (the rule's score dtype) of rank-sorted ``values`` (:func:`select`), 0 beyond κ (step 5).

    ``kept_sum`` over softmax scores differentiates through :class:`RenormalizedProbs` (to the
    kept logits, gathered from ``logits`` at ``ids``); every other rule through autograd's own
    backward of the framework's ops, so κ ≡ k reproduces the framework's gradients bit for bit.
    """
    if rule.score_dtype is not None:
        values = values.to(rule.score_dtype)
    normalization = rule.normalization
    if normalization == "none":
        return torch.where(kept, values, torch.zeros_like(values))
    if normalization == "kept_softmax":
        # exp(-inf) is exactly 0 beyond κ (slot 0 is always kept), and so is its gradient there
        return torch.softmax(torch.where(kept, values, _negative_infinity(values.dtype, values.device)), dim=-1)
    kept_values = torch.where(kept, values, torch.zeros_like(values))
    floor = rule.renormalization_min
    if rule.renormalization_p is not None:  # DBRX: w = s / ||s_S||_p
        normalised = kept_values / torch.linalg.vector_norm(kept_values, rule.renormalization_p, dim=-1, keepdim=True)
        return normalised if normalization == "kept_sum" else torch.where(several_kept(kept), normalised, kept_values)
    softmax_renormalised = normalization == "kept_sum" and rule.score_function == "softmax" and floor is None
    if softmax_renormalised and logits is not None and ids is not None:
        return RenormalizedProbs.apply(
            torch.gather(logits, 1, ids).to(values.dtype), kept_values.detach(), rule.renormalization_eps
        )
    total = kept_values.sum(-1, keepdim=True)
    normalised = kept_values / (total.clamp(min=floor) if floor is not None else total + rule.renormalization_eps)
    if normalization == "kept_sum":
        return normalised
    return torch.where(several_kept(kept), normalised, kept_values)


def several_kept(kept: torch.Tensor) -> torch.Tensor:
    """bool [T, 1]: κ_t > 1, read off the mask (its second slot), no host sync."""
    return kept[:, 1:2] if kept.shape[1] > 1 else torch.zeros_like(kept[:, :1])


def simplex_grad(weights: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """g − Σ_i w_i g_i, computed relative to slot 0 so that exact zeros come out as exact zeros.

    Every normalised gate has a vector-Jacobian product (g_j − Σ_i w_i g_i) times a per-slot
    factor. Subtracting g_0 first (slot 0 is always kept) uses Σ_i w_i = 1: when every kept slot
    receives the same upstream gradient (top-1, or identical expert outputs) each difference is
    exactly 0, so the router gradient is exactly 0 instead of rounding noise
    (``docs/gates.md#router-gradients-expert-outputs-f-held-fixed``).
    """
    centred = grad - grad[..., :1]
    return centred - (weights * centred).sum(-1, keepdim=True)


def softmax_like_backward(ctx, grad: torch.Tensor):
    """w ⊙ (g − Σ w g), centred: the VJP of every softmax-shaped weight to its first input; None
    for the others (a mask, detached values, a constant)."""
    (weights,) = ctx.saved_tensors
    return (weights * simplex_grad(weights, grad),) + (None,) * (len(ctx.needs_input_grad) - 1)


class RenormalizedProbs(torch.autograd.Function):
    """w = p_S / (Σ p_S + ε) from the detached kept probabilities; backward to the *kept logits*.

    The forward is transformers' ``top_value /= top_value.sum()`` (bitwise, ε = 0). The backward
    uses w_i = exp(z_i) / Σ_{j∈S} exp(z_j), so ∂w_i/∂z_j = w_i (δ_ij − w_j) for i, j ∈ S: the
    gradient reaches only the kept logits, and unkept ones get an exact 0 instead of the rounding
    residue of the full softmax's denominator (whose true contribution cancels).
    """

    @staticmethod
    def forward(ctx, kept_logits: torch.Tensor, kept_probs: torch.Tensor, eps: float = 0.0) -> torch.Tensor:
        total = kept_probs.sum(-1, keepdim=True)
        if eps:
            weights = kept_probs / (total + eps)
        else:  # a κ = 0 token keeps nothing: divide by 1 instead of 0 so its weights stay 0, not NaN
            weights = kept_probs / torch.where(total > 0, total, torch.ones_like(total))
        ctx.save_for_backward(weights)
        return weights

    backward = staticmethod(softmax_like_backward)


@functools.lru_cache(maxsize=32)
def _slot_ranks(width: int, device: torch.device) -> torch.Tensor:
    """0..width-1 (int64) on ``device``, made once per (width, device); read-only by convention.
    Made outside inference mode, so that a first call under ``torch.inference_mode()`` does not
    cache an inference tensor for training."""
    with torch.inference_mode(False):
        return torch.arange(width, device=device)


@functools.lru_cache(maxsize=16)
def _negative_infinity(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A 0-d −inf made once (outside inference mode, as :func:`_slot_ranks`): a Python −inf costs
    a ``scalar_tensor`` op on every call."""
    with torch.inference_mode(False):
        return torch.full((), float("-inf"), dtype=dtype, device=device)


__all__ = [
    "GATE_CONVENTIONS",
    "NORMALIZATIONS",
    "SCORE_FUNCTIONS",
    "SIGMOID_EPS",
    "RenormalizedProbs",
    "Routing",
    "RoutingRule",
    "balancing_scores",
    "budget_mask",
    "route",
    "score",
    "select",
    "several_kept",
    "simplex_grad",
    "softmax_like_backward",
    "top_p_budgets",
    "weigh",
]
