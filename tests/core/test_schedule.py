"""BudgetSchedule: the paper's pmf values, its exposure identities, and both sampling modes."""

import math

import pytest
import torch

from elastic_moe_plugin import BudgetSchedule

# Paper Table (§2.3 of the facts reference), k0 = 8.
PAPER_PMFS = {
    ("7-9", 1.5): [0.3078, 0.3844, 0.3078],
    ("6-10", 1.5): [0.1201, 0.2339, 0.2921, 0.2339, 0.1201],
    ("5-11", 1.5): [0.0366, 0.1113, 0.2167, 0.2707, 0.2167, 0.1113, 0.0366],
    ("6-10", 1.0): [0.0545, 0.2442, 0.4026, 0.2442, 0.0545],
    ("6-10", 3.0): [0.1782, 0.2105, 0.2225, 0.2105, 0.1782],
}
PAPER_MAD = {("7-9", 1.5): 0.6156, ("6-10", 1.5): 0.9481, ("5-11", 1.5): 1.0984, ("6-10", 1.0): 0.7064, ("6-10", 3.0): 1.1339}
SCHEDULES = [BudgetSchedule.parse(spec, 8, sigma) for spec, sigma in PAPER_PMFS] + [
    BudgetSchedule.parse("1-3", 2),
    BudgetSchedule.parse("2-6", 4, 0.7),
    BudgetSchedule.static(8),
]


def _hand_pmf(low, high, center, sigma):
    weights = [math.exp(-((r - center) ** 2) / (2 * sigma**2)) for r in range(low, high + 1)]
    return [w / sum(weights) for w in weights]


@pytest.mark.parametrize(("spec", "sigma"), list(PAPER_PMFS))
def test_pmf_matches_paper_table_and_closed_form(spec, sigma):
    schedule = BudgetSchedule.parse(spec, 8, sigma)
    assert schedule.pmf == pytest.approx(PAPER_PMFS[spec, sigma], abs=5e-5)
    low, high = map(int, spec.split("-"))
    assert schedule.pmf == pytest.approx(_hand_pmf(low, high, 8, sigma), abs=1e-15)
    assert schedule.budgets == tuple(range(low, high + 1))
    assert schedule.mean == pytest.approx(8.0, abs=1e-12)
    assert schedule.mean_abs_deviation == pytest.approx(PAPER_MAD[spec, sigma], abs=5e-5)


def test_issue_figures_to_three_decimals():
    rounded = lambda spec: [round(q, 3) for q in BudgetSchedule.parse(spec, 8).pmf]  # noqa: E731
    assert rounded("6-10") == [0.120, 0.234, 0.292, 0.234, 0.120]
    assert rounded("7-9") == [0.308, 0.384, 0.308]
    assert rounded("5-11") == [0.037, 0.111, 0.217, 0.271, 0.217, 0.111, 0.037]


@pytest.mark.parametrize("schedule", SCHEDULES, ids=lambda s: s.describe())
def test_exposure_identities(schedule):
    exposure = schedule.exposure(schedule.high + 3)
    # Σ_j a(j) = E[κ]
    assert math.fsum(exposure) == pytest.approx(schedule.mean, abs=1e-12)
    # q(j) = a(j) - a(j+1), for every j including outside the support
    for j in range(1, schedule.high + 2):
        assert schedule.probability(j) == pytest.approx(schedule.survival(j) - schedule.survival(j + 1), abs=1e-12)
    # Σ_{j > k0} a(j) = ½ E|κ - k0|
    tail = math.fsum(exposure[schedule.center :])
    assert tail == pytest.approx(0.5 * schedule.mean_abs_deviation, abs=1e-12)
    # ranks <= low always exposed, ranks > high never
    assert all(a == 1.0 for a in exposure[: schedule.low])
    assert all(a == 0.0 for a in exposure[schedule.high :])


def test_static_is_the_step_function():
    schedule = BudgetSchedule.static(8)
    assert schedule.is_static and schedule.pmf == (1.0,) and schedule.mean == 8
    assert schedule.exposure(10) == (1.0,) * 8 + (0.0, 0.0)
    assert schedule.off_center_share == 0.0
    assert BudgetSchedule.parse("static", 8) == schedule == BudgetSchedule.parse("8", 8)


def test_iid_samples_pass_chi_square():
    scipy_stats = pytest.importorskip("scipy.stats")
    schedule = BudgetSchedule.parse("6-10", 8)
    generator = torch.Generator().manual_seed(1234)
    budgets = schedule.sample(1_000_000, "iid", generator=generator)
    assert budgets.dtype == torch.long and budgets.shape == (1_000_000,)
    assert int(budgets.min()) >= 6 and int(budgets.max()) <= 10
    observed = torch.bincount(budgets - 6, minlength=5).double().numpy()
    expected = [q * 1_000_000 for q in schedule.pmf]
    _, p_value = scipy_stats.chisquare(observed, expected)
    assert p_value > 1e-3, (observed, expected, p_value)


