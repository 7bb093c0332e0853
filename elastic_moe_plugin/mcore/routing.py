"""Elastic routing for one Megatron ``TopKRouter`` forward: budgets, selection, gate weights,
load balancing on the realised assignments, and routing records.

The algorithm (paper §3.2, Eq. 4-5) is laid out in :mod:`elastic_moe_plugin.mcore`'s docstring;
:func:`elastic_routing` follows its numbered steps. Padding-mask polarity, as Megatron's code uses
it: ``padding_mask`` True = padding token.
"""

from __future__ import annotations

import contextlib

import torch

from elastic_moe_plugin.core import records
from elastic_moe_plugin.core.budget_stream import LATEST_DRAW_ATTR, BudgetDraw, latest_draw
from elastic_moe_plugin.core.errors import UnsupportedMegatronError
from elastic_moe_plugin.core.gates import budget_mask, top_p_budgets, weigh_candidates
from elastic_moe_plugin.core.plan import LayerPlan
from elastic_moe_plugin.mcore import budget_rng
from elastic_moe_plugin.mcore.aux_loss import apply_realised_aux_losses, realised_assignments
from elastic_moe_plugin.mcore.dispatch import mark_elastic



# ---------------------------------------------------------------------------------- routing
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


def draw_budgets(router, plan: LayerPlan, num_tokens: int, device: torch.device) -> torch.Tensor:
    """κ [T] for this rank's T tokens: one draw of κ's counter-based stream (:mod:`.budget_rng`).

    The draw is addressed by (stream seed, draw counter, token shard), with the shard of
    :func:`token_shard`: the rank generates exactly its own T uniforms on the host, maps them with
    the schedule and copies κ to the device without a sync (``core.budget_stream``). Tensor-parallel
    peers holding the same tokens have the same shard, hence the same κ; data/context/sequence-
    parallel shards have their own keys, hence independent κ; the counter advances by one on every
    rank whatever its T. Megatron's checkpoints save the stream and its activation recompute
    restores it, so a resumed run continues the κ sequence and a recomputed layer sees the same κ.

    The draw itself, with κ and Σκ on the host, is kept on the router
    (``core.budget_stream.latest_draw(router)``).
    """
    cached = router.__dict__.get("_elastic_token_shard")
    if cached is None:  # process groups are fixed for the router's life
        cached = router.__dict__["_elastic_token_shard"] = token_shard(router)
    draw = budget_rng.draw(plan.schedule, plan.sampling, cached[1], num_tokens, device)
    router.__dict__[LATEST_DRAW_ATTR] = draw
    return draw.budgets


