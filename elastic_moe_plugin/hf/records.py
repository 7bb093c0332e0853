"""What the elastic routers of a transformers model did: records, κ histograms, logged scalars."""

from __future__ import annotations

import torch

from elastic_moe_plugin.core import metrics, records
from elastic_moe_plugin.core.metrics import RoutingRecord
from elastic_moe_plugin.core.plan import PLAN_CACHE_ATTR
from elastic_moe_plugin.core.schedule import BudgetSchedule
from elastic_moe_plugin.hf.families import covered_routers, router_layer_index


def _collect(model: torch.nn.Module, attribute: str) -> dict:
    routers = [(name, router) for name, router, _ in covered_routers(model)]
    return records.collect(routers, attribute, router_layer_index)


def routing_records(model: torch.nn.Module) -> dict[int, RoutingRecord]:
    """{0-based layer index: RoutingRecord} of every elastic router's latest training forward.

    Raises:
        ValueError: two routers share a layer index (several MoE stacks: pass one stack).
    """
    return _collect(model, records.RECORD_ATTR)


def budget_histograms(model: torch.nn.Module) -> dict[int, torch.Tensor]:
    """{0-based layer index: LongTensor [b+1]}: κ counts (index = κ) since the last reset.

    Bounded in size; every routed token is counted once per step, also under gradient checkpointing.
    """
    return _collect(model, records.HISTOGRAM_ATTR)


def reset_budget_histograms(model: torch.nn.Module) -> None:
    records.reset_histograms(budget_histograms(model).values())


def static_layers(model: torch.nn.Module) -> dict[int, int]:
    """{0-based layer index: k} of the routers that ran a training forward as stock top-k (outside
    ``ElasticConfig.layers``, or a ``static`` schedule): their cached plan is None."""
    found = {}
    for name, router, _ in covered_routers(model):
        cached = router.__dict__.get(PLAN_CACHE_ATTR)
        if cached is not None and cached[1] is None:
            index = router_layer_index(name, router)
            if index is not None:
                found[index] = int(router.top_k)
    return found


def routing_metrics(model: torch.nn.Module) -> dict[str, float]:
    """Scalars for a trainer's logs from the records and κ histograms (one host sync per call).

    ``{"elastic_moe/layer_<i>/<name>": ..., "elastic_moe/<name>": ...}`` as computed by
    :func:`elastic_moe_plugin.core.metrics.routing_metrics` (mean κ, κ shares, exposure per rank,
    retained weight sums, expert load imbalance), static layers at κ = k; empty before the first
    training forward. Call :func:`reset_budget_histograms` after logging to make each log cover
    its own steps.
    """
    layer_records, histograms, static = routing_records(model), budget_histograms(model), static_layers(model)
    if not (layer_records or histograms or static):
        return {}
    # The schedule and expert count of an elastic router (its cached plan); a model's elastic
    # routers share both. Without one (every layer static), the point mass at k.
    routers = [router for _, router, _ in covered_routers(model)]
    for router in routers:
        cached = router.__dict__.get(PLAN_CACHE_ATTR)
        if cached is not None and cached[1] is not None:
            return metrics.routing_metrics(layer_records, histograms, cached[1].schedule, int(router.num_experts),
                                           static)
    k = next(iter(static.values()))
    return metrics.routing_metrics({}, {}, BudgetSchedule.static(k), int(routers[0].num_experts), static)


__all__ = ["budget_histograms", "reset_budget_histograms", "routing_metrics", "routing_records", "static_layers"]
