"""``elastic-moe bench --only kappa``: the κ draw of one router call, as the routers make it, as the
number of token shards grows.

One draw = the κ [T] of one elastic router call on one rank (T = 8192 tokens, schedule 6-10 around
8; ``--quick``: T = 1024). For num_shards ∈ {1, 8, 64, 1024} (``--quick``: {1, 8}), each sampling:

- per door (``megatron``, ``transformers``; a door whose framework is not installed is left out):
  the call a training forward makes, :meth:`~elastic_moe_plugin.core.router_state.RouterState.draw`
  on the :class:`~elastic_moe_plugin.core.router_state.ElasticPath` the door resolved for a real
  router (:func:`router_draw`: the door's router built and run once under the patch). So its home
  is the door's own: Megatron's ``TrackedStream`` (an entry of Megatron's RNG tracker,
  :data:`elastic_moe_plugin.mcore.budget_rng.STREAM`) or the transformers door's ``ProcessStream``
  (:data:`elastic_moe_plugin.hf.budget_rng.STREAM`), drawn by
  :meth:`~elastic_moe_plugin.core.budget_stream.StreamHome.draw`: this rank's T uniforms from
  (seed, counter, shard) on the host, from blocks of draws made ahead and mapped there by
  :meth:`~elastic_moe_plugin.core.schedule.BudgetSchedule.budgets_from_uniforms`. O(T) whatever
  num_shards. Only the shard is the bench's (the path's, replaced);
- ``before``, the reference: the draw the plugin made until the counter-based stream,
  ``num_shards · T`` fp64 uniforms from a generator (the tracker state's), then this rank's slice
  mapped by the same ``budgets_from_uniforms``: O(num_shards · T) on every rank.

Measured on the host CPU (where both draw on a CPU device; on a GPU ``before`` drew on the device
and the routers add one non-blocking copy of 8·T bytes), each path on its own (so one's cache
footprint does not land on the other): repeated draws, the mean per draw (what a router call costs
in a run: block generation amortised over the block's draws; two blocks' worth of draws for a door),
their median, min and max; and the most one of those draws allocates (a door's: the draw that makes
the block ahead, and its state entries; torch tensors counted by :class:`~.measure.LiveBytes`, numpy
arrays by ``tracemalloc``), the last shard in all.
"""

from __future__ import annotations

import contextlib
import dataclasses
import statistics
import time
import tracemalloc
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from elastic_moe_plugin.core.config import ElasticConfig
from elastic_moe_plugin.core.router_state import ElasticPath, RouterState, state_of
from elastic_moe_plugin.core.schedule import BudgetSchedule, SamplingMode
from elastic_moe_plugin.tools.bench import calls
from elastic_moe_plugin.tools.bench.measure import SAMPLINGS, LiveBytes
from elastic_moe_plugin.tools.bench.schema import BenchRow, row

SHARDS, QUICK_SHARDS = (1, 8, 64, 1024), (1, 8)
TOKENS, QUICK_TOKENS = 8192, 1024
SCHEDULE_SPEC, CENTER = "6-10", calls.TOPK
BEFORE = "before"


@dataclass
class KappaDrawResult:
    """One (sampling, num_shards, path) cell of the κ-draw table: ``path`` is ``before`` or a door."""

    sampling: str
    num_shards: int
    path: str
    tokens: int
    mean_us: float
    median_us: float
    min_us: float
    max_us: float
    peak_bytes: int
    draws: int
    stream: str = ""  # the door's StreamHome class ("" for before)


def _before(schedule: BudgetSchedule, sampling: SamplingMode, num_shards: int, tokens: int) -> Callable[[], object]:
    generator = torch.Generator().manual_seed(1234)
    shard = num_shards - 1

    def draw() -> object:
        uniforms = torch.rand(num_shards * tokens, dtype=torch.float64, generator=generator)
        return schedule.budgets_from_uniforms(uniforms[shard * tokens : (shard + 1) * tokens], sampling)

    return draw


