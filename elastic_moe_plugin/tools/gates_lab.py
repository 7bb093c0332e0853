"""The gate-convention lab (seed 000): the same logits, experts and tokens under every convention.

Three tools, pure torch:

1. :func:`compare` runs each convention on identical logits, expert parameters, token order and
   capacity policy (dropless) in a seeded toy MoE, and records per convention the loss, the
   selected identities, the retained weight sums, the router- and expert-weight gradient norms,
   and the tokens whose router-gate gradient is exactly zero, with the cause of each zero.
2. :func:`gradcheck_router` checks router-logit gradients against central differences only where
   the difference cannot cross a membership change, and reports the selection change instead
   where it would.
3. :func:`two_logit_example`: the two-expert gate [0, w·x − 0.5], whose second probability is
   σ(w·x − 0.5) with gate derivative p(1 − p). It isolates the normalisation mechanism; it is
   not a sparse-training simulator.

``elastic-moe gates`` is :func:`configure_parser` + :func:`run`.

The toy MoE
-----------
x ``[T, D]`` tokens; router logits z = scale · x W_rᵀ with W_r ``[E, D]``; expert e is linear,
F_e(x) = x W_eᵀ with W_e ``[D, D]``; the layer output is y_t = Σ_{i∈S_t} w_ti F_i(x_t) and the
loss L = ½ · mean_t ‖y_t − target_t‖². There is no auxiliary loss, so the router learns only
through the gate weights: exactly the path seed 000 asks about. Every expert runs on every token
(dropless, no capacity limit); unselected experts get weight 0 and therefore no gradient.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from elastic_moe_plugin.core.gates import (
    CONVENTION_NAMES,
    get_convention,
    to_dense,
)
from elastic_moe_plugin.core.schedule import SAMPLING_MODES, BudgetSchedule

#: Why a token's router-gate gradient can be exactly zero, in the order the lab tests them.
ZERO_CAUSES: dict[str, str] = {
    "detached": (
        "detached tensor: the gate weights are not connected to the router logits (.detach(), no_grad "
        "or a copy), so no gradient can reach the router"
    ),
    "renormalized_top1": (
        "renormalised top-1: the single kept weight is p_a / p_a = 1 for any logits, so the gate "
        "carries no task gradient to the router (seed 000; Megatron rejects post-softmax top-1 for this)"
    ),
    "saturated": (
        "saturated probability: the gate probability is exactly 0 or 1 in this dtype, so its "
        "derivative p(1 - p) underflows to 0"
    ),
    "identical_outputs": (
        "identical expert outputs: every kept expert returns the same vector F, so y = (sum of kept "
        "weights) * F, and a normalised gate's sum (= 1) does not depend on the logits"
    ),
    "zero_output_grad": (
        "zero output gradient: dL/dy is exactly 0 for this token (its output already minimises the "
        "loss), so no weight receives gradient from it"
    ),
    "unexplained": "none of the known causes applies: please report this configuration",
}

#: Conventions whose weights sum to one over the kept set whenever κ_t > 1 (sigmoid: up to 1e-20).
_NORMALISED = frozenset({"renormalized", "selected_softmax", "sigmoid"})
#: Conventions that renormalise a single kept weight to the constant 1.
_NORMALISED_AT_TOP1 = frozenset({"renormalized", "selected_softmax"})

_DTYPES = {"float64": torch.float64, "float32": torch.float32}

#: gradcheck_router: default central-difference step (fp64), its ceiling as a share of the
#: smallest membership margin, and the smallest step still trusted against rounding.
DEFAULT_STEP = 1e-6
STEP_SHARE_OF_MARGIN = 0.25
MIN_STEP = 1e-8


# ======================================================================================== helpers
def _check_int(name: str, value: Any, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name}={value!r} is invalid: expected an integer >= {low}.")
    return value


def _finite(value: float) -> float | None:
    """A float for JSON: inf and NaN become None."""
    return float(value) if math.isfinite(value) else None


def _convention_names(conventions: Sequence[str] | str | None) -> tuple[str, ...]:
    if conventions is None:
        return CONVENTION_NAMES
    if isinstance(conventions, str):
        conventions = [c for c in conventions.replace(" ", "").split(",") if c]
    names = tuple(conventions)
    if not names:
        raise ValueError(f"--conventions is empty: expected a comma-separated subset of {', '.join(CONVENTION_NAMES)}.")
    for name in names:
        get_convention(name)  # raises naming the accepted values
    return names


def load_logits(path: str | Path) -> torch.Tensor:
    """Read user-supplied router logits ``[T, E]`` (a single row ``[E]`` is one token).

    Accepted files: ``.pt`` / ``.pth`` (a tensor, or a dict with a ``"logits"`` tensor; loaded
    with ``weights_only=True``), ``.npy`` (no pickles) and ``.json`` (a list of rows, or
    ``{"logits": [...]}``).

    Raises:
        ValueError: for a missing file, another extension, a non-numeric or non-finite array,
            or a shape other than ``[E]`` / ``[T, E]``.
    """
    file = Path(path)
    if not file.is_file():
        raise ValueError(f"--logits {str(path)!r}: no such file.")
    suffix = file.suffix.lower()
    if suffix not in (".pt", ".pth", ".npy", ".json"):
        raise ValueError(
            f"--logits {str(path)!r}: unsupported file type {suffix or '(none)'!r}; "
            f"expected .pt/.pth, .npy or .json."
        )
    try:
        if suffix == ".npy":
            import numpy

            data = torch.from_numpy(numpy.load(file, allow_pickle=False))
        elif suffix == ".json":
            data = json.loads(file.read_text())
        else:
            data = torch.load(file, map_location="cpu", weights_only=True)
    # Each reader fails its own way (pickle, zip, JSON, numpy errors): all are bad input here.
    except Exception as error:  # noqa: BLE001
        raise ValueError(f"--logits {str(path)!r}: could not read it ({error}).") from None
    if isinstance(data, dict):
        if "logits" not in data:
            raise ValueError(f"--logits {str(path)!r}: a mapping must hold the key 'logits', got {sorted(data)}.")
        data = data["logits"]
    try:
        logits = torch.as_tensor(data)
    except (TypeError, ValueError, RuntimeError) as error:
        raise ValueError(f"--logits {str(path)!r}: not a numeric array ({error}).") from None
    if logits.dim() == 1:
        logits = logits[None, :]
    if logits.dim() != 2 or logits.shape[0] < 1 or logits.shape[1] < 2:
        raise ValueError(
            f"--logits {str(path)!r}: expected shape [tokens, experts] with at least 2 experts, "
            f"got {tuple(logits.shape)}."
        )
    if logits.is_complex() or logits.dtype == torch.bool:
        raise ValueError(f"--logits {str(path)!r}: expected real numbers, got dtype {logits.dtype}.")
    logits = logits.to(torch.float64)
    if not torch.isfinite(logits).all():
        raise ValueError(f"--logits {str(path)!r}: every logit must be finite (found NaN or inf).")
    return logits


# ======================================================================================== compare
@dataclass
class _Toy:
    inputs: torch.Tensor  # [T, D]
    router_weight: torch.Tensor | None  # [E, D]; None with user-supplied logits
    expert_weight: torch.Tensor  # [E, D, D]
    targets: torch.Tensor  # [T, D]
    logits: torch.Tensor | None  # user-supplied [T, E], else None


def _build_toy(
    num_tokens: int, num_experts: int, hidden: int, generator: torch.Generator, dtype: torch.dtype,
    identical_experts: bool, logits: torch.Tensor | None,
) -> _Toy:
    # One draw order for every configuration, so a given seed always gives the same toy.
    inputs = torch.randn(num_tokens, hidden, generator=generator, dtype=torch.float64)
    router = torch.randn(num_experts, hidden, generator=generator, dtype=torch.float64) / math.sqrt(hidden)
    experts = torch.randn(num_experts, hidden, hidden, generator=generator, dtype=torch.float64) / math.sqrt(hidden)
    targets = torch.randn(num_tokens, hidden, generator=generator, dtype=torch.float64)
    if identical_experts:
        experts = experts[:1].expand_as(experts).clone()
    return _Toy(
        inputs.to(dtype),
        None if logits is not None else router.to(dtype),
        experts.to(dtype),
        targets.to(dtype),
        None if logits is None else logits.to(dtype),
    )


def _zero_cause(
    name: str, token: int, *, detached: bool, kept: int, weights: torch.Tensor, logits: torch.Tensor,
    kept_ids: torch.Tensor, expert_outputs: torch.Tensor, output_grad: torch.Tensor | None,
) -> str:
    """The first cause in ZERO_CAUSES order that explains token ``token``'s zero gate gradient."""
    if detached:
        return "detached"
    if name in _NORMALISED_AT_TOP1 and kept == 1:
        return "renormalized_top1"
    if name == "sigmoid":
        scores = torch.sigmoid(logits[token, kept_ids])
        if bool((scores * (1 - scores) == 0).all()):
            return "saturated"
    elif bool(weights[token, 0] == 1) and (name == "full_softmax" or kept > 1):
        return "saturated"
    outputs = expert_outputs[token, kept_ids]  # [kept, D]
    if kept > 1 and name in _NORMALISED and bool((outputs == outputs[:1]).all()):
        return "identical_outputs"
    if output_grad is not None and bool((output_grad[token] == 0).all()):
        return "zero_output_grad"
    return "unexplained"


