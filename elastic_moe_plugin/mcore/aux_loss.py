"""Load balancing on the realised assignments: Megatron's three aux losses, one function each.

Stock Megatron (``TopKRouter._apply_aux_loss`` / ``_apply_seq_aux_loss`` / ``_apply_global_aux_loss``)
computes every load-balancing loss on a *fresh static top-k map*, whatever was dispatched. Elastic
routing computes them on the realised map (paper §3.2: "load-balancing statistics use realized
assignments"). Each function here is the realised twin of the stock method of the same name, in
the same order and with the same normalisation, so a diff against stock reads line by line:

    loss = E · coeff · Σ_i P_i · f_i,   P_i = mean_t s_ti,   f_i = c_i / Σ_j c_j = c_i / Σ_t κ_t

with s the full-distribution scores, c the realised per-expert counts (before capacity drops),
and Megatron's ``topk · T`` replaced by the realised Σκ. Under a point mass (κ ≡ k) Σκ = T·k is
known on the host, and the stock count and normalisation functions are called verbatim, so the
result is bit-identical to stock. Nothing here synchronises with the host.

Padding-mask polarity, as Megatron's code uses it: ``padding_mask`` True = padding token.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect

import torch

from elastic_moe_plugin.core.errors import UnsupportedMegatronError
from elastic_moe_plugin.core.plan import LayerPlan
from elastic_moe_plugin.core.routing import balancing_scores


@dataclasses.dataclass(frozen=True)
class RealisedAssignments:
    """What the three losses share for one router forward.

    Attributes:
        scores: [T, E] full-distribution scores s (fp32; padding rows zeroed), as stock computes them.
        valid_map: [T, E] bool, the realised routing map of the valid (non-padding) tokens.
        padding_mask: [T] bool, True = padding, or None.
        host_topk: k when κ ≡ k (a point mass): then stock's own functions apply verbatim; else None.
        seq_length, bsz: the router input's [S, B] shape (seq_aux_loss folds B into the expert axis).
        host_total: Σκ of ``valid_map`` when the host knows it (κ drawn on the host, no padding
            mask), else None. With a reduction group of one rank it is the Σ_j c_j of the loss, so
            the normalisation needs no device op (:func:`_realised_sum`).
    """

    scores: torch.Tensor
    valid_map: torch.Tensor
    padding_mask: torch.Tensor | None
    host_topk: int | None
    seq_length: int
    bsz: int
    host_total: int | None = None


def realised_assignments(
    router,
    plan: LayerPlan,
    logits: torch.Tensor,
    realised_map: torch.Tensor,
    padding_mask: torch.Tensor | None,
    seq_length: int,
    bsz: int,
    probabilities: torch.Tensor | None = None,
    host_total: int | None = None,
) -> RealisedAssignments:
    """Scores and the valid realised map (``logits`` [T, E], ``realised_map`` [T, E] before capacity drops).

    ``probabilities``: ``torch.softmax(logits, dim=-1, dtype=torch.float32)`` [T, E] when the caller
    has computed it already (top-p mode) and nothing else backpropagates through it; else None.
    ``host_total``: Σκ of ``realised_map`` when the host knows it (the κ draw's total), else None.
    """
    scores = aux_loss_scores(logits, router.score_function, padding_mask, probabilities)
    valid_map = realised_map if padding_mask is None else realised_map & (~padding_mask).unsqueeze(-1)
    host_topk = plan.fixed_budget
    return RealisedAssignments(
        scores,
        valid_map,
        padding_mask,
        host_topk,
        seq_length,
        bsz,
        host_total=host_total if padding_mask is None else None,
    )


def aux_loss_scores(
    logits: torch.Tensor,
    score_function: str,
    padding_mask: torch.Tensor | None = None,
    probabilities: torch.Tensor | None = None,
) -> torch.Tensor:
    """The full-distribution scores s [T, E] of the aux losses, bit for bit what Megatron's
    ``compute_routing_scores_for_aux_loss(logits, topk, score_function, fused=False, padding_mask)``
    returns as its scores, without the static top-k map it also builds (a top-k and a scatter over
    [T, E] that realised load balancing never reads)::

        softmax                  s = softmax(z)                          (fp32)
        sigmoid / sqrtsoftplus   s = g(z) / (Σ_e g(z)_e + 1e-20),  g = sigmoid or sqrt(softplus)
        padding rows (padding_mask True) are zeroed

    sigmoid and sqrtsoftplus compute in the dtype stock computes them in (fp32 in megatron-core
    0.19, the logits' own dtype in 0.16: :func:`_stock_score_dtype`).
    """
    if score_function not in ("softmax", "sigmoid", "sqrtsoftplus"):
        raise UnsupportedMegatronError(f"moe_router_score_function={score_function!r} is not supported.")
    if score_function == "softmax" and probabilities is not None:
        scores = probabilities
    else:
        dtype = torch.float32 if score_function == "softmax" else _stock_score_dtype(score_function, logits.dtype)
        scores = balancing_scores(logits, score_function, dtype)
    if padding_mask is not None:
        scores = scores * (~padding_mask).unsqueeze(-1)
    return scores


@functools.lru_cache(maxsize=16)
def _stock_score_dtype(score_function: str, logits_dtype: torch.dtype) -> torch.dtype:
    """The dtype the installed megatron-core computes ``score_function``'s aux-loss scores in for
    logits of ``logits_dtype``: read once from stock's own function on a [1, 2] input (megatron-core
    0.16 applies the sigmoid to the logits as they are, 0.19 to ``logits.float()``). Stock raises
    for a score function it does not know (0.16: sqrtsoftplus), as it would on the real input."""
    from megatron.core.transformer.moe.moe_utils import compute_routing_scores_for_aux_loss

    _, scores = compute_routing_scores_for_aux_loss(
        torch.zeros(1, 2, dtype=logits_dtype), 1, score_function, fused=False
    )
    return scores.dtype


def apply_realised_aux_losses(router, assignments: RealisedAssignments, probs: torch.Tensor) -> torch.Tensor:
    """All three losses, in stock's order, each attached to ``probs`` when its coefficient is > 0."""
    probs = _apply_aux_loss(router, assignments, probs)
    probs = _apply_seq_aux_loss(router, assignments, probs)
    return _apply_global_aux_loss(router, assignments, probs)


# ---------------------------------------------------------------------------------- the three losses
def _apply_aux_loss(router, assignments: RealisedAssignments, probs: torch.Tensor) -> torch.Tensor:
    """``aux_loss``: micro-batch load balancing over the tensor+context-parallel group."""
    coeff = router.get_aux_loss_coeff("aux_loss")
    if coeff == 0:
        return probs
    counts, local_tokens, total_tokens = _token_counts(
        assignments, assignments.valid_map, router.tp_cp_group, assignments.padding_mask
    )
    aux_loss = _switch_loss(
        router,
        assignments,
        assignments.scores,
        counts,
        total_tokens,
        coeff,
        realised_sum=_realised_sum(assignments, router.tp_cp_group),
    )
    return router.attach_and_log_load_balancing_loss(
        probs,
        coeff,
        aux_loss,
        "load_balancing_loss",
        router.tp_cp_group,
        valid_token_count=local_tokens,
        **_attach_kwargs(router, needs_dp_avg=True),
    )


def _apply_seq_aux_loss(router, assignments: RealisedAssignments, probs: torch.Tensor) -> torch.Tensor:
    """``seq_aux_loss``: per-sequence load balancing, averaged over the B sequences.

    As stock, the batch folds into the expert axis (column (b, e) counts sequence b's tokens). With
    κ varying, each sequence s normalises by its own realised Σ_{t∈s} κ_t, in the op order of the
    micro-batch loss, so that on one sequence (B = 1) the two are exactly equal, as stock's are.
    """
    coeff = router.get_aux_loss_coeff("seq_aux_loss")
    if coeff == 0:
        return probs
    bsz, num_experts = assignments.bsz, router.config.num_moe_experts
    seq_scores = assignments.scores.reshape(assignments.seq_length, -1)
    seq_map = assignments.valid_map.reshape(assignments.seq_length, -1)
    if assignments.host_topk is not None:
        counts, local_tokens, total_tokens = _token_counts(
            assignments, seq_map, router.tp_cp_group, None, topk_scale=bsz
        )
        aux_loss = _switch_loss(router, assignments, seq_scores, counts, total_tokens, coeff) / bsz
    else:
        counts, local_tokens, total_tokens = _realised_token_counts(
            seq_map, router.tp_cp_group, assignments.padding_mask
        )
        if assignments.padding_mask is not None:
            # tokens per sequence, averaged over the micro-batch (stock's convention for P)
            local_tokens, total_tokens = local_tokens / bsz, total_tokens / bsz
        # Per sequence s, stock's switch_load_balancing_loss_func with its topk := Σ_{t∈s} κ_t / T,
        # op for op: sum_e(P_se · c_se) · (E·coeff / (topk_s · T · T)), then the mean over the B
        # sequences. On one sequence that is exactly _apply_aux_loss's value (as stock's seq and
        # micro-batch losses are equal there); a fully padded sequence has Σκ = 0 and P = 0, so
        # clamp instead of producing 0/0 = NaN.
        # one sequence with Σκ on the host: the same host normalisation as _apply_aux_loss
        realised_sum = _realised_sum(assignments, router.tp_cp_group) if bsz == 1 else None
        if realised_sum is not None:
            topk = max(realised_sum, 1) / total_tokens
        else:
            sequence_budgets = counts.view(bsz, num_experts).sum(dim=-1).clamp(min=1)
            topk = sequence_budgets / total_tokens
        weighted = (seq_scores.sum(dim=0) * counts).view(bsz, num_experts).sum(dim=-1)
        aux_loss = (weighted * (num_experts * coeff / (topk * total_tokens * total_tokens))).sum() / bsz
    return router.attach_and_log_load_balancing_loss(
        probs,
        coeff,
        aux_loss,
        "seq_load_balancing_loss",
        router.tp_cp_group,
        valid_token_count=local_tokens * bsz,
        **_attach_kwargs(router, needs_dp_avg=True),
    )


def _apply_global_aux_loss(router, assignments: RealisedAssignments, probs: torch.Tensor) -> torch.Tensor:
    """``global_aux_loss``: counts accumulated over micro-batches and the data-parallel group.

    f_i = accumulated c_i / accumulated Σκ: the realised counts sum to the realised budgets.
    """
    coeff = router.get_aux_loss_coeff("global_aux_loss")
    if coeff == 0:
        return probs
    counts, local_tokens, total_tokens = _token_counts(
        assignments, assignments.valid_map, router.tp_dp_cp_group, assignments.padding_mask
    )
    router.global_tokens_per_expert += counts
    router.ga_steps += 1
    averaged_counts = router.global_tokens_per_expert / router.ga_steps
    aux_loss = _switch_loss(router, assignments, assignments.scores, averaged_counts, total_tokens, coeff)
    return router.attach_and_log_load_balancing_loss(
        probs,
        coeff,
        aux_loss,
        "global_load_balancing_loss",
        router.tp_dp_cp_group,
        valid_token_count=local_tokens,
        **_attach_kwargs(router, needs_dp_avg=False),
    )


# ---------------------------------------------------------------------------------- shared steps
def _switch_loss(
    router, assignments: RealisedAssignments, scores, counts, total_tokens, coeff, realised_sum: int | None = None
):
    """Megatron's E·coeff·Σ_i P_i·f_i with f_i = c_i / Σ_j c_j = c_i / Σκ (its topk·T := Σκ).

    Σ_j c_j is ``realised_sum`` when the host knows it (:func:`_realised_sum`), then the scale
    E·coeff / (topk·T·T) is a host float as stock's; else it is read off ``counts`` on the device.
    """
    from megatron.core.transformer.moe.moe_utils import switch_load_balancing_loss_func

    if assignments.host_topk is not None:
        topk = assignments.host_topk
    elif realised_sum is not None:
        topk = realised_sum / total_tokens
    else:
        topk = counts.sum() / total_tokens
    return switch_load_balancing_loss_func(
        probs=scores,
        tokens_per_expert=counts,
        total_num_tokens=total_tokens,
        topk=topk,
        num_experts=router.config.num_moe_experts,
        moe_aux_loss_coeff=coeff,
        fused=False,
    )


def _realised_sum(assignments: RealisedAssignments, group) -> int | None:
    """Σ_j c_j of the loss on the host: the realised Σκ when the host knows it and the counts are
    reduced over one rank only (over several, the other ranks' Σκ would be needed), else None."""
    return assignments.host_total if assignments.host_total and group.size() == 1 else None  # 0 tokens: as the device


def _token_counts(assignments: RealisedAssignments, routing_map, group, padding_mask, topk_scale: int = 1):
    """(global counts [E], local tokens, global tokens): stock's function under a point mass."""
    if assignments.host_topk is not None:
        from megatron.core.transformer.moe.moe_utils import get_tokens_per_expert_and_token_count

        return get_tokens_per_expert_and_token_count(
            routing_map=routing_map,
            reduce_group=group,
            topk=assignments.host_topk * topk_scale,
            with_padding_mask=assignments.padding_mask is not None,
        )
    return _realised_token_counts(routing_map, group, padding_mask)


def _realised_token_counts(routing_map: torch.Tensor, group, padding_mask: torch.Tensor | None):
    """(global realised counts [E], local valid tokens, global valid tokens) without a host sync.

    Valid tokens are counted from the mask (not counts/k, which is wrong once κ varies); with a
    mask, counts and the token count travel in one all-reduce.
    """
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    local_counts = routing_map.sum(dim=0)
    if padding_mask is None:
        num_tokens = routing_map.shape[0]
        return reduce_from_tensor_model_parallel_region(local_counts, group), num_tokens, num_tokens * group.size()
    valid_tokens = (~padding_mask).sum()
    packed = reduce_from_tensor_model_parallel_region(torch.cat([local_counts, valid_tokens.view(1)]), group)
    return packed[:-1], valid_tokens, packed[-1]


def _attach_kwargs(router, needs_dp_avg: bool) -> dict[str, bool]:
    """0.16 names the flag ``reduce_group_has_dp`` (inverse meaning); 0.17+ ``needs_dp_avg``."""
    flag = _attach_flag(type(router).attach_and_log_load_balancing_loss)
    if flag == "needs_dp_avg":
        return {"needs_dp_avg": needs_dp_avg}
    if flag == "reduce_group_has_dp":
        return {"reduce_group_has_dp": not needs_dp_avg}
    return {}


@functools.lru_cache(maxsize=8)
def _attach_flag(method) -> str | None:
    # inspect.signature costs tens of microseconds: once per method, not once per forward
    parameters = inspect.signature(method).parameters
    return next((name for name in ("needs_dp_avg", "reduce_group_has_dp") if name in parameters), None)


__all__ = ["RealisedAssignments", "apply_realised_aux_losses", "aux_loss_scores", "realised_assignments"]
