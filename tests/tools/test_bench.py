"""`elastic-moe bench --quick --json --only router layer gpt`: the Megatron scenarios; every figure is
emitted, and the exact ones are right (the transformers blocks: test_bench_hf.py).

Timing and memory ratios are measurements, not asserted (only that they are finite and positive);
the dispatched pairs and the sync counts are exact and asserted.
"""

import json
import math

import pytest

from elastic_moe_plugin.cli import main

pytestmark = [pytest.mark.megatron, pytest.mark.slow]


@pytest.fixture(scope="module")
def report(mp_world):
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["bench", "--quick", "--json", "--only", "router", "layer", "gpt"]) == 0
    return json.loads(out.getvalue())


def test_every_scenario_and_figure_is_reported(report):
    scenarios = {entry["scenario"]: entry for entry in report["scenarios"]}
    assert set(scenarios) == {"router", "layer-allgather", "layer-alltoall", "layer-droppad", "gpt-step"}
    for entry in scenarios.values():
        assert set(entry["variants"]) == {"stock", "iid", "balanced"}
        for variant in entry["variants"].values():
            assert variant["min_ms"] <= variant["median_ms"] <= variant["max_ms"]
            assert variant["peak_bytes"] > 0
        for ratios in entry["ratios"].values():
            assert math.isfinite(ratios["time_ratio"]) and ratios["time_ratio"] > 0
            assert math.isfinite(ratios["memory_ratio"]) and ratios["memory_ratio"] > 0


def test_pairs_are_compute_matched(report):
    for entry in report["scenarios"]:
        stock, iid, balanced = (entry["variants"][name] for name in ("stock", "iid", "balanced"))
        assert stock["realised_pairs"] == stock["expected_pairs"]
        # balanced: Σκ = T·k exactly; iid: equal only in expectation
        assert balanced["realised_pairs"] == balanced["expected_pairs"]
        assert abs(iid["realised_pairs"] - iid["expected_pairs"]) < 0.1 * iid["expected_pairs"]


def test_sync_budget(report):
    scenarios = {entry["scenario"]: entry for entry in report["scenarios"]}
    moe_layers = {"router": 1, "layer-allgather": 1, "layer-alltoall": 1, "layer-droppad": 1,
                  "gpt-step": 2}  # --quick shapes
    for name, entry in scenarios.items():
        assert entry["ratios"]["balanced"]["syncs_added"] == 0
        assert entry["ratios"]["iid"]["syncs_added"] <= moe_layers[name]  # at most one per MoE layer
    # the router itself never syncs; alltoall iid sizes its permute from the host's Σκ (the κ draw's
    # total), so it reads nothing on 0.19 and 0.16 alike
    assert scenarios["router"]["variants"]["iid"]["syncs_per_forward"] == 0
    assert scenarios["layer-alltoall"]["ratios"]["iid"]["syncs_added"] == 0


def test_drop_and_pad_experts_multiply_stocks_rows_whatever_kappa(report):
    """cf = 1 with padding: every expert buffer holds get_capacity(T·k, E, 1) rows in all three
    variants (capacity from k, as stock; sizing from b = 6 would give 1.5x the rows at the --quick
    shape E=16, k=4, 2-6, T=512)."""
    from megatron.core.transformer.moe.moe_utils import get_capacity

    entry = {e["scenario"]: e for e in report["scenarios"]}["layer-droppad"]
    rows = 16 * get_capacity(num_tokens=512 * 4, num_experts=16, capacity_factor=1.0)
    assert rows == 2048
    for name, variant in entry["variants"].items():
        assert variant["expected_pairs"] == variant["realised_pairs"] == rows, name

