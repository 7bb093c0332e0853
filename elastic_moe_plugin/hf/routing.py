"""Elastic routing for one transformers router call (its forward, or the block's routing method:
DBRX, Jamba 5.19), the kept-slot marks the experts read, and the load-balancing loss on what was
dispatched.

One MoE layer in training (paper §3.2, Eq. 4-5; the routing core, :mod:`elastic_moe_plugin.core.routing`,
does steps 3-4 under the family's :class:`~elastic_moe_plugin.core.routing.RoutingRule`, read by
:mod:`.rules`)::

    (1) z [T, E] = x W^T (+ bias)                         (the stock router logits, in the family's
                                                           dtype: :data:`.rules.LOGITS`; a routing
                                                           method takes its block's)
    (2) κ [T] ~ q on {a..b}                              (one draw of κ's counter-based stream,
                                                           on the host: the router's state,
                                                           core.router_state; a checkpoint's
                                                           recompute replays its forward's draw,
                                                           a looped router's passes last first)
    (3) the top-b candidates by the rule's selection (the family's scores, plus its selection
        bias, inside its groups; or its logits), sorted by rank
    (4) slot j (0-based) is kept iff j < κ_t; weights by the rule over the kept set
        (docs/gates.md): the kept scores (``full_softmax``), or the family's renormalisation
        (``renormalized``: p / Σ_kept p, s / (Σ_kept s + ε), softmax of the kept logits,
        p / max(Σ_kept p, floor), p / ||p_kept||_q), × the family's scaling factor (Gemma 4:
        then × per_expert_scale[id]; Inkling: normalised with its shared experts,
        :func:`shared_sink_weights`)
    (5) return what the stock call returns, in the family's order and dtypes, at width b: (z, or
        Gemma 4's p; w [T, b]; ids [T, b]; Inkling's shared-expert weights), a routing method its
        own pair: real candidate ids, and weight exactly 0 in every slot beyond κ_t; ids is
        marked with κ on the host (:func:`mark_kept_slots`), so the patched experts compact the
        call to its Σκ kept pairs in every experts implementation, with shapes known on the host
        and no host sync (:mod:`.experts`). Top-p mode computes κ on the device and reads it once.
    (6) remember the realised routing (ids, kept mask), weakly keyed by the tensor transformers'
        output recorder collects (z; Gemma 4's p; ERNIE-4.5-VL's merged logits,
        :func:`merging_block_forward`), for ``load_balancing_loss_func``; and, in the router's
        state, what it routed and a bounded κ histogram

The experts and the MoE blocks read the routing width from ``top_k_index.size(-1)``, never from
``config.num_experts_per_tok``, so a width b ≠ k needs no further patch (checked for 5.19).

Shapes: T = tokens in the call (batch × sequence), E and k the router's (its family's
``num_experts_path`` and ``top_k_path``), b = the plan's width. Attention-mask polarity, as
transformers uses it: 1 = real token.
"""

from __future__ import annotations

import contextvars
import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from elastic_moe_plugin.core.budget_stream import to_device
from elastic_moe_plugin.core.plan import LayerPlan
from elastic_moe_plugin.core.router_state import STATE_ATTR, ElasticPath, RouterState, TensorMarks, ensure_state
from elastic_moe_plugin.core.routing import Routing, RoutingRule, balancing_scores, route, score
from elastic_moe_plugin.hf import budget_rng
from elastic_moe_plugin.hf.families import family_of
from elastic_moe_plugin.hf.rules import expert_scale, family_rule, routes_in_fp32, selection_bias
from elastic_moe_plugin.hf.rules import router_logits as router_logits_of

#: the tensor the loss reads (z; Gemma 4's p; ERNIE-4.5-VL's merged logits) → the slots dispatched
#: for it: (candidate ids LongTensor [T, b], kept-slot mask BoolTensor [T, b]). Keyed by the tensor's
#: data, so an alias finds it (DeepSpeed ZeRO-3 re-creates every module output), and weakly.
_DISPATCHED: TensorMarks[tuple[torch.Tensor, torch.Tensor]] = TensorMarks()


