"""Megatron's process-global MoE metrics tracker, one interface for megatron-core 0.16 to 0.19.

megatron-core 0.17 moved the tracker into ``moe_logging``: a ``MoEMetricsTracker`` object with
``record`` / ``report`` / ``clear``. 0.16 keeps a module-level dict in ``moe_utils``
(``{name: {"values": Tensor[num_layers], "reduce_group", "avg_group", ...}}``), filled by
``save_to_aux_losses_tracker`` and reported by ``track_moe_metrics``. Both size an entry at its
first record (``values`` has one slot per layer), so a model with another layer count needs
:func:`reset`, not :func:`zero`.

Every tool, test and script that reads or writes the tracker goes through this module.

Reports on a tracker of our own (:func:`isolated`) synchronise all their entries in one go:
Megatron's report all-reduces each entry by itself (a pipeline sum and a data-parallel average per
name: 62 collectives for the 31 routing metrics of a logging step), :func:`isolated` packs the
entries that reduce alike into one tensor and hands that to Megatron's own reduction (2
collectives). The reduction is elementwise, so each value is what the per-entry reduction gives.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from elastic_moe_plugin.core.patching import AttributePatches


@functools.lru_cache(maxsize=1)
def has_metrics_tracker() -> bool:
    """True on megatron-core >= 0.17 (``moe_logging.MoEMetricsTracker``), False on 0.16."""
    try:
        from megatron.core.transformer.moe import moe_logging  # noqa: F401 (importing it is the probe)
    except ImportError:
        return False
    return True


def entries() -> dict[str, torch.Tensor]:
    """``{name: values [num_layers]}`` of every entry, the live tensors (not copies)."""
    if has_metrics_tracker():
        from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

        return {name: entry.values for name, entry in get_moe_metrics_tracker().metrics.items()}
    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

    return {name: entry["values"] for name, entry in get_moe_layer_wise_logging_tracker().items()}


def values(name: str) -> torch.Tensor | None:
    """A detached copy of the per-layer values [num_layers] of ``name``, or None if never recorded."""
    found = entries().get(name)
    return None if found is None else found.detach().clone()


def reset() -> None:
    """Forget every entry; the next record sizes it again (for a model with another layer count)."""
    if has_metrics_tracker():
        from megatron.core.transformer.moe.moe_logging import destroy_moe_metrics_tracker

        destroy_moe_metrics_tracker()
        return
    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

    get_moe_layer_wise_logging_tracker().clear()


def zero() -> None:
    """Zero every entry's values and keep its sizing, as Megatron's training loop does per step."""
    if has_metrics_tracker():
        from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

        get_moe_metrics_tracker().clear()
        return
    from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker

    clear_aux_losses_tracker()


def record_layers(
    name: str, layer_values: torch.Tensor, layer_numbers: Sequence[int], num_layers: int, dp_group: Any = None
) -> None:
    """Add ``layer_values`` [n] (on the entry's device) at ``values[layer_numbers[i] - 1]`` of
    ``name``, by one indexed add, averaged over data parallelism when reported (0.17+:
    ``needs_dp_avg=True``; 0.16: ``avg_group=dp_group``, its only DP averaging)."""
    index = torch.tensor([number - 1 for number in layer_numbers], dtype=torch.long, device=layer_values.device)
    layer_values = layer_values.detach()
    if has_metrics_tracker():
        from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

        tracker = get_moe_metrics_tracker()
        tracker.ensure_initialized(name, num_layers, device=layer_values.device)
        entry = tracker.metrics[name]
        entry.values.index_add_(0, index, layer_values.to(entry.values.dtype))
        entry.reduce_group, entry.avg_group, entry.needs_dp_avg = None, None, True  # what record() sets
        return
    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

    tracker = get_moe_layer_wise_logging_tracker()
    if name not in tracker:
        tracker[name] = {"values": torch.zeros(num_layers, device=layer_values.device)}
    values = tracker[name]["values"]
    values.index_add_(0, index, layer_values.to(values.dtype))
    tracker[name].update(reduce_group=None, avg_group=dp_group, reduce_group_has_dp=False)  # what 0.16 saves


def ensure(name: str, num_layers: int, device: Any) -> None:
    """Create ``name`` with zero values [num_layers] unless it exists (Megatron's own
    ``force_initialize``, without tying the entry's size to the report's layer count). Every rank
    must report the same names: a report all-reduces each entry it holds, so a rank that lacks one
    (a pipeline stage without the layers that record it) would leave the others waiting."""
    if has_metrics_tracker():
        from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

        get_moe_metrics_tracker().ensure_initialized(name, num_layers, device=device)
        return
    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

    tracker = get_moe_layer_wise_logging_tracker()
    if name not in tracker:
        tracker[name] = {
            "values": torch.zeros(num_layers, device=device),
            "reduce_group": None,
            "avg_group": None,
            "reduce_group_has_dp": False,
        }


def report(
    names: list[str],
    iteration: int,
    *,
    writer: Any,
    wandb_writer: Any,
    per_layer_logging: bool,
    num_layers: int,
    pg_collection: Any = None,
) -> None:
    """Megatron's own report of ``names``: PP sum, DP average, mean over ``num_layers`` layers, written
    as ``<name>`` (and ``moe/<name>_layer_<i>``) to the writers; the reported entries are cleared."""
    if has_metrics_tracker():
        from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

        get_moe_metrics_tracker().report(
            loss_scale=1.0,
            iteration=iteration,
            writer=writer,
            wandb_writer=wandb_writer,
            per_layer_logging=per_layer_logging,
            track_names=names,
            num_layers=num_layers,
            pg_collection=pg_collection,
        )
        return
    from megatron.core.transformer.moe.moe_utils import track_moe_metrics

    track_moe_metrics(
        loss_scale=1.0,
        iteration=iteration,
        writer=writer,
        wandb_writer=wandb_writer,
        per_layer_logging=per_layer_logging,
        track_names=names,
        num_layers=num_layers,
    )


#: the one tracker entry a packed synchronisation hands to Megatron's reduction
PACKED_ENTRY = "elastic_moe/_packed_for_sync"


def _packed_sync(
    names: Sequence[str],
    entries: dict[str, Any],
    values_of: Callable[[Any], torch.Tensor],
    reduction_of: Callable[[Any], tuple],
    with_packed: Callable[[Any, torch.Tensor], Any],
    reduce: Callable[[dict[str, Any]], None],
) -> None:
    """Reduce ``entries`` (``{name: entry}``, Megatron's, mutated in place) in as few collectives as
    the stock reduction allows: the entries of ``names`` are grouped by how they reduce
    (``reduction_of``), each group's values are concatenated, and ``reduce`` runs Megatron's own
    reduction on a table holding only that packed entry (``with_packed(first entry, packed)``).
    Groups go in the order of ``names``, which every rank passes alike, so the collectives match."""
    groups: dict[tuple, list[str]] = {}
    for name in names:
        if name in entries:
            entry = entries[name]
            values = values_of(entry)
            groups.setdefault((*map(id, reduction_of(entry)), values.dtype, values.device), []).append(name)
    for members in groups.values():
        parts = [values_of(entries[name]) for name in members]
        packed = torch.cat(parts) if len(parts) > 1 else parts[0]
        reduce({PACKED_ENTRY: with_packed(entries[members[0]], packed)})
        if len(parts) > 1:
            for part, reduced in zip(parts, packed.split([part.numel() for part in parts]), strict=True):
                part.copy_(reduced)


@functools.lru_cache(maxsize=1)
def _packed_tracker_class():
    """A ``MoEMetricsTracker`` whose ``_sync_metrics`` reduces its entries packed (module docstring);
    Megatron's own class where it has no ``_sync_metrics`` to override."""
    from megatron.core.transformer.moe.moe_logging import MoEMetricsTracker

    stock_sync = vars(MoEMetricsTracker).get("_sync_metrics")
    # the override hands the packed table over as self._metrics: only for the signature it knows
    if stock_sync is None or list(inspect.signature(stock_sync).parameters) != [
        "self",
        "metric_names",
        "pg_collection",
    ]:
        return MoEMetricsTracker

    class PackedSyncMoEMetricsTracker(MoEMetricsTracker):
        def _sync_metrics(self, metric_names, pg_collection=None):
            entries = self._metrics

            def reduce(table):
                self._metrics = table
                try:
                    stock_sync(self, list(table), pg_collection)
                finally:
                    self._metrics = entries

            _packed_sync(
                metric_names,
                entries,
                values_of=lambda entry: entry.values,
                reduction_of=lambda entry: (entry.reduce_group, entry.avg_group, entry.needs_dp_avg),
                with_packed=lambda entry, packed: dataclasses.replace(entry, values=packed),
                reduce=reduce,
            )

    return PackedSyncMoEMetricsTracker


@contextlib.contextmanager
def isolated() -> Iterator[None]:
    """Run records and reports on a tracker of their own, leaving the global one (this step's aux
    losses) untouched: a report synchronises, writes and then clears every entry it holds. The
    report inside synchronises packed (module docstring)."""
    if has_metrics_tracker():
        from megatron.core.transformer.moe import moe_logging

        saved = moe_logging.get_moe_metrics_tracker()
        moe_logging.set_moe_metrics_tracker(_packed_tracker_class()())
        try:
            yield
        finally:
            moe_logging.set_moe_metrics_tracker(saved)
        return
    from megatron.core.transformer.moe import moe_utils

    tracker = moe_utils.get_moe_layer_wise_logging_tracker()  # a module-global dict, mutated in place
    saved = dict(tracker)
    tracker.clear()
    # track_moe_metrics looks its reduction up in the module at call time
    patches = AttributePatches()
    patches.wrap(
        moe_utils, "reduce_aux_losses_tracker_across_ranks", functools.partial(_packed_dict_reduction, tracker)
    )
    try:
        yield
    finally:
        patches.restore()
        tracker.clear()
        tracker.update(saved)


def _packed_dict_reduction(tracker: dict, stock_reduce: Callable) -> Callable:
    """megatron-core 0.16's ``reduce_aux_losses_tracker_across_ranks`` over ``tracker`` (its
    module-global dict), packed (module docstring)."""

    def reduce_aux_losses_tracker_across_ranks(track_names=None, pg_collection=None):
        entries = dict(tracker)

        def reduce(table):
            tracker.clear()
            tracker.update(table)
            try:
                stock_reduce(list(table), pg_collection=pg_collection)
            finally:
                tracker.clear()
                tracker.update(entries)

        _packed_sync(
            list(entries) if track_names is None else list(track_names),
            entries,
            values_of=lambda entry: entry["values"],
            reduction_of=lambda entry: (
                entry.get("reduce_group"),
                entry.get("avg_group"),
                entry.get("reduce_group_has_dp", False),
            ),
            with_packed=lambda entry, packed: {**entry, "values": packed},
            reduce=reduce,
        )

    return reduce_aux_losses_tracker_across_ranks


__all__ = [
    "PACKED_ENTRY",
    "ensure",
    "entries",
    "has_metrics_tracker",
    "isolated",
    "record_layers",
    "report",
    "reset",
    "values",
    "zero",
]
