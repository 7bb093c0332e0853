"""ms-swift integration: what ``--plugin elastic_moe`` (or ``--external_plugins FILE``) loads, and the callbacks.

Usage (ms-swift 4.6; docs/swift.md)::

    ELASTIC_MOE_SCHEDULE=6-10 swift sft    ... --plugin elastic_moe
    ELASTIC_MOE_SCHEDULE=6-10 megatron sft ... --plugin elastic_moe
    # the fallback, where the start-up hook is not installed (an editable checkout):
    ELASTIC_MOE_SCHEDULE=6-10 swift sft    ... --external_plugins "$(elastic-moe plugin-path)" --callbacks elastic_moe

``--plugin`` is this package's: :mod:`.plugin_flag` (a start-up hook installed with the wheel, and
by ``make setup`` into an editable checkout's venv) rewrites it into the second form in ms-swift's
entry processes. ms-swift has no ``--plugin`` flag; its hook is ``--external_plugins FILE``.
``swift sft`` and ``megatron sft`` re-launch a child process (or torchrun), and the child imports the
file on every rank in ``BaseArguments.__post_init__``, before any model is built (Megatron-SWIFT's
arguments inherit that). The plugin file calls :func:`install`, which

0. in a command that does not train (``swift infer``, ``export``, ``deploy``, ``eval``, ``app``,
   ``web-ui``, ...: every route but ``sft``, ``pt``, ``rlhf``) reads nothing and patches nothing: a
   checkpoint routes static top-k at inference, so nothing about κ is validated there;
1. reads :class:`ElasticConfig` from ``ELASTIC_MOE_*`` / ``ELASTIC_MOE_CONFIG`` (a swift YAML's
   ``ENV:`` block sets those in the launcher, and the child inherits them), checked against the model
   that ``--model`` names when its ``config.json`` is local (top-k, experts, layers; ``schedule``
   ``auto``, the default, is resolved from it). A bad value raises
   :class:`~elastic_moe_plugin.core.config.ConfigError` right there, and a model without a MoE router
   :class:`~elastic_moe_plugin.core.errors.NoMoERouterError`: the run exits non-zero at start-up, on
   every rank, with the plugin's message and before any training step;
2. patches the transformers routers (:mod:`elastic_moe_plugin.hf`) when transformers is
   importable, and Megatron-core (:mod:`elastic_moe_plugin.mcore`: ``TopKRouter`` plus the token
   dispatcher fixes) when ``megatron.core`` has already been imported. Megatron-SWIFT's argument
   module imports ``megatron.core`` before it loads plugins; ``swift sft`` (transformers) never
   imports it, and importing it there would cost start-up time and fail on machines where
   megatron-core is installed but cannot import (no triton / Transformer Engine);
3. registers the ``elastic_moe`` callback in swift's HF callback map
   (``swift.callbacks.mapping.callbacks_map``) and, when Megatron-SWIFT imports, in its separate
   ``swift.megatron.callbacks.mapping.megatron_callbacks_map``. ``--callbacks`` is a plain list of
   names looked up when the trainer is built, i.e. after the plugin ran. At the start of training
   the callback logs the plan and refuses a model in which no router is covered;
4. keeps its own file out of the ``args.json`` that ms-swift saves with the run and copies into
   every checkpoint (``BaseArguments.save_args``, wrapped): ms-swift replays ``external_plugins``
   from there in ``swift infer/export/deploy``, where the path into this environment would not
   resolve in an environment without the plugin. The record goes under the key
   ``elastic_moe_plugin`` instead (version, file, settings), which ms-swift does not read.

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


def install(config: ElasticConfig | None = None) -> ElasticConfig | None:
    """Validate the configuration, patch every framework in use, register the callbacks; in an
    ms-swift command that does not train, do nothing (module docstring).

    Logs one line on every rank (``[INFO:elastic_moe] rank R/W: plugin loaded ...``), so a
    multi-rank log shows that each rank loaded it.

    Returns:
        the config in use; None in a command that does not train.

    Raises:
        ConfigError: a bad ``ELASTIC_MOE_*`` setting, or one the model of ``--model`` refuses (the
            run stops before building a model). Its message is printed on its own first
            (:func:`_report_errors_first`).
        NoMoERouterError: ``--model``'s config declares no experts (a dense model).
    """
    from elastic_moe_plugin.core.config import ElasticConfig

    _ensure_log_handler()
    _report_errors_first()
    rank, world = os.environ.get("RANK", "0"), os.environ.get("WORLD_SIZE", "1")
    from elastic_moe_plugin.swift.entry import TRAINING_ROUTES

    entry = _swift_entry()
    if entry is not None and entry.route not in TRAINING_ROUTES:
        logger.info("rank %s/%s: plugin loaded in `%s %s`, which does not train: nothing patched, ELASTIC_MOE_* not "
                    "read (a checkpoint routes static top-k at inference)", rank, world,
                    "megatron" if entry.megatron else "swift", entry.route)
        return None
    peeked = _peek_model(sys.argv[1:]) if entry is not None and not entry.megatron else None
    model = peeked[1].shape if peeked is not None and peeked[1].covered else None
    config = ElasticConfig.from_env(model=model) if config is None else config
    if peeked is not None and config.enabled and not peeked[1].declares_experts:
        raise _no_moe_router(config, f"the model {peeked[0]} (model_type={peeked[1].model_type!r}) declares no experts "
                                     f"in its config.json")
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
    args_json = _args_json_patch()
    args_json.on()
    if args_json.is_on and _importable("swift.arguments"):
        patched.append("ms-swift's args.json (the plugin is not replayed at inference)")
    checked = f"; checked against {peeked[0]} ({model.describe()})" if model is not None else ""
    logger.info("rank %s/%s: plugin loaded (pid %d): %s%s; patched %s; callback %r registered in %s", rank, world,
                os.getpid(), config, checked, ", ".join(patched) or "nothing (no framework found)", CALLBACK_NAME,
                ", ".join(registered) or "nothing")
    return config


def _swift_entry():
    """The ms-swift entry script this process runs (:func:`.entry.swift_entry`), or None."""
    from elastic_moe_plugin.swift.entry import swift_entry

    return swift_entry(list(sys.argv), list(getattr(sys, "orig_argv", [])))


def _peek_model(arguments: list[str]):
    """``(path, ConfigRouters)`` of the local checkpoint folder ``--model`` names, or None (a hub id,
    no config.json): what its ``config.json`` says about the routers, before ms-swift builds it."""
    import json

    from elastic_moe_plugin.hf.families import config_routers
    from elastic_moe_plugin.swift.entry import argument_groups

    values = next((values for flag, values in reversed(argument_groups(arguments)) if flag == "--model"), None)
    if not values:
        return None
    config_file = os.path.join(values[0], "config.json")
    try:
        with open(config_file, encoding="utf-8") as handle:
            data = json.load(handle)
    except (OSError, ValueError):
        return None
    return (values[0], config_routers(data)) if isinstance(data, dict) else None


def _no_moe_router(config: ElasticConfig, what: str):
    from elastic_moe_plugin.core.errors import NoMoERouterError
    from elastic_moe_plugin.hf.families import family_names

    return NoMoERouterError(
        f"{what}: it has no mixture-of-experts router, so elastic routing would change nothing and the run would "
        f"train it plain. The plugin covers the transformers router families {family_names()} (docs/transformers.md) "
        f"and Megatron-core's TopKRouter. Train this model without --plugin elastic_moe, or use "
        f"{config.spell('enabled', False)} to keep the plugin loaded with every router stock.")


def require_covered_routers(model, config: ElasticConfig | None, framework: str, plans: dict) -> None:
    """Refuse to train ``model`` elastically when none of its routers is covered (``plans`` empty: a
    dense model, or a family the plugin does not cover), naming its type and the covered families.

    Raises:
        NoMoERouterError: an enabled config, and no covered router in ``model``.
    """
    if config is None or not config.enabled or plans:
        return
    inner = model[0] if isinstance(model, (list, tuple)) and model else model
    model_config = getattr(inner, "config", None)
    model_type = getattr(model_config, "model_type", None)
    described = f"{type(inner).__name__}" + (f" (model_type={model_type!r})" if model_type else "")
    raise _no_moe_router(config, f"the {framework} model {described} has no router the plugin covers")


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


def _report_errors_first() -> None:
    """Print a plugin error that ends the process on its own line before the traceback.

    ms-swift prints the traceback of whatever stops it, some 40 lines whose last one would be the
    plugin's message. ``sys.excepthook`` runs for the exception that ends the process (on every
    rank, torchrun workers included), so the message comes first, then the usual traceback: a
    :class:`ConfigError` as ``elastic-moe: configuration error: ...``, a model or framework the
    plugin cannot route (:class:`UnsupportedFrameworkError`) as ``elastic-moe: error: ...``."""
    if getattr(sys.excepthook, "__elastic_moe_hook__", False):
        return
    previous = sys.excepthook

    def excepthook(kind, error, traceback):
        from elastic_moe_plugin.core.errors import ConfigError, UnsupportedFrameworkError

        if os.environ.get("LOCAL_RANK", "0") == "0":
            if isinstance(error, ConfigError):
                sys.stderr.write(f"\nelastic-moe: configuration error: {error}\n\n")
            elif isinstance(error, UnsupportedFrameworkError):
                sys.stderr.write(f"\nelastic-moe: error: {error}\n\n")
            sys.stderr.flush()
        previous(kind, error, traceback)

    excepthook.__elastic_moe_hook__ = True
    sys.excepthook = excepthook


# ------------------------------------------------------------------------------ args.json
def _is_this_plugin_file(path: str) -> bool:
    """Whether ``path`` (as ms-swift holds it: relative to the working directory, or absolute) is the
    packaged plugin file: the same file (``patches/elastic_moe.py`` links to it) or a copy of it."""
    try:
        if os.path.realpath(path) == os.path.realpath(PLUGIN_FILE):
            return True
        return Path(path).read_bytes() == PLUGIN_FILE.read_bytes()
    except OSError:
        return False


def _save_args_without_replay(original):
    """``BaseArguments.save_args`` that writes ``args.json`` without this plugin's file in
    ``external_plugins`` (ms-swift would replay it in ``swift infer/export/deploy``, which need no
    plugin) and with the record under ``elastic_moe_plugin``; the arguments object is unchanged."""
    import functools

    @functools.wraps(original)
    def save_args(self, *args, **kwargs):
        plugins = getattr(self, "external_plugins", None)
        listed = [plugins] if isinstance(plugins, str) else list(plugins or [])
        ours = [path for path in listed if _is_this_plugin_file(path)]
        if not ours:
            return original(self, *args, **kwargs)
        from elastic_moe_plugin import __version__

        config = _active_config()
        self.external_plugins = [path for path in listed if path not in ours]
        self.elastic_moe_plugin = {
            "version": __version__,
            "external_plugins": [os.path.abspath(path) for path in ours],
            "config": None if config is None else config.to_dict(),
            "note": ("left out of external_plugins: a checkpoint routes static top-k at inference, so swift "
                     "infer/export/deploy need no plugin; pass --plugin elastic_moe again to train on elastically"),
        }
        try:
            return original(self, *args, **kwargs)
        finally:
            self.external_plugins = plugins
            del self.elastic_moe_plugin

    return save_args


def _install_args_json(patches) -> None:
    if not _importable("swift.arguments"):
        return
    try:
        from swift.arguments.base_args import base_args
    except ImportError:  # swift without its trainer stack
        return
    patches.wrap(base_args.BaseArguments, "save_args", _save_args_without_replay)


def _active_config():
    """The config the adapters run with in this process (None before install)."""
    for name in ("elastic_moe_plugin.hf", "elastic_moe_plugin.mcore"):
        module = sys.modules.get(name)
        if module is not None and module.active_config() is not None:
            return module.active_config()
    return None


_ARGS_JSON = None


def _args_json_patch():
    """The ``args.json`` patch (one per process), built on first use: ``core.patching`` imports torch,
    which the start-up hook must not pay for."""
    global _ARGS_JSON
    if _ARGS_JSON is None:
        from elastic_moe_plugin.core.patching import PatchSwitch

        _ARGS_JSON = PatchSwitch(_install_args_json)
    return _ARGS_JSON


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
        stages) of this rank count together, by global layer index. As Megatron-SWIFT's own MoE
        losses, a log holds the layer means (``elastic_moe/<name>``), and every layer's values
        too when the model's config sets ``moe_per_layer_logging``
        (``--megatron_extra_kwargs '{"moe_per_layer_logging": true}'``)."""

        # The model's routers, enumerated at the first log (a walk over every module) and kept: the
        # modules of a training run do not change; and whether it logs per layer.
        routers: Any = None
        per_layer = False

        def on_train_begin(self):
            from elastic_moe_plugin import mcore

            chunks = list(self.trainer.unwrapped_models)
            require_covered_routers(chunks, mcore.active_config(), "megatron-core", tracking.model_plans(chunks)[0])
            tracking.log_plan(chunks)

        def on_log(self, logs: dict[str, Any]):
            if not _is_training_log(logs):
                return
            if self.routers is None:
                self.routers = tracking.router_sites(list(self.trainer.unwrapped_models))
                self.per_layer = tracking.per_layer_logging(self.routers)
            logs.update(tracking.routing_metrics(self.routers, per_layer=self.per_layer))
            tracking.reset(self.routers)

    _MEGATRON_CALLBACK = ElasticMoeMegatronCallback
    return ElasticMoeMegatronCallback
