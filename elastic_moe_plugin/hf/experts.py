"""Expert compute that follows κ: the experts side of an elastic transformers MoE layer.

An elastic router (:func:`.routing.elastic_routing`) returns b candidate slots per token (b = the
schedule's high budget): real expert ids, and a weight of exactly 0 in every slot j >= κ_t. It marks
its ``top_k_index`` tensor with the kept-slot mask (:func:`mark_kept_slots`). The patched
``<Family>Experts.forward`` (:func:`experts_forward`) looks the mark up and has the active experts
implementation multiply only the Σ_t κ_t kept (token, expert) rows:

==============  ========================================================================  ===============
implementation  what runs for a marked call                                               syncs added
==============  ========================================================================  ===============
``eager``       transformers' own loop, with the sentinel id E (= ``num_experts``) in       +1 (the loop's
                the unkept slots: the loop skips expert E                                 test of E)
``grouped_mm``  transformers' ``grouped_mm_experts_forward`` with its expert-parallel      0
                sentinel handling switched on for the call: ids E sort to the tail,
                ``histc(max=E-1)`` leaves them out of the offsets, the grouped GEMM
                stops at ``offsets[-1]`` = Σκ, and one pre-mask and two post-masks keep
                the tail rows (left uninitialised by the kernel) out of the output and
                of every gradient
``batched_mm``  compaction: the P = Σκ kept pairs become a top-1 problem of P rows for      iid: 1 (P is
                transformers' ``batched_mm_experts_forward`` (which has no offsets and     read by
                multiplies every row it gets); each pair's output goes back to its slot   ``nonzero``);
                of a zero ``[T, b, H]`` buffer, summed per token as stock sums its slots  balanced: 0
                                                                                          (P = T·k)
other           the stock implementation over every slot (the unkept ones weigh 0):       0
                correct, b/k of the compute; logged once per implementation
==============  ========================================================================  ===============

A call without a mark (eval mode, static layers, ``schedule="static"``, a router that is not
patched, or a block that rebuilt the index tensor) runs the stock forward untouched, bit for bit.
The implementation is read from ``experts.config._experts_implementation`` at every call, so
``from_pretrained(..., experts_implementation=...)``, ``model.set_experts_implementation(...)`` and
ms-swift's ``--experts_impl`` all apply, before or after :func:`elastic_moe_plugin.hf.apply`.

Shapes: T = tokens of the call, b = slots per token, H = hidden size, E = ``experts.num_experts``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
from collections.abc import Callable, Iterator

import torch
from torch.utils.weak import WeakIdKeyDictionary

logger = logging.getLogger("elastic_moe_plugin.hf")


@dataclasses.dataclass(frozen=True)
class KeptSlots:
    """What an elastic router dispatched in one call, attached to its ``top_k_index`` tensor.

    Attributes:
        kept: ``BoolTensor[T, b]``, slot j of token t kept iff j < κ_t.
        pair_count: Σ_t κ_t when the host knows it without a sync (``sampling="balanced"``:
            exactly T·k), else None.
    """

    kept: torch.Tensor
    pair_count: int | None


#: top_k_index tensor → its KeptSlots. Keyed by identity and weakly: the mark dies with the tensor,
#: and a tensor the MoE block rebuilt is unmarked (the stock forward then computes every slot).
_MARKS: WeakIdKeyDictionary = WeakIdKeyDictionary()
_warned_implementations: set[str] = set()


def mark_kept_slots(top_k_index: torch.Tensor, kept: torch.Tensor, pair_count: int | None) -> None:
    """Tell the experts that slots of ``top_k_index`` [T, b] outside ``kept`` [T, b] must not be computed."""
    _MARKS[top_k_index] = KeptSlots(kept=kept, pair_count=pair_count)


def kept_slots(top_k_index: torch.Tensor) -> KeptSlots | None:
    """The mark of an elastic router's ``top_k_index``, or None (stock routing)."""
    return _MARKS.get(top_k_index)


# ------------------------------------------------------------------------------ the patched forward
def experts_forward(original: Callable) -> Callable:
    """Replacement of a covered ``<Family>Experts.forward`` (transformers' implementation dispatcher).

    ``original`` is the stock dispatcher installed by ``@use_experts_implementation``; it runs
    whenever the call carries no mark, and for implementations this module does not know.
    """

    @functools.wraps(original)
    def forward(self, hidden_states, top_k_index, top_k_weights, *args, **kwargs):
        slots = kept_slots(top_k_index) if not (args or kwargs) else None
        if slots is None:
            return original(self, hidden_states, top_k_index, top_k_weights, *args, **kwargs)
        compute = _kappa_compute(self)
        if compute is None:
            return original(self, hidden_states, top_k_index, top_k_weights)
        return compute(self, original, hidden_states, top_k_index, top_k_weights, slots)

    return forward


