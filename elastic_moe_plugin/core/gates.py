"""Top-k gate conventions: the discrete choice of experts, and the differentiable weights it keeps.

Seed 000's point: for the same logits, *which* experts a token uses and *how much* each selected
expert's output counts are two separate decisions, and the way they are combined decides what the
router learns. This module is the single implementation of those decisions; the lab
(:mod:`~elastic_moe_plugin.tools.gates_lab`) and the Megatron / transformers adapters all call it, so
the lab and the product cannot drift apart.

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

Router-logit gradients with expert outputs F held fixed, for y = Σ_{i∈S} w_i F_i (seed 000's
scalar illustration; for vector outputs read F_i as ⟨∂L/∂y, F_i⟩):

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

Convention = Callable[..., "tuple[torch.Tensor, torch.Tensor]"]

#: Added to the sigmoid denominator exactly as Megatron's ``topk_routing_with_score_function``.
SIGMOID_EPS = 1e-20


# ---------------------------------------------------------------------------------------- helpers
def budget_mask(budgets: torch.Tensor, width: int) -> torch.Tensor:
    """The kept-slot mask: ``BoolTensor[T, width]`` with slot j kept iff j < κ_t.

    This is the paper's prefix mask m_j^(κ) = 1[j ≤ κ] over 1-based ranks (Eq. 6), written with
    0-based slots. Built from a broadcast comparison, so it never synchronises with the host.

    Args:
        budgets: ``LongTensor[T]``, κ per token.
        width: number of rank slots (kmax), a Python int.
    """
    if not isinstance(budgets, torch.Tensor) or budgets.dim() != 1:
        shape = tuple(budgets.shape) if isinstance(budgets, torch.Tensor) else type(budgets).__name__
        raise ValueError(f"budgets must be a LongTensor of shape [T], got {shape}.")
    if isinstance(width, bool) or not isinstance(width, int) or width < 0:
        raise ValueError(f"width={width!r} is invalid: expected an integer >= 0.")
    return torch.arange(width, device=budgets.device) < budgets[:, None]


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
                raise ValueError(
                    f"budgets k must lie in 1..num_experts={num_experts}, got min {low}, max {high}."
                )
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


def _simplex_grad(weights: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """g − Σ_i w_i g_i, computed relative to slot 0 so that exact zeros come out as exact zeros.

    Every normalised gate below (renormalised, selected softmax, sigmoid with κ > 1) has a
    vector-Jacobian product (g_j − Σ_i w_i g_i) times a per-slot factor.
    Subtracting g_0 first (the rank-1 slot, always kept) uses Σ_i w_i = 1 and gives
    (g_j − g_0) − Σ_i w_i (g_i − g_0): mathematically the same, but when every kept slot receives
    the same upstream gradient (top-1, or identical expert outputs) each difference is exactly 0,
    so the router gradient is exactly 0 instead of rounding noise. The lab counts exact zeros.
    """
    centred = grad - grad[..., :1]
    return centred - (weights * centred).sum(-1, keepdim=True)


class _SigmoidRenormalize(torch.autograd.Function):
    """w = s / (Σ s + 1e-20) along the last dim; backward (g − Σ w g) / (Σ s + 1e-20), centred.

    The forward is Megatron's sigmoid normalisation (bitwise). The 1e-20 only guards against
    division by zero; the centred backward (see _simplex_grad) drops its relative 1e-20 share.
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
        return _simplex_grad(weights, grad) / denominator


def _softmax_like_backward(ctx, grad: torch.Tensor):
    """w ⊙ (g − Σ w g), centred: the VJP of every softmax-shaped weight (renormalised probabilities
    or a masked softmax), to the first input; None for the second (a mask or detached values)."""
    (weights,) = ctx.saved_tensors
    return weights * _simplex_grad(weights, grad), None


