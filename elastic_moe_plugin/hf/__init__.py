"""Elastic Expert Routing for transformers 5.x: one class-level patch of the MoE top-k routers.

Usage (call before building the model, in every process)::

    from elastic_moe_plugin import ElasticConfig, hf

    hf.apply(ElasticConfig(schedule="6-10", layers="3-7"))
    model = AutoModelForCausalLM.from_pretrained(...)   # every covered router routes elastically in training

    hf.apply(config, model=model)      # a model built *before* apply: also tags its layers and validates
    with hf.patched(ElasticConfig()):  # or scoped
        ...

Modules: :mod:`.router_family` (a family as data), :mod:`.family_table` (the covered families,
every transformers MoE family whose router ranks, and the refused ones), :mod:`.families` (finding
them in the installed transformers and in models), :mod:`.rules` (a family's router read into a
routing rule), :mod:`.plans` (a router's plan and start-up checks), :mod:`.patch` (what is patched,
the lifecycle), :mod:`.routing` (one elastic router call, and the realised load-balancing loss),
:mod:`.experts` (expert compute that follows κ in every experts implementation),
:mod:`.records` (the routers it enumerates for the records front end of
:mod:`elastic_moe_plugin.core.records`: records, κ histograms, static layers, logged metrics).
``docs/transformers.md`` has the details.
"""

from elastic_moe_plugin.core.errors import UnsupportedTransformersError
from elastic_moe_plugin.core.plan import LayerPlan
from elastic_moe_plugin.core.records import RoutingRecord
from elastic_moe_plugin.hf.families import FAMILIES, RouterFamily, covered_router_classes, set_layer_index
from elastic_moe_plugin.hf.patch import (
    ALLOW_UNSUPPORTED_ENV,
    SUPPORTED_TRANSFORMERS_RANGE,
    active_config,
    apply,
    check_transformers_version,
    is_applied,
    log_plan,
    logged_metrics,
    model_plans,
    patched,
    patched_symbols,
    remove,
    tag_layers,
    transformers_version,
    validate_model,
)
from elastic_moe_plugin.hf.plans import gate_for, resolve_plan, validate_router
from elastic_moe_plugin.hf.records import (
    budget_histograms,
    reset_budget_histograms,
    router_keys,
    routing_metrics,
    routing_records,
    static_layers,
)
from elastic_moe_plugin.hf.routing import elastic_routing, realised_load_balancing_loss

__all__ = [
    "ALLOW_UNSUPPORTED_ENV",
    "FAMILIES",
    "SUPPORTED_TRANSFORMERS_RANGE",
    "LayerPlan",
    "RouterFamily",
    "RoutingRecord",
    "UnsupportedTransformersError",
    "active_config",
    "apply",
    "budget_histograms",
    "check_transformers_version",
    "covered_router_classes",
    "elastic_routing",
    "gate_for",
    "is_applied",
    "log_plan",
    "logged_metrics",
    "model_plans",
    "patched",
    "patched_symbols",
    "realised_load_balancing_loss",
    "remove",
    "reset_budget_histograms",
    "resolve_plan",
    "router_keys",
    "routing_metrics",
    "routing_records",
    "set_layer_index",
    "static_layers",
    "tag_layers",
    "transformers_version",
    "validate_model",
    "validate_router",
]
