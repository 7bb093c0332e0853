"""Elastic routing for one transformers router forward, the kept-slot marks the experts read, and the
load-balancing loss on what was dispatched.

One MoE layer in training (paper §3.2, Eq. 4-5; the routing core, :mod:`elastic_moe_plugin.core.routing`,
does steps 3-4 under the family's :class:`~elastic_moe_plugin.core.routing.RoutingRule`, read by
:mod:`.rules`)::

    (1) z [T, E] = x W^T (+ bias)                         (the stock router logits, in the family's
                                                           dtype: :data:`.rules.LOGITS`)
    (2) κ [T] ~ q on {a..b}                              (one draw of κ's counter-based stream,
                                                           on the host: the router's state,
                                                           core.router_state; a checkpoint's
                                                           recompute replays the latest draw)
    (3) the top-b candidates by the rule's selection (the family's scores, plus its selection
        bias, inside its groups; or its logits), sorted by rank
    (4) slot j (0-based) is kept iff j < κ_t; weights by the rule over the kept set
        (docs/gates.md): the kept scores (``full_softmax``), or the family's renormalisation
        (``renormalized``: p / Σ_kept p, s / (Σ_kept s + ε), softmax of the kept logits,
        p / max(Σ_kept p, floor)), × the family's scaling factor
    (5) return (z, w [T, b], ids [T, b]) in the family's order and dtypes: real candidate ids, and
        weight exactly 0 in every slot
        beyond κ_t; ids is marked with κ on the host (:func:`mark_kept_slots`), so the patched
        experts compact the call to its Σκ kept pairs in every experts implementation, with
        shapes known on the host and no host sync (:mod:`.experts`). Top-p mode computes κ on
        the device and reads it once.
    (6) remember the realised routing (ids, kept mask), weakly keyed by the z tensor transformers'
        output recorder collects, for ``load_balancing_loss_func``; and, in the router's state,
        what it routed and a bounded κ histogram

The experts and the MoE blocks read the routing width from ``top_k_index.size(-1)``, never from
``config.num_experts_per_tok``, so a width b ≠ k needs no further patch (checked for 5.19).

Shapes: T = tokens in the call (batch × sequence), E = ``router.num_experts``, k = ``router.top_k``,
b = the plan's width. Attention-mask polarity, as transformers uses it: 1 = real token.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch.utils.weak import WeakIdKeyDictionary

from elastic_moe_plugin.core.budget_stream import to_device
from elastic_moe_plugin.core.plan import LayerPlan
from elastic_moe_plugin.core.router_state import STATE_ATTR, ElasticPath, RouterState, ensure_state
from elastic_moe_plugin.core.routing import RoutingRule, balancing_scores, route, score
from elastic_moe_plugin.hf import budget_rng
from elastic_moe_plugin.hf.families import family_of
from elastic_moe_plugin.hf.rules import expert_scale, family_rule, selection_bias
from elastic_moe_plugin.hf.rules import router_logits as router_logits_of

#: router_logits tensor → the slots dispatched for it: (candidate ids LongTensor [T, b], kept-slot
#: mask BoolTensor [T, b]). Keyed by object identity (a tensor's == is elementwise) and weakly, so
#: entries die with the logits.
_DISPATCHED: WeakIdKeyDictionary = WeakIdKeyDictionary()


# ---------------------------------------------------------------------------------- the rule
def routing_rule(router: Any, family: Any, plan: LayerPlan) -> RoutingRule:
    """The routing rule of ``router`` (a covered ``family``) under ``plan``'s gate (:func:`.rules.family_rule`)."""
    return family_rule(router, family, plan.gate)


