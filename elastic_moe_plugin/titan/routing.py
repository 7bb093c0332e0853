"""One elastic torchtitan MoE forward, and the dispatch of its Σκ kept pairs.

One MoE layer in training (paper §3.2, Eq. 4-5; steps 3-4 are the routing core's
:func:`~elastic_moe_plugin.core.routing.route` under the router's rule, :mod:`.rules`)::

    (1) z [T, E] = gate(x) in fp32                         (as ``TokenChoiceTopKRouter`` computes it)
    (2) κ [T] ~ q on {a..b}                                 (one draw of κ's stream on the host,
                                                             :mod:`.budget_rng`; a recompute replays it)
    (3) ids [T, b] = the top-b by s (+ expert_bias), inside the kept groups, sorted by rank
    (4) slot j kept iff j < κ_t; w [T, b] by the rule over the kept set, × route_scale, 0 beyond κ
    (5) realised counts [E] = #{(t, j) kept : ids[t, j] = e}: the dispatch sizes and what
        ``tokens_per_expert_E`` (the aux-loss-free bias update) adds up, as stock counts its top-k
    (6) the routed experts get ids with −1 in every slot beyond κ (weight 0) and the dispatcher's
        reorder keeps only the Σκ kept pairs (:func:`kept_pairs_reorder`), Σκ known on the host

Every dispatcher that reorders locally (``LocalTokenDispatcher``, ``AllToAllTokenDispatcher``,
``TorchAOTokenDispatcher``: torchtitan's ``_local_reorder``) then sorts, exchanges and multiplies
Σκ rows, not T·b; the expert-parallel all-to-all splits follow the realised counts.

κ ≡ k selects the same experts as stock top-k: the dispatcher's stable sort by expert puts every
expert's rows in token order whatever the slot order, so the expert inputs, scores and the
combine's sums are stock's (bitwise without ``route_norm``; with it the sum over the k kept scores
is taken in rank order, stock's in ``topk(sorted=False)`` order).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from elastic_moe_plugin.core.budget_stream import BudgetDraw
from elastic_moe_plugin.core.plan import LayerPlan
from elastic_moe_plugin.core.router_state import STATE_ATTR, ElasticPath, RouterState, ensure_state
from elastic_moe_plugin.core.routing import route
from elastic_moe_plugin.titan import budget_rng
from elastic_moe_plugin.titan.rules import routing_rule

#: the expert id of a slot beyond κ (it sorts before every expert, so the reorder drops it first)
DROPPED = -1
#: the dispatcher's ``__dict__`` key holding Σκ for the call in flight
KEPT_PAIRS_ATTR = "_elastic_kept_pairs"


def patched_moe_forward(original: Callable, lifecycle: Any, resolve_plan: Callable[[Any, Any], Any]) -> Callable:
    """The replacement of ``MoE.forward``: the stock forward in eval mode, without an active enabled
    config and where the layer's plan is None; else :func:`elastic_forward`. The layer's state is
    resolved once per patch generation."""

    @functools.wraps(original)
    def forward(self, x_BLD: torch.Tensor) -> torch.Tensor:
        generation = lifecycle.generation  # before the config: an apply writes the config first
        config = lifecycle.config
        if config is None or not self.training or not config.enabled:
            return original(self, x_BLD)
        state = self.__dict__.get(STATE_ATTR)
        if state is None or state.generation != generation:
            state = resolve_state(self, resolve_plan(self, config), generation)
        if state.path is None:
            return original(self, x_BLD)
        return elastic_forward(self, state, state.path, x_BLD)

    return forward


def resolve_state(moe: Any, plan: LayerPlan | None, generation: Any) -> RouterState:
    """The MoE's state with ``plan`` for ``generation``: its router's rule, the process's κ stream and shard."""
    state = ensure_state(moe)
    if plan is None:
        return state.resolved(generation, None)
    path = ElasticPath(plan, routing_rule(moe.router, plan.gate), budget_rng.STREAM, budget_rng.token_shard())
    return state.resolved(generation, path)


