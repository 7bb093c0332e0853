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
from elastic_moe_plugin.tools.bench import calls

pytestmark = [pytest.mark.megatron, pytest.mark.hf]


def _bench(*extra):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["bench", "--quick", "--only", "calls", *extra]) == 0
    return out.getvalue()


def test_every_door_and_variant_is_timed_and_the_elastic_call_counted(mp_world):
    rows = {(row["door"], row["variant"]): row for row in json.loads(_bench("--json"))["router_calls"]}
    assert set(rows) == {(door, variant) for door in ("megatron", "transformers") for variant in calls.VARIANTS}
    for (_, variant), row in rows.items():
        assert 0 < row["min_us"] <= row["median_us"] <= row["max_us"]
        assert row["tokens"] == calls.QUICK_TOKENS
        if variant == "elastic":
            assert row["package_calls"] > 0 and 1 <= row["package_modules"] <= 5
        else:
            assert row["package_calls"] is None and row["package_modules"] is None
    text = _bench()
    assert "one router call, training forward" in text
    assert len([line for line in text.splitlines() if line.startswith(("megatron ", "transformers "))]) == 6


def test_the_counter_counts_calls_into_the_package_only():
    from elastic_moe_plugin.core.schedule import BudgetSchedule

    schedule = BudgetSchedule.parse("6-10", center=8)
    assert calls.package_calls(lambda: len([1, 2])) == (0, 0)
    counted, modules = calls.package_calls(lambda: schedule.probability(8))
    assert counted == 1 and modules == 1
