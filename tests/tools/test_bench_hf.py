"""`elastic-moe bench --quick --json --only hf`: the transformers blocks, every experts implementation.

Timing and memory ratios are measurements, not asserted (only that they are finite and positive);
the rows the expert GEMMs multiplied, the dispatched Σκ and the sync counts are exact and asserted.
"""

import json
import math

import pytest
import torch

from elastic_moe_plugin.cli import main
from elastic_moe_plugin.tools.bench import schema

pytest.importorskip("transformers")

pytestmark = [pytest.mark.hf, pytest.mark.slow]

IMPLEMENTATIONS = ("eager", "grouped_mm", "batched_mm")
BLOCKS = ("olmoe-block", "qwen3_moe-block", "deepseek_v3-block", "gemma4-block")


@pytest.fixture(scope="module")
def report():
    import contextlib
    import io

    from elastic_moe_plugin import hf

    hf.remove()
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["bench", "--quick", "--json", "--only", "hf"]) == 0
    assert not hf.is_applied()  # the bench leaves the patch as it found it
    return json.loads(out.getvalue())


class _Entry:
    """One block under one implementation: ``variants`` (metrics), ``ratios`` (against stock), ``shape``."""

    def __init__(self, rows):
        self.rows = rows
        self.variants = {row["variant"]: row["metrics"] for row in rows}
        self.ratios = {row["variant"]: row["ratios"] for row in rows if row["baseline"] == "stock"}
        (self.shape,) = {row["shape"] for row in rows}


def _entries(report):
    grouped = {}
    for row in report["rows"]:
        grouped.setdefault((row["scenario"], row["params"]["implementation"]), []).append(row)
    return {key: _Entry(rows) for key, rows in grouped.items()}


def test_every_block_and_implementation_is_reported(report):
    schema.validate(report)
    assert report["modes"] == ["hf"] and report["environment"]["transformers"]
    entries = _entries(report)
    assert set(entries) == {(block, impl) for block in BLOCKS for impl in IMPLEMENTATIONS}
    for (_, impl), entry in entries.items():
        assert set(entry.variants) == {"stock", "iid", "balanced"} and set(entry.ratios) == {"iid", "balanced"}
        assert entry.shape.startswith(f"experts_implementation={impl}: E=")
        for variant in entry.variants.values():
            assert variant["min_ms"] <= variant["median_ms"] <= variant["max_ms"]
            assert variant["peak_bytes"] > 0
        for ratios in entry.ratios.values():
            assert math.isfinite(ratios["time_ratio"]) and ratios["time_ratio"] > 0
            assert math.isfinite(ratios["memory_ratio"]) and ratios["memory_ratio"] > 0


def test_rows_multiplied_equal_sum_of_budgets_in_every_implementation(report):
    for (block, impl), entry in _entries(report).items():
        stock, iid, balanced = (entry.variants[name] for name in ("stock", "iid", "balanced"))
        tokens = entry.rows[0]["params"]["tokens"]
        assert tokens == int(entry.shape.split("T=")[1].split()[0])
        assert stock["expected_pairs"] == tokens * 8  # every block is top-8
        assert stock["realised_pairs"] == stock["dispatched_pairs"] == stock["expected_pairs"], (block, impl)
        for variant in (iid, balanced):
            # the GEMMs multiplied exactly the kept rows, not the b = 10 slots the router hands over
            assert variant["realised_pairs"] == variant["dispatched_pairs"], (block, impl)
            assert variant["realised_pairs"] < tokens * 10
        assert balanced["dispatched_pairs"] == balanced["expected_pairs"]
        assert abs(iid["dispatched_pairs"] - iid["expected_pairs"]) < 0.1 * iid["expected_pairs"]


def test_syncs_added_per_implementation(report):
    # (iid, balanced), one MoE layer. Σκ is a host int (κ is drawn on the host), so no implementation
    # reads it; eager's loop syncs once per expert it hits, and the bench's tokens hit every expert in
    # stock and elastic alike (before issue 25: eager (1, 1), batched_mm (1, 0)).
    added = {"eager": (0, 0), "grouped_mm": (0, 0), "batched_mm": (0, 0)}
    for (_block, impl), entry in _entries(report).items():
        assert (entry.ratios["iid"]["syncs_added"], entry.ratios["balanced"]["syncs_added"]) == added[impl]
    for block in BLOCKS:
        assert _entries(report)[(block, "grouped_mm")].variants["iid"]["syncs_per_forward"] == 0