def _host_draw(router, budgets: torch.Tensor) -> BudgetDraw | None:
    """The router's latest draw when ``budgets`` [T] is that draw's κ (not, e.g., budgets a caller
    substituted for the draw), else None: Σκ and κ's histogram known on the host."""
    draw = latest_draw(router)
    return draw if draw is not None and draw.budgets is budgets else None


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
    """Top-b candidates by Megatron's selection rule, sorted by rank (step 3 of :mod:`elastic_moe_plugin.mcore`).

    The plain-argument counterpart of Megatron's ``topk_routing_with_score_function(logits, topk,
    use_pre_softmax, num_groups, group_topk, scaling_factor, score_function, expert_bias)``: the same
    ranking, widened from k to b, returning what the gate weighs instead of the weights::

        softmax, post-softmax (default)   rank by z,        values z (renormalized) or p = softmax(z)
        softmax, use_pre_softmax          rank by p,        values p, or z for renormalized
        sigmoid / sqrtsoftplus            rank by s + bias, values s (unbiased; bias for selection only)
        s = sigmoid(z) or sqrt(softplus(z)) in fp32; p = softmax(z) in fp32

    Group-limited routing (``group_topk``) keeps the groups stock top-k keeps, scored with k
    (:func:`_group_limited_candidates`), then takes the top-b inside them.

    Args:
        logits: z [T, E] (after the z-loss).
        width: b, the candidate slots per token (``LayerPlan.width``).
        topk: k, the model's ``moe_router_topk`` (scores the expert groups).
        gate: ``LayerPlan.gate``: ``"renormalized"`` (values z for softmax), ``"full_softmax"`` or
            ``"sigmoid_auto"``.
        score_function, use_pre_softmax, num_groups, group_topk, expert_bias: as Megatron's router
            (``router.score_function``, ``moe_router_pre_softmax``, ``moe_router_num_groups``,
            ``moe_router_group_topk``, ``router.expert_bias`` [E] or None).
        probabilities: p = ``torch.softmax(logits, dim=-1, dtype=torch.float32)`` [T, E] when the
            caller has computed it (top-p mode), so that it is not computed twice; else None.

    Returns:
        candidate_values [T, b]: what the gate convention weighs (fp32 probabilities for
            full_softmax, raw logits for softmax renormalized, unbiased scores for
            sigmoid/sqrtsoftplus).
        candidate_ids [T, b]: expert indices, best first.

    Raises:
        UnsupportedMegatronError: another score function.
    """
    if score_function == "softmax":
        # Post-softmax ranks by logits (as stock), pre-softmax by probabilities: same order, but
        # matching stock keeps ties and the static case bit-identical.
        if use_pre_softmax or gate == "full_softmax":
            scores = torch.softmax(logits, dim=-1, dtype=torch.float32) if probabilities is None else probabilities
            selection = scores if use_pre_softmax else logits
        else:
            scores = None
            selection = logits
        biased = None
    elif score_function in ("sigmoid", "sqrtsoftplus"):
        if score_function == "sigmoid":
            scores = torch.sigmoid(logits.float())
        else:
            scores = torch.nn.functional.softplus(logits.float()).sqrt()
        biased = scores + expert_bias.float() if expert_bias is not None else None
        selection = biased if biased is not None else scores
    else:
        raise UnsupportedMegatronError(f"moe_router_score_function={score_function!r} is not supported.")

    if group_topk:
        selected, candidate_ids = _group_limited_candidates(
            selection, topk=topk, width=width, num_groups=num_groups, group_topk=group_topk,
        )
    else:
        selected, candidate_ids = torch.topk(selection, k=width, dim=1, sorted=True)

    if score_function == "softmax" and gate == "renormalized":
        # Renormalized softmax gates weigh the kept logits (softmax over them = p_e / Σ_kept p), on
        # pre- and post-softmax models alike: κ_t = 1 then gives weight exactly 1 and a gate
        # gradient exactly 0 (docs/gates.md#gate-conventions), where p / Σp would leave fp32 rounding noise.
        return (selected if selection is logits else torch.gather(logits, 1, candidate_ids)), candidate_ids
    if selection is scores:
        return selected, candidate_ids
    return torch.gather(scores, 1, candidate_ids), candidate_ids


