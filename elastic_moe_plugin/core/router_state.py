"""One state object per patched router: its plan, its κ stream, its latest draw and what it routed.

A door keeps everything a router needs between forwards in one :class:`RouterState`, in the
router's ``__dict__`` (no parameter, buffer or state-dict key is added, so checkpoints stay stock).
The door resolves the state's plan when the router is built or the config changes (a new patch
generation), not at every forward; a training forward then only reads it, draws κ
(:meth:`RouterState.draw`) and keeps what it routed (:meth:`RouterState.remember`).

What a forward keeps costs no device op: references to the routing call's own tensors
(:class:`~elastic_moe_plugin.core.routing.Routing`), and κ's histogram added up on the host when κ
was drawn there (one ``scatter_add_`` on the device for top-p κ, which the device computes).
:mod:`elastic_moe_plugin.core.records` turns them into :class:`~.records.RoutingRecord` objects,
and :mod:`elastic_moe_plugin.core.metrics` into logged scalars, only when a logger asks.

What a router call hands the code downstream (the transformers door's kept-slot marks on its
``top_k_index``, its dispatched slots on its logits) is attached to the tensor's data by
:class:`TensorMarks`, not to the tensor object: DeepSpeed ZeRO-3 passes every module's inputs and
outputs through an autograd function returning ``tensor.detach()``, a new object over the same
data, so a mark keyed by identity was lost at the first module boundary (the experts computed all
T·b slots, the loss recounted a static top-b). A mark is keyed by the tensor's storage (held
weakly), offset, shape, strides and dtype: every alias finds it (``detach``, ZeRO-3's hooks, a view
of the same elements), a copy does not (``clone``, a rebuilt tensor: the stock behaviour), and it
dies with its storage. The key is sound: while an entry's weak reference exists, the storage's
control block is not freed, so no other storage can take its address. A tensor without plain
storage (a ``DTensor``, a fake tensor) is keyed by identity.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Generic, NamedTuple, TypeVar

import numpy as np
import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils.weak import WeakIdKeyDictionary

from elastic_moe_plugin.core.budget_stream import BudgetDraw, StreamHome, to_device
from elastic_moe_plugin.core.plan import LayerPlan
from elastic_moe_plugin.core.routing import Routing, RoutingRule

#: the ``router.__dict__`` key of its :class:`RouterState`
STATE_ATTR = "_elastic_state"
#: draws a router keeps for a recompute to replay: a looped router's passes per forward (Inkling-2-
#: Loop: 3 by default), with room; without checkpointing nothing replays them, and the oldest go
MAX_PENDING_DRAWS = 8


class PendingDraw(NamedTuple):
    """A draw kept for a recompute, on the host only: κ [T] (int64 numpy), Σκ, κ's histogram."""

    host_budgets: np.ndarray
    total: int
    counts: np.ndarray | None


@dataclasses.dataclass(frozen=True)
class ElasticPath:
    """How an elastic router routes in training, all of it resolved: its plan, the routing rule
    the plan routes with, where its κ stream lives and this rank's token shard."""

    plan: LayerPlan
    rule: RoutingRule
    stream: StreamHome
    shard: int


