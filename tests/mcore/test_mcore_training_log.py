"""The Megatron-LM logging hook (``elastic_moe_plugin.mcore.training_log``), in process.

Its end-to-end behaviour (Megatron-LM's console line and TensorBoard event files, on every rank,
through ``python -m elastic_moe_plugin.megatron_lm``) is in ``test_megatron_lm.py``; here the names
every rank reports and the version guard.
"""

from __future__ import annotations

import types

import pytest
import torch

from elastic_moe_plugin import ElasticConfig, mcore
from elastic_moe_plugin.core import metrics
from elastic_moe_plugin.core.errors import UnsupportedMegatronError
from elastic_moe_plugin.core.patching import AttributePatches
from elastic_moe_plugin.mcore import tracking, training_log

pytestmark = [pytest.mark.megatron, pytest.mark.usefixtures("mcore_env")]


@pytest.mark.parametrize("schedule, topk, experts, capacity_factor",
                         [("1-3", 2, 8, None), ("6-10", 8, 16, None), ("6-10", 8, 16, 1.0)])
def test_every_rank_reports_the_names_a_routed_layer_produces(schedule, topk, experts, capacity_factor, make_config,
                                                              make_router):
    """The names come from the schedule (and whether a capacity factor is set) alone, so a pipeline
    stage without elastic layers reports the same list as one with them (else Megatron's report
    would wait forever in its all-reduce)."""
    mcore.apply(ElasticConfig(schedule=schedule))
    config = make_config(num_moe_experts=experts, moe_router_topk=topk, moe_expert_capacity_factor=capacity_factor)
    router = make_router(config, weight_std=0.5)
    router(torch.randn(64, 1, 16))
    routed = set(tracking.per_layer_metrics(router)[0])
    elastic_schedule = ElasticConfig(schedule=schedule).budget_schedule(topk)
    assert set(metrics.metric_names(elastic_schedule, experts, capacity_factor is not None)) == routed
    assert {"mean_kappa", f"kappa_frac_{elastic_schedule.high}", f"exposure_rank_{elastic_schedule.high}"} <= routed
    assert ("capacity_dropped_frac_beyond_k" in routed) == (capacity_factor is not None)


@pytest.mark.parametrize("writers, reports_every_metric", [
    (dict(tensorboard_dir="/tmp/tb", wandb_project=""), True),
    (dict(tensorboard_dir=None, wandb_project="elastic"), True),
    (dict(tensorboard_dir=None, wandb_project=""), False),
    ({}, False),  # arguments of a Megatron-LM without these flags
])
def test_a_run_without_tensorboard_or_wandb_reports_only_the_console_metrics(writers, reports_every_metric):
    """Decided by the arguments (the same on every rank), not by the writers, which only the last
    rank holds; the console's metrics are always among the reported ones."""
    schedule = ElasticConfig(schedule="6-10").budget_schedule(8)
    megatron_args = types.SimpleNamespace(num_experts=16, moe_expert_capacity_factor=None, moe_per_layer_logging=True,
                                          **writers)
    reported = training_log.reported_metrics(schedule, megatron_args)
    every = metrics.metric_names(schedule, 16, False)
    assert reported == (every if reports_every_metric else list(training_log.CONSOLE_METRICS))
    assert set(training_log.CONSOLE_METRICS) <= set(every) and len(every) > len(training_log.CONSOLE_METRICS)


@pytest.mark.parametrize("per_layer_logging", [False, True])
def test_the_schedules_constants_are_reported_only_with_per_layer_logging(per_layer_logging):
    """survival_rank_<r> is the schedule's a(r), the same at every step: a log of layer means leaves
    it out (each scalar costs the training thread a TensorBoard write), per-layer logging keeps it."""
    schedule = ElasticConfig(schedule="6-10").budget_schedule(8)
    megatron_args = types.SimpleNamespace(num_experts=16, moe_expert_capacity_factor=None, tensorboard_dir="/tmp/tb",
                                          moe_per_layer_logging=per_layer_logging)
    reported = training_log.reported_metrics(schedule, megatron_args)
    every = metrics.metric_names(schedule, 16, False)
    survival = [f"survival_rank_{rank}" for rank in range(1, 11)]
    assert set(survival) <= set(every) and len(every) == 31  # 1 + 5 κ shares + 10 + 10 ranks + 5 statistics
    expected = every if per_layer_logging else [name for name in every if name not in survival]
    assert list(reported) == list(expected)
    assert len(reported) == (31 if per_layer_logging else 21)


def test_a_training_log_without_an_iteration_argument_is_refused_with_the_way_out():
    module = types.ModuleType("megatron.training.training")
    module.training_log = lambda loss_dict, total_loss_dict: None
    with pytest.raises(UnsupportedMegatronError, match=r"training_log\(\.\.\., iteration, \.\.\.\).*no iteration argument"
                                                      r".*--elastic-moe-log-metrics false"):
        training_log._install(AttributePatches(), module)
    del module.training_log
    with pytest.raises(UnsupportedMegatronError, match="no such function"):
        training_log._install(AttributePatches(), module)
