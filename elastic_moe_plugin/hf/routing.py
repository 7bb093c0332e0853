"""Elastic routing for one transformers router forward, and the load-balancing loss on what it dispatched.

One MoE layer in training (paper §3.2, Eq. 4-5; the gate weights follow ``docs/gates.md``)::

    (1) z [T, E] = x W^T                                  (the stock router logits)
    (2) κ [T] ~ q on {a..b}                              (one draw of κ's counter-based stream,
                                                           on the host, hf.budget_rng: this
                                                           process's token shard, saved by the
                                                           Trainer, replayed by gradient
                                                           checkpointing)
    (3) p = softmax(z) in fp32; the top-b candidates by p, sorted by rank
    (4) slot j (0-based) is kept iff j < κ_t; weights by core.gates.weigh_candidates:
            full_softmax  w = p_e                          (norm_topk_prob=False, OLMoE)
            renormalized  w = p_e / Σ_kept p               (norm_topk_prob=True, Qwen3, Mixtral)
    (5) return (z, w [T, b], ids [T, b]): real candidate ids, and weight exactly 0 in every slot
        beyond κ_t; ids is marked with κ on the host, so the patched experts compact the call to
        its Σκ kept pairs in every experts implementation, with shapes known on the host and no
        host sync (:mod:`.experts`). Top-p mode computes κ on the device and reads it once.
    (6) remember the realised routing (ids, kept mask), weakly keyed by the z tensor transformers'
        output recorder collects, for ``load_balancing_loss_func``; plus a routing record (references
        to ids, kept mask and weights; nothing computed) and a bounded κ histogram per router

The experts and the MoE blocks read the routing width from ``top_k_index.size(-1)``, never from
``config.num_experts_per_tok``, so a width b ≠ k needs no further patch (checked for 5.19).

Shapes: T = tokens in the call (batch × sequence), E = ``router.num_experts``, k = ``router.top_k``,
b = the plan's width. Attention-mask polarity, as transformers uses it: 1 = real token.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.weak import WeakIdKeyDictionary

from elastic_moe_plugin.core import records
from elastic_moe_plugin.core.gates import budget_mask, top_p_budgets, weigh_candidates
from elastic_moe_plugin.core.plan import LayerPlan
from elastic_moe_plugin.hf import budget_rng
from elastic_moe_plugin.hf.experts import mark_kept_slots

#: router_logits tensor → the slots dispatched for it: (candidate ids LongTensor [T, b], kept-slot
#: mask BoolTensor [T, b]). Keyed by object identity (a tensor's == is elementwise) and weakly, so
#: entries die with the logits.
_DISPATCHED: WeakIdKeyDictionary = WeakIdKeyDictionary()


def elastic_routing(
    router: torch.nn.Module, plan: LayerPlan, hidden_states: torch.Tensor, budgets: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Elastic replacement of a covered router's ``forward`` for one training call (steps 1-6).

    Args:
        hidden_states: ``[..., H]`` (the MoE block passes ``[T, H]``).
        budgets: ``LongTensor[T]`` to use instead of drawing from the schedule (tests).

    Returns:
        ``router_logits [T, E]`` (the logits' dtype), ``top_k_weights [T, b]`` (the logits' dtype, or
        fp32 where ``plan.cast_weights_to_logits`` is False), ``top_k_index LongTensor[T, b]``: the
        stock contract with width b; slots j >= κ_t have weight exactly 0, and ``top_k_index``
        carries κ on the host for the experts (:func:`.experts.mark_kept_slots`).
    """
    hidden = hidden_states.reshape(-1, router.hidden_dim)
    router_logits = F.linear(hidden, router.weight)  # (1) exactly as the stock router
    num_tokens = router_logits.shape[0]
    width = plan.width
    recompute = _in_backward()
    host_budgets = host_counts = None
    if budgets is None and plan.top_p is None:  # (2) κ's own stream, on the host; a checkpoint's recompute replays
        draw = budget_rng.draw(router, plan, num_tokens, router_logits.device, replay=recompute)
        budgets, host_budgets, host_counts = draw.budgets, draw.host_budgets, draw.counts
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)  # (3) as stock: fp32 softmax
    candidates, candidate_ids = torch.topk(probs, width, dim=-1)  # sorted by rank, like stock top-k
    if budgets is None:  # mode="top_p": the smallest top-ranked set reaching the probability mass
        budgets = top_p_budgets(candidates.detach(), plan.top_p)
    if host_budgets is None:
        # κ was computed on the device (top-p mode) or given (tests): the experts size their work
        # from κ on the host, so read it once (a host sync on an accelerator, none on the CPU).
        host_budgets = budgets.cpu().numpy()
    kept = budget_mask(budgets, width)  # (4)
    if plan.gate == "renormalized":
        # The gradient reaches the kept logits only (w_i = softmax over the kept z), so a κ = 1 token
        # has weight exactly 1 and gate gradient exactly 0 (docs/gates.md), not fp32 rounding residue.
        selected_logits = torch.gather(router_logits, 1, candidate_ids).float()  # [T, b], no fp32 [T, E] copy
        weights = weigh_candidates("renormalized", candidates, kept, selected_logits=selected_logits)
    else:
        weights = weigh_candidates(plan.gate, candidates, kept)
    # (6) A checkpoint's recompute replays the same κ; the step was counted in its first forward.
    # The record keeps references; its logging tensors are derived when a logger reads them.
    records.remember(router, width, budgets, candidate_ids, kept, weights, count=not recompute,
                     host_counts=host_counts)
    if plan.cast_weights_to_logits:
        weights = weights.to(router_logits.dtype)
    _DISPATCHED[router_logits] = (candidate_ids.detach(), kept)  # (6)
    mark_kept_slots(candidate_ids, host_budgets)  # (5)
    return router_logits, weights, candidate_ids  # (5)


