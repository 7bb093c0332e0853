"""A HybridModel's layers as the plugin reads them: every pattern symbol is a layer, only ``E`` routes.

- ``hybrid_pattern``: the MoE layer numbers of a pattern (pipes and MTP left out), against a
  hand-written table, and the same numbers from megatron-core 0.19's own allocation
  (``hybrid_layer_allocation``) where it imports.
- The Megatron-LM entry point checks ``--elastic-moe-layers`` against ``--hybrid-layer-pattern``
  before Megatron starts: a range past the pattern or without an MoE layer is refused, naming the
  MoE layer numbers, and every fix the message offers is accepted by the same check.
- The metrics' layer mean divides by the elastic MoE layers of the pattern (``*E*E*E*E`` with
  ``layers=3-5``: 2, not 8), and the plan line shows layer numbers with their MoE index.
"""

from __future__ import annotations

import importlib.util
import types
from pathlib import Path

import pytest

from elastic_moe_plugin import BudgetSchedule, ConfigError, ElasticConfig
from elastic_moe_plugin.core.config_refusals import ModelShape
from elastic_moe_plugin.core.plan import LayerPlan, describe_plans
from elastic_moe_plugin.mcore import hybrid_pattern
from elastic_moe_plugin.mcore.megatron_args import check_megatron_args, model_shape
from elastic_moe_plugin.mcore.tracking import num_elastic_moe_layers
from elastic_moe_plugin.megatron_lm import parse_argv

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "examples" / "megatron_lm" / "pretrain_gpt_moe.py"
MOE_FLAGS = ["--num-experts", "4", "--moe-router-topk", "2", "--num-layers", "2"]


# ====================================================================================== the pattern
@pytest.mark.parametrize(("pattern", "symbols", "moe_layers", "stages"), [
    ("*E*E*E*E", "*E*E*E*E", (1, 3, 5, 7), 1),
    ("*E-E", "*E-E", (1, 3), 1),
    ("M*E|M*E|-E", "M*EM*E-E", (2, 5, 7), 3),  # pipes are stage boundaries, not layers
    ("*E*E/*E/*E", "*E*E", (1, 3), 1),  # MTP depths after "/" are not decoder layers
    ("M-M-", "M-M-", (), 1),
])
def test_the_moe_layers_are_the_e_symbols_of_the_decoder(pattern, symbols, moe_layers, stages):
    layers = hybrid_pattern.parse(pattern)
    assert layers.symbols == symbols and layers.moe_layers == moe_layers and len(layers.stages) == stages
    assert [layers.moe_index(layer) for layer in moe_layers] == list(range(len(moe_layers)))
    assert all(layers.moe_index(layer) is None for layer in range(len(symbols)) if layer not in moe_layers)


@pytest.mark.parametrize("pattern", ["", "*E?E", "/E"])
def test_a_pattern_this_module_cannot_read_is_left_to_megatron(pattern):
    assert hybrid_pattern.parse(pattern) is None


@pytest.mark.skipif(importlib.util.find_spec("megatron.core.models.hybrid") is None,
                    reason="megatron-core < 0.19 has no HybridModel")
@pytest.mark.parametrize("pattern", ["*E*E*E*E", "M*E|M*E|-E", "*E-E*E/*E"])
def test_the_layers_agree_with_megatrons_own_allocation(pattern):
    from megatron.core.models.hybrid.hybrid_layer_allocation import (
        get_hybrid_total_layer_count,
        parse_hybrid_pattern,
    )

    layers = hybrid_pattern.parse(pattern)
    assert layers.num_layers == get_hybrid_total_layer_count(pattern)
    main = parse_hybrid_pattern(pattern).main_pattern.replace("|", "")
    assert layers.moe_layers == tuple(i for i, symbol in enumerate(main) if symbol == "E")


def test_moe_layer_numbers_follow_the_pattern_else_the_frequency():
    assert hybrid_pattern.moe_layer_numbers(8, 1, "*E*E*E*E") == (1, 3, 5, 7)
    assert hybrid_pattern.moe_layer_numbers(6, 2) == (0, 2, 4)
    assert hybrid_pattern.moe_layer_numbers(4, [1, 0, 0, 1]) == (0, 3)


# ====================================================================================== start-up check
def _check(megatron_args: list[str], elastic: list[str]) -> ElasticConfig:
    launch = parse_argv([str(SCRIPT), *megatron_args, *elastic], environ={})
    check_megatron_args(launch.config, launch.megatron_args)
    return launch.config


