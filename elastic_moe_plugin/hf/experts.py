"""Expert compute that follows κ: the experts side of an elastic transformers MoE layer.

An elastic router (:func:`.routing.elastic_routing`) returns b candidate slots per token (b = the
schedule's high budget): real expert ids, and a weight of exactly 0 in every slot j >= κ_t. It marks
its ``top_k_index`` tensor with κ **on the host** (:func:`.routing.mark_kept_slots`; κ is drawn there, so
Σκ = P is a host int that cost no device read). The patched ``<Family>Experts.forward``
(:func:`experts_forward`) looks the mark up and compacts the call to its P kept (token, expert)
pairs: the pair index (:meth:`KeptSlots.pairs`, built on the host, one host-to-device copy) gathers
each pair's hidden state, expert id and weight, the active experts implementation runs on those P
rows, and the weighted pair outputs are summed per token (:func:`_sum_per_token`). Every shape is
known on the host, so nothing syncs:

==============  ============================================  ==========  =========  ===========
implementation  what runs for a marked call                   GEMM rows   elementw.  syncs added
                                                                          rows
==============  ============================================  ==========  =========  ===========
``grouped_mm``  transformers' grouped GEMM over the P pairs   P = Σκ      P          0
                sorted by expert (``offsets[-1]`` = P: no
                tail, nothing to mask); the weighted rows
                are added into their tokens
``batched_mm``  transformers' ``batched_mm_experts_forward``  P           P          0
                on P tokens of one slot each
``eager``       transformers' own loop on P tokens of one     P           P          0 (the loop's
                slot each                                                            own per
                                                                                     expert hit)
other           the stock implementation over every slot      T·b         T·b        0
                (the unkept ones weigh 0): correct, b/k of
                the compute; logged once per implementation
==============  ============================================  ==========  =========  ===========

"elementw. rows": the rows of every element-wise op on activations (the gathers, the gate
activation and its backward, the weighting, the per-token sum): P, the tokens' T for the output.
Only [T, b]-shaped index bookkeeping of the router's own outputs (the gathers of the P ids and
weights, and the weights' gradient) keeps the b slots, with no hidden dimension.

Expert parallelism (:func:`install_expert_parallel`), by what the installed transformers defines:

- 5.23+ (``transformers.distributed.expert_parallel``): the ``ep_dispatch_experts`` style reaches the
  experts through an ``EPImplementation`` (``DistributedConfig.ep_implementation``). ``AllToAllEP``
  (``"all_to_all"``; ``"auto"`` in training) is called on the P kept pairs as P tokens of one slot
  each: its TP slicing splits the pairs, its all-to-alls move only them, and the weighted pair
  outputs it gathers back are summed per token. ``AllReduceEP`` (``"all_reduce"``; ``"auto"`` under
  no grad) rebuilds the index for the local experts (other ranks' experts → the sentinel id E,
  weight 0); the rebuilt index is marked with the call's κ, so each rank's experts compact to the
  P kept pairs and leave the sentinel ones out of the grouped GEMM, and the all-reduce stays [T, H].
- 5.19-5.22 (``EpDispatchExpertsParallel`` in ``tensor_parallel``, from 5.22 in ``expert_parallel``):
  its token dispatch sends only the P kept pairs to their owners and adds the weighted outputs back
  per token (with a TP group, each rank's ``Shard(0)`` slice of the tokens is marked with its slice
  of κ); the masked plan (``ep_router`` + ``moe_tp_experts``) keeps the mark through the router's
  output hook, so each rank's experts compact to the P kept pairs, as under ``AllReduceEP``.

A call without a mark (eval mode, static layers, ``schedule="static"``, a router that is not
patched, or a block that rebuilt the index tensor) runs the stock forward untouched, bit for bit;
so does a marked call that keeps every slot (P = T·b, a point-mass schedule at b), since the
per-token ``index_add`` would sum the pairs in another order than stock's slot sum.
The implementation is read from ``experts.config._experts_implementation`` at every call, so
``from_pretrained(..., experts_implementation=...)``, ``model.set_experts_implementation(...)`` and
ms-swift's ``--experts_impl`` all apply, before or after :func:`elastic_moe_plugin.hf.apply`.

Shapes: T = tokens of the call, b = slots per token, P = Σ_t κ_t kept pairs, H = hidden size,
E = ``experts.num_experts`` (the local experts under expert parallelism).
"""

from __future__ import annotations

import functools
import importlib
import logging
from collections.abc import Callable

import torch

from elastic_moe_plugin.core.router_state import TensorMarks
from elastic_moe_plugin.hf.routing import KeptSlots, kept_slots, mark_kept_slots

