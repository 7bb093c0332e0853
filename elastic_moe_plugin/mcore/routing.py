"""Elastic routing for one Megatron ``TopKRouter`` forward: the router read into a routing rule,
budgets, the routing core, capacity, load balancing on the realised assignments, and the tag the
dispatchers read.

The algorithm (paper §3.2, Eq. 4-5) is laid out in :mod:`elastic_moe_plugin.mcore`'s docstring;
:func:`patched_routing` is the patched ``TopKRouter.routing``. A router's state
(:mod:`elastic_moe_plugin.core.router_state`) is resolved once per patch generation, and again
only when one of the options stock reads at every forward changes on the built router
(:func:`router_options`: Megatron's own unit tests change some of them); a forward reads it.
Padding-mask polarity, as Megatron's code uses it: ``padding_mask`` True = padding token.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch

from elastic_moe_plugin.core.config import ElasticConfig
from elastic_moe_plugin.core.errors import UnsupportedMegatronError
from elastic_moe_plugin.core.plan import LayerPlan
from elastic_moe_plugin.core.router_state import STATE_ATTR, ElasticPath, RouterState, ensure_state
from elastic_moe_plugin.core.routing import SIGMOID_EPS, RoutingRule, route, score, select
from elastic_moe_plugin.mcore import budget_rng
from elastic_moe_plugin.mcore.aux_loss import apply_realised_aux_losses, realised_assignments

#: tensor attributes of an elastic routing map (the tag :mod:`.dispatch` reads)
WIDTH_ATTR = "_elastic_moe_width"
BALANCED_ATTR = "_elastic_moe_balanced"
TOTAL_ATTR = "_elastic_moe_total"

#: (score-function family, LayerPlan.gate) -> the routing core's normalisation. Softmax models
#: weigh "renormalized" as a softmax over the kept logits, as Megatron's post-softmax does, so κ = 1
#: gives weight exactly 1; "sigmoid_auto" is the sigmoid / sqrtsoftplus rule only.
_NORMALIZATIONS = {
    ("softmax", "full_softmax"): "none",
    ("softmax", "renormalized"): "kept_softmax",
    ("sigmoid", "sigmoid_auto"): "kept_sum_if_several",
    ("sigmoid", "renormalized"): "kept_sum",
    ("sigmoid", "full_softmax"): "none",
}


# ---------------------------------------------------------------------------------- the rule
def routing_rule(
    score_function: str,
    gate: str,
    *,
    topk: int,
    use_pre_softmax: bool = False,
    num_groups: int | None = None,
    group_topk: int | None = None,
    scaling_factor: float | None = None,
) -> RoutingRule:
    """Megatron's routing (``topk_routing_with_score_function``) as a routing rule::

        softmax, post-softmax (default)   rank by z,        weigh z (renormalized) or p = softmax(z)
        softmax, use_pre_softmax          rank by p,        weigh p, or z for renormalized
        sigmoid / sqrtsoftplus            rank by s + bias, weigh s (unbiased; bias for selection only)

    Group-limited routing scores the groups with the model's k (``topk // group_topk``), so a token
    with κ = k keeps the groups stock top-k keeps.

    Raises:
        UnsupportedMegatronError: another score function, or a ``gate`` of another score function.
    """
    if score_function not in ("softmax", "sigmoid", "sqrtsoftplus"):
        raise UnsupportedMegatronError(f"moe_router_score_function={score_function!r} is not supported.")
    family = "softmax" if score_function == "softmax" else "sigmoid"
    normalization = _NORMALIZATIONS.get((family, gate))
    if normalization is None:
        accepted = sorted(name for (name_family, name) in _NORMALIZATIONS if name_family == family)
        raise UnsupportedMegatronError(
            f"LayerPlan.gate={gate!r} cannot weigh a router whose score_function is {score_function!r} (the plan "
            f"was resolved for another score function, or router.score_function changed after it was). Accepted "
            f"gates for {score_function!r}: {', '.join(accepted)}. Resolve the plan for the router as it is now: "
            f"under mcore.apply plans re-resolve by themselves; a LayerPlan built by hand needs one of those gates."
        )
    return RoutingRule(
        score_function=score_function,  # type: ignore[arg-type]
        select_on="logits" if family == "softmax" and not use_pre_softmax else "scores",
        normalization=normalization,  # type: ignore[arg-type]
        renormalization_eps=SIGMOID_EPS if family == "sigmoid" else 0.0,
        num_groups=num_groups if group_topk else None,
        groups_kept=group_topk or None,
        group_score_topk=topk // group_topk if group_topk else None,
        scaling_factor=scaling_factor or None,
    )


def router_rule(router, plan: LayerPlan) -> RoutingRule:
    """:func:`routing_rule` of ``router`` as it is now, under ``plan``'s gate."""
    model = router.config
    return routing_rule(
        router.score_function,
        plan.gate,
        topk=plan.schedule.center,
        use_pre_softmax=model.moe_router_pre_softmax,
        num_groups=model.moe_router_num_groups,
        group_topk=model.moe_router_group_topk,
        scaling_factor=model.moe_router_topk_scaling_factor,
    )


