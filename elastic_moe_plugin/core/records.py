"""Routing records and κ histograms of elastic routers, and the one front end both doors read them through.

After every training forward an elastic router's state (:class:`~.router_state.RouterState`)
holds what it routed and a running κ histogram [b+1] (index = κ) since the last reset; here they
become :class:`RoutingRecord` objects, built at the first read, and
:mod:`~elastic_moe_plugin.core.metrics` turns them into logged scalars only when a logger asks.

The front end. An adapter only enumerates its routers, as :class:`RouterSite` rows in model order
(transformers: the covered router classes, tagged with ``layer_idx``; Megatron: every decoder-layer
``TopKRouter`` of every model chunk, MTP routers left out). Everything read off those rows is
written once, here and in :func:`elastic_moe_plugin.core.metrics.model_routing_metrics`:

- :func:`routing_records`, :func:`budget_histograms`, :func:`reset_budget_histograms`;
- :func:`static_layers`: the routers that ran a training forward as stock top-k;
- :func:`model_plans`: every router's training plan, for the start-up plan line
  (:func:`.plan.log_plan`).

One rule keys them all by layer: a router's layer index is the one its adapter knows (Megatron's
``layer_number - 1``, transformers' ``layer_idx``), else its position among the enumerated routers.
Where a layer legitimately holds several routers (ERNIE-4.5-VL's text and vision routers, the
encoder and decoder stacks of DiffusionGemma), the adapter names each one's part
(:attr:`RouterSite.part`) and every key of the model becomes a :class:`RouterKey` (layer, part);
two routers with one index and no part to tell them apart are an error naming both (routers tagged
with another router's layer number).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, TypeVar, cast

import numpy as np
import torch

from elastic_moe_plugin.core.config import ElasticConfig
from elastic_moe_plugin.core.layer_keys import LayerKey, RouterKey
from elastic_moe_plugin.core.plan import LayerPlan
from elastic_moe_plugin.core.router_state import STATE_ATTR, HostHistogram, RouterState
from elastic_moe_plugin.core.schedule import BudgetSchedule


class RoutingRecord:
    """What one elastic router did in its latest training forward, detached: the record
    ``docs/gates.md#gate-conventions`` asks for.

    Attributes:
        budgets: LongTensor [T], the realised κ per token.
        expert_ids: LongTensor [T, b], selected experts sorted by router rank, −1 beyond κ_t.
        retained_weight_sums: Tensor [T], Σ of the kept gate weights before any scaling factor
            (1 for ``renormalized``; < 1 for ``full_softmax``).
        capacity_dropped: BoolTensor [T, b], True where a selected slot of ``expert_ids`` was
            dropped by the capacity factor (Megatron's ``moe_expert_capacity_factor``); None when
            no capacity factor is set. ``expert_ids`` keep the selection before drops.
        budget_counts: κ's histogram [b+1] (int64 numpy, index = κ) of these T tokens when the host
            has it (κ drawn there: the draw's ``BudgetDraw.counts``), else None. With it, a log
            takes mean κ and the share κ ≠ k from the host instead of reducing κ on the device.

    A forward stores only what it already holds (:meth:`of_forward`: κ, the candidate ids, the
    kept mask and the gate weights, all detached references, no copy); ``expert_ids`` =
    ``where(kept, candidate_ids, −1)`` and ``retained_weight_sums`` = ``gate_weights.sum(−1)`` are
    computed when first read (a logging step), then kept. Read-only.
    """

    __slots__ = ("_candidate_ids", "_expert_ids", "_gate_weights", "_kept", "_retained_weight_sums", "budget_counts",
                 "budgets", "capacity_dropped")  # fmt: skip
    budgets: torch.Tensor
    capacity_dropped: torch.Tensor | None
    budget_counts: np.ndarray | None
    _candidate_ids: torch.Tensor | None
    _kept: torch.Tensor | None
    _gate_weights: torch.Tensor | None
    _expert_ids: torch.Tensor | None
    _retained_weight_sums: torch.Tensor | None

    def __init__(
        self,
        budgets: torch.Tensor,
        expert_ids: torch.Tensor,
        retained_weight_sums: torch.Tensor,
        capacity_dropped: torch.Tensor | None = None,
    ) -> None:
        """A record from its read forms (tests, synthetic records); a forward uses :meth:`of_forward`."""
        self._set(
            budgets=budgets,
            capacity_dropped=capacity_dropped,
            budget_counts=None,
            _candidate_ids=None,
            _kept=None,
            _gate_weights=None,
            _expert_ids=expert_ids,
            _retained_weight_sums=retained_weight_sums,
        )

    @classmethod
    def of_forward(
        cls,
        budgets: torch.Tensor,
        candidate_ids: torch.Tensor,
        kept: torch.Tensor,
        gate_weights: torch.Tensor | None = None,
        *,
        retained_weight_sums: torch.Tensor | None = None,
        capacity_dropped: torch.Tensor | None = None,
        budget_counts: np.ndarray | None = None,
    ) -> RoutingRecord:
        """The record of one forward, from what the forward holds (nothing computed or copied; the
        float tensors detached, the integer and bool ones, which cannot require grad, as they are).

        Args:
            budgets: κ [T]; candidate_ids: [T, b] by router rank; kept: [T, b] bool, j < κ_t.
            gate_weights: [T, b] kept gate weights before any scaling factor (0 beyond κ_t), or
                None with ``retained_weight_sums`` [T] given instead (a caller that has the sums).
            capacity_dropped: [T, b] bool, or None without a capacity factor.
            budget_counts: κ's histogram [b+1] (int64 numpy) when the host has it, else None.
        """
        if (gate_weights is None) == (retained_weight_sums is None):
            raise TypeError(
                "RoutingRecord.of_forward takes exactly one of gate_weights [T, b] and retained_weight_sums [T]."
            )
        record = cls.__new__(cls)
        # κ, ids and masks are integer / bool tensors, which never require grad: stored as they are
        # (a detach() is one op, and on a CPU runtime each tensor attribute read is a Python call)
        assign = object.__setattr__
        assign(record, "budgets", budgets)
        assign(record, "capacity_dropped", capacity_dropped)
        assign(record, "budget_counts", budget_counts)
        assign(record, "_candidate_ids", candidate_ids)
        assign(record, "_kept", kept)
        assign(record, "_gate_weights", None if gate_weights is None else gate_weights.detach())
        assign(record, "_expert_ids", None)
        assign(record, "_retained_weight_sums", None if retained_weight_sums is None else retained_weight_sums.detach())
        return record

    def _set(self, **values: Any) -> None:
        for name, value in values.items():
            object.__setattr__(self, name, value)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"RoutingRecord is read-only (cannot set {name!r})")

    def __reduce__(self):
        # copy.deepcopy / pickle of a module that holds a record (read-only: no default setattr path)
        return _restore_record, tuple(getattr(self, name) for name in self.__slots__)

    @property
    def expert_ids(self) -> torch.Tensor:
        """LongTensor [T, b]: the candidate ids, −1 beyond κ_t (computed at the first read)."""
        if self._expert_ids is None:
            candidate_ids, kept = self._forward_slots()
            object.__setattr__(self, "_expert_ids", torch.where(kept, candidate_ids, -1))
        assert self._expert_ids is not None  # set just now, or a read-form record's own
        return self._expert_ids

    @property
    def retained_weight_sums(self) -> torch.Tensor:
        """Tensor [T]: Σ of the kept gate weights (computed at the first read)."""
        if self._retained_weight_sums is None:
            assert self._gate_weights is not None  # a record holds one of the two
            object.__setattr__(self, "_retained_weight_sums", self._gate_weights.sum(dim=-1))
        assert self._retained_weight_sums is not None
        return self._retained_weight_sums

    @property
    def candidate_ids(self) -> torch.Tensor:
        """LongTensor [T, b]: the b = high candidates of every token by router rank, kept or not
        (a record a forward made; a read-form record has only :attr:`expert_ids`)."""
        return self._forward_slots()[0]

    def _forward_slots(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(candidate ids [T, b], kept [T, b]) of a record a forward made (:meth:`of_forward`)."""
        assert self._candidate_ids is not None and self._kept is not None, "a read-form record has no slots"
        return self._candidate_ids, self._kept

    def __repr__(self) -> str:
        return f"RoutingRecord(tokens={self.budgets.numel()}, width={self.expert_ids.shape[-1]})"

    def stack_key(self) -> tuple:
        """Records with one key stack into one [L, T, b] batch (:func:`stacked_records`): T, b, the
        device, whether the record holds the forward's own tensors or its read forms, and whether
        the host has its κ histogram."""
        ids = self._forward_slots()[0] if self._kept is not None else self.expert_ids
        weights = self._gate_weights if self._gate_weights is not None else self.retained_weight_sums
        forward_form = (self._kept is not None, self._gate_weights is not None)
        return (tuple(ids.shape), ids.device, *forward_form, weights.dtype, self.budget_counts is not None)


def stacked_records(
    records: Sequence[RoutingRecord], *, with_budgets: bool = True
) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(κ [L, T], expert ids [L, T, b], selected [L, T, b] bool, retained weight sums [L, T])`` of
    L records with one :meth:`RoutingRecord.stack_key`: a handful of stacks for the whole batch
    instead of each record's own ``where`` and ``sum`` (a log of a 48-layer model reads them all at
    once). Where ``selected`` is False an id is a valid expert that was not selected (the candidate
    beyond κ; 0 for a read-form record's −1), so that the ids index per-expert bins as they are.
    κ is None unless ``with_budgets`` (a caller with the host's κ histograms needs no κ stack)."""
    first = records[0]
    budgets = torch.stack([record.budgets for record in records]) if with_budgets else None
    if first._kept is not None:
        slots = [record._forward_slots() for record in records]
        ids = torch.stack([candidate_ids for candidate_ids, _ in slots])
        selected = torch.stack([kept for _, kept in slots])
    else:
        ids = torch.stack([record.expert_ids for record in records])
        selected = ids >= 0
        ids = ids.clamp(min=0)  # a valid expert under every unselected slot, as the candidates are
    gate_weights = [record._gate_weights for record in records]
    if all(weights is not None for weights in gate_weights):
        sums = torch.stack([weights for weights in gate_weights if weights is not None]).sum(dim=-1)
    else:
        sums = torch.stack([record.retained_weight_sums for record in records])
    return budgets, ids, selected, sums


def _restore_record(*values: Any) -> RoutingRecord:
    record = RoutingRecord.__new__(RoutingRecord)
    record._set(**dict(zip(RoutingRecord.__slots__, values, strict=True)))
    return record


V = TypeVar("V")


@dataclasses.dataclass(frozen=True)
class RouterSite:
    """One MoE router as its adapter enumerates it.

    Attributes:
        name: the router's qualified module name (error messages name it).
        router: the module; its :class:`~.router_state.RouterState` holds what the readers read.
        layer_index: the 0-based decoder-layer index the adapter knows, or None (then the router's
            position among the enumerated routers stands in).
        topk: k, the router's static top-k (what a static layer routes with).
        num_experts: E.
        part: what tells this router from the others of its layer, where its layer holds several
            (the differing part of their module paths); None for a layer's only router.
        static: the router cannot rank (DeepSeek-V4's hash-routed layers): its layer is static by
            construction, never patched, and read as a static layer once the model has trained.
    """

    name: str
    router: torch.nn.Module
    layer_index: int | None
    topk: int
    num_experts: int
    part: str | None = None
    static: bool = False


# ---------------------------------------------------------------------------------- by layer
def keyed_sites(sites: Sequence[RouterSite]) -> Iterator[tuple[LayerKey, RouterSite]]:
    """``(key, site)`` in model order: the layer index, ``site.layer_index``, else the site's
    position; a :class:`RouterKey` (layer, part) for every site where some site names a part."""
    keyed = any(site.part for site in sites)
    for position, site in enumerate(sites):
        index = position if site.layer_index is None else site.layer_index
        yield (RouterKey(index, site.part or "") if keyed else index), site


def layer_indexed(values: Mapping[LayerKey, V]) -> dict[int, V]:
    """``values`` keyed by plain layer indices, for an adapter whose layers hold one router each
    (Megatron: its sites name no part, so no :class:`RouterKey` can occur).

    Raises:
        TypeError: a key is a :class:`RouterKey`.
    """
    for key in values:
        if not isinstance(key, int):
            raise TypeError(f"layer key {key} names a router part, but this adapter keys by layer index")
    return cast(dict[int, V], dict(values))


def _by_layer(entries: Iterable[tuple[LayerKey, RouterSite, Any]]) -> dict[Any, Any]:
    """``{key: value}`` from ``(key, site, value)`` rows, sorted by key.

    Raises:
        ValueError: two rows have one index (the message names both routers).
    """
    values: dict[LayerKey, Any] = {}
    names: dict[LayerKey, str] = {}
    for index, site, value in entries:
        if index in values:
            raise ValueError(
                f"routers {names[index]!r} and {site.name!r} both have decoder-layer index {index}, and nothing in "
                f"their module paths tells them apart (a router tagged with another's layer number, or without "
                f"one). Set each router's own layer number (hf.set_layer_index, or Megatron's layer_number)."
            )
        values[index] = value
        names[index] = site.name
    return dict(sorted(values.items()))


def _states(sites: Sequence[RouterSite]) -> Iterator[tuple[LayerKey, RouterSite, RouterState]]:
    for index, site in keyed_sites(sites):
        state = site.router.__dict__.get(STATE_ATTR)
        if state is not None:
            yield index, site, state


def latest_record(router: torch.nn.Module) -> RoutingRecord | None:
    """The :class:`RoutingRecord` of ``router``'s latest elastic training forward, None before one
    (built from its state at the first read, then kept until the next forward)."""
    state = router.__dict__.get(STATE_ATTR)
    if state is None or state.routed is None:
        return None
    if state.record is None:
        budgets, ids, kept, gate_weights, capacity_dropped, budget_counts = state.routed
        state.record = RoutingRecord.of_forward(
            budgets, ids, kept, gate_weights, capacity_dropped=capacity_dropped, budget_counts=budget_counts
        )
    return state.record


def routing_records(sites: Sequence[RouterSite]) -> dict[LayerKey, RoutingRecord]:
    """``{layer index: RoutingRecord}`` of the routers whose latest training forward was elastic.

    Raises:
        ValueError: two of those routers share a layer index.
    """
    return _by_layer(
        (index, site, latest_record(site.router)) for index, site, state in _states(sites) if state.routed is not None
    )


def _histograms(sites: Sequence[RouterSite]) -> dict[LayerKey, HostHistogram | torch.Tensor]:
    return _by_layer(
        (index, site, state.histogram) for index, site, state in _states(sites) if state.histogram is not None
    )


def budget_histograms(sites: Sequence[RouterSite]) -> dict[LayerKey, torch.Tensor]:
    """``{layer index: LongTensor [b+1]}``: κ counts (index = κ) since the last reset.

    Raises:
        ValueError: two routers holding a histogram share a layer index.
    """
    return {
        layer: torch.from_numpy(histogram.fold()) if isinstance(histogram, HostHistogram) else histogram
        for layer, histogram in _histograms(sites).items()
    }


def reset_budget_histograms(sites: Sequence[RouterSite]) -> None:
    """Zero the κ histograms in place, so the next log covers only the steps after this one."""
    for histogram in _histograms(sites).values():
        if isinstance(histogram, HostHistogram):
            histogram.zero()
        else:
            histogram.zero_()


def _resolved_plan(router: torch.nn.Module) -> tuple[bool, LayerPlan | None]:
    """``(True, plan)`` when ``router`` resolved a training plan (``plan`` None: it routed stock
    top-k), ``(False, None)`` before its first training forward under the patch."""
    state = router.__dict__.get(STATE_ATTR)
    return (False, None) if state is None or state.generation is None else (True, state.plan)


def static_layers(sites: Sequence[RouterSite]) -> dict[LayerKey, int]:
    """``{layer index: k}`` of the routers that ran a training forward as stock top-k (outside
    ``ElasticConfig.layers``, or a ``static`` schedule): their resolved plan is None; and, once
    another router has, of the routers that cannot rank (:attr:`RouterSite.static`).

    Raises:
        ValueError: two of those routers share a layer index.
    """
    rows, trained = [], False
    for index, site in keyed_sites(sites):
        resolved, plan = _resolved_plan(site.router)
        trained = trained or resolved
        if (resolved and plan is None) or site.static:
            rows.append((index, site, site.topk))
    return _by_layer([row for row in rows if trained or not row[1].static])


def trained_schedule(sites: Sequence[RouterSite]) -> tuple[BudgetSchedule, int] | None:
    """``(schedule, E)`` the routers trained with: the schedule of the first elastic router's cached
    plan (one model's routers share it) and its expert count; without one (every layer static, or no
    training forward yet), the point mass at the first static layer's k (else the first router's).
    None without routers."""
    for site in sites:
        _, plan = _resolved_plan(site.router)
        if plan is not None:
            return plan.schedule, site.num_experts
    if not sites:
        return None
    static = static_layers(sites)
    topk = next(iter(static.values())) if static else sites[0].topk
    return BudgetSchedule.static(topk), sites[0].num_experts


# ---------------------------------------------------------------------------------- plans
def model_plans(
    sites: Sequence[RouterSite],
    config: ElasticConfig | None,
    resolve_plan: Callable[[RouterSite], LayerPlan | None],
) -> tuple[dict[LayerKey, LayerPlan | None], dict[LayerKey, int]]:
    """``({layer index: training plan, None = stock top-k}, {layer index: k})`` of every router,
    resolved by the adapter's ``resolve_plan`` as a first training forward resolves it (nothing is
    cached; a router that cannot rank is None); ``({}, {})`` when ``config`` is None or disabled.

    Raises:
        ValueError: two routers share a layer index.
    """
    if config is None or not config.enabled:
        return {}, {}
    rows = [(index, site, None if site.static else resolve_plan(site)) for index, site in keyed_sites(sites)]
    plans = _by_layer(rows)
    return plans, {index: site.topk for index, site, _ in rows}


__all__ = [
    "HostHistogram",
    "LayerKey",
    "RouterKey",
    "RouterSite",
    "RoutingRecord",
    "budget_histograms",
    "keyed_sites",
    "latest_record",
    "layer_indexed",
    "model_plans",
    "reset_budget_histograms",
    "routing_records",
    "stacked_records",
    "static_layers",
    "trained_schedule",
]
