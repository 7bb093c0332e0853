"""What the plugin file does in an ms-swift process: :func:`install`.

ms-swift imports the plugin file on every rank in ``BaseArguments.__post_init__``, before any model
is built (Megatron-SWIFT's arguments inherit that), and the file calls :func:`install`, which

0. in a command that does not train (``swift infer``, ``export``, ``deploy``, ``eval``, ``app``,
   ``web-ui``, ...: every route but ``sft``, ``pt``, ``rlhf``) reads nothing and patches nothing: a
   checkpoint routes static top-k at inference, so nothing about κ is validated there;
1. reads :class:`ElasticConfig` from ``ELASTIC_MOE_*`` / ``ELASTIC_MOE_CONFIG`` (a swift YAML's
   ``ENV:`` block sets those in the launcher, and the child inherits them), checked against the model
   that ``--model`` names when its ``config.json`` is local (:mod:`.model_check`: top-k, experts,
   layers; ``schedule`` ``auto``, the default, is resolved from it). A bad value raises
   :class:`~elastic_moe_plugin.core.config.ConfigError` right there, and a model without a MoE router
   :class:`~elastic_moe_plugin.core.errors.NoMoERouterError`: the run exits non-zero at start-up, on
   every rank, with the plugin's message first (:mod:`.console`) and before any training step;
2. patches the transformers routers (:mod:`elastic_moe_plugin.hf`) when transformers is
   importable, and Megatron-core (:mod:`elastic_moe_plugin.mcore`: ``TopKRouter`` plus the token
   dispatcher fixes) when ``megatron.core`` has already been imported. Megatron-SWIFT's argument
   module imports ``megatron.core`` before it loads plugins; ``swift sft`` (transformers) never
   imports it, and importing it there would cost start-up time and fail on machines where
   megatron-core is installed but cannot import (no triton / Transformer Engine);
3. registers the ``elastic_moe`` callback (:mod:`.callbacks`);
4. keeps its own file out of the ``args.json`` that ms-swift saves with the run (:mod:`.saved_args`).

ms-swift imports plugin files under a hashed module name (``_swift_external_<sha256 of the path>``),
so the same code may run more than once per process (two paths, or the package's copy and the
checkout's); every step above is idempotent: one patch, one callback class per map.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import TYPE_CHECKING

from elastic_moe_plugin.swift.callbacks import register_callbacks
from elastic_moe_plugin.swift.console import ensure_log_handler, report_errors_first
from elastic_moe_plugin.swift.entry import TRAINING_ROUTES, importable, swift_entry
from elastic_moe_plugin.swift.model_check import no_moe_router, peek_model
from elastic_moe_plugin.swift.names import CALLBACK_NAME
from elastic_moe_plugin.swift.saved_args import args_json_patch

if TYPE_CHECKING:
    from elastic_moe_plugin.core.config import ElasticConfig

# The package's logger, not this module's: the name a user's logging configuration addresses.
logger = logging.getLogger("elastic_moe_plugin.swift")


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
            (:func:`~elastic_moe_plugin.swift.console.report_errors_first`).
        NoMoERouterError: ``--model``'s config declares no experts (a dense model).
    """
    from elastic_moe_plugin.core.config import ElasticConfig

    ensure_log_handler()
    report_errors_first()
    rank, world = os.environ.get("RANK", "0"), os.environ.get("WORLD_SIZE", "1")
    entry = _swift_entry()
    if entry is not None and entry.route not in TRAINING_ROUTES:
        logger.info(
            "rank %s/%s: plugin loaded in `%s %s`, which does not train: nothing patched, ELASTIC_MOE_* not "
            "read (a checkpoint routes static top-k at inference)",
            rank,
            world,
            "megatron" if entry.megatron else "swift",
            entry.route,
        )
        return None
    peeked = peek_model(sys.argv[1:]) if entry is not None and not entry.megatron else None
    model = peeked[1].shape if peeked is not None and peeked[1].covered else None
    config = ElasticConfig.from_env(model=model) if config is None else config
    if peeked is not None and config.enabled and not peeked[1].declares_experts:
        raise no_moe_router(
            config,
            f"the model {peeked[0]} (model_type={peeked[1].model_type!r}) declares no experts in its config.json",
        )
    patched = _patch_frameworks(config)
    registered = register_callbacks()
    args_json = args_json_patch()
    args_json.on()
    if args_json.is_on and importable("swift.arguments"):
        patched.append("ms-swift's args.json (the plugin is not replayed at inference)")
    checked = f"; checked against {peeked[0]} ({model.describe()})" if peeked is not None and model is not None else ""
    logger.info(
        "rank %s/%s: plugin loaded (pid %d): %s%s; patched %s; callback %r registered in %s",
        rank,
        world,
        os.getpid(),
        config,
        checked,
        ", ".join(patched) or "nothing (no framework found)",
        CALLBACK_NAME,
        ", ".join(registered) or "nothing",
    )
    return config


def _swift_entry():
    """The ms-swift entry script this process runs (:func:`.entry.swift_entry`), or None."""
    return swift_entry(list(sys.argv), list(getattr(sys, "orig_argv", [])))


def _patch_frameworks(config: ElasticConfig) -> list[str]:
    """Apply ``config`` to each framework this process uses; returns their names, in patch order."""
    patched = []
    if importable("transformers"):
        from elastic_moe_plugin import hf

        hf.apply(config)
        patched.append("transformers")
    if "megatron.core" in sys.modules:  # Megatron-SWIFT (or any Megatron script) imported it already
        from elastic_moe_plugin import mcore

        mcore.apply(config)
        patched.append("megatron-core")
    return patched


__all__ = ["install"]
