"""The lab's seeded toy MoE: one forward and backward pass under one gate convention, and the
cause of every exactly-zero router-gate gradient it shows.

x ``[T, D]`` tokens; router logits z = scale · x W_rᵀ with W_r ``[E, D]`` (or user-supplied z
``[T, E]``); expert e is linear, F_e(x) = x W_eᵀ with W_e ``[D, D]``; the layer output is
y_t = Σ_{i∈S_t} w_ti F_i(x_t) and the loss L = ½ · mean_t ‖y_t − target_t‖². There is no
auxiliary loss, so the router learns only through the gate weights: exactly the path docs/gates.md#gate-conventions
asks about. Every expert runs on every token (dropless, no capacity limit); unselected experts
get weight 0 and therefore no gradient.

With g_te = ⟨∂L/∂y_t, F_e(x_t)⟩ and ḡ_t = Σ_{i∈S_t} w_ti g_ti, the router-gate gradient is
∂L/∂z_tj = p_tj (g_tj·[j∈S_t] − ḡ_t) under ``full_softmax`` (unselected logits included, through
the denominator) and w_tj (g_tj − ḡ_t) on S_t, 0 off it, under ``renormalized`` /
``selected_softmax``: exactly 0 at κ_t = 1 (w = 1) and when every kept expert returns the same
output. :data:`ZERO_CAUSES` lists every cause of an exact zero the lab tells apart.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from elastic_moe_plugin.core.routing import score
from elastic_moe_plugin.tools.gates_lab.conventions import get_convention, to_dense

#: Why a token's router-gate gradient can be exactly zero, in the order the lab tests them.
ZERO_CAUSES: dict[str, str] = {
    "detached": (
        "detached tensor: the gate weights are not connected to the router logits (.detach(), no_grad "
        "or a copy), so no gradient can reach the router"
    ),
    "renormalized_top1": (
        "renormalised top-1: the single kept weight is p_a / p_a = 1 for any logits, so the gate "
        "carries no task gradient to the router (docs/gates.md#gate-conventions; "
        "Megatron rejects post-softmax top-1 for this)"
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


@dataclass
class _Toy:
    inputs: torch.Tensor  # [T, D]
    router_weight: torch.Tensor | None  # [E, D]; None with user-supplied logits
    expert_weight: torch.Tensor  # [E, D, D]
    targets: torch.Tensor  # [T, D]
    logits: torch.Tensor | None  # user-supplied [T, E], else None


@dataclass
class _Pass:
    """One convention's forward pass through the toy, after ``loss.backward()``."""

    loss: torch.Tensor  # []
    logits: torch.Tensor  # [T, E]; .grad is None when the gate is cut off from them
    router: torch.Tensor | None  # [E, D] leaf; None with user-supplied logits
    experts: torch.Tensor  # [E, D, D] leaf
    expert_ids: torch.Tensor  # [T, width], -1 in unused slots
    weights: torch.Tensor  # [T, width]
    detached: bool  # the gate weights carry no graph to the logits
    routing_map: torch.Tensor  # [T, E] bool
    expert_outputs: torch.Tensor  # [T, E, D], every expert on every token
    output: torch.Tensor  # [T, D]; .grad = dL/dy


def _build_toy(
    num_tokens: int,
    num_experts: int,
    hidden: int,
    generator: torch.Generator,
    dtype: torch.dtype,
    identical_experts: bool,
    logits: torch.Tensor | None,
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
    name: str,
    token: int,
    *,
    detached: bool,
    kept: int,
    weights: torch.Tensor,
    logits: torch.Tensor,
    kept_ids: torch.Tensor,
    expert_outputs: torch.Tensor,
    output_grad: torch.Tensor | None,
) -> str:
    """The first cause in ZERO_CAUSES order that explains token ``token``'s zero gate gradient."""
    if detached:
        return "detached"
    if name in _NORMALISED_AT_TOP1 and kept == 1:
        return "renormalized_top1"
    if name == "sigmoid":
        scores = score(logits[token, kept_ids], "sigmoid", logits.dtype)
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


