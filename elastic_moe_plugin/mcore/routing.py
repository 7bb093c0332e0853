"""Elastic routing for one Megatron ``TopKRouter`` forward: budgets, selection, gate weights,
load balancing on the realised assignments, and routing records.

The algorithm (paper §3.2, Eq. 4-5) is laid out in :mod:`elastic_moe_plugin.mcore`'s docstring;
:func:`elastic_routing` follows its numbered steps. Padding-mask polarity, as Megatron's code uses
it: ``padding_mask`` True = padding token.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect

import torch

from elastic_moe_plugin.core.errors import UnsupportedMegatronError
from elastic_moe_plugin.core.gates import budget_mask, top_p_budgets, weigh_candidates
from elastic_moe_plugin.mcore.dispatch import mark_elastic
from elastic_moe_plugin.core.metrics import RoutingRecord
from elastic_moe_plugin.core.schedule import BudgetSchedule



@dataclasses.dataclass(frozen=True)
class LayerPlan:
    """How one router routes in training, resolved from the config and the model."""

    schedule: BudgetSchedule
    gate: str  # "full_softmax" | "renormalized" | "sigmoid_auto"
    sampling: str
    layer_index: int | None
    top_p: float | None = None  # mode="top_p": κ from the cumulative full-softmax probability
    top_p_width: int | None = None

    @property
    def width(self) -> int:
        """b: the number of candidate slots per token (every expert, or the cap, in top-p mode)."""
        return self.top_p_width if self.top_p is not None else self.schedule.high


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
    """κ [T] for this rank's tokens, from torch's default generator.

    Every rank draws the uniforms of all token shards (``num_shards · T``, one global stream) and
    keeps its own slice. Megatron seeds the default generator identically on the ranks of a
    pipeline stage, so tensor-parallel peers holding the same tokens get the same κ, while
    data/context/sequence-parallel shards get independent draws; activation recompute replays the
    generator state, so recomputed layers see the same κ.
    """
    cached = router.__dict__.get("_elastic_token_shard")
    if cached is None:  # process groups are fixed for the router's life
        cached = router.__dict__["_elastic_token_shard"] = token_shard(router)
    num_shards, shard = cached
    if num_shards == 1:
        return plan.schedule.sample(num_tokens, plan.sampling, device=device)
    uniforms = torch.rand(num_shards * num_tokens, dtype=torch.float64, device=device)
    return plan.schedule.budgets_from_uniforms(uniforms[shard * num_tokens : (shard + 1) * num_tokens], plan.sampling)


def _select_candidates(router, plan: LayerPlan, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-b candidates by the stock selection rule, sorted by rank.

    Returns:
        candidate_values [T, b]: what the gate convention weighs (fp32 probabilities for
            full_softmax, raw logits for softmax renormalized, unbiased scores for
            sigmoid/sqrtsoftplus).
        candidate_ids [T, b]: expert indices.
    """
    from megatron.core.transformer.moe.moe_utils import group_limited_topk

    model = router.config
    num_tokens, num_experts = logits.shape
    width = plan.width
    score_function = router.score_function
    if score_function == "softmax":
        # Post-softmax ranks by logits (as stock), pre-softmax by probabilities: same order, but
        # matching stock keeps ties and the static case bit-identical.
        if model.moe_router_pre_softmax or plan.gate == "full_softmax":
            scores = torch.softmax(logits, dim=-1, dtype=torch.float32)
            selection = scores if model.moe_router_pre_softmax else logits
        else:
            scores = None
            selection = logits
        biased = None
    elif score_function in ("sigmoid", "sqrtsoftplus"):
        if score_function == "sigmoid":
            scores = torch.sigmoid(logits.float())
        else:
            scores = torch.nn.functional.softplus(logits.float()).sqrt()
        biased = scores + router.expert_bias.float() if router.expert_bias is not None else None
        selection = biased if biased is not None else scores
    else:
        raise UnsupportedMegatronError(f"moe_router_score_function={score_function!r} is not supported.")

    if model.moe_router_group_topk:
        selected, candidate_ids = group_limited_topk(
            scores=selection, topk=width, num_tokens=num_tokens, num_experts=num_experts,
            num_groups=model.moe_router_num_groups, group_topk=model.moe_router_group_topk,
        )
    else:
        selected, candidate_ids = torch.topk(selection, k=width, dim=1, sorted=True)

    if score_function == "softmax" and plan.gate == "renormalized":
        # Renormalized softmax gates weigh the kept logits (softmax over them = p_e / Σ_kept p), on
        # pre- and post-softmax models alike: κ_t = 1 then gives weight exactly 1 and a gate
        # gradient exactly 0 (seed 000), where p / Σp would leave fp32 rounding noise.
        return (selected if selection is logits else torch.gather(logits, 1, candidate_ids)), candidate_ids
    if selection is scores:
        return selected, candidate_ids
    return torch.gather(scores, 1, candidate_ids), candidate_ids


