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

from elastic_moe_plugin.core.budget_stream import BudgetDraw, BudgetStream, TrackedStream
from elastic_moe_plugin.core.schedule import BUDGET_SEED_OFFSET, BudgetSchedule, SamplingMode

#: the tracker state κ's stream lives in (saved by Megatron as ``rng_tracker_states[BUDGET_RNG_NAME]``)
BUDGET_RNG_NAME = "elastic-moe-budget-rng"

logger = logging.getLogger("elastic_moe_plugin.mcore")


def budget_seed() -> int:
    """The seed of a newly registered stream: the CUDA default generator's seed + offset."""
    return BUDGET_SEED_OFFSET + int(torch.cuda.initial_seed())


def _bind_tracker():
    """``megatron.core.tensor_parallel.get_cuda_rng_tracker``, bound once (the tracker itself may
    be replaced, so it is looked up at every draw)."""
    from megatron.core import tensor_parallel

    return tensor_parallel.get_cuda_rng_tracker


#: κ's stream, the entry :data:`BUDGET_RNG_NAME` of Megatron's CUDA RNG tracker
STREAM = TrackedStream(_bind_tracker, BUDGET_RNG_NAME, budget_seed, logger)


def ensure_registered() -> None:
    """Add a fresh stream (counter 0, :func:`budget_seed`) to the tracker unless it holds one."""
    STREAM.register()


def stream() -> BudgetStream:
    """The current stream (registers it first)."""
    return STREAM.load()


def draw(
    schedule: BudgetSchedule, sampling: SamplingMode, shard: int, num_tokens: int, device: torch.device | str
) -> BudgetDraw:
    """κ [T] of this rank's token shard from the stream, which advances by one draw."""
    return STREAM.draw(schedule, sampling, shard, num_tokens, device)


def reset() -> None:
    """Drop the stream from the tracker: the next elastic router or draw registers a fresh one,
    seeded from the CUDA default generator's seed at that time (tests; a deliberate re-seed)."""
    STREAM.forget()


def state() -> torch.Tensor:
    """The stream's state tensor (a copy: :meth:`BudgetStream.to_state_tensor`), for tests and
    diagnostics; registers the stream first."""
    return stream().to_state_tensor()


__all__ = ["BUDGET_RNG_NAME", "STREAM", "budget_seed", "draw", "ensure_registered", "reset", "state", "stream"]