def _in_backward() -> bool:
    """True while autograd runs a backward pass, i.e. during a checkpoint's recompute.

    Reentrant checkpointing runs its first forward without grad and recomputes inside backward;
    non-reentrant recomputes inside backward too. Counting only outside backward counts every
    routed token exactly once per step in both modes (and without checkpointing).
    """
    current = getattr(torch._C, "_current_graph_task_id", None)
    return current is not None and current() != -1


def dispatched_slots(gate_logits: tuple[Any, ...]) -> list[tuple[torch.Tensor, torch.Tensor] | None]:
    """Look up, per layer, the slots an elastic router dispatched for those logits (step 6):
    ``(candidate ids [T, b], kept [T, b])``, or None for logits that did not come from an elastic
    training forward. A lookup by tensor identity; nothing is computed."""
    return [_DISPATCHED.get(layer) if isinstance(layer, torch.Tensor) else None for layer in gate_logits]


def realised_load_balancing_loss(
    gate_logits: tuple[torch.Tensor, ...],
    dispatched: list[tuple[torch.Tensor, torch.Tensor] | None],
    num_experts: int,
    top_k: int,
    attention_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """transformers' Switch load-balancing loss, with each layer's counts from what was dispatched.

    With N = Σ_layers Σ_t m_t (m_t = attention-mask value of token t, 1 without a mask)::

        loss = E · Σ_e (c_e / N) · (P_e / N),   P_e = Σ_layers Σ_t m_t · softmax(z_t)_e
        c_e  = Σ_layers Σ_t m_t · #{kept slots of token t routed to e}

    This is transformers' own normalisation (``load_balancing_loss_func`` in 5.19); only c_e
    changes: realised counts for layers with a ``dispatched`` entry, the stock top-k recount
    (``top_k`` on the logits) for layers whose entry is None (eval, static layers). Σ_e c_e / N is
    the mean number of experts per (layer, token): k for static top-k, the realised mean κ for
    elastic layers.

    Args:
        gate_logits: per layer ``[T, E]`` router logits, T = batch × sequence.
        dispatched: per layer ``(candidate ids [T, b], kept mask [T, b])`` (:func:`dispatched_slots`) or None.
        attention_mask: ``[batch, sequence]``, 1 = real token, or None.
    """
    compute_device = gate_logits[0].device
    tokens_per_expert_sum = torch.zeros(num_experts, dtype=torch.float32, device=compute_device)
    router_prob_sum = torch.zeros(num_experts, dtype=torch.float32, device=compute_device)
    total_rows: Any = 0.0
    flat_mask = None
    if attention_mask is not None:
        flat_mask = attention_mask.reshape(-1).to(device=compute_device, dtype=torch.float32)

    for layer_gate, entry in zip(gate_logits, dispatched):
        # Stock P: softmax in the logits' dtype, then fp32 sums (kept identical to transformers).
        routing_weights = torch.nn.functional.softmax(layer_gate.to(compute_device), dim=-1)
        if entry is None:
            _, expert_ids = torch.topk(routing_weights, top_k, dim=-1)
            slot_weights = torch.ones(expert_ids.shape, dtype=torch.float32, device=compute_device)
        else:
            expert_ids = entry[0].to(compute_device)
            slot_weights = entry[1].to(device=compute_device, dtype=torch.float32)
        if flat_mask is None:
            router_prob_sum = router_prob_sum + routing_weights.float().sum(dim=0)
            total_rows = total_rows + routing_weights.shape[0]
        else:
            slot_weights = slot_weights * flat_mask.unsqueeze(-1)
            router_prob_sum = router_prob_sum + (routing_weights.float() * flat_mask.unsqueeze(-1)).sum(dim=0)
            total_rows = total_rows + flat_mask.sum()
        # Unkept slots add weight 0: no boolean indexing, so no host sync.
        tokens_per_expert_sum = tokens_per_expert_sum + torch.zeros(
            num_experts, dtype=torch.float32, device=compute_device
        ).scatter_add_(0, expert_ids.reshape(-1), slot_weights.reshape(-1))

    tokens_per_expert = tokens_per_expert_sum / total_rows
    router_prob_per_expert = router_prob_sum / total_rows
    overall_loss = torch.sum(tokens_per_expert * router_prob_per_expert.unsqueeze(0))
    return overall_loss * num_experts


__all__ = ["dispatched_slots", "elastic_routing", "realised_load_balancing_loss"]
