"""The ``elastic_moe`` callback: logs the routing plan when training starts, refuses a model with no
covered router, and adds the routing metrics to every training log.

:func:`register_callbacks` puts one callback class in swift's HF callback map
(``swift.callbacks.mapping.callbacks_map``) and, when Megatron-SWIFT imports, one in its separate
``swift.megatron.callbacks.mapping.megatron_callbacks_map``. ``--callbacks`` is a plain list of
names looked up when the trainer is built, i.e. after the plugin file ran.

What the callbacks log, at every training log step (see :mod:`elastic_moe_plugin.core.metrics`),
as ``ElasticConfig.log_metrics`` (``ELASTIC_MOE_LOG_METRICS``) says: ``elastic_moe/mean_kappa`` and
per layer ``elastic_moe/layer_{i}/mean_kappa``, ``.../kappa_frac_{r}`` (the κ histogram since the
previous log), exposure per rank, retained gate weight sums and ``tokens_per_expert_max_over_mean``
/ ``_cv`` (load imbalance of the latest micro-batch) with ``layers`` (the default; ``megatron sft``:
per layer only with ``moe_per_layer_logging``), the layer means only with ``means``, nothing with
``off`` (the plan line and the start-up check stay). ``swift sft`` writes them to
``<output_dir>/logging.jsonl``, to TensorBoard (``--report_to tensorboard``, under
``<output_dir>/runs``) and to ``trainer_state.json``'s
``log_history``; ``megatron sft`` to its ``logging.jsonl`` and its report backends. Values are
those of the process that logs (rank 0 for ``swift sft``; Megatron-SWIFT's last rank, which holds
the last pipeline stage's layers), not reduced across ranks.

The classes are built on first use, inside functions: their base classes live in ms-swift, which
this module must not import while the plugin file loads in a process that lacks it.
"""

from __future__ import annotations

import sys
from typing import Any

from elastic_moe_plugin.core.config import log_layout
from elastic_moe_plugin.swift.entry import importable
from elastic_moe_plugin.swift.model_check import require_covered_routers
from elastic_moe_plugin.swift.names import CALLBACK_NAME


def register_callbacks() -> list[str]:
    """Put the callback classes in swift's maps; returns the names of the maps it reached."""
    registered = []
    if importable("swift.callbacks"):
        try:
            from swift.callbacks import mapping
        except ImportError:  # swift without its trainer stack
            mapping = None
        if mapping is not None:
            mapping.callbacks_map[CALLBACK_NAME] = hf_callback_class()
            registered.append("swift.callbacks_map")
    # Megatron-SWIFT needs mcore-bridge, which needs Transformer Engine: only where it imports.
    # Its package __init__ runs init_megatron_env(), so do not import it in a `swift sft` process.
    if "swift.megatron" in sys.modules:
        try:
            from swift.megatron.callbacks import mapping as megatron_mapping
        except ImportError:
            megatron_mapping = None
        if megatron_mapping is not None:
            megatron_mapping.megatron_callbacks_map[CALLBACK_NAME] = megatron_callback_class()
            registered.append("swift.megatron_callbacks_map")
    return registered


# One class per map and per process, whichever module object (hashed plugin copies import this
# module under its package name, so there is one) asks for it.
_HF_CALLBACK: type | None = None
_MEGATRON_CALLBACK: type | None = None

#: logs that are not a training step's (the end-of-training summary; evaluation)
_SUMMARY_KEYS = ("train_runtime", "train_samples_per_second")


def _is_training_log(logs: dict[str, Any]) -> bool:
    return not any(key.startswith("eval_") or key in _SUMMARY_KEYS for key in logs)


