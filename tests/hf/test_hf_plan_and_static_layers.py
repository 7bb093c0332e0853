"""The start-up plan line and the static layers in the logged metrics (transformers adapter)."""

from __future__ import annotations

import logging

import pytest
import torch

pytest.importorskip("transformers")

from elastic_moe_plugin import ElasticConfig, hf
from elastic_moe_plugin.core import plan as core_plan

pytestmark = [pytest.mark.hf, pytest.mark.usefixtures("hf_clean")]


def _four_layer_olmoe(tiny):
    return tiny.model("olmoe", num_hidden_layers=4).train()


def test_plan_line_names_elastic_and_static_layers(tiny, caplog):
    core_plan.forget_logged()
    hf.apply(ElasticConfig(schedule="1-3", layers="1-2"))
    model = _four_layer_olmoe(tiny)
    with caplog.at_level(logging.INFO, logger="elastic_moe_plugin"):
        line = hf.log_plan(model)
        hf.log_plan(model)  # once per run
    assert line == ("elastic-moe plan (transformers, 4 MoE layers): elastic 1-3 around k=2 (σ=1.5), olmoe softmax_topk "
                    "rule, full_softmax gate, iid sampling: layers 1-2; static top-2: layers 0, 3")
    assert [record.getMessage() for record in caplog.records].count(line) == 1


def test_plan_line_is_rank_zero_only(tiny, caplog, monkeypatch):
    core_plan.forget_logged()
    monkeypatch.setenv("RANK", "1")
    hf.apply(ElasticConfig(schedule="1-3"))
    with caplog.at_level(logging.INFO, logger="elastic_moe_plugin"):
        hf.log_plan(_four_layer_olmoe(tiny))
    assert not [r for r in caplog.records if "elastic-moe plan" in r.getMessage()]


def test_static_layers_are_logged_at_kappa_k(tiny):
    hf.apply(ElasticConfig(schedule="1-3", layers="1-2"))
    model = _four_layer_olmoe(tiny)
    torch.manual_seed(0)
    model(input_ids=torch.randint(3, 128, (2, 64)))
    values = hf.routing_metrics(model)
    for layer in (0, 3):
        prefix = f"elastic_moe/layer_{layer}/"
        assert values[prefix + "mean_kappa"] == 2.0
        assert [values[prefix + f"kappa_frac_{b}"] for b in (1, 2, 3)] == [0.0, 1.0, 0.0]
        assert [values[prefix + f"exposure_rank_{r}"] for r in (1, 2, 3)] == [1.0, 1.0, 0.0]
        assert values[prefix + "topk_set_changed_frac"] == 0.0
        assert prefix + "retained_weight_sum_mean" not in values  # no record: nothing measured
    elastic = [values[f"elastic_moe/layer_{layer}/mean_kappa"] for layer in (1, 2)]
    assert all(value != 2.0 for value in elastic)  # 128 iid draws each
    assert values["elastic_moe/mean_kappa"] == pytest.approx((2.0 + 2.0 + sum(elastic)) / 4)


def test_a_static_schedule_logs_every_layer_at_k(tiny):
    hf.apply(ElasticConfig(schedule="static"))
    model = tiny.model("qwen3_moe").train()
    model(**tiny.inputs("qwen3_moe"))
    values = hf.routing_metrics(model)
    assert values["elastic_moe/mean_kappa"] == 2.0
    assert values["elastic_moe/layer_0/kappa_frac_2"] == 1.0 and values["elastic_moe/layer_1/kappa_frac_2"] == 1.0


def test_no_metrics_before_a_training_forward(tiny):
    hf.apply(ElasticConfig(schedule="1-3", layers="1"))
    model = tiny.model("olmoe").eval()
    model(**tiny.inputs("olmoe"))
    assert hf.routing_metrics(model) == {}
