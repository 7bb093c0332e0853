"""LayerPlan: the candidate width b and the host-known fixed budget of a point mass."""

import pytest

from elastic_moe_plugin import BudgetSchedule
from elastic_moe_plugin.core.plan import LayerPlan


def _plan(schedule, **fields):
    return LayerPlan(schedule=schedule, gate="renormalized", sampling="iid", layer_index=0, **fields)


@pytest.mark.parametrize(("schedule", "fixed", "width"), [
    (BudgetSchedule.static(8), 8, 8),
    (BudgetSchedule(7, 9, 8, sigma=1e-3), 8, 9),  # exp(-1/(2σ²)) underflows: all mass on k
    (BudgetSchedule(7, 9, 8, sigma=0.2), None, 9),  # q(7) = q(9) ≈ 4e-6: κ can differ from k
    (BudgetSchedule.parse("6-10", 8), None, 10),
])
def test_fixed_budget_is_k_only_when_every_draw_is_k(schedule, fixed, width):
    plan = _plan(schedule)
    assert plan.fixed_budget == fixed and plan.width == width
    if fixed is not None:
        assert set(schedule.sample(10_000).tolist()) == {fixed}
        assert set(schedule.sample(10_000, "balanced").tolist()) == {fixed}


def test_top_p_plans_have_no_fixed_budget():
    """mode='top_p' carries the point mass at k, but κ comes from the probabilities."""
    assert _plan(BudgetSchedule.static(8), top_p=0.4, top_p_width=64).fixed_budget is None