@contextlib.contextmanager
def _streams_restored() -> Iterator[None]:
    """Leave the doors' κ streams as found (the bench draws hundreds of times from them)."""
    restore = []
    with contextlib.suppress(ImportError):
        from elastic_moe_plugin.hf import budget_rng as hf_rng

        saved = hf_rng.state_dict()
        restore.append(lambda: hf_rng.load_state_dict(saved))
    try:
        yield
    finally:
        for undo in restore:
            undo()
        with contextlib.suppress(ImportError):
            from elastic_moe_plugin.mcore import budget_rng as mcore_rng

            mcore_rng.reset()


def router_draw(door: str, sampling: SamplingMode) -> tuple[RouterState, ElasticPath, torch.device]:
    """The state, resolved path and device of a real router of ``door`` (``calls``' router: E=32,
    top-8) run once in training under the patch with schedule 6-10 and ``sampling``: what its
    next forwards call, ``state.draw(path, T, device)``.

    Raises:
        ImportError: the door's framework is not installed.
    """
    patch, factory = calls.door(door)
    build, forward = factory(calls.QUICK_TOKENS)
    with patch.patched(ElasticConfig(schedule=SCHEDULE_SPEC, sampling=sampling)):
        router = build()
        forward(router)  # the first training forward resolves the router's state
    state = state_of(router)
    if state is None or state.path is None:
        raise RuntimeError(f"the {door} router resolved no elastic path under schedule {SCHEDULE_SPEC}")
    device = next(router.parameters()).device
    return state, state.path, device


def _door_draw(state: RouterState, path: ElasticPath, device: torch.device, num_shards: int, tokens: int):
    shard_path = dataclasses.replace(path, shard=num_shards - 1)
    return lambda: state.draw(shard_path, tokens, device)


