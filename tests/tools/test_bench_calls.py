"""`elastic-moe bench --quick --only calls`: one router call per door, stock against patched.

Times are measurements, not asserted (only finite, positive and ordered); the package's calls and
modules in one elastic call are counted, so they are asserted: a training forward enters at most
five modules of the package (tests/contract/test_router_forward_trace.py checks which).
"""

import contextlib
import io
import json

import pytest

from elastic_moe_plugin.cli import main
from elastic_moe_plugin.tools.bench import calls, schema

pytestmark = [pytest.mark.megatron, pytest.mark.hf]


def _bench(*extra):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["bench", "--quick", "--only", "calls", *extra]) == 0
    return out.getvalue()


def test_every_door_and_variant_is_timed_and_the_elastic_call_counted(mp_world):
    report = json.loads(_bench("--json"))
    schema.validate(report)
    rows = {(row["params"]["door"], row["variant"]): row for row in report["rows"]}
    assert set(rows) == {(door, variant) for door in calls.DOORS for variant in calls.VARIANTS}
    for (door, variant), row in rows.items():
        metrics = row["metrics"]
        assert row["mode"] == "calls" and row["params"]["tokens"] == calls.QUICK_TOKENS
        assert 0 < metrics["min_us"] <= metrics["median_us"] <= metrics["max_us"]
        if variant == "stock":
            assert row["baseline"] is None
        else:
            assert row["baseline"] == "stock"
            stock = rows[door, "stock"]["metrics"]["median_us"]
            assert row["ratios"]["added_us"] == pytest.approx(metrics["median_us"] - stock)
        if variant == "elastic":
            assert metrics["package_calls"] > 0 and 1 <= metrics["package_modules"] <= 5
        else:
            assert metrics["package_calls"] is None and metrics["package_modules"] is None
    text = _bench()
    assert "one router call, training forward" in text
    assert len([line for line in text.splitlines() if line.startswith(("megatron ", "transformers "))]) == 6


def test_the_counter_counts_calls_into_the_package_only():
    from elastic_moe_plugin.core.schedule import BudgetSchedule

    schedule = BudgetSchedule.parse("6-10", center=8)
    assert calls.package_calls(lambda: len([1, 2])) == (0, 0)
    counted, modules = calls.package_calls(lambda: schedule.probability(8))
    assert counted == 1 and modules == 1