class RouterState:
    """What one router keeps between forwards.

    Attributes:
        generation: the patch generation the state was resolved for (None: not resolved yet).
        path: the router's :class:`ElasticPath`, or None where it routes stock top-k (eval aside).
        options: the door's reading of the router's own routing options when the state was
            resolved; a door that must follow options changed on a built router compares them.
        layer_index: the 0-based decoder-layer index, where the door tags it (transformers).
        tensor_parallel_group: the group whose ranks share this router's tokens (transformers).
        latest_draw: the :class:`~.budget_stream.BudgetDraw` of the latest forward.
        pending_draws: where the door replays draws (transformers), the draws of this step's
            forwards that no recompute has replayed yet, in call order, on the host (a router run
            several times per forward, as Inkling-2-Loop's looped layers, draws once per pass; a
            checkpoint's backward recomputes the passes in reverse order and replays them last
            first: :meth:`replay`). Bounded by :data:`MAX_PENDING_DRAWS`; ``dropped_draws`` counts
            those dropped since the last replay.
        replayed: the draw the latest recompute replayed (a second recompute of it replays it again).
        routed: what the latest training forward routed, ``(budgets κ [T], ids [T, b], kept
            [T, b], gate weights [T, b] detached, capacity_dropped [T, b] or None, κ's host
            histogram [b+1] or None)``: references to the forward's own tensors.
        record: its :class:`~.records.RoutingRecord`, built at the first read.
        histogram: κ counts [b+1] since the last reset: a :class:`HostHistogram`, or a device
            tensor for κ the device computed.
    """

    __slots__ = ("dropped_draws", "generation", "histogram", "latest_draw", "layer_index", "options", "path",
                 "pending_draws", "record", "replayed", "routed", "tensor_parallel_group")  # fmt: skip

    def __init__(self) -> None:
        self.generation: Any = None
        self.path: ElasticPath | None = None
        self.options: Any = None
        self.layer_index: int | None = None
        self.tensor_parallel_group: Any = None
        self.latest_draw: BudgetDraw | None = None
        self.pending_draws: list[PendingDraw] = []
        self.dropped_draws = 0
        self.replayed: BudgetDraw | None = None
        self.routed: tuple | None = None
        self.record: Any = None
        self.histogram: HostHistogram | torch.Tensor | None = None

    @property
    def plan(self) -> LayerPlan | None:
        """The training plan, None for a router that routes stock top-k."""
        return None if self.path is None else self.path.plan

    def resolved(self, generation: Any, path: ElasticPath | None, options: Any = None) -> RouterState:
        """Set what was resolved for ``generation`` (returns the state). A router resolved to stock
        top-k (``path`` None) forgets what its last elastic forward routed and its κ histogram, so
        the readers report it as a static layer from its next forward on, not as its stale record
        (a config switched to ``static`` mid-run)."""
        self.generation, self.path, self.options = generation, path, options
        if path is None:
            self.routed = self.record = self.histogram = self.latest_draw = None
        return self

    def draw(self, path: ElasticPath, num_tokens: int, device: torch.device, *, replayable: bool = False) -> BudgetDraw:
        """κ [T] of this router's forward: one draw of its stream on its shard, kept as the latest;
        with ``replayable`` (a door whose recompute replays it: transformers) also kept, on the host,
        pending a recompute (:meth:`replay`; a draw after a replay starts a new step and drops the
        last step's pending ones)."""
        plan = path.plan
        drawn = path.stream.draw(plan.schedule, plan.sampling, path.shard, num_tokens, device)
        self.latest_draw = drawn
        if replayable:
            if self.replayed is not None:
                self.pending_draws.clear()
                self.replayed, self.dropped_draws = None, 0
            # host arrays only: no device memory held for a recompute that may never come
            self.pending_draws.append(PendingDraw(drawn.host_budgets, drawn.total, drawn.counts))
            if len(self.pending_draws) > MAX_PENDING_DRAWS:  # without checkpointing nothing replays them
                del self.pending_draws[0]
                self.dropped_draws += 1
        return drawn

    def replay(self, device: torch.device) -> BudgetDraw | None:
        """The draw a gradient-checkpointing recompute replays, κ on ``device``: the latest pending
        one (the passes of a looped router recompute in reverse order), else the one the last
        recompute replayed (a second recompute of it); None before any.

        Raises:
            RuntimeError: the draw to replay was dropped (more passes since the last step than
                :data:`MAX_PENDING_DRAWS`).
        """
        if self.pending_draws:
            kept = self.pending_draws.pop()
            self.replayed = BudgetDraw(to_device(kept.host_budgets, device), kept.host_budgets, kept.total, kept.counts)
        elif self.dropped_draws and self.replayed is not None:
            raise RuntimeError(
                f"elastic-moe: a gradient-checkpointing recompute needs a κ this router dropped: it ran more than "
                f"{MAX_PENDING_DRAWS} times since its last backward, the most passes of a looped layer it keeps "
                f"for a recompute. Disable gradient checkpointing, or run fewer passes."
            )
        return self.replayed

    def remember(
        self,
        routing: Routing,
        *,
        count: bool,
        capacity_dropped: torch.Tensor | None = None,
        budget_counts: np.ndarray | None = None,
    ) -> None:
        """Keep this forward's routing; with ``count``, add its κ to the histogram [b+1].

        Args:
            routing: the routing call's result (kept by reference; the gate weights detached, so the
                forward's autograd graph is not held until the next forward).
            count: False for a forward that replays a step already counted (activation recompute).
            capacity_dropped: bool [T, b], kept slots that a capacity factor dropped; None without one.
            budget_counts: κ's histogram [b+1] (int64 numpy) when the host has it (the draw's
                ``counts``); else κ is counted on the device. Of other than b + 1 bins it is
                ignored and κ counted on the device.
        """
        bins = routing.ids.shape[1] + 1
        if budget_counts is not None and len(budget_counts) != bins:
            budget_counts = None
        self.routed = (
            routing.budgets,
            routing.ids,
            routing.kept,
            routing.gate_weights.detach(),
            capacity_dropped,
            budget_counts,
        )
        self.record = None
        if not count:
            return
        histogram = self.histogram
        if budget_counts is not None:
            if not isinstance(histogram, HostHistogram) or histogram.bins != bins:
                histogram = self.histogram = HostHistogram(bins)
            histogram.add(budget_counts)
            return
        budgets = routing.budgets
        if not isinstance(histogram, torch.Tensor) or histogram.numel() != bins or histogram.device != budgets.device:
            histogram = self.histogram = torch.zeros(bins, dtype=torch.long, device=budgets.device)
        histogram.scatter_add_(0, budgets, torch.ones_like(budgets))


