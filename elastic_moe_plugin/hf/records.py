"""What the elastic routers of a transformers model did: the routers it enumerates for the records
front end (:mod:`elastic_moe_plugin.core.records`, :func:`~elastic_moe_plugin.core.metrics.model_routing_metrics`).

The routers are the covered router classes (:func:`.families.covered_routers`), in module order,
each at its 0-based decoder-layer index: the ``layer_idx`` the patched decoder layer tagged it
with, else the ``...layers.<i>.mlp.gate`` of its module path (:func:`.families.router_layer_index`),
else its position among the model's routers.
"""

from __future__ import annotations

import torch

from elastic_moe_plugin.core import metrics, records
from elastic_moe_plugin.core.records import RouterSite, RoutingRecord
from elastic_moe_plugin.hf.families import covered_routers, router_layer_index


def router_sites(model: torch.nn.Module) -> list[RouterSite]:
    """Every covered router of ``model``: name, module, layer index, k and E (its family's ``top_k`` and
    ``num_experts``, or where that family keeps them)."""
    return [
        RouterSite(
            name, router, router_layer_index(name, router), family.top_k_of(router), family.num_experts_of(router)
        )
        for name, router, family in covered_routers(model)
    ]


def routing_records(model: torch.nn.Module) -> dict[int, RoutingRecord]:
    """{0-based layer index: RoutingRecord} of every elastic router's latest training forward.

    Raises:
        ValueError: two routers share a layer index (several MoE stacks: pass one stack).
    """
    return records.routing_records(router_sites(model))


def budget_histograms(model: torch.nn.Module) -> dict[int, torch.Tensor]:
    """{0-based layer index: LongTensor [b+1]}: κ counts (index = κ) since the last reset.

    Bounded in size; every routed token is counted once per step, also under gradient checkpointing.
    """
    return records.budget_histograms(router_sites(model))


def reset_budget_histograms(model: torch.nn.Module) -> None:
    """Zero every elastic router's κ histogram, so the next log covers only the steps after this one."""
    records.reset_budget_histograms(router_sites(model))


def static_layers(model: torch.nn.Module) -> dict[int, int]:
    """{0-based layer index: k} of the routers that ran a training forward as stock top-k (outside
    ``ElasticConfig.layers``, or a ``static`` schedule): their cached plan is None."""
    return records.static_layers(router_sites(model))


def routing_metrics(model: torch.nn.Module, *, per_layer: bool = True) -> dict[str, float]:
    """Scalars for a trainer's logs from the records and κ histograms (one device read for all
    layers; top-p κ histograms one more each). A logging hook calls
    :func:`~elastic_moe_plugin.hf.patch.logged_metrics`, which follows ``ElasticConfig.log_metrics``.

    ``{"elastic_moe/layer_<i>/<name>": ..., "elastic_moe/<name>": ...}`` as computed by
    :func:`elastic_moe_plugin.core.metrics.routing_metrics` (mean κ, κ shares, exposure per rank,
    retained weight sums, expert load imbalance), static layers at κ = k, named after the schedule
    the elastic routers trained with (:func:`elastic_moe_plugin.core.records.trained_schedule`);
    empty before the first training forward. ``per_layer=False``: only ``elastic_moe/<name>``, the
    layer mean of every name but the schedule's constants. Call :func:`reset_budget_histograms`
    after logging to make each log cover its own steps.
    """
    return metrics.model_routing_metrics(router_sites(model), per_layer=per_layer)


__all__ = [
    "budget_histograms",
    "reset_budget_histograms",
    "router_sites",
    "routing_metrics",
    "routing_records",
    "static_layers",
]
