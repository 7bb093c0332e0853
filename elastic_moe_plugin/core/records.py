"""Routing records and κ histograms, kept on each elastic router between logging steps.

After every training forward an elastic router holds (in its ``__dict__``, so no parameter,
buffer or state-dict key is added) the latest :class:`~elastic_moe_plugin.core.metrics.RoutingRecord`
and a running κ histogram ``LongTensor [b+1]`` (index = κ) since the last reset. Keeping them costs
two small device ops per layer and no host sync; :mod:`~elastic_moe_plugin.core.metrics` turns
them into logged scalars only when a logger asks.

Collecting them by layer follows one rule in both adapters: a router's layer index is the one
the adapter knows (Megatron's ``layer_number - 1``, transformers' ``layer_idx``), else its
position among the model's routers; two routers with the same index are an error naming both
(e.g. Qwen3-Omni's thinker and talker stacks: collect one stack at a time).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from elastic_moe_plugin.core.metrics import RoutingRecord

RECORD_ATTR = "_elastic_record"
HISTOGRAM_ATTR = "_elastic_budget_histogram"


def remember(
    router: torch.nn.Module,
    width: int,
    budgets: torch.Tensor,
    candidate_ids: torch.Tensor,
    kept: torch.Tensor,
    retained_weight_sums: torch.Tensor,
    *,
    count: bool,
    capacity_dropped: torch.Tensor | None = None,
) -> None:
    """Store this forward's record on ``router``; with ``count``, add κ [T] to its histogram [b+1].

    Args:
        width: b, the candidate slots per token (the histogram has b + 1 bins).
        budgets: κ [T] (LongTensor).
        candidate_ids: [T, b] expert ids by router rank; kept: [T, b] bool, slot j kept iff j < κ_t.
        retained_weight_sums: [T], Σ of the kept gate weights.
        count: False for a forward that replays a step already counted (activation recompute).
        capacity_dropped: [T, b] bool, kept slots that a capacity factor dropped; None without one.
    """
    router.__dict__[RECORD_ATTR] = RoutingRecord(
        budgets=budgets.detach(),
        expert_ids=torch.where(kept, candidate_ids, -1).detach(),
        retained_weight_sums=retained_weight_sums.detach(),
        capacity_dropped=None if capacity_dropped is None else capacity_dropped.detach(),
    )
    if not count:
        return
    histogram = router.__dict__.get(HISTOGRAM_ATTR)
    if histogram is None or histogram.numel() != width + 1 or histogram.device != budgets.device:
        histogram = torch.zeros(width + 1, dtype=torch.long, device=budgets.device)
        router.__dict__[HISTOGRAM_ATTR] = histogram
    histogram.scatter_add_(0, budgets, torch.ones_like(budgets))


def collect(
    routers: Iterable[tuple[str, torch.nn.Module]],
    attribute: str,
    layer_index: Callable[[str, torch.nn.Module], int | None],
) -> dict[int, Any]:
    """``{layer index: router.__dict__[attribute]}`` for the routers that hold ``attribute``.

    Args:
        routers: ``(qualified name, router)`` in model order.
        layer_index: the adapter's index of a router, or None when it does not know one (then
            the router's position among ``routers`` is used).

    Raises:
        ValueError: two routers map to one index.
    """
    values: dict[int, Any] = {}
    names: dict[int, str] = {}
    for position, (name, router) in enumerate(routers):
        value = router.__dict__.get(attribute)
        if value is None:
            continue
        index = layer_index(name, router)
        index = position if index is None else index
        if index in values:
            raise ValueError(
                f"routers {names[index]!r} and {name!r} both have decoder-layer index {index}: the model has "
                f"several MoE stacks (e.g. Qwen3-Omni's thinker and talker) or routers without a layer number. "
                f"Pass one stack (e.g. routing_records(model.thinker)), or set each router's layer number."
            )
        values[index] = value
        names[index] = name
    return dict(sorted(values.items()))


def reset_histograms(histograms: Iterable[torch.Tensor]) -> None:
    """Zero κ histograms in place, so the next log covers only the steps after this one."""
    for histogram in histograms:
        histogram.zero_()


__all__ = ["HISTOGRAM_ATTR", "RECORD_ATTR", "collect", "remember", "reset_histograms"]