def state_of(router: torch.nn.Module) -> RouterState | None:
    """The router's state, or None for a router no door has met."""
    return router.__dict__.get(STATE_ATTR)


def ensure_state(router: torch.nn.Module) -> RouterState:
    """The router's state, created empty if it has none."""
    state = router.__dict__.get(STATE_ATTR)
    if state is None:
        state = router.__dict__[STATE_ATTR] = RouterState()
    return state


class ReplayWording(NamedTuple):
    """How a door names its checkpoint recompute in :func:`checked_replay`'s refusal, e.g.
    ``("a gradient-checkpointing recompute", "router", "as transformers' Trainer does",
    "disable gradient checkpointing")``."""

    recompute: str
    #: whose latest forward drew the κ being replayed: ``"router"`` or ``"layer"``
    owner: str
    #: a training loop that runs each micro-batch's backward before the next forward
    loop: str
    #: how to turn the recompute off
    fix: str


def checked_replay(
    draw: BudgetDraw | None, module: torch.nn.Module, num_tokens: int, device: torch.device, wording: ReplayWording
) -> BudgetDraw:
    """``draw``, the κ a checkpoint's recompute of ``module`` replays, once it is known to be κ for
    the recompute's ``num_tokens`` tokens on ``device``: a replay is exact only when the forward
    it replays routed the same tokens, so any other draw is refused rather than silently misapplied.

    Raises:
        RuntimeError: ``draw`` is of another token count or device (or None: no forward drew one).
    """
    if draw is None or draw.budgets.numel() != num_tokens or draw.budgets.device != torch.device(device):
        found = "none" if draw is None else f"{draw.budgets.numel()} tokens on {draw.budgets.device}"
        raise RuntimeError(
            f"elastic-moe: {wording.recompute} of {type(module).__name__} routes {num_tokens} tokens "
            f"on {device}, but the {wording.owner}'s latest forward drew κ for {found}. The recompute replays the κ of "
            f"the {wording.owner}'s latest forward, so each micro-batch's backward must run before the next forward of "
            f"the same layer ({wording.loop}); {wording.fix} otherwise."
        )
    return draw


