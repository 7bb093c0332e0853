"""`elastic-moe bench --quick --json --only hf`: the transformers blocks, every experts implementation.

Timing and memory ratios are measurements, not asserted (only that they are finite and positive);
the rows the expert GEMMs multiplied, the dispatched Σκ and the sync counts are exact and asserted.
"""

import json
import math

import pytest

from elastic_moe_plugin.cli import main
from elastic_moe_plugin.tools.bench import schema

pytest.importorskip("transformers")

pytestmark = [pytest.mark.hf, pytest.mark.slow]

IMPLEMENTATIONS = ("eager", "grouped_mm", "batched_mm")
BLOCKS = ("olmoe-block", "qwen3_moe-block", "deepseek_v3-block")


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
