"""``elastic-moe bench --only kappa``: the cost of one κ draw as the number of token shards grows.

One draw = the κ [T] of one elastic router call on one rank (T = 8192 tokens, schedule 6-10 around
8; ``--quick``: T = 1024). For num_shards ∈ {1, 8, 64, 1024} (``--quick``: {1, 8}), two code paths:

- ``before``: the draw the plugin made until the counter-based stream, ``num_shards · T`` fp64
  uniforms from a generator (the tracker state's), then this rank's slice mapped by
  ``BudgetSchedule.budgets_from_uniforms``: O(num_shards · T) time and memory on every rank;
- ``after``: the draw the routers make (:meth:`~elastic_moe_plugin.core.budget_stream.StreamHome.draw`),
  this rank's T uniforms from (seed, counter, shard) on the host, mapped there, from blocks of
  draws made ahead: O(T) whatever num_shards.

Measured on the host CPU (where both draw on a CPU device; on a GPU ``before`` drew on the device
and ``after`` adds one non-blocking copy of 8·T bytes): the median and spread of repeated draws of
one path (each path on its own, so one's cache footprint does not land on the other), and the peak
bytes the draw allocates (torch tensors counted by :class:`~.measure.LiveBytes`,
numpy arrays by ``tracemalloc``), the last shard's draw in both.
"""

from __future__ import annotations

import statistics
import time
import tracemalloc
from collections.abc import Callable
from dataclasses import dataclass

import torch

from elastic_moe_plugin.core.budget_stream import ProcessStream
from elastic_moe_plugin.core.schedule import BudgetSchedule, SamplingMode
from elastic_moe_plugin.tools.bench.measure import SAMPLINGS, LiveBytes

SHARDS, QUICK_SHARDS = (1, 8, 64, 1024), (1, 8)
TOKENS, QUICK_TOKENS = 8192, 1024
SCHEDULE_SPEC, CENTER = "6-10", 8


@dataclass
class KappaDrawResult:
    """One (sampling, num_shards, path) cell of the κ-draw table."""

    sampling: str
    num_shards: int
    path: str  # "before" | "after"
    tokens: int
    median_us: float
    min_us: float
    max_us: float
    peak_bytes: int


def _before(
    schedule: BudgetSchedule, sampling: SamplingMode, num_shards: int, tokens: int
) -> Callable[[], torch.Tensor]:
    generator = torch.Generator().manual_seed(1234)
    shard = num_shards - 1

    def draw() -> torch.Tensor:
        uniforms = torch.rand(num_shards * tokens, dtype=torch.float64, generator=generator)
        return schedule.budgets_from_uniforms(uniforms[shard * tokens : (shard + 1) * tokens], sampling)

    return draw


def _after(
    schedule: BudgetSchedule, sampling: SamplingMode, num_shards: int, tokens: int
) -> Callable[[], torch.Tensor]:
    home = ProcessStream(lambda: 1234)
    shard = num_shards - 1

    def draw() -> torch.Tensor:
        return home.draw(schedule, sampling, shard, tokens, "cpu").budgets

    return draw


def _peak_bytes(draw: Callable[[], torch.Tensor]) -> int:
    """Peak bytes of one draw: torch storages, then (a second draw, nothing else traced) numpy's."""
    with LiveBytes() as live:
        draw()
    tracemalloc.start()
    try:
        draw()
        _, host_peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return live.peak + host_peak


def run_suite(quick: bool, threads: int) -> list[KappaDrawResult]:
    """The table's cells: iid and balanced, each num_shards, before and after."""
    if threads:
        torch.set_num_threads(threads)
    tokens, shards = (QUICK_TOKENS, QUICK_SHARDS) if quick else (TOKENS, SHARDS)
    rounds, warmup = (5, 1) if quick else (25, 3)
    schedule = BudgetSchedule.parse(SCHEDULE_SPEC, center=CENTER)
    results = []
    for sampling in SAMPLINGS:
        for num_shards in shards:
            draws = {
                "before": _before(schedule, sampling, num_shards, tokens),
                "after": _after(schedule, sampling, num_shards, tokens),
            }
            for name, draw in draws.items():
                # each path timed on its own: a 64 MiB `before` draw between two `after` draws would
                # evict the caches the `after` draw then pays for (drift is what the rounds absorb)
                for _ in range(warmup):
                    draw()
                times = []
                for _ in range(rounds):
                    start = time.perf_counter()
                    draw()
                    times.append((time.perf_counter() - start) * 1e6)
                results.append(
                    KappaDrawResult(
                        sampling=sampling,
                        num_shards=num_shards,
                        path=name,
                        tokens=tokens,
                        median_us=statistics.median(times),
                        min_us=min(times),
                        max_us=max(times),
                        peak_bytes=_peak_bytes(draw),
                    )
                )
    return results


def format_table(results: list[KappaDrawResult]) -> str:
    """One row per (sampling, num_shards): before and after, time and peak memory."""
    cells = {(r.sampling, r.num_shards, r.path): r for r in results}
    tokens = results[0].tokens
    lines = [
        f"κ draw per router call, T={tokens}, schedule {SCHEDULE_SPEC} around {CENTER}, host CPU "
        f"(before: num_shards·T uniforms, this rank's slice; after: this rank's T from the counter-based stream)",
        f"{'sampling':9s} {'num_shards':>10s} {'before µs':>11s} {'after µs':>10s} {'after min-max µs':>17s} "
        f"{'before MiB':>11s} {'after MiB':>10s}",
    ]
    for sampling, num_shards in dict.fromkeys((r.sampling, r.num_shards) for r in results):
        before, after = cells[sampling, num_shards, "before"], cells[sampling, num_shards, "after"]
        lines.append(
            f"{sampling:9s} {num_shards:10d} {before.median_us:11.1f} {after.median_us:10.1f} "
            f"{after.min_us:8.1f}-{after.max_us:8.1f} {before.peak_bytes / 2**20:11.3f} "
            f"{after.peak_bytes / 2**20:10.3f}"
        )
    return "\n".join(lines)


__all__ = ["QUICK_SHARDS", "SHARDS", "KappaDrawResult", "format_table", "run_suite"]
