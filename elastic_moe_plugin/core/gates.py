"""The gate-weighing rules routing runs: which rank slots a token keeps, and the weights they get.

For the same logits, *which* experts a token uses and *how much* each selected expert's output
counts are two separate decisions (``docs/gates.md#gate-conventions``). Routing in both adapters
selects its candidates with its framework's own rules (group limits, expert bias, score
functions) and calls this module for the second decision, so every weight in training comes from
one place. The reference conventions the gate lab compares (selection and weighing together, from
raw logits) live in :mod:`elastic_moe_plugin.tools.gates_lab.conventions` and call these rules too.

Vocabulary
----------
- ``budgets`` κ: ``LongTensor[T]``, the number of experts token t keeps (static top-k: κ ≡ k).
- ``width`` b: the number of rank slots; slot j (0-based) holds the expert at router rank j + 1
  and is *kept* iff j < κ_t (:func:`budget_mask`). Rank order is descending score.
- ``candidates``: ``[T, b]``, the values a rule weighs, sorted by rank.
- ``weights``: ``[T, b]``, exactly 0 in slots that are not kept.

The rules (:func:`weigh_candidates`), with S_t = the κ_t kept slots:

========================  =============================================================
rule                      weight of slot i ∈ S_t
========================  =============================================================
full_softmax              p_i, full-softmax probabilities, unnormalised (Σ_S w ≤ 1)
renormalized              p_i / Σ_{j∈S} p_j
selected_softmax          exp(z_i) / Σ_{j∈S} exp(z_j), from logits (≡ renormalized)
sigmoid                   s_i / (Σ_{j∈S} s_j + 1e-20) if κ_t > 1, else s_i (Megatron)
sigmoid_renormalized      s_i / (Σ_{j∈S} s_j + 1e-20) for every κ_t
========================  =============================================================

Precision and synchronisation: the rules compute in the dtype of ``candidates`` (the adapters
pass fp32, Megatron's and transformers' precision policy). Nothing here synchronises with the
host (no ``.item()``, ``nonzero`` or data-dependent shapes), so every rule is safe inside CUDA
graphs and overlapped pipelines. Budgets above ``width`` keep every slot; a κ = 0 token keeps
nothing and gets weights 0. Neither is checked, because the check would need a host sync.
"""

from __future__ import annotations

import functools

import torch

#: Added to the sigmoid denominator exactly as Megatron's ``topk_routing_with_score_function``.
SIGMOID_EPS = 1e-20

#: the rules :func:`weigh_candidates` knows
WEIGHING_RULES: tuple[str, ...] = ("full_softmax", "renormalized", "selected_softmax", "sigmoid", "sigmoid_renormalized")


def budget_mask(budgets: torch.Tensor, width: int) -> torch.Tensor:
    """The kept-slot mask: ``BoolTensor[T, width]`` with slot j kept iff j < κ_t.

    This is the paper's prefix mask m_j^(κ) = 1[j ≤ κ] over 1-based ranks (Eq. 6), written with
    0-based slots. Built from a broadcast comparison, so it never synchronises with the host.

    Args:
        budgets: ``LongTensor[T]``, κ per token.
        width: number of rank slots (b), a Python int.
    """
    if not isinstance(budgets, torch.Tensor) or budgets.dim() != 1:
        shape = tuple(budgets.shape) if isinstance(budgets, torch.Tensor) else type(budgets).__name__
        raise ValueError(f"budgets must be a LongTensor of shape [T], got {shape}.")
    if isinstance(width, bool) or not isinstance(width, int) or width < 0:
        raise ValueError(f"width={width!r} is invalid: expected an integer >= 0.")
    return _slot_ranks(width, budgets.device) < budgets[:, None]


@functools.lru_cache(maxsize=32)
def _slot_ranks(width: int, device: torch.device) -> torch.Tensor:
    """0..width-1 (int64) on ``device``, built once per (width, device): one op less per router call.
    Read-only by convention (every use compares it). Made outside inference mode, so that a first
    call under ``torch.inference_mode()`` does not cache an inference tensor for training."""
    with torch.inference_mode(False):
        return torch.arange(width, device=device)