#: (router, the slots it dispatched) in call order, while a merging block runs (:func:`merging_block_forward`)
_MERGING: contextvars.ContextVar[list[tuple[Any, tuple[torch.Tensor, torch.Tensor]]] | None] = contextvars.ContextVar(
    "elastic_moe_merging", default=None
)


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
    """The replacement of a covered router's ``forward`` (or of the block's routing method, where
    the family routes in one: :attr:`~.router_family.RouterFamily.routing_method`): the stock call in
    eval mode, without an active enabled config, and where the router's plan is None; else the
    elastic call (:func:`_elastic_call`).

    The router's state is resolved once per patch generation (``resolve_plan`` and the family's
    rule, :func:`resolve_state`); a call only reads it.
    """

    @functools.wraps(original)
    def forward(self, *args: Any, **kwargs: Any):
        generation = lifecycle.generation  # before the config: an apply writes the config first
        config = lifecycle.config
        if config is None or not self.training or not config.enabled:
            return original(self, *args, **kwargs)
        state = self.__dict__.get(STATE_ATTR)
        if state is None or state.generation != generation:
            state = resolve_state(self, family, resolve_plan(self, family, config), generation)
        if state.path is None:
            return original(self, *args, **kwargs)
        return _elastic_call(self, family, state, state.path, _call_arguments(family, args, kwargs))

    return forward


def _call_arguments(family: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """The call's arguments by name: ``hidden_states`` and :attr:`~.router_family.RouterFamily.forward_args`
    for a router's forward, the method's parameters for a routing method.

    Raises:
        TypeError: more positional arguments than the call takes.
    """
    names = family.call_parameters
    if len(args) > len(names):
        raise TypeError(f"{family.router}.{family.patched_method} takes {len(names)} arguments, got {len(args)}")
    return {**dict(zip(names[: len(args)], args, strict=True)), **kwargs}


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
    router: Any, plan: LayerPlan, *args: Any, budgets: torch.Tensor | None = None
) -> tuple[torch.Tensor, ...]:
    """Elastic replacement of a covered router's ``forward`` (or its block's routing method) for one
    training call under ``plan`` (steps 1-6), for a caller that holds a plan (the patched forward
    resolves its own).

    Args:
        router: a router of a covered family (:data:`~.families.FAMILIES`), or the block that
            routes in a method (DBRX, Jamba in 5.19).
        args: the call's arguments, as the block passes them: ``hidden_states`` ``[..., H]`` (the
            MoE block passes ``[T, H]``) and the router's further arguments (MiniMax-M2's
            correction bias); a routing method's own (``router_logits``).
        budgets: ``LongTensor[T]`` to use instead of drawing from the schedule (tests).

    Returns:
        What the stock call returns, in the family's order and dtypes, with width b:
        ``(router_logits [T, E], top_k_weights [T, b], top_k_index LongTensor[T, b])`` for a
        router; slots j >= κ_t have weight exactly 0, and ``top_k_index`` carries κ on the host for
        the experts (:func:`mark_kept_slots`).
    """
    family = family_of(type(router))
    state = ensure_state(router)
    if state.path is None or state.path.plan is not plan:
        resolve_state(router, family, plan, state.generation)
    assert state.path is not None  # resolved just now with a plan
    return _elastic_call(router, family, state, state.path, _call_arguments(family, args, {}), budgets)