class _RenormalizedProbs(torch.autograd.Function):
    """w = p_S / Σ p_S from the (no-grad) top-κ probabilities; backward to the *selected logits*.

    The forward is HF Qwen3's ``top_value /= top_value.sum()`` (bitwise). The backward uses
    w_i = exp(z_i) / Σ_{j∈S} exp(z_j), so ∂w_i/∂z_j = w_i (δ_ij − w_j) for i, j ∈ S: the gradient
    reaches only the selected logits, and unselected logits get an exact 0 rather than the
    rounding residue of the softmax denominator (whose true contribution cancels).
    """

    @staticmethod
    def forward(ctx, selected_logits: torch.Tensor, kept_probs: torch.Tensor) -> torch.Tensor:
        total = kept_probs.sum(-1, keepdim=True)
        # A κ = 0 token keeps nothing: divide by 1 instead of 0 so its weights stay 0, not NaN.
        weights = kept_probs / torch.where(total > 0, total, torch.ones_like(total))
        ctx.save_for_backward(weights)
        return weights

    backward = staticmethod(lambda ctx, grad: _softmax_like_backward(ctx, grad))


class _MaskedSoftmax(torch.autograd.Function):
    """w = softmax(x with slots outside ``mask`` at −inf), 0 outside ``mask``; backward w ⊙ (g − Σ w g).

    The forward is ``torch.softmax`` (bitwise Megatron's post-softmax when every slot is kept);
    only the backward is centred (see _simplex_grad).
    """

    @staticmethod
    def forward(ctx, scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        # Slot 0 always enters the softmax so that a κ = 0 row is finite (its weights are zeroed).
        in_softmax = mask.clone()
        in_softmax[..., :1] = True
        weights = torch.softmax(scores.masked_fill(~in_softmax, float("-inf")), dim=-1)
        weights = torch.where(mask, weights, torch.zeros_like(weights))
        ctx.save_for_backward(weights)
        return weights

    backward = staticmethod(lambda ctx, grad: _softmax_like_backward(ctx, grad))


# ------------------------------------------------------------------------------ shared weighing
WEIGHING_RULES: tuple[str, ...] = ("full_softmax", "renormalized", "selected_softmax", "sigmoid", "sigmoid_renormalized")


def weigh_candidates(
    rule: str,
    candidates: torch.Tensor,
    mask: torch.Tensor,
    *,
    selected_logits: torch.Tensor | None = None,
    exact_backward: bool = True,
) -> torch.Tensor:
    """Gate weights ``[T, width]`` of rank-sorted candidates, 0 in slots not kept.

    The one place where a convention turns selected scores into weights; the conventions below
    and the Megatron / transformers adapters (which select with their framework's own rules:
    group limits, expert bias, score functions) all call it.

    Args:
        rule: what ``candidates`` hold and how they are weighed:
            ``"full_softmax"``: full-softmax probabilities p; w = p (unnormalised).
            ``"renormalized"``: full-softmax probabilities p; w = p / Σ_kept p. Pass
            ``selected_logits`` (the logits of the same slots) to route the gradient to them.
            ``"selected_softmax"``: logits z; w = softmax of the kept z.
            ``"sigmoid"``: sigmoid-like scores s; w = s / (Σ_kept s + 1e-20) if κ_t > 1, else s
            (Megatron's ``topk > 1`` rule with κ_t for k).
            ``"sigmoid_renormalized"``: scores s; w = s / (Σ_kept s + 1e-20) for every κ_t.
        candidates: ``[T, width]``, sorted by router rank.
        mask: ``BoolTensor[T, width]`` from :func:`budget_mask`; slot 0 must be kept.
        selected_logits: ``[T, width]``, only for ``"renormalized"`` with ``exact_backward``.
        exact_backward: the forward is the same either way. True uses the centred closed-form
            backward (:func:`_simplex_grad`): mathematically zero gate gradients (top-1, identical
            kept outputs) come out as exact zeros, which the lab counts. False uses autograd's own
            backward of the same ops, which reproduces a framework's stock gradients bit for bit
            (the Megatron adapter's point-mass check); top-1 under ``selected_softmax`` is exactly
            zero there too, other zeros carry rounding residue of order 1e-8 (fp32).
    """
    if rule == "full_softmax":
        return torch.where(mask, candidates, torch.zeros_like(candidates))
    if rule == "renormalized":
        kept = torch.where(mask, candidates, torch.zeros_like(candidates))
        if selected_logits is None or not exact_backward:
            return kept / kept.sum(-1, keepdim=True)
        return _RenormalizedProbs.apply(selected_logits, kept.detach())
    if rule == "selected_softmax":
        if exact_backward:
            return _MaskedSoftmax.apply(candidates, mask)
        weights = torch.softmax(candidates.masked_fill(~mask, float("-inf")), dim=-1)
        return torch.where(mask, weights, torch.zeros_like(weights))
    if rule in ("sigmoid", "sigmoid_renormalized"):
        kept = torch.where(mask, candidates, torch.zeros_like(candidates))
        if exact_backward:
            normalised = _SigmoidRenormalize.apply(kept)
        else:
            normalised = kept / (kept.sum(-1, keepdim=True) + SIGMOID_EPS)
        if rule == "sigmoid_renormalized":
            return normalised
        # κ_t from the mask (no host sync): the second slot is kept iff κ_t > 1.
        several = mask[:, 1:2] if mask.shape[1] > 1 else torch.zeros_like(mask[:, :1])
        return torch.where(several, normalised, kept)
    raise ValueError(f"weighing rule {rule!r} is unknown: expected one of {', '.join(WEIGHING_RULES)}.")


def top_p_budgets(sorted_probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Per-token budgets of cumulative (nucleus) routing: κ [T] from ``sorted_probs`` [T, width].

    κ_t = min{ j : Σ_{i ≤ j} p_(i) ≥ top_p }, the smallest top-ranked set whose full-softmax
    probability reaches ``top_p``, clipped to [1, width] (the paper's top-p control; it changes
    the expected compute, unlike a budget schedule). Counted as the slots whose preceding
    cumulative mass is still below ``top_p``; no host sync.
    """
    preceding = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
    return (preceding < top_p).sum(dim=-1).clamp(min=1, max=sorted_probs.shape[-1])


# ---------------------------------------------------------------------------------- conventions
def full_softmax(
    logits: torch.Tensor, k: int | torch.Tensor, *, width: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Full softmax over all E experts, keep the top-κ probabilities unnormalised.

    p = softmax(z) over E (in fp32, or fp64 for fp64 logits); rank by p; slot j keeps
    (id, p_id) iff j < κ_t. Retained weights sum to Σ_{i∈S} p_i ≤ 1. Seed 000's "selected
    full-softmax gate" (Switch top-1, OLMoE ``norm_topk_prob=False``, Megatron
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
    probs = torch.softmax(logits.to(_compute_dtype(logits)), dim=-1)
    values, indices = torch.topk(probs, width, dim=-1, sorted=True)
    return _finish(indices, weigh_candidates("full_softmax", values, mask), mask)


def renormalized(
    logits: torch.Tensor, k: int | torch.Tensor, *, width: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Full softmax, keep the top-κ, divide by the retained sum: w_i = p_i / Σ_{j∈S} p_j.

    Seed 000's "selected-set renormalization" (Qwen3 ``norm_topk_prob=True``). Retained weights
    sum to 1, so top-1 has the constant weight 1 and no task gradient reaches the router through
    the gate; in general ∂y/∂z_j = w_j (F_j − y) for j ∈ S and 0 otherwise. Mathematically
    identical to :func:`selected_softmax`.

    Same arguments and returns as :func:`full_softmax`.
    """
    width, mask = _resolve(logits, k, width)
    scores = logits.to(_compute_dtype(logits))
    with torch.no_grad():  # the gradient goes through the selected logits (see _RenormalizedProbs)
        values, indices = torch.topk(torch.softmax(scores, dim=-1), width, dim=-1, sorted=True)
    selected = torch.gather(scores, 1, indices)
    return _finish(indices, weigh_candidates("renormalized", values, mask, selected_logits=selected), mask)


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
    values, indices = torch.topk(logits.to(_compute_dtype(logits)), width, dim=-1, sorted=True)
    return _finish(indices, weigh_candidates("selected_softmax", values, mask), mask)


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
    scores = torch.sigmoid(logits.to(_compute_dtype(logits)))
    if expert_bias is None:
        values, indices = torch.topk(scores, width, dim=-1, sorted=True)
    else:
        if expert_bias.shape != (logits.shape[1],):
            raise ValueError(
                f"expert_bias must have shape [num_experts] = [{logits.shape[1]}], got {tuple(expert_bias.shape)}."
            )
        _, indices = torch.topk(scores + expert_bias.detach().to(scores.dtype), width, dim=-1, sorted=True)
        values = torch.gather(scores, 1, indices)
    return _finish(indices, weigh_candidates("sigmoid", values, mask), mask)


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
def to_dense(
    expert_ids: torch.Tensor, weights: torch.Tensor, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor]:
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
