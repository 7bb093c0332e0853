"""Elastic Expert Routing for Megatron-core: a class-level patch of ``TopKRouter``.

Usage (call before building the model, on every rank)::

    from elastic_moe_plugin import ElasticConfig, mcore

    mcore.apply(ElasticConfig(schedule="6-10", layers="3-7"))
    model = GPTModel(...)                      # every TopKRouter now routes elastically in training

    with mcore.patched(ElasticConfig()):       # or scoped
        ...

Modules: :mod:`.patch` (what is patched: ``TopKRouter.routing`` and ``__init__`` at class level,
plus the dispatcher fixes of :mod:`.dispatch`; the lifecycle; validation and plans),
:mod:`.routing` (one elastic router forward), :mod:`.aux_loss` (load balancing on the realised
map), :mod:`.records` (the routers it enumerates for the records front end of
:mod:`elastic_moe_plugin.core.records`), :mod:`.tracking` (metrics in Megatron's MoE tracker),
:mod:`.budget_rng` (κ's own stream, a named state of Megatron's RNG tracker), :mod:`.spec`
(``ElasticTopKRouter`` for explicit specs), :mod:`.megatron_lm` (Megatron-LM's scripts with the
patch applied) and :mod:`.training_log` (the routing metrics in Megatron-LM's own log).
``docs/parallelism.md`` covers the parallelisms and dispatchers.

Elastic routing, one MoE layer in training (paper §3.2, Eq. 4-5)::

    (1) logits [T, E] = gating(x)                    (stock; z-loss applied as stock)
    (2) κ [T] ~ q on {a..b}                         (BudgetSchedule, on κ's own stream: budget_rng)
    (3) top-b candidates by the stock selection rule (softmax / sigmoid / sqrtsoftplus score,
        expert bias for selection only; group-limited routing keeps the groups stock top-k
        keeps, then takes the top-b inside them), sorted by rank
    (4) keep the first κ_t candidates of token t; weights by the gate convention (docs/gates.md):
        full_softmax  w = p_e                       (Switch/OLMoE; Megatron pre-softmax)
        renormalized  w = p_e / Σ_kept p            (Qwen3; Megatron post-softmax), computed as a
                                                     softmax over the kept logits like Megatron
        sigmoid       w = s_e / Σ_kept s if κ_t > 1 else s_e   (Megatron's rule with κ for k)
        then × moe_router_topk_scaling_factor
    (5) capacity dropping as stock, capacity ceil(T·k/E · cf) from k (E[κ] = k), not from b
    (6) load balancing on the realised assignments: f_i = c_i / Σ_j c_j = c_i / Σκ with c the
        realised per-expert counts before capacity drops (paper: "load-balancing statistics are
        computed over the realized dispatched assignments")
    (7) expert-bias counts from the realised map (stock ``_apply_expert_bias``)

Padding-mask polarity, as Megatron's code uses it: ``padding_mask`` True = padding token.
"""

from elastic_moe_plugin.core.errors import UnsupportedMegatronError
from elastic_moe_plugin.core.plan import LayerPlan
from elastic_moe_plugin.core.records import RoutingRecord
from elastic_moe_plugin.mcore.patch import (
    ALLOW_UNSUPPORTED_ENV,
    SUPPORTED_MCORE_RANGE,
    active_config,
    apply,
    check_megatron_version,
    gate_for,
    is_applied,
    log_plan,
    megatron_core_version,
    model_plans,
    patched,
    patched_symbols,
    remove,
    resolve_plan,
    validate_router,
)
from elastic_moe_plugin.mcore.records import budget_histograms, reset_budget_histograms, routing_records, static_layers
from elastic_moe_plugin.mcore.routing import elastic_routing
from elastic_moe_plugin.mcore.spec import elastic_router_spec
from elastic_moe_plugin.mcore.tracking import log_routing_metrics, routing_metrics


def __getattr__(name: str):
    if name == "ElasticTopKRouter":  # built on first use: it subclasses Megatron's TopKRouter
        from elastic_moe_plugin.mcore import spec

        return spec.__getattr__(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "ALLOW_UNSUPPORTED_ENV",
    "SUPPORTED_MCORE_RANGE",
    "ElasticTopKRouter",
    "LayerPlan",
    "RoutingRecord",
    "UnsupportedMegatronError",
    "active_config",
    "apply",
    "budget_histograms",
    "check_megatron_version",
    "elastic_router_spec",
    "elastic_routing",
    "gate_for",
    "is_applied",
    "log_plan",
    "log_routing_metrics",
    "megatron_core_version",
    "model_plans",
    "patched",
    "patched_symbols",
    "remove",
    "reset_budget_histograms",
    "resolve_plan",
    "routing_metrics",
    "routing_records",
    "static_layers",
    "validate_router",
]
