"""Every gate convention on the same seeded toy MoE (:mod:`.toy_moe`), side by side.

:func:`compare` holds everything but the gate fixed: the logits z ``[T, E]``, the expert
parameters ``[E, D, D]``, the token order, the budgets κ ``[T]`` (drawn once from the schedule)
and the capacity policy (dropless). Per convention it records the loss, the selected ids
``[T, width]``, the retained weight sums Σ_{S_t} w_t, ‖∂L/∂W_r‖ (or ‖∂L/∂z‖ for user logits),
‖∂L/∂W_e‖ per expert, and the tokens whose router-gate gradient ∂L/∂z_t is exactly 0, each with
its cause; optionally the boundary-aware gradient check of :mod:`.gradcheck` on the toy
linearised at y (F_te = ⟨∂L/∂y_t, F_e(x_t)⟩ held fixed). :func:`format_comparison` renders the
report as a fixed-width table.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from elastic_moe_plugin.core.schedule import SAMPLING_MODES, BudgetSchedule, SamplingMode
from elastic_moe_plugin.tools.gates_lab.gradcheck import finite_or_none, gradcheck_router
from elastic_moe_plugin.tools.gates_lab.inputs import DTYPES, check_int, convention_names
from elastic_moe_plugin.tools.gates_lab.toy_moe import ZERO_CAUSES, _build_toy, _run_convention, _Toy


def compare(
    *,
    k: int = 1,
    schedule: str | None = None,
    sigma: float = 1.5,
    sampling: SamplingMode = "iid",
    num_experts: int | None = None,
    num_tokens: int | None = None,
    hidden: int = 8,
    seed: int = 0,
    conventions: Sequence[str] | str | None = None,
    logits: torch.Tensor | None = None,
    identical_experts: bool = False,
    logit_scale: float = 1.0,
    detach_gate: bool = False,
    dtype: torch.dtype | str = torch.float64,
    gradcheck: bool = False,
    step: float | None = None,
) -> dict[str, Any]:
    """Run every gate convention on the same seeded toy MoE and report what each one learns.

    Identical for every convention: the logits (same router weights and inputs, or the same
    user-supplied ``logits``), the expert parameters, the token order, the budgets κ (drawn once)
    and the capacity policy (dropless). Only the gate convention changes.

    Args:
        k: the top-k (the schedule's center).
        schedule: an elastic budget schedule around ``k`` (``"LOW-HIGH"``, see
            :meth:`BudgetSchedule.parse`); None for static top-k.
        sigma, sampling: the schedule's σ and sampling mode (``"iid"`` or ``"balanced"``).
        num_experts, num_tokens: E and T (default 8 and 16, or the shape of ``logits``).
        hidden: D, the toy's width.
        seed: seeds the toy's parameters, inputs, targets and the budgets.
        conventions: names to compare (default: all four), or a comma-separated string.
        logits: user-supplied ``[T, E]`` logits; they replace the toy router (the router-weight
            gradient is then not defined, and the logit gradient is reported instead).
        identical_experts: give every expert the same weights (a zero-gradient cause).
        logit_scale: multiply the toy router's logits (large values saturate the gate).
        detach_gate: detach the gate weights before mixing (a zero-gradient cause).
        dtype: ``torch.float64`` (default) or ``torch.float32``, or their names.
        gradcheck: also run :func:`gradcheck_router` per convention on these logits, with the
            expert outputs (projected on dL/dy) held fixed.
        step: the finite-difference step for ``gradcheck`` (default: chosen from the margins).

    Returns:
        A JSON-ready dict: ``setup``, ``same_selection``, ``conventions`` (per name: ``loss``,
        ``selected`` [T][width] ids with −1 unused, ``retained_weight_sum`` mean/min/max,
        ``router_grad_norm``, ``logit_grad_norm``, ``expert_grad_norm`` [E],
        ``zero_gate_grad_tokens``, ``unselected_logit_grad_tokens``, ``zero_gate_grad``
        [{token, cause}], ``zero_causes`` {cause: count}, optionally ``gradcheck``) and
        ``causes`` (the explanation of each cause found).

    Raises:
        ValueError: naming the argument (CLI flag), the value and what is accepted.
    """
    names = convention_names(conventions)
    dtype = _compute_dtype(dtype)
    _check_toy_arguments(k=k, hidden=hidden, seed=seed, logit_scale=logit_scale, sampling=sampling)
    if logits is not None:
        num_tokens, num_experts = _user_logits_shape(logits, num_tokens, num_experts, logit_scale)
    num_experts = check_int("--experts", 8 if num_experts is None else num_experts, 2)
    num_tokens = check_int("--tokens", 16 if num_tokens is None else num_tokens, 1)
    if k > num_experts:
        raise ValueError(f"--k={k} is invalid: expected 1 <= k <= --experts={num_experts}.")

    generator = torch.Generator().manual_seed(seed)
    toy = _build_toy(num_tokens, num_experts, hidden, generator, dtype, identical_experts, logits)
    budget_schedule, k_arg = _draw_budgets(k, schedule, sigma, sampling, num_experts, num_tokens, generator)
    budgets = k_arg if isinstance(k_arg, torch.Tensor) else torch.full((num_tokens,), k, dtype=torch.long)
    width = budget_schedule.high
    results = _run_conventions(
        names,
        toy,
        k_arg,
        budgets,
        width,
        logit_scale=logit_scale,
        detach_gate=detach_gate,
        gradcheck=gradcheck,
        step=step,
    )
    selections = [result["selected"] for result in results.values()]
    found = sorted(
        {cause for result in results.values() for cause in result["zero_causes"]}, key=list(ZERO_CAUSES).index
    )
    return {
        "setup": {
            "num_tokens": num_tokens,
            "num_experts": num_experts,
            "hidden": hidden,
            "k": k,
            "schedule": budget_schedule.spec(),
            "sigma": budget_schedule.sigma,
            "sampling": sampling if schedule is not None else None,
            "width": width,
            "budgets": budgets.tolist(),
            "seed": seed,
            "dtype": str(dtype).removeprefix("torch."),
            "router": "user-supplied logits"
            if logits is not None
            else f"linear: logits = {logit_scale:g} * x @ W_router^T",
            "experts": "linear, identical weights" if identical_experts else "linear, independent weights",
            "gate_detached": detach_gate,
            "capacity_policy": "dropless (every selected token-expert pair is computed)",
            "loss": "0.5 * mean_t ||y_t - target_t||^2, no auxiliary loss",
        },
        "same_selection": all(s == selections[0] for s in selections),
        "conventions": results,
        "causes": {cause: ZERO_CAUSES[cause] for cause in found},
    }


# ------------------------------------------------------------------------------ compare's steps
def _compute_dtype(dtype: torch.dtype | str) -> torch.dtype:
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"--dtype={dtype!r} is invalid: expected one of {', '.join(DTYPES)}.")
        dtype = DTYPES[dtype]
    if dtype not in DTYPES.values():
        raise ValueError(f"dtype={dtype} is invalid: expected torch.float64 or torch.float32.")
    return dtype


def _check_toy_arguments(*, k: int, hidden: int, seed: int, logit_scale: float, sampling: str) -> None:
    check_int("--k", k, 1)
    check_int("--hidden", hidden, 1)
    check_int("--seed", seed, 0)
    if isinstance(logit_scale, bool) or not isinstance(logit_scale, (int, float)) or not math.isfinite(logit_scale):
        raise ValueError(f"--logit-scale={logit_scale!r} is invalid: expected a finite number.")
    if sampling not in SAMPLING_MODES:
        raise ValueError(f"--sampling={sampling!r} is invalid: expected one of {', '.join(SAMPLING_MODES)}.")


def _user_logits_shape(
    logits: torch.Tensor,
    num_tokens: int | None,
    num_experts: int | None,
    logit_scale: float,
) -> tuple[int, int]:
    """(T, E) of user-supplied logits, which any given ``num_tokens`` / ``num_experts`` must match."""
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2 or not logits.is_floating_point():
        raise ValueError("logits must be a floating-point tensor of shape [tokens, experts].")
    if not torch.isfinite(logits).all():
        raise ValueError("logits must be finite (found NaN or inf).")
    for flag, given, actual in (("--tokens", num_tokens, logits.shape[0]), ("--experts", num_experts, logits.shape[1])):
        if given is not None and given != actual:
            raise ValueError(
                f"{flag}={given} contradicts --logits, whose shape is {tuple(logits.shape)} "
                f"[tokens, experts]: drop {flag} or pass {actual}."
            )
    if logit_scale != 1.0:
        raise ValueError("--logit-scale only scales the toy router; it does not apply to --logits.")
    return logits.shape[0], logits.shape[1]


def _draw_budgets(
    k: int,
    schedule: str | None,
    sigma: float,
    sampling: SamplingMode,
    num_experts: int,
    num_tokens: int,
    generator: torch.Generator,
) -> tuple[BudgetSchedule, int | torch.Tensor]:
    """The schedule and the convention's ``k``: the int k when static, else κ ``LongTensor[T]``."""
    if schedule is None:
        return BudgetSchedule.static(k), k
    budget_schedule = BudgetSchedule.parse(schedule, center=k, sigma=sigma)
    budget_schedule.validate_for(num_experts, k)
    return budget_schedule, budget_schedule.sample(num_tokens, mode=sampling, generator=generator)


def _run_conventions(
    names: Sequence[str],
    toy: _Toy,
    k: int | torch.Tensor,
    budgets: torch.Tensor,
    width: int,
    *,
    logit_scale: float,
    detach_gate: bool,
    gradcheck: bool,
    step: float | None,
) -> dict[str, dict[str, Any]]:
    results: dict[str, Any] = {}
    for name in names:
        results[name] = _run_convention(name, toy, k, width, logit_scale, detach_gate)
        if gradcheck:
            check = gradcheck_router(
                name,
                results[name]["_logits"],
                budgets,
                expert_outputs=results[name]["_fixed_outputs"],
                step=step,
            )
            results[name]["gradcheck"] = {
                "status": check.status,
                "step": check.step,
                "max_abs_error": finite_or_none(check.max_abs_error),
                "refused_tokens": [change.token for change in check.refused],
                "message": check.message,
            }
    for result in results.values():
        del result["_fixed_outputs"], result["_logits"]
    return results


# ------------------------------------------------------------------------------------- the table
def format_comparison(report: dict[str, Any], show_tokens: int = 8) -> str:
    """A fixed-width text table of :func:`compare`'s report."""
    lines = (
        _setup_lines(report["setup"])
        + _learning_signal_lines(report)
        + _selection_lines(report, show_tokens)
        + _zero_gradient_lines(report)
        + _gradcheck_lines(report["conventions"])
    )
    return "\n".join(line.rstrip() for line in lines)


def _setup_lines(setup: dict[str, Any]) -> list[str]:
    schedule = "static"
    if setup["schedule"] != "static":
        schedule = f"elastic {setup['schedule']} (sigma={setup['sigma']:g}, {setup['sampling']})"
    return [
        (
            f"gates: T={setup['num_tokens']} tokens, E={setup['num_experts']} experts, "
            f"top-{setup['k']} {schedule}, seed={setup['seed']}, {setup['dtype']}"
        ),
        f"router: {setup['router']}; experts: {setup['experts']} (D={setup['hidden']})"
        + ("; gate DETACHED" if setup["gate_detached"] else ""),
        f"capacity: {setup['capacity_policy']}; loss: {setup['loss']}",
        "identical for every convention: logits, expert parameters, token order, budgets, capacity policy",
        "",
    ]


def _learning_signal_lines(report: dict[str, Any]) -> list[str]:
    """The per-convention table (loss, retained sums, gradient norms, zero-grad counts), then the
    expert-weight gradient norms."""
    setup, results = report["setup"], report["conventions"]
    lines = [
        (
            f"{'convention':<17}{'loss':>10}{'sum w mean':>12}{'min':>8}{'max':>8}{'|dL/dW_r|':>11}"
            f"{'|dL/dz|':>10}{'zero-grad':>11}{'unsel.grad':>12}"
        ),
    ]
    for name, r in results.items():
        w = r["retained_weight_sum"]
        router = "-" if r["router_grad_norm"] is None else f"{r['router_grad_norm']:.4g}"
        lines.append(
            f"{name:<17}{r['loss']:>10.5f}{w['mean']:>12.4f}{w['min']:>8.4f}{w['max']:>8.4f}{router:>11}"
            f"{r['logit_grad_norm']:>10.4g}{r['zero_gate_grad_tokens']:>7}/{setup['num_tokens']:<3}"
            f"{r['unselected_logit_grad_tokens']:>8}/{setup['num_tokens']:<3}"
        )
    lines += [
        "  zero-grad: tokens whose router-gate gradient dL/dz_t is exactly 0;",
        "  unsel.grad: tokens where an unselected expert's logit still gets gradient (softmax denominator)",
        "",
        "expert-weight gradient norm |dL/dW_e| per expert",
        f"{'convention':<17}" + "".join(f"{'e' + str(e):>9}" for e in range(setup["num_experts"])),
    ]
    for name, r in results.items():
        lines.append(f"{name:<17}" + "".join(f"{g:>9.4f}" for g in r["expert_grad_norm"]))
    return lines


def _selection_lines(report: dict[str, Any], show_tokens: int) -> list[str]:
    """The selected experts of the first ``show_tokens`` tokens: one column, or one per convention."""
    setup, results = report["setup"], report["conventions"]
    shown = min(show_tokens, setup["num_tokens"])
    if shown <= 0:
        return []
    lines = ["", f"selected experts, rank order (first {shown} of {setup['num_tokens']} tokens)"]
    if report["same_selection"]:
        first = next(iter(results.values()))
        lines.append(f"{'token':>5}{'kappa':>7}  all conventions")
        for t in range(shown):
            ids = [i for i in first["selected"][t] if i >= 0]
            lines.append(f"{t:>5}{setup['budgets'][t]:>7}  {ids}")
    else:
        lines.append(f"{'token':>5}{'kappa':>7}  " + "  ".join(f"{name:<17}" for name in results))
        for t in range(shown):
            cells = [str([i for i in r["selected"][t] if i >= 0]) for r in results.values()]
            lines.append(f"{t:>5}{setup['budgets'][t]:>7}  " + "  ".join(f"{c:<17}" for c in cells))
    return lines


def _zero_gradient_lines(report: dict[str, Any]) -> list[str]:
    results = report["conventions"]
    lines = ["", "zero router-gate gradients"]
    if not any(r["zero_gate_grad_tokens"] for r in results.values()):
        lines.append("  none: every token passes gradient to its router logits under every convention")
    for name, r in results.items():
        if r["zero_gate_grad_tokens"]:
            counts = ", ".join(f"{cause} x{n}" for cause, n in r["zero_causes"].items())
            lines.append(f"  {name}: {r['zero_gate_grad_tokens']} token(s): {counts}")
    for cause, text in report["causes"].items():
        lines.append(f"  [{cause}] {text}")
    return lines


def _gradcheck_lines(results: dict[str, Any]) -> list[str]:
    checks = {name: r["gradcheck"] for name, r in results.items() if "gradcheck" in r}
    if not checks:
        return []
    lines = ["", "finite-difference check of dL/dz (expert outputs and dL/dy held fixed)"]
    for check in checks.values():
        lines += ["  " + line for line in check["message"].splitlines()]
    return lines
