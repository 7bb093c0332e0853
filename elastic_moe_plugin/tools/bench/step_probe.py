"""The bench's step probe: it wraps one Megatron trainer's ``train_step`` (``elastic-moe bench --only e2e``).

Switched on in the children of the bench's ``megatron sft`` and Megatron-LM runs by the child
bootstrap (:mod:`elastic_moe_plugin.tools.child_bootstrap`, feature ``step_probe``) and configured
by its own variables; :func:`install` does nothing unless one of them is set. It wraps the
trainer's ``train_step`` as soon as its module is imported (``$E2E_BENCH_TARGET``: ``megatron_lm``
for ``megatron.training.training.train_step``, ``megatron_swift`` for
``swift.megatron.trainers.base.BaseMegatronTrainer.train_step``, or any ``module:function``),
through the package's one import finder (:mod:`elastic_moe_plugin.core.import_hooks`); one call
is one training iteration (every micro-batch's forward and backward, the optimizer step).

- ``E2E_BENCH_SYNC_STEP=n`` (separate runs): call ``n`` runs under
  :class:`~elastic_moe_plugin.tools.bench.measure.SyncCounter`; rank 0 writes ``{"syncs": count}``
  to ``$E2E_BENCH_SYNC_OUT``.
- ``E2E_BENCH_INTERLEAVE_BLOCK=b`` (interleaved runs: static and elastic in this one process): the
  run starts elastic; calls alternate in blocks of ``b`` between stock routing (calls 1..b:
  ``mcore.remove()``) and elastic routing (calls b+1..2b: ``mcore.apply`` of the run's own
  :class:`~elastic_moe_plugin.ElasticConfig`), and so on. Iteration i lasts from the start of call
  i to the start of call i + 1, so it includes the trainer's logging step after ``train_step``; the
  switch runs between the two, outside every iteration's time. With ``E2E_BENCH_SYNC_STEP=w`` (the
  warm-up), the first call of each mode after call w runs under the sync counter, untimed (the
  counter's own cost). Every block starts with ``gc.freeze()``: the objects alive then are left
  out of the garbage collector's later passes, so a full collection (long over a trainer's many
  objects, docs/performance.md; landing in whichever block it lands) does not decide a block pair;
  it costs both modes alike what the objects of their own steps cost. Rank 0 writes
  ``{"block": b, "iterations": [[i, "static" | "elastic", seconds or null], ...],
  "syncs": {"static": n, "elastic": n}}`` to ``$E2E_BENCH_INTERLEAVE_OUT`` at exit (null: a
  sync-counted call, and the last call, which no call follows).

Standard library only at import (the frameworks are imported when a wrapped call first runs).
"""

from __future__ import annotations

import atexit
import functools
import gc
import json
import os
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from elastic_moe_plugin.core.config import ElasticConfig

TARGETS = {  # target -> (module, class or None, function)
    "megatron_lm": ("megatron.training.training", None, "train_step"),
    "megatron_swift": ("swift.megatron.trainers.base", "BaseMegatronTrainer", "train_step"),
}
MODES = ("static", "elastic")  # block 0, 1, 2, ... alternate in this order


def _is_rank_zero() -> bool:
    return os.environ.get("RANK", "0") == "0"


def _counted(function, step: int, out: str):
    calls = [0]

    @functools.wraps(function)
    def train_step(*args, **kwargs):
        calls[0] += 1
        if calls[0] != step or not _is_rank_zero():
            return function(*args, **kwargs)
        from elastic_moe_plugin.tools.bench.measure import SyncCounter

        with SyncCounter() as counter:
            result = function(*args, **kwargs)
        with open(out, "w") as sink:
            json.dump({"syncs": counter.count}, sink)
        return result

    return train_step


