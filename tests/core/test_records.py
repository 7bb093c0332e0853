"""The records front end (``core.records``, ``core.metrics.model_routing_metrics``) on plain modules.

No framework: the routers are bare ``torch.nn.Module`` objects carrying the state a training
forward leaves (``core.router_state``: a resolved plan, what it routed and κ counted via
``RouterState.remember``). Every expectation is written out by hand.
"""

from __future__ import annotations

import pytest
import numpy as np
import torch

from elastic_moe_plugin import BudgetSchedule, ElasticConfig
from elastic_moe_plugin.core import metrics, plan, records, router_state
from elastic_moe_plugin.core.plan import LayerPlan
from elastic_moe_plugin.core.records import RouterSite
from elastic_moe_plugin.core.budget_stream import ProcessStream
from elastic_moe_plugin.core.router_state import ElasticPath, ensure_state
from elastic_moe_plugin.core.routing import Routing, RoutingRule

SCHEDULE = BudgetSchedule.parse("1-3", 2)
ELASTIC = LayerPlan(schedule=SCHEDULE, gate="renormalized", sampling="iid", layer_index=None)


def _remember(router, budgets, ids, kept, gate_weights, **keywords):
    """``RouterState.remember`` of one forward that routed ``budgets`` [T] to ``ids`` / ``kept`` [T, b]."""
    routing = Routing(ids, kept, budgets, gate_weights, gate_weights)
    ensure_state(router).remember(routing, **keywords)


def _elastic(router, budgets):
    """What an elastic training forward leaves on ``router``: its plan, what it routed, κ counted."""
    ensure_state(router).resolved("generation", ElasticPath(ELASTIC, RoutingRule(), ProcessStream(lambda: 0), 0))
    width = SCHEDULE.high
    ids = torch.arange(width).repeat(len(budgets), 1)
    kept = torch.arange(width).unsqueeze(0) < torch.tensor(budgets).unsqueeze(1)
    _remember(router, torch.tensor(budgets), ids, kept, kept.float() / torch.tensor(budgets)[:, None], count=True)


def _static(router):
    ensure_state(router).resolved("generation", None)  # a stock top-k forward resolves no elastic path


def _sites(*layer_indices):
    return [RouterSite(f"layers.{i}.gate", torch.nn.Module(), index, 2, 4) for i, index in enumerate(layer_indices)]


def test_layers_are_the_adapters_index_else_the_position():
    sites = _sites(None, 5, None)
    for site in sites:
        _elastic(site.router, [1, 3])
    assert list(records.routing_records(sites)) == [0, 2, 5]  # positions 0 and 2, index 5; sorted
    assert {index: h.tolist() for index, h in records.budget_histograms(sites).items()} == {
        0: [0, 1, 0, 1], 2: [0, 1, 0, 1], 5: [0, 1, 0, 1]}
    records.reset_budget_histograms(sites)
    assert all(h.sum() == 0 for h in records.budget_histograms(sites).values())


def test_two_routers_on_one_layer_are_an_error_naming_both():
    sites = _sites(3, 3)
    for site in sites:
        _elastic(site.router, [2])
    with pytest.raises(ValueError, match=r"'layers.0.gate' and 'layers.1.gate' both have decoder-layer index 3"):
        records.routing_records(sites)


def test_static_layers_are_the_routers_whose_cached_plan_is_none():
    sites = _sites(0, 1, 2)
    _static(sites[0].router)
    _elastic(sites[1].router, [1, 2, 3])
    # sites[2] never ran a training forward: neither static nor elastic
    assert records.static_layers(sites) == {0: 2}
    assert records.trained_schedule(sites) == (SCHEDULE, 4)
    assert records.trained_schedule(sites[:1]) == (BudgetSchedule.static(2), 4)
    assert records.trained_schedule([]) is None


def test_model_routing_metrics_reports_elastic_and_static_layers():
    sites = _sites(0, 1)
    _static(sites[0].router)
    _elastic(sites[1].router, [1, 3, 3, 1])
    values = metrics.model_routing_metrics(sites)
    assert values["elastic_moe/layer_0/mean_kappa"] == 2.0 and values["elastic_moe/layer_1/mean_kappa"] == 2.0
    assert values["elastic_moe/layer_1/kappa_frac_3"] == 0.5
    assert values["elastic_moe/layer_1/topk_set_changed_frac"] == 1.0  # every κ ≠ k = 2
    assert values["elastic_moe/topk_set_changed_frac"] == 0.5  # the static layer counts at 0
    elastic_only = metrics.model_routing_metrics(sites, include_static=False)
    assert not any(key.startswith("elastic_moe/layer_0/") for key in elastic_only)
    assert metrics.model_routing_metrics(sites, lambda: None) == {}  # the adapter's schedule: none
    assert metrics.model_routing_metrics(_sites(0)) == {}  # nothing ran yet