#: LayerPlan.gate (softmax models resolve "renormalized" to a softmax over the kept logits, as
#: Megatron's post-softmax does, so κ = 1 gives weight exactly 1) -> gates.weigh_candidates rule
_WEIGHING_RULE = {
    ("softmax", "full_softmax"): "full_softmax",
    ("softmax", "renormalized"): "selected_softmax",
    ("sigmoid", "sigmoid_auto"): "sigmoid",
    ("sigmoid", "renormalized"): "sigmoid_renormalized",
    ("sigmoid", "full_softmax"): "full_softmax",
}


def _prefix_weights(router, plan: LayerPlan, candidate_values: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
    """Gate weights [T, b] of the kept prefix (0 beyond κ), by :func:`gates.weigh_candidates`."""
    family = "softmax" if router.score_function == "softmax" else "sigmoid"
    rule = _WEIGHING_RULE[family, plan.gate]
    # Megatron's precision policy: scores and weights in fp32 whatever the router dtype. Autograd's
    # own backward, so that a point-mass plan reproduces stock gradients bit for bit.
    return weigh_candidates(rule, candidate_values.float(), kept, exact_backward=False)


def elastic_routing(router, plan: LayerPlan, logits: torch.Tensor, padding_mask: torch.Tensor | None = None):
    """Elastic replacement of ``TopKRouter.routing`` for one training forward.

    Args:
        logits: [S, B, E] (or [T, E]) router logits.
        padding_mask: [S, B] bool, True = padding, or None.

    Returns:
        probs [T, E] (sparse, dtype of logits) and routing_map [T, E] (bool), the stock contract;
        row t of routing_map has κ_t True entries (fewer after capacity drops; drop-and-pad adds
        zero-weight padding entries).
    """
    from megatron.core.transformer.moe.moe_utils import apply_router_token_dropping

    model = router.config
    seq_length, bsz = (logits.shape[0], logits.shape[1]) if logits.dim() == 3 else (logits.shape[0], 1)
    logits = logits.view(-1, model.num_moe_experts)
    if padding_mask is not None:
        padding_mask = padding_mask.reshape(-1)
    logits = router.apply_z_loss(logits, padding_mask=padding_mask)

    num_tokens = logits.shape[0]
    candidate_values, candidate_ids = _select_candidates(router, plan, logits)
    if plan.top_p is None:
        budgets = draw_budgets(router, plan, num_tokens, logits.device)
    else:  # the smallest top-ranked set whose full-softmax mass reaches p (paper's top-p control)
        with torch.no_grad():
            sorted_probs = torch.softmax(logits.float(), dim=-1).gather(1, candidate_ids)
        budgets = top_p_budgets(sorted_probs, plan.top_p)
    kept = budget_mask(budgets, plan.width)  # [T, b]
    weights = _prefix_weights(router, plan, candidate_values, kept)
    retained_weight_sums = weights.detach().sum(dim=-1)
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

    if model.moe_expert_capacity_factor is not None:
        probs, routing_map = apply_router_token_dropping(
            probs, routing_map, router_topk=plan.width, capacity_factor=model.moe_expert_capacity_factor,
            drop_policy=model.moe_token_drop_policy, pad_to_capacity=model.moe_pad_expert_input_to_capacity,
        )

    if router.training and torch.is_grad_enabled() and router.is_aux_loss_enabled():
        probs = _apply_realised_aux_losses(router, plan, probs, logits, realised_map, padding_mask, seq_length, bsz)

    router._apply_expert_bias(routing_map, padding_mask=padding_mask)
    _record(router, plan, budgets, candidate_ids, kept, retained_weight_sums)
    # Dispatchers size buffers from k unless told otherwise (see mcore.dispatch).
    return probs, mark_elastic(routing_map, plan.width, balanced=plan.sampling == "balanced")


def _record(router, plan: LayerPlan, budgets, candidate_ids, kept, retained_weight_sums) -> None:
    router.__dict__["_elastic_record"] = RoutingRecord(
        budgets=budgets.detach(),
        expert_ids=torch.where(kept, candidate_ids, -1).detach(),
        retained_weight_sums=retained_weight_sums,
    )
    # Counted once per real step: recompute's first pass runs without grad (as stock expert-bias counting).
    if torch.is_grad_enabled():
        histogram = router.__dict__.get("_elastic_budget_histogram")
        if histogram is None or histogram.numel() != plan.width + 1 or histogram.device != budgets.device:
            histogram = torch.zeros(plan.width + 1, dtype=torch.long, device=budgets.device)
            router.__dict__["_elastic_budget_histogram"] = histogram
        histogram.scatter_add_(0, budgets, torch.ones_like(budgets))


# ---------------------------------------------------------------------------------- aux losses
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


def _realised_token_counts(routing_map: torch.Tensor, group, padding_mask: torch.Tensor | None):
    """(global realised counts [E], local valid tokens, global valid tokens) without a host sync.

    Valid tokens are counted from the mask (not counts/k, which is wrong once κ varies); with a
    mask, counts and the token count travel in one all-reduce.
    """
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    local_counts = routing_map.sum(dim=0)
    if padding_mask is None:
        local_tokens = routing_map.shape[0]
        return reduce_from_tensor_model_parallel_region(local_counts, group), local_tokens, local_tokens * group.size()
    local_tokens = (~padding_mask).sum()
    packed = reduce_from_tensor_model_parallel_region(torch.cat([local_counts, local_tokens.view(1)]), group)
    return packed[:-1], local_tokens, packed[-1]


def _apply_realised_aux_losses(router, plan, probs, logits, realised_map, padding_mask, seq_length, bsz):
    """aux / seq_aux / global_aux load balancing on the realised routing map (step 6)."""
    from megatron.core.transformer.moe.moe_utils import (
        compute_routing_scores_for_aux_loss,
        get_tokens_per_expert_and_token_count,
        switch_load_balancing_loss_func,
    )

    model = router.config
    num_experts = model.num_moe_experts
    # Full-distribution scores P exactly as stock computes them. For softmax the same two ops as
    # compute_routing_scores_for_aux_loss, without the static top-k map it would also build (a
    # top-k over [T, E] is the costliest op of a CPU router); other score functions call it.
    if router.score_function == "softmax":
        scores = torch.softmax(logits, dim=-1, dtype=torch.float32)
        if padding_mask is not None:
            scores = scores * (~padding_mask).unsqueeze(-1)
    else:
        _, scores = compute_routing_scores_for_aux_loss(logits, 1, router.score_function, fused=False,
                                                        padding_mask=padding_mask)
    valid_map = realised_map if padding_mask is None else realised_map & (~padding_mask).unsqueeze(-1)
    # Σκ is known on the host only for a point mass; then the stock normalisation applies verbatim.
    host_topk = plan.schedule.center if plan.schedule.is_static else None
    with_mask = padding_mask is not None

    def realised_switch_loss(probs, counts, total_tokens, coeff):
        """Megatron's E·coeff·Σ_i P_i·f_i with f_i = c_i / Σ_j c_j = c_i / Σκ (its topk·T := Σκ)."""
        effective_topk = host_topk if host_topk is not None else counts.sum() / total_tokens
        return switch_load_balancing_loss_func(
            probs=probs, tokens_per_expert=counts, total_num_tokens=total_tokens, topk=effective_topk,
            num_experts=num_experts, moe_aux_loss_coeff=coeff, fused=False,
        )

    def counts_for(routing_map, group, mask, topk_scale=1):
        if host_topk is not None:
            return get_tokens_per_expert_and_token_count(routing_map=routing_map, reduce_group=group,
                                                         topk=host_topk * topk_scale, with_padding_mask=with_mask)
        return _realised_token_counts(routing_map, group, mask)

    coeff = router.get_aux_loss_coeff("aux_loss")
    if coeff > 0:
        counts, local_tokens, total_tokens = counts_for(valid_map, router.tp_cp_group, padding_mask)
        aux_loss = realised_switch_loss(scores, counts, total_tokens, coeff)
        probs = router.attach_and_log_load_balancing_loss(
            probs, coeff, aux_loss, "load_balancing_loss", router.tp_cp_group,
            valid_token_count=local_tokens, **_attach_kwargs(router, True),
        )

    coeff = router.get_aux_loss_coeff("seq_aux_loss")
    if coeff > 0:
        # Fold the batch into the expert axis, as stock: column (b, e) counts sequence b's tokens.
        seq_scores = scores.reshape(seq_length, -1)
        seq_map = valid_map.reshape(seq_length, -1)
        if host_topk is not None:
            counts, local_tokens, total_tokens = counts_for(seq_map, router.tp_cp_group, None, topk_scale=bsz)
            aux_loss = switch_load_balancing_loss_func(
                probs=seq_scores, tokens_per_expert=counts, total_num_tokens=total_tokens, topk=host_topk,
                num_experts=num_experts, moe_aux_loss_coeff=coeff, fused=False,
            ) / bsz
        else:
            counts, local_tokens, total_tokens = _realised_token_counts(seq_map, router.tp_cp_group, padding_mask)
            if padding_mask is not None:
                # tokens per sequence, averaged over the micro-batch (stock's convention for P)
                local_tokens, total_tokens = local_tokens / bsz, total_tokens / bsz
            per_sequence_counts = counts.view(bsz, num_experts)
            # Σ_{t∈s} κ_t, realised; a fully padded sequence has 0 here and weighted = 0, so clamp
            # instead of producing 0/0 = NaN
            sequence_budgets = per_sequence_counts.sum(dim=-1).clamp(min=1)
            weighted = (seq_scores.sum(dim=0).view(bsz, num_experts) * per_sequence_counts).sum(dim=-1)
            aux_loss = (weighted / (sequence_budgets * total_tokens)).sum() * (num_experts * coeff / bsz)
        probs = router.attach_and_log_load_balancing_loss(
            probs, coeff, aux_loss, "seq_load_balancing_loss", router.tp_cp_group,
            valid_token_count=local_tokens * bsz, **_attach_kwargs(router, True),
        )

    coeff = router.get_aux_loss_coeff("global_aux_loss")
    if coeff > 0:
        counts, local_tokens, total_tokens = counts_for(valid_map, router.tp_dp_cp_group, padding_mask)
        router.global_tokens_per_expert += counts
        router.ga_steps += 1
        averaged_counts = router.global_tokens_per_expert / router.ga_steps
        # f_i = accumulated c_i / accumulated Σκ: the realised counts sum to the realised budgets.
        aux_loss = realised_switch_loss(scores, averaged_counts, total_tokens, coeff)
        probs = router.attach_and_log_load_balancing_loss(
            probs, coeff, aux_loss, "global_load_balancing_loss", router.tp_dp_cp_group,
            valid_token_count=local_tokens, **_attach_kwargs(router, False),
        )
    return probs


# ---------------------------------------------------------------------------------- records
def routing_records(model: torch.nn.Module) -> dict[int, RoutingRecord]:
    """{0-based layer index: RoutingRecord} of every elastic router's latest training forward."""
    records = {}
    for module in model.modules():
        record = module.__dict__.get("_elastic_record")
        if record is not None:
            layer_number = getattr(module, "layer_number", None)
            records[int(layer_number) - 1 if layer_number is not None else len(records)] = record
    return records


def budget_histograms(model: torch.nn.Module) -> dict[int, torch.Tensor]:
    """{0-based layer index: LongTensor [b+1]} running κ counts since the last reset (bounded)."""
    histograms = {}
    for module in model.modules():
        histogram = module.__dict__.get("_elastic_budget_histogram")
        if histogram is not None:
            histograms[int(module.layer_number) - 1 if module.layer_number is not None else len(histograms)] = histogram
    return histograms


def reset_budget_histograms(model: torch.nn.Module) -> None:
    for histogram in budget_histograms(model).values():
        histogram.zero_()

