"""Routing metrics from routing records (``core.metrics``): the capacity-drop shares, the layer means and the
batched record statistics, by hand."""

import numpy as np
import pytest
import torch

from elastic_moe_plugin import BudgetSchedule
from elastic_moe_plugin.core.metrics import is_schedule_constant, layer_metrics, record_statistics, routing_metrics
from elastic_moe_plugin.core.records import RoutingRecord
from counters import all_ops

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
    """``per_layer=False`` (Megatron's layout without ``moe_per_layer_logging``): one value per name
    but the schedule's constants (``survival_rank_<r>``, a(r) of the config), the mean over the
    layers that report it (the minimum for ``retained_weight_sum_min``), by hand:
    layer 0 holds κ = (1, 2, 3, 4) with retained sums 1, layer 1 κ = (2, 2) with sums 0.5 and 0.7,
    layer 2 is static at κ = k = 2 (no record, so no weight or load value)."""
    second = RoutingRecord(budgets=torch.tensor([2, 2]), expert_ids=torch.tensor([[0, 1, -1, -1], [2, 3, -1, -1]]),
                           retained_weight_sums=torch.tensor([0.5, 0.7]))
    histograms = {0: torch.tensor([0, 1, 1, 1, 1]), 1: torch.tensor([0, 0, 2, 0, 0])}
    records = {0: _record(None), 1: second}
    flat = routing_metrics(records, histograms, SCHEDULE, 4, {2: 2}, per_layer=False)
    per_layer = routing_metrics(records, histograms, SCHEDULE, 4, {2: 2})
    names = {key.split("/")[-1] for key in per_layer if key.startswith("elastic_moe/layer_")}
    survival = {f"survival_rank_{rank}" for rank in (1, 2, 3)}
    assert survival <= names  # a layer's values keep a(r), next to its observed exposure
    assert set(flat) == {f"elastic_moe/{name}" for name in names - survival}  # the rest, nothing per layer
    assert not any(is_schedule_constant(name) for name in names - survival)
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


def _forward_record(seed: int, tokens: int = 6, width: int = 4, num_experts: int = 5,
                    host_counts: bool = False) -> RoutingRecord:
    """A record as a forward stores it: κ, the candidates by rank, the kept mask, the gate weights,
    and with ``host_counts`` κ's histogram on the host (as a κ drawn there leaves it)."""
    generator = torch.Generator().manual_seed(seed)
    budgets = torch.randint(1, width + 1, (tokens,), generator=generator)
    candidate_ids = torch.stack([torch.randperm(num_experts, generator=generator)[:width] for _ in range(tokens)])
    kept = torch.arange(width) < budgets[:, None]
    weights = torch.rand(tokens, width, generator=generator) * kept
    counts = np.bincount(budgets.numpy(), minlength=width + 1) if host_counts else None
    return RoutingRecord.of_forward(budgets, candidate_ids, kept, weights, budget_counts=counts)


def _hand_statistics(record: RoutingRecord, num_experts: int, topk: int) -> tuple[float, ...]:
    """RECORD_STATISTICS of one record, in Python floats from its read forms."""
    sums = [float(value) for value in record.retained_weight_sums.double()]
    per_expert = [0] * num_experts
    for expert in record.expert_ids.flatten().tolist():
        if expert >= 0:
            per_expert[expert] += 1
    mean = sum(per_expert) / num_experts
    std = (sum((count - mean) ** 2 for count in per_expert) / num_experts) ** 0.5
    budgets = record.budgets.tolist()
    return (sum(sums) / len(sums), min(sums), max(per_expert), mean, std,
            sum(budget != topk for budget in budgets) / len(budgets), sum(budgets) / len(budgets))


def test_record_statistics_of_stacked_layers_are_each_layers_own_by_hand():
    """Layers of one shape are reduced as one [L, T, b] batch; a layer of another T (its own batch),
    a read-form record and an empty one are handled beside them: every value as by hand."""
    layer_records = {0: _forward_record(0), 1: _forward_record(1), 3: _forward_record(3, tokens=9),
                     4: RoutingRecord(budgets=torch.tensor([1, 2, 3, 4]), expert_ids=EXPERT_IDS,
                                      retained_weight_sums=torch.tensor([1.0, 0.5, 0.25, 1.0])),
                     5: RoutingRecord(budgets=torch.zeros(0, dtype=torch.long), expert_ids=torch.zeros(0, 4, dtype=torch.long),
                                      retained_weight_sums=torch.zeros(0))}
    statistics = record_statistics(layer_records, num_experts=5, topk=2)
    assert set(statistics) == {0, 1, 3, 4}  # no tokens, no statistics
    for layer, values in statistics.items():
        assert values == pytest.approx(_hand_statistics(layer_records[layer], 5, 2), rel=1e-12, abs=1e-12), layer
        # the same numbers as the layer read alone
        assert values == pytest.approx(record_statistics({layer: layer_records[layer]}, 5, 2)[layer], rel=1e-15, abs=0)


def test_record_statistics_take_the_kappa_terms_from_the_hosts_histogram_bit_for_bit():
    """A record whose κ histogram the host has: mean κ, the share κ ≠ k and the mean tokens per
    expert come from it, equal to the device's reduction bit for bit, beside device-only records of
    the same shape (another batch) and against the hand computation."""
    host = {layer: _forward_record(layer, host_counts=True) for layer in (0, 1, 2)}
    device = {layer: _forward_record(layer) for layer in (0, 1, 2)}
    assert record_statistics(host, 5, 2) == record_statistics(device, 5, 2)  # exact
    mixed = {0: host[0], 1: device[1], 2: host[2], 3: _forward_record(3, tokens=9, host_counts=True)}
    statistics = record_statistics(mixed, num_experts=5, topk=2)
    assert list(statistics) == [0, 2, 1, 3]  # one batch per stack key, in order of first appearance
    for layer, values in statistics.items():
        assert values == pytest.approx(_hand_statistics(mixed[layer], 5, 2), rel=1e-12, abs=1e-12), layer
        # as the layer read alone (a std over a batch may differ in the last bit, as for device records)
        assert values == pytest.approx(record_statistics({layer: mixed[layer]}, 5, 2)[layer], rel=1e-15, abs=0)
    # k outside the histogram's bins: every token has κ ≠ k
    assert record_statistics({0: host[0]}, 5, 7)[0][5] == 1.0


def test_a_log_runs_the_same_operators_for_two_layers_or_twelve():
    """One batch per shape: the operators of a log do not grow with the number of layers (one
    pass per layer ran ~25 each)."""
    def operators(num_layers: int, host_counts: bool = False) -> int:
        layer_records = {layer: _forward_record(layer, host_counts=host_counts) for layer in range(num_layers)}
        record_statistics(layer_records, num_experts=5, topk=2)  # the per-shape offsets, made once
        with all_ops() as counter:
            record_statistics(layer_records, num_experts=5, topk=2)
        return counter.count

    assert operators(2) == operators(12) <= 21
    # κ drawn on the host (both adapters' default): no κ stack and no κ reductions
    assert operators(2, host_counts=True) == operators(12, host_counts=True) <= 16