def _run_convention(
    name: str, toy: _Toy, k: int | torch.Tensor, width: int, logit_scale: float, detach_gate: bool,
) -> dict[str, Any]:
    fn = get_convention(name)
    router = None if toy.router_weight is None else toy.router_weight.clone().requires_grad_()
    if router is None:
        logits = toy.logits.clone().requires_grad_()
    else:
        logits = (toy.inputs @ router.T) * logit_scale
        logits.retain_grad()
    experts = toy.expert_weight.clone().requires_grad_()
    expert_ids, weights = fn(logits, k, width=width)
    gate = weights.detach() if detach_gate else weights
    probs, routing_map = to_dense(expert_ids, gate, logits.shape[1])
    # Every expert on every token (dropless); an elementwise product + sum rather than a GEMM so
    # that identical experts give bitwise-identical outputs and gradients (exact zeros stay exact).
    expert_outputs = (toy.inputs[:, None, None, :] * experts[None]).sum(-1)  # [T, E, D]
    output = (probs.to(expert_outputs.dtype)[:, :, None] * expert_outputs).sum(1)  # [T, D]
    output.retain_grad()
    loss = 0.5 * ((output - toy.targets) ** 2).sum(-1).mean()
    loss.backward()

    num_tokens = logits.shape[0]
    logit_grad = logits.grad if logits.grad is not None else torch.zeros_like(logits)
    detached = logits.grad is None or not gate.requires_grad
    zero_tokens = (logit_grad == 0).all(-1)
    unselected_grad = ((logit_grad != 0) & ~routing_map).any(-1)
    kept_counts = (expert_ids >= 0).sum(-1)
    zeros = []
    for token in range(num_tokens):
        if not zero_tokens[token]:
            continue
        kept = int(kept_counts[token])
        cause = _zero_cause(
            name, token, detached=detached, kept=kept, weights=weights.detach(), logits=logits.detach(),
            kept_ids=expert_ids[token, :kept], expert_outputs=expert_outputs.detach(), output_grad=output.grad,
        )
        zeros.append({"token": token, "cause": cause})
    causes: dict[str, int] = {}
    for item in zeros:
        causes[item["cause"]] = causes.get(item["cause"], 0) + 1
    retained = weights.detach().sum(-1)
    return {
        "loss": float(loss.detach()),
        "selected": expert_ids.tolist(),
        "retained_weight_sum": {
            "mean": float(retained.mean()), "min": float(retained.min()), "max": float(retained.max()),
        },
        "router_grad_norm": None if router is None else float(router.grad.norm()) if router.grad is not None else 0.0,
        "logit_grad_norm": float(logit_grad.norm()),
        "expert_grad_norm": [float(g.norm()) for g in experts.grad],
        "zero_gate_grad_tokens": len(zeros),
        "unselected_logit_grad_tokens": int(unselected_grad.sum()),
        "zero_gate_grad": zeros,
        "zero_causes": causes,
        # For gradcheck: expert outputs projected on dL/dy, held fixed (the loss linearised at y).
        "_fixed_outputs": (output.grad[:, None, :] * expert_outputs.detach()).sum(-1),
        "_logits": logits.detach(),
    }