logger = logging.getLogger("elastic_moe_plugin.hf")


_warned_implementations: set[str | None] = set()


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
        if slots.total == top_k_index.numel():
            # Every slot kept (a point-mass schedule at b): the stock forward is the same compute,
            # and bit for bit stock's summation order, which the per-token index_add is not.
            return original(self, hidden_states, top_k_index, top_k_weights)
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
    # own "grouped_mm" in the ExpertsInterface, and that one need not take P rows for T·b.
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
            "static top-k).",
            implementation,
        )
    return None


def own_experts_forward(original: Callable) -> Callable:
    """Replacement of the ``forward`` of a family's own experts (not transformers' dispatcher) that
    sums over slots, Σ_j w_tj · f_{e_tj}(x_t) (:attr:`~.router_family.RouterFamily.experts_slot_sum`:
    DBRX, Step-3.7 in 5.19, Ergo): a marked call runs the family's own forward
    on the P kept pairs as P tokens of one slot each and sums them per token, as the eager path of
    the dispatcher does; an unmarked one, or one that keeps every slot, runs stock. Hidden states
    of any shape ``[..., H]`` (DBRX's block passes ``[B, S, H]``) come back in that shape."""

    @functools.wraps(original)
    def forward(self, hidden_states, top_k_index, top_k_weights, *args, **kwargs):
        slots = kept_slots(top_k_index) if not (args or kwargs) else None
        if slots is None or slots.total == top_k_index.numel():
            return original(self, hidden_states, top_k_index, top_k_weights, *args, **kwargs)
        flat = hidden_states.reshape(-1, hidden_states.shape[-1])
        tokens, ids, weights, _ = _kept_pairs(top_k_index, top_k_weights, slots, flat.device)
        pair_outputs = original(self, flat[tokens], ids.unsqueeze(-1), weights.unsqueeze(-1))
        summed = _sum_per_token(pair_outputs.reshape(len(tokens), -1), tokens, flat.shape[0], flat.dtype)
        return summed.reshape(hidden_states.shape)

    return forward


# ------------------------------------------------------------------------------ pairs in, tokens out
def _kept_pairs(top_k_index: torch.Tensor, top_k_weights: torch.Tensor, slots: KeptSlots, device: torch.device):
    """``(tokens [P], expert ids [P], weights [P], positions [P])`` of the kept pairs (token-major)."""
    positions, tokens = slots.pairs(top_k_index.shape[-1], device)
    return tokens, top_k_index.reshape(-1)[positions], top_k_weights.reshape(-1)[positions], positions


