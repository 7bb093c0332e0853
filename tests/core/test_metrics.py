"""Routing metrics from routing records (``core.metrics``): the capacity-drop shares, by hand."""

import pytest
import torch

from elastic_moe_plugin import BudgetSchedule
from elastic_moe_plugin.core.metrics import layer_metrics, routing_metrics
from elastic_moe_plugin.core.records import RoutingRecord

# 4 tokens, b = 4 slots, k = 2: κ = (1, 2, 3, 4); slot j holds router rank j + 1
EXPERT_IDS = torch.tensor([[0, -1, -1, -1], [1, 2, -1, -1], [2, 3, 0, -1], [3, 0, 1, 2]])
DROPPED = torch.tensor([[False, False, False, False],
                        [False, True, False, False],
                        [False, False, True, False],
                        [True, False, True, True]])
SCHEDULE = BudgetSchedule.parse("1-3", 2)


def _record(capacity_dropped):
    return RoutingRecord(budgets=torch.tensor([1, 2, 3, 4]), expert_ids=EXPERT_IDS,
                         retained_weight_sums=torch.ones(4), capacity_dropped=capacity_dropped)


def test_capacity_drop_shares_count_selected_slots_by_router_rank():
    metrics = layer_metrics(_record(DROPPED), None, SCHEDULE, num_experts=4)
    # selected: 10 slots, 7 at ranks 1..2 and 3 at ranks 3..4; dropped: 5, of which 2 at ranks 1..2
    assert metrics["capacity_dropped_frac"] == pytest.approx(5 / 10)
    assert metrics["capacity_dropped_frac_top_k"] == pytest.approx(2 / 7)
    assert metrics["capacity_dropped_frac_beyond_k"] == pytest.approx(3 / 3)
    flat = routing_metrics({0: _record(DROPPED)}, {}, SCHEDULE, num_experts=4)
    assert flat["elastic_moe/capacity_dropped_frac"] == flat["elastic_moe/layer_0/capacity_dropped_frac"] == 0.5


def test_a_dropped_flag_on_an_unselected_slot_is_not_counted():
    stray = DROPPED.clone()
    stray[0, 3] = True  # token 0 has κ = 1: slot 3 was never selected
    assert layer_metrics(_record(stray), None, SCHEDULE, 4)["capacity_dropped_frac"] == pytest.approx(5 / 10)


def test_no_capacity_factor_means_no_drop_metrics_and_no_token_beyond_k_means_zero():
    assert not any(name.startswith("capacity_dropped") for name in layer_metrics(_record(None), None, SCHEDULE, 4))
    within_k = RoutingRecord(budgets=torch.tensor([2, 2]), expert_ids=torch.tensor([[0, 1, -1], [2, 3, -1]]),
                             retained_weight_sums=torch.ones(2),
                             capacity_dropped=torch.tensor([[False, True, False], [False, False, False]]))
    metrics = layer_metrics(within_k, None, SCHEDULE, 4)
    assert metrics["capacity_dropped_frac_beyond_k"] == 0.0
    assert metrics["capacity_dropped_frac_top_k"] == metrics["capacity_dropped_frac"] == pytest.approx(1 / 4)


def test_without_per_layer_values_every_name_is_its_mean_over_the_layers_that_give_it():
    """``per_layer=False`` (Megatron's layout without ``moe_per_layer_logging``): one value per name,
    the mean over the layers that report it (the minimum for ``retained_weight_sum_min``), by hand:
    layer 0 holds κ = (1, 2, 3, 4) with retained sums 1, layer 1 κ = (2, 2) with sums 0.5 and 0.7,
    layer 2 is static at κ = k = 2 (no record, so no weight or load value)."""
    second = RoutingRecord(budgets=torch.tensor([2, 2]), expert_ids=torch.tensor([[0, 1, -1, -1], [2, 3, -1, -1]]),
                           retained_weight_sums=torch.tensor([0.5, 0.7]))
    histograms = {0: torch.tensor([0, 1, 1, 1, 1]), 1: torch.tensor([0, 0, 2, 0, 0])}
    records = {0: _record(None), 1: second}
    flat = routing_metrics(records, histograms, SCHEDULE, 4, {2: 2}, per_layer=False)
    per_layer = routing_metrics(records, histograms, SCHEDULE, 4, {2: 2})
    names = {key.split("/")[-1] for key in per_layer if key.startswith("elastic_moe/layer_")}
    assert set(flat) == {f"elastic_moe/{name}" for name in names}  # every name, nothing per layer
    assert flat["elastic_moe/mean_kappa"] == pytest.approx((2.5 + 2 + 2) / 3)
    assert flat["elastic_moe/kappa_frac_2"] == pytest.approx((1 / 4 + 1 + 1) / 3)
    assert flat["elastic_moe/kappa_frac_3"] == pytest.approx((1 / 4 + 0 + 0) / 3)  # layer 0's 4 is outside 1-3
    assert flat["elastic_moe/exposure_rank_3"] == pytest.approx((2 / 4 + 0 + 0) / 3)
    assert flat["elastic_moe/topk_set_changed_frac"] == pytest.approx((3 / 4 + 0 + 0) / 3)
    assert flat["elastic_moe/retained_weight_sum_mean"] == pytest.approx((1 + 0.6) / 2)  # records only
    assert flat["elastic_moe/retained_weight_sum_min"] == pytest.approx(0.5)
    # where both layouts write a mean, it is the same number
    assert {key: flat[key] for key in per_layer if key in flat} == {key: per_layer[key] for key in per_layer
                                                                     if key in flat}
