"""Budget schedules: the distribution of the per-token expert budget κ (paper §3.1-3.3).

Vocabulary
----------
- ``center`` (k0): the deployment top-k. Inference always routes to exactly ``center`` experts.
- ``budgets``: the support {low, ..., high} of κ, as a tuple of ints.
- ``pmf``: q(r) for every r in ``budgets`` (paper Eq. 5)::

      q(r) = exp(-(r - k0)^2 / (2 σ^2)) / Z,    Z = Σ_{s=low}^{high} exp(-(s - k0)^2 / (2 σ^2))

- ``survival(j)`` = a(j) = P(κ >= j): the probability that the expert at router rank j
  (1-based) is dispatched. Static top-k is the step a(j) = [j <= k0]; an elastic schedule
  smooths it (paper Eq. 6-10). Identities the tests pin:

      Σ_j a(j) = E[κ]                       (exposure sums to the mean budget)
      q(j) = a(j) - a(j + 1)
      Σ_{j > k0} a(j) = ½ · E|κ - k0|       (for a schedule with E[κ] = k0)

:meth:`BudgetSchedule.budgets_from_uniforms` is the one map from uniforms to κ.
:meth:`BudgetSchedule.sample` feeds it uniforms from a torch generator (the gate lab, analyses); in
training the doors feed it uniforms of κ's own counter-based stream instead
(:mod:`elastic_moe_plugin.core.budget_stream`, seeded with ``BUDGET_SEED_OFFSET`` + the framework's
seed), whose state lives where the framework saves and replays RNG state (Megatron's RNG tracker,
the Trainer's ``rng_state`` files). A private generator that nothing saves or replays would
silently break recompute and resume.
"""

from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import torch

#: κ's stream is seeded with this + the framework's seed: a large prime, so it never meets the seeds
#: Megatron gives its own tracker states (seed, seed + 2718 + tp_rank, seed + 1024 + 100·ep_rank + ...)
BUDGET_SEED_OFFSET = 2_147_483_647

SamplingMode = Literal["iid", "balanced"]
SAMPLING_MODES: tuple[str, ...] = ("iid", "balanced")

_RANGE_SPEC = re.compile(r"^\s*(\d+)\s*-\s*(\d+)\s*$")
_INT_SPEC = re.compile(r"^\s*(\d+)\s*$")


def parse_range(spec: str) -> tuple[int, int] | None:
    """``(low, high)`` of a ``"LOW-HIGH"`` schedule spec (either order, unchecked), else None."""
    match = _RANGE_SPEC.match(spec)
    return (int(match.group(1)), int(match.group(2))) if match else None


def symmetric_range(center: int, half_width: int, num_experts: int | None = None) -> str:
    """The schedule spec ``"{center-d}-{center+d}"`` with ``d = half_width`` narrowed until the range
    holds at least one expert per token and at most ``num_experts``; ``"static"`` when ``d`` reaches 0."""
    d = min(half_width, center - 1, (num_experts - center) if num_experts is not None else half_width)
    return "static" if d <= 0 else f"{center - d}-{center + d}"


