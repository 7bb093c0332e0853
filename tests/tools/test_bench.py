"""`elastic-moe bench --quick --json --only router routing layer gpt`: the Megatron modes; every figure
is emitted in the one JSON schema, and the exact ones are right (the transformers blocks:
test_bench_hf.py; every mode and the schema: test_bench_modes.py).

Timing and memory ratios are measurements, not asserted (only that they are finite and positive);
the dispatched pairs and the sync counts are exact and asserted.
"""

import json
import math

import pytest

from elastic_moe_plugin.cli import main
from elastic_moe_plugin.tools.bench import schema

pytestmark = [pytest.mark.megatron, pytest.mark.slow]


@pytest.fixture(scope="module")
def report(mp_world):
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["bench", "--quick", "--json", "--only", "router", "routing", "layer", "gpt"]) == 0
    return json.loads(out.getvalue())


def _scenarios(report, mode=None):
    """{scenario: {variant: row}} of one configuration per scenario (the --quick shapes have one)."""
    found = {}
    for row in report["rows"]:
        if mode is None or row["mode"] == mode:
            found.setdefault(row["scenario"], {})[row["variant"]] = row
    return found


def test_the_report_follows_the_one_schema(report):
    schema.validate(report)
    assert report["modes"] == ["router", "routing", "layer", "gpt"] and report["ok"]
    assert report["environment"]["megatron_core"] and report["environment"]["device"] == "cpu"


def test_every_scenario_and_figure_is_reported(report):
    scenarios = _scenarios(report)
    assert set(scenarios) == {"router", "routing", "layer-allgather", "layer-alltoall", "layer-droppad", "gpt-step"}
    assert {row["mode"] for row in report["rows"] if row["scenario"].startswith("layer-")} == {"layer"}
    for variants in scenarios.values():
        assert set(variants) == {"stock", "iid", "balanced"}
        assert len({row["shape"] for row in variants.values()}) == 1
        for name, row in variants.items():
            metrics = row["metrics"]
            assert metrics["min_ms"] <= metrics["median_ms"] <= metrics["max_ms"]
            assert metrics["peak_bytes"] > 0
            assert row["params"]["aux_coeff"] == 0.01
            if name == "stock":
                assert row["baseline"] is None and row["ratios"] == {}
                continue
            assert row["baseline"] == "stock"
            ratios = row["ratios"]
            assert math.isfinite(ratios["time_ratio"]) and ratios["time_ratio"] > 0
            assert math.isfinite(ratios["memory_ratio"]) and ratios["memory_ratio"] > 0


def test_pairs_are_compute_matched(report):
    for variants in _scenarios(report).values():
        stock, iid, balanced = (variants[name]["metrics"] for name in ("stock", "iid", "balanced"))
        assert stock["realised_pairs"] == stock["expected_pairs"]
        # balanced: Σκ = T·k exactly; iid: equal only in expectation
        assert balanced["realised_pairs"] == balanced["expected_pairs"]
        assert abs(iid["realised_pairs"] - iid["expected_pairs"]) < 0.1 * iid["expected_pairs"]


def test_sync_budget(report):
    scenarios = _scenarios(report)
    moe_layers = {"router": 1, "routing": 1, "layer-allgather": 1, "layer-alltoall": 1, "layer-droppad": 1,
                  "gpt-step": 2}  # --quick shapes
    for name, variants in scenarios.items():
        assert variants["balanced"]["ratios"]["syncs_added"] == 0
        assert variants["iid"]["ratios"]["syncs_added"] <= moe_layers[name]  # at most one per MoE layer
    # the router itself never syncs; alltoall iid sizes its permute from the host's Σκ (the κ draw's
    # total), so it reads nothing on 0.19 and 0.16 alike
    for scope in ("router", "routing"):
        assert scenarios[scope]["iid"]["metrics"]["syncs_per_forward"] == 0
    assert scenarios["layer-alltoall"]["iid"]["ratios"]["syncs_added"] == 0


def test_drop_and_pad_experts_multiply_stocks_rows_whatever_kappa(report):
    """cf = 1 with padding: every expert buffer holds get_capacity(T·k, E, 1) rows in all three
    variants (capacity from k, as stock; sizing from b = 6 would give 1.5x the rows at the --quick
    shape E=16, k=4, 2-6, T=512)."""
    from megatron.core.transformer.moe.moe_utils import get_capacity

    variants = _scenarios(report)["layer-droppad"]
    rows = 16 * get_capacity(num_tokens=512 * 4, num_experts=16, capacity_factor=1.0)
    assert rows == 2048
    for name, row in variants.items():
        assert row["params"]["pad_to_capacity"] is True
        assert row["metrics"]["expected_pairs"] == row["metrics"]["realised_pairs"] == rows, name


def test_no_aux_routes_without_the_aux_loss(mp_world, capsys):
    """--no-aux: the routers' aux loss is 0, said in the shape and the params (the router scope's
    ratio then compares one top-k pass with one top-b pass)."""
    assert main(["bench", "--quick", "--json", "--no-aux", "--only", "routing"]) == 0
    report = json.loads(capsys.readouterr().out)
    schema.validate(report)
    assert {row["params"]["aux_coeff"] for row in report["rows"]} == {0.0}
    assert all(row["shape"].endswith(" aux 0") for row in report["rows"])
