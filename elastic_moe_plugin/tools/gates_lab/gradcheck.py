"""Boundary-aware gradient check of the router logits: central differences only where a step
cannot change which experts are kept, and the selection change reported where it would.

The checked function is the scalar illustration of docs/gates.md#gate-conventions, per token t
with the expert outputs F held fixed (``F [T, E]``; in the toy MoE F_te = ⟨∂L/∂y_t, F_e(x_t)⟩):

    y_t(z) = Σ_{i∈S_t} w_ti(z) F_ti,    S_t = the κ_t top-ranked experts of z_t.

Inside a fixed selection region the router-logit gradients have closed forms (derived in
:mod:`.conventions` and docs/gates.md): ``full_softmax`` ∂y/∂z_j =
p_j (F_j·[j∈S] − y); ``renormalized`` / ``selected_softmax`` ∂y/∂z_j = w_j (F_j − y) on S and 0
off it; ``sigmoid`` s_j(1 − s_j)(F_j − y) / Σ_S s for κ > 1, s_a(1 − s_a)F_a for κ = 1. Across
the boundary between ranks κ_t and κ_t + 1 y_t jumps, so a difference quotient there is no
derivative: the margin m_t = z_(κ_t) − z_(κ_t+1) bounds the step.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from elastic_moe_plugin.tools.gates_lab.conventions import CONVENTION_NAMES, get_convention
from elastic_moe_plugin.tools.gates_lab.inputs import check_int

#: Default central-difference step (fp64), its ceiling as a share of the smallest membership
#: margin, and the smallest step still trusted against rounding.
DEFAULT_STEP = 1e-6
STEP_SHARE_OF_MARGIN = 0.25
MIN_STEP = 1e-8


def finite_or_none(value: float) -> float | None:
    """A float for JSON: inf and NaN become None."""
    return float(value) if math.isfinite(value) else None


@dataclass
class SelectionChange:
    """What a step of ``step`` at token ``token`` does to its kept set instead of a derivative.

    ``left`` is the rank-κ expert, ``entered`` the rank-κ+1 expert, ``margin`` the logit gap
    between them. ``observed`` is True when evaluating the convention at the perturbed logits
    really swapped them; ``output_jump`` is y_t(perturbed) − y_t.
    """

    token: int
    budget: int
    margin: float
    step: float
    left: int
    entered: int
    observed: bool
    output_jump: float
    reason: str

    def describe(self) -> str:
        head = (
            f"token {self.token} (kappa={self.budget}): margin {self.margin:.3g} between rank {self.budget} "
            f"(expert {self.left}) and rank {self.budget + 1} (expert {self.entered}) {self.reason}"
        )
        if self.observed:
            return head + (
                f"; at z[{self.token}, {self.entered}] + {self.step:.3g} expert {self.entered} enters and expert "
                f"{self.left} leaves (output jumps by {self.output_jump:+.6g})"
            )
        return head + f"; a step of {self.step:.3g} lands on the tie, so the kept set is ambiguous there"


@dataclass
class GradcheckResult:
    """The outcome of :func:`gradcheck_router`.

    ``status``: ``"passed"`` (every token checked and within tolerance), ``"failed"`` (a checked
    token is out of tolerance) or ``"refused"`` (no failures, but some tokens sit within the step
    of a rank change and were not differentiated; see ``refused``). Tensors are float64:
    ``margins [T]`` (logit gap between ranks κ and κ+1; inf when κ = E), ``rank_margins [T, E-1]``
    (every adjacent gap, NaN beyond rank κ+1), ``analytic`` and ``numeric [T, E]`` (NaN rows for
    refused tokens).
    """

    convention: str
    status: str
    step: float | None
    margins: torch.Tensor
    rank_margins: torch.Tensor
    analytic: torch.Tensor
    numeric: torch.Tensor
    max_abs_error: float
    atol: float
    rtol: float
    checked_tokens: list[int]
    refused: list[SelectionChange] = field(default_factory=list)
    message: str = ""

    @property
    def passed(self) -> bool:
        return self.status == "passed"

    def to_dict(self) -> dict[str, Any]:
        return {
            "convention": self.convention,
            "status": self.status,
            "step": self.step,
            "margins": [finite_or_none(m) for m in self.margins.tolist()],
            "max_abs_error": finite_or_none(self.max_abs_error),
            "atol": self.atol,
            "rtol": self.rtol,
            "checked_tokens": self.checked_tokens,
            "refused": [vars(change) for change in self.refused],
            "message": self.message,
        }


@dataclass(frozen=True)
class _GatedOutput:
    """y_t = Σ_j w_tj · F[t, id_tj] under ``convention`` with F ``[T, E]`` held fixed."""

    convention: Callable
    budgets: torch.Tensor  # [T]
    width: int
    fixed: torch.Tensor  # [T, E]

    def __call__(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(y [T], expert_ids [T, width]) at ``logits``."""
        expert_ids, weights = self.convention(logits, self.budgets, width=self.width)
        picked = torch.gather(self.fixed, 1, expert_ids.clamp_min(0))
        return (weights * picked).sum(-1), expert_ids