def _forward_backward(
    name: str,
    toy: _Toy,
    k: int | torch.Tensor,
    width: int,
    logit_scale: float,
    detach_gate: bool,
) -> _Pass:
    router = None if toy.router_weight is None else toy.router_weight.clone().requires_grad_()
    if router is None:
        assert toy.logits is not None  # a toy without router weights holds the user's logits
        logits = toy.logits.clone().requires_grad_()
    else:
        logits = (toy.inputs @ router.T) * logit_scale
        logits.retain_grad()
    experts = toy.expert_weight.clone().requires_grad_()
    expert_ids, weights = get_convention(name)(logits, k, width=width)
    gate = weights.detach() if detach_gate else weights
    probs, routing_map = to_dense(expert_ids, gate, logits.shape[1])
    # Every expert on every token (dropless); an elementwise product + sum rather than a GEMM so
    # that identical experts give bitwise-identical outputs and gradients (exact zeros stay exact).
    expert_outputs = (toy.inputs[:, None, None, :] * experts[None]).sum(-1)  # [T, E, D]
    output = (probs.to(expert_outputs.dtype)[:, :, None] * expert_outputs).sum(1)  # [T, D]
    output.retain_grad()
    loss = 0.5 * ((output - toy.targets) ** 2).sum(-1).mean()
    loss.backward()
    return _Pass(
        loss=loss,
        logits=logits,
        router=router,
        experts=experts,
        expert_ids=expert_ids,
        weights=weights,
        detached=logits.grad is None or not gate.requires_grad,
        routing_map=routing_map,
        expert_outputs=expert_outputs,
        output=output,
    )


def _zero_gate_grad_tokens(name: str, run: _Pass, logit_grad: torch.Tensor) -> list[dict[str, Any]]:
    """``[{token, cause}]`` for every token whose router-gate gradient ``logit_grad [T, E]`` is exactly 0."""
    zero_tokens = (logit_grad == 0).all(-1)
    kept_counts = (run.expert_ids >= 0).sum(-1)
    zeros = []
    for token in range(logit_grad.shape[0]):
        if not zero_tokens[token]:
            continue
        kept = int(kept_counts[token])
        cause = _zero_cause(
            name,
            token,
            detached=run.detached,
            kept=kept,
            weights=run.weights.detach(),
            logits=run.logits.detach(),
            kept_ids=run.expert_ids[token, :kept],
            expert_outputs=run.expert_outputs.detach(),
            output_grad=run.output.grad,
        )
        zeros.append({"token": token, "cause": cause})
    return zeros


def _run_convention(
    name: str,
    toy: _Toy,
    k: int | torch.Tensor,
    width: int,
    logit_scale: float,
    detach_gate: bool,
) -> dict[str, Any]:
    """One convention on the toy: what it selects, keeps and passes back to the router and experts."""
    run = _forward_backward(name, toy, k, width, logit_scale, detach_gate)
    logit_grad = run.logits.grad if run.logits.grad is not None else torch.zeros_like(run.logits)
    zeros = _zero_gate_grad_tokens(name, run, logit_grad)
    causes: dict[str, int] = {}
    for item in zeros:
        causes[item["cause"]] = causes.get(item["cause"], 0) + 1
    unselected_grad = ((logit_grad != 0) & ~run.routing_map).any(-1)
    retained = run.weights.detach().sum(-1)
    experts_grad, output_grad = run.experts.grad, run.output.grad
    assert experts_grad is not None and output_grad is not None  # a leaf and a retained grad: backward() filled them
    router_grad_norm = None
    if run.router is not None:
        router_grad_norm = float(run.router.grad.norm()) if run.router.grad is not None else 0.0
    return {
        "loss": float(run.loss.detach()),
        "selected": run.expert_ids.tolist(),
        "retained_weight_sum": {
            "mean": float(retained.mean()),
            "min": float(retained.min()),
            "max": float(retained.max()),
        },
        "router_grad_norm": router_grad_norm,
        "logit_grad_norm": float(logit_grad.norm()),
        "expert_grad_norm": [float(g.norm()) for g in experts_grad],
        "zero_gate_grad_tokens": len(zeros),
        "unselected_logit_grad_tokens": int(unselected_grad.sum()),
        "zero_gate_grad": zeros,
        "zero_causes": causes,
        # For gradcheck: expert outputs projected on dL/dy, held fixed (the loss linearised at y).
        "_fixed_outputs": (output_grad[:, None, :] * run.expert_outputs.detach()).sum(-1),
        "_logits": run.logits.detach(),
    }
