"""What the elastic routers of a transformers model did: the routers it enumerates for the records
front end (:mod:`elastic_moe_plugin.core.records`, :func:`~elastic_moe_plugin.core.metrics.model_routing_metrics`).

The routers are the covered router classes (:func:`.families.covered_routers`), in module order,
each at its 0-based decoder-layer index: the ``layer_idx`` the patched decoder layer tagged it
with, else the ``...layers.<i>.<site>`` of its module path (:func:`.families.router_layer_index`),
else its position among the model's routers; and the routers that cannot rank (DeepSeek-V4's hash
layers), as static layers. Where a layer holds several routers, each is keyed (layer, part)
(:func:`router_parts`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from elastic_moe_plugin.core import metrics, records
from elastic_moe_plugin.core.layer_keys import LayerKey
from elastic_moe_plugin.core.records import RouterSite, RoutingRecord
from elastic_moe_plugin.hf.families import (
    layer_index_from_name,
    model_routers,
    router_layer_index,
    router_site,
    router_stack,
)


def router_sites(model: torch.nn.Module) -> list[RouterSite]:
    """Every covered router of ``model``: name, module, layer index, k and E (its family's ``top_k`` and
    ``num_experts``, or where that family keeps them), and its part where its layer holds several
    (:func:`router_parts`)."""
    sites = [
        RouterSite(
            name,
            router,
            router_layer_index(name, router) if why is None else layer_index_from_name(name),
            family.top_k_of(router),
            family.num_experts_of(router),
            # a router that cannot rank (DeepSeek-V4's hash layers): a static layer of the model
            static=why is not None,
        )
        for name, router, family, why in model_routers(model)
    ]
    parts = router_parts(sites)
    return [dataclasses.replace(site, part=parts[site.name]) if site.name in parts else site for site in sites]


def router_parts(sites: list[RouterSite]) -> dict[str, str]:
    """{router name: part} of every router of a model where some layer holds several (else {}):
    the segment of its stack that tells the stacks apart (DiffusionGemma: ``encoder`` /
    ``decoder``; Qwen3-Omni: ``thinker`` / ``talker``), then the segment of its site that tells a
    layer's routers apart (ERNIE-4.5-VL: ``text_moe`` / ``vision_moe``), so that every router of one
    stack and site gets the same part. Only routers whose path shows the layer index they are keyed
    by count: routers tagged with another router's index stay an error of the readers."""
    paths: dict[str, tuple[str, str]] = {}
    layers: dict[int, int] = {}
    for site in sites:
        stack, site_path = router_stack(site.name), router_site(site.name)
        if site.layer_index is None or stack is None or site_path is None:
            continue
        if layer_index_from_name(site.name) == site.layer_index:
            paths[site.name] = (stack, site_path)
            layers[site.layer_index] = layers.get(site.layer_index, 0) + 1
    if not layers or max(layers.values()) < 2:
        return {}
    stack_part = _distinguishing_segment({stack for stack, _ in paths.values()})
    site_part = _distinguishing_segment({site_path for _, site_path in paths.values()})
    return {
        name: ".".join(part for part in (stack_part(stack), site_part(site_path)) if part)
        for name, (stack, site_path) in paths.items()
    }


def _distinguishing_segment(paths: set[str]) -> Callable[[str], str]:
    """For dotted paths, the function that gives each one's first segment where they differ ("" for
    all where there is only one path)."""
    split = [path.split(".") for path in paths]
    index = next((i for i in range(min(map(len, split))) if len({parts[i] for parts in split}) > 1), None)
    if len(paths) < 2 or index is None:
        return lambda path: ""
    return lambda path: path.split(".")[index]


def router_keys(model: torch.nn.Module) -> dict[str, LayerKey]:
    """{router name: its key in the readers' dicts}: its 0-based layer index, or a
    :class:`~elastic_moe_plugin.core.layer_keys.RouterKey` (layer, part) where a layer of ``model``
    holds several routers."""
    return {site.name: key for key, site in records.keyed_sites(router_sites(model))}


def routing_records(model: torch.nn.Module) -> dict[LayerKey, RoutingRecord]:
    """{0-based layer index: RoutingRecord} of every elastic router's latest training forward.

    Raises:
        ValueError: two routers share a layer index that their module paths do not show.
    """
    return records.routing_records(router_sites(model))


def budget_histograms(model: torch.nn.Module) -> dict[LayerKey, torch.Tensor]:
    """{0-based layer index: LongTensor [b+1]}: κ counts (index = κ) since the last reset.

    Bounded in size; every routed token is counted once per step, also under gradient checkpointing.
    """
    return records.budget_histograms(router_sites(model))


def reset_budget_histograms(model: torch.nn.Module) -> None:
    """Zero every elastic router's κ histogram, so the next log covers only the steps after this one."""
    records.reset_budget_histograms(router_sites(model))


def static_layers(model: torch.nn.Module) -> dict[LayerKey, int]:
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
    "router_keys",
    "router_sites",
    "routing_metrics",
    "routing_records",
    "static_layers",
]
