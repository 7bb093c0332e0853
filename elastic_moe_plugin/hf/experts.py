"""Expert compute that follows κ: the experts side of an elastic transformers MoE layer.

An elastic router (:func:`.routing.elastic_routing`) returns b candidate slots per token (b = the
schedule's high budget): real expert ids, and a weight of exactly 0 in every slot j >= κ_t. It marks
its ``top_k_index`` tensor with the kept-slot mask (:func:`mark_kept_slots`). The patched
``<Family>Experts.forward`` (:func:`experts_forward`) looks the mark up and has the active experts
implementation multiply only the Σ_t κ_t kept (token, expert) rows:

==============  ========================================================================  ===============
implementation  what runs for a marked call                                               syncs added
==============  ========================================================================  ===============
``eager``       transformers' own loop, with the sentinel id E (= ``num_experts``) in     +1 (the loop's
                the unkept slots: the loop skips expert E                                 test of E)
``grouped_mm``  transformers' grouped GEMM over the slots sorted by expert, the unkept    0
                ones (id E) last: ``histc(max=E-1)`` leaves them out of the offsets, both
                GEMMs stop at ``offsets[-1]`` = Σκ, and one forward-only zeroing keeps the
                tail rows (left uninitialised by the kernel) out of the output and of
                every gradient (:func:`_grouped_mm`)
``batched_mm``  compaction: the P = Σκ kept pairs become a top-1 problem of P rows for    iid: 1 (P is
                transformers' ``batched_mm_experts_forward`` (which has no offsets and   read by
                multiplies every row it gets); each pair's output goes back to its slot  ``nonzero``);
                of a zero ``[T, b, H]`` buffer, summed per token as stock sums its slots balanced: 0
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

import dataclasses
import functools
import logging
from collections.abc import Callable

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
    if implementation in ("eager", None) and registered is None:
        return _eager  # None: an experts module outside a model, which transformers runs eagerly
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


def _grouped_mm(experts, original, hidden_states, top_k_index, top_k_weights, slots) -> torch.Tensor:
    """Σ_{j<κ_t} w_tj · expert_{e_tj}(x_t) through transformers' grouped GEMM, multiplying Σκ rows.

    The S = T·b slots are sorted by expert id, the unkept ones (id E) last; ``histc`` over
    [0, E-1] leaves them out of the offsets, so both grouped GEMMs stop at ``offsets[-1]`` = Σκ
    and the tail costs no GEMM work. No shape depends on κ, so nothing syncs. The kernel leaves the
    tail rows of its output, and of its input gradient, uninitialised; they reach nothing:

    - forward: the tail rows of the first GEMM's output pass the (row-wise) gate activation and are
      then read by nobody (the second GEMM reads rows below ``offsets[-1]`` only); those of the
      second are set to 0 before they are weighed and summed per token;
    - backward: the tail's weights are 0, so the gradient entering the second GEMM's tail is 0;
      what the kernels leave in the tail of their input gradients is read by no GEMM, and the
      first one's lands on a zero row appended to the hidden states for the tail to gather, whose
      gradient is dropped.

    This is transformers' own expert-parallel sentinel scheme (``grouped_mm_experts_forward``) with
    one forward-only zeroing of the tail where it has three masking passes over all S rows, each
    with its backward (a pre-mask of the gathered input, two out-of-place post-masks): at OLMoE's
    width those cost 5.4% of a block's forward + backward on CPU, this path 0.5%
    (``docs/performance.md``).
    """
    from transformers.integrations import moe

    num_tokens, width = top_k_index.shape
    num_experts = int(experts.num_experts)
    ids = _with_sentinels(experts, top_k_index, slots).reshape(-1)  # [S]
    sorted_ids, order = torch.sort(ids)  # [S]: slots grouped by expert, the tail (id E) last
    tail = sorted_ids == num_experts
    padded = torch.cat([hidden_states, hidden_states.new_zeros(1, hidden_states.shape[-1])])  # [T+1, H]
    selected = padded[torch.where(tail, num_tokens, order // width)]  # [S, H]; the tail reads the zero row
    # histc, not bincount, as transformers does (CUDA graphs); CPU histc wants a float input
    histc_input = sorted_ids.float() if sorted_ids.device.type in ("cpu", "mps") else sorted_ids.int()
    offsets = torch.cumsum(torch.histc(histc_input, bins=num_experts, min=0, max=num_experts - 1), 0,
                           dtype=torch.int32)
    bias_ids = sorted_ids.clamp(max=num_experts - 1)  # keeps a bias gather in bounds; tail rows are unused
    if experts.has_gate:
        up_weight, up_bias = experts.gate_up_proj, experts.gate_up_proj_bias[bias_ids] if experts.has_bias else None
    else:
        up_weight, up_bias = experts.up_proj, experts.up_proj_bias[bias_ids] if experts.has_bias else None
    projected = moe._grouped_linear(selected, up_weight, offsets, bias=up_bias, is_transposed=experts.is_transposed)
    projected = experts._apply_gate(projected) if experts.has_gate else experts.act_fn(projected)
    down_bias = experts.down_proj_bias[bias_ids] if experts.has_bias else None
    out = moe._grouped_linear(projected, experts.down_proj, offsets, bias=down_bias,
                              is_transposed=experts.is_transposed)  # [S, H]
    with torch.no_grad():
        # What the kernel left in the tail is no value: zero it for the forward only (in place;
        # the GEMM's backward does not read its output). The gradient needs no mask: the tail's
        # weights are 0, so d out = w · d weighted is 0 there, and d w = out · d weighted reads
        # the zeroed rows.
        out.masked_fill_(tail.unsqueeze(-1), 0.0)
    weights = torch.where(tail, 0.0, top_k_weights.reshape(-1)[order])  # [S]; 0 beyond κ by construction too
    weighted = out * weights.unsqueeze(-1)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    # Summed over the b slots in slot order, unkept slots exactly 0, as stock sums its k slots.
    return weighted[inverse].view(num_tokens, width, -1).sum(dim=1).to(hidden_states.dtype)


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