def _group_limited_candidates(selection: torch.Tensor, topk: int, width: int, num_groups: int,
                              group_topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-``width`` (b) candidates inside the expert groups that stock top-k keeps.

    Megatron's ``group_limited_topk`` scores each of the G groups by the sum of its top
    ``topk // group_topk`` scores, keeps the ``group_topk`` best groups and takes the top-k inside
    them. The groups are chosen here by that same rule with the model's k, and only the final
    selection widens to b, so a token with κ = k routes exactly as stock top-k. Scoring groups
    with b // group_topk instead changes the groups of every token whenever that differs from
    k // group_topk (6-10 around 8 with group_topk = 3: 3 against 2).

    Args:
        selection: [T, E], the scores experts are ranked by.
        topk: k, which scores the groups; width: b, the candidates returned.
        num_groups, group_topk: Megatron's ``moe_router_num_groups`` / ``moe_router_group_topk``.

    Returns:
        (values [T, b], expert ids [T, b]), sorted by rank.
    """
    num_tokens, num_experts = selection.shape
    # The same ops as megatron.core.transformer.moe.moe_utils.group_limited_topk, with k for the groups.
    group_scores = selection.view(num_tokens, num_groups, -1).topk(topk // group_topk, dim=-1)[0].sum(dim=-1)
    group_idx = torch.topk(group_scores, k=group_topk, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
    experts_per_group = num_experts // num_groups
    score_mask = group_mask.unsqueeze(-1).expand(num_tokens, num_groups, experts_per_group).reshape(num_tokens, -1)
    return torch.topk(selection.masked_fill(~score_mask.bool(), float("-inf")), k=width, dim=-1)


#: (score-function family, LayerPlan.gate) -> gates.weigh_candidates rule. Softmax models resolve
#: "renormalized" to a softmax over the kept logits, as Megatron's post-softmax does, so κ = 1
#: gives weight exactly 1; "sigmoid_auto" is the sigmoid / sqrtsoftplus rule only.
_WEIGHING_RULE = {
    ("softmax", "full_softmax"): "full_softmax",
    ("softmax", "renormalized"): "selected_softmax",
    ("sigmoid", "sigmoid_auto"): "sigmoid",
    ("sigmoid", "renormalized"): "sigmoid_renormalized",
    ("sigmoid", "full_softmax"): "full_softmax",
}


def _weighing_rule(router, plan: LayerPlan) -> str:
    """The :func:`gates.weigh_candidates` rule of ``plan.gate`` for the router's score function now.

    Raises:
        UnsupportedMegatronError: ``plan.gate`` belongs to another score function, i.e. the plan
            was resolved for a router whose ``score_function`` has changed since. The patch
            re-resolves its plans when that happens (``patch.training_plan``), so only a plan built
            by hand reaches this.
    """
    family = "softmax" if router.score_function == "softmax" else "sigmoid"
    rule = _WEIGHING_RULE.get((family, plan.gate))
    if rule is None:
        accepted = sorted(gate for (gate_family, gate) in _WEIGHING_RULE if gate_family == family)
        raise UnsupportedMegatronError(
            f"LayerPlan.gate={plan.gate!r} cannot weigh a router whose score_function is "
            f"{router.score_function!r} (the plan was resolved for another score function, or "
            f"router.score_function changed after it was). Accepted gates for {router.score_function!r}: "
            f"{', '.join(accepted)}. Resolve the plan for the router as it is now: under mcore.apply plans "
            f"re-resolve by themselves; a LayerPlan built by hand needs one of those gates."
        )
    return rule


def _prefix_weights(rule: str, candidate_values: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
    """Gate weights [T, b] of the kept prefix (0 beyond κ), by :func:`gates.weigh_candidates`."""
    # Megatron's precision policy: scores and weights in fp32 whatever the router dtype. Autograd's
    # own backward, so that a point-mass plan reproduces stock gradients bit for bit.
    return weigh_candidates(rule, candidate_values.float(), kept)


def elastic_routing(router, plan: LayerPlan, logits: torch.Tensor, padding_mask: torch.Tensor | None = None):
    """Elastic replacement of ``TopKRouter.routing`` for one training forward.

    Args:
        logits: [S, B, E] (or [T, E]) router logits.
        padding_mask: [S, B] bool, True = padding, or None.

    Returns:
        probs [T, E] (sparse, dtype of logits) and routing_map [T, E] (bool), the stock contract;
        row t of routing_map has κ_t True entries (fewer after capacity drops; drop-and-pad adds
        zero-weight padding entries). With a capacity factor cf, column e has at most
        ``get_capacity(T·k, E, cf)`` True entries, as stock (drop-and-pad: exactly that many when
        it is at most T).

    Raises:
        UnsupportedMegatronError: ``plan.gate`` does not fit ``router.score_function``.
    """
    from megatron.core.transformer.moe.moe_utils import apply_router_token_dropping

    model = router.config
    seq_length, bsz = (logits.shape[0], logits.shape[1]) if logits.dim() == 3 else (logits.shape[0], 1)
    logits = logits.view(-1, model.num_moe_experts)
    if padding_mask is not None:
        padding_mask = padding_mask.reshape(-1)
    logits = router.apply_z_loss(logits, padding_mask=padding_mask)

    num_tokens = logits.shape[0]
    rule = _weighing_rule(router, plan)  # first: a stale plan fails here, clearly, not mid-selection
    with_aux_loss = router.training and torch.is_grad_enabled() and router.is_aux_loss_enabled()
    probabilities, selection_reads_them = None, False
    if plan.top_p is not None:
        # Top-p reads p = softmax(z) [T, E] (fp32); computed once, here, and shared with whichever
        # of selection or aux loss also needs it. Never with both: the two would then backpropagate
        # through one softmax node, summing their gradients before it rather than after, which
        # rounds differently. Top-p itself reads it detached.
        selection_reads_them = model.moe_router_pre_softmax or plan.gate == "full_softmax"
        with contextlib.nullcontext() if selection_reads_them or with_aux_loss else torch.no_grad():
            probabilities = torch.softmax(logits, dim=-1, dtype=torch.float32)
    candidate_values, candidate_ids = select_candidates(
        logits, plan.width, plan.schedule.center, plan.gate, score_function=router.score_function,
        use_pre_softmax=model.moe_router_pre_softmax, num_groups=model.moe_router_num_groups,
        group_topk=model.moe_router_group_topk, expert_bias=router.expert_bias,
        probabilities=probabilities if selection_reads_them else None,
    )
    if plan.top_p is None:
        budgets = draw_budgets(router, plan, num_tokens, logits.device)
        draw = _host_draw(router, budgets)
        host_total, host_counts = (draw.total, draw.counts) if draw is not None else (None, None)
    else:  # the smallest top-ranked set whose full-softmax mass reaches p (paper's top-p control)
        budgets = top_p_budgets(probabilities.detach().gather(1, candidate_ids), plan.top_p)
        host_total = host_counts = None  # κ came from the device's probabilities
    kept = budget_mask(budgets, plan.width)  # [T, b]
    weights = gate_weights = _prefix_weights(rule, candidate_values, kept)
    if model.moe_router_topk_scaling_factor:
        weights = weights * model.moe_router_topk_scaling_factor
    weights = weights.type_as(logits)

    # Dense [T, E] form, as stock. The b candidates of a row are distinct experts and the weights
    # beyond κ_t are exactly 0, so all b slots scatter; the map keeps only the first κ_t.
    probs = torch.zeros((num_tokens, model.num_moe_experts), dtype=logits.dtype, device=logits.device)
    probs = probs.scatter(1, candidate_ids, weights)
    routing_map = torch.zeros((num_tokens, model.num_moe_experts), dtype=torch.bool, device=logits.device)
    routing_map = routing_map.scatter(1, candidate_ids, kept)
    realised_map = routing_map

    capacity_dropped = None
    if model.moe_expert_capacity_factor is not None:
        # Capacity from k, not b: ceil(T·k/E · cf) per expert, stock's number for the same cf, since
        # the expected load per expert is T·E[κ]/E = T·k/E. The drop-and-pad dispatchers size their
        # buffers from the same T·k, so the padded map and the buffers agree (docs/parallelism.md).
        probs, routing_map = apply_router_token_dropping(
            probs, routing_map, router_topk=plan.schedule.center, capacity_factor=model.moe_expert_capacity_factor,
            drop_policy=model.moe_token_drop_policy, pad_to_capacity=model.moe_pad_expert_input_to_capacity,
        )
        # [T, b]: selected slots the capacity mask removed (for the drop metrics; no host sync)
        capacity_dropped = kept & ~routing_map.gather(1, candidate_ids)

    if with_aux_loss:
        assignments = realised_assignments(router, plan, logits, realised_map, padding_mask, seq_length, bsz,
                                           probabilities=None if selection_reads_them else probabilities,
                                           host_total=host_total)
        probs = apply_realised_aux_losses(router, assignments, probs)

    router._apply_expert_bias(routing_map, padding_mask=padding_mask)
    # Counted once per real step: recompute's first pass runs without grad (as stock expert-bias counting).
    records.remember(router, plan.width, budgets, candidate_ids, kept, gate_weights, count=torch.is_grad_enabled(),
                     capacity_dropped=capacity_dropped, host_counts=host_counts)
    # Dispatchers size buffers from k unless told otherwise (see mcore.dispatch); capacity drops
    # leave the map with fewer entries than Σκ, which only the device counts.
    if capacity_dropped is not None:
        host_total = None
    return probs, mark_elastic(routing_map, plan.width, balanced=plan.sampling == "balanced", total=host_total)
