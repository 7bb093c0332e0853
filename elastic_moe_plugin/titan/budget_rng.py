"""κ's stream on the torchtitan path: one counter-based stream per process, seeded from the trainer's
seed, carried by torchtitan's checkpoints.

- **Draws**: :class:`~elastic_moe_plugin.core.budget_stream.BudgetStream` ``(seed, counter)``; each
  elastic MoE forward draws this process's T uniforms on the host from (seed, counter, token shard)
  and advances the counter by one, whatever T. The token shard is ``rank // tp``: torchtitan's
  device mesh puts ``tp`` innermost, so tensor-parallel peers, which route the same tokens, share a
  shard and draw the same κ, and every data-parallel, context-parallel and expert-parallel rank
  (expert parallelism borrows the data-parallel ranks) holds its own tokens and its own shard.
- **Seed**: ``BUDGET_SEED_OFFSET + --debug.seed`` (0 where the run sets none), the same on every
  rank, set when the trainer validates its config (:func:`start`). Nothing else draws from the
  stream: dropout, data order and initialisation leave κ where it was.
- **Activation checkpointing** (torchtitan's ``selective`` and ``full`` modes) re-runs a block's
  forward inside backward: the MoE forward sees it (:func:`in_backward`) and replays the κ of its
  latest forward (:func:`replayed_draw`: the forward's own tensor), exact because
  each micro-batch's backward runs before the next forward of the same layer (torchtitan's loop
  without pipeline parallelism, the only one the door admits).
- **Resume**: :class:`StreamState`, a ``Stateful`` the door adds to the ``states`` torchtitan's
  ``CheckpointManager`` saves with DCP (key :data:`CHECKPOINT_KEY`), so a resumed run continues the
  κ sequence exactly on every rank (the counter is the same on all of them).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from elastic_moe_plugin.core.budget_stream import BudgetDraw, BudgetStream, ProcessStream
from elastic_moe_plugin.core.router_state import ReplayWording, RouterState, checked_replay

logger = logging.getLogger("elastic_moe_plugin.titan")

#: the key of κ's stream in torchtitan's checkpoint ``states``
CHECKPOINT_KEY = "elastic_moe_budget_stream"

_SEED = [0]
#: the process's κ stream, seeded from the trainer's seed (0 until a trainer sets it)
STREAM = ProcessStream(lambda: _SEED[0])
_TENSOR_PARALLEL = [1]
#: how a mismatched replay's refusal names torchtitan's recompute
_REPLAY_WORDING = ReplayWording(
    recompute="an activation-checkpointing recompute",
    owner="layer",
    loop="torchtitan's loop without pipeline parallelism",
    fix="set --activation_checkpoint.mode none",
)


def start(seed: int | None, tensor_parallel: int) -> None:
    """Restart the stream at ``(BUDGET_SEED_OFFSET + seed, 0)`` (seed None: 0) for a trainer whose
    tensor-parallel degree is ``tensor_parallel``."""
    _SEED[0] = 0 if seed is None else int(seed)
    _TENSOR_PARALLEL[0] = max(1, int(tensor_parallel))
    STREAM.replace(None)


def token_shard() -> int:
    """This process's token shard: ``rank // tp`` (0 without ``torch.distributed``)."""
    distributed = torch.distributed
    if not (distributed.is_available() and distributed.is_initialized()):
        return 0
    return distributed.get_rank() // _TENSOR_PARALLEL[0]


def in_backward() -> bool:
    """Whether the caller runs inside autograd's backward: an activation-checkpointing recompute."""
    return torch._C._current_graph_task_id() != -1


def replayed_draw(moe: torch.nn.Module, state: RouterState, num_tokens: int, device: torch.device) -> BudgetDraw:
    """The κ of the MoE's latest forward, for an activation-checkpointing recompute: the forward's own
    draw, its device tensor included, so the recompute dispatches no op the forward did not
    (torchtitan's selective checkpointing saves tensor creations such as ``aten.lift_fresh`` and
    matches the recompute's ops against them).

    Raises:
        RuntimeError: the latest draw is of another token count or device (or there is none).
    """
    return checked_replay(state.latest_draw, moe, num_tokens, device, _REPLAY_WORDING)


class StreamState:
    """κ's stream as a ``torch.distributed.checkpoint.stateful.Stateful``: ``{"seed", "counter"}``."""

    def state_dict(self) -> dict[str, int]:
        stream = STREAM.load()
        return {"seed": stream.seed, "counter": stream.counter}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        STREAM.replace(BudgetStream(int(state["seed"]), int(state["counter"])))
        logger.info("elastic-moe: κ's stream restored at counter %d", int(state["counter"]))


__all__ = ["CHECKPOINT_KEY", "STREAM", "StreamState", "in_backward", "replayed_draw", "start", "token_shard"]