@dataclass
class _Boundary:
    """Each token's logit ranking and how far its kept set is from changing."""

    order: torch.Tensor  # [T, E] expert ids by descending logit
    margins: torch.Tensor  # [T] gap between ranks κ and κ+1 (inf when κ = E, 0 at a tie)
    rank_margins: torch.Tensor  # [T, E-1] adjacent gaps, NaN beyond rank κ+1


@dataclass
class _StepPlan:
    """The central-difference step and the tokens it would carry across their boundary."""

    step: float | None  # None: no token is far enough from its boundary to be differentiated
    refused: torch.Tensor  # [T] bool
    probe: float  # the step that shows a refused token's selection change
    refusal_reason: str


def gradcheck_router(
    convention: str | Callable,
    logits: torch.Tensor,
    k: int | torch.Tensor,
    *,
    expert_outputs: torch.Tensor | None = None,
    step: float | None = None,
    atol: float = 1e-6,
    rtol: float = 1e-5,
    seed: int = 0,
) -> GradcheckResult:
    """Check router-logit gradients by central differences, never across a membership change.

    The checked function is y_t(z) = Σ_{i∈S_t} w_ti(z) F_ti with the expert outputs F held fixed
    (the scalar illustration of docs/gates.md#gate-conventions). Steps, in float64:

    1. Rank each token's logits and measure the margin m_t = z_(κ_t) − z_(κ_t+1) between ranks
       κ_t and κ_t+1: the only adjacent pair whose order changes the kept set (ties *inside* the
       kept set only permute slots; y is unchanged). All adjacent gaps are in ``rank_margins``.
       If the convention's own selection differs from the logit ranking (scores that tie after
       rounding, e.g. two probabilities underflowing to 0), the margin is 0: a tie.
    2. Pick the step: with ``step=None``, h = min(1e-6, ¼ · min m_t) over tokens whose margin is
       at least 4e-8 (below that, rounding would swamp a difference that small). A single-logit
       perturbation of size h < m_t cannot move any expert across the boundary.
    3. Refuse tokens with m_t <= h (or below the trusted floor): no derivative is reported for
       them (NaN row). Instead, evaluate the convention at z + h'·e_entering (h' = the step, or
       1e-6 when it was chosen automatically) and report the selection change: which expert
       entered, which left, and the jump in y_t.
    4. Compare autograd with the central differences on the other tokens:
       |analytic − numeric| <= atol + rtol·|numeric|.

    Args:
        convention: a name in ``CONVENTIONS`` or a convention function. ``sigmoid``'s
            ``expert_bias`` is not used: the margins assume selection by logit order.
        logits: ``[T, E]`` (or ``[E]`` for one token); cast to float64.
        k: int or ``LongTensor[T]`` budgets κ (1..E).
        expert_outputs: fixed F as ``[T, E]`` or ``[E]``; default seeded N(0, 1) ``[T, E]``.
        step: the central-difference step h; default chosen from the margins (step 2).
        atol, rtol: tolerance of the comparison.
        seed: seeds the default ``expert_outputs``.

    Returns:
        :class:`GradcheckResult`; its ``message`` says what was checked, refused and why.

    Raises:
        ValueError: for malformed logits, budgets, outputs or step.
    """
    name, fn = _resolve_convention(convention)
    z = _float64_logits(logits)
    num_tokens, num_experts = z.shape
    budgets = _token_budgets(k, num_tokens, num_experts, z.device)
    fixed = _fixed_expert_outputs(expert_outputs, num_tokens, num_experts, seed, z.device)
    _check_step(step)

    output = _GatedOutput(fn, budgets, int(budgets.max()) if num_tokens else 1, fixed)
    base_outputs, base_ids = output(z)
    boundary = _measure_boundary(z, budgets, base_ids, output.width)
    plan = _plan_step(boundary.margins, step)
    analytic = _autograd_gradient(output, z)
    numeric = _central_differences(output, z, plan)
    checked, max_error, bad_tokens = _check_tolerance(analytic, numeric, plan, atol, rtol)
    changes = _selection_changes(output, z, base_outputs, base_ids, boundary, plan)

    status = "failed" if bad_tokens else "refused" if changes else "passed"
    message = _outcome_message(
        name,
        status,
        step=plan.step,
        requested_step=step,
        margins=boundary.margins,
        checked=checked,
        max_error=max_error,
        bad_tokens=bad_tokens,
        atol=atol,
        rtol=rtol,
        changes=changes,
        num_tokens=num_tokens,
    )
    return GradcheckResult(
        convention=name,
        status=status,
        step=plan.step,
        margins=boundary.margins,
        rank_margins=boundary.rank_margins,
        analytic=analytic,
        numeric=numeric,
        max_abs_error=max_error,
        atol=atol,
        rtol=rtol,
        checked_tokens=checked,
        refused=changes,
        message=message,
    )


