"""The training plan of one transformers router under a config, and the start-up checks that decide
it: its schedule against the router (top-k, experts, the model's layers, the layers whose router
can rank), its gate, and the reach of group-limited selection. The patch (:mod:`.patch`) resolves a
router's plan at its first training forward and for the start-up plan line; nothing here keeps
state.
"""

from __future__ import annotations

from typing import Any

import torch

from elastic_moe_plugin.core.config import ElasticConfig
from elastic_moe_plugin.core.errors import ConfigError
from elastic_moe_plugin.core.plan import LayerPlan, check_group_reach, top_p_refusal, warn_if_top1_gate_is_constant
from elastic_moe_plugin.core.router_state import state_of
from elastic_moe_plugin.core.schedule import BudgetSchedule
from elastic_moe_plugin.hf.families import ranking_layers
from elastic_moe_plugin.hf.router_family import RouterFamily
from elastic_moe_plugin.hf.rules import activation_score_function, family_gate, family_rule

#: the rule kinds that rank by the full softmax p, which top-p's budget reads (with no selection bias)
TOP_P_RULES = frozenset({"softmax_topk", "softmax_pnorm"})


def ranks_by_probability(family: RouterFamily) -> bool:
    """Whether the family ranks its experts by p = softmax(z) itself: a softmax rule kind, and no
    selection bias (LongCat-Flash ranks p + b)."""
    return family.rule in TOP_P_RULES and family.bias is None and family.bias_argument is None


def gate_for(router: torch.nn.Module, family: RouterFamily, config: ElasticConfig) -> str:
    """The weighing rule: ``config.gate`` unless ``"auto"``; then the family's own convention
    (:func:`.rules.family_gate`: e.g. ``norm_topk_prob`` True → ``"renormalized"``, False →
    ``"full_softmax"``)."""
    return config.gate if config.gate != "auto" else family_gate(router, family)


def validate_router(
    router: Any,
    family: RouterFamily,
    config: ElasticConfig,
    *,
    num_layers: int | None = None,
    model_config: Any = None,
) -> BudgetSchedule:
    """Check ``config`` against one router (top-k, expert count, layer count, and where the family
    mixes ranking and static routers, that ``layers`` selects a ranking one: ``model_config`` is
    the model's config) and return its schedule.

    Raises:
        ConfigError: naming the setting, its value and the fix.
    """
    if family.rule == "activation_bias":
        activation_score_function(router)  # a scoring_func the routing core computes, or refused now
    layer_kinds = ranking_layers(family, model_config)
    ranking, note = None, None
    if layer_kinds is not None:
        ranking, static = layer_kinds
        if static and family.static_routers:
            note = f"layer(s) {', '.join(map(str, static))} are {family.static_routers[0][1]}"
    return config.resolve(
        num_experts=family.num_experts_of(router),
        topk=family.top_k_of(router),
        num_layers=num_layers,
        moe_layers=ranking,
        static_layers_note=note,
    )


def resolve_plan(router, family: RouterFamily, config: ElasticConfig) -> LayerPlan | None:
    """The training plan of ``router`` under ``config`` (uncached), None for stock top-k: a static
    schedule, or a layer outside ``ElasticConfig.layers``.

    Raises:
        ConfigError: ``config`` does not fit the router, or ``layers`` is set and the router has no
            layer tag (a model built before :func:`apply`; the message names the fix).
    """
    schedule = validate_router(router, family, config)
    if schedule.is_static and config.mode != "top_p":
        return None
    state = state_of(router)
    layer_index = None if state is None else state.layer_index
    if layer_index is None and config.layer_set is not None:
        raise ConfigError(
            f"layers={config.layers!r} needs each router's decoder-layer index, but this "
            f"{type(router).__name__} has none (the model was built before elastic_moe_plugin.hf.apply). "
            f"Call hf.apply(config, model=model) or hf.tag_layers(model), build the model after apply, "
            f"or leave `layers` unset."
        )
    if layer_index is not None and not config.layer_is_elastic(layer_index):
        return None
    gate = gate_for(router, family, config)
    warn_if_top1_gate_is_constant(schedule, gate, f"{family.name} routers")
    if config.mode == "top_p" and not ranks_by_probability(family):
        ranked = "p plus a selection bias" if family.rule in TOP_P_RULES else f"{family.rule.replace('_', ' ')} scores"
        raise top_p_refusal(config, f"{family.name} routers rank", ranked)
    top_p = config.top_p if config.mode == "top_p" else None
    width = (config.top_p_max_experts or family.num_experts_of(router)) if top_p is not None else None
    _check_group_reach(router, family, config, gate, width or schedule.high)
    return LayerPlan(
        schedule=schedule,
        gate=gate,
        sampling=config.sampling,
        layer_index=layer_index,
        top_p=top_p,
        top_p_width=width,
        cast_weights_to_logits=family.weights_dtype == "logits",
        rule=f"{family.name} {family.rule}",
    )


def _check_group_reach(router: Any, family: RouterFamily, config: ElasticConfig, gate: str, width: int) -> None:
    """:func:`~elastic_moe_plugin.core.plan.check_group_reach` with the groups of the family's rule
    (only budget schedules get here: top-p is refused earlier for every rule kind that groups)."""
    rule = family_rule(router, family, gate)
    check_group_reach(
        config,
        width=width,
        top_k=family.top_k_of(router),
        num_experts=family.num_experts_of(router),
        num_groups=rule.num_groups,
        groups_kept=rule.groups_kept,
        router=f"{family.name} routes",
        group_fields=("topk_group", "n_group"),
    )


__all__ = ["TOP_P_RULES", "gate_for", "ranks_by_probability", "resolve_plan", "validate_router"]