@dataclass(frozen=True)
class BudgetSchedule:
    """A discretised Gaussian over the integer budgets {low..high}, centred at ``center``.

    Args:
        low: smallest budget a (>= 1).
        high: largest budget b (>= center).
        center: k0, the deployment top-k; must lie in [low, high].
        sigma: σ of the Gaussian (> 0, finite). The paper uses 1.5.
        allow_off_center: accept a support that is not symmetric around ``center``. Such a
            schedule's mean differs from k0, so training is no longer compute-matched with
            static top-k; off by default.

    Raises:
        ValueError: naming the field, the value and what is accepted.
    """

    low: int
    high: int
    center: int
    sigma: float = 1.5
    allow_off_center: bool = False
    budgets: tuple[int, ...] = field(init=False, repr=False)
    pmf: tuple[float, ...] = field(init=False, repr=False)
    #: low == high: the point mass, κ ≡ center (a field, not a property: routers read it per forward)
    is_static: bool = field(init=False, repr=False, compare=False)
    #: low + high == 2·center: E[κ] = center, so training is compute-matched with static top-k (and
    #: ``"balanced"`` sampling can hit Σκ = T·center exactly)
    is_symmetric: bool = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("low", "high", "center"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"BudgetSchedule.{name}={value!r} is invalid: expected an integer number of experts.")
        if self.low < 1:
            raise ValueError(
                f"BudgetSchedule.low={self.low} is invalid: every token needs at least one expert, "
                f"so low must be >= 1 (e.g. schedule '{symmetric_range(self.center, self.high - self.center)}')."
            )
        if not self.low <= self.center <= self.high:
            raise ValueError(
                f"BudgetSchedule center={self.center} lies outside the support {self.low}-{self.high}: "
                f"expected low <= center <= high. Use a range around the model's top-k, "
                f"e.g. '{symmetric_range(self.center, (self.high - self.low) // 2)}'."
            )
        sigma = self.sigma
        if isinstance(sigma, bool) or not isinstance(sigma, (int, float)) or not math.isfinite(sigma) or sigma <= 0:
            raise ValueError(
                f"BudgetSchedule.sigma={sigma!r} is invalid: expected a finite number > 0 (the paper uses 1.5)."
            )
        budgets = tuple(range(self.low, self.high + 1))
        weights = [math.exp(-((r - self.center) ** 2) / (2.0 * sigma * sigma)) for r in budgets]
        total = math.fsum(weights)
        object.__setattr__(self, "budgets", budgets)
        object.__setattr__(self, "pmf", tuple(w / total for w in weights))
        object.__setattr__(self, "is_static", self.low == self.high)
        object.__setattr__(self, "is_symmetric", self.low + self.high == 2 * self.center)
        if not self.is_symmetric and not self.allow_off_center:
            raise ValueError(
                f"schedule '{self.low}-{self.high}' around center={self.center} has mean {self.mean:.4f}, "
                f"not {self.center}: training would no longer be compute-matched with static top-{self.center}. "
                f"Use a range symmetric around the center (low + high == 2 * center, e.g. "
                f"'{symmetric_range(self.center, (self.high - self.low) // 2)}'), or pass allow_off_center=True to "
                f"accept it."
            )

    # ------------------------------------------------------------------ constructors
    @classmethod
    def static(cls, k: int) -> BudgetSchedule:
        """The point mass at k: the fixed top-k objective (paper Eq. 3)."""
        return cls(k, k, k)

    @classmethod
    def parse(cls, spec: str, center: int, sigma: float = 1.5, allow_off_center: bool = False) -> BudgetSchedule:
        """Build a schedule from ``"6-10"`` (a range), ``"static"`` or ``"8"`` (a point mass).

        A point-mass spec must equal ``center``: ``"9"`` around 8 would be a different model.
        """
        if not isinstance(spec, str):
            raise ValueError(f"schedule={spec!r} is invalid: expected a string such as '6-10', 'static' or '{center}'.")
        text = spec.strip().lower()
        if text == "static":
            return cls.static(center)
        match = _INT_SPEC.match(text)
        if match:
            k = int(match.group(1))
            if k != center:
                raise ValueError(
                    f"schedule='{spec}' is a point mass at {k}, but center={center}: a static schedule must "
                    f"equal the model's top-k. Use 'static' (or '{center}'); to train with more experts "
                    f"change the model's top-k instead."
                )
            return cls.static(k)
        bounds = parse_range(text)
        if bounds is None:
            raise ValueError(
                f"schedule='{spec}' does not parse: expected 'LOW-HIGH' (e.g. '6-10'), 'static', "
                f"or a single integer equal to the model's top-k."
            )
        low, high = bounds
        if low > high:
            raise ValueError(
                f"schedule='{spec}' has low={low} > high={high}: write the range as 'LOW-HIGH', e.g. '{high}-{low}'."
            )
        return cls(low, high, center, sigma, allow_off_center=allow_off_center)

    # ------------------------------------------------------------------ statistics
    @property
    def mean(self) -> float:
        """E[κ] = Σ_r r·q(r)."""
        return math.fsum(r * q for r, q in zip(self.budgets, self.pmf, strict=True))

    @property
    def mean_abs_deviation(self) -> float:
        """E|κ - center|."""
        return math.fsum(abs(r - self.center) * q for r, q in zip(self.budgets, self.pmf, strict=True))

    @property
    def std(self) -> float:
        """SD(κ)."""
        mean = self.mean
        return math.sqrt(math.fsum((r - mean) ** 2 * q for r, q in zip(self.budgets, self.pmf, strict=True)))

    @property
    def off_center_share(self) -> float:
        """P(κ ≠ center): the share of tokens whose budget differs from static top-k."""
        return 1.0 - self.probability(self.center)

    def probability(self, budget: int) -> float:
        """q(budget); 0 outside the support."""
        if self.low <= budget <= self.high:
            return self.pmf[budget - self.low]
        return 0.0

    def survival(self, rank: int) -> float:
        """a(rank) = P(κ >= rank) for a 1-based router rank (paper Eq. 7)."""
        if rank <= self.low:
            return 1.0
        if rank > self.high:
            return 0.0
        return math.fsum(self.pmf[rank - self.low :])

    def exposure(self, num_ranks: int) -> tuple[float, ...]:
        """(a(1), ..., a(num_ranks)): the expected dispatch share of each router rank.

        Its sum equals ``mean`` once ``num_ranks >= high``.
        """
        return tuple(self.survival(rank) for rank in range(1, num_ranks + 1))

    def spec(self) -> str:
        """The canonical spec string: ``"static"`` or ``"LOW-HIGH"``."""
        return "static" if self.is_static else f"{self.low}-{self.high}"

    def describe(self) -> str:
        return f"{self.spec()} around k={self.center} (σ={self.sigma:g})"

    # ------------------------------------------------------------------ model checks
    def validate_for(self, num_experts: int, topk: int) -> None:
        """Check that this schedule fits a model with ``num_experts`` routed experts and top-k ``topk``.

        Raises:
            ValueError: if ``high > num_experts`` or ``center != topk``.
        """
        if self.center != topk:
            raise ValueError(
                f"schedule {self.describe()} is centred at {self.center}, but the model routes to "
                f"top-{topk}: the center must be the model's deployment top-k. Leave `center` unset "
                f"(it defaults to the model's top-k) or set it to {topk}."
            )
        if self.high > num_experts:
            raise ValueError(
                f"schedule {self.describe()} reaches budget {self.high}, but the model has only "
                f"{num_experts} experts: expected high <= num_experts. Use a narrower range, e.g. "
                f"'{symmetric_range(topk, (self.high - self.low) // 2, num_experts)}'."
            )

    # ------------------------------------------------------------------ sampling
    def sample(
        self,
        num_tokens: int,
        mode: SamplingMode = "iid",
        generator: torch.Generator | None = None,
        device: torch.device | str | None = None,
    ) -> torch.Tensor:
        """Draw one budget per token: LongTensor κ [num_tokens] on ``device``.

        Modes:
            ``"iid"``: independent draws from q (the paper). The total number of dispatched
                (token, expert) pairs varies around ``num_tokens * center``.
            ``"balanced"``: a uniformly random permutation of a fixed budget multiset whose
                counts follow q (rounded symmetrically) and whose sum is *exactly*
                ``num_tokens * center``. Every micro-batch then dispatches exactly as many pairs
                as static top-k, so buffer sizes are static. Trade-off: budgets of tokens in one
                micro-batch are no longer independent (they are drawn without replacement), and
                the pmf holds only up to rounding for small T.

        Both modes consume ``num_tokens`` float64 uniforms from ``generator`` (torch's default CPU
        generator when None) and map them on the host with :meth:`budgets_from_uniforms`. For the
        gate lab and analyses; training draws κ from its own counter-based stream
        (:mod:`elastic_moe_plugin.core.budget_stream`), which maps its uniforms the same way.
        """
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 0:
            raise ValueError(f"num_tokens={num_tokens!r} is invalid: expected an integer >= 0.")
        if mode not in SAMPLING_MODES:
            raise ValueError(f"sampling='{mode}' is not a sampling mode: expected one of {SAMPLING_MODES}.")
        uniforms = torch.rand(num_tokens, generator=generator, dtype=torch.float64)
        budgets = torch.from_numpy(self.budgets_from_uniforms(uniforms.numpy(), mode))
        return budgets if device is None else budgets.to(device)

    def budgets_from_uniforms(self, uniforms, mode: SamplingMode = "iid"):
        """Map uniforms u in [0, 1) to budgets κ (int64): the one mapping of the package.

        ``"iid"`` inverts the CDF token by token: κ = low + #{r < high : CDF(r) <= u} (u of any
        shape). ``"balanced"`` permutes the sorted :meth:`balanced_counts` multiset m by the order
        of the T uniforms, κ = m[argsort(u)], a uniformly random permutation of m; ties go by token
        index (u of shape [T]).

        ``uniforms``: a float64 numpy array (returns numpy), or a tensor (returns a tensor on its
        device, mapped on the host).
        """
        if isinstance(uniforms, torch.Tensor):
            host = uniforms.detach().to("cpu", torch.float64).numpy()
            return torch.from_numpy(self.budgets_from_uniforms(host, mode)).to(uniforms.device)
        if mode == "iid":
            if self.is_static:
                return np.full(uniforms.shape, self.low, dtype=np.int64)
            return np.add(np.searchsorted(_cumulative(self.pmf), uniforms, side="right"), self.low, dtype=np.int64)
        if mode == "balanced":
            if uniforms.ndim != 1:
                raise ValueError(f"balanced sampling needs uniforms of shape [T], got {tuple(uniforms.shape)}.")
            counts = self.balanced_counts(uniforms.size) if not self.is_static else {self.low: uniforms.size}
            multiset = _multiset(tuple(sorted(counts.items())))
            if self.is_static:
                return multiset.copy()
            order = np.argsort(uniforms, kind="quicksort")
            ranked = uniforms[order]
            if ranked.size > 1 and bool(np.any(ranked[1:] == ranked[:-1])):
                order = np.argsort(uniforms, kind="stable")  # ties by token index, as the docstring says
            return multiset[order]
        raise ValueError(f"sampling='{mode}' is not a sampling mode: expected one of {SAMPLING_MODES}.")

    def balanced_counts(self, num_tokens: int) -> dict[int, int]:
        """Budget counts {κ: n_κ} for ``"balanced"`` sampling of ``num_tokens`` tokens.

        n_{k0±d} = round(T·q(k0±d)) for each offset d > 0, identical on both sides so that
        Σ n_κ·κ = T·k0 exactly; the center takes the rest. If rounding up overfills T (tiny T),
        the pairs rounded up the most are decremented first.

        Raises:
            ValueError: for a schedule not symmetric around its center, where no multiset can
                match the compute of static top-k.
        """
        if not self.is_symmetric:
            raise ValueError(
                f"sampling='balanced' needs a schedule symmetric around its center, got {self.describe()}: "
                f"use sampling='iid', or a range with low + high == 2 * center."
            )
        return dict(_balanced_counts_cached(self.pmf, self.low, self.center, num_tokens))


