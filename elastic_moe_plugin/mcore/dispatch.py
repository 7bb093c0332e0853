"""Token-dispatcher fixes for a per-token budget κ (Megatron assumes a fixed k in a few places).

An elastic router tags the ``routing_map`` it returns (:func:`.routing.mark_elastic`) with its candidate
width b and its sampling mode; the patched dispatcher methods below read the tag and otherwise run
stock code untouched. Maps from static layers carry no tag, so those layers pay nothing.

==========================================  =======================================================
place (stock)                               with an elastic map
==========================================  =======================================================
alltoall ``preprocess``, dropless           stock sizes the permuted output as T·k, and the unfused
                                            permute keeps ``argsort(...)[:T·k]``, dropping or
                                            inventing rows. The size becomes the map's Σκ, taken
                                            from the tag: the host Σκ of the router's κ draw (``iid``
                                            and ``balanced`` alike; under ``balanced`` it is T·k),
                                            so no host sync and stock's sync point. Only a map whose
                                            Σκ the host does not know (``mode="top_p"``: κ comes from
                                            the device's probabilities) reads it from the device, on
                                            Megatron's own DtoH stream at ``before_permutation_1``
                                            (one sync per layer, the one stock pays with a capacity
                                            factor). ``ELASTIC_MOE_DEBUG=1`` asserts the host Σκ
                                            against the device's count (one read per layer).
alltoall ``preprocess``, EP/TP > 1 and      no fix: the split sizes and the per-local-expert counts
several local experts                       that stock moves to the host at ``before_ep_alltoall``
                                            / ``before_permutation_2`` / ``before_finish`` depend on
                                            which experts each token picked, which only the device
                                            knows; stock pays the same syncs at the same points.
alltoall with a capacity factor or          no fix: stock reads the dropped / padded count from the
``moe_router_padding_for_quantization``     device (one sync), as it does for a static map.
alltoall / HybridEP drop-and-pad, HybridEP  no fix: stock sizes the expert capacity (and HybridEP's
rank budget                                 rank budget) from T·k, and the elastic router masks to
                                            that same capacity (E[κ] = k; ``docs/parallelism.md``).
allgather ``dispatch_postprocess``          no fix: stock counts the (gathered) map's rows per local
                                            expert and copies them to the host (``.cpu()``, one
                                            sync), then sizes the permute from that host copy; an
                                            elastic map costs the same.
flex DeepEP / NCCL-EP ``setup_metadata``    stock rebuilds indices with ``topk(probs, k)``: tokens
                                            with κ < k get phantom zero-weight experts and κ > k is
                                            truncated. Indices are rebuilt from the routing map with
                                            width b, the worst case; unrouted slots are −1. NCCL-EP
                                            sizes its receive buffer from that width (an overflow
                                            traps, so it must hold the worst case). The received
                                            counts these managers read with ``.item()`` come back
                                            from the dispatch (other ranks' tokens): stock's sync,
                                            unchanged.
flex ``dispatch_preprocess``                ``_initialize_metadata`` expands the map over TP×EP into a
                                            new tensor, which drops the tag before ``setup_metadata``
                                            runs; the tag is handed to the manager instead (outside
                                            the ``torch.compile`` region of ``dispatch_preprocess``).
==========================================  =======================================================

The router in front of these adds no sync of its own: κ is drawn on the host from its counter-based
stream and reaches the device by one non-blocking copy from pinned memory (:mod:`.budget_rng`), so
Σκ is known on the host (``core.budget_stream.BudgetDraw.total``) and travels on the map's tag
(:func:`mark_elastic`). Device reads per dropless alltoall layer at EP = 1, beyond the copy of the
per-expert counts that stock makes at its own sync point (counted by
``tests/mcore/test_mcore_dispatch.py``; ``docs/performance.md``): stock 0, stock with a capacity
factor 1, elastic ``iid`` 0, ``balanced`` 0, ``mode="top_p"`` 1.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any

import torch

from elastic_moe_plugin.core.errors import UnsupportedMegatronError
from elastic_moe_plugin.core.patching import AttributePatches, PatchSwitch, is_patched
from elastic_moe_plugin.mcore.routing import BALANCED_ATTR, TOTAL_ATTR, elastic_width, unread_arguments

#: ``ELASTIC_MOE_DEBUG=1`` checks the tag's host Σκ against the device's count (one read per layer)
DEBUG_ENV = "ELASTIC_MOE_DEBUG"


#: set on a flex dispatcher's manager for one ``dispatch_preprocess``: (b, balanced), or False for
#: a stock map; absent when ``setup_metadata`` is called directly (then the map's own tag counts)
MANAGER_TAG_ATTR = "_elastic_moe_map_tag"


def _map_tag(manager: Any, routing_map: torch.Tensor) -> tuple[int, bool] | None:
    tag = getattr(manager, MANAGER_TAG_ATTR, None)
    if tag is None:
        width = elastic_width(routing_map)
        return None if width is None else (width, bool(getattr(routing_map, BALANCED_ATTR, False)))
    return tag or None


def indices_from_routing_map(
    routing_map: torch.Tensor, probs: torch.Tensor, width: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Convert a multi-hot map [T, E] into (probs [T, width], indices [T, width]) with −1 slots.

    Routed experts come first (their key is 1, others 0); slots past a token's κ get index −1 and
    probability 0, so no phantom expert is dispatched and no κ > k is truncated. No host sync.
    """
    _, indices = torch.topk(routing_map.to(torch.int8), width, dim=-1)
    routed = torch.gather(routing_map, 1, indices)
    token_probs = torch.gather(probs, 1, indices) * routed
    return token_probs, indices.masked_fill(~routed, -1)


