"""The measuring core of ``elastic-moe bench``, shared by the Megatron and transformers scenarios.

A scenario is a dict ``{variant: Step}`` (``stock``, ``iid``, ``balanced``) built from the same
weights and fed the same inputs; :func:`measure` turns it into a :class:`ScenarioResult`:

- Timing: warm-up, then rounds in which every variant runs once, in a rotating order (interleaved,
  so drift and other load hit all variants alike); medians and min-max per variant.
- Memory: peak bytes of tensors alive during one step, counted by a ``TorchDispatchMode`` over
  storages (:class:`LiveBytes`; allocator-independent, kernel scratch space is not seen).
- Syncs: device-to-host synchronisations during one forward (:class:`SyncCounter`:
  ``aten._local_scalar_dense`` and ``aten.nonzero`` calls, what ``.item()``, ``int(t)``,
  ``.tolist()`` and data-dependent shapes become), elastic minus stock.
- Pairs: (token, expert) pairs per forward, expected T·k against what the variant's
  ``Step.pairs`` reports as realised.
"""

from __future__ import annotations

import gc
import statistics
import time
import weakref
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from elastic_moe_plugin.tools.bench.schema import BenchRow, Scalar, row

if TYPE_CHECKING:
    from elastic_moe_plugin.core.schedule import SamplingMode

VARIANTS = ("stock", "iid", "balanced")
#: the elastic variants: one per κ sampling mode
SAMPLINGS: tuple[SamplingMode, ...] = ("iid", "balanced")
SYNC_OPS = ("_local_scalar_dense", "nonzero")


# ------------------------------------------------------------------------------------ counters
class LiveBytes(TorchDispatchMode):
    """Peak bytes of storages created by aten ops while active (each storage counted once)."""

    def __init__(self) -> None:
        super().__init__()
        self.current = 0
        self.peak = 0
        self._live: dict[int, list[int]] = {}  # storage data_ptr -> [nbytes, live tensors]

    def _release(self, key: int) -> None:
        entry = self._live.get(key)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            self.current -= entry[0]
            del self._live[key]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in tree_flatten(out)[0]:
            if not isinstance(tensor, torch.Tensor) or tensor.device.type == "meta":
                continue
            storage = tensor.untyped_storage()
            key = storage.data_ptr()
            if key == 0:
                continue
            entry = self._live.get(key)
            if entry is None:
                entry = self._live[key] = [storage.nbytes(), 0]
                self.current += entry[0]
                self.peak = max(self.peak, self.current)
            entry[1] += 1
            weakref.finalize(tensor, self._release, key)
        return out


class SyncCounter(TorchDispatchMode):
    """Counts the aten ops that force a device-to-host synchronisation (see :data:`SYNC_OPS`)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in SYNC_OPS and not _host_only_read(args):
            self.count += 1
        return func(*args, **(kwargs or {}))


def _host_only_read(args) -> bool:
    """A read that waits for no device, so not a sync: the RNG-state comparison at the end of
    Megatron's tracker fork (two CPU generator states, on a GPU too), and, where a GPU computes,
    any read of CPU tensors. On a CPU-only machine every other read stands for the device read it
    would be on a GPU, and counts."""
    from elastic_moe_plugin import cpu_runtime

    if cpu_runtime.in_rng_tracker_fork():
        return True
    tensors = [a for a in tree_flatten(args)[0] if isinstance(a, torch.Tensor)]
    return torch.cuda.is_available() and bool(tensors) and all(t.device.type == "cpu" for t in tensors)


# ------------------------------------------------------------------------------------ results
def _nothing() -> None:
    return None


@dataclass
class VariantResult:
    median_ms: float
    min_ms: float
    max_ms: float
    peak_bytes: int
    syncs_per_forward: int
    expected_pairs: int
    realised_pairs: int


@dataclass
class ScenarioResult:
    scenario: str
    shape: str
    variants: dict[str, VariantResult] = field(default_factory=dict)
    #: the configuration's settings (the schema's ``params``)
    params: dict[str, Scalar] = field(default_factory=dict)
    #: the ``--only`` mode that measured it
    mode: str = ""

    def ratios(self) -> dict[str, dict[str, float | int]]:
        stock = self.variants["stock"]
        return {
            name: {
                "time_ratio": result.median_ms / stock.median_ms,
                "memory_ratio": result.peak_bytes / stock.peak_bytes,
                "syncs_added": result.syncs_per_forward - stock.syncs_per_forward,
            }
            for name, result in self.variants.items()
            if name != "stock"
        }

    def rows(self) -> list[BenchRow]:
        """One schema row per variant (:mod:`.schema`); the elastic ones against ``stock``."""
        ratios = self.ratios()
        return [
            row(
                self.mode,
                self.scenario,
                self.shape,
                name,
                params=self.params,
                metrics=asdict(variant),
                baseline=None if name == "stock" else "stock",
                ratios=ratios.get(name),
            )
            for name, variant in self.variants.items()
        ]


@dataclass
class Step:
    """One variant of a scenario: ``run()`` is forward + backward; ``forward()`` forward only;
    ``pairs()`` the (token, expert) pairs realised by the latest forward (or by one of its own);
    ``setup()`` runs, untimed, before each of them (e.g. to install or remove a patch)."""

    run: Callable[[], None]
    forward: Callable[[], object]  # its output is discarded
    pairs: Callable[[], int]
    setup: Callable[[], None] = _nothing


# ------------------------------------------------------------------------------------ running
def _synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def measure(
    scenario: str,
    shape: str,
    steps: dict[str, Step],
    warmup: int,
    repeats: int,
    *,
    reset: Callable[[], None] = _nothing,
    between_runs: Callable[[], None] = _nothing,
    params: dict[str, Scalar] | None = None,
    mode: str = "",
) -> ScenarioResult:
    """Interleaved timing, then memory, syncs and pairs of each variant.

    Args:
        reset: called once before the warm-up (Megatron: size its metrics tracker afresh).
        between_runs: called after the warm-up, after each timed round and after each variant's
            memory and sync runs (Megatron: zero its metrics tracker).
        params: the configuration's settings; mode: the ``--only`` mode (both for the JSON rows).
    """
    reset()
    for _ in range(warmup):
        for step in steps.values():
            step.setup()
            step.run()
    between_runs()
    names = list(steps)
    times: dict[str, list[float]] = {name: [] for name in names}
    for round_index in range(repeats):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            steps[name].setup()
            _synchronize()
            start = time.perf_counter()
            steps[name].run()
            _synchronize()
            times[name].append((time.perf_counter() - start) * 1e3)
        between_runs()
    result = ScenarioResult(scenario=scenario, shape=shape, params=dict(params or {}), mode=mode)
    for name in names:
        gc.collect()
        steps[name].setup()
        with LiveBytes() as live:
            steps[name].run()
        with SyncCounter() as syncs, torch.no_grad():
            steps[name].forward()
        between_runs()
        realised = steps[name].pairs()
        steps["stock"].setup()
        expected = steps["stock"].pairs()
        result.variants[name] = VariantResult(
            median_ms=statistics.median(times[name]),
            min_ms=min(times[name]),
            max_ms=max(times[name]),
            peak_bytes=live.peak,
            syncs_per_forward=syncs.count,
            expected_pairs=expected,
            realised_pairs=realised,
        )
    return result


__all__ = [
    "SAMPLINGS",
    "SYNC_OPS",
    "VARIANTS",
    "LiveBytes",
    "ScenarioResult",
    "Step",
    "SyncCounter",
    "VariantResult",
    "measure",
]