def test_model_plans_key_by_layer_and_need_an_enabled_config():
    sites = _sites(None, 1)
    resolved = {id(sites[0].router): ELASTIC, id(sites[1].router): None}
    config = ElasticConfig(schedule="1-3")
    plans, topk = records.model_plans(sites, config, lambda site: resolved[id(site.router)])
    assert plans == {0: ELASTIC, 1: None} and topk == {0: 2, 1: 2}
    assert records.model_plans(sites, None, lambda site: ELASTIC) == ({}, {})
    assert records.model_plans(sites, ElasticConfig(enabled=False), lambda site: ELASTIC) == ({}, {})
    line = plan.log_plan(plans, topk, "test")
    assert line == ("elastic-moe plan (test, 2 MoE layers): elastic 1-3 around k=2 (σ=1.5), renormalized gate, "
                    "iid sampling: layers 0; static top-2: layers 1")
    assert plan.log_plan({}, {}, "test") is None


def test_host_counted_histograms_add_up_fold_reset_and_copy_exactly():
    """κ's histogram given by the draw (host counts) is kept on the host: many forwards (past the
    fold of pending counts), a read, a reset and a copy of the module give the hand-summed counts."""
    import copy

    import numpy as np

    sites = _sites(0)
    router, width = sites[0].router, SCHEDULE.high
    ids = torch.arange(width).repeat(2, 1)
    kept = torch.ones(2, width, dtype=torch.bool)
    expected = np.zeros(width + 1, dtype=np.int64)
    for step in range(router_state.PENDING_FOLD + 7):  # past the fold of pending counts
        counts = np.array([0, step % 3, 1, step % 5], dtype=np.int64)
        expected += counts
        _remember(router, torch.tensor([1, 2]), ids, kept, kept.float(), count=True, budget_counts=counts)
        if step == 100:
            assert records.budget_histograms(sites)[0].tolist() == expected.tolist()  # a read folds the pending ones
    assert records.budget_histograms(sites)[0].tolist() == expected.tolist()
    copied = copy.deepcopy(router)
    records.reset_budget_histograms(sites)
    assert records.budget_histograms(sites)[0].tolist() == [0, 0, 0, 0]
    _remember(router, torch.tensor([1, 2]), ids, kept, kept.float(), count=True, budget_counts=np.array([0, 1, 1, 0]))
    _remember(router, torch.tensor([1, 2]), ids, kept, kept.float(), count=False,  # a recompute
              budget_counts=np.array([0, 1, 1, 0]))
    assert records.budget_histograms(sites)[0].tolist() == [0, 1, 1, 0]
    assert records.routing_records(sites)[0].budget_counts.tolist() == [0, 1, 1, 0]  # the record keeps them too
    copied_sites = [RouterSite("copy", copied, 0, 2, 4)]
    assert records.budget_histograms(copied_sites)[0].tolist() == expected.tolist()  # the copy kept its own counts
    # the copy's record too (a read-only record used to make copy.deepcopy of a trained router raise)
    assert records.routing_records(copied_sites)[0].budgets.tolist() == [1, 2]
    assert records.routing_records(copied_sites)[0].expert_ids.tolist() == ids.tolist()


def test_device_counted_histograms_count_the_budgets_tensor():
    """Without host counts (top-p κ, computed on the device) κ is counted on κ's device."""
    sites = _sites(0)
    _elastic(sites[0].router, [3, 1, 3, 2])
    histogram = records.budget_histograms(sites)[0]
    assert isinstance(ensure_state(sites[0].router).histogram, torch.Tensor)
    assert histogram.tolist() == [0, 1, 1, 2]
    assert records.routing_records(sites)[0].budget_counts is None
    # host counts of other than b + 1 bins are not this router's histogram: κ is counted on the device
    width = SCHEDULE.high
    _remember(sites[0].router, torch.tensor([1, 2]), torch.arange(width).repeat(2, 1),
              torch.ones(2, width, dtype=torch.bool), torch.ones(2, width), count=True,
              budget_counts=np.zeros(width + 3, dtype=np.int64))
    assert records.routing_records(sites)[0].budget_counts is None
    assert records.budget_histograms(sites)[0].tolist() == [0, 2, 2, 2]