# ---------------------------------------------------------------------------------- the forward
def patched_forward(
    original: Callable,
    family: Any,
    lifecycle: Any,
    resolve_plan: Callable[[torch.nn.Module, Any, Any], LayerPlan | None],
) -> Callable:
    """The replacement of a covered router's ``forward``: the stock forward in eval mode, without
    an active enabled config, and where the router's plan is None; else :func:`_elastic_forward`.

    The router's state is resolved once per patch generation (``resolve_plan`` and the family's
    rule, :func:`resolve_state`); a forward only reads it.
    """

    @functools.wraps(original)
    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any):
        generation = lifecycle.generation  # before the config: an apply writes the config first
        config = lifecycle.config
        if config is None or not self.training or not config.enabled:
            return original(self, hidden_states, *args, **kwargs)
        state = self.__dict__.get(STATE_ATTR)
        if state is None or state.generation != generation:
            state = resolve_state(self, family, resolve_plan(self, family, config), generation)
        if state.path is None:
            return original(self, hidden_states, *args, **kwargs)
        arguments = _forward_arguments(family, args, kwargs) if args or kwargs else None
        return _elastic_forward(self, family, state, state.path, hidden_states, arguments)

    return forward


def _forward_arguments(family: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """The router forward's arguments after ``hidden_states``, by name
    (:attr:`~.family_table.RouterFamily.forward_args`).

    Raises:
        TypeError: more positional arguments than the family's forward takes.
    """
    if len(args) > len(family.forward_args):
        raise TypeError(f"{family.router}.forward takes {len(family.forward_args) + 1} arguments, got {len(args) + 1}")
    return {**dict(zip(family.forward_args[: len(args)], args, strict=True)), **kwargs}


def resolve_state(router: Any, family: Any, plan: LayerPlan | None, generation: Any) -> RouterState:
    """The router's state with ``plan`` for ``generation``: its family's rule, the process's κ
    stream and the router's token shard (:func:`.budget_rng.token_shard`)."""
    state = ensure_state(router)
    if plan is None:
        return state.resolved(generation, None)
    rule = routing_rule(router, family, plan)
    path = ElasticPath(plan, rule, budget_rng.STREAM, budget_rng.token_shard(router)[1])
    return state.resolved(generation, path)


def elastic_routing(
    router: Any, plan: LayerPlan, hidden_states: torch.Tensor, *args: Any, budgets: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Elastic replacement of a covered router's ``forward`` for one training call under ``plan``
    (steps 1-6), for a caller that holds a plan (the patched forward resolves its own).

    Args:
        router: a router of a covered family (:data:`~.families.FAMILIES`).
        hidden_states: ``[..., H]`` (the MoE block passes ``[T, H]``).
        args: the router forward's further arguments, as the block passes them (MiniMax-M2's
            correction bias).
        budgets: ``LongTensor[T]`` to use instead of drawing from the schedule (tests).

    Returns:
        ``(router_logits [T, E], top_k_weights [T, b], top_k_index LongTensor[T, b])`` (ids first
        where the family returns them first), in the family's dtypes: the stock contract with width
        b; slots j >= κ_t have weight exactly 0, and ``top_k_index`` carries κ on the host for the
        experts (:func:`mark_kept_slots`).
    """
    family = family_of(type(router))
    state = ensure_state(router)
    if state.path is None or state.path.plan is not plan:
        resolve_state(router, family, plan, state.generation)
    assert state.path is not None  # resolved just now with a plan
    arguments = _forward_arguments(family, args, {}) if args else None
    return _elastic_forward(router, family, state, state.path, hidden_states, arguments, budgets)


def _elastic_forward(
    router: Any,
    family: Any,
    state: RouterState,
    path: ElasticPath,
    hidden_states: torch.Tensor,
    arguments: dict[str, Any] | None = None,
    budgets: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    plan = path.plan
    router_logits = router_logits_of(router, family, hidden_states)  # (1) as stock
    recompute = _in_backward()
    host_budgets = host_counts = probabilities = None
    if budgets is None and plan.top_p is None:  # (2) κ's own stream, on the host
        num_tokens, device = router_logits.shape[0], router_logits.device
        drawn = (
            budget_rng.replayed_draw(router, state, num_tokens, device)
            if recompute
            else state.draw(path, num_tokens, device)
        )
        budgets, host_budgets, host_counts = drawn.budgets, drawn.host_budgets, drawn.counts
    if family.first_output == "probabilities" or (budgets is None and plan.top_p is not None):
        # Gemma 4 returns p = softmax(z) in fp32 first; top-p ranks the same probability mass
        probabilities = score(router_logits, "softmax", path.rule.score_dtype or router_logits.dtype)
    # (3)-(4)
    routing = route(
        router_logits,
        path.rule,
        plan.width,
        budgets=budgets,
        top_p=plan.top_p,
        selection_bias=selection_bias(router, family, arguments),
        probabilities=probabilities,
    )
    if host_budgets is None:
        # κ was computed on the device (top-p mode) or given (tests): the experts size their work
        # from κ on the host, so read it once (a host sync on an accelerator, none on the CPU).
        host_budgets = routing.budgets.cpu().numpy()
    # (6) A checkpoint's recompute replays the same κ; the step was counted in its first forward.
    state.remember(routing, count=not recompute, budget_counts=host_counts)
    first = probabilities if family.first_output == "probabilities" and probabilities is not None else router_logits
    _DISPATCHED[first] = (routing.ids.detach(), routing.kept)
    mark_kept_slots(routing.ids, host_budgets)  # (5)
    weights = routing.weights
    scale = expert_scale(router, family)
    if scale is not None:  # Gemma 4: × per_expert_scale[id] after the renormalisation (0 stays 0 beyond κ)
        weights = weights * scale[routing.ids]
    weights = weights.to(hidden_states.dtype) if family.weights_dtype == "input" else weights
    if family.ids_first:
        return routing.ids, weights, first
    return first, weights, routing.ids


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

    for layer_gate, entry in zip(gate_logits, dispatched, strict=True):
        # Stock P: softmax in the logits' dtype, then fp32 sums (kept identical to transformers).
        layer_gate = layer_gate.to(compute_device)
        routing_weights = balancing_scores(layer_gate, "softmax", layer_gate.dtype)
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


# ---------------------------------------------------------------------------------- kept-slot marks
@dataclasses.dataclass(frozen=True)
class KeptSlots:
    """What an elastic router dispatched in one call, attached to its ``top_k_index`` [T, b] tensor.

    Attributes:
        host_budgets: κ [T] (int64 numpy) on the host: slot j of token t is kept iff j < κ_t.
        total: P = Σ_t κ_t, a host int.
    """

    host_budgets: np.ndarray
    total: int

    def pairs(self, width: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """``(positions [P], tokens [P])`` of the kept pairs, in token-major order: pair p is
        (t, j) with j < κ_t, at flat slot position t·b + j of the [T, b] routing tensors.

        Built on the host from κ (O(T·b) integer work there) and sent to ``device`` in one copy:
        none on a CPU device, one non-blocking copy from pinned memory on CUDA
        (:func:`~elastic_moe_plugin.core.budget_stream.to_device`). No host sync.
        """
        tokens, slots = np.nonzero(np.arange(width) < self.host_budgets[:, None])
        index = to_device(np.stack([tokens * width + slots, tokens]), device)  # [2, P] int64
        return index[0], index[1]


#: top_k_index tensor → its KeptSlots. Keyed by identity and weakly: the mark dies with the tensor,
#: and a tensor the MoE block rebuilt is unmarked (the stock forward then computes every slot).
_MARKS: WeakIdKeyDictionary = WeakIdKeyDictionary()


def mark_kept_slots(top_k_index: torch.Tensor, host_budgets: np.ndarray) -> None:
    """Tell the experts that only slots j < κ_t of ``top_k_index`` [T, b] must be computed, κ [T]
    given on the host."""
    host_budgets = np.asarray(host_budgets, dtype=np.int64)
    _MARKS[top_k_index] = KeptSlots(host_budgets=host_budgets, total=int(host_budgets.sum()))


def kept_slots(top_k_index: torch.Tensor) -> KeptSlots | None:
    """The mark of an elastic router's ``top_k_index``, or None (stock routing)."""
    return _MARKS.get(top_k_index)


__all__ = [
    "KeptSlots",
    "dispatched_slots",
    "elastic_routing",
    "kept_slots",
    "mark_kept_slots",
    "patched_forward",
    "realised_load_balancing_loss",
    "resolve_state",
    "routing_rule",
]