# ------------------------------------------------------------------------------------ the inputs
def _resolve_convention(convention: str | Callable) -> tuple[str, Callable]:
    if isinstance(convention, str):
        return convention, get_convention(convention)
    if callable(convention):
        return getattr(convention, "__name__", "convention"), convention
    raise TypeError(f"convention={convention!r} is invalid: expected a name in {CONVENTION_NAMES} or a function.")


def _float64_logits(logits: torch.Tensor) -> torch.Tensor:
    """Detached float64 ``[T, E]`` logits (a row ``[E]`` is one token)."""
    if not isinstance(logits, torch.Tensor) or logits.dim() not in (1, 2) or not logits.is_floating_point():
        raise ValueError("logits must be a floating-point tensor of shape [tokens, experts] (or [experts]).")
    z = logits.detach().to(torch.float64)
    z = z[None, :] if z.dim() == 1 else z
    if not torch.isfinite(z).all():
        raise ValueError("logits must be finite (found NaN or inf).")
    return z


def _token_budgets(k: int | torch.Tensor, num_tokens: int, num_experts: int, device: torch.device) -> torch.Tensor:
    """κ as ``LongTensor[T]``, each in 1..E."""
    if isinstance(k, torch.Tensor):
        budgets = k.detach().to(device=device, dtype=torch.long).reshape(-1)
        if budgets.shape != (num_tokens,):
            raise ValueError(
                f"k as a tensor must hold one budget per token, shape [{num_tokens}], got {tuple(k.shape)}."
            )
    else:
        check_int("k", k, 1)
        budgets = torch.full((num_tokens,), k, dtype=torch.long, device=device)
    if num_tokens and not bool(((budgets >= 1) & (budgets <= num_experts)).all()):
        raise ValueError(f"budgets k must lie in 1..num_experts={num_experts}, got {budgets.tolist()}.")
    return budgets


