"""Elastic Expert Routing for Megatron-core: a class-level patch of ``TopKRouter``.

Usage (call before building the model, on every rank)::

    from elastic_moe_plugin import ElasticConfig, mcore

    mcore.apply(ElasticConfig(schedule="6-10", layers="3-7"))
    model = GPTModel(...)                      # every TopKRouter now routes elastically in training

    with mcore.patched(ElasticConfig()):       # or scoped
        ...

What is patched (all on ``megatron.core.transformer.moe.router.TopKRouter``, so subclasses such as
mcore-bridge's router and layers built from every stock spec are covered, whenever they were built):

- ``TopKRouter.routing``: in training, elastic layers run :func:`elastic_routing`; in eval mode,
  in layers outside ``ElasticConfig.layers``, in MTP layers, and for ``schedule="static"`` the
  original method runs unchanged, so results are bit-for-bit stock.
- ``TopKRouter.__init__``: runs the original, then validates the config against the router's
  model config (top-k, expert count, layer count, unsupported options), so a bad setting stops the
  run at model build on every rank instead of mid-training.

Not patched: the ``TopKRouter`` name itself. ``MoESubmodules.router`` binds its default at import
time, so rebinding the name would silently do nothing. The router's parameters and buffers are
untouched, so checkpoints stay interchangeable with stock Megatron and transformers.

For explicit specs instead of monkey-patching, use :class:`ElasticTopKRouter` via
:func:`elastic_router_spec`; both routes share :func:`elastic_routing`.

Elastic routing, one MoE layer in training (paper §3.2, Eq. 4-5)::

    (1) logits [T, E] = gating(x)                    (stock; z-loss applied as stock)
    (2) κ [T] ~ q on {a..b}                         (BudgetSchedule, torch's default generator)
    (3) top-b candidates by the stock selection rule (softmax / sigmoid / sqrtsoftplus score,
        expert bias for selection only, group-limited routing with b), sorted by rank
    (4) keep the first κ_t candidates of token t; weights by the gate convention (seed 000):
        full_softmax  w = p_e                       (Switch/OLMoE; Megatron pre-softmax)
        renormalized  w = p_e / Σ_kept p            (Qwen3; Megatron post-softmax), computed as a
                                                     softmax over the kept logits like Megatron
        sigmoid       w = s_e / Σ_kept s if κ_t > 1 else s_e   (Megatron's rule with κ for k)
        then × moe_router_topk_scaling_factor
    (5) capacity dropping as stock, sized with b
    (6) load balancing on the realised assignments: f_i = c_i / Σ_j c_j = c_i / Σκ with c the
        realised per-expert counts before capacity drops (paper: "load-balancing statistics are
        computed over the realized dispatched assignments")
    (7) expert-bias counts from the realised map (stock ``_apply_expert_bias``)

Padding-mask polarity, as Megatron's code uses it: ``padding_mask`` True = padding token.
"""

from elastic_moe_plugin.mcore.patch import (
    ALLOW_UNSUPPORTED_ENV,
    SUPPORTED_MCORE_RANGE,
    active_config,
    apply,
    check_megatron_version,
    elastic_router_spec,
    is_applied,
    megatron_core_version,
    patched,
    remove,
    validate_router,
)
from elastic_moe_plugin.mcore.routing import (
    LayerPlan,
    RoutingRecord,
    UnsupportedMegatronError,
    budget_histograms,
    elastic_routing,
    reset_budget_histograms,
    routing_records,
)
from elastic_moe_plugin.mcore.tracking import log_routing_metrics, routing_metrics


def __getattr__(name: str):
    if name == "ElasticTopKRouter":
        from elastic_moe_plugin.mcore import patch

        return patch.__getattr__(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "ALLOW_UNSUPPORTED_ENV", "SUPPORTED_MCORE_RANGE", "ElasticTopKRouter", "LayerPlan", "RoutingRecord",
    "UnsupportedMegatronError", "active_config", "apply", "budget_histograms", "check_megatron_version",
    "elastic_router_spec", "elastic_routing", "is_applied", "megatron_core_version", "patched", "remove",
    "log_routing_metrics", "reset_budget_histograms", "routing_metrics", "routing_records", "validate_router",
]