def elastic_forward(
    moe: Any, state: RouterState, path: ElasticPath, x_BLD: torch.Tensor, budgets: torch.Tensor | None = None
) -> torch.Tensor:
    """Steps 1-6 of the module docstring for ``x_BLD`` [B, L, D]; returns [B, L, D] as ``MoE.forward``.

    ``budgets``: κ [B·L] to use instead of drawing (tests)."""
    plan = path.plan
    batch, length, _ = x_BLD.shape
    num_tokens = batch * length
    with torch.autocast(device_type=x_BLD.device.type, dtype=torch.float32):
        logits = moe.router.gate(x_BLD)  # (1) fp32, as the stock router
    recompute = budget_rng.in_backward()
    drawn = None
    if budgets is None and plan.top_p is None:  # (2)
        drawn = _draw(moe, state, path, num_tokens, x_BLD.device, recompute)
        budgets = drawn.budgets
    routing = route(  # (3)-(4)
        logits.view(num_tokens, -1),
        path.rule,
        plan.width,
        budgets=budgets,
        top_p=plan.top_p,
        selection_bias=moe.expert_bias_E,
    )
    # κ's host copy sizes the dispatch; top-p κ (and a test's) came from the device: one read
    kept_pairs = drawn.total if drawn is not None else int(routing.budgets.sum())
    state.remember(routing, count=not recompute, budget_counts=None if drawn is None else drawn.counts)
    num_experts = logits.shape[-1]
    ids = torch.where(routing.kept, routing.ids, DROPPED)
    counts = realised_counts(ids, num_experts)  # (5)
    with torch.no_grad():  # in every forward, a recompute's included, as stock counts
        moe.tokens_per_expert_E.add_(counts)
    dispatcher = moe.routed_experts.token_dispatcher
    dispatcher.__dict__[KEPT_PAIRS_ATTR] = kept_pairs  # (6)
    try:
        out_BLD = moe.routed_experts(
            x_BLD, routing.weights.view(batch, length, -1), ids.view(batch, length, -1), counts
        )
    finally:
        dispatcher.__dict__.pop(KEPT_PAIRS_ATTR, None)
    if moe.shared_experts is not None:
        out_BLD = out_BLD + moe.shared_experts(x_BLD)
    return out_BLD


def _draw(
    moe: Any, state: RouterState, path: ElasticPath, num_tokens: int, device: torch.device, recompute: bool
) -> BudgetDraw:
    """κ of this forward: the replayed draw in a recompute, else a fresh one (kept as the state's latest)."""
    if recompute:
        return budget_rng.replayed_draw(moe, state, num_tokens, device)
    return state.draw(path, num_tokens, device)


def realised_counts(ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """int64 [E]: the kept (token, expert) pairs per expert of ``ids`` [T, b] (−1 beyond κ), counted
    into an (E+1)-th bin that is dropped, so nothing reads the device."""
    flat = torch.where(ids >= 0, ids, num_experts).view(-1)
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=ids.device)
    return counts.scatter_add_(0, flat, torch.ones_like(flat))[:num_experts]


def kept_pairs_reorder(original: Callable) -> Callable:
    """The replacement of ``LocalTokenDispatcher._local_reorder``: for a call an elastic forward
    made, the stock reorder of the Σκ kept pairs alone (the dropped slots, id −1, sort first and
    are cut off); any other call runs the stock method."""

    @functools.wraps(original)
    def _local_reorder(self, x_TD: torch.Tensor, topk_scores_TK: torch.Tensor, topk_expert_ids_TK: torch.Tensor):
        kept_pairs = self.__dict__.get(KEPT_PAIRS_ATTR)
        if kept_pairs is None:
            return original(self, x_TD, topk_scores_TK, topk_expert_ids_TK)
        width = topk_expert_ids_TK.size(-1)  # b, where the stock method divides by the config's top_k
        order_N = torch.argsort(topk_expert_ids_TK.view(-1), stable=True)
        order_R = order_N[order_N.numel() - kept_pairs :]
        scores_R = topk_scores_TK.view(-1)[order_R]
        token_indices_R = order_R // width
        return x_TD[token_indices_R], token_indices_R, scores_R

    return _local_reorder


__all__ = [
    "DROPPED",
    "KEPT_PAIRS_ATTR",
    "elastic_forward",
    "kept_pairs_reorder",
    "patched_moe_forward",
    "realised_counts",
    "resolve_state",
]
