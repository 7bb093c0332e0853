"""κ's stream on the Megatron path: a named state of Megatron's CUDA RNG tracker.

The stream is :class:`~elastic_moe_plugin.core.budget_stream.BudgetStream` ``(seed, counter)``; a
draw (:func:`draw`) generates this rank's T uniforms on the host from (seed, counter, token shard)
and advances the counter by one, whatever T. Its state lives in the tracker under
:data:`BUDGET_RNG_NAME`, so it is carried, with no code of ours, everywhere Megatron carries RNG
state:

- ``save_checkpoint`` / ``load_checkpoint`` store and restore ``get_states()`` (the
  ``rng_tracker_states`` of the ``rng_state`` entry). Megatron saves data-parallel rank 0's states
  (every rank's with ``--data-parallel-random-init``) and gives them to every data-parallel rank:
  the counter is identical on all of them whatever their T, so that restores every rank exactly;
- activation recompute (``CheckpointFunction``, ``CheckpointWithoutOutput``, Transformer Engine's
  checkpoint) snapshots ``get_states()`` (a shallow copy of the dict) at forward and restores it for
  the recompute. A draw never mutates the stored entry: it stores a new one, so the snapshot keeps
  the old state and a recomputed layer draws the same κ;
- the rerun state machine (``--rerun-mode``) saves and restores the same states;
- ``model_parallel_cuda_manual_seed(s)`` (a re-seed) resets the tracker; the next draw registers a
  fresh stream seeded from ``s``.

The entry. The stream as the 16-byte state of a CUDA Philox generator (seed, offset = 4·counter;
:meth:`BudgetStream.to_state_tensor`), a CPU ``uint8`` tensor like the tracker's own states, or,
in a tracker whose states are ``torch.Generator`` objects (``use_cudagraphable_rng``, i.e. any
``--cuda-graph-impl``, and Transformer Engine's tracker, ``--te-rng-tracker``), a CUDA generator
holding that state. So every consumer that iterates the tracker's states sees an entry of the kind
it expects: CUDA-graph capture registers every state with ``register_generator_state`` (a
generator there); ``load_checkpoint`` under a graph-safe tracker converts each saved tensor with
``convert_cuda_rng_state(to_graphable=True)``, which sets it on the CUDA generator (16 bytes, an
offset that is a multiple of 4) and clones it; ``get_rng_state`` pickles the states into a
``ShardedObject``. Nothing ever forks into the entry: no generator draws from it.

Seed. ``BUDGET_SEED_OFFSET + s``, where ``s`` is the CUDA default generator's seed when the state is
registered: ``model_parallel_cuda_manual_seed(s)`` sets it, and Megatron-LM passes ``--seed`` +
100·pp_rank (+ 10·dp_rank with ``--data-parallel-random-init``). Registration happens when an
elastic router is built (after Megatron's seeding, before ``load_checkpoint`` replaces the states
with the saved ones), and again at a draw if the state is missing (a checkpoint of a static or
stock run; a re-seed). Nothing here reads the device: the state is host bytes, a draw is host work
plus one non-blocking copy.
"""

from __future__ import annotations

import logging

import torch

from elastic_moe_plugin.core.budget_stream import BudgetDraw, BudgetStream
from elastic_moe_plugin.core.schedule import BUDGET_SEED_OFFSET, BudgetSchedule, SamplingMode

#: the tracker state κ's stream lives in (saved by Megatron as ``rng_tracker_states[BUDGET_RNG_NAME]``)
BUDGET_RNG_NAME = "elastic-moe-budget-rng"

logger = logging.getLogger("elastic_moe_plugin.mcore")

# The entry this process stored last and the stream it holds: consecutive draws skip decoding it.
_LAST_WRITTEN: list = [None, None]
# megatron.core.tensor_parallel.get_cuda_rng_tracker, bound at the first call (an import statement
# inside a per-layer function runs importlib's from-list handling in Python on every call)
_GET_TRACKER: list = []


def _tracker():
    if not _GET_TRACKER:
        from megatron.core import tensor_parallel

        _GET_TRACKER.append(tensor_parallel.get_cuda_rng_tracker)
    return _GET_TRACKER[0]()


def _states(tracker) -> dict:
    """The tracker's states without copying them (its ``states_`` dict; ``get_states()`` copies)."""
    states = getattr(tracker, "states_", None)
    return states if isinstance(states, dict) else tracker.get_states()


def budget_seed() -> int:
    """The seed of a newly registered stream: the CUDA default generator's seed + offset."""
    return BUDGET_SEED_OFFSET + int(torch.cuda.initial_seed())