def host_total(routing_map: torch.Tensor, topk: int) -> int | None:
    """Σ_t κ_t of an elastic ``routing_map`` as the host knows it, without a device read: the tag's
    total, or T·k for a balanced map tagged without one; None when only the device knows it."""
    total = getattr(routing_map, TOTAL_ATTR, None)
    if total is None and getattr(routing_map, BALANCED_ATTR, False):
        total = routing_map.size(0) * topk
    return total


def _check_host_total(routing_map: torch.Tensor, total: int) -> None:
    """``ELASTIC_MOE_DEBUG=1``: the host's Σκ must be the map's count on the device (one read)."""
    realised = int(routing_map.sum())
    if realised == total:
        return
    if getattr(routing_map, BALANCED_ATTR, False):
        raise AssertionError(f"balanced elastic routing dispatched {realised} pairs, expected T·k = {total}")
    raise AssertionError(
        f"elastic routing dispatched {realised} pairs, but the κ drawn on the host sum to Σκ = {total}"
    )


def _refuse_unread_arguments(stock: Callable, args: tuple, kwargs: dict) -> None:
    """An elastic map's ``setup_metadata`` does not run stock's body and reads ``routing_map`` and
    ``probs`` only: a further argument a newer Megatron passes, not at its default, raises, naming
    it, instead of being dropped (:func:`.routing.unread_arguments`)."""
    if not args and not kwargs:
        return
    unread, _ = unread_arguments(stock, 3, args, kwargs)  # self, routing_map, probs
    if unread:
        raise UnsupportedMegatronError(
            f"{stock.__qualname__} was called with {', '.join(unread)} (not at its default), which the elastic "
            f"indices of elastic_moe_plugin.mcore.dispatch do not read; use the alltoall dispatcher, or keep "
            f"these layers stock."
        )