class HostHistogram:
    """A running κ histogram [bins] counted on the host, from draws whose histograms the host has.

    Adding is appending a reference (an in-place numpy add inside a router call runs with cold
    caches); the pending counts are summed when the histogram is read, or every
    :data:`PENDING_FOLD` additions, so memory stays bounded without a reader.
    """

    __slots__ = ("bins", "counts", "pending")

    def __init__(self, bins: int) -> None:
        self.bins = bins
        self.counts = np.zeros(bins, dtype=np.int64)
        self.pending: list[np.ndarray] = []

    def add(self, counts: np.ndarray) -> None:
        self.pending.append(counts)
        if len(self.pending) >= PENDING_FOLD:
            self.fold()

    def fold(self) -> np.ndarray:
        """The counts so far (int64 [bins]), the pending ones added in."""
        if self.pending:
            # one pending draw is one in-place add; np.sum of a list builds a 2-D array first
            self.counts += self.pending[0] if len(self.pending) == 1 else np.sum(self.pending, axis=0)
            self.pending.clear()
        return self.counts

    def zero(self) -> None:
        self.pending.clear()
        self.counts[:] = 0


#: pending draws a :class:`HostHistogram` sums into its counts at once
PENDING_FOLD = 256

# ---------------------------------------------------------------------------------- marks
Value = TypeVar("Value")


class TensorMarks(Generic[Value]):
    """A mapping from tensors to values, keyed by the tensor's data (the module docstring says why).

    ``marks[tensor] = value``; ``marks.get(tensor)``, ``marks[tensor]`` (``KeyError`` if unmarked).
    """

    def __init__(self) -> None:
        self._by_data: dict[tuple, tuple[StorageWeakRef, Value]] = {}
        self._by_identity: WeakIdKeyDictionary = WeakIdKeyDictionary()

    @staticmethod
    def _key(tensor: torch.Tensor) -> tuple | None:
        """(storage pointer, offset, shape, strides, dtype), or None where there is no plain storage."""
        if type(tensor) is not torch.Tensor and not isinstance(tensor, torch.nn.Parameter):
            return None
        try:
            storage = tensor.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return None
        # StorageWeakRef hashes and compares by the storage's address
        return (StorageWeakRef(storage), tensor.storage_offset(), tuple(tensor.shape), tensor.stride(), tensor.dtype)

    def __setitem__(self, tensor: torch.Tensor, value: Value) -> None:
        key = self._key(tensor)
        if key is None:
            self._by_identity[tensor] = value
            return
        self._forget_expired()
        self._by_data[key] = (key[0], value)

    def get(self, tensor: torch.Tensor, default: Value | None = None) -> Value | None:
        key = self._key(tensor)
        if key is None:
            return self._by_identity.get(tensor, default)
        entry = self._by_data.get(key)
        if entry is None or entry[0].expired():
            return default
        return entry[1]

    def __getitem__(self, tensor: torch.Tensor) -> Value:
        marked = self.get(tensor, _UNMARKED)  # type: ignore[arg-type]
        if marked is _UNMARKED:
            raise KeyError("tensor is not marked")
        return marked  # type: ignore[return-value]

    def __len__(self) -> int:
        self._forget_expired()
        return len(self._by_data) + len(self._by_identity)

    def _forget_expired(self) -> None:
        expired = [key for key, (reference, _) in self._by_data.items() if reference.expired()]
        for key in expired:
            del self._by_data[key]


_UNMARKED = object()


__all__ = [
    "PENDING_FOLD",
    "STATE_ATTR",
    "ElasticPath",
    "HostHistogram",
    "ReplayWording",
    "RouterState",
    "TensorMarks",
    "checked_replay",
    "ensure_state",
    "state_of",
]
