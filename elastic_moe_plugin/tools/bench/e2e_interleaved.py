"""Interleaved runs of ``elastic-moe bench --only e2e``: static and elastic in one training process.

The house rule for speed, end to end: one Megatron trainer (``megatron sft`` or Megatron-LM's),
started elastic, switches its routing between blocks of ``b`` training iterations, stock top-k
(``mcore.remove()``) then elastic (``mcore.apply`` of its own config), and so on (torchtitan's
trainer alike, its static blocks the door at ``schedule="static"``: :mod:`.e2e_titan`); the step probe
(:mod:`.step_probe`, switched on by the child bootstrap) times every iteration (start of one
``train_step`` to the start of the next: the logging step included, the switch left out) and counts host syncs on the
first iteration of each mode after the warm-up (left out of the times). Blocks are short where
they can be: ``megatron sft`` logs every step and takes blocks of 5 (8 pairs), Megatron-LM logs
every 10 (its recipe's interval) and takes blocks of 10 (4 pairs); torchtitan logs every step and
takes blocks of 5 (8 pairs). Every interleaved row's batches have one shape (mock data of a fixed
length; chat rows longer than ``--max_length``, cut to it; torchtitan's documents packed into rows of
``--training.seq_len``), so blocks of different steps do the same work. Load on the machine then hits both modes within
seconds of each other, where separate runs minutes apart drift by far more than the effect measured
(docs/performance.md).

From the iterations after the warm-up (:func:`read`):

- a block's time per iteration is the mean over its timed iterations (its logging steps included:
  with Megatron-LM's recipe interval 10 and blocks of 10, every block holds one);
- a block pair is two adjacent blocks, one of each mode (every adjacent pair, so that the static
  block comes first in half of them and drift favours neither); its ratio is
  static s/it over elastic s/it, i.e. elastic steps/s over static steps/s;
- the run's ratio is the median of its pairs' ratios; each mode's steps/s is its timed iterations
  over the time they took.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path

MODES = ("static", "elastic")  # the start-up module's block order: block 0 static, block 1 elastic, ...
#: iterations per block in a full Megatron-LM run: its recipe logs every 10, so each block logs once
BLOCK = 10
PAIRS = 4  # block pairs after the warm-up in a default Megatron-LM run
QUICK_BLOCK, QUICK_PAIRS = 2, 1
#: the table's timing note for an interleaved row
TIMING = (
    "interleaved in one process, blocks of {block} steps switching static/elastic, each step timed from one "
    "train_step to the next, the switch left out (each mode's first step after the warm-up, sync-counted, left "
    "out too); x static: median of the adjacent block pairs' ratios; peak RSS: the one process's"
)


def run_steps(warmup: int, block: int, pairs: int) -> int:
    """Steps of a run whose warm-up is followed by ``2·pairs`` whole blocks (and the one call more
    that ends the last block's last iteration)."""
    first = -(-warmup // block) * block  # the warm-up rounded up to a block boundary
    return first + 2 * pairs * block + 1


@dataclass(frozen=True)
class InterleavedReading:
    """What one interleaved run's timings say (module docstring)."""

    block: int
    steps_per_second: dict[str, float]
    pair_ratios: tuple[float, ...]
    syncs: dict[str, int | None]
    elastic_iterations: frozenset[int]

    @property
    def ratio(self) -> float:
        return statistics.median(self.pair_ratios)


def read(path: Path, warmup: int) -> InterleavedReading:
    """The reading of the start-up module's ``{"block", "iterations", "syncs"}`` file.

    Raises:
        RuntimeError: the file is missing, or leaves no timed block pair after the warm-up.
    """
    if not path.exists():
        raise RuntimeError(
            f"{path} is missing: the interleaving start-up module wrote no timings (did the run "
            f"reach its first training step?)"
        )
    data = json.loads(path.read_text())
    block, rows = int(data["block"]), data["iterations"]
    blocks: dict[int, list[float]] = {}
    modes: dict[int, str] = {}
    for call, mode, seconds in rows:
        index = (call - 1) // block
        modes[index] = mode
        if index * block >= warmup and seconds is not None:  # a block after the warm-up
            blocks.setdefault(index, []).append(seconds)
    timed = sorted(blocks)
    per_iteration = {index: statistics.fmean(blocks[index]) for index in timed}
    ratios = []
    for index in timed:
        if index + 1 in per_iteration and modes[index] != modes[index + 1]:
            static, elastic = sorted((index, index + 1), key=lambda j: MODES.index(modes[j]))
            ratios.append(per_iteration[static] / per_iteration[elastic])
    if not ratios:
        raise RuntimeError(
            f"{path}: no two adjacent timed blocks of {block} steps after the warm-up's {warmup} "
            f"(blocks {timed}); run more steps, e.g. --steps {run_steps(warmup, block, 1)}."
        )
    rates = {}
    for mode in MODES:
        seconds = [value for index in timed if modes[index] == mode for value in blocks[index]]
        rates[mode] = len(seconds) / sum(seconds)
    syncs = {mode: data["syncs"].get(mode) for mode in MODES}
    elastic_calls = frozenset(call for call, mode, _ in rows if mode == "elastic")
    return InterleavedReading(block, rates, tuple(ratios), syncs, elastic_calls)


__all__ = ["BLOCK", "MODES", "PAIRS", "QUICK_BLOCK", "QUICK_PAIRS", "TIMING", "InterleavedReading", "read", "run_steps"]
