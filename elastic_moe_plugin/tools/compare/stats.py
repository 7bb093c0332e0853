"""The statistics of a paired study: elastic minus static per seed, and two 95% intervals of the mean.

A study trains each arm once per seed with the same seed, data order and initialisation, so the
unit of evidence is the seed's **paired difference** d_s = elastic_s − static_s (n seeds). Its mean
d̄ gets two intervals:

- **paired t**: d̄ ± t_{1−α/2, n−1} · s_d / √n, with s_d the sample standard deviation of the d_s
  (n − 1 in the denominator) and t the Student quantile (:func:`student_t_quantile`, computed
  here from the regularised incomplete beta function: no scipy at run time);
- **bootstrap over seeds**: the α/2 and 1 − α/2 percentiles (numpy's default linear
  interpolation) of the means of ``resamples`` resamples of the n differences drawn with
  replacement (numpy's PCG64 seeded with ``seed``: the same interval on every machine).

The pairing matters: d_s pairs the arms' results of the *same* seed. Pairing them otherwise
(shuffled) changes the differences and so the intervals; :func:`paired_differences` pairs by the
seed's key and refuses arms whose seeds differ.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

import numpy as np

CONFIDENCE = 0.95
BOOTSTRAP_RESAMPLES = 10_000


@dataclasses.dataclass(frozen=True)
class Interval:
    """A closed interval [low, high]."""

    low: float
    high: float

    @property
    def contains_zero(self) -> bool:
        return self.low <= 0.0 <= self.high


@dataclasses.dataclass(frozen=True)
class PairedDifference:
    """One quantity's paired differences (elastic − static, in seed order) and their intervals."""

    name: str
    seeds: tuple[int, ...]
    differences: tuple[float, ...]
    mean: float
    t_interval: Interval | None
    bootstrap_interval: Interval | None

    @property
    def detectable(self) -> bool:
        """Whether both intervals exclude 0 (a difference this study can tell from none)."""
        intervals = (self.t_interval, self.bootstrap_interval)
        return all(interval is not None and not interval.contains_zero for interval in intervals)


def paired_differences(
    static: Mapping[int, float], elastic: Mapping[int, float]
) -> tuple[tuple[int, ...], list[float]]:
    """``(seeds, [elastic_s − static_s for s in seeds])``, seeds in ascending order.

    Raises:
        ValueError: the arms were not run with the same seeds (nothing to pair).
    """
    if set(static) != set(elastic):
        missing = sorted(set(static) ^ set(elastic))
        raise ValueError(f"the arms' seeds differ ({missing} in only one arm): a paired difference needs both")
    seeds = tuple(sorted(static))
    return seeds, [float(elastic[seed]) - float(static[seed]) for seed in seeds]


def t_interval(differences: Sequence[float], confidence: float = CONFIDENCE) -> Interval | None:
    """d̄ ± t_{(1+confidence)/2, n−1} · s_d / √n; None for fewer than 2 differences."""
    n = len(differences)
    if n < 2:
        return None
    values = np.asarray(differences, dtype=np.float64)
    mean, deviation = float(values.mean()), float(values.std(ddof=1))
    half = student_t_quantile((1 + confidence) / 2, n - 1) * deviation / math.sqrt(n)
    return Interval(mean - half, mean + half)


def bootstrap_interval(
    differences: Sequence[float],
    confidence: float = CONFIDENCE,
    resamples: int = BOOTSTRAP_RESAMPLES,
    seed: int = 0,
) -> Interval | None:
    """The percentile bootstrap interval of the mean difference; None for fewer than 2 differences."""
    n = len(differences)
    if n < 2:
        return None
    values = np.asarray(differences, dtype=np.float64)
    draws = np.random.Generator(np.random.PCG64(seed)).integers(0, n, size=(resamples, n))
    means = values[draws].mean(axis=1)
    alpha = 1 - confidence
    low, high = np.percentile(means, [100 * alpha / 2, 100 * (1 - alpha / 2)])
    return Interval(float(low), float(high))