# ------------------------------------------------------------------------------------- patches
def _alltoall_preprocess(original: Callable) -> Callable:
    @functools.wraps(original)
    def preprocess(self, routing_map: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        width = elastic_width(routing_map)
        if width is None or self.drop_and_pad:
            # Drop-and-pad: stock's capacity from T·k is the router's (routing.elastic_routing).
            return original(self, routing_map, *args, **kwargs)
        tokens_per_expert = original(self, routing_map, *args, **kwargs)
        if self.config.moe_expert_capacity_factor is None and not getattr(
            self.config, "moe_router_padding_for_quantization", False
        ):
            # Stock chose the static T·k; an elastic map has Σκ rows.
            total = host_total(routing_map, self.config.moe_router_topk)
            if total is None:
                # Only the device knows Σκ (top-p): read it at Megatron's earliest sync point.
                self.num_out_tokens = routing_map.sum()
                self._maybe_update_cuda_sync_point("before_permutation_1")
            else:
                if os.environ.get(DEBUG_ENV, "") == "1":
                    _check_host_total(routing_map, total)
                self.num_out_tokens = total  # a host int, as stock's T·k: stock's sync point stays
        return tokens_per_expert

    return preprocess


def _flex_dispatch_preprocess(original: Callable) -> Callable:
    """Hand the map's tag to the manager: ``_initialize_metadata`` builds a new (untagged) map."""

    @functools.wraps(original)
    def dispatch_preprocess(self, hidden_states: torch.Tensor, routing_map: torch.Tensor, *args: Any, **kwargs: Any):
        manager = getattr(self, "_comm_manager", None)
        if manager is None:
            return original(self, hidden_states, routing_map, *args, **kwargs)
        width = elastic_width(routing_map)
        manager.__dict__[MANAGER_TAG_ATTR] = (
            False if width is None else (width, bool(getattr(routing_map, BALANCED_ATTR, False)))
        )
        try:
            return original(self, hidden_states, routing_map, *args, **kwargs)
        finally:
            manager.__dict__.pop(MANAGER_TAG_ATTR, None)

    return dispatch_preprocess


def _indexed_setup_metadata(original: Callable) -> Callable:
    """DeepEP / NCCL-EP: indices from the map, width = (TP fold) · b."""

    @functools.wraps(original)
    def setup_metadata(self, routing_map: torch.Tensor, probs: torch.Tensor, *args: Any, **kwargs: Any):
        tag = _map_tag(self, routing_map)
        stock_topk = self.__dict__.get("_elastic_stock_topk")
        if tag is None:
            if stock_topk is None or stock_topk == self.router_topk:
                return original(self, routing_map, probs, *args, **kwargs)
            # A stock map (eval, static layer) after elastic steps raised router_topk: stock width,
            # else every token would get (b - k)·TP phantom zero-weight experts.
            raised, self.router_topk = self.router_topk, stock_topk
            try:
                return original(self, routing_map, probs, *args, **kwargs)
            finally:
                self.router_topk = raised
        _refuse_unread_arguments(original, args, kwargs)  # the elastic indices replace stock's whole body
        width = tag[0]
        num_tokens = routing_map.shape[0]
        if stock_topk is None:
            stock_topk = self.__dict__["_elastic_stock_topk"] = self.router_topk
        # The flex dispatcher folds TP into the expert axis: router_topk = tp_size · k at construction.
        folded_width = max(1, stock_topk // self.config.moe_router_topk) * width
        if getattr(self, "_bootstrapped", False) and folded_width > self.router_topk:
            raise UnsupportedMegatronError(
                f"the NCCL-EP receive buffers were sized for {self.router_topk} experts per token before the first "
                f"elastic step, but the schedule needs {folded_width}. Run an elastic training step before any "
                f"evaluation step, or use the alltoall dispatcher."
            )
        self.router_topk = max(self.router_topk, folded_width)
        routing_map = routing_map.reshape(num_tokens, self.num_experts)
        probs = probs.reshape(num_tokens, self.num_experts)
        self.token_probs, self.token_indices = indices_from_routing_map(routing_map, probs, self.router_topk)
        if hasattr(self, "num_local_tokens"):
            self.num_local_tokens = num_tokens

    return setup_metadata


def _targets() -> list[tuple[Any, str, Callable]]:
    from megatron.core.transformer.moe import token_dispatcher

    targets = [(token_dispatcher.MoEAlltoAllTokenDispatcher, "preprocess", _alltoall_preprocess)]
    # HybridEP consumes the map itself and sizes from k like the router: it needs no fix.
    for name in ("_DeepepManager", "_NCCLEPManager"):
        cls = getattr(token_dispatcher, name, None)
        if cls is not None and "setup_metadata" in cls.__dict__:
            targets.append((cls, "setup_metadata", _indexed_setup_metadata))
    flex = getattr(token_dispatcher, "MoEFlexTokenDispatcher", None)
    if flex is not None and "dispatch_preprocess" in flex.__dict__:
        targets.append((flex, "dispatch_preprocess", _flex_dispatch_preprocess))
    return targets


def install(patches: AttributePatches) -> None:
    """Wrap, through ``patches``, every dispatcher method above that no elastic patch holds yet.

    Maps without the elastic tag take the stock path, so the fixes are harmless to static layers.
    A method another holder already wrapped (the explicit-spec routers' :data:`SPEC_FIXES`, or a
    second copy of this package) is left to it, so ``patches`` lists, and restores, exactly what
    it replaced.
    """
    for owner, name, factory in _targets():
        if not is_patched(owner.__dict__.get(name)):
            patches.wrap(owner, name, factory)


#: The fixes ``ElasticTopKRouter`` (the explicit-spec route) needs: on at its first construction,
#: for the life of the process, since its maps reach the stock dispatchers of every layer built
#: from its spec. The monkey-patch reinstalls them after restoring what it wrapped
#: (:func:`reinstall_spec_fixes`), so removing the patch never strips a spec router's dispatcher.
SPEC_FIXES = PatchSwitch(install)


def reinstall_spec_fixes() -> None:
    """Re-wrap what :data:`SPEC_FIXES` needs after another holder restored the stock methods."""
    if SPEC_FIXES.is_on:
        SPEC_FIXES.off()
        SPEC_FIXES.on()


def installed_targets() -> list[str]:
    """Dotted names of the dispatcher methods an elastic patch (any holder) wraps now."""
    return [
        f"{owner.__module__}.{owner.__qualname__}.{name}"
        for owner, name, _ in _targets()
        if is_patched(owner.__dict__.get(name))
    ]
