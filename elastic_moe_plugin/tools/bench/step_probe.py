"""The bench's step probe: it wraps one trainer's ``train_step`` (``elastic-moe bench --only e2e``).

Switched on in the children of the bench's ``megatron sft``, Megatron-LM and torchtitan runs by the
child bootstrap (:mod:`elastic_moe_plugin.tools.child_bootstrap`, feature ``step_probe``) and
configured by its own variables; :func:`install` does nothing unless one of them is set. It wraps
the trainer's ``train_step`` as soon as its module is imported (``$E2E_BENCH_TARGET``:
``megatron_lm`` for ``megatron.training.training.train_step``, ``megatron_swift`` for
``swift.megatron.trainers.base.BaseMegatronTrainer.train_step``, ``torchtitan`` for
``torchtitan.trainer.Trainer.train_step``, or any ``module:function``), through the package's one
import finder (:mod:`elastic_moe_plugin.core.import_hooks`); one call is one training iteration
(every micro-batch's forward and backward, the optimizer step, the step's logging where the
trainer logs inside it, as torchtitan does).

- ``E2E_BENCH_SYNC_STEP=n`` (separate runs): call ``n`` runs under
  :class:`~elastic_moe_plugin.tools.bench.measure.SyncCounter`; rank 0 writes ``{"syncs": count}``
  to ``$E2E_BENCH_SYNC_OUT``.
- ``E2E_BENCH_INTERLEAVE_BLOCK=b`` (interleaved runs: static and elastic in this one process): the
  run starts elastic; calls alternate in blocks of ``b`` between static routing (calls 1..b) and
  elastic routing (calls b+1..2b: the door's ``apply`` of the run's own
  :class:`~elastic_moe_plugin.ElasticConfig`), and so on. Static is the target's door's
  (:data:`DOORS`; ``$E2E_BENCH_DOOR`` for a ``module:function`` target, default ``mcore``): for
  ``mcore``, stock routing (``mcore.remove()``); for ``titan``, the door applied with the run's
  config at ``schedule="static"``, whose MoE forward is torchtitan's own (bit for bit:
  ``tests/titan/test_titan_trainer.py``) and whose metrics log every layer at κ = k; the switch
  is a class-level re-patch, which each MoE layer resolves at its next forward (the patch
  generation). Iteration i lasts from the start of call
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
    "torchtitan": ("torchtitan.trainer", "Trainer", "train_step"),
}
#: the door an interleaved run of a target switches (``$E2E_BENCH_DOOR`` for a ``module:function`` one)
DOORS = {"megatron_lm": "mcore", "megatron_swift": "mcore", "torchtitan": "titan"}
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

    def __init__(self, block: int, out: str, warmup: int = 0, door: str = "mcore") -> None:
        if door not in ("mcore", "titan"):
            raise ValueError(f"E2E_BENCH_DOOR={door!r}: expected mcore or titan.")
        self.block, self.out, self.warmup, self.door = block, out, warmup, door
        self.calls = 0
        self.config: ElasticConfig | None = None
        self.static_config: ElasticConfig | None = None  # titan: the run's config at schedule "static"
        self.starts: list[tuple[int, str, float, bool]] = []  # (call, mode, start, sync-counted)
        self.ends: list[float] = []  # the end of call i's iteration: call i + 1 entered, before its switch
        self.syncs: dict[str, int] = {}
        atexit.register(self.write)

    def mode(self, call: int) -> str:
        return MODES[((call - 1) // self.block) % 2]

    def switch(self, mode: str) -> None:
        if self.door == "titan":
            self._switch_titan(mode)
            return
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

    def _switch_titan(self, mode: str) -> None:
        import dataclasses

        from elastic_moe_plugin import titan

        if self.config is None:
            self.config = titan.active_config()
            if self.config is None:
                raise RuntimeError(
                    "E2E_BENCH_INTERLEAVE_BLOCK needs a run that starts elastic (--override.imports "
                    "elastic_moe_plugin.titan.elastic_moe=...); this one has no active ElasticConfig."
                )
            self.static_config = dataclasses.replace(self.config, schedule="static")
            if titan.trainer.is_elastic(self.static_config):  # top-p routing has no static schedule
                raise RuntimeError(f"E2E_BENCH_INTERLEAVE_BLOCK: {self.config} has no static counterpart.")
        titan.apply(self.static_config if mode == "static" else self.config)  # a no-op within a block

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
    target = environ["E2E_BENCH_TARGET"]
    module, owner, function = _target(target)
    if block:
        door = environ.get("E2E_BENCH_DOOR") or DOORS.get(target, "mcore")
        wrap = _Interleaving(int(block), environ["E2E_BENCH_INTERLEAVE_OUT"], int(step or 0), door).wrap
    else:
        wrap = functools.partial(_counted, step=int(step or 0), out=environ["E2E_BENCH_SYNC_OUT"])
    _wrap_on_import(module, owner, function, wrap)


__all__ = ["DOORS", "MODES", "TARGETS", "install"]
