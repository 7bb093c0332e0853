"""κ's own random stream on the transformers path, saved in the Trainer's ``rng_state`` files.

- **Draws** come from one ``torch.Generator`` per device, seeded at its first draw with
  ``BUDGET_SEED_OFFSET + torch.initial_seed()`` (``transformers.set_seed(args.seed)``, which the
  Trainer calls, sets that seed). Nothing else draws from it: dropout, data shuffling and weight
  initialisation no longer move any budget. The seed is the same on every process, as the default
  generator's was, so tensor-parallel processes (holding the same tokens) draw the same κ.
- **Gradient checkpointing** restores the default generators for the recompute, not this one. The
  recompute runs inside backward (the caller says so: ``replay=True``) and reuses the κ the router
  drew in its latest forward, kept on the router: exact for every loop that runs a micro-batch's
  backward before the next forward of the same router (the Trainer, accelerate, ms-swift). A
  recompute whose token count differs from that forward's is an error, not a silent mismatch.
- **Resume**: :func:`state_dict` / :func:`load_state_dict`. :func:`install` wraps
  ``Trainer._save_rng_state`` and ``Trainer._load_rng_state`` so the generator states travel as the
  key :data:`RNG_STATE_KEY` of the Trainer's own ``rng_state.pth`` (``rng_state_<process>.pth``
  with several processes) and come back when ``trainer.train(resume_from_checkpoint=...)`` restores
  the other generators; the κ sequence then continues exactly.
"""

from __future__ import annotations

import functools
import os
import threading
from typing import Any

import torch

from elastic_moe_plugin.core.patching import AttributePatches
from elastic_moe_plugin.core.plan import LayerPlan
from elastic_moe_plugin.core.schedule import BUDGET_SEED_OFFSET

#: the key of the budget generators' states in the Trainer's rng_state files
RNG_STATE_KEY = "elastic_moe_budget"
#: κ [T] of a router's latest forward, reused by its recompute
LATEST_BUDGETS_ATTR = "_elastic_latest_budgets"

_LOCK = threading.Lock()
_GENERATORS: dict[str, torch.Generator] = {}  # str(device) -> generator
_RESTORED: dict[str, torch.Tensor] = {}  # states loaded before the device's first draw


def _generator(device: torch.device) -> torch.Generator:
    key = str(device)
    with _LOCK:
        generator = _GENERATORS.get(key)
        if generator is None:
            generator = torch.Generator(device=device)
            restored = _RESTORED.pop(key, None)
            if restored is not None:
                generator.set_state(restored)
            else:
                generator.manual_seed(BUDGET_SEED_OFFSET + torch.initial_seed())
            _GENERATORS[key] = generator
        return generator


def draw(router: torch.nn.Module, plan: LayerPlan, num_tokens: int, device: torch.device, *, replay: bool) -> torch.Tensor:
    """κ [T] for one router forward: a fresh draw, or with ``replay`` (a checkpoint's recompute)
    the router's latest κ.

    Raises:
        RuntimeError: a recompute finds no κ of that token count to replay.
    """
    if replay:
        latest = router.__dict__.get(LATEST_BUDGETS_ATTR)
        if latest is None or latest.numel() != num_tokens or latest.device != torch.device(device):
            found = "none" if latest is None else f"{latest.numel()} tokens on {latest.device}"
            raise RuntimeError(
                f"elastic-moe: a gradient-checkpointing recompute of {type(router).__name__} routes {num_tokens} tokens "
                f"on {device}, but the router's latest forward drew κ for {found}. The recompute replays the κ of "
                f"the router's latest forward, so each micro-batch's backward must run before the next forward of "
                f"the same layer (as transformers' Trainer does); disable gradient checkpointing otherwise."
            )
        return latest
    budgets = plan.schedule.sample(num_tokens, plan.sampling, generator=_generator(device), device=device)
    router.__dict__[LATEST_BUDGETS_ATTR] = budgets
    return budgets


def state_dict() -> dict[str, torch.Tensor]:
    """{device: generator state} of every budget generator (copies; states restored but not yet
    drawn from included)."""
    with _LOCK:
        states = {key: state.clone() for key, state in _RESTORED.items()}
        states.update({key: generator.get_state() for key, generator in _GENERATORS.items()})
    return states


def load_state_dict(states: dict[str, torch.Tensor]) -> None:
    """Restore the generators of :func:`state_dict` (devices not drawn from yet get theirs at their
    first draw); generators of other devices start afresh."""
    with _LOCK:
        _GENERATORS.clear()
        _RESTORED.clear()
        _RESTORED.update({str(key): state.clone() for key, state in states.items()})


def reset() -> None:
    """Forget every generator: the next draw seeds anew from ``torch.initial_seed()`` (tests)."""
    load_state_dict({})


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


def install(patches: AttributePatches) -> None:
    """Carry the budget generators in the Trainer's rng_state files (part of ``hf.apply``)."""
    from transformers import trainer

    patches.wrap(trainer.Trainer, "_save_rng_state", _save_with_budget_states)
    patches.wrap(trainer.Trainer, "_load_rng_state", _load_with_budget_states)


__all__ = ["LATEST_BUDGETS_ATTR", "RNG_STATE_KEY", "draw", "install", "load_state_dict", "reset", "state_dict"]