HYBRID = [*MOE_FLAGS, "--hybrid-layer-pattern", "*E*E*E*E"]


def test_the_pattern_decides_the_layers_not_num_layers():
    assert model_shape(HYBRID) == ModelShape(2, 4, 8, (1, 3, 5, 7))
    assert model_shape([*MOE_FLAGS, "--hybrid-override-pattern", "*E-E"]) == ModelShape(2, 4, 4, (1, 3))  # the deprecated name
    config = _check(HYBRID, ["--elastic-moe-schedule", "1-3", "--elastic-moe-layers", "3-5"])
    assert config.layer_set == {3, 4, 5}  # layers 3 and 5 hold routers; 4 is attention


@pytest.mark.parametrize(("layers", "says", "first_fix"), [
    ("2", "none of which is an MoE layer: the model's MoE layers are 1, 3, 5, 7", "1"),
    ("4", "none of which is an MoE layer", "3"),  # the nearest MoE layer (3 and 5 tie: the lower)
    ("0,2", "none of which is an MoE layer", "1"),
    ("6-9", "but the model has 8 decoder layers (0-based indices 0..7; its MoE layers are 1, 3, 5, 7)", "6-7"),
    ("8-9", "but the model has 8 decoder layers", None),
])
def test_a_range_without_an_moe_layer_or_past_the_pattern_is_refused_with_accepted_fixes(layers, says, first_fix):
    elastic = ["--elastic-moe-schedule", "1-3", "--elastic-moe-layers", layers]
    with pytest.raises(ConfigError) as caught:
        _check(HYBRID, elastic)
    assert says in str(caught.value), str(caught.value)
    assert caught.value.field == "layers"
    assert caught.value.fixes[0]["layers"] == first_fix, caught.value.fixes
    assert "--elastic-moe-layers" in str(caught.value)  # spelt for this entry point
    for fix in caught.value.fixes:
        value = "all" if fix["layers"] is None else fix["layers"]
        config = _check(HYBRID, ["--elastic-moe-schedule", "1-3", "--elastic-moe-layers", value])
        assert config.layer_set is None or config.layer_set & {1, 3, 5, 7}


def test_the_same_range_on_a_gpt_model_is_not_checked_for_moe_layers():
    """Without a pattern every decoder layer of a GPT model (moe_layer_freq 1) holds a router."""
    assert _check([*MOE_FLAGS], ["--elastic-moe-schedule", "1-3", "--elastic-moe-layers", "0"]).layer_set == {0}


# ====================================================================================== means and plan
@pytest.mark.parametrize(("layers", "divisor"), [(None, 4), ("3-5", 2), ("0-7", 4), ("7", 1)])
def test_the_layer_mean_divides_by_the_elastic_moe_layers_of_the_pattern(layers, divisor):
    megatron_args = types.SimpleNamespace(num_layers=8, moe_layer_freq=1, hybrid_layer_pattern="*E*E*E*E")
    config = ElasticConfig(schedule="1-3", layers=layers)
    pattern = hybrid_pattern.pattern_of(megatron_args)
    assert num_elastic_moe_layers(megatron_args, config, [], pattern) == divisor
    assert num_elastic_moe_layers(megatron_args, config, [], None) == len(config.layer_set or range(8))  # GPT: all 8


def test_the_plan_line_shows_layer_numbers_and_moe_indices():
    schedule = BudgetSchedule.parse("1-3", 2)
    elastic = LayerPlan(schedule=schedule, gate="renormalized", sampling="iid", layer_index=3)
    plans = {1: None, 3: elastic, 5: elastic, 7: None}
    moe_index = {1: 0, 3: 1, 5: 2, 7: 3}
    line = describe_plans(plans, dict.fromkeys(plans, 2), "megatron-core", moe_index=moe_index)
    assert line == (
        "elastic-moe plan (megatron-core, 4 MoE layers): elastic 1-3 around k=2 (σ=1.5), renormalized gate, "
        "iid sampling: layers 3, 5 (MoE layers 1-2); static top-2: layers 1, 7 (MoE layers 0, 3)"
    )
    gpt = describe_plans({0: elastic, 1: None}, {0: 2, 1: 2}, "megatron-core", moe_index={0: 0, 1: 1})
    assert gpt.endswith("layers 0; static top-2: layers 1")  # a layer's number is its MoE index: shown once
