"""κ's stream on the transformers path: one counter-based stream per process, saved in the
Trainer's ``rng_state`` files and reset by an explicit re-seed.

- **Draws**: :class:`~elastic_moe_plugin.core.budget_stream.BudgetStream` ``(seed, counter)``; each
  router call draws this process's T uniforms on the host from (seed, counter, token shard) and
  advances the counter by one, whatever T. The token shard (:func:`token_shard`) is the process's
  data-parallel index: every process of a DDP / FSDP / DeepSpeed run (ms-swift, the Trainer, a
  plain loop) holds its own tokens, so κ is independent across processes, also when their
  padding-free lengths differ; tensor-parallel peers (a model whose ``_device_mesh`` has a ``tp``
  dimension, tagged at ``from_pretrained`` or :func:`tag_tensor_parallel`) share a shard and
  draw the same κ. Nothing else draws from the stream: dropout, data shuffling and weight
  initialisation leave κ where it was.
- **Seed**: ``BUDGET_SEED_OFFSET + s``. An explicit re-seed, ``torch.manual_seed(s)`` (what
  ``transformers.set_seed``, the Trainer's ``seed`` / ``full_determinism`` and accelerate's
  ``set_seed`` call), resets the stream to ``(BUDGET_SEED_OFFSET + s, 0)`` while the patch is
  applied: :func:`install` wraps ``torch.manual_seed`` (and its alias ``torch.random.manual_seed``)
  through the adapter's ``AttributePatches``, restored by ``hf.remove()``; the wrapper adds two
  integer assignments to the call. Calling ``set_seed(42)`` twice in one process therefore gives
  the same κ twice. Without a re-seed since the patch was applied, the stream is seeded at its
  first draw from ``torch.initial_seed()``. Code that bound ``manual_seed`` before the patch
  (``from torch import manual_seed``) bypasses the wrapper; call :func:`reseed` there.
- **Gradient checkpointing** restores the default generators for the recompute, not this stream.
  The recompute runs inside backward (the router's forward sees it: :func:`replayed_draw`) and reuses the κ the
  router drew in its latest forward, kept on the router: exact for every loop that runs a
  micro-batch's backward before the next forward of the same router (the Trainer, accelerate,
  ms-swift). A recompute whose token count differs from that forward's is an error, not a silent
  mismatch.
- **Resume**: :func:`state_dict` / :func:`load_state_dict` (``{"seed": int, "counter": int}``).
  :func:`install` wraps ``Trainer._save_rng_state`` and ``Trainer._load_rng_state`` so the state
  travels as the key :data:`RNG_STATE_KEY` of the Trainer's own ``rng_state.pth``
  (``rng_state_<process>.pth`` with several processes) and comes back when
  ``trainer.train(resume_from_checkpoint=...)`` restores the other generators; the κ sequence then
  continues exactly on every process (the counter is the same on all of them).
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Any

import torch

from elastic_moe_plugin.core.budget_stream import BudgetDraw, BudgetStream, ProcessStream
from elastic_moe_plugin.core.patching import PATCH_MARKER, AttributePatches, unwrap
from elastic_moe_plugin.core.router_state import ReplayWording, RouterState, checked_replay, ensure_state
from elastic_moe_plugin.core.schedule import BUDGET_SEED_OFFSET

logger = logging.getLogger("elastic_moe_plugin.hf")

#: the key of κ's stream state in the Trainer's rng_state files
RNG_STATE_KEY = "elastic_moe_budget"
#: the process's κ stream (seeded from ``torch.initial_seed()`` at its first draw if nothing seeded it)
STREAM = ProcessStream(torch.initial_seed)
#: how a mismatched replay's refusal names transformers' recompute
_REPLAY_WORDING = ReplayWording(
    recompute="a gradient-checkpointing recompute",
    owner="router",
    loop="as transformers' Trainer does",
    fix="disable gradient checkpointing",
)


def current_stream():
    """The stream of the next draw (seeded from ``torch.initial_seed()`` if nothing seeded it)."""
    return STREAM.load()


def reseed(seed: int) -> None:
    """Reset the stream to ``(BUDGET_SEED_OFFSET + seed, 0)`` (what ``torch.manual_seed(seed)`` does
    while the patch is applied)."""
    STREAM.replace(BudgetStream.seeded(BUDGET_SEED_OFFSET + int(seed)))


def token_shard(router: torch.nn.Module) -> tuple[int, int]:
    """(number of token shards, this process's shard): (1, 0) without ``torch.distributed``; else
    (world // tp, rank // tp), tp the size of the router's tensor-parallel group (1 untagged).

    Raises:
        ValueError: the tensor-parallel ranks are not a contiguous block of the world (transformers'
            meshes put ``tp`` innermost).
    """
    distributed = torch.distributed
    if not (distributed.is_available() and distributed.is_initialized()):
        return 1, 0
    world, rank = distributed.get_world_size(), distributed.get_rank()
    group = ensure_state(router).tensor_parallel_group
    tp_ranks = sorted(distributed.get_process_group_ranks(group)) if group is not None else [rank]
    tp = len(tp_ranks)
    if tp_ranks != list(range(tp_ranks[0], tp_ranks[0] + tp)) or tp_ranks[0] % tp:
        raise ValueError(
            f"elastic-moe draws one κ per token shard and needs tensor-parallel ranks to form a contiguous block "
            f"(got {tp_ranks} of {world}); build the device mesh with 'tp' as its innermost dimension, as "
            f"transformers does."
        )
    return world // tp, rank // tp


def tag_tensor_parallel(model: torch.nn.Module) -> int:
    """Tag every router of ``model`` with its tensor-parallel group, read from transformers'
    ``model._device_mesh`` (its ``tp`` dimension, or the mesh itself when it is one-dimensional and
    ``model.tp_size > 1``); returns the tensor-parallel size (1: nothing to tag)."""
    mesh = getattr(model, "_device_mesh", None)
    if mesh is None:
        return 1
    names = getattr(mesh, "mesh_dim_names", None) or ()
    if "tp" in names:
        tp_mesh = mesh["tp"]
    elif mesh.ndim == 1 and (getattr(model, "_tp_size", None) or 1) > 1:
        tp_mesh = mesh
    else:
        return 1
    if tp_mesh.size() <= 1:
        return 1
    from elastic_moe_plugin.hf.families import covered_routers

    group = tp_mesh.get_group()
    for _, router, _ in covered_routers(model):
        state = ensure_state(router)
        state.tensor_parallel_group = group
        state.generation = None  # re-resolved at the next forward, with the new shard
    return tp_mesh.size()


def replayed_draw(router: torch.nn.Module, state: RouterState, num_tokens: int, device: torch.device) -> BudgetDraw:
    """The draw of the router's latest forward, for a gradient-checkpointing recompute.

    Gradient checkpointing restores the default generators for the recompute, not κ's stream: the
    recompute runs inside backward and reuses the κ the router drew in its latest forward
    (:meth:`RouterState.replay`; a router that runs once per pass of a looped layer, as
    Inkling-2-Loop's, replays its passes' draws last first, as backward recomputes them). Exact
    for every loop that runs a micro-batch's backward before the next forward of the same router
    (the Trainer, accelerate, ms-swift).

    Raises:
        RuntimeError: the latest draw is of another token count or device (or there is none).
    """
    return checked_replay(state.replay(device), router, num_tokens, device, _REPLAY_WORDING)


def state_dict() -> dict[str, int]:
    """``{"seed": int, "counter": int}``: the stream of the next draw."""
    stream = STREAM.load()
    return {"seed": stream.seed, "counter": stream.counter}


def load_state_dict(state: dict[str, Any]) -> None:
    """Restore :func:`state_dict`'s stream; an empty dict forgets it (the next draw seeds from
    ``torch.initial_seed()``). A state of the plugin's earlier generator-per-device format is
    ignored with a warning: the stream then starts afresh."""
    if state and "seed" in state and "counter" in state:
        STREAM.replace(BudgetStream(int(state["seed"]), int(state["counter"])))
        return
    STREAM.replace(None)
    if state:
        logger.warning(
            "elastic-moe: the saved κ state (keys %s) predates the counter-based stream; κ's stream starts afresh "
            "from torch.initial_seed().",
            sorted(state),
        )


def reset() -> None:
    """Forget the stream: the next draw seeds anew from ``torch.initial_seed()`` (tests)."""
    load_state_dict({})


def _reseeding(original):
    @functools.wraps(original)
    def manual_seed(seed):
        result = original(seed)
        reseed(int(seed))
        return result

    return manual_seed


# ---------------------------------------------------------------------------------- the Trainer
def _rng_file(trainer: Any, directory: str) -> str:
    """The file the Trainer writes its generator states to (``Trainer._save_rng_state``)."""
    if trainer.args.world_size <= 1:
        return os.path.join(directory, "rng_state.pth")
    return os.path.join(directory, f"rng_state_{trainer.args.process_index}.pth")


def _read_rng_file(path: str) -> dict:
    """The Trainer's rng_state file, read as the Trainer reads it (weights only; numpy's generator
    state allow-listed by transformers' own ``safe_globals``)."""
    from transformers.trainer_pt_utils import safe_globals

    with safe_globals():
        return torch.load(path, weights_only=True)


def _save_with_budget_states(original):
    @functools.wraps(original)
    def _save_rng_state(self, output_dir: str) -> None:
        original(self, output_dir)
        path = _rng_file(self, output_dir)
        states = _read_rng_file(path)
        states[RNG_STATE_KEY] = state_dict()
        torch.save(states, path)

    return _save_rng_state


def _load_with_budget_states(original):
    @functools.wraps(original)
    def _load_rng_state(self, checkpoint: str | None) -> None:
        original(self, checkpoint)
        path = None if checkpoint is None else _rng_file(self, checkpoint)
        if path is not None and os.path.isfile(path):
            states = _read_rng_file(path)
            if RNG_STATE_KEY in states:  # a checkpoint written without the plugin has none
                load_state_dict(states[RNG_STATE_KEY])

    return _load_rng_state


def _tagging_tensor_parallel(stock):
    @functools.wraps(stock)
    def maybe_distribute_model(cls, model, *args, **kwargs):
        model = stock(cls, model, *args, **kwargs)
        tag_tensor_parallel(model)
        return model

    setattr(maybe_distribute_model, PATCH_MARKER, True)  # its __wrapped__ (functools.wraps) is the stock function
    replacement = classmethod(maybe_distribute_model)
    setattr(replacement, PATCH_MARKER, True)
    return replacement


def install(patches: AttributePatches) -> None:
    """Part of ``hf.apply``: carry κ's stream in the Trainer's rng_state files, reset it on
    ``torch.manual_seed``, and tag tensor-parallel models built by ``from_pretrained``."""
    from transformers import trainer

    patches.wrap(trainer.Trainer, "_save_rng_state", _save_with_budget_states)
    patches.wrap(trainer.Trainer, "_load_rng_state", _load_with_budget_states)
    patches.wrap(torch, "manual_seed", _reseeding)
    if vars(torch.random).get("manual_seed") is not None:
        patches.wrap(torch.random, "manual_seed", _reseeding)
    try:
        from transformers.distributed.mixin import DistributedMixin
    except ImportError:  # a transformers without its own distributed loading
        return
    found = vars(DistributedMixin).get("maybe_distribute_model")
    if isinstance(found, classmethod):
        # AttributePatches.wrap cannot mark a classmethod (its __wrapped__ is read-only): wrap the
        # stock function (unwrapped of another copy's wrapper) and redirect, restored by identity.
        patches.set(DistributedMixin, "maybe_distribute_model", _tagging_tensor_parallel(unwrap(found.__func__)))


__all__ = [
    "RNG_STATE_KEY",
    "STREAM",
    "current_stream",
    "install",
    "load_state_dict",
    "replayed_draw",
    "reseed",
    "reset",
    "state_dict",
    "tag_tensor_parallel",
    "token_shard",
]