def simplex_grad(weights: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """g − Σ_i w_i g_i, computed relative to slot 0 so that exact zeros come out as exact zeros.

    Every normalised gate (renormalised, selected softmax, sigmoid with κ > 1) has a
    vector-Jacobian product (g_j − Σ_i w_i g_i) times a per-slot factor. Subtracting g_0 first
    (the rank-1 slot, always kept) uses Σ_i w_i = 1 and gives (g_j − g_0) − Σ_i w_i (g_i − g_0):
    mathematically the same, but when every kept slot receives the same upstream gradient (top-1,
    or identical expert outputs) each difference is exactly 0, so the router gradient is exactly 0
    instead of rounding noise (``docs/gates.md#router-gradients-expert-outputs-f-held-fixed``).
    """
    centred = grad - grad[..., :1]
    return centred - (weights * centred).sum(-1, keepdim=True)


def softmax_like_backward(ctx, grad: torch.Tensor):
    """w ⊙ (g − Σ w g), centred: the VJP of every softmax-shaped weight (renormalised probabilities
    or a masked softmax), to the first input; None for the second (a mask or detached values)."""
    (weights,) = ctx.saved_tensors
    return weights * simplex_grad(weights, grad), None


class RenormalizedProbs(torch.autograd.Function):
    """w = p_S / Σ p_S from the (no-grad) top-κ probabilities; backward to the *selected logits*.

    The forward is transformers Qwen3's ``top_value /= top_value.sum()`` (bitwise). The backward
    uses w_i = exp(z_i) / Σ_{j∈S} exp(z_j), so ∂w_i/∂z_j = w_i (δ_ij − w_j) for i, j ∈ S: the
    gradient reaches only the selected logits, and unselected logits get an exact 0 rather than
    the rounding residue of the softmax denominator (whose true contribution cancels).
    """

    @staticmethod
    def forward(ctx, selected_logits: torch.Tensor, kept_probs: torch.Tensor) -> torch.Tensor:
        total = kept_probs.sum(-1, keepdim=True)
        # A κ = 0 token keeps nothing: divide by 1 instead of 0 so its weights stay 0, not NaN.
        weights = kept_probs / torch.where(total > 0, total, torch.ones_like(total))
        ctx.save_for_backward(weights)
        return weights

    backward = staticmethod(softmax_like_backward)


def weigh_candidates(
    rule: str,
    candidates: torch.Tensor,
    mask: torch.Tensor,
    *,
    selected_logits: torch.Tensor | None = None,
) -> torch.Tensor:
    """Gate weights ``[T, width]`` of rank-sorted candidates, 0 in slots not kept.

    The one place where training turns selected scores into weights (the table in the module
    docstring; ``docs/gates.md#how-the-plugin-maps-its-gate-setting``).

    Args:
        rule: what ``candidates`` hold and how they are weighed:
            ``"full_softmax"``: full-softmax probabilities p; w = p (unnormalised).
            ``"renormalized"``: full-softmax probabilities p; w = p / Σ_kept p. With
            ``selected_logits`` (the logits of the same slots) the gradient goes to those logits
            through the closed form of :class:`RenormalizedProbs` (exact zeros where the true
            gradient is zero); without, autograd's own.
            ``"selected_softmax"``: logits z; w = softmax of the kept z.
            ``"sigmoid"``: sigmoid-like scores s; w = s / (Σ_kept s + 1e-20) if κ_t > 1, else s
            (Megatron's ``topk > 1`` rule with κ_t for k).
            ``"sigmoid_renormalized"``: scores s; w = s / (Σ_kept s + 1e-20) for every κ_t.
        candidates: ``[T, width]``, sorted by router rank.
        mask: ``BoolTensor[T, width]`` from :func:`budget_mask`; slot 0 must be kept.
        selected_logits: ``[T, width]``, only for ``"renormalized"``.

    Every rule but ``renormalized`` with ``selected_logits`` differentiates with autograd's own
    backward of the same ops as the framework, so a point-mass plan reproduces a framework's stock
    gradients bit for bit (the Megatron adapter's equivalence tests); a top-1 ``selected_softmax``
    gate gradient is exactly zero there too.
    """
    if rule == "full_softmax":
        return torch.where(mask, candidates, torch.zeros_like(candidates))
    if rule == "renormalized":
        kept = torch.where(mask, candidates, torch.zeros_like(candidates))
        if selected_logits is None:
            return kept / kept.sum(-1, keepdim=True)
        return RenormalizedProbs.apply(selected_logits, kept.detach())
    if rule == "selected_softmax":
        # exp(-inf) is exactly 0 beyond κ (slot 0 is always kept) and so is the softmax gradient
        # there (w_j = 0): no second where() to zero them; one where() masks, not ~mask + masked_fill
        return torch.softmax(torch.where(mask, candidates, _negative_infinity(candidates.dtype, candidates.device)), dim=-1)
    if rule in ("sigmoid", "sigmoid_renormalized"):
        kept = torch.where(mask, candidates, torch.zeros_like(candidates))
        normalised = kept / (kept.sum(-1, keepdim=True) + SIGMOID_EPS)
        if rule == "sigmoid_renormalized":
            return normalised
        return torch.where(several_kept(mask), normalised, kept)
    raise ValueError(f"weighing rule {rule!r} is unknown: expected one of {', '.join(WEIGHING_RULES)}.")


@functools.lru_cache(maxsize=16)
def _negative_infinity(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    # a 0-d tensor made once (outside inference mode, as _slot_ranks): a Python -inf costs a
    # scalar_tensor op on every call
    with torch.inference_mode(False):
        return torch.full((), float("-inf"), dtype=dtype, device=device)


def several_kept(mask: torch.Tensor) -> torch.Tensor:
    """``BoolTensor[T, 1]``: κ_t > 1, read off the mask (the second slot is kept), no host sync."""
    return mask[:, 1:2] if mask.shape[1] > 1 else torch.zeros_like(mask[:, :1])


def top_p_budgets(sorted_probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Per-token budgets of cumulative (nucleus) routing: κ [T] from ``sorted_probs`` [T, width].

    κ_t = min{ j : Σ_{i ≤ j} p_(i) ≥ top_p }, the smallest top-ranked set whose full-softmax
    probability reaches ``top_p``, clipped to [1, width] (the paper's top-p control; it changes
    the expected compute, unlike a budget schedule). Counted as the slots whose preceding
    cumulative mass is still below ``top_p``; no host sync.
    """
    preceding = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
    return (preceding < top_p).sum(dim=-1).clamp(min=1, max=sorted_probs.shape[-1])


__all__ = ["SIGMOID_EPS", "WEIGHING_RULES", "RenormalizedProbs", "budget_mask", "several_kept", "simplex_grad",
           "softmax_like_backward", "top_p_budgets", "weigh_candidates"]