@pytest.mark.parametrize("shapes", ["FULL_SHAPES", "QUICK_SHAPES"])
def test_the_deepseek_v3_block_is_transformers_own_with_its_routing_and_shared_expert(shapes):
    """The DeepSeek-V3 row builds ``DeepseekV3MoE`` (router, experts and one shared expert of the
    routed experts' width, whose time the block's includes) from ``moe_intermediate_size`` and
    ``n_routed_experts``, with V3's groups and scaling; the schedule's widest κ fits in the experts
    of a token's eligible groups."""
    from elastic_moe_plugin.core.schedule import parse_range
    from elastic_moe_plugin.tools.bench import hf as bench_hf

    (shape,) = [shape for shape in getattr(bench_hf, shapes) if shape.family == "deepseek_v3"]
    size = shape.sizes["eager"]
    block = bench_hf.build_block(shape, "eager")
    assert type(block).__name__ == "DeepseekV3MoE" and block.training
    gate, experts, shared = block.gate, block.experts, block.shared_experts
    assert (gate.num_experts, gate.top_k, gate.num_group, gate.topk_group) == (shape.experts, shape.topk, 8, 4)
    assert gate.routed_scaling_factor == 2.5 and gate.norm_topk_prob
    assert gate.e_score_correction_bias.abs().sum() > 0  # drawn, as a trained model's: selection differs from weights
    assert (experts.num_experts, experts.hidden_dim, experts.intermediate_dim) == (shape.experts, size.hidden, size.ffn)
    assert shared.gate_proj.weight.shape == (size.ffn, size.hidden)  # n_shared_experts = 1
    assert parse_range(shape.schedule)[1] <= gate.topk_group * shape.experts // gate.num_group


@pytest.mark.parametrize("shapes", ["FULL_SHAPES", "QUICK_SHAPES"])
def test_the_gemma4_block_holds_transformers_own_router_and_experts(shapes):
    """Gemma 4 has no MoE block class: the row builds the bench's ``Gemma4MoE``, which holds
    transformers' ``Gemma4TextRouter`` and ``Gemma4TextExperts`` from a ``Gemma4TextConfig`` (k in
    ``top_k_experts``), their weight matrices drawn, the router's scales at their built ones; its
    router, built outside a decoder layer and so never tagged with a layer index, is covered by the
    plugin and resolves an elastic plan under a config without ``layers``."""
    from elastic_moe_plugin import ElasticConfig, hf
    from elastic_moe_plugin.tools.bench import hf as bench_hf

    (shape,) = [shape for shape in getattr(bench_hf, shapes) if shape.family == "gemma4"]
    size = shape.sizes["eager"]
    block = bench_hf.build_block(shape, "eager")
    assert isinstance(block, bench_hf.Gemma4MoE) and block.training
    router, experts = block.router, block.experts
    assert (type(router).__name__, type(experts).__name__) == ("Gemma4TextRouter", "Gemma4TextExperts")
    assert (router.config.num_experts, router.config.top_k_experts) == (shape.experts, shape.topk)
    assert (experts.num_experts, experts.hidden_dim, experts.intermediate_dim) == (shape.experts, size.hidden, size.ffn)
    assert experts.config._experts_implementation == "eager"
    assert 0 < router.proj.weight.std() < 0.03 and 0 < experts.gate_up_proj.std() < 0.03  # drawn N(0, 0.02)
    assert torch.equal(router.per_expert_scale, torch.ones(shape.experts))  # vectors as built
    assert hf.router_keys(block) == {"router": 0}  # keyed by its position: no layer tag, no layer in its path
    with hf.patched(ElasticConfig(schedule=shape.schedule)):
        plans, topk = hf.model_plans(block)
    assert topk == {0: shape.topk} and plans[0] is not None and plans[0].layer_index is None
    assert plans[0].rule == "gemma4 softmax_topk"


def test_the_gemma4_block_computes_the_decoder_layers_moe_branch():
    """``Gemma4MoE`` on the residual stream gives exactly the decoder layer's ``hidden_states_2``:
    the router on the residual, the experts on its ``pre_feedforward_layernorm_2`` norm, then
    ``post_feedforward_layernorm_2`` (every norm weight and scale random, so a swapped or skipped
    norm changes the output)."""
    from transformers.models.gemma4 import modeling_gemma4

    from elastic_moe_plugin.tools.bench import hf as bench_hf

    config = modeling_gemma4.Gemma4TextConfig(
        hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
        head_dim=16, global_head_dim=16, hidden_size_per_layer_input=0, vocab_size=64, vocab_size_per_layer_input=64,
        layer_types=["full_attention"], enable_moe_block=True, num_experts=8, top_k_experts=2, moe_intermediate_size=16,
    )  # fmt: skip
    torch.manual_seed(0)
    model = modeling_gemma4.Gemma4TextModel(config).eval()
    (layer,) = model.layers
    block = bench_hf.Gemma4MoE(config).eval()
    names = {name for name, _ in block.named_parameters()}
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for parameter in layer.parameters():
            parameter.normal_(0.5 if parameter.dim() == 1 else 0.0, 0.2, generator=generator)
    block.load_state_dict({name: value for name, value in layer.state_dict().items() if name in names})
    seen = {}
    layer.router.register_forward_pre_hook(lambda module, args: seen.setdefault("residual", args[0]))
    layer.post_feedforward_layernorm_2.register_forward_hook(lambda module, args, out: seen.setdefault("moe", out))
    with torch.no_grad():
        model(input_ids=torch.randint(0, 64, (2, 5), generator=generator))
        out = block(seen["residual"].reshape(2, 5, 32))
    assert out.shape == seen["moe"].shape and out.abs().sum() > 0
    assert torch.equal(out, seen["moe"])