def _fixed_expert_outputs(
    expert_outputs: torch.Tensor | None,
    num_tokens: int,
    num_experts: int,
    seed: int,
    device: torch.device,
) -> torch.Tensor:
    """F as float64 ``[T, E]``: the given outputs (a row ``[E]`` is shared by every token), or seeded N(0, 1)."""
    if expert_outputs is None:
        generator = torch.Generator().manual_seed(seed)
        return torch.randn(num_tokens, num_experts, generator=generator, dtype=torch.float64).to(device)
    fixed = expert_outputs.detach().to(device=device, dtype=torch.float64)
    if fixed.shape == (num_experts,):
        fixed = fixed.expand(num_tokens, num_experts)
    if fixed.shape != (num_tokens, num_experts):
        raise ValueError(
            f"expert_outputs must be [tokens, experts] = [{num_tokens}, {num_experts}] or [experts], "
            f"got {tuple(expert_outputs.shape)}."
        )
    return fixed


def _check_step(step: float | None) -> None:
    bad_step = isinstance(step, bool) or not isinstance(step, (int, float)) or not math.isfinite(step) or step <= 0
    if step is not None and bad_step:
        raise ValueError(f"--step={step!r} is invalid: expected a finite number > 0.")


# ------------------------------------------------------------------------------------- the steps
def _measure_boundary(z: torch.Tensor, budgets: torch.Tensor, selected_ids: torch.Tensor, width: int) -> _Boundary:
    """Step 1: the margins, from the logits' own ranking (a stable sort: ties keep index order).

    A token whose convention kept other experts (``selected_ids [T, width]``) than the logit
    ranking's top κ gets margin 0: its scores tie after rounding.
    """
    num_experts = z.shape[1]
    sorted_logits, order = torch.sort(z, dim=-1, descending=True, stable=True)
    gaps = sorted_logits[:, :-1] - sorted_logits[:, 1:]  # [T, E-1], gap between rank j and j+1
    ranks = torch.arange(1, num_experts, device=z.device)
    rank_margins = torch.where(ranks[None, :] <= budgets[:, None], gaps, torch.full_like(gaps, float("nan")))
    at_end = budgets >= num_experts
    boundary = (budgets - 1).clamp(max=num_experts - 2)[:, None]
    margins = torch.where(at_end, torch.full_like(z[:, 0], float("inf")), gaps.gather(1, boundary)[:, 0])
    kept = torch.arange(width, device=z.device)[None, :] < budgets[:, None]
    by_logits = torch.where(kept, order[:, :width], torch.full_like(selected_ids, -1))
    disagrees = (by_logits.sort(-1).values != selected_ids.sort(-1).values).any(-1)
    margins = torch.where(disagrees, torch.zeros_like(margins), margins)
    return _Boundary(order=order, margins=margins, rank_margins=rank_margins)


def _plan_step(margins: torch.Tensor, step: float | None) -> _StepPlan:
    """Steps 2 and 3: the step, and which tokens are refused."""
    if step is not None:
        h = float(step)
        return _StepPlan(step=h, refused=margins <= h, probe=h, refusal_reason=f"is <= the step {h:.3g}")
    trusted = margins >= MIN_STEP / STEP_SHARE_OF_MARGIN
    smallest = float(margins[trusted].min()) if bool(trusted.any()) else math.inf
    # κ = E tokens have no boundary (margin inf): they alone allow the default step.
    chosen = min(DEFAULT_STEP, STEP_SHARE_OF_MARGIN * smallest) if bool(trusted.any()) else None
    reason = (
        f"is below the floor {MIN_STEP / STEP_SHARE_OF_MARGIN:.0e} (any step small enough not to cross "
        f"would be lost in rounding)"
    )
    return _StepPlan(step=chosen, refused=~trusted, probe=DEFAULT_STEP, refusal_reason=reason)


def _autograd_gradient(output: _GatedOutput, z: torch.Tensor) -> torch.Tensor:
    """Step 4, analytic side: ∂y_t/∂z_t ``[T, E]``."""
    z_grad = z.clone().requires_grad_()
    outputs, _ = output(z_grad)
    outputs.sum().backward()
    assert z_grad.grad is not None  # a leaf that requires grad: backward() filled it
    return z_grad.grad.detach()