class _Interleaving:
    """Switches routing between blocks of calls, times every call, counts the syncs of each mode's
    first call after the warm-up."""

    def __init__(self, block: int, out: str, warmup: int = 0) -> None:
        self.block, self.out, self.warmup = block, out, warmup
        self.calls = 0
        self.config: ElasticConfig | None = None
        self.starts: list[tuple[int, str, float, bool]] = []  # (call, mode, start, sync-counted)
        self.ends: list[float] = []  # the end of call i's iteration: call i + 1 entered, before its switch
        self.syncs: dict[str, int] = {}
        atexit.register(self.write)

    def mode(self, call: int) -> str:
        return MODES[((call - 1) // self.block) % 2]

    def switch(self, mode: str) -> None:
        from elastic_moe_plugin import mcore

        if self.config is None:
            self.config = mcore.active_config()
            if self.config is None:
                raise RuntimeError(
                    "E2E_BENCH_INTERLEAVE_BLOCK needs a run that starts elastic (mcore.apply "
                    "before the first training step); this one has no active ElasticConfig."
                )
        if mode == "elastic" and not mcore.is_applied():
            mcore.apply(self.config)
        elif mode == "static" and mcore.is_applied():
            mcore.remove()

    def wrap(self, function):
        @functools.wraps(function)
        def train_step(*args, **kwargs):
            entered = time.perf_counter()
            if self.starts:
                self.ends.append(entered)
            self.calls += 1
            call, mode = self.calls, self.mode(self.calls)
            first_of_block = (call - 1) % self.block == 0
            self.switch(mode)
            if first_of_block:
                gc.freeze()
            counted = first_of_block and call > self.warmup and mode not in self.syncs
            self.starts.append((call, mode, time.perf_counter(), counted))
            if not counted:
                return function(*args, **kwargs)
            from elastic_moe_plugin.tools.bench.measure import SyncCounter

            with SyncCounter() as counter:
                result = function(*args, **kwargs)
            self.syncs[mode] = counter.count
            return result

        return train_step

    def write(self) -> None:
        if not _is_rank_zero() or not self.starts:
            return
        rows = []
        for index, (call, mode, start, counted) in enumerate(self.starts):
            seconds = None if counted or index >= len(self.ends) else self.ends[index] - start
            rows.append([call, mode, seconds])
        with open(self.out, "w") as sink:
            json.dump({"block": self.block, "iterations": rows, "syncs": self.syncs}, sink)


def _wrap_on_import(module: str, owner, function: str, wrap) -> None:
    """Replace ``module[.owner].function`` by ``wrap(function)`` right after ``module``'s body has run,
    through the package's one import finder (the module is imported later, by the trainer)."""
    from elastic_moe_plugin.core.import_hooks import IMPORT_HOOKS

    def wrap_function(imported) -> None:
        holder = getattr(imported, owner) if owner else imported
        setattr(holder, function, wrap(getattr(holder, function)))

    IMPORT_HOOKS.after_import(module, wrap_function)


def _target(name: str) -> tuple:
    """A named target, or ``module:function`` / ``module:Class.function`` (tests' stand-in trainers)."""
    if name in TARGETS:
        return TARGETS[name]
    module, _, qualified = name.partition(":")
    owner, _, function = qualified.rpartition(".")
    return module, owner or None, function


def install(environ: Mapping[str, str]) -> None:
    """Wrap the target's ``train_step`` as ``environ``'s ``E2E_BENCH_*`` variables say (nothing when
    neither ``E2E_BENCH_SYNC_STEP`` nor ``E2E_BENCH_INTERLEAVE_BLOCK`` is set)."""
    step, block = environ.get("E2E_BENCH_SYNC_STEP"), environ.get("E2E_BENCH_INTERLEAVE_BLOCK")
    if not step and not block:
        return
    module, owner, function = _target(environ["E2E_BENCH_TARGET"])
    if block:
        wrap = _Interleaving(int(block), environ["E2E_BENCH_INTERLEAVE_OUT"], int(step or 0)).wrap
    else:
        wrap = functools.partial(_counted, step=int(step or 0), out=environ["E2E_BENCH_SYNC_OUT"])
    _wrap_on_import(module, owner, function, wrap)


__all__ = ["MODES", "TARGETS", "install"]