def compare(
    name: str, static: Mapping[int, float], elastic: Mapping[int, float], confidence: float = CONFIDENCE
) -> PairedDifference:
    """The paired differences of one quantity and both intervals (:func:`paired_differences`)."""
    seeds, differences = paired_differences(static, elastic)
    return estimate(name, dict(zip(seeds, differences, strict=True)), confidence)


def estimate(name: str, values: Mapping[int, float], confidence: float = CONFIDENCE) -> PairedDifference:
    """The mean over seeds of a quantity that is already a within-seed contrast (a router measure of
    a seed's static-vs-elastic pair, e.g. D1 − Dk) and both intervals; ``differences`` are the values."""
    seeds = tuple(sorted(values))
    ordered = [float(values[seed]) for seed in seeds]
    return PairedDifference(
        name,
        seeds,
        tuple(ordered),
        float(np.mean(ordered)) if ordered else math.nan,
        t_interval(ordered, confidence),
        bootstrap_interval(ordered, confidence),
    )


# ---------------------------------------------------------------------------------- Student's t
def student_t_quantile(probability: float, degrees: int) -> float:
    """The ``probability`` quantile of Student's t with ``degrees`` degrees of freedom: the root of
    F(t) = probability, F(t) = 1 − I_{ν/(ν+t²)}(ν/2, 1/2) / 2 for t ≥ 0, by bisection to 1e-12.

    Raises:
        ValueError: ``probability`` outside (0, 1) or ``degrees`` < 1.
    """
    if not 0.0 < probability < 1.0 or degrees < 1:
        raise ValueError(f"student_t_quantile needs 0 < probability < 1 and degrees >= 1, got {probability}, {degrees}")
    if probability < 0.5:
        return -student_t_quantile(1 - probability, degrees)
    low, high = 0.0, 1.0
    while student_t_cdf(high, degrees) < probability:
        high *= 2
    for _ in range(200):
        middle = (low + high) / 2
        if student_t_cdf(middle, degrees) < probability:
            low = middle
        else:
            high = middle
        if high - low < 1e-12 * max(1.0, high):
            break
    return (low + high) / 2


def student_t_cdf(t: float, degrees: int) -> float:
    """F(t) of Student's t with ``degrees`` degrees of freedom (module docstring's form)."""
    tail = regularized_incomplete_beta(degrees / (degrees + t * t), degrees / 2, 0.5) / 2
    return 1 - tail if t >= 0 else tail


def regularized_incomplete_beta(x: float, a: float, b: float) -> float:
    """I_x(a, b) by its continued fraction (Lentz's method), using the symmetry
    I_x(a, b) = 1 − I_{1−x}(b, a) where the fraction converges slowly."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x))
    if x < (a + 1) / (a + b + 2):
        return front * _beta_fraction(x, a, b) / a
    return 1 - front * _beta_fraction(1 - x, b, a) / b


def _beta_fraction(x: float, a: float, b: float) -> float:
    tiny = 1e-300
    c, d = 1.0, 1 - (a + b) * x / (a + 1)
    d = 1 / (d if abs(d) > tiny else tiny)
    result = d
    for m in range(1, 500):
        for numerator in (
            m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
            -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1)),
        ):
            d = 1 + numerator * d
            d = 1 / (d if abs(d) > tiny else tiny)
            c = 1 + numerator / c
            c = c if abs(c) > tiny else tiny
            result *= c * d
        if abs(c * d - 1) < 1e-15:
            break
    return result


__all__ = [
    "BOOTSTRAP_RESAMPLES",
    "CONFIDENCE",
    "Interval",
    "PairedDifference",
    "bootstrap_interval",
    "compare",
    "estimate",
    "paired_differences",
    "regularized_incomplete_beta",
    "student_t_cdf",
    "student_t_quantile",
    "t_interval",
]