def test_iid_chi_square_detects_a_wrong_pmf():
    # The statistical test has teeth: sigma=1.5 draws are rejected against the sigma=3.0 pmf.
    scipy_stats = pytest.importorskip("scipy.stats")
    budgets = BudgetSchedule.parse("6-10", 8).sample(200_000, generator=torch.Generator().manual_seed(0))
    observed = torch.bincount(budgets - 6, minlength=5).double().numpy()
    wrong = [q * 200_000 for q in BudgetSchedule.parse("6-10", 8, 3.0).pmf]
    assert scipy_stats.chisquare(observed, wrong)[1] < 1e-6


def test_sampling_uses_the_default_generator_so_recompute_replays():
    schedule = BudgetSchedule.parse("6-10", 8)
    for mode in ("iid", "balanced"):
        torch.manual_seed(7)
        state = torch.get_rng_state()
        first = schedule.sample(4096, mode)
        assert not torch.equal(torch.get_rng_state(), state), "sampling must advance the default generator"
        torch.set_rng_state(state)
        assert torch.equal(schedule.sample(4096, mode), first)


@pytest.mark.parametrize("spec,center", [("6-10", 8), ("5-11", 8), ("7-9", 8), ("1-3", 2), ("2-6", 4)])
@pytest.mark.parametrize("num_tokens", [0, 1, 2, 3, 4, 5, 7, 16, 33, 100, 257, 4096, 10_000])
def test_balanced_sum_is_exact_and_marginal_within_rounding(spec, center, num_tokens):
    schedule = BudgetSchedule.parse(spec, center)
    budgets = schedule.sample(num_tokens, "balanced", generator=torch.Generator().manual_seed(num_tokens))
    assert budgets.shape == (num_tokens,)
    assert int(budgets.sum()) == num_tokens * center
    counts = dict(zip(schedule.budgets, torch.bincount(budgets, minlength=schedule.high + 1)[schedule.low :].tolist()))
    num_offsets = schedule.center - schedule.low
    for budget, q in zip(schedule.budgets, schedule.pmf):
        # each side is T·q rounded (off by < 1); the center absorbs both sides' rounding
        tolerance = num_offsets if budget == schedule.center else 1
        assert abs(counts[budget] - num_tokens * q) <= tolerance, (budget, counts, num_tokens)
        assert counts[budget] == counts[2 * schedule.center - budget]  # symmetric


def test_balanced_is_a_random_permutation():
    schedule = BudgetSchedule.parse("6-10", 8)
    a = schedule.sample(1000, "balanced", generator=torch.Generator().manual_seed(0))
    b = schedule.sample(1000, "balanced", generator=torch.Generator().manual_seed(1))
    assert not torch.equal(a, b)
    assert torch.equal(torch.sort(a).values, torch.sort(b).values)


def test_balanced_rejects_asymmetric_schedule():
    schedule = BudgetSchedule(1, 4, 2, allow_off_center=True)
    with pytest.raises(ValueError, match="balanced.*symmetric"):
        schedule.sample(10, "balanced")


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: BudgetSchedule(0, 4, 2), r"low=0 is invalid.*>= 1"),
        (lambda: BudgetSchedule(3, 5, 2), r"center=2 lies outside the support 3-5"),
        (lambda: BudgetSchedule(1, 1, 2), r"center=2 lies outside the support 1-1"),
        (lambda: BudgetSchedule(6, 10, 8, sigma=0), r"sigma=0 is invalid"),
        (lambda: BudgetSchedule(6, 10, 8, sigma=-1.0), r"sigma=-1.0 is invalid"),
        (lambda: BudgetSchedule(6, 10, 8, sigma=float("nan")), r"sigma=nan is invalid"),
        (lambda: BudgetSchedule(6, 10, 8, sigma=float("inf")), r"sigma=inf is invalid"),
        (lambda: BudgetSchedule.parse("six-ten", 8), r"schedule='six-ten' does not parse"),
        (lambda: BudgetSchedule.parse("6-", 8), r"does not parse"),
        (lambda: BudgetSchedule.parse("10-6", 8), r"low=10 > high=6"),
        (lambda: BudgetSchedule.parse("9", 8), r"point mass at 9, but center=8"),
        (lambda: BudgetSchedule.parse("1-4", 2), r"mean 2.2729, not 2.*allow_off_center"),
        (lambda: BudgetSchedule.parse("6-10", 8).sample(3, "stratified"), r"sampling='stratified'.*iid"),
        (lambda: BudgetSchedule.parse("6-10", 8).sample(-1), r"num_tokens=-1"),
    ],
)
def test_bad_input_raises_clear_error(build, message):
    with pytest.raises(ValueError, match=message):
        build()


def test_off_center_allowed_when_asked():
    schedule = BudgetSchedule.parse("1-4", 2, allow_off_center=True)
    assert schedule.mean == pytest.approx(2.2729, abs=1e-4)


def test_validate_for():
    schedule = BudgetSchedule.parse("6-10", 8)
    schedule.validate_for(num_experts=64, topk=8)
    schedule.validate_for(num_experts=10, topk=8)
    with pytest.raises(ValueError, match=r"reaches budget 10, but the model has only 9 experts"):
        schedule.validate_for(num_experts=9, topk=8)
    with pytest.raises(ValueError, match=r"centred at 8, but the model routes to top-4"):
        schedule.validate_for(num_experts=64, topk=4)
