"""Gradient clipping by total norm for megatron-core's optimizer on a CPU-only torch.

megatron-core's ``clip_grad_by_total_norm_fp32`` (``megatron/core/optimizer/clip_grads.py``, 0.16.1
and 0.19.2) asserts ``param.grad.type() == 'torch.cuda.FloatTensor'`` for every gradient it scales,
so on CPU any ``clip_grad > 0`` fails at the first optimizer step. ``clip_grad = 0`` avoids the
assertion but also skips the norm: the optimizer then reports ``grad_norm = 0.0``, and a test or a
rehearsal cannot compare norms. With :func:`enable` the optimizer module's name
``clip_grad_by_total_norm_fp32`` (looked up when ``MegatronOptimizer.clip_grad_norm`` runs) answers
with :func:`clip_by_total_norm`, the same operation on host tensors:

    g <- g · min(1, max_norm / (total_norm + 1e-6))     for every gradient g,

with ``total_norm`` the norm megatron-core's own ``get_grad_norm_fp32`` computed (unchanged, so the
logged ``grad_norm`` is megatron-core's). Nothing else of the optimizer is replaced.

Part of the opt-in CPU runtime (:mod:`elastic_moe_plugin.cpu_runtime`); a GPU run never loads it.
"""

from __future__ import annotations

import types
from collections.abc import Iterable

import torch

from elastic_moe_plugin.core.patching import AttributePatches, PatchSwitch

__all__ = ["OPTIMIZER_MODULE", "clip_by_total_norm", "disable", "enable", "is_enabled"]

#: the module whose global ``clip_grad_by_total_norm_fp32`` ``MegatronOptimizer.clip_grad_norm`` calls
OPTIMIZER_MODULE = "megatron.core.optimizer.optimizer"
_EPSILON = 1.0e-6  # megatron-core's: max_norm / (total_norm + 1e-6)


def clip_by_total_norm(
    parameters: Iterable[torch.Tensor] | torch.Tensor,
    max_norm: float,
    total_norm: float | torch.Tensor,
    use_decoupled_grad: bool = False,
) -> None:
    """Scale every gradient of ``parameters`` in place by ``min(1, max_norm / (total_norm + 1e-6))``.

    The signature of megatron-core's ``clip_grad_by_total_norm_fp32``; ``use_decoupled_grad`` reads
    ``param.decoupled_grad`` instead of ``param.grad``. A tensor ``total_norm`` stays a tensor (no
    host read), as megatron-core's tensor path keeps it.
    """
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    attribute = "decoupled_grad" if use_decoupled_grad else "grad"
    grads = [getattr(param, attribute) for param in parameters]
    grads = [_local(grad).detach() for grad in grads if grad is not None]
    if not grads:
        return
    coefficient = max_norm / (total_norm + _EPSILON)
    if isinstance(coefficient, torch.Tensor):
        torch._foreach_mul_(grads, coefficient.clamp(max=1.0).to(grads[0].device))
    elif coefficient < 1.0:
        torch._foreach_mul_(grads, coefficient)


def _local(grad: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor gradient (Megatron-FSDP), else the tensor itself."""
    to_local = getattr(grad, "to_local", None)
    return to_local() if callable(to_local) else grad


def _install(patches: AttributePatches) -> None:
    def redirect(module: types.ModuleType) -> None:
        if hasattr(module, "clip_grad_by_total_norm_fp32"):
            patches.set(module, "clip_grad_by_total_norm_fp32", clip_by_total_norm)

    patches.when_imported(OPTIMIZER_MODULE, redirect)


_SWITCH = PatchSwitch(_install)


def enable() -> None:
    """Redirect megatron-core's optimizer to :func:`clip_by_total_norm` (idempotent; before or after
    ``megatron.core.optimizer`` is imported)."""
    _SWITCH.on()


def disable() -> None:
    """Restore megatron-core's ``clip_grad_by_total_norm_fp32`` by identity (idempotent)."""
    _SWITCH.off()


def is_enabled() -> bool:
    """Whether the redirect is installed."""
    return _SWITCH.is_on