def _kappa_compute(experts: torch.nn.Module) -> Callable | None:
    """The κ-following compute for the experts' current implementation, or None (stock, all slots)."""
    from transformers.integrations import moe

    implementation = getattr(getattr(experts, "config", None), "_experts_implementation", None)
    # Dispatch on the function transformers would run, not on the name: a library may register its
    # own "grouped_mm" in the ExpertsInterface, and that one need not honour the sentinel.
    registered = moe.ALL_EXPERTS_FUNCTIONS.get(implementation) if implementation is not None else None
    if implementation == "eager" and registered is None:
        return _eager
    if registered is moe.grouped_mm_experts_forward:
        return _grouped_mm
    if registered is moe.batched_mm_experts_forward:
        return _batched_mm
    if implementation not in _warned_implementations:
        _warned_implementations.add(implementation)
        logger.warning(
            "elastic-moe: experts implementation %r is not one whose compute elastic routing can cut to κ "
            "(eager, grouped_mm, batched_mm): it computes all b candidate slots per token (the slots beyond κ "
            "weigh exactly 0, so outputs and gradients are those of top-κ routing; expert FLOPs are b/k of "
            "static top-k).", implementation)
    return None


def _with_sentinels(experts: torch.nn.Module, top_k_index: torch.Tensor, slots: KeptSlots) -> torch.Tensor:
    """``top_k_index`` [T, b] with the sentinel id E (``num_experts``) in every unkept slot."""
    return torch.where(slots.kept, top_k_index, int(experts.num_experts))


def _eager(experts, original, hidden_states, top_k_index, top_k_weights, slots) -> torch.Tensor:
    # The stock loop one-hot encodes E + 1 classes and skips class E: sentinel slots cost nothing.
    return original(experts, hidden_states, _with_sentinels(experts, top_k_index, slots), top_k_weights)


@contextlib.contextmanager
def _sentinels_skipped(experts: torch.nn.Module) -> Iterator[None]:
    """transformers' grouped_mm honours ids >= num_experts only in expert-parallel mode; switch it
    on for one call (already on under expert parallelism, where it stays on)."""
    previous = experts._is_expert_parallel
    experts._is_expert_parallel = True
    try:
        yield
    finally:
        experts._is_expert_parallel = previous


def _grouped_mm(experts, original, hidden_states, top_k_index, top_k_weights, slots) -> torch.Tensor:
    from transformers.integrations import moe

    ids = _with_sentinels(experts, top_k_index, slots)
    with _sentinels_skipped(experts):
        return moe.grouped_mm_experts_forward(experts, hidden_states, ids, top_k_weights)


def _batched_mm(experts, original, hidden_states, top_k_index, top_k_weights, slots) -> torch.Tensor:
    """Σ_{j<κ_t} w_tj · expert_{e_tj}(x_t) with one batched GEMM row per kept pair.

    With P = Σκ kept pairs, ``pairs`` [P] holds their flat slot positions t·b + j, in slot order.
    transformers' batched_mm then runs on P tokens with one slot each (x_t repeated per pair, the
    pair's expert id and weight) and returns the weighted pair outputs [P, H].
    """
    from transformers.integrations import moe

    num_tokens, width = top_k_index.shape
    kept = slots.kept.reshape(-1)
    if slots.pair_count is None:
        pairs = kept.nonzero().squeeze(1)  # the one host sync: P = Σκ is random under iid sampling
    else:
        pairs = torch.nonzero_static(kept, size=slots.pair_count).squeeze(1)  # P known: no sync
    pair_outputs = moe.batched_mm_experts_forward(
        experts, hidden_states[pairs // width], top_k_index.reshape(-1)[pairs, None],
        top_k_weights.reshape(-1)[pairs, None],
    )  # [P, H]
    per_slot = pair_outputs.new_zeros(num_tokens * width, pair_outputs.shape[-1]).index_copy(0, pairs, pair_outputs)
    # Summed over the b slots in slot order, unkept slots exactly 0, as stock sums its k slots.
    return per_slot.view(num_tokens, width, -1).sum(dim=1).to(hidden_states.dtype)


__all__ = ["KeptSlots", "experts_forward", "kept_slots", "mark_kept_slots"]