def _depth(tokens: int) -> int:
    """Draws per block made ahead at T tokens (:mod:`elastic_moe_plugin.core.budget_stream`'s sizing)."""
    from elastic_moe_plugin.core.budget_stream import AHEAD_DRAWS, AHEAD_ELEMENTS

    return max(1, min(AHEAD_DRAWS, AHEAD_ELEMENTS // tokens))


def _measured(draw: Callable[[], object], warmup: int, rounds: int) -> tuple[list[float], int]:
    for _ in range(warmup):
        draw()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        draw()
        times.append((time.perf_counter() - start) * 1e6)
    return times, _peak_bytes(draw, rounds)


def _peak_bytes(draw: Callable[[], object], count: int) -> int:
    """The most one draw allocates, over ``count`` draws (a block made ahead among them): its torch
    storages, then (as many draws again) its numpy arrays and Python objects, each draw on its own,
    so that what earlier draws left alive does not count."""
    live_peak = 0
    for _ in range(count):
        with LiveBytes() as live:
            draw()
        live_peak = max(live_peak, live.peak)
    host_peak = 0
    tracemalloc.start()
    try:
        for _ in range(count):
            tracemalloc.reset_peak()
            before = tracemalloc.get_traced_memory()[0]
            draw()
            host_peak = max(host_peak, tracemalloc.get_traced_memory()[1] - before)
    finally:
        tracemalloc.stop()
    return live_peak + host_peak


def run_suite(quick: bool, threads: int) -> list[KappaDrawResult]:
    """The table's cells: iid and balanced, each num_shards, ``before`` and each installed door."""
    if threads:
        torch.set_num_threads(threads)
    tokens, shards = (QUICK_TOKENS, QUICK_SHARDS) if quick else (TOKENS, SHARDS)
    rounds, warmup = (5, 1) if quick else (25, 3)
    schedule = BudgetSchedule.parse(SCHEDULE_SPEC, center=CENTER)
    results = []
    with _streams_restored():
        for sampling in SAMPLINGS:
            doors = {}
            for door in calls.DOORS:
                with contextlib.suppress(ImportError):
                    doors[door] = router_draw(door, sampling)
            for num_shards in shards:
                paths: dict[str, tuple[Callable[[], object], int, str]] = {
                    BEFORE: (_before(schedule, sampling, num_shards, tokens), rounds, "")
                }
                for door, (state, path, device) in doors.items():
                    draw = _door_draw(state, path, device, num_shards, tokens)
                    paths[door] = (draw, 2 * _depth(tokens), type(path.stream).__name__)
                for name, (draw, count, stream) in paths.items():
                    times, peak = _measured(draw, warmup, count)
                    results.append(
                        KappaDrawResult(
                            sampling=sampling,
                            num_shards=num_shards,
                            path=name,
                            tokens=tokens,
                            mean_us=statistics.fmean(times),
                            median_us=statistics.median(times),
                            min_us=min(times),
                            max_us=max(times),
                            peak_bytes=peak,
                            draws=count,
                            stream=stream,
                        )
                    )
    return results


def rows(results: list[KappaDrawResult]) -> list[BenchRow]:
    """The schema rows: one per cell; a door's against ``before`` of its (sampling, num_shards)."""
    before = {(r.sampling, r.num_shards): r for r in results if r.path == BEFORE}
    out = []
    for r in results:
        reference = before.get((r.sampling, r.num_shards)) if r.path != BEFORE else None
        params = ("sampling", "num_shards", "path", "tokens")
        metrics = {k: v for k, v in dataclasses.asdict(r).items() if k not in params}
        out.append(
            row(
                "kappa",
                "kappa-draw",
                f"{r.sampling} num_shards={r.num_shards} T={r.tokens} schedule {SCHEDULE_SPEC} around {CENTER}",
                r.path,
                params=dict(sampling=r.sampling, num_shards=r.num_shards, tokens=r.tokens, schedule=SCHEDULE_SPEC),
                metrics=metrics,
                baseline=BEFORE if reference is not None else None,
                ratios=(
                    {"time_ratio": r.mean_us / reference.mean_us, "memory_ratio": r.peak_bytes / reference.peak_bytes}
                    if reference is not None
                    else None
                ),
            )
        )
    return out


def format_table(results: list[KappaDrawResult]) -> str:
    """One row per (sampling, num_shards): each path's mean µs per draw and peak MiB."""
    cells = {(r.sampling, r.num_shards, r.path): r for r in results}
    paths = list(dict.fromkeys(r.path for r in results))
    tokens = results[0].tokens
    lines = [
        f"κ draw per router call, T={tokens}, schedule {SCHEDULE_SPEC} around {CENTER}, host CPU; µs: mean per "
        f"draw (blocks made ahead amortised), MiB: the most one draw allocates (before: num_shards·T uniforms, this "
        f"rank's slice; a door: RouterState.draw through its own stream home)",
        f"{'sampling':9s} {'num_shards':>10s} "
        + " ".join(f"{name + ' µs':>16s}" for name in paths)
        + " "
        + " ".join(f"{name + ' MiB':>17s}" for name in paths),
    ]
    for sampling, num_shards in dict.fromkeys((r.sampling, r.num_shards) for r in results):
        row_cells = [cells[sampling, num_shards, name] for name in paths]
        lines.append(
            f"{sampling:9s} {num_shards:10d} "
            + " ".join(f"{cell.mean_us:16.1f}" for cell in row_cells)
            + " "
            + " ".join(f"{cell.peak_bytes / 2**20:17.3f}" for cell in row_cells)
        )
    return "\n".join(lines)


__all__ = [
    "BEFORE",
    "QUICK_SHARDS",
    "QUICK_TOKENS",
    "SHARDS",
    "TOKENS",
    "KappaDrawResult",
    "format_table",
    "router_draw",
    "rows",
    "run_suite",
]
