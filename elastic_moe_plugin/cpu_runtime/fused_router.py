"""Transformer Engine's fused MoE router functions, computed on the CPU by megatron-core's own
unfused code: what ``moe_router_fusion=True`` (``--moe-router-fusion``) calls, where TE is absent.

With ``moe_router_fusion`` megatron-core's ``TopKRouter`` routes through three functions that
``megatron.core.transformer.moe.moe_utils`` binds at import from ``transformer_engine.pytorch.router``
(through ``megatron.core.extensions.transformer_engine``), each called only behind
``if not HAVE_TE or <name> is None: raise ValueError(...)``:

==========================================  =================================================
``moe_utils`` name (TE's kernel)            stand-in: megatron-core's unfused twin
==========================================  =================================================
``fused_topk_with_score_function``          ``topk_routing_with_score_function(..., fused=False)``
``fused_compute_score_for_moe_aux_loss``    ``compute_routing_scores_for_aux_loss(..., fused=False)``
``fused_moe_aux_loss``                      ``switch_load_balancing_loss_func(..., fused=False)``
==========================================  =================================================

Without TE, megatron-core 0.19 binds all three to ``None`` and 0.16 leaves them undefined, so a
fused router cannot run on the CPU at all. :func:`install` (every ``cpu_runtime.enable()``, through
:func:`.megatron_core.install`) sets the three names to the stand-ins below and ``moe_utils.HAVE_TE``
to True, and sets to ``None`` (TE absent, the value megatron-core's own checks test for) the other
TE-bound names 0.16 leaves undefined (``fused_permute`` and kin), so that their ``HAVE_TE or``
guards still raise megatron-core's own "not available" error. ``disable()`` restores every name
by identity. Nothing is installed where TE's fused router is present (a GPU machine with TE): the
real kernels run.

Each stand-in takes TE's keywords and returns what TE's kernel returns, computed exactly as the
unfused path (so a fused static layer equals the unfused one bit for bit here, which TE's kernels
only approximate). Not covered: ``score_function="sqrtsoftplus"``, whose fused path first asks
``is_te_min_version("2.13.0")``, which needs TE itself.
"""

from __future__ import annotations

import types
from typing import Any

from elastic_moe_plugin.core.patching import MISSING, AttributePatches

MOE_UTILS_MODULE = "megatron.core.transformer.moe.moe_utils"
#: the fused router functions ``moe_utils`` binds from Transformer Engine
FUSED_ROUTER_FUNCTIONS = (
    "fused_topk_with_score_function",
    "fused_compute_score_for_moe_aux_loss",
    "fused_moe_aux_loss",
)
#: the other TE-bound names whose ``not HAVE_TE or name is None`` guard must keep raising
_OTHER_TE_NAMES = (
    "fused_permute",
    "fused_permute_and_pad_with_probs",
    "fused_permute_with_probs",
    "fused_sort_chunks_by_index",
    "fused_sort_chunks_by_index_with_probs",
    "fused_unpermute",
)
#: set on each stand-in (tests and diagnostics tell it from TE's kernel by it)
STAND_IN_MARKER = "__cpu_runtime_stand_in__"


def _moe_utils() -> types.ModuleType:
    from megatron.core.transformer.moe import moe_utils

    return moe_utils


def fused_topk_with_score_function(
    logits: Any,
    topk: int,
    use_pre_softmax: bool = False,
    num_groups: int | None = None,
    group_topk: int | None = None,
    scaling_factor: float | None = None,
    score_function: str = "softmax",
    expert_bias: Any = None,
) -> tuple[Any, Any]:
    """TE's ``fused_topk_with_score_function``: ``(probs [T, E], routing_map [T, E] bool)``."""
    return _moe_utils().topk_routing_with_score_function(
        logits,
        topk,
        use_pre_softmax=use_pre_softmax,
        num_groups=num_groups,
        group_topk=group_topk,
        scaling_factor=scaling_factor,
        score_function=score_function,
        expert_bias=expert_bias,
        fused=False,
    )


def fused_compute_score_for_moe_aux_loss(logits: Any, topk: int, score_function: str) -> tuple[Any, Any]:
    """TE's ``fused_compute_score_for_moe_aux_loss``: ``(routing_map [T, E], scores [T, E])``."""
    return _moe_utils().compute_routing_scores_for_aux_loss(logits, topk, score_function, fused=False)


def fused_moe_aux_loss(
    probs: Any, tokens_per_expert: Any, total_num_tokens: Any, topk: Any, num_experts: int, coeff: float
) -> Any:
    """TE's ``fused_moe_aux_loss``: the switch load-balancing loss (a scalar tensor)."""
    return _moe_utils().switch_load_balancing_loss_func(
        probs=probs,
        tokens_per_expert=tokens_per_expert,
        total_num_tokens=total_num_tokens,
        topk=topk,
        num_experts=num_experts,
        moe_aux_loss_coeff=coeff,
        fused=False,
    )


STAND_INS = {
    "fused_topk_with_score_function": fused_topk_with_score_function,
    "fused_compute_score_for_moe_aux_loss": fused_compute_score_for_moe_aux_loss,
    "fused_moe_aux_loss": fused_moe_aux_loss,
}
for _stand_in in STAND_INS.values():
    setattr(_stand_in, STAND_IN_MARKER, True)


def _install_into(patches: AttributePatches, module: types.ModuleType) -> None:
    if any(getattr(module, name, None) is not None for name in FUSED_ROUTER_FUNCTIONS):
        return  # Transformer Engine's fused router is there: its kernels run
    for name in _OTHER_TE_NAMES:
        if vars(module).get(name, MISSING) is MISSING:
            patches.set(module, name, None)
    for name, stand_in in STAND_INS.items():
        patches.set(module, name, stand_in)
    if not getattr(module, "HAVE_TE", False):
        patches.set(module, "HAVE_TE", True)


def install(patches: AttributePatches) -> None:
    """Install the stand-ins into ``moe_utils`` now, or right after its import (module docstring)."""
    patches.when_imported(MOE_UTILS_MODULE, lambda module: _install_into(patches, module))


def is_stand_in(function: Any) -> bool:
    """Whether ``function`` is one of these stand-ins (not TE's kernel)."""
    return bool(getattr(function, STAND_IN_MARKER, False))


__all__ = [
    "FUSED_ROUTER_FUNCTIONS",
    "MOE_UTILS_MODULE",
    "STAND_INS",
    "fused_compute_score_for_moe_aux_loss",
    "fused_moe_aux_loss",
    "fused_topk_with_score_function",
    "install",
    "is_stand_in",
]