def _central_differences(output: _GatedOutput, z: torch.Tensor, plan: _StepPlan) -> torch.Tensor:
    """Step 4, numeric side: (y(z + h·e_j) − y(z − h·e_j)) / 2h ``[T, E]``, NaN rows where refused."""
    numeric = torch.full_like(z, float("nan"))
    if plan.step is not None:
        h = plan.step
        for expert in range(z.shape[1]):
            plus, minus = z.clone(), z.clone()
            plus[:, expert] += h
            minus[:, expert] -= h
            y_plus, _ = output(plus)
            y_minus, _ = output(minus)
            numeric[:, expert] = (y_plus - y_minus) / (2 * h)
    numeric[plan.refused] = float("nan")
    return numeric


def _check_tolerance(
    analytic: torch.Tensor,
    numeric: torch.Tensor,
    plan: _StepPlan,
    atol: float,
    rtol: float,
) -> tuple[list[int], float, list[int]]:
    """Step 4, the comparison: (checked tokens, max |error| over them, tokens out of tolerance)."""
    checked = (~plan.refused).nonzero().flatten().tolist() if plan.step is not None else []
    if not checked:
        return checked, math.nan, []
    errors = (analytic - numeric).abs()
    within = errors[checked] <= atol + rtol * numeric[checked].abs()
    bad_tokens = [checked[i] for i in (~within.all(-1)).nonzero().flatten().tolist()]
    return checked, float(errors[checked].max()), bad_tokens


def _selection_changes(
    output: _GatedOutput,
    z: torch.Tensor,
    base_outputs: torch.Tensor,
    base_ids: torch.Tensor,
    boundary: _Boundary,
    plan: _StepPlan,
) -> list[SelectionChange]:
    """Step 3's report: at each refused token, evaluate at the perturbed logits and say what happened."""
    changes = []
    for token in plan.refused.nonzero().flatten().tolist():
        budget = int(output.budgets[token])
        left, entered = int(boundary.order[token, budget - 1]), int(boundary.order[token, budget])
        before = set(base_ids[token, :budget].tolist())
        perturbed = z.clone()
        perturbed[token, entered] += plan.probe
        y_after, ids_after = output(perturbed)
        after = set(ids_after[token, :budget].tolist())
        observed = after != before
        if observed:
            entered = next(iter(after - before))
            left = next(iter(before - after))
        margin = float(boundary.margins[token])
        changes.append(
            SelectionChange(
                token=token,
                budget=budget,
                margin=margin,
                step=plan.probe,
                left=left,
                entered=entered,
                observed=observed,
                output_jump=float(y_after[token] - base_outputs[token]),
                reason="is a tie" if margin == 0 else plan.refusal_reason,
            )
        )
    return changes


def _outcome_message(
    name: str,
    status: str,
    *,
    step: float | None,
    requested_step: float | None,
    margins: torch.Tensor,
    checked: list[int],
    max_error: float,
    bad_tokens: list[int],
    atol: float,
    rtol: float,
    changes: list[SelectionChange],
    num_tokens: int,
) -> str:
    """What was checked, refused and why: the summary line, then one line per selection change."""
    if status == "passed":
        message = (
            f"{name}: passed on {len(checked)} token(s): autograd matches central differences "
            f"(step {step:.3g}, smallest kept/unkept margin {float(margins.min()):.3g}; max |error| {max_error:.3g})"
        )
    elif status == "failed":
        message = (
            f"{name}: FAILED on token(s) {bad_tokens}: autograd and central differences (step {step:.3g}) differ by up "
            f"to {max_error:.3g} > atol {atol:g} + rtol {rtol:g}·|numeric|"
        )
        if requested_step is not None and requested_step > DEFAULT_STEP:
            message += " (a central difference errs by O(step^2): retry with a smaller --step, or omit it)"
    else:
        message = (
            f"{name}: refused for {len(changes)} of {num_tokens} token(s): a step there would cross a rank "
            f"change, so no derivative is reported"
        )
        if checked:
            message += f"; the other {len(checked)} token(s) pass (step {step:.3g}, max |error| {max_error:.3g})"
    return message + "".join("\n  " + change.describe() for change in changes)