def _elastic_call(
    router: Any,
    family: Any,
    state: RouterState,
    path: ElasticPath,
    arguments: dict[str, Any],
    budgets: torch.Tensor | None = None,
) -> tuple[torch.Tensor, ...]:
    plan = path.plan
    hidden_states = arguments.get("hidden_states")
    shared_logits = None
    if family.routing_method is None:
        router_logits = router_logits_of(router, family, arguments["hidden_states"])  # (1) as stock
        if family.shared_sink:  # Inkling: the shared experts' logits come last
            shared = router.n_shared_experts
            router_logits, shared_logits = router_logits[..., :-shared], router_logits[..., -shared:]
    else:
        router_logits = arguments["router_logits"]  # the block computed them (its router is a Linear)
    recompute = _in_backward()
    host_budgets = host_counts = probabilities = None
    if budgets is None and plan.top_p is None:  # (2) κ's own stream, on the host
        drawn = _draw(router, state, path, router_logits, recompute)
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
    shared_weights = None
    if shared_logits is not None:
        routing, shared_weights = shared_sink_weights(router, routing, router_logits, shared_logits, plan.gate)
    # (6) A checkpoint's recompute replays the same κ; the step was counted in its first forward.
    state.remember(routing, count=not recompute, budget_counts=host_counts)
    first = probabilities if family.first_output == "probabilities" and probabilities is not None else router_logits
    _DISPATCHED[first] = (routing.ids.detach(), routing.kept)
    merging = _MERGING.get()
    if merging is not None:  # inside a block that merges its routers' logits (ERNIE-4.5-VL)
        merging.append((router, _DISPATCHED[first]))
    mark_kept_slots(routing.ids, host_budgets)  # (5)
    outputs = {
        "logits": first,
        "weights": _returned_weights(router, family, routing, hidden_states),
        "ids": routing.ids,
    }
    if shared_weights is not None:  # in the routed weights' dtype
        outputs["shared_weights"] = shared_weights.to(outputs["weights"].dtype)
    return tuple(outputs[name] for name in family.outputs)


def shared_sink_weights(
    router: Any, routing: Routing, routed_logits: torch.Tensor, shared_logits: torch.Tensor, gate: str
) -> tuple[Routing, torch.Tensor]:
    """Inkling's weights: the kept routed experts and the S shared experts normalised together
    (:attr:`~.router_family.RouterFamily.shared_sink`), in log space as stock computes them::

        w_i = exp(log σ(z_i) − logsumexp_{j ∈ kept ∪ shared} log σ(z_j)) × route_scale × global_scale

    for the kept slots i (0 beyond κ: their log σ is −inf) and the shared experts alike; under the
    ``full_softmax`` gate the scores as they are, σ(z) × the scales.

    Args:
        routing: the call's routing over the routed experts (its gate weights: their σ, 0 beyond κ).
        routed_logits: z [T, E]; shared_logits: [T, S].

    Returns:
        ``(routing, shared weights [T, S])``: the routing with its weights [T, b] (and its gate
        weights: the share each kept expert gets before the scales) the family's, both in the
        logits' dtype, as stock's before its cast to the hidden dtype.
    """
    scale = router.global_scale.float() if routes_in_fp32(type(router)) else router.global_scale
    if gate == "full_softmax":
        shares = torch.cat([routing.gate_weights, torch.sigmoid(shared_logits)], dim=-1)
    else:
        log_scores = F.logsigmoid(torch.cat([routed_logits.gather(-1, routing.ids), shared_logits], dim=-1))
        kept = torch.cat([routing.kept, torch.ones_like(shared_logits, dtype=torch.bool)], dim=-1)
        log_scores = torch.where(kept, log_scores, torch.full_like(log_scores, float("-inf")))
        shares = torch.exp(log_scores - torch.logsumexp(log_scores, dim=-1, keepdim=True))
    weights = shares * router.route_scale * scale
    width = routing.ids.shape[-1]
    routing = routing._replace(gate_weights=shares[:, :width], weights=weights[:, :width].contiguous())
    return routing, weights[:, width:].contiguous()


def _draw(router: Any, state: RouterState, path: ElasticPath, router_logits: torch.Tensor, recompute: bool):
    """κ [T] of this call from the router's stream (a checkpoint's recompute replays its forward's)."""
    num_tokens, device = router_logits.shape[0], router_logits.device
    if recompute:
        return budget_rng.replayed_draw(router, state, num_tokens, device)
    return state.draw(path, num_tokens, device, replayable=True)


