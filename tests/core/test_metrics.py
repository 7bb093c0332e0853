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
