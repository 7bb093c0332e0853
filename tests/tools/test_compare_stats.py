"""The paired statistics of `elastic-moe compare` against hand computations and scipy (a dev dependency)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats as scipy_stats

from elastic_moe_plugin.tools.compare import stats

#: elastic − static of 4 seeds, worked by hand below
STATIC = {0: 2.00, 1: 2.10, 2: 1.90, 3: 2.05}
ELASTIC = {0: 1.98, 1: 2.07, 2: 1.91, 3: 2.01}


def test_the_paired_t_interval_of_four_seeds_by_hand():
    # d = (-0.02, -0.03, 0.01, -0.04); mean -0.02; deviations (0, -0.01, 0.03, -0.02): Σ² = 0.0014,
    # s = sqrt(0.0014 / 3) = 0.0216025; t_{0.975, 3} = 3.182446; half-width = 3.182446 · s / 2 = 0.0343746
    result = stats.compare("loss", STATIC, ELASTIC)
    assert result.seeds == (0, 1, 2, 3)
    assert result.differences == pytest.approx((-0.02, -0.03, 0.01, -0.04))
    assert result.mean == pytest.approx(-0.02)
    half = 3.182446305284263 * math.sqrt(0.0014 / 3) / 2
    assert result.t_interval.low == pytest.approx(-0.02 - half, abs=1e-12)
    assert result.t_interval.high == pytest.approx(-0.02 + half, abs=1e-12)
    assert result.t_interval.contains_zero and not result.detectable


def test_the_bootstrap_interval_is_the_percentiles_of_resampled_means():
    differences = [-0.02, -0.03, 0.01, -0.04]
    draws = np.random.Generator(np.random.PCG64(0)).integers(0, 4, size=(stats.BOOTSTRAP_RESAMPLES, 4))
    means = np.asarray(differences)[draws].mean(axis=1)
    low, high = np.percentile(means, [2.5, 97.5])
    assert stats.bootstrap_interval(differences) == stats.Interval(float(low), float(high))
    # with 4 values, the resampled means lie on the grid of quarter sums: the ends are two of its points
    grid = {round(sum(c) / 4, 12) for c in np.array(np.meshgrid(*[differences] * 4)).T.reshape(-1, 4)}
    assert round(low, 12) in grid and round(high, 12) in grid


def test_a_shuffled_pairing_changes_the_result():
    seeds = list(range(8))
    static = {s: 2.0 + 0.1 * s for s in seeds}  # seeds differ a lot between each other...
    elastic = {s: static[s] - 0.01 for s in seeds}  # ...and elastic is lower by 0.01 on every one
    paired = stats.compare("loss", static, elastic)
    assert paired.differences == pytest.approx((-0.01,) * 8)
    assert paired.detectable and paired.t_interval.high < 0
    shuffled = {s: elastic[(s + 3) % 8] for s in seeds}  # pairs seed s with seed s+3's elastic run
    unpaired = stats.compare("loss", static, shuffled)
    assert unpaired.mean == pytest.approx(paired.mean)  # the same means...
    assert unpaired.t_interval.contains_zero and not unpaired.detectable  # ...but no longer tellable


def test_arms_with_other_seeds_are_refused():
    with pytest.raises(ValueError, match=r"seeds differ \(\[4\] in only one arm\)"):
        stats.paired_differences({0: 1.0, 4: 1.0}, {0: 1.0})


def test_one_seed_has_no_interval():
    result = stats.compare("loss", {0: 1.0}, {0: 0.9})
    assert result.t_interval is None and result.bootstrap_interval is None and not result.detectable


@pytest.mark.parametrize("degrees", [1, 2, 3, 7, 15, 30, 120])
@pytest.mark.parametrize("probability", [0.025, 0.6, 0.9, 0.975, 0.995])
def test_the_student_t_quantile_matches_scipy(probability, degrees):
    assert stats.student_t_quantile(probability, degrees) == pytest.approx(
        scipy_stats.t.ppf(probability, degrees), abs=1e-9
    )


def test_the_t_interval_matches_scipy():
    differences = [0.01, -0.02, 0.005, 0.03, 0.012, -0.004, 0.02, 0.001]
    low, high = scipy_stats.t.interval(0.95, 7, loc=np.mean(differences), scale=scipy_stats.sem(differences))
    interval = stats.t_interval(differences)
    assert (interval.low, interval.high) == pytest.approx((low, high), abs=1e-12)