def _accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for bf16/fp16 activations (as stock's slot sum accumulates), else the dtype itself."""
    return torch.promote_types(dtype, torch.float32)


def _sum_per_token(
    pair_values: torch.Tensor, tokens: torch.Tensor, num_tokens: int, dtype: torch.dtype
) -> torch.Tensor:
    """Σ_{p: token(p) = t} pair_values[p]: ``[P, H]`` → ``[T, H]`` in ``dtype``.

    Added in the accumulation dtype (fp32 for bf16/fp16 values, as stock's reshape-and-sum over the
    slots accumulates), cast once at the end. ``index_add_`` adds in pair order on the CPU, and is
    deterministic on CUDA under ``torch.use_deterministic_algorithms(True)``, as everything else.
    Its backward is one gather of the [T, H] gradient to the P pairs.
    """
    accumulate = _accumulation_dtype(pair_values.dtype)
    summed = pair_values.new_zeros((num_tokens, pair_values.shape[-1]), dtype=accumulate)
    return summed.index_add_(0, tokens, pair_values.to(accumulate)).to(dtype)


def _eager(experts, original, hidden_states, top_k_index, top_k_weights, slots) -> torch.Tensor:
    """transformers' eager loop on the P kept pairs, as P tokens of one slot each, summed per token."""
    tokens, ids, weights, _ = _kept_pairs(top_k_index, top_k_weights, slots, hidden_states.device)
    pair_outputs = original(experts, hidden_states[tokens], ids.unsqueeze(-1), weights.unsqueeze(-1))  # [P, H]
    return _sum_per_token(pair_outputs, tokens, hidden_states.shape[0], hidden_states.dtype)


def _batched_mm(experts, original, hidden_states, top_k_index, top_k_weights, slots) -> torch.Tensor:
    """transformers' ``batched_mm_experts_forward`` on the P kept pairs (one batched GEMM row per
    pair: x_t, its expert's weights, its weight), summed per token."""
    from transformers.integrations import moe

    tokens, ids, weights, _ = _kept_pairs(top_k_index, top_k_weights, slots, hidden_states.device)
    pair_outputs = moe.batched_mm_experts_forward(
        experts, hidden_states[tokens], ids.unsqueeze(-1), weights.unsqueeze(-1)
    )  # [P, H]
    return _sum_per_token(pair_outputs, tokens, hidden_states.shape[0], hidden_states.dtype)


def _grouped_mm(experts, original, hidden_states, top_k_index, top_k_weights, slots) -> torch.Tensor:
    """Σ_{j<κ_t} w_tj · expert_{e_tj}(x_t) through transformers' grouped GEMM over the P kept pairs.

    The pairs are sorted by expert; ``histc`` over [0, E-1] gives the offsets, so ``offsets[-1]``
    = P: every row the GEMMs are given is a kept pair, and every element-wise op (the gather of the
    hidden states, the gate activation, the weighting, their backward) runs over P rows. The
    weighted rows are added into their tokens in expert order (:func:`_sum_per_token`), which saves
    stock's inverse permutation.

    Under transformers' masked expert parallelism (``experts._is_expert_parallel``: ``ep_router``,
    or from 5.23 ``AllReduceEP``, gives the pairs of other ranks' experts the sentinel id E), the
    sentinel pairs sort last and ``histc`` leaves them out of the offsets, as in
    ``grouped_mm_experts_forward``: the GEMMs stop at the local pairs, the tail gathers an appended
    zero row (whose gradient is dropped), and one forward-only zeroing keeps the rows the kernel
    leaves uninitialised out of the output (and out of the post-expert norm, 5.20+); the
    tail's weights are 0, so nothing reaches a gradient.
    """
    from transformers.integrations import moe

    num_tokens = hidden_states.shape[0]
    num_experts = int(experts.num_experts)
    tokens, ids, weights, _ = _kept_pairs(top_k_index, top_k_weights, slots, hidden_states.device)
    sorted_ids, order = torch.sort(ids)  # [P]: pairs grouped by expert
    sorted_tokens = tokens[order]
    weights = weights[order]
    tail = None
    # older transformers (5.17) have no such flag (their grouped-GEMM forward checks the ids for the
    # sentinel at every call): there the masked path runs, which is exact without sentinels too
    if getattr(experts, "_is_expert_parallel", True):
        tail = sorted_ids >= num_experts  # [P]: pairs of another rank's experts, sorted last
        padded = torch.cat([hidden_states, hidden_states.new_zeros(1, hidden_states.shape[-1])])  # [T+1, H]
        selected = padded[torch.where(tail, num_tokens, sorted_tokens)]  # [P, H]
        weights = torch.where(tail, 0.0, weights)  # 0 already (ep_router masks them); keeps NaN·0 out
        bias_ids = sorted_ids.clamp(max=num_experts - 1)  # keeps a bias gather in bounds; tail rows unused
    else:
        selected = hidden_states[sorted_tokens]  # [P, H]
        bias_ids = sorted_ids
    # histc, not bincount, as transformers does (CUDA graphs); CPU histc wants a float input
    histc_input = sorted_ids.float() if sorted_ids.device.type in ("cpu", "mps") else sorted_ids.int()
    offsets = torch.cumsum(torch.histc(histc_input, bins=num_experts, min=0, max=num_experts - 1), 0, dtype=torch.int32)
    if experts.has_gate:
        up_weight, up_bias = experts.gate_up_proj, experts.gate_up_proj_bias[bias_ids] if experts.has_bias else None
    else:
        up_weight, up_bias = experts.up_proj, experts.up_proj_bias[bias_ids] if experts.has_bias else None
    projected = moe._grouped_linear(selected, up_weight, offsets, bias=up_bias, is_transposed=experts.is_transposed)
    projected = experts._apply_gate(projected) if experts.has_gate else experts.act_fn(projected)
    down_bias = experts.down_proj_bias[bias_ids] if experts.has_bias else None
    out = moe._grouped_linear(
        projected, experts.down_proj, offsets, bias=down_bias, is_transposed=experts.is_transposed
    )  # [P, H]
    if tail is not None:
        with torch.no_grad():
            # The kernel leaves the tail rows uninitialised: zero them for the forward (in place;
            # the GEMM's backward does not read its output). d out = w · d weighted is 0 there.
            out.masked_fill_(tail.unsqueeze(-1), 0.0)
    if getattr(experts, "has_post_expert_norm", False):  # transformers 5.20+: normed before the weighting
        out = experts.post_expert_norm(out)
    # The product in the accumulation dtype (fp32 for bf16), as stock's slot sum accumulates it.
    weighted = out * weights.to(_accumulation_dtype(out.dtype)).unsqueeze(-1)  # [P, H]
    return _sum_per_token(weighted, sorted_tokens, num_tokens, hidden_states.dtype)


# ------------------------------------------------------------------------------ expert parallelism
#: the ``order`` tensor of a compacted token dispatch → (flat positions [P], tokens [P], T)
_COMPACTED: TensorMarks[tuple[torch.Tensor, torch.Tensor, int]] = TensorMarks()


def _dispatch_kept_pairs(original: Callable) -> Callable:
    """``EpDispatchExpertsParallel._dispatch_tokens`` (transformers 5.19-5.22) sending only the P kept
    pairs of a marked call (as P tokens of one slot each); the all-to-all split sizes it reads are
    then P's."""

    @functools.wraps(original)
    def _dispatch_tokens(self, hidden_states, top_k_index, num_local_experts, ep_group, ep_size):
        slots = kept_slots(top_k_index)
        if slots is None or slots.total == top_k_index.numel():  # unmarked, or every slot kept: stock
            return original(self, hidden_states, top_k_index, num_local_experts, ep_group, ep_size)
        positions, tokens = slots.pairs(top_k_index.shape[-1], hidden_states.device)
        dispatched = original(
            self,
            hidden_states[tokens],
            top_k_index.reshape(-1)[positions].unsqueeze(-1),
            num_local_experts,
            ep_group,
            ep_size,
        )
        _COMPACTED[dispatched[2]] = (positions, tokens, hidden_states.shape[0])
        return dispatched

    return _dispatch_tokens


def _tp_slice_keeps_the_mark(original: Callable) -> Callable:
    """``EpDispatchExpertsParallel.transform_inputs_pre_forward``: with a TP group (the ranks that
    hold the same batch), each rank keeps its ``Shard(0)`` slice of the tokens before dispatching;
    the sliced index tensor is marked with the same slice of κ, so the dispatch still sends only
    the kept pairs."""

    @functools.wraps(original)
    def transform_inputs_pre_forward(self, module, args, kwargs, mesh, *, tp_mesh=None):
        transformed, kwargs = original(self, module, args, kwargs, mesh, tp_mesh=tp_mesh)
        slots = kept_slots(args[1])
        if slots is not None and transformed[1] is not args[1]:
            # Shard(0) splits the rows as torch.chunk does: ceil(T / n) per rank, the last ones short.
            rows = len(slots.host_budgets)
            chunk = -(-rows // tp_mesh.size())
            start = min(rows, tp_mesh.get_local_rank() * chunk)
            local = slots.host_budgets[start : start + chunk]
            if len(local) == transformed[1].shape[0]:
                mark_kept_slots(transformed[1], local)
        return transformed, kwargs

    return transform_inputs_pre_forward


def _combine_kept_pairs(original: Callable) -> Callable:
    """``EpDispatchExpertsParallel._combine_tokens`` for a compacted dispatch: the returned pair
    outputs weighted by their pair's weight, then summed per token (:func:`_sum_per_token`)."""

    @functools.wraps(original)
    def _combine_tokens(self, expert_output, top_k_weights, order, send_sizes, recv_sizes, ep_group):
        compacted = _COMPACTED.get(order)
        if compacted is None:
            return original(self, expert_output, top_k_weights, order, send_sizes, recv_sizes, ep_group)
        positions, tokens, num_tokens = compacted
        pair_outputs = original(
            self,
            expert_output,
            top_k_weights.reshape(-1)[positions].unsqueeze(-1),
            order,
            send_sizes,
            recv_sizes,
            ep_group,
        )  # [P, H]
        return _sum_per_token(pair_outputs, tokens, num_tokens, pair_outputs.dtype)

    return _combine_tokens


def _router_output_keeps_the_mark(original: Callable) -> Callable:
    """``EpRouterParallel.transform_output_post_forward`` (the masked plan's router hook, which
    rebuilds the index tensor for the local experts) carrying the router's mark to the new index."""

    @functools.wraps(original)
    def transform_output_post_forward(self, module, output, mesh, *args, **kwargs):
        transformed = original(self, module, output, mesh, *args, **kwargs)
        slots = kept_slots(output[2]) if isinstance(output, tuple) and len(output) >= 3 else None
        if slots is not None:
            mark_kept_slots(transformed[2], slots.host_budgets)  # elementwise remap: the same slots are kept
        return transformed

    return transform_output_post_forward


def _all_to_all_kept_pairs(original: Callable) -> Callable:
    """``AllToAllEP.__call__`` (transformers 5.23+) on the P kept pairs of a marked call, as P tokens
    of one slot each: its TP slicing splits the pairs (each is dispatched once by its TP group), its
    split sizes are P's, and it returns the weighted pair outputs [P, H], gathered over TP; they are
    summed per token here (:func:`_sum_per_token`)."""

    @functools.wraps(original)
    def __call__(self, hidden_states, top_k_index, top_k_weights):
        slots = kept_slots(top_k_index)
        if slots is None or slots.total == top_k_index.numel():  # unmarked, or every slot kept: stock
            return original(self, hidden_states, top_k_index, top_k_weights)
        tokens, ids, weights, _ = _kept_pairs(top_k_index, top_k_weights, slots, hidden_states.device)
        pair_outputs = original(self, hidden_states[tokens], ids.unsqueeze(-1), weights.unsqueeze(-1))  # [P, H]
        return _sum_per_token(pair_outputs, tokens, hidden_states.shape[0], pair_outputs.dtype)

    return __call__


def _all_reduce_keeps_the_mark(original: Callable) -> Callable:
    """``AllReduceEP.__call__`` (transformers 5.23+) carrying the call's mark to the index it rebuilds
    for the local experts, so they compact to the P kept pairs (:func:`experts_forward`).

    The rebuild (``torch.where(off_rank, E, top_k_index % E)``) happens inside the call, between no
    two methods; the experts forward it then calls is the instance's ``experts_forward`` attribute,
    so that is swapped, for this call only, for one that marks its [T, b] index argument (an
    elementwise remap: the same slots are kept). The all-reduce keeps its [T, H] rows.
    """

    @functools.wraps(original)
    def __call__(self, hidden_states, top_k_index, top_k_weights):
        slots = kept_slots(top_k_index)
        if slots is None:
            return original(self, hidden_states, top_k_index, top_k_weights)
        experts_forward = self.experts_forward

        def marked_experts_forward(local_states, local_index, *args, **kwargs):
            if local_index.shape == top_k_index.shape:
                mark_kept_slots(local_index, slots.host_budgets)
            return experts_forward(local_states, local_index, *args, **kwargs)

        self.experts_forward = marked_experts_forward
        try:
            return original(self, hidden_states, top_k_index, top_k_weights)
        finally:
            self.experts_forward = experts_forward

    return __call__


def _defined(name: str) -> type | None:
    """The class ``name`` of transformers' expert parallelism, where this transformers defines it:
    ``transformers.distributed.expert_parallel`` (5.22+) or ``.tensor_parallel`` (5.19-5.21), else
    None. Read from each module's own namespace: from 5.22, ``tensor_parallel`` re-exports the moved
    classes through a module ``__getattr__`` that warns (FutureWarning) at every access."""
    for module_name in ("expert_parallel", "tensor_parallel"):
        try:
            module = importlib.import_module(f"transformers.distributed.{module_name}")
        except ImportError:  # not this version's layout, or torch.distributed unavailable
            continue
        found = vars(module).get(name)
        if isinstance(found, type):
            return found
    return None


def install_expert_parallel(patches) -> None:
    """Part of ``hf.apply``: transformers' expert-parallel styles follow κ (module docstring). Chooses
    by what the installed transformers defines; nothing to do on one without them."""
    # 5.23+: the ep_dispatch_experts style calls an EPImplementation (AutoEP calls these two).
    for name, factory in (("AllToAllEP", _all_to_all_kept_pairs), ("AllReduceEP", _all_reduce_keeps_the_mark)):
        implementation = _defined(name)
        if implementation is not None:
            patches.wrap(implementation, "__call__", factory)
    # 5.19-5.22: the style dispatches the tokens itself (from 5.23 it has no such methods).
    dispatch = _defined("EpDispatchExpertsParallel")
    if dispatch is not None and "_dispatch_tokens" in vars(dispatch):
        patches.wrap(dispatch, "_dispatch_tokens", _dispatch_kept_pairs)
        patches.wrap(dispatch, "_combine_tokens", _combine_kept_pairs)
        patches.wrap(dispatch, "transform_inputs_pre_forward", _tp_slice_keeps_the_mark)
    router = _defined("EpRouterParallel")  # the masked plan's router hook (5.19-5.22)
    if router is not None:
        patches.wrap(router, "transform_output_post_forward", _router_output_keeps_the_mark)


__all__ = [
    "KeptSlots",
    "experts_forward",
    "install_expert_parallel",
    "kept_slots",
    "mark_kept_slots",
]  # marks: .routing
