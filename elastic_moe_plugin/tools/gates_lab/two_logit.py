"""The worked example of docs/gates.md#the-two-logit-worked-example: the two-expert gate with logits [0, w·x − 0.5].

Softmax over the two logits gives the second probability p2 = σ(w·x − 0.5), and by the chain rule

    dp2/dz2 = p2 (1 − p2),    dp2/dw = x · p2 (1 − p2),    dp2/dx = w · p2 (1 − p2).

Under top-1 the selected expert's weight passes p(1 − p) to its own logit and −p1·p2 to the
other with ``full_softmax``, and exactly 0 with a renormalised gate (its single weight is the
constant 1). The example isolates the normalisation mechanism; it is not a sparse-training
simulator.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from elastic_moe_plugin.core.routing import score
from elastic_moe_plugin.tools.gates_lab.conventions import CONVENTION_NAMES, get_convention


def two_logit_example(x: float = 1.0, w: float = 1.0) -> dict[str, Any]:
    """The binary gate of docs/gates.md#the-two-logit-worked-example: logits [0, w·x − 0.5],
    p2 = σ(w·x − 0.5), dp2/dz2 = p2(1 − p2).

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
    p2 = score(logits, "softmax", logits.dtype)[1]
    p2.backward()
    z2_grad, w_grad, x_grad = z2.grad, w_t.grad, x_t.grad
    assert z2_grad is not None and w_grad is not None and x_grad is not None  # p2.backward() filled them
    closed_p = 1.0 / (1.0 + math.exp(-(float(w) * float(x) - 0.5)))
    derivative = closed_p * (1.0 - closed_p)
    return {
        "x": float(x),
        "w": float(w),
        "logits": [0.0, float(z2.detach())],
        "p2": float(p2.detach()),
        "p2_closed": closed_p,
        "dp2_dz2": float(z2_grad),
        "dp2_dz2_closed": derivative,
        "dp2_dw": float(w_grad),
        "dp2_dw_closed": float(x) * derivative,
        "dp2_dx": float(x_grad),
        "dp2_dx_closed": float(w) * derivative,
        "tie": float(z2.detach()) == 0.0,
        "top1": _top1_gates(logits.detach()),
    }


def _top1_gates(logits: torch.Tensor) -> dict[str, dict[str, Any]]:
    """Per convention, top-1 on ``logits [2]``: the selected expert, its weight and d weight / d z1, z2."""
    top1: dict[str, Any] = {}
    for name in CONVENTION_NAMES:
        gate_logits = logits[None, :].clone().requires_grad_()
        expert_ids, weights = get_convention(name)(gate_logits, 1)
        weights[0, 0].backward()
        grad = gate_logits.grad
        assert grad is not None  # a leaf that requires grad: backward() filled it
        top1[name] = {
            "selected": int(expert_ids[0, 0]),
            "weight": float(weights[0, 0].detach()),
            "dweight_dz1": float(grad[0, 0]),
            "dweight_dz2": float(grad[0, 1]),
        }
    return top1


def format_two_logit(example: dict[str, Any]) -> str:
    """The text report of :func:`two_logit_example`."""
    e = example
    z2 = e["logits"][1]
    lines = [
        f"two-logit gate (docs/gates.md#the-two-logit-worked-example): logits [0, w*x - 0.5] "
        f"with x={e['x']:g}, w={e['w']:g} -> [0, {z2:g}]",
        f"  p2 = sigmoid(w*x - 0.5)          = {e['p2_closed']:.6f}   (softmax over both logits: {e['p2']:.6f})",
        f"  dp2/dz2 = p2 * (1 - p2)          = {e['dp2_dz2_closed']:.6f}   (autograd: {e['dp2_dz2']:.6f})",
        f"  dp2/dw  = x * p2 * (1 - p2)      = {e['dp2_dw_closed']:.6f}   (autograd: {e['dp2_dw']:.6f})",
        f"  dp2/dx  = w * p2 * (1 - p2)      = {e['dp2_dx_closed']:.6f}   (autograd: {e['dp2_dx']:.6f})",
        "",
    ]
    if e["tie"]:
        lines.append(
            "top-1 on the same logits: a TIE (z1 = z2): the selected expert is ambiguous; derivatives below are"
        )
        lines.append("  those of the branch torch.topk picked, and do not hold across the tie")
    else:
        chosen = next(iter(e["top1"].values()))["selected"]
        which = "second" if chosen == 1 else "first"
        lines.append(
            f"top-1 on the same logits: the {which} expert (logit z{chosen + 1}) is selected, margin {abs(z2):g}"
        )
    lines.append(f"  {'convention':<18}{'weight':>10}{'dw/dz1':>11}{'dw/dz2':>11}")
    for name, r in e["top1"].items():
        lines.append(f"  {name:<18}{r['weight']:>10.6f}{r['dweight_dz1']:>11.6f}{r['dweight_dz2']:>11.6f}")
    lines += [
        "  full softmax passes p(1 - p) to the selected logit and -p1*p2 to the other; a renormalised",
        "  top-1 weight is the constant 1 and passes exactly 0 (docs/gates.md#gate-conventions).",
    ]
    return "\n".join(lines)
