"""What the elastic routers of a Megatron-core model did: the routers it enumerates for the records
front end (:mod:`elastic_moe_plugin.core.records`, :func:`~elastic_moe_plugin.core.metrics.model_routing_metrics`).

The routers are the decoder-layer ``TopKRouter`` instances (subclasses included: mcore-bridge's,
``ElasticTopKRouter``) of a module or of a list of model chunks (virtual pipeline stages), in
module order, chunk by chunk. Layer indices are 0-based and global: ``router.layer_number - 1``
(Megatron's 1-based number includes pipeline and virtual-pipeline offsets), else the router's
position among the enumerated routers. Multi-token-prediction routers are not decoder layers and
are left out (:func:`is_mtp_router`); they always route stock top-k.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from elastic_moe_plugin.core import records
from elastic_moe_plugin.core.records import RouterSite, RoutingRecord


class ModelRouters(list):
    """:func:`router_sites` of a model, with the model's ``chunks``: pass it wherever a model is
    expected, and the routers are not enumerated again (a logging step reads them several times;
    each enumeration walks every module of the model)."""

    def __init__(self, sites: list[RouterSite], chunks: list[torch.nn.Module]) -> None:
        super().__init__(sites)
        self.chunks = chunks


def model_chunks(model: torch.nn.Module | Sequence[torch.nn.Module]) -> list[torch.nn.Module]:
    """``[model]`` for one module, else the list of model chunks (a :class:`ModelRouters`' own).

    Raises:
        TypeError: neither a module nor a sequence of modules.
    """
    if isinstance(model, torch.nn.Module):
        return [model]
    if isinstance(model, ModelRouters):
        return model.chunks
    chunks = list(model)
    if not all(isinstance(chunk, torch.nn.Module) for chunk in chunks):
        raise TypeError("expected a torch.nn.Module or a sequence of model chunks (torch.nn.Module).")
    return chunks


def is_mtp_router(router: Any) -> bool:
    """Whether ``router`` routes a multi-token-prediction layer: ``is_mtp_layer`` (megatron-core
    0.17+), or a layer number past the decoder (0.16 numbers MTP layers ``num_layers + i`` and has
    no flag on the router)."""
    if getattr(router, "is_mtp_layer", False):
        return True
    layer_number = getattr(router, "layer_number", None)
    return layer_number is not None and int(layer_number) - 1 >= int(router.config.num_layers)


def router_sites(model: torch.nn.Module | Sequence[torch.nn.Module]) -> ModelRouters:
    """Every decoder-layer ``TopKRouter`` of the module or chunks: name (``<chunk>.<name>`` with
    several chunks), module, ``layer_number - 1``, k = ``moe_router_topk``, E = ``num_moe_experts``;
    a :class:`ModelRouters` is returned as it is."""
    from megatron.core.transformer.moe.router import TopKRouter

    if isinstance(model, ModelRouters):
        return model
    chunks = model_chunks(model)
    sites = []
    for number, chunk in enumerate(chunks):
        for name, module in chunk.named_modules():
            if not isinstance(module, TopKRouter) or is_mtp_router(module):
                continue
            layer_number = getattr(module, "layer_number", None)
            config = module.config
            sites.append(
                RouterSite(
                    name if len(chunks) == 1 else f"{number}.{name}",
                    module,
                    None if layer_number is None else int(layer_number) - 1,
                    int(config.moe_router_topk),
                    int(config.num_moe_experts),
                )
            )
    return ModelRouters(sites, chunks)


def routing_records(model: torch.nn.Module | Sequence[torch.nn.Module]) -> dict[int, RoutingRecord]:
    """{0-based global layer index: RoutingRecord} of every elastic router's latest training forward.

    Raises:
        ValueError: two routers share a layer index.
    """
    return records.layer_indexed(records.routing_records(router_sites(model)))


def budget_histograms(model: torch.nn.Module | Sequence[torch.nn.Module]) -> dict[int, torch.Tensor]:
    """{0-based global layer index: LongTensor [b+1]} running κ counts since the last reset (bounded)."""
    return records.layer_indexed(records.budget_histograms(router_sites(model)))


def reset_budget_histograms(model: torch.nn.Module | Sequence[torch.nn.Module]) -> None:
    """Zero every elastic router's κ histogram, so the next log covers only the steps after this one."""
    records.reset_budget_histograms(router_sites(model))


def static_layers(model: torch.nn.Module | Sequence[torch.nn.Module]) -> dict[int, int]:
    """{0-based global layer index: k} of the decoder-layer routers that ran a training forward as
    stock top-k (cached plan None: outside ``ElasticConfig.layers``, or a ``static`` schedule)."""
    return records.layer_indexed(records.static_layers(router_sites(model)))


__all__ = [
    "ModelRouters",
    "budget_histograms",
    "is_mtp_router",
    "model_chunks",
    "reset_budget_histograms",
    "router_sites",
    "routing_records",
    "static_layers",
]