def _generator_device(tracker) -> torch.device | None:
    """The device of the tracker's ``torch.Generator`` states, None when it holds tensors (a
    tracker's states are all of one kind: its first state other than ours decides)."""
    for name, state in _states(tracker).items():
        if name != BUDGET_RNG_NAME:
            return state.device if isinstance(state, torch.Generator) else None
    return None


class _StateTensorsAhead:
    """The state tensors of the next :data:`_STATES_AHEAD` counters of one seed, made together
    (a draw stores one per router call; one at a time costs ten times as much with the caches
    cold, see ``core.budget_stream._DrawsAhead``). Immutable by contract, as every entry is."""

    def __init__(self) -> None:
        self.seed, self.first, self.tensors = None, 0, ()

    def get(self, stream: BudgetStream) -> torch.Tensor:
        row = stream.counter - self.first
        if stream.seed != self.seed or not 0 <= row < len(self.tensors):
            self.seed, self.first, row = stream.seed, stream.counter, 0
            self.tensors = tuple(BudgetStream(stream.seed, counter).to_state_tensor()
                                 for counter in range(stream.counter, min(stream.counter + _STATES_AHEAD, _LAST_OFFSET)))
        return self.tensors[row]


_STATES_AHEAD = 64
_LAST_OFFSET = 1 << 62  # a state's offset 4·counter has 64 bits: counters below 2^62 have one
_STATE_TENSORS = _StateTensorsAhead()


def _entry(tracker, stream: BudgetStream):
    """The stream as an entry of the kind the tracker holds (module docstring)."""
    device = _generator_device(tracker)
    if device is None:
        return _STATE_TENSORS.get(stream)
    generator = torch.Generator(device=device)
    generator.set_state(stream.to_state_tensor())
    return generator


def _store(tracker, stream: BudgetStream) -> None:
    """Replace the entry (never mutate it: a recompute snapshot holds the old object)."""
    entry = _entry(tracker, stream)
    states = getattr(tracker, "states_", None)
    if isinstance(states, dict):
        states[BUDGET_RNG_NAME] = entry  # what the tracker's own fork() does with its states
    else:
        tracker.set_states({**tracker.get_states(), BUDGET_RNG_NAME: entry})
    _LAST_WRITTEN[0], _LAST_WRITTEN[1] = entry, stream


def ensure_registered() -> None:
    """Add a fresh stream (counter 0, :func:`budget_seed`) to the tracker unless it holds one."""
    tracker = _tracker()
    if BUDGET_RNG_NAME not in tracker.get_states():
        _store(tracker, BudgetStream.seeded(budget_seed()))


def stream() -> BudgetStream:
    """The current stream (registers it first)."""
    return _stream(_tracker())


def _stream(tracker) -> BudgetStream:
    entry = _states(tracker).get(BUDGET_RNG_NAME)
    if entry is None:
        ensure_registered()
        return _LAST_WRITTEN[1]
    if entry is _LAST_WRITTEN[0]:
        return _LAST_WRITTEN[1]
    try:
        return BudgetStream.from_state(entry)
    except ValueError as error:  # e.g. a CPU checkpoint of a version that kept a generator state here
        logger.warning("elastic-moe: the saved κ stream %r is not a stream state (%s); starting a fresh one "
                       "from seed %d.", BUDGET_RNG_NAME, error, budget_seed())
        _store(tracker, BudgetStream.seeded(budget_seed()))
        return _LAST_WRITTEN[1]


def draw(schedule: BudgetSchedule, sampling: SamplingMode, shard: int, num_tokens: int,
         device: torch.device | str) -> BudgetDraw:
    """κ [T] of this rank's token shard from the stream, which advances by one draw."""
    tracker = _tracker()
    budgets, advanced = _stream(tracker).draw(schedule, sampling, shard, num_tokens, device)
    _store(tracker, advanced)
    return budgets


def reset() -> None:
    """Drop the stream from the tracker: the next elastic router or draw registers a fresh one,
    seeded from the CUDA default generator's seed at that time (tests; a deliberate re-seed)."""
    tracker = _tracker()
    states = tracker.get_states()
    if BUDGET_RNG_NAME in states:
        tracker.set_states({name: value for name, value in states.items() if name != BUDGET_RNG_NAME})


def state() -> torch.Tensor:
    """The stream's state tensor (a copy: :meth:`BudgetStream.to_state_tensor`), for tests and
    diagnostics; registers the stream first."""
    return stream().to_state_tensor()


__all__ = ["BUDGET_RNG_NAME", "budget_seed", "draw", "ensure_registered", "reset", "state", "stream"]
