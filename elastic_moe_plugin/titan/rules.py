"""A torchtitan router read into the routing core's rule, and one MoE layer's training plan.

torchtitan has one router, ``TokenChoiceTopKRouter`` (``torchtitan.models.common.moe``), shared by
every MoE model it registers (DeepSeek-V3, Qwen3-MoE, Qwen3.5, GPT-OSS). Its forward, for
logits z [B, L, E] computed in fp32::

    s          = softmax(z) or sigmoid(z)                         (``score_func``)
    selection  = s + expert_bias                                   (the aux-loss-free bias: ranks only)
                 inside ``num_limited_groups`` of ``num_expert_groups`` groups, a group scored by
                 the sum of its two best selection values, the others −inf
    ids [.., k]  = top-k of selection;  w = s gathered at ids     (unbiased)
    w          = w / (Σ w + 1e-20) if ``route_norm``;  w × ``route_scale``

is the routing core's rule (:func:`routing_rule`) with ``select_on="scores"``, the bias as the
call's selection bias, ``group_score_topk=2`` and normalisation ``kept_sum`` (ε 1e-20) or ``none``:
so κ ≡ k selects and weighs exactly the experts stock top-k does (``docs/gates.md``).
"""

from __future__ import annotations

from typing import Any

from elastic_moe_plugin.core.config import ElasticConfig
from elastic_moe_plugin.core.errors import ConfigError
from elastic_moe_plugin.core.plan import LayerPlan, check_group_reach, top_p_refusal, warn_if_top1_gate_is_constant
from elastic_moe_plugin.core.router_state import state_of
from elastic_moe_plugin.core.routing import SIGMOID_EPS, RoutingRule

#: the gate convention of ``docs/gates.md`` -> the routing core's normalisation over the kept set
GATE_NORMALIZATIONS = {"full_softmax": "none", "renormalized": "kept_sum", "sigmoid_auto": "kept_sum_if_several"}
#: torchtitan scores an expert group by the sum of its two best selection values
GROUP_SCORE_TOPK = 2


def router_gate(router: Any) -> str:
    """The router's own gate convention: ``renormalized`` with ``route_norm``, else ``full_softmax``."""
    return "renormalized" if router.route_norm else "full_softmax"


def gate_for(router: Any, config: ElasticConfig) -> str:
    """``config.gate``, or the router's own convention for ``"auto"``."""
    return router_gate(router) if config.gate == "auto" else config.gate


def routing_rule(router: Any, gate: str) -> RoutingRule:
    """The routing core's rule for a ``TokenChoiceTopKRouter`` weighed by ``gate`` (module docstring)."""
    normalization = GATE_NORMALIZATIONS[gate]
    grouped = router.num_expert_groups is not None
    return RoutingRule(
        score_function=router.score_func,
        select_on="scores",
        normalization=normalization,  # type: ignore[arg-type]
        renormalization_eps=SIGMOID_EPS if normalization != "none" else 0.0,
        num_groups=router.num_expert_groups if grouped else None,
        groups_kept=router.num_limited_groups if grouped else None,
        group_score_topk=GROUP_SCORE_TOPK if grouped else None,
        scaling_factor=None if router.route_scale == 1.0 else float(router.route_scale),
    )


def resolve_plan(moe: Any, config: ElasticConfig, *, num_layers: int | None = None) -> LayerPlan | None:
    """The training plan of one torchtitan ``MoE`` under ``config`` (uncached), None for stock top-k:
    a static schedule, or a layer outside ``ElasticConfig.layers``.

    Raises:
        ConfigError: ``config`` does not fit the router (its top-k, experts, groups, or the layer
            count ``num_layers`` when given), ``layers`` is set and the MoE has no layer tag (built
            outside a torchtitan ``Decoder``), or the router balances by ``_debug_force_load_balance``.
    """
    router = moe.router
    schedule = config.resolve(num_experts=router.num_experts, topk=router.top_k, num_layers=num_layers)
    if schedule.is_static and config.mode != "top_p":
        return None
    state = state_of(moe)
    layer_index = None if state is None else state.layer_index
    if layer_index is None and config.layer_set is not None:
        raise ConfigError(
            f"layers={config.layers!r} needs each MoE's decoder-layer index, but this {type(moe).__name__} has none "
            f"(it was not built by a torchtitan Decoder after elastic_moe_plugin.titan.apply). "
            f"Build the model after apply, or leave {config.spell('layers', None)}.",
            field="layers",
            fixes=({"layers": None},),
        )
    if layer_index is not None and not config.layer_is_elastic(layer_index):
        return None
    if router._debug_force_load_balance:
        raise ConfigError(
            "torchtitan's --debug.moe_force_load_balance replaces the router's choice by a round-robin one, which "
            "leaves no ranking for a budget κ to cut. Drop --debug.moe_force_load_balance, or set "
            f"{config.spell('enabled', False)}.",
            field="enabled",
            fixes=({"enabled": False},),
        )
    gate = gate_for(router, config)
    warn_if_top1_gate_is_constant(schedule, gate, "torchtitan routers")
    top_p = _top_p(moe, config)
    width = (config.top_p_max_experts or router.num_experts) if top_p is not None else None
    _check_group_reach(router, config, width or schedule.high)
    return LayerPlan(
        schedule=schedule,
        gate=gate,
        sampling=config.sampling,
        layer_index=layer_index,
        top_p=top_p,
        top_p_width=width,
        rule=f"torchtitan {router.score_func}{'+bias' if moe.expert_bias_E is not None else ''}",
    )


def _top_p(moe: Any, config: ElasticConfig) -> float | None:
    """``config.top_p`` in ``mode="top_p"`` (None otherwise), for a router that ranks by p itself.

    Raises:
        ConfigError: the router ranks by sigmoid scores, or by p plus the aux-loss-free bias.
    """
    if config.mode != "top_p":
        return None
    router = moe.router
    if router.score_func != "softmax" or moe.expert_bias_E is not None:
        ranked = "sigmoid scores" if router.score_func != "softmax" else "p plus the aux-loss-free expert bias"
        raise top_p_refusal(config, "this torchtitan router ranks", ranked)
    return config.top_p


def _check_group_reach(router: Any, config: ElasticConfig, width: int) -> None:
    """:func:`~elastic_moe_plugin.core.plan.check_group_reach` with the router's node-limited groups."""
    check_group_reach(
        config,
        width=width,
        top_k=router.top_k,
        num_experts=router.num_experts,
        num_groups=router.num_expert_groups,
        groups_kept=router.num_limited_groups,
        router="this torchtitan router ranks",
        group_fields=("num_limited_groups", "num_expert_groups"),
        explain_static=False,
    )


__all__ = ["GATE_NORMALIZATIONS", "GROUP_SCORE_TOPK", "gate_for", "resolve_plan", "router_gate", "routing_rule"]
