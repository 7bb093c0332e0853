"""Megatron's process-global MoE metrics tracker, one interface for megatron-core 0.16 to 0.19.

megatron-core 0.17 moved the tracker into ``moe_logging``: a ``MoEMetricsTracker`` object with
``record`` / ``report`` / ``clear``. 0.16 keeps a module-level dict in ``moe_utils``
(``{name: {"values": Tensor[num_layers], "reduce_group", "avg_group", ...}}``), filled by
``save_to_aux_losses_tracker`` and reported by ``track_moe_metrics``. Both size an entry at its
first record (``values`` has one slot per layer), so a model with another layer count needs
:func:`reset`, not :func:`zero`.

Every tool, test and script that reads or writes the tracker goes through this module.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import torch


@functools.lru_cache(maxsize=1)
def has_metrics_tracker() -> bool:
    """True on megatron-core >= 0.17 (``moe_logging.MoEMetricsTracker``), False on 0.16."""
    try:
        from megatron.core.transformer.moe import moe_logging  # noqa: F401
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


def record(name: str, value: torch.Tensor, layer_number: int, num_layers: int, dp_group: Any = None) -> None:
    """Add ``value`` at ``values[layer_number - 1]`` of ``name``, averaged over data parallelism when
    reported (0.17+: ``needs_dp_avg=True``; 0.16: ``avg_group=dp_group``, its only DP averaging)."""
    if has_metrics_tracker():
        from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

        get_moe_metrics_tracker().record(name, value, layer_number=layer_number, num_layers=num_layers,
                                         reduce_group=None, avg_group=None, needs_dp_avg=True)
        return
    from megatron.core.transformer.moe.moe_utils import save_to_aux_losses_tracker

    save_to_aux_losses_tracker(name, value, layer_number, num_layers, reduce_group=None, avg_group=dp_group)


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
        tracker[name] = {"values": torch.zeros(num_layers, device=device), "reduce_group": None,
                         "avg_group": None, "reduce_group_has_dp": False}


def report(names: list[str], iteration: int, *, writer: Any, wandb_writer: Any, per_layer_logging: bool,
           num_layers: int, pg_collection: Any = None) -> None:
    """Megatron's own report of ``names``: PP sum, DP average, mean over ``num_layers`` layers, written
    as ``<name>`` (and ``moe/<name>_layer_<i>``) to the writers; the reported entries are cleared."""
    if has_metrics_tracker():
        from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

        get_moe_metrics_tracker().report(
            loss_scale=1.0, iteration=iteration, writer=writer, wandb_writer=wandb_writer,
            per_layer_logging=per_layer_logging, track_names=names, num_layers=num_layers,
            pg_collection=pg_collection,
        )
        return
    from megatron.core.transformer.moe.moe_utils import track_moe_metrics

    track_moe_metrics(loss_scale=1.0, iteration=iteration, writer=writer, wandb_writer=wandb_writer,
                      per_layer_logging=per_layer_logging, track_names=names, num_layers=num_layers)


@contextlib.contextmanager
def isolated() -> Iterator[None]:
    """Run records and reports on a tracker of their own, leaving the global one (this step's aux
    losses) untouched: a report synchronises, writes and then clears every entry it holds."""
    if has_metrics_tracker():
        from megatron.core.transformer.moe import moe_logging

        saved = moe_logging.get_moe_metrics_tracker()
        moe_logging.set_moe_metrics_tracker(moe_logging.MoEMetricsTracker())
        try:
            yield
        finally:
            moe_logging.set_moe_metrics_tracker(saved)
        return
    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

    tracker = get_moe_layer_wise_logging_tracker()  # a module-global dict, mutated in place
    saved = dict(tracker)
    tracker.clear()
    try:
        yield
    finally:
        tracker.clear()
        tracker.update(saved)


__all__ = ["ensure", "entries", "has_metrics_tracker", "isolated", "record", "report", "reset", "values", "zero"]
