"""κ's own random stream on the Megatron path: a named state in Megatron's CUDA RNG tracker.

Budgets are drawn inside ``get_cuda_rng_tracker().fork(BUDGET_RNG_NAME)``, the mechanism Megatron
uses for its own streams (``model-parallel-rng`` for dropout in tensor-parallel regions,
``expert-parallel-rng`` for expert initialisation). A named tracker state is carried, with no code
of ours, everywhere Megatron already carries RNG state:

- ``save_checkpoint`` / ``load_checkpoint`` store and restore ``get_states()`` (the
  ``rng_tracker_states`` of the ``rng_state`` entry), so a resumed run continues the exact κ
  sequence;
- activation recompute (``CheckpointFunction``, ``CheckpointWithoutOutput``, Transformer Engine's
  checkpoint) snapshots the tracker states at forward and restores them for the recompute, so a
  recomputed layer draws the same κ;
- nothing else draws from it: data shuffling, dropout and initialisation use the default generator
  or their own states, so changing them no longer moves any budget (the issue with drawing from
  the default generator, whose state Megatron-LM advances between ``load_checkpoint`` and the first
  step when it builds the data iterators).

Seed. ``BUDGET_SEED_OFFSET + s``, where ``s`` is the seed of the CUDA default generator when the
state is registered: ``model_parallel_cuda_manual_seed(s)`` sets it, and Megatron-LM passes its
``--seed`` + 100·pp_rank (+ 10·dp_rank with ``--data-parallel-random-init``). The state is the same
on every rank of a pipeline stage; :func:`~elastic_moe_plugin.mcore.routing.draw_budgets` keeps
drawing the uniforms of all token shards from it and taking its own slice, so tensor-parallel peers
holding the same tokens get the same κ and data/context/sequence-parallel shards independent κ,
exactly as before. Because the state is identical across data-parallel ranks, the checkpoint's copy
(Megatron saves data-parallel rank 0's tracker states unless ``--data-parallel-random-init``, and
then every rank's) restores every rank exactly.

Registration happens when an elastic router is built (after Megatron's seeding, before
``load_checkpoint`` replaces the states with the saved ones), and again at a draw if the state is
missing: a checkpoint saved by a static or stock run has none, and re-seeding
(``model_parallel_cuda_manual_seed``) resets the tracker. Neither costs a host sync: the tracker
keeps states as host tensors, and a draw only swaps the device generator's state.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from elastic_moe_plugin.core.schedule import BUDGET_SEED_OFFSET

#: the tracker state κ is drawn from (saved by Megatron as ``rng_tracker_states[BUDGET_RNG_NAME]``)
BUDGET_RNG_NAME = "elastic-moe-budget-rng"


def _tracker():
    from megatron.core import tensor_parallel

    return tensor_parallel.get_cuda_rng_tracker()


def budget_seed() -> int:
    """The seed of a newly registered budget state: the CUDA default generator's seed + offset."""
    return BUDGET_SEED_OFFSET + int(torch.cuda.initial_seed())


def ensure_registered() -> None:
    """Add the budget state to Megatron's RNG tracker unless it holds one (idempotent)."""
    tracker = _tracker()
    if BUDGET_RNG_NAME in tracker.get_states():
        return
    seed = budget_seed()
    # The tracker refuses a seed it has seen; ours stays booked after a set_states() (a checkpoint
    # load, a recompute restoring an earlier snapshot) dropped the state itself.
    booked = getattr(tracker, "seeds_", None)
    if isinstance(booked, set):
        booked.discard(seed)
    tracker.add(BUDGET_RNG_NAME, seed)


@contextlib.contextmanager
def forked() -> Iterator[None]:
    """Draws inside the block come from the budget stream (the device's default generator runs on
    the budget state, which is then saved back; the default generator's own state is restored)."""
    ensure_registered()
    with _tracker().fork(BUDGET_RNG_NAME):
        yield


def reset() -> None:
    """Drop the budget state from the tracker: the next elastic router or draw registers a fresh
    one, seeded from the CUDA default generator's seed at that time (tests; a deliberate re-seed)."""
    tracker = _tracker()
    states = tracker.get_states()
    if BUDGET_RNG_NAME in states:
        tracker.set_states({name: value for name, value in states.items() if name != BUDGET_RNG_NAME})


def state() -> torch.Tensor:
    """The budget stream's current state (a copy, for tests and diagnostics); registers it first."""
    ensure_registered()
    found = _tracker().get_states()[BUDGET_RNG_NAME]
    return found.get_state() if isinstance(found, torch.Generator) else found.clone()


__all__ = ["BUDGET_RNG_NAME", "budget_seed", "ensure_registered", "forked", "reset", "state"]