def compare(
    *,
    k: int = 1,
    schedule: str | None = None,
    sigma: float = 1.5,
    sampling: str = "iid",
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
    names = _convention_names(conventions)
    if isinstance(dtype, str):
        if dtype not in _DTYPES:
            raise ValueError(f"--dtype={dtype!r} is invalid: expected one of {', '.join(_DTYPES)}.")
        dtype = _DTYPES[dtype]
    if dtype not in _DTYPES.values():
        raise ValueError(f"dtype={dtype} is invalid: expected torch.float64 or torch.float32.")
    _check_int("--k", k, 1)
    _check_int("--hidden", hidden, 1)
    _check_int("--seed", seed, 0)
    if isinstance(logit_scale, bool) or not isinstance(logit_scale, (int, float)) or not math.isfinite(logit_scale):
        raise ValueError(f"--logit-scale={logit_scale!r} is invalid: expected a finite number.")
    if sampling not in SAMPLING_MODES:
        raise ValueError(f"--sampling={sampling!r} is invalid: expected one of {', '.join(SAMPLING_MODES)}.")
    if logits is not None:
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
        num_tokens, num_experts = logits.shape
        if logit_scale != 1.0:
            raise ValueError("--logit-scale only scales the toy router; it does not apply to --logits.")
    num_experts = _check_int("--experts", 8 if num_experts is None else num_experts, 2)
    num_tokens = _check_int("--tokens", 16 if num_tokens is None else num_tokens, 1)
    if k > num_experts:
        raise ValueError(f"--k={k} is invalid: expected 1 <= k <= --experts={num_experts}.")

    generator = torch.Generator().manual_seed(seed)
    toy = _build_toy(num_tokens, num_experts, hidden, generator, dtype, identical_experts, logits)
    if schedule is None:
        budget_schedule = BudgetSchedule.static(k)
        k_arg: int | torch.Tensor = k
    else:
        budget_schedule = BudgetSchedule.parse(schedule, center=k, sigma=sigma)
        budget_schedule.validate_for(num_experts, k)
        k_arg = budget_schedule.sample(num_tokens, mode=sampling, generator=generator)
    budgets = k_arg if isinstance(k_arg, torch.Tensor) else torch.full((num_tokens,), k, dtype=torch.long)
    width = budget_schedule.high

    results: dict[str, Any] = {}
    for name in names:
        results[name] = _run_convention(name, toy, k_arg, width, logit_scale, detach_gate)
        if gradcheck:
            check = gradcheck_router(
                name, results[name]["_logits"], budgets, expert_outputs=results[name]["_fixed_outputs"], step=step,
            )
            results[name]["gradcheck"] = {
                "status": check.status, "step": check.step, "max_abs_error": _finite(check.max_abs_error),
                "refused_tokens": [change.token for change in check.refused], "message": check.message,
            }
    for result in results.values():
        del result["_fixed_outputs"], result["_logits"]
    selections = [result["selected"] for result in results.values()]
    found = sorted({cause for result in results.values() for cause in result["zero_causes"]}, key=list(ZERO_CAUSES).index)
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
            "router": "user-supplied logits" if logits is not None else f"linear: logits = {logit_scale:g} * x @ W_router^T",
            "experts": "linear, identical weights" if identical_experts else "linear, independent weights",
            "gate_detached": detach_gate,
            "capacity_policy": "dropless (every selected token-expert pair is computed)",
            "loss": "0.5 * mean_t ||y_t - target_t||^2, no auxiliary loss",
        },
        "same_selection": all(s == selections[0] for s in selections),
        "conventions": results,
        "causes": {cause: ZERO_CAUSES[cause] for cause in found},
    }


