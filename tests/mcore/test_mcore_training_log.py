"""The Megatron-LM logging hook (``elastic_moe_plugin.mcore.training_log``), in process.

Its end-to-end behaviour (Megatron-LM's console line and TensorBoard event files, on every rank,
through ``python -m elastic_moe_plugin.megatron_lm``) is in ``test_megatron_lm.py``; here the names
every rank reports, the version guard, and what a logging step writes under each ``log_metrics``.
"""

from __future__ import annotations

import gc
import sys
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
                                                      r".*--elastic-moe-log-metrics off"):
        training_log._install(AttributePatches(), module)
    del module.training_log
    with pytest.raises(UnsupportedMegatronError, match="no such function"):
        training_log._install(AttributePatches(), module)


# ---------------------------------------------------------------------------------- what a logging step writes
MOE_LAYERS, EXPERTS, TOPK = 48, 16, 8  # a 48-layer MoE model, tiny hidden sizes, schedule 6-10 around top-8


class CountingWriter:
    """A TensorBoard ``SummaryWriter`` stand-in that keeps every tag written."""

    def __init__(self):
        self.tags: list[str] = []

    def add_scalar(self, tag, value, step, *args, **kwargs):
        self.tags.append(tag)


def routed_moe_layers(make_config, make_router, log_metrics: str) -> list:
    """48 routers of one 48-layer model, each after one training forward, built under the patch."""
    gc.collect()  # routers of earlier tests, still in the patch's list of built routers until collected
    mcore.apply(ElasticConfig(schedule="6-10", log_metrics=log_metrics))
    config = make_config(num_layers=MOE_LAYERS, num_moe_experts=EXPERTS, moe_router_topk=TOPK)
    routers = [make_router(config, layer_number=number, weight_std=0.5).train() for number in range(1, MOE_LAYERS + 1)]
    for router in routers:
        router(torch.randn(16, 1, config.hidden_size))
    return routers


@pytest.mark.parametrize("log_metrics, per_layer_switch, layout", [
    ("layers", True, "layers"), ("layers", False, "means"), ("means", True, "means"), ("off", True, "off"),
])
def test_a_logging_step_of_48_moe_layers_writes_what_log_metrics_says(log_metrics, per_layer_switch, layout,
                                                                      make_config, make_router, monkeypatch):
    """Megatron-LM's hook (``log_step``, what the wrap of ``training_log`` runs at a logging step) into a
    writer that counts: ``layers`` with ``--moe-per-layer-logging`` writes 31 names x (48 layers + the
    layer mean); ``layers`` without it, and ``means`` even with it, the 21 layer means (no schedule
    constant); ``off`` nothing, no console fragment, and the κ histograms are left alone."""
    routers = routed_moe_layers(make_config, make_router, log_metrics)
    writer = CountingWriter()
    fake_training = types.ModuleType("megatron.training")  # log_step's writers, without importing Megatron-LM
    fake_training.get_tensorboard_writer, fake_training.get_wandb_writer = (lambda: writer), (lambda: None)
    monkeypatch.setitem(sys.modules, "megatron.training", fake_training)
    megatron_args = types.SimpleNamespace(num_experts=EXPERTS, moe_router_topk=TOPK, num_layers=MOE_LAYERS,
                                          moe_layer_freq=1, moe_expert_capacity_factor=None, tensorboard_dir="/tmp/tb",
                                          wandb_project="", moe_per_layer_logging=per_layer_switch, log_interval=1)
    fragment = training_log.log_step(5, megatron_args)

    names = metrics.metric_names(ElasticConfig(schedule="6-10").budget_schedule(TOPK), EXPERTS)
    means = [name for name in names if not metrics.is_schedule_constant(name)]
    assert (len(names), len(means)) == (31, 21)
    expected = {"layers": len(names) * (MOE_LAYERS + 1), "means": len(means), "off": 0}[layout]
    assert len(writer.tags) == len(set(writer.tags)) == expected
    assert sum("_layer_" in tag for tag in writer.tags) == (len(names) * MOE_LAYERS if layout == "layers" else 0)
    if layout == "means":
        assert len(writer.tags) <= 40 and set(writer.tags) == {f"elastic_moe/{name}" for name in means}
    assert ("elastic_moe/mean_kappa" in fragment) == (layout != "off")
    assert all(int(histogram.sum()) == (16 if layout == "off" else 0) for histogram in mcore.budget_histograms(routers).values())
