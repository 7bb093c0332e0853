"""What the door asks of torchtitan's trainer: the start-up checks of its config, κ's stream in its
checkpoints, and the routing metrics in its metrics logger.

- ``Trainer.Config._validate_cuda_graphs`` (the trainer's own check of its config, run on every
  rank after ``--override.imports`` is applied and before the model is built): runs the original,
  then :func:`check_trainer_config` refuses what would freeze κ into a graph or what the door has
  not been proven under, naming the flag and the fix; and restarts κ's stream from ``--debug.seed``
  (:func:`.budget_rng.start`).
- ``CheckpointManager.__init__``: its ``states`` also hold :class:`.budget_rng.StreamState` under
  :data:`.budget_rng.CHECKPOINT_KEY`, so DCP saves and restores κ's stream with the model.
- ``MetricsProcessor.log``: the routing metrics of the model parts it holds join the step's
  ``extra_metrics`` (TensorBoard, W&B), as ``ElasticConfig.log_metrics`` says, and one console line
  gives their layer means; the κ histograms restart after each log.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

import torch

from elastic_moe_plugin.core.config import ElasticConfig
from elastic_moe_plugin.core.errors import UnsupportedTorchtitanError
from elastic_moe_plugin.titan import budget_rng

logger = logging.getLogger("elastic_moe_plugin.titan")

#: the token dispatchers whose ``_local_reorder`` the door narrows to the kept pairs
DISPATCHERS = ("LocalTokenDispatcher", "AllToAllTokenDispatcher", "TorchAOTokenDispatcher")
#: dispatchers with their own fixed-k buffers or kernels, refused until each is checked on a GPU
REFUSED_DISPATCHERS = {
    "DeepEPTokenDispatcher": "its buffer is built for num_topk = k and its kernels were not run here",
    "HybridEPTokenDispatcher": "it maps indices with k and sizes fixed-capacity buffers",
    "MinimalAsyncEPTokenDispatcher": "it sizes its receive buffers with k and runs triton kernels",
}


def is_elastic(config: ElasticConfig | None) -> bool:
    """Whether ``config`` can route any layer elastically (an enabled config whose schedule is not ``static``)."""
    if config is None or not config.enabled:
        return False
    return config.mode == "top_p" or config.schedule.strip().lower() != "static"


def check_trainer_config(trainer_config: Any) -> None:
    """Refuse the torchtitan options the door cannot run under (every rank, before the model is built).

    Raises:
        UnsupportedTorchtitanError: naming the flag, its value, why, and the fix.
    """
    refusal = _refusal(trainer_config)
    if refusal is not None:
        raise UnsupportedTorchtitanError(f"elastic-moe (torchtitan): {refusal}")


def _refusal(trainer_config: Any) -> str | None:
    compile_config, parallelism = trainer_config.compile, trainer_config.parallelism
    if compile_config.enable and "model" in compile_config.components:
        others = [name for name in compile_config.components if name != "model"]
        return (
            f"--compile.enable with --compile.components {','.join(compile_config.components)} compiles each "
            "block with fullgraph=True, and a block's MoE draws κ on the host at every forward (a graph break, "
            "or κ frozen into the graph). Leave 'model' out of --compile.components"
            + (f" (--compile.components {','.join(others)})" if others else "")
            + ", or drop --compile.enable."
        )
    if not trainer_config.training.disable_cuda_graphs and torch.cuda.is_available() and torch.version.hip is None:
        return (
            "CUDA graphs are on (--training.disable_cuda_graphs is False): the captured forward and backward "
            "would replay the first step's κ and its Σκ-sized buffers at every step. Set "
            "--training.disable_cuda_graphs."
        )
    if parallelism.pipeline_parallel_degree > 1:
        return (
            f"--parallelism.pipeline_parallel_degree {parallelism.pipeline_parallel_degree}: pipeline schedules run "
            "several micro-batches' forwards before their backwards, and a recompute replays only a layer's latest "
            "κ; pipeline stages also hold different counters of κ's stream. Train with "
            "--parallelism.pipeline_parallel_degree 1."
        )
    if parallelism.tensor_parallel_degree > 1:
        return (
            f"--parallelism.tensor_parallel_degree {parallelism.tensor_parallel_degree}: the MoE's router input is a "
            "sequence-sharded DTensor there, which the door has not been run under. Train with "
            "--parallelism.tensor_parallel_degree 1 (data, context and expert parallelism are covered)."
        )
    return _dispatcher_refusal(trainer_config)


def _dispatcher_refusal(trainer_config: Any) -> str | None:
    model_spec = getattr(trainer_config, "model_spec", None)
    if model_spec is None:
        return None
    from torchtitan.models.common import token_dispatcher

    for fqn, dispatcher, *_ in model_spec.model.traverse(token_dispatcher.LocalTokenDispatcher.Config):
        for refused, why in REFUSED_DISPATCHERS.items():
            if isinstance(dispatcher, getattr(token_dispatcher, refused).Config):
                return (
                    f"{fqn or 'the model'} uses {refused}: {why}. The door dispatches the Σκ kept pairs through "
                    f"{', '.join(DISPATCHERS)}; pick a model config with the standard all-to-all "
                    "(torchtitan's default expert-parallel backend)."
                )
    return None


def validating_config(original: Callable, lifecycle: Any) -> Callable:
    """The replacement of ``Trainer.Config._validate_cuda_graphs``: the original check, then the
    door's (:func:`check_trainer_config`) and κ's stream restarted from the trainer's seed."""

    @functools.wraps(original)
    def _validate_cuda_graphs(self) -> None:
        original(self)
        if is_elastic(lifecycle.config):
            check_trainer_config(self)
        budget_rng.start(self.debug.seed, self.parallelism.tensor_parallel_degree)

    return _validate_cuda_graphs


def with_stream_state(original: Callable, lifecycle: Any) -> Callable:
    """The replacement of ``CheckpointManager.__init__``: κ's stream joins the ``states`` it saves."""

    @functools.wraps(original)
    def __init__(self, config: Any, *args: Any, states: dict[str, Any], **kwargs: Any) -> None:
        if is_elastic(lifecycle.config):
            states = {**states, budget_rng.CHECKPOINT_KEY: budget_rng.StreamState()}
        original(self, config, *args, states=states, **kwargs)

    return __init__


def logging_metrics(original: Callable, read_metrics: Callable[[list], dict[str, float]]) -> Callable:
    """The replacement of ``MetricsProcessor.log``: ``read_metrics(model_parts)`` joins ``extra_metrics``."""

    @functools.wraps(original)
    def log(self, step: int, global_avg_loss: float, global_max_loss: float, grad_norm: float, extra_metrics=None):
        routing = read_metrics(list(self.model_parts or []))
        if routing:
            extra_metrics = {**(extra_metrics or {}), **routing}
            means = ", ".join(f"{name.split('/')[-1]} {value:.4g}" for name, value in sorted(routing.items())
                              if name.count("/") == 1)  # fmt: skip
            logger.info("elastic-moe: step %d: %s", step, means)
        return original(self, step, global_avg_loss, global_max_loss, grad_norm, extra_metrics=extra_metrics)

    return log


__all__ = [
    "DISPATCHERS",
    "REFUSED_DISPATCHERS",
    "check_trainer_config",
    "is_elastic",
    "logging_metrics",
    "validating_config",
    "with_stream_state",
]