def format_comparison(report: dict[str, Any], show_tokens: int = 8) -> str:
    """A fixed-width text table of :func:`compare`'s report."""
    setup, results = report["setup"], report["conventions"]
    schedule = "static"
    if setup["schedule"] != "static":
        schedule = f"elastic {setup['schedule']} (sigma={setup['sigma']:g}, {setup['sampling']})"
    lines = [
        (
            f"gates: T={setup['num_tokens']} tokens, E={setup['num_experts']} experts, "
            f"top-{setup['k']} {schedule}, seed={setup['seed']}, {setup['dtype']}"
        ),
        f"router: {setup['router']}; experts: {setup['experts']} (D={setup['hidden']})"
        + ("; gate DETACHED" if setup["gate_detached"] else ""),
        f"capacity: {setup['capacity_policy']}; loss: {setup['loss']}",
        "identical for every convention: logits, expert parameters, token order, budgets, capacity policy",
        "",
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

    shown = min(show_tokens, setup["num_tokens"])
    if shown > 0:
        lines += ["", f"selected experts, rank order (first {shown} of {setup['num_tokens']} tokens)"]
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

    lines += ["", "zero router-gate gradients"]
    if not any(r["zero_gate_grad_tokens"] for r in results.values()):
        lines.append("  none: every token passes gradient to its router logits under every convention")
    for name, r in results.items():
        if r["zero_gate_grad_tokens"]:
            counts = ", ".join(f"{cause} x{n}" for cause, n in r["zero_causes"].items())
            lines.append(f"  {name}: {r['zero_gate_grad_tokens']} token(s): {counts}")
    for cause, text in report["causes"].items():
        lines.append(f"  [{cause}] {text}")

    checks = {name: r["gradcheck"] for name, r in results.items() if "gradcheck" in r}
    if checks:
        lines += ["", "finite-difference check of dL/dz (expert outputs and dL/dy held fixed)"]
        for check in checks.values():
            lines += ["  " + line for line in check["message"].splitlines()]
    return "\n".join(line.rstrip() for line in lines)


# ===================================================================================== gradcheck
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
            "margins": [_finite(m) for m in self.margins.tolist()],
            "max_abs_error": _finite(self.max_abs_error),
            "atol": self.atol,
            "rtol": self.rtol,
            "checked_tokens": self.checked_tokens,
            "refused": [vars(change) for change in self.refused],
            "message": self.message,
        }


