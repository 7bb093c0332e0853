"""What the elastic routers of a Megatron-core model did: routing records and κ histograms.

Layer indices are 0-based and global: ``router.layer_number - 1`` (Megatron's 1-based number
includes pipeline and virtual-pipeline offsets).
"""

from __future__ import annotations

import torch

from elastic_moe_plugin.core import records
from elastic_moe_plugin.core.metrics import RoutingRecord


def _layer_index(name: str, router: torch.nn.Module) -> int | None:
    layer_number = getattr(router, "layer_number", None)
    return None if layer_number is None else int(layer_number) - 1


def _collect(model: torch.nn.Module, attribute: str) -> dict:
    routers = [(name, module) for name, module in model.named_modules() if attribute in module.__dict__]
    return records.collect(routers, attribute, _layer_index)


def routing_records(model: torch.nn.Module) -> dict[int, RoutingRecord]:
    """{0-based layer index: RoutingRecord} of every elastic router's latest training forward.

    Raises:
        ValueError: two routers share a layer index.
    """
    return _collect(model, records.RECORD_ATTR)


def budget_histograms(model: torch.nn.Module) -> dict[int, torch.Tensor]:
    """{0-based layer index: LongTensor [b+1]} running κ counts since the last reset (bounded)."""
    return _collect(model, records.HISTOGRAM_ATTR)


def reset_budget_histograms(model: torch.nn.Module) -> None:
    records.reset_histograms(budget_histograms(model).values())


__all__ = ["budget_histograms", "reset_budget_histograms", "routing_records"]