def _returned_weights(router: Any, family: Any, routing: Routing, hidden_states: torch.Tensor | None) -> torch.Tensor:
    """The weights [T, b] in the family's form: × its per-expert scale (Gemma 4: after the
    renormalisation; 0 stays 0 beyond κ), in its dtype."""
    weights = routing.weights
    scale = expert_scale(router, family)
    if scale is not None:
        weights = weights * scale[routing.ids]
    if family.weights_dtype in ("input", "input_then_fp32") and hidden_states is not None:
        weights = weights.to(hidden_states.dtype)  # Ergo: rounded to the hidden dtype, returned fp32
        return weights.float() if family.weights_dtype == "input_then_fp32" else weights
    return weights


def _in_backward() -> bool:
    """True while autograd runs a backward pass, i.e. during a checkpoint's recompute.

    Reentrant checkpointing runs its first forward without grad and recomputes inside backward;
    non-reentrant recomputes inside backward too. Counting only outside backward counts every
    routed token exactly once per step in both modes (and without checkpointing).
    """
    current = getattr(torch._C, "_current_graph_task_id", None)
    return current is not None and current() != -1


def merging_block_forward(original: Callable) -> Callable:
    """Replacement of the ``forward`` of an MoE block whose second output merges the logits [T, E] of
    its routers by token type (ERNIE-4.5-VL: ``moe_mm_token_type_ids`` 0 → the text router's row,
    else the vision router's; :attr:`~.router_family.RouterFamily.merging_block`): runs the original
    and registers, for the merged tensor the loss reads, the slots its elastic routers dispatched in
    this call, merged the same way ([T, b] ids and kept mask). A router of the block that did not
    route in a training call (ERNIE-4.5-VL's vision router on a text-only batch) has its latest
    record forgotten, so that a log does not report an earlier step's routing as this one's. A call
    where no router routed elastically (eval, static layers) registers nothing and returns stock."""

    @functools.wraps(original)
    def forward(self, hidden_states, moe_mm_token_type_ids=None, *args, **kwargs):
        token = _MERGING.set([])
        try:
            output = original(self, hidden_states, moe_mm_token_type_ids, *args, **kwargs)
            dispatched = _MERGING.get()
        finally:
            _MERGING.reset(token)
        if dispatched:
            routed = {id(router) for router, _ in dispatched}
            for module in self.modules():  # the block's elastic routers that did not route this call
                state = module.__dict__.get(STATE_ATTR)
                if state is not None and id(module) not in routed:
                    state.routed = state.record = None
            merged = output[1]
            if len(dispatched) == 1:  # text tokens only: the text router's rows, in order
                _DISPATCHED[merged] = dispatched[0][1]
            else:
                vision = moe_mm_token_type_ids.bool().reshape(-1)
                (_, (text_ids, text_kept)), (_, (vision_ids, vision_kept)) = dispatched
                ids = text_ids.new_empty((vision.numel(), text_ids.shape[-1]))
                kept = text_kept.new_empty(ids.shape)
                ids[~vision], ids[vision] = text_ids, vision_ids
                kept[~vision], kept[vision] = text_kept, vision_kept
                _DISPATCHED[merged] = (ids, kept)
        return output

    return forward


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


#: top_k_index tensor → its KeptSlots, keyed by the tensor's data and weakly (core.router_state's
#: TensorMarks): an alias finds the mark (ZeRO-3's module hooks hand the experts one), the mark dies
#: with the data, and a tensor the MoE block rebuilt is unmarked (the stock forward computes every slot).
_MARKS: TensorMarks[KeptSlots] = TensorMarks()


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
    "merging_block_forward",
    "patched_forward",
    "realised_load_balancing_loss",
    "resolve_state",
    "routing_rule",
]
