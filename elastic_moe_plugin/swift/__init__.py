"""ms-swift integration: what ``--plugin elastic_moe`` (or ``--external_plugins FILE``) loads, and the callbacks.

Usage (ms-swift 4.6; docs/swift.md)::

    ELASTIC_MOE_SCHEDULE=6-10 swift sft    ... --plugin elastic_moe
    ELASTIC_MOE_SCHEDULE=6-10 megatron sft ... --plugin elastic_moe
    # the fallback, where the start-up hook is not installed (an editable checkout):
    ELASTIC_MOE_SCHEDULE=6-10 swift sft    ... --external_plugins "$(elastic-moe plugin-path)" --callbacks elastic_moe

``--plugin`` is this package's: :mod:`.plugin_flag` (a start-up hook installed with the wheel)
rewrites it into the second form in ms-swift's entry processes.
ms-swift has no ``--plugin`` flag; its hook is ``--external_plugins FILE``. ``swift sft`` and
``megatron sft`` re-launch a child process (or torchrun), and the child imports the file on every
rank in ``BaseArguments.__post_init__``, before any model is built (Megatron-SWIFT's arguments
inherit that). The plugin file calls :func:`install`, which

1. reads :class:`ElasticConfig` from ``ELASTIC_MOE_*`` / ``ELASTIC_MOE_CONFIG`` (a swift YAML's
   ``ENV:`` block sets those in the launcher, and the child inherits them). A bad value raises
   :class:`~elastic_moe_plugin.core.config.ConfigError` right there: the run exits non-zero at start-up,
   on every rank, with the plugin's message and before any training step;
2. patches the transformers routers (:mod:`elastic_moe_plugin.hf`) when transformers is
   importable, and Megatron-core (:mod:`elastic_moe_plugin.mcore`: ``TopKRouter`` plus the token
   dispatcher fixes) when ``megatron.core`` has already been imported. Megatron-SWIFT's argument
   module imports ``megatron.core`` before it loads plugins; ``swift sft`` (transformers) never
   imports it, and importing it there would cost start-up time and fail on machines where
   megatron-core is installed but cannot import (no triton / Transformer Engine);
3. registers the ``elastic_moe`` callback in swift's HF callback map
   (``swift.callbacks.mapping.callbacks_map``) and, when Megatron-SWIFT imports, in its separate
   ``swift.megatron.callbacks.mapping.megatron_callbacks_map``. ``--callbacks`` is a plain list of
   names looked up when the trainer is built, i.e. after the plugin ran.

ms-swift imports plugin files under a hashed module name (``_swift_external_<sha256 of the path>``),
so the same code may run more than once per process (two paths, or the package's copy and the
checkout's); every step above is idempotent: one patch, one callback class per map.

What the callbacks log, at every training log step (see :mod:`elastic_moe_plugin.core.metrics`):
``elastic_moe/mean_kappa`` and per layer ``elastic_moe/layer_{i}/mean_kappa``,
``.../kappa_frac_{r}`` (the κ histogram since the previous log), exposure per rank, retained gate
weight sums and ``tokens_per_expert_max_over_mean`` / ``_cv`` (load imbalance of the latest
micro-batch). ``swift sft`` writes them to ``<output_dir>/logging.jsonl``, to TensorBoard
(``--report_to tensorboard``, under ``<output_dir>/runs``) and to ``trainer_state.json``'s
``log_history``; ``megatron sft`` to its ``logging.jsonl`` and its report backends. Values are
those of the process that logs (rank 0 for ``swift sft``; Megatron-SWIFT's last rank, which holds
the last pipeline stage's layers), not reduced across ranks.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from elastic_moe_plugin.core.config import ElasticConfig

# Nothing at module level imports torch: the start-up hook (:mod:`.plugin_flag`) imports this
# package inside ms-swift's entry scripts before ms-swift itself.
logger = logging.getLogger(__name__)

CALLBACK_NAME = "elastic_moe"
#: alone in its directory: ms-swift inserts a plugin's directory first on sys.path, and the package
#: directory itself (swift.py, config.py, ...) would shadow top-level modules of those names
PLUGIN_FILE = Path(__file__).parent / "plugin" / "elastic_moe.py"


def plugin_path() -> Path:
    """The installed plugin file, for ``--external_plugins "$(elastic-moe plugin-path)"``."""
    return PLUGIN_FILE


def _importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def install(config: ElasticConfig | None = None) -> ElasticConfig:
    """Validate the configuration, patch every framework in use, register the callbacks.

    Logs one line on every rank (``[INFO:elastic_moe] rank R/W: plugin loaded ...``), so a
    multi-rank log shows that each rank loaded it.

    Raises:
        ConfigError: a bad ``ELASTIC_MOE_*`` setting (the run stops before building a model). Its
            message is printed on its own first (:func:`_report_config_errors_first`).
    """
    from elastic_moe_plugin.core.config import ElasticConfig

    _ensure_log_handler()
    _report_config_errors_first()
    config = ElasticConfig.from_env() if config is None else config
    patched = []
    if _importable("transformers"):
        from elastic_moe_plugin import hf

        hf.apply(config)
        patched.append("transformers")
    if "megatron.core" in sys.modules:  # Megatron-SWIFT (or any Megatron script) imported it already
        from elastic_moe_plugin import mcore

        mcore.apply(config)
        patched.append("megatron-core")
    registered = _register_callbacks()
    rank, world = os.environ.get("RANK", "0"), os.environ.get("WORLD_SIZE", "1")
    logger.info("rank %s/%s: plugin loaded (pid %d): %s; patched %s; callback %r registered in %s", rank, world,
                os.getpid(), config, ", ".join(patched) or "nothing (no framework found)", CALLBACK_NAME,
                ", ".join(registered) or "nothing")
    return config


def _ensure_log_handler() -> None:
    """Show the plugin's INFO lines in ms-swift's output, in ms-swift's format (``[INFO:swift] ...``).

    ms-swift configures only its own ``swift`` logger; without a handler the package's logger would
    print nothing below WARNING. A handler the application already attached (to this logger or
    the root) wins."""
    package_logger = logging.getLogger("elastic_moe_plugin")
    if package_logger.handlers or logging.getLogger().handlers:
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("[%(levelname)s:elastic_moe] %(message)s"))
    package_logger.addHandler(handler)
    package_logger.setLevel(logging.INFO)
    package_logger.propagate = False


def _report_config_errors_first() -> None:
    """Print a :class:`ConfigError` that ends the process on its own line before the traceback.

    ms-swift prints the traceback of whatever stops it, some 40 lines whose last one would be the
    plugin's message. ``sys.excepthook`` runs for the exception that ends the process (on every
    rank, torchrun workers included), so the message comes first, then the usual traceback."""
    if getattr(sys.excepthook, "__elastic_moe_hook__", False):
        return
    previous = sys.excepthook

    def excepthook(kind, error, traceback):
        from elastic_moe_plugin.core.errors import ConfigError

        if isinstance(error, ConfigError) and os.environ.get("LOCAL_RANK", "0") == "0":
            sys.stderr.write(f"\nelastic-moe: configuration error: {error}\n\n")
            sys.stderr.flush()
        previous(kind, error, traceback)

    excepthook.__elastic_moe_hook__ = True
    sys.excepthook = excepthook


def _register_callbacks() -> list[str]:
    """Put the callback classes in swift's maps; returns the names of the maps it reached."""
    registered = []
    if _importable("swift.callbacks"):
        try:
            from swift.callbacks import mapping
        except ImportError:  # swift without its trainer stack
            mapping = None
        if mapping is not None:
            mapping.callbacks_map[CALLBACK_NAME] = _hf_callback_class()
            registered.append("swift.callbacks_map")
    # Megatron-SWIFT needs mcore-bridge, which needs Transformer Engine: only where it imports.
    # Its package __init__ runs init_megatron_env(), so do not import it in a `swift sft` process.
    if "swift.megatron" in sys.modules:
        try:
            from swift.megatron.callbacks import mapping as megatron_mapping
        except ImportError:
            megatron_mapping = None
        if megatron_mapping is not None:
            megatron_mapping.megatron_callbacks_map[CALLBACK_NAME] = _megatron_callback_class()
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


