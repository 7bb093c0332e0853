"""Routing statistics of one demo run, from the routers' outputs and Megatron's κ counts.

:class:`RoutingStats` hooks every ``TopKRouter``: a router returns ``(probs, routing_map)`` with
``routing_map`` bool [T, E], so a row sum is the token's realised budget κ and a column sum the
tokens an expert received. From those counts, per layer:

- the κ entry (:func:`kappa_summary`): mean, min, max and the histogram [n] indexed by budget;
- the observed exposure P(κ ≥ r) for r = 1..R (:func:`observed_exposure`), next to the
  schedule's survival a(r);
- the load imbalance max_e c_e / mean_e c_e of the tokens per expert (1 = perfectly even).

Elastic layers take κ from ``mcore.budget_histograms`` and cross-check it against the routing
maps (:func:`realised_budgets`).
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from elastic_moe_plugin.core.metrics import max_over_mean, observed_survival
from elastic_moe_plugin.core.schedule import BudgetSchedule


def _routers(model) -> dict[int, Any]:
    """{0-based layer index: TopKRouter}."""
    from megatron.core.transformer.moe.router import TopKRouter

    return {int(m.layer_number) - 1: m for m in model.modules() if isinstance(m, TopKRouter)}


class RoutingStats:
    """Forward hooks on every router: κ (row sums of the routing map) and tokens per expert.

    Training forwards fill ``kappa`` (whole run) and ``expert_counts`` (while ``count_experts`` is
    set); eval forwards fill ``eval_expert_counts`` while ``eval_on`` is set.
    """

    def __init__(self, model, num_experts: int) -> None:
        self.num_experts = num_experts
        self.kappa: dict[int, torch.Tensor] = {}
        self.expert_counts: dict[int, torch.Tensor] = {}
        self.eval_expert_counts: dict[int, torch.Tensor] = {}
        self.count_experts = False
        self.eval_on = False
        self.handles = [router.register_forward_hook(self._hook(layer)) for layer, router in _routers(model).items()]

    def _hook(self, layer: int):
        def hook(module, inputs, output) -> None:
            routing_map = output[1].detach()
            if module.training:
                kappa = routing_map.sum(dim=-1).long()
                counts = torch.bincount(kappa, minlength=self.num_experts + 1)
                self.kappa[layer] = self.kappa.get(layer, 0) + counts
                if self.count_experts:
                    self.expert_counts[layer] = self.expert_counts.get(layer, 0) + routing_map.sum(dim=0).long()
            elif self.eval_on:
                self.eval_expert_counts[layer] = self.eval_expert_counts.get(layer, 0) + routing_map.sum(dim=0).long()

        return hook

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()

    def imbalance(self, train_window_steps: int) -> dict[str, Any]:
        """Tokens-per-expert max/mean per layer, over the counted training steps and held-out."""
        return {
            "train": {str(layer): max_over_mean(c) for layer, c in sorted(self.expert_counts.items())},
            "train_window_steps": train_window_steps,
            "heldout": {str(layer): max_over_mean(c) for layer, c in sorted(self.eval_expert_counts.items())},
        }


def observed_exposure(histogram: torch.Tensor, ranks: int) -> list[float]:
    """Observed P(κ ≥ r) for r = 1..ranks from a κ histogram indexed by budget (0 beyond its end)."""
    missing = max(0, ranks + 1 - histogram.numel())
    padded = torch.cat([histogram, histogram.new_zeros(missing)])
    return observed_survival(padded)[1 : ranks + 1].tolist()


def kappa_summary(
    histogram: torch.Tensor, *, elastic: bool, source: str, matches_routing_maps: bool | None
) -> dict[str, Any]:
    """One layer's ``kappa`` entry: mean, support and counts of a (non-empty) κ histogram."""
    support = histogram.nonzero().flatten()
    total = float(histogram.sum())
    mean = float((histogram.double() * torch.arange(histogram.numel(), dtype=torch.double)).sum()) / total
    return {
        "mean": mean,
        "min": int(support.min()),
        "max": int(support.max()),
        "elastic": elastic,
        "source": source,
        "tokens": int(total),
        "histogram_matches_routing_maps": matches_routing_maps,
        "histogram": {str(r): int(histogram[r]) for r in range(histogram.numel()) if histogram[r] > 0},
    }


def _layer_histogram(
    run: str, layer: int, budget_histogram: torch.Tensor | None, from_maps: torch.Tensor
) -> tuple[torch.Tensor, str, bool | None]:
    """(κ histogram, its source, whether it matches the routing maps) for one layer."""
    if budget_histogram is None:
        return from_maps, "routing_maps", None
    # cross-check: no capacity factor, so the routing map's rows hold exactly κ
    padded = torch.zeros_like(from_maps)
    padded[: budget_histogram.numel()] = budget_histogram
    agrees = torch.equal(padded, from_maps)
    if not agrees:
        print(
            f"elastic-moe demo: warning: {run} run, layer {layer}: mcore.budget_histograms "
            f"disagrees with the routing maps' row sums",
            file=sys.stderr,
        )
    return budget_histogram, "budget_histograms", agrees


def realised_budgets(
    run: str,
    budget_histograms: Mapping[int, torch.Tensor],
    stats: RoutingStats,
    schedule: BudgetSchedule,
    elastic_layers: Sequence[int],
    topk: int,
    num_layers: int,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Per layer ``{"0": ...}``: the ``kappa`` entries and the ``exposure`` entries (observed P(κ ≥ r)
    for r = 1..max(high, k)+1 against the layer's schedule: ``schedule`` if elastic, static top-k
    otherwise). Elastic layers count κ Megatron-side, static layers through the routing maps.
    ``budget_histograms`` are on the CPU; the routing-map counts are moved there."""
    ranks = max(schedule.high, topk) + 1
    kappa, exposure = {}, {}
    for layer in range(num_layers):
        elastic = layer in elastic_layers
        from_maps = stats.kappa[layer].cpu()  # counted on the model's device
        histogram, source, agrees = _layer_histogram(run, layer, budget_histograms.get(layer), from_maps)
        layer_schedule = schedule if elastic else BudgetSchedule.static(topk)
        kappa[str(layer)] = kappa_summary(histogram, elastic=elastic, source=source, matches_routing_maps=agrees)
        exposure[str(layer)] = {
            "observed": observed_exposure(histogram, ranks),
            "schedule": list(layer_schedule.exposure(ranks)),
        }
    return kappa, exposure