def select_candidates(
    logits: torch.Tensor,
    width: int,
    topk: int,
    gate: str,
    score_function: str = "softmax",
    use_pre_softmax: bool = False,
    num_groups: int | None = None,
    group_topk: int | None = None,
    expert_bias: torch.Tensor | None = None,
    probabilities: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The top-b candidates of Megatron's selection rule with plain arguments, as Megatron's
    ``topk_routing_with_score_function`` takes them: ``(values [T, b], ids [T, b])``, sorted by
    rank, ``values`` what the gate weighs (fp32 probabilities for full_softmax, raw logits for
    softmax renormalized, unbiased scores for sigmoid / sqrtsoftplus).

    Raises:
        UnsupportedMegatronError: another score function.
    """
    rule = routing_rule(
        score_function, gate, topk=topk, use_pre_softmax=use_pre_softmax, num_groups=num_groups, group_topk=group_topk
    )
    bias = expert_bias if score_function != "softmax" else None
    ids, values = select(logits, rule, width, selection_bias=bias, probabilities=probabilities)
    return values, ids


# ---------------------------------------------------------------------------------- the state
def router_options(router) -> tuple:
    """What stock reads off a built router at every forward and a caller can change: the layer
    number, the score function, and the config's top-k, experts, pre-softmax, group limit, scaling
    factor, fusion and routing-replay flags. A change re-resolves the router's state, and re-runs
    the start-up checks, at the next forward."""
    model = router.config
    return (
        router.layer_number,
        router.score_function,
        model.moe_router_topk,
        model.num_moe_experts,
        model.moe_router_pre_softmax,
        model.moe_router_num_groups,
        model.moe_router_group_topk,
        model.moe_router_topk_scaling_factor,
        getattr(model, "moe_router_fusion", False),
        getattr(model, "moe_enable_routing_replay", False),
    )


def token_shard(router) -> tuple[int, int]:
    """(number of token shards, this rank's shard) of the router's input tokens.

    Ranks hold different tokens across data, context and, with sequence parallelism, tensor
    parallelism; tensor-parallel peers without SP hold the same tokens. Read from the router's
    ``tp_dp_cp`` group (tensor-parallel ranks are its fastest-varying axis in Megatron's layouts).
    """
    group = getattr(router, "tp_dp_cp_group", None)
    if group is None or group.size() == 1:
        return 1, 0
    tp_size = router.tp_group.size() if getattr(router, "tp_group", None) is not None else 1
    if tp_size == 1 or router.config.sequence_parallel:
        return group.size(), group.rank()
    ranks = sorted(torch.distributed.get_process_group_ranks(group))
    tp_ranks = sorted(torch.distributed.get_process_group_ranks(router.tp_group))
    start = ranks.index(tp_ranks[0])
    if ranks[start : start + tp_size] != tp_ranks:
        raise UnsupportedMegatronError(
            "elastic-moe draws one budget per token shard and needs tensor-parallel ranks to be contiguous "
            f"in the tensor+data+context group (got TP ranks {tp_ranks} in {ranks}); use an order that "
            "starts with 'tp' (Megatron's default 'tp-cp-ep-dp-pp')."
        )
    return group.size() // tp_size, start // tp_size


def resolve_state(router: Any, plan: LayerPlan | None, generation: Any, options: Any = None) -> RouterState:
    """The router's state with ``plan`` for ``generation``: its rule (:func:`router_rule`), κ's
    stream in Megatron's RNG tracker (:mod:`.budget_rng`) and the router's token shard."""
    state = ensure_state(router)
    if plan is None:
        return state.resolved(generation, None, options)
    path = ElasticPath(plan, router_rule(router, plan), budget_rng.STREAM, token_shard(router)[1])
    return state.resolved(generation, path, options)


def training_state(
    router: Any, config: ElasticConfig, generation: Any, resolve_plan: Callable[[Any, ElasticConfig], LayerPlan | None]
) -> RouterState | None:
    """The state of this forward, or None when the stock path must run (eval mode, a disabled
    config, a plan of None: an MTP layer, a static schedule, a layer outside ``layers``)."""
    if not router.training or not config.enabled:
        return None
    state = router.__dict__.get(STATE_ATTR)
    options = router_options(router)
    if state is None or state.generation != generation or state.options != options:
        state = resolve_state(router, resolve_plan(router, config), generation, options)
    return state if state.path is not None else None


def patched_routing(
    original: Callable, lifecycle: Any, resolve_plan: Callable[[Any, ElasticConfig], LayerPlan | None]
) -> Callable:
    """The replacement of ``TopKRouter.routing``: :func:`elastic_forward` where the router's state
    has an elastic path (:func:`training_state`), else the original, bit for bit stock.

    It takes whatever the stock method takes (``*args, **kwargs``): the stock path passes every
    argument on untouched, so a Megatron that adds one (Megatron-LM's SeqTopK branch calls
    ``self.routing(logits, padding_mask=..., seq_idx=...)``) keeps working in eval, static layers
    and MTP layers; the elastic path reads them through :func:`elastic_arguments`."""

    @functools.wraps(original)
    def routing(self, logits: torch.Tensor, *args: Any, **kwargs: Any):
        generation = lifecycle.generation  # before the config: an apply writes the config first
        config = lifecycle.config
        state = training_state(self, config, generation, resolve_plan) if config is not None else None
        if state is None or state.path is None:
            return original(self, logits, *args, **kwargs)
        padding_mask = elastic_arguments(original, args, kwargs)
        return elastic_forward(self, state, state.path, logits, padding_mask)

    return routing


@functools.lru_cache(maxsize=16)
def _signature(stock: Callable) -> inspect.Signature:
    return inspect.signature(stock)


def unread_arguments(
    stock: Callable, leading: int, args: tuple, kwargs: dict, read: tuple[str, ...] = ()
) -> tuple[list[str], dict[str, Any]]:
    """``(names of the arguments not at their default, the bound arguments)`` of a call
    ``stock(<leading parameters>, *args, **kwargs)``, leaving out the ``leading`` parameters
    (``self`` and what the elastic path reads positionally) and ``read``.

    An argument at the default of ``stock``'s signature changes nothing stock does, so an elastic
    path may ignore it; any other is what a newer Megatron asks for that the elastic path would
    silently drop.

    Raises:
        TypeError: an argument ``stock`` itself does not take (as stock raises).
    """
    signature = _signature(stock)
    bound = signature.bind(*([None] * leading), *args, **kwargs)
    unread: list[str] = []
    for parameter in list(signature.parameters.values())[leading:]:
        if parameter.name in read or parameter.name not in bound.arguments:
            continue
        value = bound.arguments[parameter.name]
        if parameter.kind is parameter.VAR_KEYWORD:
            unread += list(value)
        elif parameter.kind is parameter.VAR_POSITIONAL:
            unread += [f"*{parameter.name}"] if value else []
        elif value is not parameter.default:
            unread.append(parameter.name)
    return unread, dict(bound.arguments)


def elastic_arguments(stock: Callable, args: tuple, kwargs: dict) -> torch.Tensor | None:
    """The padding mask of a call ``stock(self, logits, *args, **kwargs)`` of a stock ``routing``,
    for the elastic forward, which reads nothing else. Any other argument must be at its default
    (:func:`unread_arguments`); one with another value raises at the first call that passes it,
    rather than being dropped.

    Raises:
        UnsupportedMegatronError: an argument other than ``padding_mask`` with a non-default value.
        TypeError: an argument ``stock`` itself does not take (as stock raises).
    """
    if not args and kwargs.keys() <= {"padding_mask"}:
        return kwargs.get("padding_mask")  # what every megatron-core release passes
    unread, arguments = unread_arguments(stock, 2, args, kwargs, read=("padding_mask",))
    if unread:
        raise UnsupportedMegatronError(
            f"TopKRouter.routing was called with {', '.join(unread)} (not at its default), which elastic routing "
            f"does not read: an elastic layer would route as if it were absent. Switch off the Megatron option "
            f"that passes it, or keep these layers stock (ElasticConfig layers=... or schedule='static')."
        )
    return arguments.get("padding_mask")


# ---------------------------------------------------------------------------------- the forward
def elastic_routing(router: Any, plan: LayerPlan, logits: torch.Tensor, padding_mask: torch.Tensor | None = None):
    """Elastic replacement of ``TopKRouter.routing`` for one training forward under ``plan``, for a
    caller that holds a plan (the patched method resolves its own); :func:`elastic_forward`.

    Raises:
        UnsupportedMegatronError: ``plan.gate`` does not fit ``router.score_function``.
    """
    state = ensure_state(router)
    if state.path is None or state.path.plan is not plan:
        resolve_state(router, plan, state.generation, state.options)
    assert state.path is not None  # resolved just now with a plan
    return elastic_forward(router, state, state.path, logits, padding_mask)


def elastic_forward(
    router: Any, state: RouterState, path: ElasticPath, logits: torch.Tensor, padding_mask: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """One elastic training forward of ``router`` (steps 2-7 of :mod:`elastic_moe_plugin.mcore`).

    Args:
        logits: [S, B, E] (or [T, E]) router logits.
        padding_mask: [S, B] bool, True = padding, or None.

    Returns:
        probs [T, E] (sparse, dtype of logits) and routing_map [T, E] (bool), the stock contract;
        row t of routing_map has κ_t True entries (fewer after capacity drops; drop-and-pad adds
        zero-weight padding entries). With a capacity factor cf, column e has at most
        ``get_capacity(T·k, E, cf)`` True entries, as stock (drop-and-pad: exactly that many when
        it is at most T). The map carries the dispatch tag (:func:`mark_elastic`).
    """
    _refuse_graph_capture(router)
    plan, model = path.plan, router.config
    seq_length, bsz = (logits.shape[0], logits.shape[1]) if logits.dim() == 3 else (logits.shape[0], 1)
    logits = logits.view(-1, model.num_moe_experts)
    if padding_mask is not None:
        padding_mask = padding_mask.reshape(-1)
    logits = router.apply_z_loss(logits, padding_mask=padding_mask)
    with_aux_loss = router.training and torch.is_grad_enabled() and router.is_aux_loss_enabled()
    drawn, probabilities, selection_reads_them = _budgets(router, state, path, logits, with_aux_loss)
    bias = router.expert_bias if path.rule.score_function != "softmax" else None
    budgets = None if drawn is None else drawn.budgets
    routing = route(
        logits,
        path.rule,
        plan.width,
        budgets=budgets,
        top_p=plan.top_p,
        selection_bias=bias,
        probabilities=probabilities,
    )
    probs, realised_map = _dense(routing, logits)
    probs, routing_map, capacity_dropped = _drop_over_capacity(plan, model, routing, probs, realised_map)
    host_total = None if drawn is None else drawn.total
    if with_aux_loss:  # on the realised assignments, before capacity drops
        shared = None if selection_reads_them else probabilities
        assignments = realised_assignments(
            router,
            plan,
            logits,
            realised_map,
            padding_mask,
            seq_length,
            bsz,
            probabilities=shared,
            host_total=host_total,
        )
        probs = apply_realised_aux_losses(router, assignments, probs)
    router._apply_expert_bias(routing_map, padding_mask=padding_mask)
    # Counted once per real step: recompute's first pass runs without grad (as stock expert-bias counting).
    counts = None if drawn is None else drawn.counts
    state.remember(routing, count=torch.is_grad_enabled(), capacity_dropped=capacity_dropped, budget_counts=counts)
    # Capacity drops leave the map with fewer entries than Σκ, which only the device counts.
    total = None if capacity_dropped is not None else host_total
    return probs, mark_elastic(routing_map, plan.width, balanced=plan.sampling == "balanced", total=total)


def graph_capture_underway() -> bool:
    """Whether a CUDA graph is being captured now: Megatron's flag (its local and Transformer
    Engine implementations) or the current CUDA stream (any capture). Read at every elastic
    forward, so it lives here and not in :mod:`.graph_options` (the forward's modules stay five,
    ``tests/contract/test_router_forward_trace.py``)."""
    from megatron.core.transformer import cuda_graphs  # loaded with TopKRouter's own module

    if cuda_graphs.is_graph_capturing():
        return True
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _refuse_graph_capture(router: Any) -> None:
    """The backstop of :mod:`.graph_options`: refuse an elastic training forward inside a graph capture."""
    if not graph_capture_underway():
        return
    from elastic_moe_plugin.mcore import graph_options  # only to word the refusal

    setting = graph_options.graph_setting(router.config)
    what = graph_options.describe_capture(setting, flags=False) if graph_options.router_capture(setting) else None
    raise UnsupportedMegatronError(
        "an elastic router's training forward is being captured into a CUDA graph"
        + (f" ({what})" if what else "")
        + ": κ is drawn on the host and copied in at every forward, so a replay would reuse the κ of the capture; "
        f"capture only scopes without the router ({graph_options.spell_fix(setting, flags=False)}), or use "
        "schedule='static'."
    )


def _budgets(router: Any, state: RouterState, path: ElasticPath, logits: torch.Tensor, with_aux_loss: bool):
    """``(draw, probabilities, selection_reads_them)``: κ's draw, or for ``mode="top_p"`` no draw
    and p = softmax(z) [T, E] (fp32), computed once and shared with whichever of selection or the
    aux loss also needs it (``selection_reads_them``: pre-softmax, or a full_softmax gate). Never
    with both: the two would then backpropagate through one softmax node, summing their gradients
    before it rather than after, which rounds differently. Top-p itself reads it detached."""
    plan = path.plan
    if plan.top_p is None:
        return state.draw(path, logits.shape[0], logits.device), None, False
    selection_reads_them = router.config.moe_router_pre_softmax or plan.gate == "full_softmax"
    with contextlib.nullcontext() if selection_reads_them or with_aux_loss else torch.no_grad():
        return None, score(logits, "softmax"), selection_reads_them


def _dense(routing, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """probs [T, E] and routing_map [T, E], stock's dense form: the b candidates of a row are
    distinct experts and the weights beyond κ_t are exactly 0, so all b slots scatter; the map
    keeps only the first κ_t."""
    shape = logits.shape
    probs = torch.zeros(shape, dtype=logits.dtype, device=logits.device).scatter(1, routing.ids, routing.weights)
    routing_map = torch.zeros(shape, dtype=torch.bool, device=logits.device).scatter(1, routing.ids, routing.kept)
    return probs, routing_map


def _drop_over_capacity(plan: LayerPlan, model, routing, probs: torch.Tensor, routing_map: torch.Tensor):
    """``(probs, routing_map, capacity_dropped [T, b] or None)``: stock's capacity dropping where a
    capacity factor is set. Capacity from k, not b: ceil(T·k/E · cf) per expert, stock's number
    for the same cf, since the expected load per expert is T·E[κ]/E = T·k/E. The drop-and-pad
    dispatchers size their buffers from the same T·k, so the padded map and the buffers agree
    (``docs/parallelism.md``)."""
    if model.moe_expert_capacity_factor is None:
        return probs, routing_map, None
    from megatron.core.transformer.moe.moe_utils import apply_router_token_dropping

    probs, dropped_map = apply_router_token_dropping(
        probs,
        routing_map,
        router_topk=plan.schedule.center,
        capacity_factor=model.moe_expert_capacity_factor,
        drop_policy=model.moe_token_drop_policy,
        pad_to_capacity=model.moe_pad_expert_input_to_capacity,
    )
    # [T, b]: selected slots the capacity mask removed (for the drop metrics; no host sync)
    return probs, dropped_map, routing.kept & ~dropped_map.gather(1, routing.ids)


# ---------------------------------------------------------------------------------- the dispatch tag
def mark_elastic(routing_map: torch.Tensor, width: int, balanced: bool, total: int | None = None) -> torch.Tensor:
    """Tag ``routing_map`` [T, E] as routed with up to ``width`` experts per token (:mod:`.dispatch`).

    ``total``: the map's True entries (Σ_t κ_t) when the host knows it without reading the device
    (the host Σκ of the κ draw), else None; ``balanced`` maps without one count T·k.
    """
    setattr(routing_map, WIDTH_ATTR, int(width))
    setattr(routing_map, BALANCED_ATTR, bool(balanced))
    setattr(routing_map, TOTAL_ATTR, None if total is None else int(total))
    return routing_map


def elastic_width(routing_map: torch.Tensor) -> int | None:
    """b if ``routing_map`` came from an elastic router, else None."""
    return getattr(routing_map, WIDTH_ATTR, None)


__all__ = [
    "BALANCED_ATTR",
    "TOTAL_ATTR",
    "WIDTH_ATTR",
    "elastic_arguments",
    "elastic_forward",
    "elastic_routing",
    "elastic_width",
    "graph_capture_underway",
    "mark_elastic",
    "patched_routing",
    "resolve_state",
    "router_options",
    "router_rule",
    "routing_rule",
    "select_candidates",
    "token_shard",
    "training_state",
    "unread_arguments",
]
