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


# ------------------------------------------------------------------------------- layers that cannot rank
def test_deepseek_v4_hash_layers_are_static_by_construction_and_named_in_the_plan_line(tiny):
    """Layer 0 routes by its token-id table (no ranking to cut at κ): it stays stock, bit for bit,
    and the plan line says why; layers 1-2 rank and are elastic."""
    from elastic_moe_plugin.core.errors import ConfigError
    from elastic_moe_plugin.hf.families import static_routers

    core_plan.forget_logged()
    model = tiny.model("deepseek_v4")
    hash_block = model.model.layers[0].mlp
    hidden = torch.randn(2, 8, 64, generator=torch.Generator().manual_seed(0))
    input_ids = torch.randint(3, 128, (2, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        stock = hash_block(hidden, input_ids=input_ids)
        hf.apply(ElasticConfig(schedule="1-3"), model=model)
        assert torch.equal(hash_block(hidden, input_ids=input_ids), stock)
    assert [name for name, *_ in static_routers(model)] == ["model.layers.0.mlp.gate"]
    assert hf.log_plan(model) == (
        "elastic-moe plan (transformers, 3 MoE layers): elastic 1-3 around k=2 (σ=1.5), deepseek_v4 activation_bias "
        "rule, renormalized gate, iid sampling: layers 1-2; static top-2 (hash-routed: experts from a token-id "
        "table, no ranking to cut at κ): layers 0")
    assert hf.routing_metrics(model) == {}  # nothing before a training forward
    model(**tiny.inputs("deepseek_v4"))
    assert set(hf.routing_records(model)) == {1, 2}
    values = hf.routing_metrics(model)  # the hash layer is logged as a static layer, at κ = k
    assert values["elastic_moe/layer_0/mean_kappa"] == 2.0 and values["elastic_moe/layer_0/kappa_frac_2"] == 1.0
    assert all(values[f"elastic_moe/layer_{layer}/kappa_frac_2"] < 1.0 for layer in (1, 2))  # 16 draws each

    hf.remove()
    hf.apply(ElasticConfig(schedule="1-3", layers="0"))
    with pytest.raises(ConfigError, match=r"layers='0' selects layer\(s\) \[0\], none of which can route "
                                          r"elastically: layer\(s\) 0 are hash-routed: .*the layers that can are "
                                          r"1, 2") as refused:
        tiny.model("deepseek_v4")
    hf.apply(ElasticConfig(schedule="1-3", **refused.value.fixes[0]))  # the fix it names is accepted
    assert refused.value.fixes[0] == {"layers": "1"}
    tiny.model("deepseek_v4")


def test_group_reach_below_k_suggests_static_and_the_fix_is_accepted(tiny):
    """transformers' own DeepSeek-V3 tester shape: top-8 of 8 experts in 2 groups, 1 kept: 4 reachable,
    fewer than k, so no width above k fits; the suggested fix, pasted back, trains."""
    from elastic_moe_plugin.core.errors import ConfigError

    overrides = {"num_experts_per_tok": 8, "n_group": 2, "topk_group": 1}
    config = ElasticConfig(schedule="7-8", allow_off_center=True)
    hf.apply(config)
    model = tiny.model("deepseek_v3", **overrides)
    with pytest.raises(ConfigError, match=r"\(4 experts a token can reach\).*no elastic width above k = 8 fits") as refused:
        model(**tiny.inputs("deepseek_v3"))
    fix = refused.value.fixes[0]
    assert fix == {"schedule": "static"}
    hf.apply(config.replace(**fix))
    model(**tiny.inputs("deepseek_v3"))


@pytest.mark.parametrize("family_name,accepted", [("dbrx", True), ("longcat_flash", False)])
def test_top_p_needs_a_family_that_ranks_by_the_softmax_itself(tiny, family_name, accepted):
    """DBRX ranks by p = softmax(z) (its q-norm only weighs): top-p reads that mass. LongCat-Flash
    ranks p plus a selection bias: refused, and the fix it names, a budget schedule, is accepted."""
    from elastic_moe_plugin.core.errors import ConfigError

    config = ElasticConfig(mode="top_p", top_p=0.5)
    hf.apply(config)
    model = tiny.model(family_name)
    if accepted:
        with torch.no_grad():  # spread the router's logits: κ then varies with each token's mass
            for block in model.modules():
                if type(block).__name__ == "DbrxRouter":
                    block.layer.weight.normal_(0.0, 1.0, generator=torch.Generator().manual_seed(0))
        model(**tiny.inputs(family_name))
        budgets = torch.cat([record.budgets for record in hf.routing_records(model).values()])
        assert int(budgets.min()) >= 1 and len(set(budgets.tolist())) > 1  # κ from the probability mass
        return
    with pytest.raises(ConfigError, match=r"longcat_flash routers rank by p plus a selection bias") as refused:
        model(**tiny.inputs(family_name))
    hf.apply(config.replace(**refused.value.fixes[0]))
    model(**tiny.inputs(family_name))