def _token_outputs(
    fn: Callable, logits: torch.Tensor, budgets: torch.Tensor, width: int, fixed: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """y_t = Σ_j w_tj · F[t, id_tj] with F held fixed; returns (y [T], expert_ids [T, width])."""
    expert_ids, weights = fn(logits, budgets, width=width)
    picked = torch.gather(fixed, 1, expert_ids.clamp_min(0))
    return (weights * picked).sum(-1), expert_ids


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
    (seed 000's scalar illustration). Steps, in float64:

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
    if isinstance(convention, str):
        name, fn = convention, get_convention(convention)
    elif callable(convention):
        name, fn = getattr(convention, "__name__", "convention"), convention
    else:
        raise TypeError(f"convention={convention!r} is invalid: expected a name in {CONVENTION_NAMES} or a function.")
    if not isinstance(logits, torch.Tensor) or logits.dim() not in (1, 2) or not logits.is_floating_point():
        raise ValueError("logits must be a floating-point tensor of shape [tokens, experts] (or [experts]).")
    z = logits.detach().to(torch.float64)
    z = z[None, :] if z.dim() == 1 else z
    if not torch.isfinite(z).all():
        raise ValueError("logits must be finite (found NaN or inf).")
    num_tokens, num_experts = z.shape
    if isinstance(k, torch.Tensor):
        budgets = k.detach().to(device=z.device, dtype=torch.long).reshape(-1)
        if budgets.shape != (num_tokens,):
            raise ValueError(f"k as a tensor must hold one budget per token, shape [{num_tokens}], got {tuple(k.shape)}.")
    else:
        _check_int("k", k, 1)
        budgets = torch.full((num_tokens,), k, dtype=torch.long, device=z.device)
    if num_tokens and not bool(((budgets >= 1) & (budgets <= num_experts)).all()):
        raise ValueError(f"budgets k must lie in 1..num_experts={num_experts}, got {budgets.tolist()}.")
    if expert_outputs is None:
        generator = torch.Generator().manual_seed(seed)
        fixed = torch.randn(num_tokens, num_experts, generator=generator, dtype=torch.float64).to(z.device)
    else:
        fixed = expert_outputs.detach().to(device=z.device, dtype=torch.float64)
        if fixed.shape == (num_experts,):
            fixed = fixed.expand(num_tokens, num_experts)
        if fixed.shape != (num_tokens, num_experts):
            raise ValueError(
                f"expert_outputs must be [tokens, experts] = [{num_tokens}, {num_experts}] or [experts], "
                f"got {tuple(expert_outputs.shape)}."
            )
    bad_step = isinstance(step, bool) or not isinstance(step, (int, float)) or not math.isfinite(step) or step <= 0
    if step is not None and bad_step:
        raise ValueError(f"--step={step!r} is invalid: expected a finite number > 0.")

    # 1. margins, from the logits' own ranking (a stable sort: ties keep index order).
    sorted_logits, order = torch.sort(z, dim=-1, descending=True, stable=True)
    gaps = sorted_logits[:, :-1] - sorted_logits[:, 1:]  # [T, E-1], gap between rank j and j+1
    ranks = torch.arange(1, num_experts, device=z.device)
    rank_margins = torch.where(ranks[None, :] <= budgets[:, None], gaps, torch.full_like(gaps, float("nan")))
    at_end = budgets >= num_experts
    boundary = (budgets - 1).clamp(max=num_experts - 2)[:, None]
    margins = torch.where(at_end, torch.full_like(z[:, 0], float("inf")), gaps.gather(1, boundary)[:, 0])
    width = int(budgets.max()) if num_tokens else 1
    base_outputs, base_ids = _token_outputs(fn, z, budgets, width, fixed)
    kept = torch.arange(width, device=z.device)[None, :] < budgets[:, None]
    by_logits = torch.where(kept, order[:, :width], torch.full_like(base_ids, -1))
    disagrees = (by_logits.sort(-1).values != base_ids.sort(-1).values).any(-1)
    margins = torch.where(disagrees, torch.zeros_like(margins), margins)

    # 2. the step, and 3. which tokens are refused.
    if step is None:
        trusted = margins >= MIN_STEP / STEP_SHARE_OF_MARGIN
        smallest = float(margins[trusted].min()) if bool(trusted.any()) else math.inf
        # κ = E tokens have no boundary (margin inf): they alone allow the default step.
        h = min(DEFAULT_STEP, STEP_SHARE_OF_MARGIN * smallest) if bool(trusted.any()) else None
        refused_mask = ~trusted
        probe = DEFAULT_STEP
        floor_note = (
            f"is below the floor {MIN_STEP / STEP_SHARE_OF_MARGIN:.0e} (any step small enough not to cross "
            f"would be lost in rounding)"
        )
    else:
        h = float(step)
        refused_mask = margins <= h
        probe = h
        floor_note = f"is <= the step {h:.3g}"

    # 4. analytic and numeric gradients.
    z_grad = z.clone().requires_grad_()
    outputs, _ = _token_outputs(fn, z_grad, budgets, width, fixed)
    outputs.sum().backward()
    analytic = z_grad.grad.detach()
    numeric = torch.full_like(z, float("nan"))
    if h is not None:
        for expert in range(num_experts):
            plus, minus = z.clone(), z.clone()
            plus[:, expert] += h
            minus[:, expert] -= h
            y_plus, _ = _token_outputs(fn, plus, budgets, width, fixed)
            y_minus, _ = _token_outputs(fn, minus, budgets, width, fixed)
            numeric[:, expert] = (y_plus - y_minus) / (2 * h)
    numeric[refused_mask] = float("nan")
    checked = (~refused_mask).nonzero().flatten().tolist() if h is not None else []
    errors = (analytic - numeric).abs()
    if checked:
        max_error = float(errors[checked].max())
        within = errors[checked] <= atol + rtol * numeric[checked].abs()
        bad_tokens = [checked[i] for i in (~within.all(-1)).nonzero().flatten().tolist()]
    else:
        max_error, bad_tokens = math.nan, []

    # Selection changes at refused tokens: evaluate at the perturbed logits and report what happened.
    changes = []
    for token in refused_mask.nonzero().flatten().tolist():
        budget = int(budgets[token])
        left, entered = int(order[token, budget - 1]), int(order[token, budget])
        before = set(base_ids[token, :budget].tolist())
        perturbed = z.clone()
        perturbed[token, entered] += probe
        y_after, ids_after = _token_outputs(fn, perturbed, budgets, width, fixed)
        after = set(ids_after[token, :budget].tolist())
        observed = after != before
        if observed:
            entered = next(iter(after - before))
            left = next(iter(before - after))
        changes.append(
            SelectionChange(
                token=token, budget=budget, margin=float(margins[token]), step=probe, left=left, entered=entered,
                observed=observed, output_jump=float(y_after[token] - base_outputs[token]),
                reason="is a tie" if float(margins[token]) == 0 else floor_note,
            )
        )

    status = "failed" if bad_tokens else "refused" if changes else "passed"
    if status == "passed":
        message = (
            f"{name}: passed on {len(checked)} token(s): autograd matches central differences "
            f"(step {h:.3g}, smallest kept/unkept margin {float(margins.min()):.3g}; max |error| {max_error:.3g})"
        )
    elif status == "failed":
        message = (
            f"{name}: FAILED on token(s) {bad_tokens}: autograd and central differences (step {h:.3g}) differ by up "
            f"to {max_error:.3g} > atol {atol:g} + rtol {rtol:g}·|numeric|"
        )
        if step is not None and step > DEFAULT_STEP:
            message += " (a central difference errs by O(step^2): retry with a smaller --step, or omit it)"
    else:
        head = (
            f"{name}: refused for {len(changes)} of {num_tokens} token(s): a step there would cross a rank "
            f"change, so no derivative is reported"
        )
        if checked:
            head += f"; the other {len(checked)} token(s) pass (step {h:.3g}, max |error| {max_error:.3g})"
        message = head
    if changes:
        message += "".join("\n  " + change.describe() for change in changes)
    return GradcheckResult(
        convention=name, status=status, step=h, margins=margins, rank_margins=rank_margins, analytic=analytic,
        numeric=numeric, max_abs_error=max_error, atol=atol, rtol=rtol, checked_tokens=checked, refused=changes,
        message=message,
    )


# ===================================================================================== two-logit
def two_logit_example(x: float = 1.0, w: float = 1.0) -> dict[str, Any]:
    """Seed 000's binary gate: logits [0, w·x − 0.5], p2 = σ(w·x − 0.5), dp2/dz2 = p2(1 − p2).

    x = 0.5, w = 1 gives p2 = 0.5 and 0.25 (and a tie: top-1 is ambiguous there); x = 1, w = 1
    gives p2 ≈ 0.6225 and ≈ 0.2350. Also reported: the chain-rule factors dp2/dw = x·p2(1 − p2)
    and dp2/dx = w·p2(1 − p2), and the top-1 gate weight of the selected expert under each
    convention with its derivative wrt both logits: full softmax passes p(1 − p) (and −p1·p2 to
    the other logit), renormalised top-1 passes exactly 0. All in float64, autograd next to the
    closed form.
    """
    for flag, value in (("--x", x), ("--w", w)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"{flag}={value!r} is invalid: expected a finite number.")
    x_t = torch.tensor(float(x), dtype=torch.float64, requires_grad=True)
    w_t = torch.tensor(float(w), dtype=torch.float64, requires_grad=True)
    z2 = w_t * x_t - 0.5
    z2.retain_grad()
    logits = torch.stack([torch.zeros_like(z2), z2])
    p2 = torch.softmax(logits, dim=0)[1]
    p2.backward()
    p = float(p2.detach())
    closed_p = 1.0 / (1.0 + math.exp(-(float(w) * float(x) - 0.5)))
    derivative = closed_p * (1.0 - closed_p)

    top1: dict[str, Any] = {}
    for name in CONVENTION_NAMES:
        gate_logits = logits.detach()[None, :].clone().requires_grad_()
        expert_ids, weights = get_convention(name)(gate_logits, 1)
        weights[0, 0].backward()
        top1[name] = {
            "selected": int(expert_ids[0, 0]),
            "weight": float(weights[0, 0].detach()),
            "dweight_dz1": float(gate_logits.grad[0, 0]),
            "dweight_dz2": float(gate_logits.grad[0, 1]),
        }
    return {
        "x": float(x),
        "w": float(w),
        "logits": [0.0, float(z2.detach())],
        "p2": p,
        "p2_closed": closed_p,
        "dp2_dz2": float(z2.grad),
        "dp2_dz2_closed": derivative,
        "dp2_dw": float(w_t.grad),
        "dp2_dw_closed": float(x) * derivative,
        "dp2_dx": float(x_t.grad),
        "dp2_dx_closed": float(w) * derivative,
        "tie": float(z2.detach()) == 0.0,
        "top1": top1,
    }


def format_two_logit(example: dict[str, Any]) -> str:
    """The text report of :func:`two_logit_example`."""
    e = example
    z2 = e["logits"][1]
    lines = [
        f"two-logit gate (seed 000): logits [0, w*x - 0.5] with x={e['x']:g}, w={e['w']:g} -> [0, {z2:g}]",
        f"  p2 = sigmoid(w*x - 0.5)          = {e['p2_closed']:.6f}   (softmax over both logits: {e['p2']:.6f})",
        f"  dp2/dz2 = p2 * (1 - p2)          = {e['dp2_dz2_closed']:.6f}   (autograd: {e['dp2_dz2']:.6f})",
        f"  dp2/dw  = x * p2 * (1 - p2)      = {e['dp2_dw_closed']:.6f}   (autograd: {e['dp2_dw']:.6f})",
        f"  dp2/dx  = w * p2 * (1 - p2)      = {e['dp2_dx_closed']:.6f}   (autograd: {e['dp2_dx']:.6f})",
        "",
    ]
    if e["tie"]:
        lines.append("top-1 on the same logits: a TIE (z1 = z2): the selected expert is ambiguous; derivatives below are")
        lines.append("  those of the branch torch.topk picked, and do not hold across the tie")
    else:
        chosen = next(iter(e["top1"].values()))["selected"]
        which = "second" if chosen == 1 else "first"
        lines.append(f"top-1 on the same logits: the {which} expert (logit z{chosen + 1}) is selected, margin {abs(z2):g}")
    lines.append(f"  {'convention':<18}{'weight':>10}{'dw/dz1':>11}{'dw/dz2':>11}")
    for name, r in e["top1"].items():
        lines.append(f"  {name:<18}{r['weight']:>10.6f}{r['dweight_dz1']:>11.6f}{r['dweight_dz2']:>11.6f}")
    lines += [
        "  full softmax passes p(1 - p) to the selected logit and -p1*p2 to the other; a renormalised",
        "  top-1 weight is the constant 1 and passes exactly 0 (seed 000).",
    ]
    return "\n".join(lines)


# =========================================================================================== CLI
def configure_parser(parser: argparse.ArgumentParser) -> None:
    """Add the flags of ``elastic-moe gates`` to ``parser``."""
    toy = parser.add_argument_group("toy MoE")
    toy.add_argument("--k", type=int, default=1, help="top-k, the schedule's center (default: 1)")
    toy.add_argument("--schedule", default=None, help="elastic budget schedule around k, e.g. '1-3' (default: static top-k)")
    toy.add_argument("--sigma", type=float, default=1.5, help="schedule sigma (default: 1.5)")
    toy.add_argument("--sampling", choices=SAMPLING_MODES, default="iid", help="budget sampling (default: iid)")
    toy.add_argument("--experts", type=int, default=None, help="number of experts E (default: 8, or from --logits)")
    toy.add_argument("--tokens", type=int, default=None, help="number of tokens T (default: 16, or from --logits)")
    toy.add_argument("--hidden", type=int, default=8, help="toy width D (default: 8)")
    toy.add_argument("--seed", type=int, default=0, help="seed of the toy and the budgets (default: 0)")
    toy.add_argument("--logits", metavar="FILE", default=None, help="user-supplied router logits [T, E]: .pt, .npy or .json")
    toy.add_argument(
        "--conventions", default=None, metavar="LIST",
        help=f"comma-separated subset of {','.join(CONVENTION_NAMES)} (default: all)",
    )
    toy.add_argument("--identical-experts", action="store_true", help="give every expert the same weights")
    toy.add_argument("--logit-scale", type=float, default=1.0, help="scale the toy router's logits (large = saturated)")
    toy.add_argument("--detach-gate", action="store_true", help="detach the gate weights (shows the 'detached tensor' cause)")
    toy.add_argument("--dtype", choices=tuple(_DTYPES), default="float64", help="compute dtype (default: float64)")
    toy.add_argument("--gradcheck", action="store_true", help="also run the boundary-aware finite-difference check")
    toy.add_argument("--step", type=float, default=None, help="finite-difference step for --gradcheck (default: from the margins)")
    toy.add_argument("--show-tokens", type=int, default=8, help="tokens whose selection the table lists (default: 8)")
    example = parser.add_argument_group("two-logit example")
    example.add_argument("--two-logit", action="store_true", help="the worked example: logits [0, w*x - 0.5]")
    example.add_argument("--x", type=float, default=None, help="input x of the two-logit example (default: 1)")
    example.add_argument("--w", type=float, default=None, help="weight w of the two-logit example (default: 1)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def _execute(args: argparse.Namespace) -> str:
    if args.two_logit:
        example = two_logit_example(1.0 if args.x is None else args.x, 1.0 if args.w is None else args.w)
        return json.dumps(example, indent=2) if args.json else format_two_logit(example)
    if args.x is not None or args.w is not None:
        raise ValueError("--x and --w set the two-logit example: add --two-logit, or drop them.")
    if args.show_tokens < 0:
        raise ValueError(f"--show-tokens={args.show_tokens} is invalid: expected an integer >= 0.")
    report = compare(
        k=args.k, schedule=args.schedule, sigma=args.sigma, sampling=args.sampling,
        num_experts=args.experts, num_tokens=args.tokens, hidden=args.hidden, seed=args.seed,
        conventions=args.conventions, logits=None if args.logits is None else load_logits(args.logits),
        identical_experts=args.identical_experts, logit_scale=args.logit_scale, detach_gate=args.detach_gate,
        dtype=args.dtype, gradcheck=args.gradcheck, step=args.step,
    )
    if args.logits is not None:
        report["setup"]["router"] = f"user-supplied logits from {args.logits}"
    return json.dumps(report, indent=2) if args.json else format_comparison(report, args.show_tokens)


def run(args: argparse.Namespace) -> int:
    """``elastic-moe gates``: print the table (or JSON); bad input -> message on stderr, exit 2."""
    try:
        print(_execute(args))
    except ValueError as error:
        print(f"elastic-moe gates: error: {error}", file=sys.stderr)
        return 2
    return 0