def hf_callback_class() -> type:
    """``--callbacks elastic_moe`` for ``swift sft`` (swift's ``TrainerCallback(args, trainer)``)."""
    global _HF_CALLBACK
    if _HF_CALLBACK is not None:
        return _HF_CALLBACK
    from swift.callbacks.base import TrainerCallback

    from elastic_moe_plugin import hf

    class ElasticMoeCallback(TrainerCallback):
        """Adds the routing metrics to every training log (swift's logging.jsonl, TensorBoard, ...).

        Logged: realised mean κ and its histogram per layer, retained gate weight sums, and the
        tokens-per-expert imbalance (max/mean); see :mod:`elastic_moe_plugin.core.metrics`. With
        ``log_metrics`` ``layers`` or ``means`` the κ histograms are reset after each log, so each log
        covers the steps since the previous one; ``off`` reads and resets nothing.
        """

        def on_train_begin(self, args, state, control, **kwargs):
            # one line on rank 0: which layers are elastic, with what, and which stay static; no
            # covered router at all (a dense model, an uncovered family) stops the run here
            model = kwargs.get("model")
            model = model if model is not None else self.trainer.model
            require_covered_routers(model, hf.active_config(), "transformers", hf.model_plans(model)[0])
            hf.log_plan(model)

        def on_init_end(self, args, state, control, **kwargs):
            # transformers orders callbacks as [flow, reporting (TensorBoard, W&B, ...), --callbacks,
            # progress/printer (swift's logging.jsonl)], and all of them read `logs` in on_log: run
            # first so that the routing metrics are in the dict every one of them writes.
            callbacks = self.trainer.callback_handler.callbacks
            if self in callbacks:
                callbacks.remove(self)
                callbacks.insert(0, self)

        def on_log(self, args, state, control, logs=None, **kwargs):
            config = hf.active_config()
            if logs is None or not _is_training_log(logs) or (config is not None and config.log_metrics == "off"):
                return
            model = kwargs.get("model")
            if model is None:
                model = self.trainer.model
            values = hf.logged_metrics(model)  # every layer's, or the layer means (ElasticConfig.log_metrics)
            hf.reset_budget_histograms(model)
            if not values:
                return
            logs.update(values)
            # Trainer.log appended a copy of `logs` to log_history before the callbacks ran.
            history = state.log_history
            if history and history[-1].get("step") == state.global_step and "loss" in history[-1]:
                history[-1].update(values)

    _HF_CALLBACK = ElasticMoeCallback
    return ElasticMoeCallback


def megatron_callback_class() -> type:
    """``--callbacks elastic_moe`` for ``megatron sft`` (Megatron-SWIFT's ``MegatronCallback(trainer)``)."""
    global _MEGATRON_CALLBACK
    if _MEGATRON_CALLBACK is not None:
        return _MEGATRON_CALLBACK
    from swift.megatron.callbacks.base import MegatronCallback

    from elastic_moe_plugin import mcore
    from elastic_moe_plugin.mcore import tracking

    class ElasticMoeMegatronCallback(MegatronCallback):
        """Adds the routing metrics to Megatron-SWIFT's training logs. ``--callbacks`` names come
        before the ``print``/``default_flow``/report callbacks that Megatron-SWIFT appends, so the
        metrics reach logging.jsonl and TensorBoard/W&B. The model chunks (virtual pipeline
        stages) of this rank count together, by global layer index. As Megatron-SWIFT's own MoE
        losses, a log holds the layer means (``elastic_moe/<name>``), and every layer's values
        too when the model's config sets ``moe_per_layer_logging``
        (``--megatron_extra_kwargs '{"moe_per_layer_logging": true}'``) and ``log_metrics`` is
        ``layers`` (the default); ``means``: the layer means only; ``off``: nothing."""

        # The model's routers, enumerated at the first log (a walk over every module) and kept: the
        # modules of a training run do not change; and whether it logs per layer.
        routers: Any = None
        per_layer = False

        def on_train_begin(self):
            chunks = list(self.trainer.unwrapped_models)
            require_covered_routers(chunks, mcore.active_config(), "megatron-core", tracking.model_plans(chunks)[0])
            tracking.log_plan(chunks)

        def on_log(self, logs: dict[str, Any]):
            config = mcore.active_config()
            if not _is_training_log(logs) or (config is not None and config.log_metrics == "off"):
                return
            if self.routers is None:
                self.routers = tracking.router_sites(list(self.trainer.unwrapped_models))
                self.per_layer = tracking.per_layer_logging(self.routers)
            layout = log_layout(None if config is None else config.log_metrics, self.per_layer)
            logs.update(tracking.routing_metrics(self.routers, per_layer=layout == "layers"))
            tracking.reset(self.routers)

    _MEGATRON_CALLBACK = ElasticMoeMegatronCallback
    return ElasticMoeMegatronCallback


__all__ = ["hf_callback_class", "megatron_callback_class", "register_callbacks"]
