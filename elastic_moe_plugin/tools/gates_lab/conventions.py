"""The reference top-k gate conventions the gate lab compares: selection and weights from raw logits.

For the same logits, *which* experts a token uses and *how much* each selected expert's output
counts are two separate decisions, and the way they are combined decides what the router learns
(``docs/gates.md#gate-conventions``). Each convention here is a
:class:`~elastic_moe_plugin.core.routing.RoutingRule` run by the routing core training runs
(:func:`~elastic_moe_plugin.core.routing.select` and :func:`~elastic_moe_plugin.core.routing.weigh`),
so the lab and the product cannot drift apart. The lab only adds, for ``selected_softmax`` and
``sigmoid``, a centred closed-form backward that turns mathematically zero gate gradients into
exact zeros.

Vocabulary
----------
- ``logits`` z: ``[num_tokens, num_experts]`` = [T, E], one finite logit per routed expert.
- ``budgets`` κ: ``LongTensor[T]``, the number of experts token t keeps (static top-k: κ ≡ k).
- ``width`` (kmax): the number of rank slots returned; slot j (0-based) holds the expert at router
  rank j + 1 and is *kept* iff j < κ_t (:func:`budget_mask`). Rank order is descending score.
- ``expert_ids``: ``LongTensor[T, width]``, −1 in slots that are not kept.
- ``weights``: ``[T, width]``, exactly 0 in slots that are not kept.
- ``probs`` / ``routing_map``: Megatron's dense form ``[T, E]`` (:func:`to_dense`).

The conventions, with S_t = the κ_t top-ranked experts of token t and p = softmax(z) over all E:

=================  ==========================  ===================================================
name               selection (rank order by)   weight of expert i ∈ S_t
=================  ==========================  ===================================================
full_softmax       p (≡ z)                     p_i                      (Σ_S w ≤ 1)
renormalized       p (≡ z)                     p_i / Σ_{j∈S} p_j         (Σ_S w = 1)
selected_softmax   z                           exp(z_i) / Σ_{j∈S} exp(z_j)  (≡ renormalized)
sigmoid            s = σ(z) (+ expert_bias)    s_i / (Σ_{j∈S} s_j + 1e-20) if κ_t > 1, else s_i
=================  ==========================  ===================================================

``renormalized`` and ``selected_softmax`` are mathematically identical (p_i / Σ_S p_j: the common
factor 1/Σ_all exp(z) cancels); they differ only in floating-point rounding.

Router-logit gradients with expert outputs F held fixed, for y = Σ_{i∈S} w_i F_i
(``docs/gates.md#router-gradients-expert-outputs-f-held-fixed``; for vector outputs read F_i as
⟨∂L/∂y, F_i⟩):

- full_softmax:  ∂y/∂z_j = p_j (F_j·[j∈S] − y). Top-1 selecting a: p_a(1−p_a)F_a and −p_a p_j F_a;
  an *unselected* logit still receives −p_j y through the softmax denominator.
- renormalized / selected_softmax:  ∂y/∂z_j = w_j (F_j − y) for j ∈ S, and 0 for j ∉ S.
  Top-1 gives w_a = 1 and F_a − y = 0: no task gradient reaches the router through the gate.
  Equal F across S also gives 0 (y = F whatever the weights).
- sigmoid, κ > 1:  ∂y/∂z_j = s_j(1−s_j)(F_j − y) / Σ_S s for j ∈ S;  κ = 1: s_a(1−s_a)F_a.

These are local derivatives inside a fixed selection region; at ties and rank crossings the
selection itself changes (see :func:`~elastic_moe_plugin.tools.gates_lab.gradcheck_router`).

Precision and synchronisation
-----------------------------
Scores are computed in float32, or float64 for float64 logits; weights come back in that dtype.
With ``width`` given, nothing here synchronises with the host (no ``.item()``, ``nonzero`` or
data-dependent shapes), so the functions are safe inside CUDA graphs and overlapped pipelines.
Budgets above ``width`` are treated as ``width`` (all slots kept); budgets must be >= 1 (a κ = 0
token keeps nothing and gets weights 0). Neither is checked when ``width`` is given, because the
check would need a host sync.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from elastic_moe_plugin.core.routing import (
    SIGMOID_EPS,
    Normalization,
    RoutingRule,
    ScoreFunction,
    SelectOn,
    budget_mask,
    select,
    several_kept,
    simplex_grad,
    softmax_like_backward,
    weigh,
)

Convention = Callable[..., "tuple[torch.Tensor, torch.Tensor]"]


def _compute_dtype(logits: torch.Tensor) -> torch.dtype:
    # Scores in fp32 at least (as Megatron and HF do); fp64 stays fp64 so closed forms hold to 1e-12.
    return torch.float64 if logits.dtype == torch.float64 else torch.float32


def _resolve(logits: torch.Tensor, k: int | torch.Tensor, width: int | None) -> tuple[int, torch.Tensor]:
    """Validate the inputs and return (kmax, kept-slot mask [T, kmax]).

    Only shape/dtype metadata is inspected when ``width`` is given: no host sync.
    """
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2:
        shape = tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__
        raise ValueError(f"logits must be a 2-D tensor [num_tokens, num_experts], got {shape}.")
    if not logits.is_floating_point():
        raise ValueError(f"logits must be floating point, got dtype {logits.dtype}.")
    num_tokens, num_experts = logits.shape
    if width is not None and (isinstance(width, bool) or not isinstance(width, int) or not 1 <= width <= num_experts):
        raise ValueError(
            f"width={width!r} is invalid: expected an integer in 1..num_experts={num_experts} "
            f"(adapters pass the schedule's high budget)."
        )
    if isinstance(k, torch.Tensor):
        if k.dim() != 1 or k.shape[0] != num_tokens:
            raise ValueError(
                f"k as a tensor must hold one budget per token, shape [{num_tokens}], got {tuple(k.shape)}."
            )
        if k.dtype not in (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8):
            raise ValueError(f"k as a tensor must be an integer tensor (LongTensor), got dtype {k.dtype}.")
        if k.device != logits.device:
            raise ValueError(f"k is on {k.device} but logits are on {logits.device}: put both on one device.")
        if width is None:
            # No width: find kmax on the host (one sync), and validate the budgets while we are there.
            if num_tokens == 0:
                return 0, torch.zeros(0, 0, dtype=torch.bool, device=logits.device)
            low, high = (int(v) for v in torch.aminmax(k))
            if low < 1 or high > num_experts:
                raise ValueError(f"budgets k must lie in 1..num_experts={num_experts}, got min {low}, max {high}.")
            width = high
        return width, budget_mask(k, width)
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= num_experts:
        raise ValueError(f"k={k!r} is invalid: expected an integer in 1..num_experts={num_experts}.")
    if width is None:
        width = k
    elif width < k:
        raise ValueError(f"width={width} is smaller than k={k}: width must hold every kept slot.")
    mask = (torch.arange(width, device=logits.device) < k).expand(num_tokens, width)
    return width, mask


def _finish(indices: torch.Tensor, weights: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # −1 / 0 in slots beyond κ; torch.where keeps the gradient of kept slots untouched.
    expert_ids = torch.where(mask, indices, torch.full_like(indices, -1))
    weights = torch.where(mask, weights, torch.zeros_like(weights))
    return expert_ids, weights


class _SigmoidRenormalize(torch.autograd.Function):
    """w = s / (Σ s + 1e-20) along the last dim; backward (g − Σ w g) / (Σ s + 1e-20), centred.

    The forward is Megatron's sigmoid normalisation (bitwise). The 1e-20 only guards against
    division by zero; the centred backward (see core.routing.simplex_grad) drops its relative 1e-20 share.
    """

    @staticmethod
    def forward(ctx, kept: torch.Tensor) -> torch.Tensor:
        denominator = kept.sum(-1, keepdim=True) + SIGMOID_EPS
        weights = kept / denominator
        ctx.save_for_backward(weights, denominator)
        return weights

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        weights, denominator = ctx.saved_tensors
        return simplex_grad(weights, grad) / denominator


class _MaskedSoftmax(torch.autograd.Function):
    """w = softmax(x with slots outside ``mask`` at −inf), 0 outside ``mask``; backward w ⊙ (g − Σ w g).

    The forward is ``torch.softmax`` (bitwise Megatron's post-softmax when every slot is kept);
    only the backward is centred (see core.routing.simplex_grad).
    """

    @staticmethod
    def forward(ctx, scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        # Slot 0 always enters the softmax so that a κ = 0 row is finite (its weights are zeroed).
        in_softmax = mask.clone()
        in_softmax[..., :1] = True
        weights = weigh(RoutingRule(normalization="kept_softmax", score_dtype=scores.dtype), scores, in_softmax)
        weights = torch.where(mask, weights, torch.zeros_like(weights))
        ctx.save_for_backward(weights)
        return weights

    backward = staticmethod(softmax_like_backward)


def _rule(
    logits: torch.Tensor, score_function: ScoreFunction, select_on: SelectOn, normalization: Normalization
) -> RoutingRule:
    return RoutingRule(
        score_function,
        select_on,
        normalization,
        renormalization_eps=SIGMOID_EPS if score_function == "sigmoid" else 0.0,
        score_dtype=_compute_dtype(logits),
    )


def full_softmax(
    logits: torch.Tensor, k: int | torch.Tensor, *, width: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Full softmax over all E experts, keep the top-κ probabilities unnormalised.

    p = softmax(z) over E (in fp32, or fp64 for fp64 logits); rank by p; slot j keeps
    (id, p_id) iff j < κ_t. Retained weights sum to Σ_{i∈S} p_i ≤ 1. The "selected
    full-softmax gate" of ``docs/gates.md#gate-conventions`` (Switch top-1, OLMoE ``norm_topk_prob=False``, Megatron
    ``moe_router_pre_softmax=True``). The router gets gradient even for unselected logits, through
    the softmax denominator: ∂y/∂z_j = p_j (F_j·[j∈S] − y).

    Args:
        logits: ``[T, E]`` floating point.
        k: int (static top-k) or ``LongTensor[T]`` budgets κ.
        width: number of slots to return (kmax); default k, or ``k.max()`` (one host sync).

    Returns:
        ``(expert_ids LongTensor[T, width], weights [T, width])``, −1 / 0 in slots j >= κ_t.
    """
    width, mask = _resolve(logits, k, width)
    rule = _rule(logits, "softmax", "scores", "none")
    indices, values = select(logits, rule, width)
    return _finish(indices, weigh(rule, values, mask), mask)


def renormalized(
    logits: torch.Tensor, k: int | torch.Tensor, *, width: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Full softmax, keep the top-κ, divide by the retained sum: w_i = p_i / Σ_{j∈S} p_j.

    "Selected-set renormalisation" (``docs/gates.md#gate-conventions``; Qwen3 ``norm_topk_prob=True``). Retained weights
    sum to 1, so top-1 has the constant weight 1 and no task gradient reaches the router through
    the gate; in general ∂y/∂z_j = w_j (F_j − y) for j ∈ S and 0 otherwise. Mathematically
    identical to :func:`selected_softmax`.

    Same arguments and returns as :func:`full_softmax`.
    """
    width, mask = _resolve(logits, k, width)
    rule = _rule(logits, "softmax", "scores", "kept_sum")
    scores = logits.to(rule.score_dtype)
    with torch.no_grad():  # the gradient goes through the kept logits (core.routing.RenormalizedProbs)
        indices, values = select(scores, rule, width)
    return _finish(indices, weigh(rule, values, mask, logits=scores, ids=indices), mask)


def selected_softmax(
    logits: torch.Tensor, k: int | torch.Tensor, *, width: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-κ on the logits, then a softmax over the κ selected logits only.

    Megatron's default post-softmax router (``moe_router_pre_softmax=False``): top-k on z, then
    softmax over the selected entries; slots beyond κ_t are masked with −inf before the softmax.
    Equal to :func:`renormalized` up to rounding: exp(z_i)/Σ_S exp(z_j) = p_i/Σ_S p_j.

    Same arguments and returns as :func:`full_softmax`.
    """
    width, mask = _resolve(logits, k, width)
    indices, values = select(
        logits.to(_compute_dtype(logits)), _rule(logits, "softmax", "logits", "kept_softmax"), width
    )
    return _finish(indices, _MaskedSoftmax.apply(values, mask), mask)


def sigmoid(
    logits: torch.Tensor,
    k: int | torch.Tensor,
    *,
    width: int | None = None,
    expert_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sigmoid scores, top-κ selection, renormalised when κ > 1 (Megatron's sigmoid router).

    s = σ(z); rank by s + expert_bias (the bias steers *selection only*, as in aux-loss-free
    balancing); weights are the unbiased s_i / (Σ_{j∈S} s_j + 1e-20) for tokens with κ_t > 1 and
    the raw s_a for κ_t = 1: Megatron's ``if topk > 1`` rule, applied per token.

    Args:
        expert_bias: optional ``[E]`` selection bias (no gradient flows through it).

    Otherwise the same arguments and returns as :func:`full_softmax`.
    """
    width, mask = _resolve(logits, k, width)
    if expert_bias is not None and expert_bias.shape != (logits.shape[1],):
        raise ValueError(
            f"expert_bias must have shape [num_experts] = [{logits.shape[1]}], got {tuple(expert_bias.shape)}."
        )
    rule = _rule(logits, "sigmoid", "scores", "kept_sum_if_several")
    bias = None if expert_bias is None else expert_bias.detach()
    indices, values = select(logits, rule, width, selection_bias=bias)
    kept = torch.where(mask, values, torch.zeros_like(values))
    return _finish(indices, torch.where(several_kept(mask), _SigmoidRenormalize.apply(kept), kept), mask)


CONVENTIONS: dict[str, Convention] = {
    "full_softmax": full_softmax,
    "renormalized": renormalized,
    "selected_softmax": selected_softmax,
    "sigmoid": sigmoid,
}
CONVENTION_NAMES: tuple[str, ...] = tuple(CONVENTIONS)


def get_convention(name: str) -> Convention:
    """The convention function called ``name``.

    Raises:
        ValueError: for an unknown name, listing the accepted ones.
    """
    try:
        return CONVENTIONS[name]
    except (KeyError, TypeError):
        hint = (
            " 'auto' is a plugin setting, not a convention: the adapter resolves it to the model's own."
            if name == "auto"
            else ""
        )
        raise ValueError(
            f"gate convention {name!r} is unknown: expected one of {', '.join(CONVENTION_NAMES)}.{hint}"
        ) from None


# ---------------------------------------------------------------------------------- dense form
def to_dense(expert_ids: torch.Tensor, weights: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Megatron's dense routing form from rank slots.

    Args:
        expert_ids: ``LongTensor[T, K]``, −1 in unused slots; ids must be < ``num_experts``
            (not checked: that would need a host sync).
        weights: ``[T, K]``, the gate weight of each slot.
        num_experts: E.

    Returns:
        ``probs [T, E]`` (dtype of ``weights``; 0 where not routed) and ``routing_map
        BoolTensor[T, E]`` (True = token routed to expert). Unused slots are dropped without a
        host sync: they are scattered into an extra column E, which is then cut off.
        Gradients flow from ``probs`` back to ``weights`` of used slots.
    """
    if expert_ids.dim() != 2 or expert_ids.shape != weights.shape:
        raise ValueError(
            f"expert_ids and weights must both be [T, K], got {tuple(expert_ids.shape)} and {tuple(weights.shape)}."
        )
    if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts < 1:
        raise ValueError(f"num_experts={num_experts!r} is invalid: expected a positive integer.")
    used = expert_ids >= 0
    columns = torch.where(used, expert_ids, torch.full_like(expert_ids, num_experts))
    num_tokens = expert_ids.shape[0]
    probs = weights.new_zeros(num_tokens, num_experts + 1).scatter(
        1, columns, torch.where(used, weights, torch.zeros_like(weights))
    )
    routing_map = torch.zeros(num_tokens, num_experts + 1, dtype=torch.bool, device=expert_ids.device).scatter(
        1, columns, used
    )
    return probs[:, :num_experts].contiguous(), routing_map[:, :num_experts].contiguous()


__all__ = [
    "CONVENTIONS",
    "CONVENTION_NAMES",
    "Convention",
    "full_softmax",
    "get_convention",
    "renormalized",
    "selected_softmax",
    "sigmoid",
    "to_dense",
]