def _hf_callback_class() -> type:
    """``--callbacks elastic_moe`` for ``swift sft`` (swift's ``TrainerCallback(args, trainer)``)."""
    global _HF_CALLBACK
    if _HF_CALLBACK is not None:
        return _HF_CALLBACK
    from swift.callbacks.base import TrainerCallback

    from elastic_moe_plugin import hf

    class ElasticMoeCallback(TrainerCallback):
        """Adds the routing metrics to every training log (swift's logging.jsonl, TensorBoard, ...).

        Logged: realised mean κ and its histogram per layer, retained gate weight sums, and the
        tokens-per-expert imbalance (max/mean); see :mod:`elastic_moe_plugin.core.metrics`. The κ
        histograms are reset after each log, so each log covers the steps since the previous one.
        """

        def on_train_begin(self, args, state, control, **kwargs):
            # one line on rank 0: which layers are elastic, with what, and which stay static
            model = kwargs.get("model")
            hf.log_plan(model if model is not None else self.trainer.model)

        def on_init_end(self, args, state, control, **kwargs):
            # transformers orders callbacks as [flow, reporting (TensorBoard, W&B, ...), --callbacks,
            # progress/printer (swift's logging.jsonl)], and all of them read `logs` in on_log: run
            # first so that the routing metrics are in the dict every one of them writes.
            callbacks = self.trainer.callback_handler.callbacks
            if self in callbacks:
                callbacks.remove(self)
                callbacks.insert(0, self)

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs is None or not _is_training_log(logs):
                return
            model = kwargs.get("model")
            if model is None:
                model = self.trainer.model
            values = hf.routing_metrics(model)
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


def _megatron_callback_class() -> type:
    """``--callbacks elastic_moe`` for ``megatron sft`` (Megatron-SWIFT's ``MegatronCallback(trainer)``)."""
    global _MEGATRON_CALLBACK
    if _MEGATRON_CALLBACK is not None:
        return _MEGATRON_CALLBACK
    from swift.megatron.callbacks.base import MegatronCallback

    from elastic_moe_plugin.mcore import tracking

    class ElasticMoeMegatronCallback(MegatronCallback):
        """Adds the routing metrics to Megatron-SWIFT's training logs. ``--callbacks`` names come
        before the ``print``/``default_flow``/report callbacks that Megatron-SWIFT appends, so the
        metrics reach logging.jsonl and TensorBoard/W&B. The model chunks (virtual pipeline
        stages) of this rank count together, by global layer index."""

        def on_train_begin(self):
            tracking.log_plan(list(self.trainer.unwrapped_models))

        def on_log(self, logs: dict[str, Any]):
            if not _is_training_log(logs):
                return
            chunks = list(self.trainer.unwrapped_models)
            logs.update(tracking.routing_metrics(chunks))
            tracking.reset(chunks)

    _MEGATRON_CALLBACK = ElasticMoeMegatronCallback
    return ElasticMoeMegatronCallback