@functools.lru_cache(maxsize=64)
def _balanced_counts_cached(
    pmf: tuple[float, ...], low: int, center: int, num_tokens: int
) -> tuple[tuple[int, int], ...]:
    offsets = range(1, center - low + 1)
    expected = {d: num_tokens * pmf[center + d - low] for d in offsets}
    per_side = {d: math.floor(expected[d] + 0.5) for d in offsets}
    # Overfill only happens for T smaller than the support; undo the largest round-ups first.
    by_round_up = sorted(offsets, key=lambda d: per_side[d] - expected[d], reverse=True)
    for d in by_round_up:
        if 2 * sum(per_side.values()) <= num_tokens:
            break
        per_side[d] -= 1
    counts = {center: num_tokens - 2 * sum(per_side.values())}
    for d in offsets:
        counts[center - d] = per_side[d]
        counts[center + d] = per_side[d]
    return tuple(sorted(counts.items()))


@functools.lru_cache(maxsize=64)
def _cumulative(pmf: tuple[float, ...]) -> np.ndarray:
    """CDF(low), ..., CDF(high - 1) as a read-only float64 array (the iid thresholds)."""
    cdf = np.cumsum(np.asarray(pmf, dtype=np.float64))[:-1]
    cdf.flags.writeable = False
    return cdf


@functools.lru_cache(maxsize=64)
def _multiset(counts: tuple[tuple[int, int], ...]) -> np.ndarray:
    """The sorted budget multiset of ``((κ, n_κ), ...)``, read-only: shared by every draw of one T."""
    multiset = np.repeat(np.asarray([b for b, _ in counts], dtype=np.int64), [n for _, n in counts])
    multiset.flags.writeable = False
    return multiset
